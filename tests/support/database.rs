//! What differs between the databases a scenario runs on, so a scenario is written once and
//! run on PostgreSQL and on MariaDB: creating a fresh database with the least-privilege
//! streamer login, writing rows in one transaction or through the enqueue routine, running a
//! statement both dialects share, counting what is left in an outbox table, how a record names
//! its log position, and the log position a stream has confirmed.

use std::future::Future;

use mysql_async::prelude::Queryable;
use tokio_postgres::types::ToSql;

use super::mysql::MyDb;
use super::pg::PgDb;

/// One outbox row as a test writes it; `None` columns are left to their default (or NULL,
/// where the test has made the column nullable).
#[derive(Debug, Clone, Default)]
pub(crate) struct Row {
    pub topic: Option<String>,
    pub key: Option<Vec<u8>>,
    pub payload: Vec<u8>,
    /// The `headers` column as JSON text.
    pub headers: Option<String>,
    /// The `kafka_partition` column: the Kafka partition the record must go to.
    pub kafka_partition: Option<i32>,
}

impl Row {
    /// A row for `topic` with `payload` and nothing else.
    pub(crate) fn new(topic: &str, payload: impl Into<Vec<u8>>) -> Self {
        Self { topic: Some(topic.to_string()), payload: payload.into(), ..Self::default() }
    }

    pub(crate) fn key(mut self, key: impl Into<Vec<u8>>) -> Self {
        self.key = Some(key.into());
        self
    }

    pub(crate) fn headers(mut self, json: &str) -> Self {
        self.headers = Some(json.to_string());
        self
    }

    pub(crate) fn kafka_partition(mut self, partition: i32) -> Self {
        self.kafka_partition = Some(partition);
        self
    }

    /// The same row with a NULL topic (a bad row once the column allows NULL).
    pub(crate) fn without_topic(mut self) -> Self {
        self.topic = None;
        self
    }
}

