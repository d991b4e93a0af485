//! What `teardown` finds of the objects `setup` created in one database, and how it removes
//! them.
//!
//! A shard-partition's table, publication, slot and checkpoint row go together, in one
//! transaction that holds the table in `ACCESS EXCLUSIVE` mode from the moment its rows are
//! counted until the commit: no row can arrive between the count and the drop, so "the table
//! was empty" (or "these N rows were dropped") is exact. The slot is dropped last inside that
//! transaction; `pg_drop_replication_slot` is not transactional, but it fails on a slot a
//! session reads (SQLSTATE 55006), which rolls the whole shard-partition back.
//!
//! Only this database's `pgoutput` slots are looked at for dropping: slot names are
//! cluster-wide, and a slot of the same name in another database belongs to someone else.
//! Nothing is dropped with `IF EXISTS` or `CASCADE`: what does not exist is not named, and an
//! object something else depends on (a view over an outbox table) is left with the server's
//! message.

use tokio_postgres::{Client, GenericClient};

use crate::setup::{StreamObjects, ident, literal};

/// What teardown looks for in one database.
#[derive(Debug, Clone)]
pub struct TeardownPlan {
    /// Tables are `<table_prefix>_<shard>_<partition>`.
    pub table_prefix: String,
    /// Slots are `<slot_prefix>_<shard>_<partition>` (the table prefix unless configured).
    pub slot_prefix: String,
    /// The configured shard-partitions.
    pub streams: Vec<StreamObjects>,
    /// `<prefix>_checkpoint`.
    pub checkpoint_table: String,
    /// `<prefix>_enqueue`: every overload in the current schema is removed.
    pub enqueue_function: String,
    /// The streamer's login: its `outbox-streamer` sessions in this database mean a streamer
    /// runs.
    pub streamer_role: String,
}

/// A session of the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    pub pid: i32,
    pub application_name: String,
}

/// What exists of one configured shard-partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamFound {
    pub objects: StreamObjects,
    /// Rows in the table now; `None` when there is no table.
    pub rows: Option<i64>,
    pub publication: bool,
    /// This database's `pgoutput` slot of the name, with the session reading it if any.
    pub slot: Option<Option<Session>>,
    pub checkpoint_row: bool,
}

/// A slot with one of the plan's names that is not this database's `pgoutput` slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForeignSlot {
    pub slot: String,
    /// Its database; empty for a physical slot.
    pub database: String,
    pub plugin: String,
}

/// An object named like the source's but outside its configured shard-partitions (left by a
/// setup with more shards or partitions).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stray {
    /// `table`, `publication` or `replication slot`.
    pub kind: &'static str,
    pub name: String,
}

/// Everything teardown found in the database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inventory {
    pub streams: Vec<StreamFound>,
    pub checkpoint_table: bool,
    /// `schema.name(argument types)` of every enqueue overload in the current schema.
    pub functions: Vec<String>,
    /// `outbox-streamer` sessions of the streamer's login in this database, this one excluded.
    pub streamer_sessions: Vec<Session>,
    pub foreign_slots: Vec<ForeignSlot>,
    pub strays: Vec<Stray>,
}

/// The regular expression of `<prefix>_<shard>_<partition>` (prefixes are `[a-z0-9_]`).
fn numbered(prefix: &str) -> String {
    format!("^{prefix}_[0-9]+_[0-9]+$")
}

/// Committed WAL-only messages with the stream's prefix that its slot has not confirmed yet
/// (a peek decodes the slot's WAL without consuming it). 0 when the slot cannot be read (an
/// invalidated slot delivers nothing any more).
pub async fn waiting_messages(client: &Client, s: &StreamObjects) -> i64 {
    count_waiting(client, s, None).await.unwrap_or_else(|e| {
        tracing::debug!(slot = %s.slot, error = %e, "cannot peek into the slot for WAL-only messages");
        0
    })
}

