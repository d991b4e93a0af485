//! Teardown of a MySQL/MariaDB source: each shard-partition's table with its checkpoint row
//! ([`outbox_mysql::teardown::drop_table`]) and then the grants on it, then the message API's
//! table and its grants when there is one (`api.rs`), then the enqueue routine, the checkpoint
//! table and its grants.

use anyhow::Context;
use outbox_mysql::mysql_async::{Conn, Error as MyError};
use outbox_mysql::teardown::{self as my, Inventory, TableDrop, TableGrant, TeardownPlan};

use super::connect::{mysql_admin_opts, mysql_connect, mysql_opts};
use crate::config::SourceConfig;
use crate::db::AdminLogin;
use crate::db::teardown::{self as plan, Line, Members, Object, Options, Section, StreamFound, Verdict};
use crate::names::{all_streams, checkpoint_table};

pub(super) async fn tear_down(
    source: &SourceConfig,
    admin: Option<AdminLogin<'_>>,
    options: Options,
    cluster: Option<&dyn Members>,
) -> anyhow::Result<Section> {
    let streamer = mysql_opts(source, None)?;
    let opts = match admin {
        Some(login) => mysql_admin_opts(source, login.url, login.password).context("--admin-url")?,
        None => streamer.clone(),
    };
    let mut conn = mysql_connect(&opts).await?;
    let prefix = &source.table_prefix;
    let plan = TeardownPlan {
        database: streamer.db_name().unwrap_or_default().to_string(),
        table_prefix: prefix.clone(),
        tables: all_streams(source.shards, source.partitions).map(|id| source.stream_names(id).table).collect(),
        checkpoint_table: checkpoint_table(prefix),
        enqueue_routine: format!("{prefix}_enqueue"),
        streamer_user: streamer.user().unwrap_or_default().to_string(),
    };
    let found = my::inspect(&mut conn, &plan).await.context("reading what exists")?;
    let mut section = Section::new(format!(
        "source {:?} (MySQL/MariaDB database {:?} as {})",
        source.name,
        plan.database,
        opts.user().unwrap_or("?")
    ));
    let source_busy = running_streamer(&plan, &found);
    let grants: &[TableGrant] = match &found.grants {
        Ok(grants) => grants,
        Err(why) => {
            section.lines.push(Line::Note(format!(
                "cannot read mysql.tables_priv ({why}): grants on these tables are not revoked; \
                 SHOW GRANTS for the streamer's login and REVOKE those on the dropped tables"
            )));
            &[]
        }
    };
    let grants_on = |table: &str| -> Vec<&TableGrant> { grants.iter().filter(|g| g.table == table).collect() };
    let mut remaining = Vec::new();
    for table in &found.tables {
        let key = format!("{}.{}", source.name, table.table);
        let on_table = grants_on(&table.table);
        let mut others = Vec::new();
        if table.checkpoint_row {
            others.push(Object::CheckpointRow(table.table.clone()));
        }
        others.extend(on_table.iter().map(|g| grants_object(g)));
        let busy = cluster.map(|c| c.serving(&key)).filter(|i| !i.is_empty()).map(|i| plan::served_reason(&i));
        let candidate = StreamFound { table: table.table.clone(), rows: table.rows, others, busy };
        let Some(verdict) = plan::stream_verdict(&candidate, source_busy.as_deref(), options.drop_pending) else {
            continue;
        };
        let objects = candidate.objects();
        if !options.act || verdict != Verdict::Drop {
            if matches!(verdict, Verdict::Leave(_)) && table.rows.is_some() {
                remaining.push(table.table.clone());
            }
            section.verdict(objects, verdict);
            continue;
        }
        match my::drop_table(&mut conn, &plan, &table.table, found.checkpoint_table, options.drop_pending).await {
            Ok(TableDrop::Dropped { rows, checkpoint_row }) => {
                let mut dropped = Vec::new();
                if rows.is_some() {
                    dropped.push(Object::Table { name: table.table.clone(), rows });
                }
                if checkpoint_row {
                    dropped.push(Object::CheckpointRow(table.table.clone()));
                }
                let (revoked, failed) = revoke_all(&mut conn, &plan, &on_table).await;
                dropped.extend(revoked);
                section.lines.push(Line::Drop(dropped));
                section.lines.extend(failed);
            }
            Ok(TableDrop::Pending(rows)) => {
                remaining.push(table.table.clone());
                section.lines.push(Line::Leave(plan::recounted(objects, rows), plan::PENDING_REASON.into()));
            }
            Err(e) => {
                remaining.push(table.table.clone());
                section.lines.push(Line::Leave(objects, reason(&e)));
            }
        }
    }
    remaining.extend(found.strays.iter().cloned());
    // The message API's table before the enqueue routine: a prepared message left in it still
    // needs the routine to be committed.
    let api_lines = super::api::tear_down(&mut conn, &plan, source_busy.as_deref(), options).await;
    if api_lines.iter().any(
        |l| matches!(l, Line::Leave(objects, _) if objects.iter().any(|o| matches!(o, Object::MessageTable { .. }))),
    ) {
        remaining.push(super::api::table(prefix));
    }
    section.lines.extend(api_lines);
    let on_checkpoint = grants_on(&plan.checkpoint_table);
    shared(&mut conn, &plan, &found, &on_checkpoint, &remaining, source_busy.as_deref(), options, &mut section).await;
    for stray in &found.strays {
        section.lines.push(Line::Leave(
            vec![Object::Table { name: stray.clone(), rows: None }],
            plan::stray_reason(source.shards, source.partitions),
        ));
    }
    conn.disconnect().await.ok();
    Ok(section)
}