/// A database the streamer reads, as the tests drive it. Implemented once per database;
/// scenarios that hold for both are generic over it.
pub(crate) trait Database: Sized + Send + Sync + 'static {
    /// A session as the admin user, for writing rows.
    type Conn: Send;

    /// `kind` of the `[[source]]` in the config.
    const KIND: &'static str;
    /// The database's name in test output.
    const NAME: &'static str;
    /// Whether the database keeps the stream's confirmed position apart from the outbox
    /// table, where a test can compare the two (a PostgreSQL slot). MariaDB's checkpoint
    /// commits together with the delete: there is nothing the table could disagree with.
    const SLOT: bool;
    /// The header that carries a record's position in the database's log.
    const POSITION_HEADER: &'static str;
    /// A statement that makes the server go on writing its log in a new file.
    const NEW_LOG_FILE: &'static str;

    /// A fresh database and the documented least-privilege streamer login (`grants`
    /// overrides the global privileges where the database has such; `None`: the documented
    /// ones). Returns the database and the streamer's URL.
    fn create(grants: Option<&str>) -> impl Future<Output = (Self, String)> + Send;

    /// The admin user's URL of this database.
    fn admin_url(&self) -> &str;

    /// A new admin session.
    fn connect(&self) -> impl Future<Output = Self::Conn> + Send;

    /// Inserts `rows` into `table` in one transaction; returns their ids in insert order.
    fn insert(conn: &mut Self::Conn, table: &str, rows: &[Row]) -> impl Future<Output = Vec<i64>> + Send;

    /// Calls the outbox's enqueue routine (`<prefix>_enqueue`, made by `setup`) with `row`
    /// for `shard`: the way an application writes a row.
    fn enqueue(conn: &mut Self::Conn, prefix: &str, row: &Row, shard: i32) -> impl Future<Output = ()> + Send;

    /// Runs `sql`, one statement both databases understand (`BEGIN`, `COMMIT`, an `INSERT`
    /// of literal values), or [`Database::NEW_LOG_FILE`].
    fn execute(conn: &mut Self::Conn, sql: &str) -> impl Future<Output = ()> + Send;

    /// The single number `sql` (a query both databases understand) returns.
    fn query_number(conn: &mut Self::Conn, sql: &str) -> impl Future<Output = i64> + Send;

    /// Whether `value` of a record's [`Database::POSITION_HEADER`] is a position in this
    /// database's log.
    fn is_position(value: &str) -> bool;

    /// Rows left in `table`.
    fn count(&self, table: &str) -> impl Future<Output = i64> + Send;

    /// Lets `table`'s `topic` column hold NULL, so a test can write a bad row.
    fn allow_null_topic(&self, table: &str) -> impl Future<Output = ()> + Send;

    /// Inserts `rows` rows in one transaction by a statement the server runs: key
    /// `k<n mod 1000>`, a 200-byte payload.
    fn insert_series(&self, table: &str, topic: &str, rows: usize) -> impl Future<Output = ()> + Send;

    /// The ids of the rows left in `table`.
    fn ids(conn: &mut Self::Conn, table: &str) -> impl Future<Output = Vec<i64>> + Send;

    /// The position in the database's log up to which the stream of `table` has confirmed,
    /// as a number that orders like the log — where [`Database::SLOT`]; `None` before the
    /// first confirmation and on a database without.
    fn confirmed_position(conn: &mut Self::Conn, table: &str) -> impl Future<Output = Option<u64>> + Send;

    /// The log's end now, comparable with [`Database::confirmed_position`]; 0 without [`Database::SLOT`].
    fn log_end(conn: &mut Self::Conn) -> impl Future<Output = u64> + Send;

    /// Makes every DELETE on `table` first pass a gate that a session can hold closed
    /// ([`Database::close_gate`]): a trigger that waits for a lock of the table's name. For
    /// a test that holds the streamer's cleanup while reading goes on.
    fn gate_deletes(conn: &mut Self::Conn, table: &str) -> impl Future<Output = ()> + Send;

    /// Closes `table`'s gate, held by this session until [`Database::open_gate`].
    fn close_gate(conn: &mut Self::Conn, table: &str) -> impl Future<Output = ()> + Send;

    /// Opens `table`'s gate again.
    fn open_gate(conn: &mut Self::Conn, table: &str) -> impl Future<Output = ()> + Send;

    /// Sessions waiting at `table`'s gate (MariaDB shows the trigger's statement as theirs).
    fn waiting_at_gate(conn: &mut Self::Conn, table: &str) -> impl Future<Output = i64> + Send;

    /// Empties `table` and starts its ids again from the first (PostgreSQL's `RESTART
    /// IDENTITY`; MariaDB's `TRUNCATE` resets `AUTO_INCREMENT`).
    fn truncate_restarting_ids(conn: &mut Self::Conn, table: &str) -> impl Future<Output = ()> + Send;

    /// Ends the sessions waiting at `table`'s gate, as the server does when their client dies:
    /// their open transactions roll back.
    fn kill_waiting_at_gate(conn: &mut Self::Conn, table: &str) -> impl Future<Output = ()> + Send;

    /// Ends every session of another login than the admin's in this database (the streamer's
    /// sessions, whatever they are doing); returns how many.
    fn kill_other_sessions(conn: &mut Self::Conn) -> impl Future<Output = usize> + Send;

    /// When the stream of `table` last reported its position to the server (seconds on the
    /// server's clock, with a fraction), where [`Database::SLOT`]; `None` otherwise or while
    /// no stream is connected.
    fn last_report(conn: &mut Self::Conn, table: &str) -> impl Future<Output = Option<f64>> + Send;

    /// The server's clock now, comparable with [`Database::last_report`].
    fn server_time(conn: &mut Self::Conn) -> impl Future<Output = f64> + Send;
}

/// Rows a single INSERT statement carries; more go in further statements of the same transaction.
const INSERT_CHUNK: usize = 1000;

/// A PostgreSQL LSN `X/Y` as a number.
pub(crate) fn lsn(text: &str) -> u64 {
    let (hi, lo) = text.split_once('/').expect("LSN is X/Y");
    (u64::from_str_radix(hi, 16).unwrap() << 32) | u64::from_str_radix(lo, 16).unwrap()
}

impl Database for PgDb {
    type Conn = tokio_postgres::Client;
    const KIND: &'static str = "postgres";
    const NAME: &'static str = "postgres";
    const SLOT: bool = true;
    const POSITION_HEADER: &'static str = "outbox-lsn";
    const NEW_LOG_FILE: &'static str = "SELECT pg_switch_wal()";

    async fn create(_grants: Option<&str>) -> (Self, String) {
        let db = super::pg::fresh_db().await;
        let url = db.streamer_url.clone();
        (db, url)
    }

    fn admin_url(&self) -> &str {
        &self.admin_url
    }

    async fn connect(&self) -> Self::Conn {
        super::pg::connect(&self.admin_url).await
    }

