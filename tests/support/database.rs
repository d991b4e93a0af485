//! What differs between the databases a scenario runs on, so a scenario is written once and
//! run on PostgreSQL and on MariaDB: creating a fresh database with the least-privilege
//! streamer login, a session as the admin user, counting what is left in an outbox table.

use std::future::Future;

use mysql_async::prelude::Queryable;

use super::mysql::MyDb;
use super::pg::PgDb;

/// A database the streamer reads, as the tests drive it. Implemented once per database;
/// scenarios that hold for both are generic over it.
pub(crate) trait Database: Sized + Send + Sync + 'static {
    /// A session as the admin user, for writing rows.
    type Conn: Send;

    /// `kind` of the `[[source]]` in the config.
    const KIND: &'static str;

    /// A fresh database and the documented least-privilege streamer login (`grants`
    /// overrides the global privileges where the database has such; `None`: the documented
    /// ones). Returns the database and the streamer's URL.
    fn create(grants: Option<&str>) -> impl Future<Output = (Self, String)> + Send;

    /// The admin user's URL of this database.
    fn admin_url(&self) -> &str;

    /// A new admin session.
    fn connect(&self) -> impl Future<Output = Self::Conn> + Send;

    /// Rows left in `table`.
    fn count(&self, table: &str) -> impl Future<Output = i64> + Send;
}

impl Database for PgDb {
    type Conn = tokio_postgres::Client;
    const KIND: &'static str = "postgres";

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

    async fn count(&self, table: &str) -> i64 {
        PgDb::count(self, table).await
    }
}

impl Database for MyDb {
    type Conn = mysql_async::Conn;
    const KIND: &'static str = "mysql";

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

    async fn count(&self, table: &str) -> i64 {
        let mut c = self.connect().await;
        let n: Option<i64> = c.query_first(format!("SELECT count(*) FROM {table}")).await.unwrap();
        c.disconnect().await.unwrap();
        n.unwrap()
    }
}