/// Why nothing of the source may be touched: sessions of the streamer's login.
fn running_streamer(plan: &TeardownPlan, found: &Inventory) -> Option<String> {
    if found.streamer_sessions.is_empty() {
        return None;
    }
    let sessions: Vec<String> =
        found.streamer_sessions.iter().map(|s| format!("id {} {:?} from {}", s.id, s.command, s.host)).collect();
    Some(format!(
        "a streamer is running: the streamer login {:?} has sessions ({}); stop it first",
        plan.streamer_user,
        sessions.join(", ")
    ))
}

fn grants_object(grant: &TableGrant) -> Object {
    Object::Grants { grantee: grant.grantee(), table: grant.table.clone() }
}

/// Revokes `grants`; returns the revoked ones and a line for each that failed.
async fn revoke_all(conn: &mut Conn, plan: &TeardownPlan, grants: &[&TableGrant]) -> (Vec<Object>, Vec<Line>) {
    let (mut revoked, mut failed) = (Vec::new(), Vec::new());
    for grant in grants {
        match my::revoke(conn, plan, grant).await {
            Ok(()) => revoked.push(grants_object(grant)),
            Err(e) => failed.push(Line::Leave(vec![grants_object(grant)], reason(&e))),
        }
    }
    (revoked, failed)
}

/// The enqueue routine, the checkpoint table and its grants: dropped once no table needs them.
#[allow(clippy::too_many_arguments)]
async fn shared(
    conn: &mut Conn,
    plan: &TeardownPlan,
    found: &Inventory,
    checkpoint_grants: &[&TableGrant],
    remaining: &[String],
    source_busy: Option<&str>,
    options: Options,
    section: &mut Section,
) {
    let mut objects: Vec<Object> =
        found.routines.iter().map(|r| Object::Routine { kind: r.kind.clone(), name: r.name.clone() }).collect();
    if found.checkpoint_table {
        objects.push(Object::CheckpointTable(plan.checkpoint_table.clone()));
    }
    objects.extend(checkpoint_grants.iter().map(|g| grants_object(g)));
    if objects.is_empty() {
        return;
    }
    let verdict = plan::shared_verdict(remaining, source_busy);
    if !options.act || verdict != Verdict::Drop {
        section.verdict(objects, verdict);
        return;
    }
    for routine in &found.routines {
        let object = Object::Routine { kind: routine.kind.clone(), name: routine.name.clone() };
        section.lines.push(match my::drop_routine(conn, plan, routine).await {
            Ok(()) => Line::Drop(vec![object]),
            Err(e) => Line::Leave(vec![object], reason(&e)),
        });
    }
    if found.checkpoint_table {
        let object = Object::CheckpointTable(plan.checkpoint_table.clone());
        match my::drop_checkpoint_table(conn, plan).await {
            Ok(()) => section.lines.push(Line::Drop(vec![object])),
            Err(e) => {
                // Its grants stay with it: the streamer still reads a table that is there.
                let mut kept = vec![object];
                kept.extend(checkpoint_grants.iter().map(|g| grants_object(g)));
                section.lines.push(Line::Leave(kept, reason(&e)));
                return;
            }
        }
    }
    let (revoked, failed) = revoke_all(conn, plan, checkpoint_grants).await;
    if !revoked.is_empty() {
        section.lines.push(Line::Drop(revoked));
    }
    section.lines.extend(failed);
}

/// A failed statement as a reason to leave an object, with what to do for the usual causes.
pub(super) fn reason(e: &MyError) -> String {
    let text = plan::db_reason(e);
    let code = match e {
        MyError::Server(s) => Some(s.code),
        _ => None,
    };
    let fix = match code {
        Some(1205) => "; a transaction of the application or a streamer holds the table: try again when it ends",
        Some(1044 | 1142 | 1227 | 1370) => {
            "; run teardown as a login that may drop the tables and revoke their grants (--admin-url or OUTBOX_SETUP_URL)"
        }
        _ => "",
    };
    format!("{text}{fix}")
}