    async fn insert(conn: &mut Self::Conn, table: &str, rows: &[Row]) -> Vec<i64> {
        let tx = conn.transaction().await.unwrap();
        let mut ids = Vec::with_capacity(rows.len());
        for chunk in rows.chunks(INSERT_CHUNK) {
            let values: Vec<String> = (0..chunk.len())
                .map(|i| {
                    let n = 5 * i;
                    format!("(${}, ${}, ${}, ${}::text::jsonb, ${})", n + 1, n + 2, n + 3, n + 4, n + 5)
                })
                .collect();
            let sql = format!(
                "INSERT INTO {table} (topic, msg_key, payload, headers, kafka_partition) VALUES {} RETURNING id",
                values.join(", ")
            );
            let params: Vec<&(dyn ToSql + Sync)> = chunk
                .iter()
                .flat_map(|r| [&r.topic as &(dyn ToSql + Sync), &r.key, &r.payload, &r.headers, &r.kafka_partition])
                .collect();
            ids.extend(tx.query(&sql, &params).await.unwrap().iter().map(|r| r.get::<_, i64>(0)));
        }
        tx.commit().await.unwrap();
        ids
    }

    async fn enqueue(conn: &mut Self::Conn, prefix: &str, row: &Row, shard: i32) {
        let sql = format!("SELECT {prefix}_enqueue($1, $2, $3, $4::text::jsonb, $5)");
        conn.execute(&sql, &[&row.topic as &(dyn ToSql + Sync), &row.key, &row.payload, &row.headers, &shard])
            .await
            .unwrap();
    }

    async fn execute(conn: &mut Self::Conn, sql: &str) {
        conn.batch_execute(sql).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    async fn query_number(conn: &mut Self::Conn, sql: &str) -> i64 {
        conn.query_one(sql, &[]).await.unwrap_or_else(|e| panic!("{sql}: {e}")).get(0)
    }

    /// An LSN, `X/Y` in hexadecimal.
    fn is_position(value: &str) -> bool {
        value
            .split_once('/')
            .is_some_and(|(hi, lo)| u32::from_str_radix(hi, 16).is_ok() && u32::from_str_radix(lo, 16).is_ok())
    }

    async fn count(&self, table: &str) -> i64 {
        PgDb::count(self, table).await
    }

    async fn allow_null_topic(&self, table: &str) {
        self.admin.batch_execute(&format!("ALTER TABLE {table} ALTER COLUMN topic DROP NOT NULL")).await.unwrap();
    }

    async fn insert_series(&self, table: &str, topic: &str, rows: usize) {
        self.admin
            .execute(
                &format!(
                    "INSERT INTO {table} (topic, msg_key, payload)
                     SELECT $1, ('k' || (g % 1000))::bytea, convert_to(lpad(g::text, 200, 'x'), 'UTF8')
                     FROM generate_series(1, {rows}) g"
                ),
                &[&topic],
            )
            .await
            .unwrap();
    }

    async fn ids(conn: &mut Self::Conn, table: &str) -> Vec<i64> {
        conn.query(&format!("SELECT id FROM {table}"), &[]).await.unwrap().iter().map(|r| r.get(0)).collect()
    }

    async fn confirmed_position(conn: &mut Self::Conn, table: &str) -> Option<u64> {
        let confirmed: Option<String> = conn
            .query_opt("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1", &[&table])
            .await
            .unwrap()?
            .get(0);
        confirmed.as_deref().map(lsn)
    }

    async fn log_end(conn: &mut Self::Conn) -> u64 {
        let end: String = conn.query_one("SELECT pg_current_wal_insert_lsn()::text", &[]).await.unwrap().get(0);
        lsn(&end)
    }

    async fn gate_deletes(conn: &mut Self::Conn, table: &str) {
        conn.batch_execute(&format!(
            "CREATE FUNCTION {table}_gate() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN PERFORM pg_advisory_xact_lock_shared(hashtext('{table}')); RETURN NULL; END $$;
             CREATE TRIGGER {table}_gate BEFORE DELETE ON {table} FOR EACH STATEMENT EXECUTE FUNCTION {table}_gate();"
        ))
        .await
        .unwrap();
    }

    async fn close_gate(conn: &mut Self::Conn, table: &str) {
        conn.execute("SELECT pg_advisory_lock(hashtext($1))", &[&table]).await.unwrap();
    }

    async fn open_gate(conn: &mut Self::Conn, table: &str) {
        let released: bool = conn.query_one("SELECT pg_advisory_unlock(hashtext($1))", &[&table]).await.unwrap().get(0);
        assert!(released, "the gate of {table} was closed by this session");
    }

    async fn waiting_at_gate(conn: &mut Self::Conn, table: &str) -> i64 {
        conn.query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
               AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
               AND objid = hashtext($1)::oid",
            &[&table],
        )
        .await
        .unwrap()
        .get(0)
    }

