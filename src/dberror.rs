//! Database errors, classified once: retry, wait for the slot, or halt with the fix.
//!
//! Every failed call to PostgreSQL or MySQL/MariaDB ends here through [`Classify`] — the SQL
//! sessions ([`crate::source::within`], [`Error::from_db`]) and the replication stream
//! alike — and the server's code decides, in the two tables [`POSTGRES`] and [`MYSQL`]:
//!
//! * **transient**: the connection or the server's state (refused, reset, timed out, server
//!   shutting down 57P01–57P03, serialization failure and deadlock 40001/40P01, 08xxx, too many
//!   connections): a new session retries with backoff. So is any code the tables do not name.
//! * **busy**: another session reads the slot (55006): wait for it, with a growing interval.
//! * **definite**: nothing changes by retrying — a refused password (28P01, 1045), a missing
//!   grant (42501, 1142, …), another database's slot (55000), a missing table: the
//!   shard-partition halts once with the server's own message and the fix.
//!
//! A fix names the exact statement or setting, so it needs to know whose stream failed: the
//! runner sets a [`Scope`] for each shard-partition's task ([`in_scope`]); outside one, fixes
//! name the objects generically.
//!
//! The server's message and hint are kept; its *detail* is dropped for data and constraint
//! errors (SQLSTATE classes 22 and 23), which may quote row values.

use std::fmt;
use std::future::Future;

use outbox_mysql::mysql_async::Error as MyError;

use crate::error::Error;

/// A server's error code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Code {
    /// PostgreSQL's five-character SQLSTATE.
    SqlState(String),
    /// MySQL/MariaDB's server error number.
    MySql(u16),
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Code::SqlState(s) => write!(f, "SQLSTATE {s}"),
            Code::MySql(n) => write!(f, "error {n}"),
        }
    }
}

/// What the server answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ServerError {
    pub code: Code,
    pub message: String,
    pub detail: Option<String>,
    pub hint: Option<String>,
}

impl ServerError {
    /// The message with hint and (safe) detail, and the code: one line for a log.
    pub(crate) fn describe(&self) -> String {
        let mut text = self.message.clone();
        let data_error = matches!(&self.code, Code::SqlState(s) if s.starts_with("22") || s.starts_with("23"));
        if let Some(detail) = self.detail.as_deref().filter(|_| !data_error) {
            text.push_str(&format!("; {detail}"));
        }
        if let Some(hint) = &self.hint {
            text.push_str(&format!("; hint: {hint}"));
        }
        format!("{text} ({})", self.code)
    }
}

/// A failed database call, as the classifier sees it.
pub(crate) trait Classify {
    /// The server this error type comes from (for generic fixes outside a stream's task).
    const BACKEND: Backend;

    /// The server's own error, when a server answered (`None` for I/O, TLS, a closed
    /// connection, a driver error).
    fn server_error(&self) -> Option<ServerError>;

    /// The error in one line, for errors no server sent.
    fn text(&self) -> String;
}

/// Which connection failed: a 42501 on the replication connection is the missing
/// REPLICATION attribute, on the SQL session a missing grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Channel {
    Sql,
    Replication,
}

/// What a server code means for a shard-partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Class {
    Transient,
    Busy,
    Definite(Remedy),
}

/// What an operator must change; rendered with the failing stream's [`Scope`] by [`Remedy::fix`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Remedy {
    /// The password was refused.
    Password,
    /// The login is not admitted at all (pg_hba.conf, NOLOGIN, a host the user may not use).
    Admission,
    /// A grant on the outbox or checkpoint table is missing.
    Privilege,
    /// The replication privilege (PostgreSQL REPLICATION, MySQL REPLICATION SLAVE/CLIENT).
    Replication,
    /// A table, column or function `setup` creates is missing.
    Schema,
    /// The URL's database does not exist.
    Database,
    /// The slot's name belongs to another database of the cluster.
    SlotElsewhere,
    /// The server is not in the state logical decoding needs (wal_level, a standby, …).
    Prerequisite,
    /// A server limit (max_replication_slots, max_wal_senders, …).
    Limit,
    /// The server insists on TLS for this login.
    Tls,
    /// MySQL blocked the client host after too many failed connections.
    HostBlocked,
    /// The streamer's own statement does not fit the server or the table.
    Unexpected,
}

