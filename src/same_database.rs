//! Two sources that reach one database under different URLs.
//!
//! `Config::validate` refuses two sources with the same URL and `table_prefix`, but it cannot
//! see that `localhost` and `127.0.0.1` (or a DNS alias, another port forward) are the same
//! server. Two such sources would run two streamers over the same outbox tables: every row
//! published twice, each deleting the other's rows. `run` and `setup` therefore ask each
//! server who it is — only for sources whose kind and prefix repeat, so a usual config opens
//! no extra connection — and refuse to start when two of them are one database.
//!
//! The server's identity is what the least-privilege login can read:
//!
//! * PostgreSQL: `pg_control_system().system_identifier` (executable by PUBLIC) and
//!   `current_database()`;
//! * MySQL/MariaDB: `@@hostname`, `@@port`, `@@datadir`, `@@server_id` (and `@@server_uuid`
//!   where it exists: MySQL) with the URL's database.
//!
//! A source that cannot be reached is skipped with a warning: `run` retries it anyway, and
//! the check must not turn a database outage into a refusal to start the others.

use std::collections::BTreeMap;

use crate::config::{Config, SourceConfig, SourceKind};

/// How long asking one server who it is may take.
const IDENTIFY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(15);

/// Fails when two sources of `config` with the same kind and `table_prefix` reach the same
/// database; the error names both sources and the fix.
pub(crate) async fn refuse_shared_databases(config: &Config) -> anyhow::Result<()> {
    let mut identified = Vec::new();
    for source in sources_sharing_a_prefix(config) {
        match tokio::time::timeout(IDENTIFY_TIMEOUT, identify(source))
            .await
            .unwrap_or_else(|_| Err(anyhow::anyhow!("no answer within {}s", IDENTIFY_TIMEOUT.as_secs())))
        {
            Ok(identity) => identified.push((source.name.as_str(), source.table_prefix.as_str(), identity)),
            Err(e) => tracing::warn!(
                source = %source.name,
                error = %format!("{e:#}"),
                "cannot tell whether this source is the same database as another with table_prefix {:?}",
                source.table_prefix
            ),
        }
    }
    match first_shared(&identified) {
        Some((a, b, identity)) => anyhow::bail!(
            "sources {a:?} and {b:?} reach the same database ({identity}) with the same table_prefix: both would stream and delete the same outbox rows; remove one of them, or give one its own table_prefix and run `outbox-streamer setup`"
        ),
        None => Ok(()),
    }
}

/// Sources whose kind and `table_prefix` another source shares: the only ones that can clash.
fn sources_sharing_a_prefix(config: &Config) -> Vec<&SourceConfig> {
    let mut groups: BTreeMap<(bool, &str), Vec<&SourceConfig>> = BTreeMap::new();
    for s in &config.sources {
        groups.entry((s.kind == SourceKind::Postgres, s.table_prefix.as_str())).or_default().push(s);
    }
    groups.into_values().filter(|g| g.len() > 1).flatten().collect()
}

/// The first two of `identified` (name, prefix, identity) with the same prefix and identity.
fn first_shared<'a>(identified: &[(&'a str, &str, String)]) -> Option<(&'a str, &'a str, String)> {
    identified.iter().enumerate().find_map(|(i, (a, prefix, identity))| {
        identified[i + 1..]
            .iter()
            .find(|(_, p, id)| p == prefix && id == identity)
            .map(|(b, _, _)| (*a, *b, identity.clone()))
    })
}

/// Who the server behind `source` is, and which database of it the source uses.
async fn identify(source: &SourceConfig) -> anyhow::Result<String> {
    crate::db::of(source.kind).identify(source).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_repeated_prefixes_are_checked_and_the_same_identity_clashes() {
        let config = Config::from_toml(
            r#"
            [[source]]
            name = "a"
            kind = "postgres"
            url = "postgres://u@localhost/app"
            [[source]]
            name = "b"
            kind = "postgres"
            url = "postgres://u@127.0.0.1/app"
            [[source]]
            name = "c"
            kind = "mysql"
            url = "mysql://u@127.0.0.1/app"
            [[source]]
            name = "d"
            kind = "postgres"
            url = "postgres://u@127.0.0.1/other"
            table_prefix = "other"
            "#,
        )
        .unwrap();
        let names: Vec<&str> = sources_sharing_a_prefix(&config).iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);

        let id = |s: &str| s.to_string();
        let same = [("a", "outbox", id("db 1")), ("b", "outbox", id("db 2")), ("c", "outbox", id("db 1"))];
        assert_eq!(first_shared(&same), Some(("a", "c", id("db 1"))));
        let different = [("a", "outbox", id("db 1")), ("b", "outbox", id("db 2"))];
        assert_eq!(first_shared(&different), None);
        let other_prefix = [("a", "outbox", id("db 1")), ("b", "other", id("db 1"))];
        assert_eq!(first_shared(&other_prefix), None);
    }
}