/// The messages [`waiting_messages`] counts, decoding at most about `cap` changes (whole
/// transactions) when given — `status` bounds its peek so, and the count is then a lower bound.
pub async fn count_waiting(client: &Client, s: &StreamObjects, cap: Option<i64>) -> Result<i64, tokio_postgres::Error> {
    // pgoutput's message: 'M', flags (bit 0: transactional), the LSN (8 bytes), the prefix
    // NUL-terminated — so the prefix starts at byte 11 (1-based).
    let sql = "SELECT count(*) FROM pg_logical_slot_peek_binary_changes($1, NULL, $4::int,
                   'proto_version', '1', 'publication_names', $2, 'messages', 'true')
               WHERE get_byte(data, 0) = 77 AND get_byte(data, 1) & 1 = 1
                 AND substring(data FROM 11 FOR octet_length($3::bytea)) = $3::bytea";
    let mut prefix = s.table.as_bytes().to_vec();
    prefix.push(0);
    let cap = cap.map(|c| i32::try_from(c).unwrap_or(i32::MAX));
    Ok(client.query_one(sql, &[&s.slot, &s.publication, &prefix, &cap]).await?.get(0))
}

/// Whether a transactional message of `s`'s prefix at `lsn` (its `outbox-id`) waits in `s`'s
/// slot: decodes the slot without consuming it, so the slot must not be held. Used by `skip
/// --message` to refuse an LSN that names nothing the stream would read.
pub async fn message_waits(client: &Client, s: &StreamObjects, lsn: i64) -> Result<bool, tokio_postgres::Error> {
    // After 'M' and the flags byte comes the message's LSN (8 bytes), then the prefix.
    let sql = "SELECT EXISTS (SELECT 1 FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL,
                   'proto_version', '1', 'publication_names', $2, 'messages', 'true')
               WHERE get_byte(data, 0) = 77 AND get_byte(data, 1) & 1 = 1
                 AND substring(data FROM 3 FOR 8) = int8send($4)
                 AND substring(data FROM 11 FOR octet_length($3::bytea)) = $3::bytea)";
    let mut prefix = s.table.as_bytes().to_vec();
    prefix.push(0);
    Ok(client.query_one(sql, &[&s.slot, &s.publication, &prefix, &lsn]).await?.get(0))
}