use Class::{Busy, Definite, Transient};

/// PostgreSQL: by exact SQLSTATE or by its two-character class; the first match wins, codes
/// not listed are transient.
pub(crate) const POSTGRES: &[(&str, Class)] = &[
    ("55006", Busy),                           // object_in_use: the slot is read by another session
    ("57P01", Transient),                      // admin_shutdown
    ("57P02", Transient),                      // crash_shutdown
    ("57P03", Transient),                      // cannot_connect_now (starting up)
    ("57014", Transient),                      // query_canceled
    ("40001", Transient),                      // serialization_failure
    ("40P01", Transient),                      // deadlock_detected
    ("55P03", Transient),                      // lock_not_available
    ("53400", Definite(Remedy::Limit)),        // configuration_limit_exceeded (all slots in use)
    ("28P01", Definite(Remedy::Password)),     // invalid_password
    ("28", Definite(Remedy::Admission)),       // no pg_hba.conf entry, role cannot log in
    ("42501", Definite(Remedy::Privilege)),    // insufficient_privilege
    ("42P01", Definite(Remedy::Schema)),       // undefined_table
    ("42703", Definite(Remedy::Schema)),       // undefined_column
    ("42883", Definite(Remedy::Schema)),       // undefined_function
    ("42704", Definite(Remedy::Schema)),       // undefined_object (a dropped publication)
    ("3D000", Definite(Remedy::Database)),     // invalid_catalog_name
    ("55000", Definite(Remedy::Prerequisite)), // object_not_in_prerequisite_state
    ("0A000", Definite(Remedy::Unexpected)),   // feature_not_supported
    ("22", Definite(Remedy::Unexpected)),      // data exceptions
    ("23", Definite(Remedy::Unexpected)),      // integrity constraint violations
    ("42", Definite(Remedy::Unexpected)),      // syntax errors and access rule violations
    ("08", Transient),                         // connection exceptions
    ("53", Transient),                         // insufficient resources (disk, memory, connections)
    ("57", Transient),                         // operator intervention
    ("58", Transient),                         // system errors (I/O)
];

/// MySQL/MariaDB server error numbers; numbers not listed are transient (lost connection,
/// 1040 too many connections, 1053 shutdown, 1205 lock wait timeout, 1213 deadlock, …).
pub(crate) const MYSQL: &[(u16, Class)] = &[
    (1044, Definite(Remedy::Privilege)),   // ER_DBACCESS_DENIED_ERROR
    (1045, Definite(Remedy::Password)),    // ER_ACCESS_DENIED_ERROR
    (1049, Definite(Remedy::Database)),    // ER_BAD_DB_ERROR
    (1054, Definite(Remedy::Schema)),      // ER_BAD_FIELD_ERROR
    (1129, Definite(Remedy::HostBlocked)), // ER_HOST_IS_BLOCKED
    (1130, Definite(Remedy::Admission)),   // ER_HOST_NOT_PRIVILEGED
    (1142, Definite(Remedy::Privilege)),   // ER_TABLEACCESS_DENIED_ERROR
    (1143, Definite(Remedy::Privilege)),   // ER_COLUMNACCESS_DENIED_ERROR
    (1146, Definite(Remedy::Schema)),      // ER_NO_SUCH_TABLE
    (1227, Definite(Remedy::Replication)), // ER_SPECIFIC_ACCESS_DENIED_ERROR
    (1251, Definite(Remedy::Admission)),   // ER_NOT_SUPPORTED_AUTH_MODE
    (1370, Definite(Remedy::Privilege)),   // ER_PROCACCESS_DENIED_ERROR
    (1698, Definite(Remedy::Password)),    // ER_ACCESS_DENIED_NO_PASSWORD_ERROR
    (3159, Definite(Remedy::Tls)),         // ER_SECURE_TRANSPORT_REQUIRED
];

