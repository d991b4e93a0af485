//! What `setup`'s own login, the streamer's login and the application accounts need, checked
//! before `setup` creates anything, each failure with the `GRANT` that fixes it.
//!
//! A login sees its own privileges in `information_schema` without any grant, so the checks
//! run as the login they are about: setup's from its session, the streamer's from a session of
//! its own. Only reading other accounts' hosts needs more (`SELECT` on `mysql.user`), and setup
//! can do without it.

use mysql_async::Conn;
use mysql_async::prelude::Queryable;

use crate::setup::{CheckFailure, ident, literal};

/// Privileges `setup` uses in the outbox database itself: CREATE/ALTER for the tables,
/// CREATE/ALTER ROUTINE for the enqueue procedure, SELECT/INSERT for the checkpoint rows.
const SETUP_USES: [&str; 6] = ["CREATE", "ALTER", "SELECT", "INSERT", "CREATE ROUTINE", "ALTER ROUTINE"];
/// Privileges `setup` grants to the streamer and the application accounts, so it must hold them
/// WITH GRANT OPTION.
const SETUP_GRANTS: [&str; 5] = ["SELECT", "INSERT", "UPDATE", "DELETE", "EXECUTE"];

/// A login's privileges on one database, from its own view of `information_schema`.
#[derive(Debug, Clone, Default)]
pub struct Privileges {
    /// `'user'@'host'` as `CURRENT_USER()` names the account the server matched.
    pub account: String,
    global: Vec<(String, bool)>,
    database: Vec<(String, bool)>,
}

impl Privileges {
    fn has(&self, privilege: &str) -> bool {
        self.global.iter().chain(&self.database).any(|(p, _)| p == privilege)
    }

    fn grantable(&self, privilege: &str) -> bool {
        self.global.iter().chain(&self.database).any(|(p, g)| p == privilege && *g)
    }

    fn has_global(&self, privilege: &str) -> bool {
        self.global.iter().any(|(p, _)| p == privilege)
    }
}

/// `user@host` as `CURRENT_USER()` returns it, quoted as an account: `'user'@'host'`.
fn account_of(current_user: &str) -> String {
    match current_user.rsplit_once('@') {
        Some((user, host)) => format!("{}@{}", literal(user), literal(host)),
        None => literal(current_user),
    }
}

/// Whether `name` matches a database pattern of a grant (`%` and `_` wildcards, `\` escapes).
fn db_pattern_matches(pattern: &str, name: &str) -> bool {
    fn go(p: &[char], n: &[char]) -> bool {
        match p.split_first() {
            None => n.is_empty(),
            Some(('%', rest)) => (0..=n.len()).any(|i| go(rest, &n[i..])),
            Some(('_', rest)) => !n.is_empty() && go(rest, &n[1..]),
            Some(('\\', rest)) if !rest.is_empty() => n.first() == rest.first() && go(&rest[1..], &n[1..]),
            Some((c, rest)) => n.first() == Some(c) && go(rest, &n[1..]),
        }
    }
    let p: Vec<char> = pattern.chars().collect();
    let n: Vec<char> = name.chars().collect();
    go(&p, &n)
}