/// Reads what exists; changes nothing and takes no lock beyond what a `count(*)` takes.
pub async fn inspect(client: &Client, plan: &TeardownPlan) -> Result<Inventory, tokio_postgres::Error> {
    let tables: Vec<String> = plan.streams.iter().map(|s| s.table.clone()).collect();
    let publications: Vec<String> = plan.streams.iter().map(|s| s.publication.clone()).collect();
    let slots: Vec<String> = plan.streams.iter().map(|s| s.slot.clone()).collect();

    let existing_tables: Vec<String> = client
        .query("SELECT t FROM unnest($1::text[]) t WHERE to_regclass(quote_ident(t)) IS NOT NULL", &[&tables])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let existing_publications: Vec<String> = client
        .query("SELECT pubname::text FROM pg_publication WHERE pubname = ANY($1)", &[&publications])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let slot_rows = client
        .query(
            "SELECT s.slot_name::text, coalesce(s.database::text, ''), coalesce(s.plugin::text, ''),
                    s.database IS NOT DISTINCT FROM current_database() AND s.plugin IS NOT DISTINCT FROM 'pgoutput',
                    s.active_pid, coalesce(a.application_name, '')
             FROM pg_replication_slots s LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid
             WHERE s.slot_name = ANY($1)
             ORDER BY s.slot_name",
            &[&slots],
        )
        .await?;
    let mut own_slots = Vec::new();
    let mut foreign_slots = Vec::new();
    for r in &slot_rows {
        let name: String = r.get(0);
        if r.get::<_, bool>(3) {
            let holder = r.get::<_, Option<i32>>(4).map(|pid| Session { pid, application_name: r.get(5) });
            own_slots.push((name, holder));
        } else {
            foreign_slots.push(ForeignSlot { slot: name, database: r.get(1), plugin: r.get(2) });
        }
    }
    let checkpoint_table = exists(client, &plan.checkpoint_table).await?;
    let checkpoint_rows: Vec<String> = if checkpoint_table {
        client
            .query(&format!("SELECT stream FROM {} WHERE stream = ANY($1)", ident(&plan.checkpoint_table)), &[&tables])
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect()
    } else {
        Vec::new()
    };

    let mut streams = Vec::with_capacity(plan.streams.len());
    for s in &plan.streams {
        let mut rows = if existing_tables.contains(&s.table) { Some(count(client, &s.table).await?) } else { None };
        let idle_slot = own_slots.iter().any(|(name, holder)| *name == s.slot && holder.is_none());
        if idle_slot && existing_publications.contains(&s.publication) {
            // WAL-only messages (`storage = "wal"`) waiting in the slot were never published
            // either: they count as pending rows, so the slot is not dropped without
            // --drop-pending.
            let messages = waiting_messages(client, s).await;
            if messages > 0 {
                rows = Some(rows.unwrap_or(0) + messages);
            }
        }
        streams.push(StreamFound {
            objects: s.clone(),
            rows,
            publication: existing_publications.contains(&s.publication),
            slot: own_slots.iter().find(|(name, _)| *name == s.slot).map(|(_, holder)| holder.clone()),
            checkpoint_row: checkpoint_rows.contains(&s.table),
        });
    }

    let functions = client
        .query(
            "SELECT format('%I.%I(%s)', n.nspname, p.proname, oidvectortypes(p.proargtypes))
             FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
             WHERE p.proname::text IN ($1::text, regexp_replace($1::text, '_enqueue$', '_emit')) AND n.nspname = current_schema()
             ORDER BY 1",
            &[&plan.enqueue_function],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let streamer_sessions = client
        .query(
            "SELECT pid, coalesce(application_name, '') FROM pg_stat_activity
             WHERE usename = $1 AND datname = current_database() AND pid <> pg_backend_pid()
               AND application_name LIKE 'outbox-streamer%'
             ORDER BY pid",
            &[&plan.streamer_role],
        )
        .await?
        .iter()
        .map(|r| Session { pid: r.get(0), application_name: r.get(1) })
        .collect();
    let strays = strays(client, plan, &tables, &publications, &slots).await?;
    Ok(Inventory { streams, checkpoint_table, functions, streamer_sessions, foreign_slots, strays })
}

/// Tables, publications and this database's slots named like the plan's, outside it.
async fn strays(
    client: &Client,
    plan: &TeardownPlan,
    tables: &[String],
    publications: &[String],
    slots: &[String],
) -> Result<Vec<Stray>, tokio_postgres::Error> {
    let table_pattern = numbered(&plan.table_prefix);
    let slot_pattern = numbered(&plan.slot_prefix);
    let rows = client
        .query(
            "SELECT 'table', c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p') AND c.relname ~ $1
               AND NOT (c.relname = ANY($2))
             UNION ALL
             SELECT 'publication', pubname::text FROM pg_publication WHERE pubname ~ $1 AND NOT (pubname = ANY($3))
             UNION ALL
             SELECT 'replication slot', slot_name::text FROM pg_replication_slots
             WHERE database = current_database() AND slot_name ~ $4 AND NOT (slot_name = ANY($5))
             ORDER BY 1, 2",
            &[&table_pattern, &tables, &publications, &slot_pattern, &slots],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| {
            let kind = match r.get::<_, &str>(0) {
                "table" => "table",
                "publication" => "publication",
                _ => "replication slot",
            };
            Stray { kind, name: r.get(1) }
        })
        .collect())
}

async fn exists(client: &impl GenericClient, table: &str) -> Result<bool, tokio_postgres::Error> {
    Ok(client.query_one("SELECT to_regclass($1) IS NOT NULL", &[&ident(table)]).await?.get(0))
}

