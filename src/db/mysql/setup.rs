//! `setup` of a MySQL/MariaDB source: checks the server and the accounts, then creates each
//! shard-partition's table, the checkpoint table and its rows, and the enqueue procedure, and
//! grants what the streamer and the application accounts need.

use anyhow::Context;
use outbox_mysql::mysql_async::prelude::Queryable;
use outbox_mysql::mysql_async::{Conn, Opts, OptsBuilder};
use outbox_mysql::privileges as myprivileges;
use outbox_mysql::setup as my;

use super::connect::{mysql_admin_opts, mysql_opts};
use crate::config::{SourceConfig, Storage};
use crate::db::SetupRequest;
use crate::names::{all_streams, checkpoint_table};

/// Checks the server and the accounts, then creates the tables and checkpoint rows (see
/// [`crate::db::Database::setup`]).
pub(super) async fn setup(source: &SourceConfig, how: &SetupRequest<'_>) -> anyhow::Result<bool> {
    let SetupRequest { dry_run, admin, app_roles, create_tables, .. } = *how;
    let serves_api = how.serves_api(source);
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
        wal_tables: all_streams(source.shards, source.partitions)
            .filter(|id| source.settings_for(*id).storage == Storage::Wal)
            .map(|id| source.stream_names(id).table)
            .collect(),
        owns_tables: source.layout().owns_tables(),
    };
    if dry_run {
        println!(
            "-- source {:?}: run in database {database:?} (<host>: each host of the streamer's account)",
            source.name
        );
        for stmt in my::statements(&plan, true) {
            println!("{stmt};\n");
        }
        if serves_api {
            println!("-- the message API's table ([api] source = {:?}):", source.name);
            for stmt in super::api::setup_statements(&plan) {
                println!("{stmt};\n");
            }
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
    let mut conn = super::connect::mysql_connect(&admin).await.with_context(|| format!("source {:?}", source.name))?;
    let (settings, mut failures) = my::check_server(&mut conn).await?;
    failures.extend(myprivileges::check_admin(&mut conn, &database).await?);
    if !source.layout().owns_tables() {
        // Only on a server ready otherwise: a failed setup creates nothing.
        if create_tables && failures.is_empty() {
            let quoted: Vec<String> = plan.tables.iter().map(|t| my::ident(t)).collect();
            for create in crate::db::create_missing_tables(source, &quoted, false)? {
                conn.query_drop(&create).await.with_context(|| format!("source {:?}: {create}", source.name))?;
            }
        }
        let listed: Vec<String> = plan.tables.iter().map(|t| my::literal(t)).collect();
        let found: Vec<(String, String, String)> = conn
            .query(format!(
                "SELECT table_name, column_name, data_type FROM information_schema.columns \
                 WHERE table_schema = DATABASE() AND table_name IN ({})",
                listed.join(", ")
            ))
            .await?;
        // A table identified by a text key is read by key — in CDC only (see `super::keyed`).
        let polled: Vec<String> = crate::job::stream_plans(source)
            .into_iter()
            .filter(|(_, settings, _)| settings.mode == crate::config::Mode::Polling)
            .map(|(_, _, names)| names.table)
            .collect();
        let (polled, streamed): (Vec<String>, Vec<String>) =
            plan.tables.iter().cloned().partition(|t| polled.contains(t));
        let mut problems = source.layout().check_tables(&streamed, &found, false, true);
        problems.extend(source.layout().check_tables(&polled, &found, false, false));
        let keyed = crate::layout::uuid_keyed(source.layout(), &streamed, &found, false);
        problems.extend(keyed_rows_before_checkpoint(&mut conn, source, &keyed).await?);
        let unique: Vec<String> = conn
            .exec(
                format!(
                    "SELECT table_name FROM information_schema.statistics \
                     WHERE table_schema = DATABASE() AND table_name IN ({}) AND non_unique = 0 \
                     GROUP BY table_name, index_name HAVING COUNT(*) = 1 AND MAX(column_name) = ?",
                    listed.join(", ")
                ),
                (source.layout().id_column(),),
            )
            .await?;
        let mut generated: Vec<String> = conn
            .exec(
                format!(
                    "SELECT table_name FROM information_schema.columns \
                     WHERE table_schema = DATABASE() AND table_name IN ({}) AND column_name = ? \
                       AND extra LIKE '%auto_increment%'",
                    listed.join(", ")
                ),
                (source.layout().id_column(),),
            )
            .await?;
        // A key is not numbered, and need not be: nothing orders such a table.
        generated.extend(keyed);
        problems.extend(source.layout().id_column_problems(&plan.tables, &found, &unique, &generated, false));
        failures.extend(problems.into_iter().map(|(what, fix)| my::CheckFailure { what, fix }));
    }
    let (changes, storage_failures) = my::storage_changes(&mut conn, &plan).await?;
    failures.extend(storage_failures);
    if failures.is_empty() {
        // Probing needs the grant option that check_admin just confirmed.
        failures.extend(myprivileges::check_app_accounts(&mut conn, &database, &plan.app_grantees).await?);
    }
    // The streamer's own session tells which account it matches and what that account holds;
    // without a default database, since setup has not granted it one yet.
    let streamer_session: Opts = OptsBuilder::from_opts(streamer.clone()).db_name(None::<String>).into();
    let streamer_account = match super::connect::mysql_connect(&streamer_session).await {
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
    if changes.install_blackhole {
        println!(
            "source {:?}: installing the BLACKHOLE engine for storage = \"wal\" (INSTALL SONAME 'ha_blackhole')",
            source.name
        );
        let fix = "install it as root (INSTALL SONAME 'ha_blackhole'), or add plugin_load_add = ha_blackhole to the server's configuration and restart it; then run setup again";
        match my::install_blackhole(&mut conn, settings.is_mariadb()).await {
            Ok(None) => {}
            Ok(Some(why)) => anyhow::bail!(
                "source {:?}: {why}; nothing was created. A plugin uninstalled while in use is removed only when the server restarts: restart it, then {fix}",
                source.name
            ),
            Err(e) => anyhow::bail!(
                "source {:?}: installing the BLACKHOLE engine for storage = \"wal\": {e}; nothing was created. {fix}",
                source.name
            ),
        }
    }
    my::apply(&mut conn, &plan, settings.is_mariadb(), &changes).await.with_context(|| {
        format!("source {:?}: creating tables and checkpoints (re-running setup completes it)", source.name)
    })?;
    if !plan.wal_tables.is_empty() {
        let expire_s: Option<u64> = conn.query_first("SELECT @@binlog_expire_logs_seconds").await.ok().flatten();
        if let Some(risk) = expire_s.and_then(|s| super::wal::retention_risk(s, source.log_retention_min_hours)) {
            eprintln!("source {:?}: warning (storage = \"wal\"): {risk}", source.name);
        }
    }
    if serves_api {
        for stmt in super::api::setup_statements(&plan) {
            conn.query_drop(&stmt).await.with_context(|| {
                format!("source {:?}: creating the message API's table (re-running setup completes it)", source.name)
            })?;
        }
        println!(
            "source {:?}: the message API's table {} is ready; the streamer login may enqueue",
            source.name,
            super::api::table(&plan.prefix)
        );
    }
    conn.disconnect().await.ok();
    println!(
        "source {:?}: {} shard-partition(s) ready in {database} on {} ({}_<shard>_<partition>{}, {}{})",
        source.name,
        plan.tables.len(),
        settings.version,
        source.table_prefix,
        if plan.owns_tables { String::new() } else { format!(" of layout {}, checked", source.layout().as_str()) },
        plan.checkpoint_table,
        if plan.owns_tables { format!(", {}_enqueue()", source.table_prefix) } else { String::new() }
    );
    Ok(true)
}

/// The tables of `keyed` (identified by a text key) that hold rows while the stream has no
/// checkpoint yet: the binlog position setup stores starts after them, and such a table cannot
/// be caught up (nothing orders it), so setup refuses rather than leave them unsent.
async fn keyed_rows_before_checkpoint(
    conn: &mut Conn,
    source: &SourceConfig,
    keyed: &[String],
) -> anyhow::Result<Vec<(String, String)>> {
    let checkpoint = checkpoint_table(&source.table_prefix);
    let known: Option<i64> = conn
        .exec_first(
            "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = ?",
            (&checkpoint,),
        )
        .await?;
    let mut problems = Vec::new();
    for table in keyed {
        let started: Option<i64> = if known.unwrap_or(0) > 0 {
            conn.exec_first(format!("SELECT COUNT(*) FROM {} WHERE stream = ?", my::ident(&checkpoint)), (table,))
                .await?
        } else {
            Some(0)
        };
        let holds: Option<i64> =
            conn.query_first(format!("SELECT EXISTS (SELECT 1 FROM {})", my::ident(table))).await?;
        if started.unwrap_or(0) == 0 && holds.unwrap_or(0) == 1 {
            let (t, id) = (my::ident(table), my::ident(source.layout().id_column()));
            problems.push((
                format!(
                    "table {table} holds rows and its stream has no binlog position yet: the position setup stores starts after them, and a table identified by the text {id} alone cannot be caught up"
                ),
                format!(
                    "delete the rows already sent (with the old relay stopped and the application's writes paused, or rows written meanwhile are lost: DELETE FROM {t};), or give the table an order so `run` sends them first: ALTER TABLE {t} ADD COLUMN seq BIGINT NOT NULL AUTO_INCREMENT UNIQUE; and set id = \"seq\" in [source.columns]"
                ),
            ));
        }
    }
    Ok(problems)
}
