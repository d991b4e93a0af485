//! `outbox-streamer setup`: creates what every shard-partition needs, after checking the server.

use std::process::ExitCode;

use anyhow::Context;
use outbox_mysql::setup as my;
use outbox_postgres::connect::PgTarget;
use outbox_postgres::setup::{self as pg, SetupPlan, StreamObjects};

use crate::config::{Config, SourceConfig, SourceKind};
use crate::connect::{mysql_admin_opts, mysql_opts, pg_admin_target, pg_target};
use crate::names::{all_streams, checkpoint_table};

/// The login `setup` runs the DDL as, instead of each source's own: a URL, and the password
/// when it comes from an environment variable rather than the URL.
#[derive(Debug, Clone, Copy)]
pub struct AdminLogin<'a> {
    pub url: &'a str,
    pub password: Option<&'a str>,
}

pub async fn setup(config: &Config, dry_run: bool, admin: Option<AdminLogin<'_>>) -> anyhow::Result<ExitCode> {
    if !dry_run {
        crate::same_database::refuse_shared_databases(config).await?;
    }
    let mut ok = true;
    for source in &config.sources {
        match source.kind {
            SourceKind::Postgres => ok &= setup_postgres(source, dry_run, admin).await?,
            SourceKind::Mysql => ok &= setup_mysql(source, dry_run, admin).await?,
        }
    }
    Ok(if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// The setup plan of a PostgreSQL source; the streamer role is the source URL's user.
pub fn postgres_plan(source: &SourceConfig, streamer: &PgTarget) -> SetupPlan {
    SetupPlan {
        prefix: source.table_prefix.clone(),
        shards: source.shards,
        partitions: source.partitions,
        streams: all_streams(source.shards, source.partitions)
            .map(|id| {
                let n = source.stream_names(id);
                StreamObjects { table: n.table, publication: n.publication, slot: n.slot }
            })
            .collect(),
        streamer_role: Some(streamer.user().to_string()),
    }
}

async fn setup_postgres(source: &SourceConfig, dry_run: bool, admin: Option<AdminLogin<'_>>) -> anyhow::Result<bool> {
    let streamer = pg_target(source, None)?;
    let plan = postgres_plan(source, &streamer);
    if dry_run {
        println!("-- source {:?}: run in database {:?}", source.name, streamer.database());
        for stmt in pg::schema_statements(&plan) {
            println!("{stmt};\n");
        }
        println!("-- outside a transaction block:");
        for stmt in pg::slot_statements(&plan) {
            println!("{stmt};\n");
        }
        println!("-- after creating a slot whose table already holds rows, so `run` sends them first:");
        for stream in &plan.streams {
            println!("{};\n", pg::catch_up_statement(&plan, stream));
        }
        return Ok(true);
    }
    let admin = match admin {
        Some(login) => pg_admin_target(source, login.url, login.password).context("--admin-url")?,
        None => streamer.clone(),
    };
    let mut client = admin
        .connect()
        .await
        .with_context(|| format!("source {:?}: connecting to {}", source.name, admin.display()))?;
    let mut failures = pg::check_server(&client, &plan).await?;
    failures.extend(
        pg::taken_slots(&client, &plan).await?.iter().map(|t| taken_slot_failure(source, streamer.database(), t)),
    );
    if !failures.is_empty() {
        eprintln!("source {:?}: the server is not ready for outbox-streamer:", source.name);
        for f in &failures {
            eprintln!("  - {f}");
        }
        return Ok(false);
    }
    pg::apply(&mut client, &plan).await.with_context(|| {
        format!("source {:?}: creating tables, publications and slots as {}", source.name, admin.display())
    })?;
    let failures = pg::check_privileges(&client, &plan).await?;
    for f in &failures {
        eprintln!("source {:?}: {f}", source.name);
    }
    println!(
        "source {:?}: {} shard-partition(s) ready in {} ({}_<shard>_<partition>: table, publication{}; {}_enqueue())",
        source.name,
        plan.streams.len(),
        streamer.database(),
        plan.prefix,
        match &source.slot_prefix {
            Some(slot_prefix) => format!("; slot {slot_prefix}_<shard>_<partition>"),
            None => ", slot".into(),
        },
        plan.prefix
    );
    Ok(failures.is_empty())
}

/// Why a slot name of the plan cannot be used, and the setting that gives this database its
/// own slots.
fn taken_slot_failure(source: &SourceConfig, database: &str, taken: &pg::TakenSlot) -> pg::CheckFailure {
    let what = if taken.database.is_empty() {
        format!("replication slot {:?} exists as a physical slot", taken.slot)
    } else if !taken.in_this_database {
        format!(
            "replication slot {:?} belongs to database {:?}, not {database:?} (slot names are cluster-wide)",
            taken.slot, taken.database
        )
    } else {
        format!("replication slot {:?} exists with output plugin {:?}, not pgoutput", taken.slot, taken.plugin)
    };
    pg::CheckFailure { what, fix: crate::dberror::slot_prefix_fix(&source.name, &source.table_prefix, database) }
}

async fn setup_mysql(source: &SourceConfig, dry_run: bool, admin: Option<AdminLogin<'_>>) -> anyhow::Result<bool> {
    let streamer = mysql_opts(source, None)?;
    let database = streamer.db_name().unwrap_or_default().to_string();
    let plan = my::SetupPlan {
        database: database.clone(),
        tables: all_streams(source.shards, source.partitions).map(|id| source.stream_names(id).table).collect(),
        checkpoint_table: checkpoint_table(&source.table_prefix),
        streamer_user: streamer.user().map(str::to_string),
    };
    if dry_run {
        println!("-- source {:?}: run in database {database:?}", source.name);
        for stmt in my::statements(&plan) {
            println!("{stmt};\n");
        }
        println!("-- then, per table, a checkpoint row at the server's current binlog position:");
        println!(
            "INSERT IGNORE INTO {} (stream, gtid, binlog_file, binlog_pos) VALUES (…);",
            my::ident(&plan.checkpoint_table)
        );
        return Ok(true);
    }
    let admin = match admin {
        Some(login) => mysql_admin_opts(source, login.url, login.password).context("--admin-url")?,
        None => streamer.clone(),
    };
    let mut conn = crate::connect::mysql_connect(&admin).await.with_context(|| format!("source {:?}", source.name))?;
    let (settings, failures) = my::check_server(&mut conn, &plan).await?;
    if !failures.is_empty() {
        eprintln!("source {:?}: the server ({}) is not ready for outbox-streamer:", source.name, settings.version);
        for f in &failures {
            eprintln!("  - {f}");
        }
        return Ok(false);
    }
    my::apply(&mut conn, &plan, settings.is_mariadb())
        .await
        .with_context(|| format!("source {:?}: creating tables and checkpoints", source.name))?;
    conn.disconnect().await.ok();
    println!(
        "source {:?}: {} shard-partition(s) ready in {database} on {} ({}_<shard>_<partition>, {})",
        source.name,
        plan.tables.len(),
        settings.version,
        source.table_prefix,
        plan.checkpoint_table
    );
    Ok(true)
}
