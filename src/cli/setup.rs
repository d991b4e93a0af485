//! `outbox-streamer setup`: creates what every shard-partition needs, after checking the server;
//! each database's checks and objects are in its folder ([`crate::db::Database::setup`]).

use std::process::ExitCode;

use crate::config::Config;
use crate::db::{self, AdminLogin, SetupRequest};

/// Runs `setup` for every source: checks first, then creates. `app_roles` are granted what
/// enqueuing needs (`--app-role`).
pub(crate) async fn setup(
    config: &Config,
    dry_run: bool,
    admin: Option<AdminLogin<'_>>,
    app_roles: &[String],
) -> anyhow::Result<ExitCode> {
    if !dry_run {
        crate::same_database::refuse_shared_databases(config).await?;
    }
    let mut ok = true;
    for source in &config.sources {
        ok &= db::of(source.kind).setup(source, &SetupRequest { dry_run, admin, app_roles }).await?;
    }
    Ok(if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