/// The class of a server error answered on `channel`.
pub(crate) fn class_of(error: &ServerError, channel: Channel) -> Class {
    let class = match &error.code {
        Code::SqlState(state) => POSTGRES
            .iter()
            .find(|(code, _)| state == code || (code.len() == 2 && state.starts_with(code)))
            .map_or(Transient, |(_, class)| *class),
        Code::MySql(number) => MYSQL.iter().find(|(code, _)| code == number).map_or(Transient, |(_, class)| *class),
    };
    match class {
        Definite(Remedy::Privilege) if channel == Channel::Replication => Definite(Remedy::Replication),
        // 55000 covers several states; the slot's is the one an operator meets most.
        Definite(Remedy::Prerequisite) if error.message.contains("was not created in this database") => {
            Definite(Remedy::SlotElsewhere)
        }
        other => other,
    }
}

/// Whose stream failed: what a fix needs to name the exact statement or setting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Scope {
    /// The `[[source]]`'s name.
    pub source: String,
    pub backend: Backend,
    /// The streamer's login (PostgreSQL role, MySQL user).
    pub login: String,
    pub database: String,
    pub table_prefix: String,
    /// The shard-partition's table.
    pub table: String,
    pub checkpoint_table: String,
    /// Where the password comes from, as the config says it.
    pub password_from: String,
}

/// Which server a [`Scope`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Backend {
    Postgres,
    MySql,
}

impl Scope {
    /// The scope of the shard-partition whose table is `table`, streamed as `login`.
    pub(crate) fn of_stream(
        source: &crate::config::SourceConfig,
        backend: Backend,
        login: &str,
        database: &str,
        table: &str,
    ) -> Self {
        let password_from = match (&source.password_env, &source.password_file) {
            (Some(var), _) => format!("password_env = {var:?} (that environment variable)"),
            (None, Some(path)) => format!("password_file = {:?}", path.display().to_string()),
            (None, None) => "its url".into(),
        };
        Self {
            source: source.name.clone(),
            backend,
            login: login.into(),
            database: database.into(),
            table_prefix: source.table_prefix.clone(),
            table: table.into(),
            checkpoint_table: crate::names::checkpoint_table(&source.table_prefix),
            password_from,
        }
    }

    /// The scope outside a shard-partition's task: objects named generically.
    fn unknown(backend: Backend) -> Self {
        Self {
            source: "<source>".into(),
            backend,
            login: "<the streamer's login>".into(),
            database: "<database>".into(),
            table_prefix: "<table_prefix>".into(),
            table: "<outbox table>".into(),
            checkpoint_table: "<table_prefix>_checkpoint".into(),
            password_from: "password_env, password_file or the URL".into(),
        }
    }
}

tokio::task_local! {
    static SCOPE: Scope;
}

/// Runs `task` with `scope` for the fixes of the database errors it classifies.
pub(crate) fn in_scope<F: Future>(scope: Scope, task: F) -> impl Future<Output = F::Output> {
    SCOPE.scope(scope, task)
}

/// `task` with the caller's scope, if it has one: for a task spawned from a shard-partition's
/// task (a task-local does not cross `tokio::spawn` by itself).
pub(crate) fn with_current_scope<F: Future>(task: F) -> impl Future<Output = F::Output> {
    let scope = SCOPE.try_with(Scope::clone).ok();
    async move {
        match scope {
            Some(scope) => SCOPE.scope(scope, task).await,
            None => task.await,
        }
    }
}

fn current_scope(backend: Backend) -> Scope {
    SCOPE.try_with(Scope::clone).unwrap_or_else(|_| Scope::unknown(backend))
}

fn pg_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

fn my_ident(name: &str) -> String {
    format!("`{}`", name.replace('`', "``"))
}

