//! A fresh MariaDB/MySQL database per test.

use mysql_async::prelude::Queryable;

use super::{env, unique};

/// One test's database, reached as the admin user.
pub struct MyDb {
    pub name: String,
    pub conn: mysql_async::Conn,
}

/// Creates a database named uniquely for this test process and call.
pub async fn fresh_db() -> MyDb {
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
    MyDb { name, conn }
}