    async fn truncate_restarting_ids(conn: &mut Self::Conn, table: &str) {
        conn.batch_execute(&format!("TRUNCATE {table} RESTART IDENTITY")).await.unwrap();
    }

    async fn kill_waiting_at_gate(conn: &mut Self::Conn, table: &str) {
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
               AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
               AND objid = hashtext($1)::oid",
            &[&table],
        )
        .await
        .unwrap();
    }

    async fn kill_other_sessions(conn: &mut Self::Conn) -> usize {
        let row = conn
            .query_one(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
                  WHERE datname = current_database() AND usename <> current_user AND pid <> pg_backend_pid()",
                &[],
            )
            .await
            .unwrap();
        row.get::<_, i64>(0) as usize
    }

    async fn last_report(conn: &mut Self::Conn, table: &str) -> Option<f64> {
        conn.query_opt(
            "SELECT extract(epoch FROM r.reply_time)::float8 FROM pg_replication_slots s
               JOIN pg_stat_replication r ON r.pid = s.active_pid
              WHERE s.slot_name = $1 AND r.reply_time IS NOT NULL",
            &[&table],
        )
        .await
        .unwrap()
        .map(|r| r.get(0))
    }

    async fn server_time(conn: &mut Self::Conn) -> f64 {
        conn.query_one("SELECT extract(epoch FROM clock_timestamp())::float8", &[]).await.unwrap().get(0)
    }
}

impl Database for MyDb {
    type Conn = mysql_async::Conn;
    const KIND: &'static str = "mysql";
    const NAME: &'static str = "mariadb";
    const SLOT: bool = false;
    const POSITION_HEADER: &'static str = "outbox-gtid";
    const NEW_LOG_FILE: &'static str = "FLUSH BINARY LOGS";

    async fn create(grants: Option<&str>) -> (Self, String) {
        let mut db = super::mysql::fresh_db().await;
        let url = db.streamer_user(grants.unwrap_or(super::mysql::STREAMER_GRANTS)).await;
        (db, url)
    }

    fn admin_url(&self) -> &str {
        &self.admin_url
    }

    async fn connect(&self) -> Self::Conn {
        mysql_async::Conn::new(mysql_async::Opts::from_url(&self.admin_url).unwrap()).await.unwrap()
    }

    async fn insert(conn: &mut Self::Conn, table: &str, rows: &[Row]) -> Vec<i64> {
        let mut tx = conn.start_transaction(mysql_async::TxOpts::default()).await.unwrap();
        let mut ids = Vec::with_capacity(rows.len());
        for chunk in rows.chunks(INSERT_CHUNK) {
            let values = vec!["(?, ?, ?, ?, ?)"; chunk.len()].join(", ");
            let sql = format!(
                "INSERT INTO {table} (topic, msg_key, payload, headers, kafka_partition) VALUES {values} RETURNING id"
            );
            let params: Vec<mysql_async::Value> = chunk.iter().flat_map(row_values).collect();
            let got: Vec<i64> = tx.exec(&sql, params).await.unwrap();
            ids.extend(got);
        }
        tx.commit().await.unwrap();
        ids
    }

    async fn enqueue(conn: &mut Self::Conn, prefix: &str, row: &Row, shard: i32) {
        let params = (row.topic.clone(), row.key.clone(), row.payload.clone(), row.headers.clone(), shard);
        conn.exec_drop(format!("CALL {prefix}_enqueue(?, ?, ?, ?, ?)"), params).await.unwrap();
    }