async fn count(client: &impl GenericClient, table: &str) -> Result<i64, tokio_postgres::Error> {
    Ok(client.query_one(&format!("SELECT count(*) FROM {}", ident(table)), &[]).await?.get(0))
}

/// How long teardown waits for a table lock (a transaction of the application or the
/// streamer) before it leaves the shard-partition.
pub const LOCK_TIMEOUT_MS: u32 = 5_000;

/// What [`drop_stream`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamDrop {
    /// Everything of the shard-partition that existed is gone: `rows` were in its table.
    Dropped { rows: Option<i64>, publication: bool, slot: bool, checkpoint_row: bool },
    /// The table holds rows and `drop_pending` was not given; nothing changed.
    Pending(i64),
    /// A session reads the slot; nothing changed.
    SlotActive(Session),
}

/// Removes one shard-partition's table, publication, checkpoint row and slot in one
/// transaction (see the module docs), unless its table holds rows and `drop_pending` is
/// false, or a session reads its slot.
pub async fn drop_stream(
    client: &mut Client,
    plan: &TeardownPlan,
    stream: &StreamObjects,
    drop_pending: bool,
) -> Result<StreamDrop, tokio_postgres::Error> {
    let tx = client.transaction().await?;
    tx.batch_execute(&format!("SET LOCAL lock_timeout = {LOCK_TIMEOUT_MS}")).await?;
    let rows = if exists(&tx, &stream.table).await? {
        tx.batch_execute(&format!("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE", ident(&stream.table))).await?;
        let rows = count(&tx, &stream.table).await?;
        if rows > 0 && !drop_pending {
            tx.rollback().await?;
            return Ok(StreamDrop::Pending(rows));
        }
        Some(rows)
    } else {
        None
    };
    let slot = tx
        .query_opt(
            "SELECT s.active_pid, coalesce(a.application_name, '')
             FROM pg_replication_slots s LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid
             WHERE s.slot_name = $1 AND s.database = current_database() AND s.plugin = 'pgoutput'",
            &[&stream.slot],
        )
        .await?;
    if let Some(pid) = slot.as_ref().and_then(|r| r.get::<_, Option<i32>>(0)) {
        let holder = Session { pid, application_name: slot.as_ref().map(|r| r.get(1)).unwrap_or_default() };
        tx.rollback().await?;
        return Ok(StreamDrop::SlotActive(holder));
    }
    let checkpoint_row = if exists(&tx, &plan.checkpoint_table).await? {
        tx.execute(&format!("DELETE FROM {} WHERE stream = $1", ident(&plan.checkpoint_table)), &[&stream.table])
            .await?
            > 0
    } else {
        false
    };
    let publication =
        tx.query_opt("SELECT 1 FROM pg_publication WHERE pubname = $1", &[&stream.publication]).await?.is_some();
    if publication {
        tx.batch_execute(&format!("DROP PUBLICATION {}", ident(&stream.publication))).await?;
    }
    if rows.is_some() {
        tx.batch_execute(&format!("DROP TABLE {}", ident(&stream.table))).await?;
    }
    if slot.is_some() {
        tx.batch_execute(&format!("SELECT pg_drop_replication_slot({})", literal(&stream.slot))).await?;
    }
    tx.commit().await?;
    Ok(StreamDrop::Dropped { rows, publication, slot: slot.is_some(), checkpoint_row })
}

/// Drops one enqueue overload, as [`Inventory::functions`] names it.
pub async fn drop_function(client: &Client, signature: &str) -> Result<(), tokio_postgres::Error> {
    client.batch_execute(&format!("DROP FUNCTION {signature}")).await
}

/// Drops the checkpoint table (every shard-partition's row with it).
pub async fn drop_checkpoint_table(client: &Client, plan: &TeardownPlan) -> Result<(), tokio_postgres::Error> {
    client.batch_execute(&format!("DROP TABLE {}", ident(&plan.checkpoint_table))).await
}
