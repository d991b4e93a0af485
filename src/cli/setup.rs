//! `outbox-streamer setup`: creates what every shard-partition needs, after checking the server.

use std::process::ExitCode;

use anyhow::Context;
use outbox_mysql::mysql_async::{Opts, OptsBuilder};
use outbox_mysql::privileges as myprivileges;
use outbox_mysql::setup as my;
use outbox_postgres::connect::PgTarget;
use outbox_postgres::privileges;
use outbox_postgres::setup::{self as pg, SetupPlan, StreamObjects};

use crate::config::{Config, SourceConfig, SourceKind};
use crate::db::mysql::connect::{mysql_admin_opts, mysql_opts};
use crate::db::postgres::connect::{pg_admin_target, pg_target};
use crate::names::{all_streams, checkpoint_table};

/// The login `setup` runs the DDL as, instead of each source's own: a URL, and the password
/// when it comes from an environment variable rather than the URL.
#[derive(Debug, Clone, Copy)]
pub struct AdminLogin<'a> {
    pub url: &'a str,
    pub password: Option<&'a str>,
}

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
        match source.kind {
            SourceKind::Postgres => ok &= setup_postgres(source, dry_run, admin, app_roles).await?,
            SourceKind::Mysql => ok &= setup_mysql(source, dry_run, admin, app_roles).await?,
        }
    }
    Ok(if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// The setup plan of a PostgreSQL source; the streamer role is the source URL's user.
pub(crate) fn postgres_plan(source: &SourceConfig, streamer: &PgTarget, app_roles: &[String]) -> SetupPlan {
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
        app_roles: app_roles.to_vec(),
    }
}

