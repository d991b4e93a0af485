//! A fresh MariaDB/MySQL database per test.

use mysql_async::prelude::Queryable;

use super::{env, unique};

/// One test's database, reached as the admin user. Dropping it drops the database and its
/// streamer user in the background (see [`drop_database`]).
pub(crate) struct MyDb {
    pub name: String,
    pub conn: mysql_async::Conn,
    /// The admin URL pointing at this database.
    pub admin_url: String,
}

impl Drop for MyDb {
    fn drop(&mut self) {
        let name = self.name.clone();
        super::in_the_background(async move { drop_database(&env("OUTBOX_MYSQL_URL"), &name).await });
    }
}

/// Drops test database `name` and its streamer user after ending their sessions, so their
/// open transactions let go of the tables. Best effort, a few attempts half a second apart
/// (a transaction a test left prepared holds its tables until it is decided): what is left
/// only takes disk.
async fn drop_database(root_url: &str, name: &str) {
    let Ok(opts) = mysql_async::Opts::from_url(root_url) else { return };
    let user = format!("{name}_s");
    super::retry_paced(20, std::time::Duration::from_millis(500), || async {
        let Ok(mut root) = mysql_async::Conn::new(opts.clone()).await else { return false };
        let sessions: Vec<u64> = root
            .exec(
                "SELECT id FROM information_schema.processlist WHERE (db = ? OR user = ?) AND id <> CONNECTION_ID()",
                (name, &user),
            )
            .await
            .unwrap_or_default();
        for id in sessions {
            let _ = root.query_drop(format!("KILL {id}")).await;
        }
        let _ = root.query_drop("SET SESSION lock_wait_timeout = 5").await;
        let dropped = root.query_drop(format!("DROP DATABASE IF EXISTS {name}")).await.is_ok();
        let _ = root.query_drop(format!("DROP USER IF EXISTS '{user}'@'127.0.0.1'")).await;
        let _ = root.disconnect().await;
        dropped
    })
    .await;
}

impl MyDb {
    /// Creates the documented least-privilege streamer user (replication only; `setup`
    /// grants the table privileges) and returns its URL. `global` overrides the grant.
    pub(crate) async fn streamer_user(&mut self, global: &str) -> String {
        let user = format!("{}_s", self.name);
        let password = format!("pw-{}", unique("x"));
        self.conn.query_drop(format!("CREATE USER '{user}'@'127.0.0.1' IDENTIFIED BY '{password}'")).await.unwrap();
        if !global.is_empty() {
            self.conn.query_drop(format!("GRANT {global} ON *.* TO '{user}'@'127.0.0.1'")).await.unwrap();
        }
        let hostport = self.admin_url.split('@').nth(1).and_then(|h| h.split('/').next()).unwrap();
        format!("mysql://{user}:{password}@{hostport}/{}", self.name)
    }
}

/// Creates a database named uniquely for this test process and call.
pub(crate) async fn fresh_db() -> MyDb {
    let url = env("OUTBOX_MYSQL_URL");
    let opts = mysql_async::Opts::from_url(&url).expect("OUTBOX_MYSQL_URL is a mysql:// URL");
    let mut root = mysql_async::Conn::new(opts.clone())
        .await
        .unwrap_or_else(|e| panic!("connecting to MariaDB: {e}; {}", super::HOW_TO_START));
    let name = unique("t");
    root.query_drop(format!("CREATE DATABASE {name}")).await.expect("create database");
    root.disconnect().await.expect("disconnect");
    let conn = mysql_async::Conn::new(mysql_async::OptsBuilder::from_opts(opts).db_name(Some(name.clone())))
        .await
        .expect("connecting to the test database");
    let (base, _) = url.rsplit_once('/').expect("OUTBOX_MYSQL_URL ends with /database");
    MyDb { admin_url: format!("{base}/{name}"), name, conn }
}

/// The documented least-privilege global grants of the streamer's user.
/// Flushes the binlog and purges every older file, waiting until only the current one is
/// left (the server keeps a file a replica connection still reads, and a stopped instance's
/// dump thread may linger a moment). Server-wide: only for a test that holds the services
/// alone.
pub(crate) async fn purge_binlogs(admin_url: &str) {
    let connect = || async { mysql_async::Conn::new(mysql_async::Opts::from_url(admin_url).unwrap()).await.unwrap() };
    let mut db = connect().await;
    db.query_drop("FLUSH BINARY LOGS").await.unwrap();
    let current: mysql_async::Row = db.query_first("SHOW MASTER STATUS").await.unwrap().unwrap();
    let file: String = current.get(0).unwrap();
    db.disconnect().await.unwrap();
    super::wait_until("older binlogs to be purged", super::world::ARRIVAL, || async {
        let mut c = connect().await;
        c.query_drop(format!("PURGE BINARY LOGS TO '{file}'")).await.unwrap();
        let logs: Vec<mysql_async::Row> = c.query("SHOW BINARY LOGS").await.unwrap();
        c.disconnect().await.unwrap();
        (logs.len() == 1).then_some(())
    })
    .await;
}

pub(crate) const STREAMER_GRANTS: &str = "REPLICATION SLAVE, REPLICATION CLIENT";
