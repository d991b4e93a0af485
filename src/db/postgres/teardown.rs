//! Teardown of a PostgreSQL source: each shard-partition's table, publication, slot and
//! checkpoint row together ([`outbox_postgres::teardown::drop_stream`]), then the message API's
//! table when there is one (`api.rs`), then the enqueue
//! function's overloads and the checkpoint table.

use anyhow::Context;
use outbox_postgres::setup::StreamObjects;
use outbox_postgres::teardown::{self as pg, Inventory, StreamDrop, TeardownPlan};

use super::connect::{pg_admin_target, pg_target};
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
    let streamer = pg_target(source, None)?;
    let target = match admin {
        Some(login) => pg_admin_target(source, login.url, login.password).context("--admin-url")?,
        None => streamer.clone(),
    };
    if target.database() != streamer.database() {
        anyhow::bail!(
            "--admin-url names database {:?}, but the source's url names {:?}: give the admin login of the source's database",
            target.database(),
            streamer.database()
        );
    }
    let mut client = target.connect().await.with_context(|| format!("connecting to {}", target.display()))?;
    let prefix = &source.table_prefix;
    let ids: Vec<_> = all_streams(source.shards, source.partitions).collect();
    let plan = TeardownPlan {
        table_prefix: prefix.clone(),
        slot_prefix: source.slot_prefix.clone().unwrap_or_else(|| prefix.clone()),
        streams: ids
            .iter()
            .map(|id| {
                let n = source.stream_names(*id);
                super::objects(n, false)
            })
            .collect(),
        checkpoint_table: checkpoint_table(prefix),
        enqueue_function: format!("{prefix}_enqueue"),
        streamer_role: streamer.user().to_string(),
    };
    let found = pg::inspect(&client, &plan).await.context("reading what exists")?;
    let mut section = Section::new(format!(
        "source {:?} (PostgreSQL database {:?} as {})",
        source.name,
        target.database(),
        target.user()
    ));
    let source_busy = running_streamer(&plan, &found);
    let mut remaining: Vec<String> = Vec::new();
    for stream in &found.streams {
        let key = format!("{}.{}", source.name, stream.objects.table);
        let candidate = stream_found(stream, cluster.map(|c| c.serving(&key)));
        let Some(verdict) = plan::stream_verdict(&candidate, source_busy.as_deref(), options.drop_pending) else {
            continue;
        };
        let objects = candidate.objects();
        let line = match (verdict, options.act) {
            (Verdict::Drop, true) => {
                match pg::drop_stream(&mut client, &plan, &stream.objects, options.drop_pending).await {
                    Ok(StreamDrop::Dropped { rows, publication, slot, checkpoint_row }) => {
                        Line::Drop(dropped_objects(&stream.objects, rows, publication, slot, checkpoint_row))
                    }
                    Ok(StreamDrop::Pending(rows)) => {
                        Line::Leave(plan::recounted(objects, rows), plan::PENDING_REASON.into())
                    }
                    Ok(StreamDrop::SlotActive(holder)) => {
                        Line::Leave(objects, slot_in_use(&stream.objects.slot, &holder))
                    }
                    Err(e) => Line::Leave(objects, reason(&e)),
                }
            }
            (verdict, _) => match verdict {
                Verdict::Drop => Line::Drop(objects),
                Verdict::Leave(why) => Line::Leave(objects, why),
            },
        };
        if matches!(line, Line::Leave(..)) && stream.rows.is_some() {
            remaining.push(stream.objects.table.clone());
        }
        section.lines.push(line);
    }
    let stray_tables: Vec<String> = found.strays.iter().filter(|s| s.kind == "table").map(|s| s.name.clone()).collect();
    remaining.extend(stray_tables);
    // The message API's table before the enqueue function: a prepared message left in it still
    // needs the function to be committed.
    if let Some(line) = super::api::tear_down(&mut client, prefix, source_busy.as_deref(), options).await {
        if matches!(line, Line::Leave(..)) {
            remaining.push(super::api::table(prefix));
        }
        section.lines.push(line);
    }
    shared(&mut client, &plan, &found, &remaining, source_busy.as_deref(), options, &mut section).await;
    for stray in &found.strays {
        let object = match stray.kind {
            "table" => Object::Table { name: stray.name.clone(), rows: None },
            "publication" => Object::Publication(stray.name.clone()),
            _ => Object::Slot(stray.name.clone()),
        };
        section.lines.push(Line::Leave(vec![object], plan::stray_reason(source.shards, source.partitions)));
    }
    for foreign in &found.foreign_slots {
        let whose = match (foreign.database.as_str(), foreign.plugin.as_str()) {
            ("", _) => "a physical slot".to_string(),
            (db, "pgoutput") => format!("database {db:?}'s slot"),
            (db, plugin) => format!("a {plugin:?} slot of database {db:?}"),
        };
        section.lines.push(Line::Note(format!(
            "replication slot {:?} is {whose}, not this source's (slot names are cluster-wide): not touched",
            foreign.slot
        )));
    }
    Ok(section)
}