async fn setup_postgres(
    source: &SourceConfig,
    dry_run: bool,
    admin: Option<AdminLogin<'_>>,
    app_roles: &[String],
) -> anyhow::Result<bool> {
    let streamer = pg_target(source, None)?;
    let mut plan = postgres_plan(source, &streamer, app_roles);
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
    failures.extend(privileges::check_admin(&client, &plan).await?);
    if !failures.is_empty() {
        eprintln!(
            "source {:?}: the server is not ready for outbox-streamer (nothing was created; setup runs as {}):",
            source.name,
            admin.display()
        );
        for f in &failures {
            eprintln!("  - {f}");
        }
        return Ok(false);
    }
    let earlier = privileges::existing_app_roles(&client, &plan).await?;
    let again: Vec<String> = earlier.into_iter().filter(|r| !plan.app_roles.contains(r)).collect();
    if !again.is_empty() {
        println!(
            "source {:?}: application role(s) {} can enqueue into existing tables; granting them the same on every table",
            source.name,
            again.join(", ")
        );
        plan.app_roles.extend(again);
    }
    let waiting = privileges::open_transactions(&client, OLD_TRANSACTION_S).await?;
    if !waiting.is_empty() {
        eprintln!(
            "source {:?}: a new replication slot waits until these open transactions end: {}",
            source.name,
            waiting.join("; ")
        );
    }
    let failed = |e: pg::ApplyError| anyhow::anyhow!("source {:?}: {e}", source.name);
    pg::apply_schema(&mut client, &plan).await.map_err(failed)?;
    if privileges::can_replicate(&client).await? {
        pg::create_slots(&client, &plan).await.map_err(failed)?;
    } else {
        // A table owner rarely has REPLICATION; the streamer has, and slots need nothing else.
        let own = streamer.connect().await.with_context(|| {
            format!(
                "source {:?}: the schema is created; connecting as the streamer {} to create the slots (re-running setup completes it)",
                source.name,
                streamer.display()
            )
        })?;
        pg::create_slots(&own, &plan).await.map_err(failed)?;
    }
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

/// Transactions open longer than this are named while a new slot may wait on them.
const OLD_TRANSACTION_S: f64 = 5.0;

async fn setup_mysql(
    source: &SourceConfig,
    dry_run: bool,
    admin: Option<AdminLogin<'_>>,
    app_roles: &[String],
) -> anyhow::Result<bool> {
    let streamer = mysql_opts(source, None)?;
    let database = streamer.db_name().unwrap_or_default().to_string();
    let streamer_user = streamer.user().unwrap_or_default().to_string();
    let mut plan = my::SetupPlan {
        database: database.clone(),
        tables: all_streams(source.shards, source.partitions).map(|id| source.stream_names(id).table).collect(),
        checkpoint_table: checkpoint_table(&source.table_prefix),
        prefix: source.table_prefix.clone(),
        shards: source.shards,
        partitions: source.partitions,
        streamer_accounts: vec![format!("{}@'<host>'", my::literal(&streamer_user))],
        app_grantees: app_roles.iter().map(|r| myprivileges::app_grantee(r)).collect(),
    };
    if dry_run {
        println!(
            "-- source {:?}: run in database {database:?} (<host>: each host of the streamer's account)",
            source.name
        );
        for stmt in my::statements(&plan, true) {
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
    let mut conn =
        crate::db::mysql::connect::mysql_connect(&admin).await.with_context(|| format!("source {:?}", source.name))?;
    let (settings, mut failures) = my::check_server(&mut conn).await?;
    failures.extend(myprivileges::check_admin(&mut conn, &database).await?);
    if failures.is_empty() {
        // Probing needs the grant option that check_admin just confirmed.
        failures.extend(myprivileges::check_app_accounts(&mut conn, &database, &plan.app_grantees).await?);
    }
    // The streamer's own session tells which account it matches and what that account holds;
    // without a default database, since setup has not granted it one yet.
    let streamer_session: Opts = OptsBuilder::from_opts(streamer.clone()).db_name(None::<String>).into();
    let streamer_account = match crate::db::mysql::connect::mysql_connect(&streamer_session).await {
        Ok(mut own) => {
            failures.extend(myprivileges::check_streamer(&mut own, &database).await?);
            let account = myprivileges::own_privileges(&mut own, &database).await?.account;
            own.disconnect().await.ok();
            Some(account)
        }
        Err(e) => {
            failures.push(my::CheckFailure {
                what: format!("the streamer's login (the source url) cannot connect: {e}"),
                fix: format!(
                    "CREATE USER {}@'%' IDENTIFIED BY '…'; GRANT REPLICATION SLAVE, BINLOG MONITOR ON *.* TO {}@'%'; or correct the url/password (see docs/configure-mysql.md)",
                    my::literal(&streamer_user),
                    my::literal(&streamer_user)
                ),
            });
            None
        }
    };
    if !failures.is_empty() {
        eprintln!(
            "source {:?}: the server ({}) is not ready for outbox-streamer (nothing was created):",
            source.name, settings.version
        );
        for f in &failures {
            eprintln!("  - {f}");
        }
        return Ok(false);
    }
    // Grant to every host of the streamer's user when setup may read them, else to the account
    // its session matched from here.
    plan.streamer_accounts = match myprivileges::account_hosts(&mut conn, &streamer_user).await? {
        Some(hosts) if !hosts.is_empty() => {
            hosts.iter().map(|h| format!("{}@{}", my::literal(&streamer_user), my::literal(h))).collect()
        }
        _ => streamer_account.into_iter().collect(),
    };
    let mut known = vec![streamer_user.clone()];
    known.extend(app_roles.iter().map(|r| r.split('@').next().unwrap_or(r).trim_matches('\'').to_string()));
    match myprivileges::insert_grantees(&mut conn, &database, &plan.tables[0], &known).await? {
        Some(earlier) if !earlier.is_empty() => {
            println!(
                "source {:?}: application account(s) {} can enqueue into existing tables; granting them the same on every table",
                source.name,
                earlier.join(", ")
            );
            plan.app_grantees.extend(earlier);
        }
        Some(_) => {}
        None if plan.app_grantees.is_empty() => {}
        None => println!(
            "source {:?}: setup may not read mysql.tables_priv, so pass --app-role again when you add shards or partitions",
            source.name
        ),
    }
    my::apply(&mut conn, &plan, settings.is_mariadb()).await.with_context(|| {
        format!("source {:?}: creating tables and checkpoints (re-running setup completes it)", source.name)
    })?;
    conn.disconnect().await.ok();
    println!(
        "source {:?}: {} shard-partition(s) ready in {database} on {} ({}_<shard>_<partition>, {}, {}_enqueue())",
        source.name,
        plan.tables.len(),
        settings.version,
        source.table_prefix,
        plan.checkpoint_table,
        source.table_prefix
    );
    Ok(true)
}
