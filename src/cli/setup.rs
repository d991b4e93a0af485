//! `outbox-streamer setup`: creates what every shard-partition needs, after checking the server;
//! each database's checks and objects are in its folder ([`crate::db::Database::setup`]).

use std::process::ExitCode;

use crate::config::Config;
use crate::db::{self, SetupRequest};

/// Runs `setup` for every source: checks first, then creates.
pub(crate) async fn setup(config: &Config, how: &SetupRequest<'_>) -> anyhow::Result<ExitCode> {
    if !how.dry_run {
        crate::same_database::refuse_shared_databases(config).await?;
    }
    let mut ok = true;
    for source in &config.sources {
        ok &= db::of(source.kind).setup(source, how).await?;
    }
    Ok(if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