    async fn execute(conn: &mut Self::Conn, sql: &str) {
        conn.query_drop(sql).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    async fn query_number(conn: &mut Self::Conn, sql: &str) -> i64 {
        let n: Option<i64> = conn.query_first(sql).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
        n.unwrap_or_else(|| panic!("{sql}: no row"))
    }

    /// A GTID, `domain-server-sequence` in decimal.
    fn is_position(value: &str) -> bool {
        let parts: Vec<&str> = value.split('-').collect();
        parts.len() == 3 && parts.iter().all(|p| p.parse::<u64>().is_ok())
    }

    async fn count(&self, table: &str) -> i64 {
        let mut c = self.connect().await;
        let n: Option<i64> = c.query_first(format!("SELECT count(*) FROM {table}")).await.unwrap();
        c.disconnect().await.unwrap();
        n.unwrap()
    }

    async fn allow_null_topic(&self, table: &str) {
        let mut c = self.connect().await;
        c.query_drop(format!("ALTER TABLE {table} MODIFY topic VARCHAR(249) NULL")).await.unwrap();
        c.disconnect().await.unwrap();
    }

    async fn insert_series(&self, table: &str, topic: &str, rows: usize) {
        let mut c = self.connect().await;
        c.exec_drop(
            format!(
                "INSERT INTO {table} (topic, msg_key, payload)
                 SELECT ?, CONCAT('k', seq MOD 1000), LPAD(seq, 200, 'x') FROM seq_1_to_{rows}"
            ),
            (topic,),
        )
        .await
        .unwrap();
        c.disconnect().await.unwrap();
    }

    async fn ids(conn: &mut Self::Conn, table: &str) -> Vec<i64> {
        conn.query(format!("SELECT id FROM {table}")).await.unwrap()
    }

    async fn confirmed_position(_conn: &mut Self::Conn, _table: &str) -> Option<u64> {
        None
    }

    async fn log_end(_conn: &mut Self::Conn) -> u64 {
        0
    }

    async fn gate_deletes(conn: &mut Self::Conn, table: &str) {
        conn.query_drop(format!(
            "CREATE TRIGGER {table}_gate BEFORE DELETE ON {table} FOR EACH ROW BEGIN
               SET @outbox_gate = GET_LOCK('{table}_gate', 600);
               SET @outbox_gate = RELEASE_LOCK('{table}_gate');
             END"
        ))
        .await
        .unwrap();
    }

    async fn close_gate(conn: &mut Self::Conn, table: &str) {
        let got: Option<i64> = conn.query_first(format!("SELECT GET_LOCK('{table}_gate', 10)")).await.unwrap();
        assert_eq!(got, Some(1), "closing the gate of {table}");
    }

    async fn open_gate(conn: &mut Self::Conn, table: &str) {
        let released: Option<i64> = conn.query_first(format!("SELECT RELEASE_LOCK('{table}_gate')")).await.unwrap();
        assert_eq!(released, Some(1), "the gate of {table} was closed by this session");
    }

    async fn waiting_at_gate(conn: &mut Self::Conn, table: &str) -> i64 {
        let n: Option<i64> = conn
            .query_first(format!(
                "SELECT count(*) FROM information_schema.processlist
                  WHERE state = 'User lock' AND INSTR(info, 'GET_LOCK(''{table}_gate''') > 0"
            ))
            .await
            .unwrap();
        n.unwrap()
    }

    async fn truncate_restarting_ids(conn: &mut Self::Conn, table: &str) {
        conn.query_drop(format!("TRUNCATE TABLE {table}")).await.unwrap();
    }

    async fn kill_waiting_at_gate(conn: &mut Self::Conn, table: &str) {
        let ids: Vec<u64> = conn
            .query(format!(
                "SELECT id FROM information_schema.processlist
                  WHERE state = 'User lock' AND INSTR(info, 'GET_LOCK(''{table}_gate''') > 0"
            ))
            .await
            .unwrap();
        for id in ids {
            conn.query_drop(format!("KILL {id}")).await.unwrap();
        }
    }

    async fn kill_other_sessions(conn: &mut Self::Conn) -> usize {
        let ids: Vec<u64> = conn
            .query(
                "SELECT id FROM information_schema.processlist
                  WHERE db = DATABASE() AND user <> SUBSTRING_INDEX(CURRENT_USER(), '@', 1) AND id <> CONNECTION_ID()",
            )
            .await
            .unwrap();
        for id in &ids {
            // A session that ended meanwhile is gone already.
            let _ = conn.query_drop(format!("KILL {id}")).await;
        }
        ids.len()
    }

    async fn last_report(_conn: &mut Self::Conn, _table: &str) -> Option<f64> {
        None
    }

    async fn server_time(conn: &mut Self::Conn) -> f64 {
        let t: Option<f64> = conn.query_first("SELECT UNIX_TIMESTAMP(NOW(6)) + 0e0").await.unwrap();
        t.unwrap()
    }
}

/// A row's values in the column order of [`Database::insert`], for MariaDB.
fn row_values(r: &Row) -> [mysql_async::Value; 5] {
    [
        r.topic.clone().into(),
        r.key.clone().into(),
        r.payload.clone().into(),
        r.headers.clone().into(),
        r.kafka_partition.into(),
    ]
}
