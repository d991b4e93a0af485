//! A MySQL/MariaDB source's connection settings — URL, password from the environment or a
//! file, TLS — turned into mysql_async [`Opts`]. Every MySQL/MariaDB connection the streamer,
//! `setup`, `status`, `teardown` and `skip` open goes through here, so none of them can forget
//! the password source or the TLS settings.

use anyhow::{Context, bail};
use outbox_mysql::mysql_async::prelude::Queryable;
use outbox_mysql::mysql_async::{Conn, Error as MyError, Opts, OptsBuilder, Row};

use crate::config::SourceConfig;

/// The MySQL/MariaDB options of `source`, or of `url` as in PostgreSQL's `pg_target`.
pub(crate) fn mysql_opts(source: &SourceConfig, url: Option<&str>) -> anyhow::Result<Opts> {
    match url {
        Some(url) => mysql_admin_opts(source, url, None),
        None => Ok(mysql_with_tls(
            source,
            mysql_url(source.url.expose(), source.password()?.as_deref())
                .with_context(|| format!("source {:?}: url", source.name))?,
        )),
    }
}

/// The admin login `url` (with `password` when given) with `source`'s TLS settings.
pub(crate) fn mysql_admin_opts(source: &SourceConfig, url: &str, password: Option<&str>) -> anyhow::Result<Opts> {
    Ok(mysql_with_tls(source, mysql_url(url, password)?))
}

fn mysql_with_tls(source: &SourceConfig, opts: Opts) -> Opts {
    OptsBuilder::from_opts(opts).ssl_opts(source.tls.as_ref().and_then(|t| t.mysql())).into()
}

/// Connection options of a MySQL/MariaDB URL, with the password from the config if given.
pub(crate) fn mysql_url(url: &str, password: Option<&str>) -> anyhow::Result<Opts> {
    let opts = Opts::from_url(url).map_err(|e| {
        anyhow::anyhow!(
            "invalid MySQL URL ({}): expected mysql://user:password@host:port/database",
            e.to_string().replace(url, "<url>")
        )
    })?;
    if opts.db_name().is_none() {
        bail!("the MySQL URL names no database: add /database to it");
    }
    let mut builder = OptsBuilder::from_opts(opts);
    if let Some(pw) = password {
        builder = builder.pass(Some(pw));
    }
    Ok(builder.into())
}

/// Opens a MySQL/MariaDB session; a failure is one line naming the server and login, with
/// what to change where the server's own message does not say it.
pub(crate) async fn mysql_connect(opts: &Opts) -> anyhow::Result<Conn> {
    Conn::new(opts.clone()).await.map_err(|e| {
        anyhow::anyhow!(
            "connecting to {}:{} as {}: {}",
            opts.ip_or_hostname(),
            opts.tcp_port(),
            opts.user().unwrap_or("?"),
            mysql_connect_message(&e)
        )
    })
}

/// `e` in one line (mysql_async repeats its cause in both message and source) with a hint.
pub(crate) fn mysql_connect_message(e: &MyError) -> String {
    let mut innermost: &dyn std::error::Error = e;
    while let Some(cause) = innermost.source() {
        innermost = cause;
    }
    let text = innermost.to_string();
    // The server's "Access denied" errors: ER_DBACCESS_DENIED_ERROR, ER_ACCESS_DENIED_ERROR,
    // ER_SPECIFIC_ACCESS_DENIED_ERROR, ER_ACCESS_DENIED_NO_PASSWORD_ERROR.
    let denied = matches!(e, MyError::Server(s) if matches!(s.code, 1044 | 1045 | 1227 | 1698));
    let hint = outbox_postgres::tls::certificate_hint(&text).or_else(|| {
        denied.then_some("check the user and password; a user created REQUIRE SSL also needs a [source.tls] table")
    });
    match hint {
        Some(hint) => format!("{text} ({hint})"),
        None => text,
    }
}

/// Who the server behind `source` is (its `server_uuid`, or host, port, datadir and server id)
/// and which database of it the source uses, for refusing two sources that reach one database
/// under two names.
pub(super) async fn identify(source: &SourceConfig) -> anyhow::Result<String> {
    let opts = mysql_opts(source, None)?;
    let database = opts.db_name().unwrap_or_default().to_string();
    // Without the database: before `setup` the streamer's login may have no grant on it.
    let mut conn: Conn = mysql_connect(&OptsBuilder::from_opts(opts).db_name(None::<String>).into()).await?;
    let row: Option<Row> = conn.query_first("SELECT @@hostname, @@port, @@datadir, @@server_id").await?;
    let row = row.ok_or_else(|| anyhow::anyhow!("the server did not say who it is"))?;
    let uuid: Option<String> = conn.query_first("SELECT @@server_uuid").await.ok().flatten();
    conn.disconnect().await.ok();
    let text = |i: usize| row.get_opt::<String, _>(i).and_then(Result::ok).unwrap_or_default();
    let server = match uuid {
        Some(uuid) => format!("server_uuid {uuid}"),
        None => format!("server {}:{} with datadir {} and server_id {}", text(0), text(1), text(2), text(3)),
    };
    Ok(format!("database {database:?} on {server}"))
}

/// The history `conn`'s server writes (see [`crate::source::Source::history`]): its
/// `server_id`, which every server of a replication topology has to itself.
pub(crate) async fn history(conn: &mut Conn) -> Result<String, crate::error::Error> {
    let id: Option<u64> =
        crate::source::within("reading the server's server_id", conn.query_first("SELECT @@server_id")).await?;
    Ok(format!("MySQL/MariaDB server_id {}", id.unwrap_or_default()))
}