/// The session's own privileges, global and on `database`, including its enabled roles'.
pub async fn own_privileges(conn: &mut Conn, database: &str) -> Result<Privileges, mysql_async::Error> {
    let current: String = conn.query_first("SELECT CURRENT_USER()").await?.unwrap_or_default();
    let account = account_of(&current);
    let mut grantees = vec![account.clone()];
    // MariaDB names a role as a grantee `'role'`; the table exists on MariaDB only.
    // With no role enabled, MariaDB returns one row with NULL.
    let roles: Vec<Option<String>> =
        conn.query("SELECT ROLE_NAME FROM information_schema.ENABLED_ROLES").await.unwrap_or_default();
    let roles: Vec<String> = roles.into_iter().flatten().collect();
    grantees.extend(roles.iter().flat_map(|r| [literal(r), format!("{}@''", literal(r))]));
    let marks = vec!["?"; grantees.len()].join(", ");
    let global: Vec<(String, String)> = conn
        .exec(
            format!(
                "SELECT PRIVILEGE_TYPE, IS_GRANTABLE FROM information_schema.USER_PRIVILEGES WHERE GRANTEE IN ({marks})"
            ),
            grantees.clone(),
        )
        .await?;
    let schema: Vec<(String, String, String)> = conn
        .exec(
            format!(
                "SELECT TABLE_SCHEMA, PRIVILEGE_TYPE, IS_GRANTABLE FROM information_schema.SCHEMA_PRIVILEGES WHERE GRANTEE IN ({marks})"
            ),
            grantees,
        )
        .await?;
    Ok(Privileges {
        account,
        global: global.into_iter().map(|(p, g)| (p, g == "YES")).collect(),
        database: schema
            .into_iter()
            .filter(|(db, _, _)| db_pattern_matches(db, database))
            .map(|(_, p, g)| (p, g == "YES"))
            .collect(),
    })
}

/// What setup's login lacks to create, and grant on, the objects of `database`; and whether it
/// may read the binlog position that seeds new checkpoints.
pub async fn check_admin(conn: &mut Conn, database: &str) -> Result<Vec<CheckFailure>, mysql_async::Error> {
    let own = own_privileges(conn, database).await?;
    let mut failures = Vec::new();
    let missing: Vec<&str> = SETUP_USES.iter().chain(&SETUP_GRANTS).copied().filter(|p| !own.has(p)).collect();
    let not_grantable: Vec<&str> = SETUP_GRANTS.iter().copied().filter(|p| !own.grantable(p)).collect();
    if !missing.is_empty() || !not_grantable.is_empty() {
        let mut all: Vec<&str> = SETUP_USES.to_vec();
        all.extend(SETUP_GRANTS.iter().filter(|p| !SETUP_USES.contains(p)));
        failures.push(CheckFailure {
            what: format!(
                "setup's login {} lacks {} on database {database:?}",
                own.account,
                [
                    (!missing.is_empty()).then(|| missing.join(", ")),
                    (!not_grantable.is_empty()).then(|| format!(
                        "GRANT OPTION for {} (setup grants them to the streamer and the application)",
                        not_grantable.join(", ")
                    )),
                ]
                .into_iter()
                .flatten()
                .collect::<Vec<_>>()
                .join("; and ")
            ),
            fix: format!("GRANT {} ON {}.* TO {} WITH GRANT OPTION;", all.join(", "), ident(database), own.account),
        });
    }
    // New checkpoints start at the server's current binlog position.
    if let Err(e) = crate::setup::binlog_end(conn).await {
        if !matches!(&e, mysql_async::Error::Server(s) if s.code == 1227 || s.code == 1142) {
            return Err(e);
        }
        failures.push(CheckFailure {
            what: format!(
                "setup's login {} may not read the binlog position (SHOW MASTER STATUS), which new checkpoints start at (on MySQL, grant REPLICATION CLIENT)",
                own.account
            ),
            fix: format!("GRANT BINLOG MONITOR ON *.* TO {};", own.account),
        });
    }
    Ok(failures)
}

/// What the streamer's login lacks to read the binlog, from its own session.
pub async fn check_streamer(conn: &mut Conn, database: &str) -> Result<Vec<CheckFailure>, mysql_async::Error> {
    let own = own_privileges(conn, database).await?;
    let has = |p: &str| own.has_global(p) || own.has_global("SUPER") && p != "REPLICATION SLAVE";
    if own.has_global("REPLICATION SLAVE") && (has("REPLICATION CLIENT") || has("BINLOG MONITOR")) {
        return Ok(Vec::new());
    }
    let held: Vec<&str> = own.global.iter().map(|(p, _)| p.as_str()).collect();
    Ok(vec![CheckFailure {
        what: format!(
            "the streamer's login {} lacks REPLICATION SLAVE or BINLOG MONITOR (REPLICATION CLIENT) (it has: {})",
            own.account,
            if held.is_empty() { "USAGE only".to_string() } else { held.join(", ") }
        ),
        fix: format!("GRANT REPLICATION SLAVE, BINLOG MONITOR ON *.* TO {};", own.account),
    }])
}

