//! A PostgreSQL source's connection settings — URL, password from the environment or a file,
//! TLS — turned into a [`PgTarget`]. Every PostgreSQL connection the streamer, `setup`,
//! `status`, `teardown` and `skip` open goes through here, so none of them can forget the
//! password source or the TLS settings.

use anyhow::Context;
use outbox_postgres::connect::PgTarget;

use crate::config::SourceConfig;

/// The PostgreSQL target of `source`, or of `url` (an admin URL given on the command line,
/// with its own password) on the same server with the source's TLS settings.
pub(crate) fn pg_target(source: &SourceConfig, url: Option<&str>) -> anyhow::Result<PgTarget> {
    match url {
        Some(url) => pg_admin_target(source, url, None),
        None => pg_with_tls(
            source,
            PgTarget::from_url(source.url.expose(), source.password()?.as_deref())
                .with_context(|| format!("source {:?}: url", source.name))?,
        ),
    }
}

/// The admin login `url` (with `password` when the URL has none) with `source`'s TLS.
pub(crate) fn pg_admin_target(source: &SourceConfig, url: &str, password: Option<&str>) -> anyhow::Result<PgTarget> {
    pg_with_tls(source, PgTarget::from_url(url, password)?)
}

fn pg_with_tls(source: &SourceConfig, target: PgTarget) -> anyhow::Result<PgTarget> {
    match source.tls.as_ref().and_then(|t| t.postgres()) {
        Some(tls) => target.with_tls(tls).with_context(|| format!("source {:?}: tls", source.name)),
        None => Ok(target),
    }
}

/// Who the server behind `source` is (its cluster's system identifier) and which database of
/// it the source uses, for refusing two sources that reach one database under two names.
pub(super) async fn identify(source: &SourceConfig) -> anyhow::Result<String> {
    let client = pg_target(source, None)?.connect().await?;
    let row = client
        .query_one("SELECT system_identifier::text, current_database()::text FROM pg_control_system()", &[])
        .await?;
    let (system, database): (String, String) = (row.get(0), row.get(1));
    Ok(format!("database {database:?} of the PostgreSQL cluster with system identifier {system}"))
}

/// The history `client`'s server writes (see [`crate::source::Source::history`]): its cluster's
/// system identifier, which a standby shares with its primary, and the timeline, which a
/// promotion or a point-in-time recovery starts anew.
pub(crate) async fn history(client: &tokio_postgres::Client) -> Result<String, crate::error::Error> {
    let sql = "SELECT system_identifier::text, CASE WHEN pg_is_in_recovery() THEN NULL \
               ELSE ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int END \
               FROM pg_control_system()";
    let row = crate::source::within("reading the server's system identifier and timeline", client.query_one(sql, &[]))
        .await?;
    let (system, timeline): (String, Option<i32>) = (row.get(0), row.get(1));
    Ok(match timeline {
        Some(timeline) => format!("PostgreSQL system {system} timeline {timeline}"),
        None => format!("PostgreSQL system {system} (a standby in recovery)"),
    })
}