/// The fix when the default slot names are another database's: a `slot_prefix` of its own.
/// `setup` and `run` say the same.
pub(crate) fn slot_prefix_fix(source: &str, table_prefix: &str, database: &str) -> String {
    let suggested = crate::names::suggested_slot_prefix(table_prefix, database);
    format!(
        "give this database its own slots: set slot_prefix = {suggested:?} in the [[source]] named {source:?} (its slots become {suggested}_<shard>_<partition>), run `outbox-streamer setup`, then restart; never drop or reuse the other database's slot"
    )
}

/// A slot of the stream's name exists, but in `database` (empty: a physical slot): it is not
/// this database's and is never read, dropped or taken over.
pub(crate) fn slot_elsewhere(slot: &str, database: &str) -> Error {
    let message = if database.is_empty() {
        format!("replication slot {slot:?} is a physical slot, not this database's logical slot")
    } else {
        format!(
            "replication slot {slot:?} belongs to database {database:?}, not to this one (slot names are cluster-wide)"
        )
    };
    Error::definite(message, Remedy::SlotElsewhere.fix(&current_scope(Backend::Postgres)))
}

impl Remedy {
    /// What to run or change, with the objects of `scope`.
    pub(crate) fn fix(self, s: &Scope) -> String {
        let pg = s.backend == Backend::Postgres;
        let setup = "or run `outbox-streamer setup --admin-url …` as the tables' owner, which grants them";
        match self {
            Remedy::Password => format!(
                "the server refused the password of {:?}: correct the password the [[source]] named {:?} takes from {}{}, then restart",
                s.login,
                s.source,
                s.password_from,
                if pg { "" } else { " (a user created REQUIRE SSL also needs a [source.tls] table)" }
            ),
            Remedy::Admission if pg => format!(
                "let role {0} log in to database {1} from this host: ALTER ROLE {0} LOGIN, and a pg_hba.conf line such as `host {2} {3} <client address> scram-sha-256` (see docs/configure-postgres.md), then restart",
                pg_ident(&s.login),
                pg_ident(&s.database),
                s.database,
                s.login
            ),
            Remedy::Admission => format!(
                "let user {:?} log in from this host with a supported authentication plugin (CREATE USER '{}'@'<client host>' …, see docs/configure-mysql.md), then restart",
                s.login, s.login
            ),
            Remedy::Privilege if pg => format!(
                "GRANT SELECT, DELETE ON {table} TO {role}; GRANT SELECT, UPDATE ON {checkpoint} TO {role} ({setup}), then restart",
                table = pg_ident(&s.table),
                checkpoint = pg_ident(&s.checkpoint_table),
                role = pg_ident(&s.login),
            ),
            Remedy::Privilege => format!(
                "GRANT SELECT, DELETE ON {db}.{table} TO '{user}'@'<host>'; GRANT SELECT, INSERT, UPDATE ON {db}.{checkpoint} TO '{user}'@'<host>' with the host of the user's account ({setup} for every host of the user), then restart",
                db = my_ident(&s.database),
                table = my_ident(&s.table),
                checkpoint = my_ident(&s.checkpoint_table),
                user = s.login,
            ),
            Remedy::Replication if pg => format!(
                "ALTER ROLE {} REPLICATION (logical replication needs it; see docs/configure-postgres.md), then restart",
                pg_ident(&s.login)
            ),
            Remedy::Replication => format!(
                "GRANT REPLICATION SLAVE, REPLICATION CLIENT ON *.* TO '{}'@'<host>' (MariaDB 10.5+: BINLOG MONITOR may replace REPLICATION CLIENT), then restart",
                s.login
            ),
            Remedy::Schema => format!(
                "run `outbox-streamer setup` for the [[source]] named {:?}: it creates the tables, columns and functions the streamer uses; then restart",
                s.source
            ),
            Remedy::Database => format!(
                "database {:?} does not exist on the server: correct the database in the url of the [[source]] named {:?}, then restart",
                s.database, s.source
            ),
            Remedy::SlotElsewhere => slot_prefix_fix(&s.source, &s.table_prefix, &s.database),
            Remedy::Prerequisite => "the server is not in the state logical replication needs, as its message says (for example wal_level = logical, or a primary rather than a standby); change that, then restart".into(),
            Remedy::Limit => "raise the server limit its message names (max_replication_slots, max_wal_senders, …) or free what uses it, then restart".into(),
            Remedy::Tls => format!(
                "the server requires TLS for this login: add a [source.tls] table to the [[source]] named {:?} (see docs/configuration.md), then restart",
                s.source
            ),
            Remedy::HostBlocked => "unblock this host on the server (FLUSH HOSTS, or mariadb-admin flush-hosts) and look at why its connections failed (max_connect_errors), then restart".into(),
            Remedy::Unexpected => "compare the tables with `outbox-streamer setup --dry-run` and run setup if they differ; if they match, report this with the server version".into(),
        }
    }
}