/// Why nothing of the source may be touched: sessions of the streamer's login in this database.
fn running_streamer(plan: &TeardownPlan, found: &Inventory) -> Option<String> {
    if found.streamer_sessions.is_empty() {
        return None;
    }
    let sessions: Vec<String> =
        found.streamer_sessions.iter().map(|s| format!("pid {} {:?}", s.pid, s.application_name)).collect();
    Some(format!(
        "a streamer is running: the streamer login {:?} has sessions in this database ({}); stop it first",
        plan.streamer_role,
        sessions.join(", ")
    ))
}

/// The generic view of one shard-partition; `serving` lists the registered instances that
/// serve it.
fn stream_found(stream: &pg::StreamFound, serving: Option<Vec<String>>) -> StreamFound {
    let o = &stream.objects;
    let mut others = Vec::new();
    if stream.publication {
        others.push(Object::Publication(o.publication.clone()));
    }
    if stream.slot.is_some() {
        others.push(Object::Slot(o.slot.clone()));
    }
    if stream.checkpoint_row {
        others.push(Object::CheckpointRow(o.table.clone()));
    }
    let busy = match (&stream.slot, serving) {
        (Some(Some(holder)), _) => Some(slot_in_use(&o.slot, holder)),
        (_, Some(instances)) if !instances.is_empty() => Some(plan::served_reason(&instances)),
        _ => None,
    };
    StreamFound { table: o.table.clone(), rows: stream.rows, others, busy }
}

fn slot_in_use(slot: &str, holder: &pg::Session) -> String {
    format!(
        "replication slot {slot:?} is in use by pid {} ({:?}): a streamer is running; stop it first",
        holder.pid, holder.application_name
    )
}

fn dropped_objects(o: &StreamObjects, rows: Option<i64>, publication: bool, slot: bool, row: bool) -> Vec<Object> {
    let mut objects = Vec::new();
    if rows.is_some() {
        objects.push(Object::Table { name: o.table.clone(), rows });
    }
    if publication {
        objects.push(Object::Publication(o.publication.clone()));
    }
    if slot {
        objects.push(Object::Slot(o.slot.clone()));
    }
    if row {
        objects.push(Object::CheckpointRow(o.table.clone()));
    }
    objects
}

/// The enqueue function's overloads and the checkpoint table: dropped once no table needs them.
async fn shared(
    client: &mut tokio_postgres::Client,
    plan: &TeardownPlan,
    found: &Inventory,
    remaining: &[String],
    source_busy: Option<&str>,
    options: Options,
    section: &mut Section,
) {
    let mut objects: Vec<Object> = found.functions.iter().map(|f| Object::Function(f.clone())).collect();
    if found.checkpoint_table {
        objects.push(Object::CheckpointTable(plan.checkpoint_table.clone()));
    }
    if objects.is_empty() {
        return;
    }
    let verdict = plan::shared_verdict(remaining, source_busy);
    if !options.act || verdict != Verdict::Drop {
        section.verdict(objects, verdict);
        return;
    }
    for object in objects {
        let result = match &object {
            Object::Function(signature) => pg::drop_function(client, signature).await,
            _ => pg::drop_checkpoint_table(client, plan).await,
        };
        section.lines.push(match result {
            Ok(()) => Line::Drop(vec![object]),
            Err(e) => Line::Leave(vec![object], reason(&e)),
        });
    }
}

/// A failed statement as a reason to leave an object, with what to do for the usual causes.
pub(super) fn reason(e: &tokio_postgres::Error) -> String {
    let text = plan::db_reason(e);
    let fix = match e.code().map(|c| c.code()) {
        Some("55P03") => "; a transaction of the application or a streamer holds the table: try again when it ends",
        Some("55006") => "; a streamer is running: stop it first",
        Some("42501") => {
            "; run teardown as the owner of the objects, with the REPLICATION attribute for slots (--admin-url or OUTBOX_SETUP_URL)"
        }
        Some("2BP01") => "; drop or change what depends on it first (teardown never cascades)",
        _ => "",
    };
    format!("{text}{fix}")
}
