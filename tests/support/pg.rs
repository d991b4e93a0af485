//! A fresh PostgreSQL database per test, with the documented least-privilege streamer role.

use tokio_postgres::{Client, NoTls};

use super::{env, unique};

/// One test's database: an admin session and the streamer role's URL. Dropping it drops
/// the database, its slots and its role in the background (see [`drop_database`]), so a
/// test run's disk use stays that of the tests running, not of every test that ran.
pub(crate) struct PgDb {
    pub admin_url: String,
    pub streamer_url: String,
    pub admin: Client,
    name: String,
}

impl Drop for PgDb {
    fn drop(&mut self) {
        let name = std::mem::take(&mut self.name);
        super::in_the_background(async move { drop_database(&env("OUTBOX_PG_URL"), &name, 60).await });
    }
}

fn with_database(url: &str, db: &str) -> String {
    let (base, _) = url.rsplit_once('/').expect("OUTBOX_PG_URL ends with /database");
    format!("{base}/{db}")
}

pub(crate) async fn connect(url: &str) -> Client {
    let (client, conn) = tokio_postgres::connect(url, NoTls)
        .await
        .unwrap_or_else(|e| panic!("connecting to PostgreSQL: {e}; {}", super::HOW_TO_START));
    tokio::spawn(async move {
        let _ = conn.await;
    });
    client
}

/// Creates a database and a streamer role (LOGIN REPLICATION, nothing else; `setup` grants
/// it SELECT and DELETE on the outbox tables). Slots and databases left behind by earlier
/// test processes are dropped first so they cannot pin WAL or fill the disk.
pub(crate) async fn fresh_db() -> PgDb {
    let root_url = env("OUTBOX_PG_URL");
    let root = connect(&root_url).await;
    drop_stale_once(&root).await;
    let name = unique("t");
    root.batch_execute(&format!("CREATE DATABASE {name}")).await.expect("create database");
    let role = format!("{name}_streamer");
    let password = format!("pw-{}", unique("x"));
    root.batch_execute(&format!("CREATE ROLE {role} LOGIN REPLICATION PASSWORD '{password}'"))
        .await
        .expect("create role");
    root.batch_execute(&format!("GRANT CONNECT ON DATABASE {name} TO {role}")).await.expect("grant connect");
    let admin_url = with_database(&root_url, &name);
    let admin = connect(&admin_url).await;
    let host = root_url.split('@').nth(1).expect("OUTBOX_PG_URL has user@host");
    let (hostport, _) = host.rsplit_once('/').expect("host/db");
    let streamer_url = format!("postgres://{role}:{password}@{hostport}/{name}");
    PgDb { admin_url, streamer_url, admin, name }
}

/// Drops test database `name`, its slots, its prepared transactions and its streamer role:
/// ends its sessions (walsenders included, so its slots go inactive), rolls back what it
/// prepared, then `DROP DATABASE … WITH (FORCE)`, which drops the inactive slots too. Makes
/// up to `attempts` half a second apart (a killed streamer's walsender may linger, a test may
/// be restarting the server); a database left behind is dropped by the next test process
/// ([`drop_stale_once`]).
async fn drop_database(root_url: &str, name: &str, attempts: u32) {
    super::retry_paced(attempts, std::time::Duration::from_millis(500), || async {
        let Ok((root, conn)) = tokio_postgres::connect(root_url, NoTls).await else { return false };
        tokio::spawn(conn);
        let _ = root
            .execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
                &[&name],
            )
            .await;
        if let Ok(rows) = root.query("SELECT gid FROM pg_prepared_xacts WHERE database = $1", &[&name]).await
            && !rows.is_empty()
        {
            let gids: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
            roll_back_prepared(&with_database(root_url, name), &gids).await;
        }
        if root.batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).await.is_err() {
            return false;
        }
        let _ = root.batch_execute(&format!("DROP ROLE IF EXISTS {name}_streamer")).await;
        true
    })
    .await;
}

/// Slots of earlier test processes' databases pin WAL forever, and their databases take
/// disk: drop them once per process.
/// Only a test process that has ended leaves stale slots: a database is `t_<pid>_<n>`, and
/// the slots of a process still running (another test run on the same services, whose halted
/// stream has let go of its slot for a moment) are its own. Each drop tolerates a slot that
/// vanished or became active meanwhile.
async fn drop_stale_once(root: &Client) {
    static DONE: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    DONE.get_or_init(|| async {
        let stale = root
            .query(
                "SELECT slot_name, database FROM pg_replication_slots WHERE NOT active AND database LIKE 't\\_%'",
                &[],
            )
            .await
            .expect("listing stale test slots");
        for row in stale {
            let (slot, db): (String, String) = (row.get(0), row.get(1));
            if of_an_ended_process(&db) {
                let _ = root.execute("SELECT pg_drop_replication_slot($1)", &[&slot]).await;
            }
        }
        // A prepared transaction left by a failed test makes every new logical slot wait for it.
        let prepared = root
            .query("SELECT gid, database FROM pg_prepared_xacts WHERE database LIKE 't\\_%'", &[])
            .await
            .expect("listing stale prepared transactions");
        for row in prepared {
            let (gid, db): (String, String) = (row.get(0), row.get(1));
            if of_an_ended_process(&db) {
                roll_back_prepared(&with_database(&env("OUTBOX_PG_URL"), &db), &[gid]).await;
            }
        }
        // Databases of ended processes (killed before their drops ran) only take disk.
        let databases = root
            .query("SELECT datname FROM pg_database WHERE datname LIKE 't\\_%'", &[])
            .await
            .expect("listing test databases");
        for row in databases {
            let db: String = row.get(0);
            if of_an_ended_process(&db) {
                drop_database(&env("OUTBOX_PG_URL"), &db, 1).await;
            }
        }
    })
    .await;
}

/// Whether test database `t_<pid>_<n>` belongs to a process that is no longer running.
fn of_an_ended_process(database: &str) -> bool {
    let pid = database.strip_prefix("t_").and_then(|rest| rest.split('_').next()).and_then(|p| p.parse::<u32>().ok());
    match pid {
        Some(pid) => pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        None => false,
    }
}

/// Rolls back two-phase transactions of one database (gone already: fine).
pub(crate) async fn roll_back_prepared(url: &str, gids: &[String]) {
    let client = connect(url).await;
    for gid in gids {
        let _ = client.batch_execute(&format!("ROLLBACK PREPARED '{gid}'")).await;
    }
}

impl PgDb {
    pub(crate) async fn count(&self, table: &str) -> i64 {
        self.admin.query_one(&format!("SELECT count(*) FROM {table}"), &[]).await.expect("count").get(0)
    }
}