/// The error for a failed call `what` on `channel`, with the current task's scope; `e` is
/// kept as its source.
pub(crate) fn classify<E>(what: &str, e: E, channel: Channel) -> Error
where
    E: Classify + std::error::Error + Send + Sync + 'static,
{
    let error = match e.server_error() {
        Some(server) => decide(what, &server, channel, &current_scope(E::BACKEND)),
        None => Error::transient(format!("{what}: {}", e.text())),
    };
    error.with_source(e)
}

/// The pure decision: a server error of call `what`, for the stream `scope`.
pub(crate) fn decide(what: &str, server: &ServerError, channel: Channel, scope: &Scope) -> Error {
    let text = format!("{what}: {}", server.describe());
    match class_of(server, channel) {
        Transient => Error::transient(text),
        Busy => Error::busy(format!("{text}: the slot is in use by another session")),
        Definite(remedy) => Error::definite(text, remedy.fix(scope)),
    }
}

impl Classify for tokio_postgres::Error {
    const BACKEND: Backend = Backend::Postgres;

    fn server_error(&self) -> Option<ServerError> {
        let db = self.as_db_error()?;
        Some(ServerError {
            code: Code::SqlState(db.code().code().to_string()),
            message: db.message().to_string(),
            detail: db.detail().map(str::to_string),
            hint: db.hint().map(str::to_string),
        })
    }

    fn text(&self) -> String {
        // tokio_postgres's own Display hides the cause ("error connecting to server").
        match std::error::Error::source(self) {
            Some(cause) => format!("{self}: {cause}"),
            None => self.to_string(),
        }
    }
}

impl Classify for outbox_postgres::connect::ConnectError {
    const BACKEND: Backend = Backend::Postgres;

    fn server_error(&self) -> Option<ServerError> {
        self.error.server_error()
    }

    fn text(&self) -> String {
        self.to_string()
    }
}

/// pgwire-replication reports a server error as text: `message (SQLSTATE xxxxx)`.
fn parse_wire_server_error(text: &str) -> ServerError {
    match outbox_postgres::stream::split_sqlstate(text) {
        Some((code, message)) => {
            ServerError { code: Code::SqlState(code.into()), message: message.into(), detail: None, hint: None }
        }
        None => ServerError { code: Code::SqlState("XX000".into()), message: text.into(), detail: None, hint: None },
    }
}

impl Classify for outbox_postgres::stream::StreamError {
    const BACKEND: Backend = Backend::Postgres;

    fn server_error(&self) -> Option<ServerError> {
        if let Some(text) = self.server_text() {
            return Some(parse_wire_server_error(text));
        }
        // The client gave up on authentication (no common method, a SCRAM failure).
        self.auth_text().map(|text| ServerError {
            code: Code::SqlState("28000".into()),
            message: text.to_string(),
            detail: None,
            hint: None,
        })
    }

    fn text(&self) -> String {
        self.to_string()
    }
}

