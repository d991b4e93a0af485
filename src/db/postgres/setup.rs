//! `setup` of a PostgreSQL source: checks the server (settings, slots, privileges), then creates
//! each shard-partition's table, publication and slot, the checkpoint table and the enqueue
//! function, and grants what the streamer and the application roles need.

use anyhow::Context;
use outbox_postgres::connect::PgTarget;
use outbox_postgres::privileges;
use outbox_postgres::setup::{self as pg, SetupPlan, StreamObjects};

use super::connect::{pg_admin_target, pg_target};
use crate::config::SourceConfig;
use crate::db::SetupRequest;
use crate::names::all_streams;

/// The setup plan of a PostgreSQL source; the streamer role is the source URL's user.
fn postgres_plan(source: &SourceConfig, streamer: &PgTarget, app_roles: &[String]) -> SetupPlan {
    SetupPlan {
        prefix: source.table_prefix.clone(),
        shards: source.shards,
        partitions: source.partitions,
        streams: all_streams(source.shards, source.partitions)
            .map(|id| {
                let n = source.stream_names(id);
                let wal = source.settings_for(id).storage == crate::config::Storage::Wal;
                super::objects(n, wal)
            })
            .collect(),
        streamer_role: Some(streamer.user().to_string()),
        app_roles: app_roles.to_vec(),
        owns_tables: source.layout().owns_tables(),
    }
}