/// The hosts of `user`'s accounts from `mysql.user`, or None when setup's login may not read
/// it (then the caller grants to the account the streamer's own session matched).
pub async fn account_hosts(conn: &mut Conn, user: &str) -> Result<Option<Vec<String>>, mysql_async::Error> {
    match conn.exec("SELECT Host FROM mysql.user WHERE User = ?", (user,)).await {
        Ok(hosts) => Ok(Some(hosts)),
        Err(mysql_async::Error::Server(s)) if s.code == 1142 || s.code == 1044 => Ok(None),
        Err(e) => Err(e),
    }
}

/// Grantees for an application account given as `name` (a role, or `'name'@'%'`) or
/// `name@host`: quoted as GRANT takes them.
pub fn app_grantee(given: &str) -> String {
    match given.rsplit_once('@') {
        Some((user, host)) => format!("{}@{}", literal(user.trim_matches('\'')), literal(host.trim_matches('\''))),
        None => literal(given),
    }
}

/// Application accounts (quoted grantees) that do not exist, as failures. Probed with a grant
/// of nothing (`USAGE` on the database), which the server refuses for an unknown account and
/// which changes nothing for a known one — setup's login may not read `mysql.user`.
pub async fn check_app_accounts(
    conn: &mut Conn,
    database: &str,
    grantees: &[String],
) -> Result<Vec<CheckFailure>, mysql_async::Error> {
    let mut failures = Vec::new();
    for grantee in grantees {
        match conn.query_drop(format!("GRANT USAGE ON {}.* TO {grantee}", ident(database))).await {
            Ok(()) => {}
            Err(mysql_async::Error::Server(s)) if s.code == 1133 => failures.push(CheckFailure {
                what: format!("the application account {grantee} given with --app-role does not exist"),
                fix: format!(
                    "CREATE USER {} IDENTIFIED BY '…'; or pass an existing account as name@host, or a role",
                    if grantee.contains('@') { grantee.clone() } else { format!("{grantee}@'%'") }
                ),
            }),
            Err(e) => return Err(e),
        }
    }
    Ok(failures)
}

/// The accounts that may INSERT into `table` according to `mysql.tables_priv`, as grantees;
/// None when setup's login may not read it.
pub async fn insert_grantees(
    conn: &mut Conn,
    database: &str,
    table: &str,
    except: &[String],
) -> Result<Option<Vec<String>>, mysql_async::Error> {
    let rows: Vec<(String, String)> = match conn
        .exec(
            "SELECT User, Host FROM mysql.tables_priv WHERE Db = ? AND Table_name = ? AND FIND_IN_SET('Insert', Table_priv)",
            (database, table),
        )
        .await
    {
        Ok(rows) => rows,
        Err(mysql_async::Error::Server(s)) if s.code == 1142 || s.code == 1044 => return Ok(None),
        Err(e) => return Err(e),
    };
    Ok(Some(
        rows.into_iter()
            .filter(|(user, _)| !except.contains(user))
            .map(
                |(user, host)| {
                    if host.is_empty() { literal(&user) } else { format!("{}@{}", literal(&user), literal(&host)) }
                },
            )
            .collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_and_accounts() {
        assert!(db_pattern_matches("app", "app"));
        assert!(db_pattern_matches("app%", "app_2"));
        assert!(db_pattern_matches("a_p", "app"));
        assert!(!db_pattern_matches("a\\_p", "app"));
        assert!(db_pattern_matches("a\\_p", "a_p"));
        assert!(!db_pattern_matches("app", "apps"));
        assert_eq!(account_of("owner@10.%"), "'owner'@'10.%'");
        assert_eq!(app_grantee("orders_app"), "'orders_app'");
        assert_eq!(app_grantee("orders_app@10.%"), "'orders_app'@'10.%'");
    }
}