impl Classify for MyError {
    const BACKEND: Backend = Backend::MySql;

    fn server_error(&self) -> Option<ServerError> {
        match self {
            MyError::Server(s) => {
                Some(ServerError { code: Code::MySql(s.code), message: s.message.clone(), detail: None, hint: None })
            }
            _ => None,
        }
    }

    fn text(&self) -> String {
        crate::db::mysql::connect::mysql_connect_message(self)
    }
}

impl Classify for outbox_mysql::binlog::BinlogError {
    const BACKEND: Backend = Backend::MySql;

    fn server_error(&self) -> Option<ServerError> {
        match self {
            outbox_mysql::binlog::BinlogError::Connection(e) => e.server_error(),
            _ => None,
        }
    }

    fn text(&self) -> String {
        self.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Kind;

    fn pg(code: &str, message: &str) -> ServerError {
        ServerError { code: Code::SqlState(code.into()), message: message.into(), detail: None, hint: None }
    }

    fn my(code: u16, message: &str) -> ServerError {
        ServerError { code: Code::MySql(code), message: message.into(), detail: None, hint: None }
    }

    #[tokio::test]
    async fn a_spawned_task_keeps_the_scope_it_was_given() {
        let spawned = in_scope(scope(Backend::Postgres), async {
            tokio::spawn(with_current_scope(async { current_scope(Backend::Postgres).table })).await.unwrap()
        });
        assert_eq!(spawned.await, "outbox_0_1", "the fix names the stream's table, not a placeholder");
        let outside = tokio::spawn(with_current_scope(async { current_scope(Backend::Postgres).table }));
        assert_eq!(outside.await.unwrap(), "<outbox table>");
    }

    fn scope(backend: Backend) -> Scope {
        Scope {
            source: "app".into(),
            backend,
            login: "outbox_streamer".into(),
            database: "billing".into(),
            table_prefix: "outbox".into(),
            table: "outbox_0_1".into(),
            checkpoint_table: "outbox_checkpoint".into(),
            password_from: "password_env = \"OUTBOX_PW\"".into(),
        }
    }

    #[test]
    fn connection_and_server_state_codes_are_transient() {
        for code in ["57P01", "57P02", "57P03", "57014", "40001", "40P01", "55P03", "08006", "08001", "53300", "XX000"]
        {
            assert_eq!(class_of(&pg(code, "x"), Channel::Sql), Transient, "{code}");
        }
        for code in [1040, 1053, 1205, 1213, 1927, 2013] {
            assert_eq!(class_of(&my(code, "x"), Channel::Sql), Transient, "{code}");
        }
    }

    #[test]
    fn permanent_codes_are_definite_and_a_busy_slot_is_busy() {
        let cases = [
            ("28P01", Remedy::Password),
            ("28000", Remedy::Admission),
            ("42501", Remedy::Privilege),
            ("42P01", Remedy::Schema),
            ("3D000", Remedy::Database),
            ("55000", Remedy::Prerequisite),
            ("53400", Remedy::Limit),
            ("22P02", Remedy::Unexpected),
            ("42601", Remedy::Unexpected),
        ];
        for (code, remedy) in cases {
            assert_eq!(class_of(&pg(code, "x"), Channel::Sql), Definite(remedy), "{code}");
        }
        assert_eq!(class_of(&pg("55006", "x"), Channel::Replication), Busy);
        assert_eq!(class_of(&pg("55006", "x"), Channel::Sql), Busy);
        for (code, remedy) in [
            (1044, Remedy::Privilege),
            (1045, Remedy::Password),
            (1142, Remedy::Privilege),
            (1143, Remedy::Privilege),
            (1227, Remedy::Replication),
            (1370, Remedy::Privilege),
            (1146, Remedy::Schema),
            (3159, Remedy::Tls),
        ] {
            assert_eq!(class_of(&my(code, "x"), Channel::Sql), Definite(remedy), "{code}");
        }
    }

    #[test]
    fn the_channel_and_the_slot_message_refine_the_remedy() {
        let walsender = pg("42501", "must be superuser or replication role to start walsender");
        assert_eq!(class_of(&walsender, Channel::Replication), Definite(Remedy::Replication));
        let elsewhere = pg("55000", "replication slot \"outbox_0_0\" was not created in this database");
        assert_eq!(class_of(&elsewhere, Channel::Replication), Definite(Remedy::SlotElsewhere));
    }

    #[test]
    fn a_missing_delete_grant_names_the_server_message_and_the_exact_grant() {
        let e = decide(
            "deleting published rows from outbox_0_1",
            &pg("42501", "permission denied for table outbox_0_1"),
            Channel::Sql,
            &scope(Backend::Postgres),
        );
        assert_eq!(e.kind(), Kind::Definite, "{e:?}");
        let (message, fix) = (e.context(), e.fix().unwrap());
        assert_eq!(
            message,
            "deleting published rows from outbox_0_1: permission denied for table outbox_0_1 (SQLSTATE 42501)"
        );
        assert!(fix.starts_with(r#"GRANT SELECT, DELETE ON "outbox_0_1" TO "outbox_streamer"; GRANT SELECT, UPDATE ON "outbox_checkpoint" TO "outbox_streamer""#), "{fix}");
        let e = decide(
            "deleting published rows",
            &my(1142, "DELETE command denied to user 'outbox_streamer'@'10.0.0.7' for table `billing`.`outbox_0_1`"),
            Channel::Sql,
            &scope(Backend::MySql),
        );
        assert_eq!(e.kind(), Kind::Definite, "{e:?}");
        let (message, fix) = (e.context(), e.fix().unwrap());
        assert!(message.ends_with("(error 1142)"), "{message}");
        assert!(
            fix.starts_with("GRANT SELECT, DELETE ON `billing`.`outbox_0_1` TO 'outbox_streamer'@'<host>'"),
            "{fix}"
        );
    }

    #[test]
    fn fixes_name_the_setting_to_change() {
        let s = scope(Backend::Postgres);
        assert!(Remedy::Password.fix(&s).contains("password_env = \"OUTBOX_PW\""));
        assert!(Remedy::Replication.fix(&s).starts_with("ALTER ROLE \"outbox_streamer\" REPLICATION"));
        assert!(Remedy::SlotElsewhere.fix(&s).contains("slot_prefix = \"outbox_billing\""));
        assert!(Remedy::Replication.fix(&scope(Backend::MySql)).starts_with("GRANT REPLICATION SLAVE"));
        let busy = decide(
            "starting replication",
            &pg("55006", "replication slot \"outbox_0_1\" is active for PID 7"),
            Channel::Replication,
            &s,
        );
        assert!(busy.kind() == Kind::Busy && busy.to_string().contains("in use by another session"));
    }

    #[test]
    fn row_data_in_a_detail_is_never_repeated() {
        let mut e = pg("23505", "duplicate key value violates unique constraint");
        e.detail = Some("Key (id)=(42) already exists.".into());
        assert!(!e.describe().contains("(42)"));
        let mut e = pg("42501", "permission denied to start WAL sender");
        e.detail = Some("Only roles with the REPLICATION attribute may start a WAL sender process.".into());
        e.hint = Some("ask an administrator".into());
        assert_eq!(
            e.describe(),
            "permission denied to start WAL sender; Only roles with the REPLICATION attribute may start a WAL sender process.; hint: ask an administrator (SQLSTATE 42501)"
        );
    }

    #[test]
    fn replication_server_errors_are_parsed_from_their_text() {
        let e = parse_wire_server_error("replication slot \"s\" is active for PID 1 (SQLSTATE 55006)");
        assert_eq!(e.code, Code::SqlState("55006".into()));
        assert_eq!(e.message, "replication slot \"s\" is active for PID 1");
        assert_eq!(parse_wire_server_error("unknown server error").code, Code::SqlState("XX000".into()));
    }
}