/// Checks the server, then creates the schema and the slots (see [`crate::db::Database::setup`]).
pub(super) async fn setup(source: &SourceConfig, how: &SetupRequest<'_>) -> anyhow::Result<bool> {
    let SetupRequest { dry_run, admin, app_roles, restrict_emit, create_tables, prepared_wait, .. } = *how;
    let serves_api = how.serves_api(source);
    let streamer = pg_target(source, None)?;
    let mut plan = postgres_plan(source, &streamer, app_roles);
    if dry_run {
        println!("-- source {:?}: run in database {:?}", source.name, streamer.database());
        for stmt in pg::schema_statements(&plan) {
            println!("{stmt};\n");
        }
        if serves_api {
            println!("-- the message API's table ([api] source = {:?}):", source.name);
            for stmt in super::api::setup_statements(&plan) {
                println!("{stmt};\n");
            }
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
    if !plan.owns_tables {
        let tables: Vec<String> = plan.streams.iter().map(|s| s.table.clone()).collect();
        // Only on a server ready otherwise: a failed setup creates nothing.
        if create_tables && failures.is_empty() {
            let quoted: Vec<String> = tables.iter().map(|t| outbox_postgres::setup::ident(t)).collect();
            for create in crate::db::create_missing_tables(source, &quoted, true)? {
                client.batch_execute(&create).await.with_context(|| format!("source {:?}: {create}", source.name))?;
            }
        }
        let found: Vec<(String, String, String)> = client
            .query(
                "SELECT table_name::text, column_name::text, data_type::text FROM information_schema.columns \
                 WHERE table_schema = current_schema() AND table_name = ANY($1)",
                &[&tables],
            )
            .await?
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect();
        // A table identified by a uuid is read by key — in CDC only (see `super::keyed`).
        let polled: Vec<String> = crate::job::stream_plans(source)
            .into_iter()
            .filter(|(_, settings, _)| settings.mode == crate::config::Mode::Polling)
            .map(|(_, _, names)| names.table)
            .collect();
        let (polled, streamed): (Vec<String>, Vec<String>) = tables.iter().cloned().partition(|t| polled.contains(t));
        let mut problems = source.layout().check_tables(&streamed, &found, true, true);
        problems.extend(source.layout().check_tables(&polled, &found, true, false));
        let keyed = crate::layout::uuid_keyed(source.layout(), &streamed, &found, true);
        problems.extend(keyed_rows_before_slot(&client, source, &keyed).await?);
        let unique: Vec<String> = client
            .query(
                "SELECT c.relname::text FROM pg_class c
                 WHERE c.relnamespace = current_schema()::regnamespace AND c.relname = ANY($1)
                   AND EXISTS (SELECT 1 FROM pg_index i
                               JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
                               WHERE i.indrelid = c.oid AND i.indisunique AND i.indnatts = 1
                                 AND i.indpred IS NULL AND a.attname = $2)",
                &[&tables, &source.layout().id_column()],
            )
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        let mut generated: Vec<String> = client
            .query(
                "SELECT table_name::text FROM information_schema.columns
                 WHERE table_schema = current_schema() AND table_name = ANY($1) AND column_name = $2
                   AND (is_identity = 'YES' OR column_default LIKE 'nextval(%')",
                &[&tables, &source.layout().id_column()],
            )
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        // A uuid is not numbered, and need not be: nothing orders such a table.
        generated.extend(keyed);
        problems.extend(source.layout().id_column_problems(&tables, &found, &unique, &generated, true));
        failures.extend(problems.into_iter().map(|(what, fix)| pg::CheckFailure { what, fix }));
    }
    failures.extend(
        pg::taken_slots(&client, &plan).await?.iter().map(|t| taken_slot_failure(source, streamer.database(), t)),
    );
    failures.extend(privileges::check_admin(&client, &plan, prepared_wait).await?);
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
    for lost in lost_wal_slots(&client, &plan).await? {
        eprintln!(
            "source {:?}: warning (storage = \"wal\"): {lost}: it is created again now, and the WAL-only messages committed after its last position were never read and may be lost",
            source.name
        );
    }
    let waiting = privileges::open_transactions(&client, OLD_TRANSACTION_S).await?;
    if !waiting.is_empty() {
        eprintln!(
            "source {:?}: a new replication slot waits until these open transactions end: {}",
            source.name,
            waiting.join("; ")
        );
    }
    // The check above waited only for the prepared transactions it first saw: one prepared
    // since (by a transaction manager, or left over) holds up the new slot just the same, and
    // without a word setup would seem to hang.
    let slots: Vec<String> = plan.streams.iter().map(|s| s.slot.clone()).collect();
    let prepared: Vec<String> = client
        .query(
            "SELECT format('%L in database %I', gid, database) FROM pg_prepared_xacts
             WHERE (SELECT count(*) FROM pg_replication_slots WHERE slot_name = ANY($1)) < cardinality($1)
             ORDER BY prepared",
            &[&slots],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    if !prepared.is_empty() {
        eprintln!(
            "source {:?}: a slot still to be created waits until these prepared transactions are decided \
             (COMMIT PREPARED or ROLLBACK PREPARED in their database): {}",
            source.name,
            prepared.join(", ")
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
    if serves_api {
        let statements = super::api::setup_statements(&plan);
        client.batch_execute(&statements.join(";\n")).await.map_err(|e| {
            anyhow::anyhow!("source {:?}: creating the message API's table: {}", source.name, pg::describe(&e))
        })?;
        println!(
            "source {:?}: the message API's table {} is ready; the streamer login may enqueue",
            source.name,
            super::api::table(&plan.prefix)
        );
    }
    let failures = pg::check_privileges(&client, &plan).await?;
    for f in &failures {
        eprintln!("source {:?}: {f}", source.name);
    }
    if plan.any_wal() {
        let keep: String = client.query_one("SHOW max_slot_wal_keep_size", &[]).await?.get(0);
        let roles: Vec<String> = plan.streamer_role.iter().chain(&plan.app_roles).cloned().collect();
        if restrict_emit {
            let statements = pg::restrict_emit_statements(&client, &roles).await?;
            client.batch_execute(&statements.join(";\n")).await.map_err(|e| {
                anyhow::anyhow!(
                    "source {:?}: --restrict-emit: {}; run setup as a superuser, or have one run: {}",
                    source.name,
                    pg::describe(&e),
                    statements.join("; ")
                )
            })?;
            println!("source {:?}: only {} may call pg_logical_emit_message now", source.name, roles.join(", "));
        }
        let risks = [pg::wal_retention_risk(&keep), pg::emit_forgery_risk(&client, &roles).await?];
        for risk in risks.into_iter().flatten() {
            eprintln!("source {:?}: warning (storage = \"wal\"): {risk}", source.name);
        }
    } else if restrict_emit {
        eprintln!(
            "source {:?}: --restrict-emit: no shard-partition has storage = \"wal\"; nothing changed",
            source.name
        );
    }
    println!(
        "source {:?}: {} shard-partition(s) ready in {} ({}_<shard>_<partition>: {}, publication{}{})",
        source.name,
        plan.streams.len(),
        streamer.database(),
        plan.prefix,
        if plan.owns_tables {
            "table".to_string()
        } else {
            format!("table of layout {} (checked)", source.layout().as_str())
        },
        match &source.slot_prefix {
            Some(slot_prefix) => format!("; slot {slot_prefix}_<shard>_<partition>"),
            None => ", slot".into(),
        },
        if plan.owns_tables { format!("; {p}_enqueue(), {p}_emit()", p = plan.prefix) } else { String::new() }
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

/// The `wal` shard-partitions whose slot is missing although an earlier setup created them
/// (their checkpoint row exists): re-creating it resumes after a loss, which is said aloud.
async fn lost_wal_slots(client: &tokio_postgres::Client, plan: &SetupPlan) -> anyhow::Result<Vec<String>> {
    let wal: Vec<&StreamObjects> = plan.streams.iter().filter(|s| s.wal).collect();
    if wal.is_empty() {
        return Ok(Vec::new());
    }
    let checkpoint = plan.checkpoint_table();
    let known: bool = client.query_one("SELECT to_regclass($1) IS NOT NULL", &[&pg::ident(&checkpoint)]).await?.get(0);
    if !known {
        return Ok(Vec::new());
    }
    let mut lost = Vec::new();
    for s in wal {
        let sql = format!(
            "SELECT EXISTS (SELECT 1 FROM {} WHERE stream = $1)
                AND NOT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $2 AND database = current_database())",
            pg::ident(&checkpoint)
        );
        if client.query_one(&sql, &[&s.table, &s.slot]).await?.get::<_, bool>(0) {
            lost.push(format!("replication slot {:?} of {} is missing", s.slot, s.table));
        }
    }
    Ok(lost)
}

/// The tables of `keyed` (identified by a uuid) that hold rows while their slot does not exist
/// yet: the log never carries those rows, and such a table cannot be caught up (nothing orders
/// it), so setup refuses rather than leave them unsent.
async fn keyed_rows_before_slot(
    client: &tokio_postgres::Client,
    source: &SourceConfig,
    keyed: &[String],
) -> anyhow::Result<Vec<(String, String)>> {
    let mut problems = Vec::new();
    for (_, _, names) in crate::job::stream_plans(source).into_iter().filter(|(_, _, n)| keyed.contains(&n.table)) {
        let sql = format!(
            "SELECT NOT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1) AND EXISTS (SELECT 1 FROM {})",
            pg::ident(&names.table)
        );
        if client.query_one(&sql, &[&names.slot]).await?.get::<_, bool>(0) {
            let (table, id) = (pg::ident(&names.table), pg::ident(source.layout().id_column()));
            problems.push((
                format!(
                    "table {} holds rows and its replication slot {:?} does not exist yet: rows written before the slot are not in its log, and a table identified by the uuid {id} alone cannot be caught up",
                    names.table, names.slot
                ),
                format!(
                    "delete the rows already sent (with the old relay stopped and the application's writes paused, or rows written meanwhile are lost: DELETE FROM {table};), or give the table an order so `run` sends them first: ALTER TABLE {table} ADD COLUMN seq bigint GENERATED ALWAYS AS IDENTITY UNIQUE; and set id = \"seq\" in [source.columns]"
                ),
            ));
        }
    }
    Ok(problems)
}

/// Transactions open longer than this are named while a new slot may wait on them.
const OLD_TRANSACTION_S: f64 = 5.0;
