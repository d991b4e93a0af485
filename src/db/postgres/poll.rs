//! Polling a PostgreSQL outbox table.
//!
//! The oldest-rows query has one good plan, the primary-key index scan. The session disables
//! sequential scans, bitmap scans and sorts, so statistics taken while the table was empty (or
//! full) can never talk the planner into reading the whole table and sorting it.
//!
//! Writers are the transactions holding `RowExclusiveLock` on the table in `pg_locks` (readable
//! by every role). An `INSERT` takes that lock before its identity default draws an id, and
//! keeps it until its transaction ends, so "none of them is left" means every id drawn before
//! is settled.

use std::sync::Arc;

use outbox_postgres::Lsn;
use outbox_postgres::cleanup;
use outbox_postgres::connect::PgTarget;
use outbox_postgres::prepared::Prepared;
use outbox_postgres::setup::ident;
use tokio_postgres::{Client, Row, Statement};

use crate::error::Error;
use crate::layout::{Field, Layout};
use crate::names::StreamNames;
use crate::poll::{ConnectProbe, PollTable, PolledRow, TableProbe, Watched, Writers, exists_each};
use crate::record::RawRow;
use crate::source::{DELETE_CHUNK, within};

/// One connection polling one table.
#[derive(Debug)]
pub(crate) struct PgPollTable {
    client: Client,
    table: String,
    /// The stream's slot, unused while polling: moved along (see [`Self::moving_slot`]), and
    /// the statement that moves it.
    slot: Option<(String, Prepared)>,
    /// The delete guarded by the owner epoch (see [`Self::fenced_by`]), and that epoch.
    fence: Option<(Prepared, i64)>,
    /// [`PollTable::writers`] and [`PollTable::any_running`], prepared at their first use:
    /// each runs once per read that found rows.
    writers: Prepared,
    any_running: Prepared,
    select: Statement,
    deleter: cleanup::RowDeleter,
    layout: Layout,
}

/// The polling session's planner settings: the primary-key index scan is the only plan left.
pub const PLANNER_SETTINGS: &str = "SET enable_seqscan = off; SET enable_bitmapscan = off; SET enable_sort = off";

/// The oldest-rows query of our own layout: `$1 < id <= $2`, `$3` rows.
pub fn oldest_sql(table: &str) -> String {
    oldest_sql_of(table, &columns(Layout::OutboxStreamer, &|_| true, false), "id")
}

fn oldest_sql_of(table: &str, select: &str, id_column: &str) -> String {
    let id = ident(id_column);
    format!("SELECT {select} FROM {} WHERE {id} > $1::int8 AND {id} <= $2::int8 ORDER BY {id} LIMIT $3", ident(table))
}

/// The select list of `layout` on `table` (a mapped layout's depends on its columns' types).
///
/// `keyed` (a table identified by a uuid, see [`super::keyed`]): the id is read as its text
/// after every other column, and `0` stands in its place.
pub(super) async fn select_list(client: &Client, table: &str, layout: Layout, keyed: bool) -> Result<String, Error> {
    if layout.mapping().is_none() {
        // Our own and tw-tkms's key and payload columns are bytea.
        return Ok(columns(layout, &|_| true, keyed));
    }
    let rows = client
        .query(
            "SELECT column_name::text FROM information_schema.columns \
             WHERE table_schema = current_schema() AND table_name = $1 AND data_type = 'bytea'",
            &[&table],
        )
        .await
        .map_err(|e| Error::from_db(&format!("reading the columns of {table}"), e))?;
    let binary: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    Ok(columns(layout, &|c| binary.iter().any(|b| b == c), keyed))
}

/// The select list [`polled`] reads: the layout's column for each field, or a typed NULL, then
/// a mapped layout's header columns as text. `is_bytea` tells a mapped key or payload column
/// that is read as it is from one read as its text.
fn columns(layout: Layout, is_bytea: &dyn Fn(&str) -> bool, keyed: bool) -> String {
    let col = |field: Field, read: &dyn Fn(&str) -> String, null: &str| {
        layout.column(field).map_or_else(|| format!("NULL::{null}"), read)
    };
    let bytes = |c: &str| if is_bytea(c) { ident(c) } else { format!("convert_to({}::text, 'UTF8')", ident(c)) };
    let text = |c: &str| format!("{}::text", ident(c));
    let mut list = vec![
        if keyed { "0::int8".to_string() } else { col(Field::Id, &|c| format!("{}::int8", ident(c)), "int8") },
        col(Field::Topic, &text, "text"),
        col(Field::Key, &bytes, "bytea"),
        col(Field::Payload, &bytes, "bytea"),
        col(Field::Headers, &text, "text"),
        col(Field::Partition, &|c| format!("{}::int4", ident(c)), "int4"),
        col(Field::CreatedAt, &|c| format!("(extract(epoch FROM {}) * 1000000)::int8", ident(c)), "int8"),
    ];
    list.extend(layout.header_columns().map(|(_, c)| text(c)));
    if keyed {
        list.push(text(layout.id_column()));
    }
    list.join(", ")
}

impl PgPollTable {
    pub(crate) async fn connect(target: &PgTarget, table: &str, layout: Layout) -> Result<Self, Error> {
        let client = target
            .connect()
            .await
            .map_err(|e| Error::from_db(&format!("connecting to {}", target.display()), e).connecting())?;
        client
            .batch_execute(PLANNER_SETTINGS)
            .await
            .map_err(|e| Error::from_db("setting the polling session's planner options", e))?;
        let select = select_list(&client, table, layout, false).await?;
        let sql = oldest_sql_of(table, &select, layout.id_column());
        let select = client
            .prepare(&sql)
            .await
            .map_err(|e| Error::from_db(&format!("preparing the polling query on {table}"), e))?;
        Ok(Self {
            client,
            table: table.to_string(),
            slot: None,
            fence: None,
            writers: Prepared::new(
                "SELECT coalesce(array_agg(virtualtransaction), '{}') FROM pg_locks
                 WHERE locktype = 'relation' AND relation = $1::text::regclass
                   AND mode = 'RowExclusiveLock' AND granted AND pid IS DISTINCT FROM pg_backend_pid()",
            ),
            any_running: Prepared::new("SELECT EXISTS (SELECT 1 FROM pg_locks WHERE virtualtransaction = ANY($1))"),
            select,
            deleter: cleanup::RowDeleter::new(table, layout.id_column()),
            layout,
        })
    }

    /// Deletes only while `<checkpoint_table>` holds no newer owner epoch than `epoch` for
    /// this stream (checked in the delete's own statement): an owner that lost its lease
    /// without knowing stops at its next delete instead of publishing on beside the new one.
    pub(crate) fn fenced_by(mut self, checkpoint_table: &str, epoch: i64) -> Self {
        let sql = format!(
            "WITH f AS (SELECT owner_epoch <= $3 AS ok FROM {cp} WHERE stream = $2 FOR SHARE),
                  d AS (DELETE FROM {t} WHERE {id} = ANY($1::int8[]) AND coalesce((SELECT ok FROM f), false) RETURNING 1)
             SELECT coalesce((SELECT ok FROM f), false), (SELECT count(*) FROM d)",
            cp = ident(checkpoint_table),
            t = ident(&self.table),
            id = ident(self.layout.id_column())
        );
        self.fence = Some((Prepared::new(sql), epoch));
        self
    }

    /// Moves `slot` to the current WAL position every few seconds while this polls, so the
    /// unused slot of a polling stream does not hold WAL. Only the stream's owner polls, so
    /// only the owner ever moves its slot; a catch-up drain (about to stream from the slot)
    /// never does.
    pub(crate) fn moving_slot(mut self, slot: &str) -> Self {
        self.slot = Some((slot.to_string(), Prepared::new(outbox_postgres::slot::ADVANCE_TO_CURRENT)));
        self
    }

    /// The highest id in the table now (`None` when it is empty).
    /// Opens a `REPEATABLE READ` transaction on this connection that every later read runs
    /// in, and answers its snapshot (`pg_snapshot` text) and the WAL insert position read right
    /// after it was taken: no transaction committing at or after that position is in it.
    pub(crate) async fn enter_snapshot(&self) -> Result<(String, Lsn), Error> {
        let what = "taking the catch-up's snapshot";
        within(what, self.client.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ")).await?;
        let row = within(
            what,
            self.client.query_one("SELECT pg_current_snapshot()::text, pg_current_wal_insert_lsn()::text", &[]),
        )
        .await?;
        let (snapshot, lsn): (String, String) = (row.get(0), row.get(1));
        let lsn = Lsn::parse(&lsn).map_err(|e| Error::transient(format!("{what}: {e}")))?;
        Ok((snapshot, lsn))
    }

    pub(crate) async fn max_id(&self) -> Result<Option<i64>, Error> {
        let row = self
            .client
            .query_one(
                &format!("SELECT max({})::int8 FROM {}", ident(self.layout.id_column()), ident(&self.table)),
                &[],
            )
            .await
            .map_err(|e| Error::from_db("reading the highest id", e))?;
        Ok(row.get(0))
    }
}

/// Builds a record from a typed row of [`columns`]; a value that cannot be read names its column.
pub(super) fn polled(row: &Row, layout: Layout) -> Result<PolledRow, Error> {
    let column_error = |column: &str, e: tokio_postgres::Error| {
        Error::definite(
            format!("column {column} cannot be read: {e}"),
            format!("change {column} back to the type `outbox-streamer setup --dry-run` shows, then restart"),
        )
        .with_source(e)
    };
    let id: i64 = row.try_get(0).map_err(|e| column_error(layout.id_column(), e))?;
    let topic: Option<String> = row.try_get(1).map_err(|e| column_error("topic", e))?;
    let key: Option<Vec<u8>> = row.try_get(2).map_err(|e| column_error("msg_key", e))?;
    let payload: Option<Vec<u8>> = row.try_get(3).map_err(|e| column_error("payload", e))?;
    let headers: Option<String> = row.try_get(4).map_err(|e| column_error("headers", e))?;
    let partition: Option<i32> = row.try_get(5).map_err(|e| column_error("kafka_partition", e))?;
    let created_at_micros: Option<i64> = row.try_get(6).map_err(|e| column_error("created_at", e))?;
    let raw = RawRow {
        topic: topic.map(String::into_bytes),
        key,
        payload,
        headers: headers.map(String::into_bytes),
        kafka_partition: partition.map(i64::from),
        created_at_micros,
        extra_headers: Vec::new(),
    };
    let mut raw = raw;
    for (i, (header, column)) in layout.header_columns().enumerate() {
        let value: Option<String> = row.try_get(7 + i).map_err(|e| column_error(column, e))?;
        if let Some(v) = value {
            raw.extra_headers.push((header.to_string(), v.into_bytes()));
        }
    }
    Ok(layout.record(id, raw))
}

/// The rows `ids` of `table` as they are now (ids not in the table are left out).
pub(crate) async fn rows_by_id(
    client: &Client,
    table: &str,
    ids: &[i64],
    layout: Layout,
) -> Result<Vec<PolledRow>, Error> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let select = select_list(client, table, layout, false).await?;
    let id = ident(layout.id_column());
    let sql = format!("SELECT {select} FROM {} WHERE {id} = ANY($1::int8[]) ORDER BY {id}", ident(table));
    let rows = match client.query(&sql, &[&ids]).await {
        Ok(rows) => rows,
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_COLUMN) => {
            return Err(Error::definite(
                format!(
                    "cannot read {table}: {}",
                    e.as_db_error().map_or_else(|| e.to_string(), |d| d.message().to_string())
                ),
                format!(
                    "restore the column as `outbox-streamer setup --dry-run` shows (ALTER TABLE {table} ADD COLUMN …), then restart"
                ),
            ));
        }
        Err(e) => return Err(Error::from_db(&format!("reading rows of {table}"), e)),
    };
    rows.iter().map(|row| polled(row, layout)).collect()
}

impl PollTable for PgPollTable {
    async fn oldest(&mut self, after: i64, upto: i64, limit: u32) -> Result<Vec<PolledRow>, Error> {
        let what = format!("reading the oldest rows of {}", self.table);
        let rows = within(&what, self.client.query(&self.select, &[&after, &upto, &i64::from(limit)])).await?;
        rows.iter().map(|row| polled(row, self.layout)).collect()
    }

    async fn delete(&mut self, ids: &[i64]) -> Result<u64, Error> {
        let mut deleted = 0;
        for chunk in ids.chunks(DELETE_CHUNK) {
            let what = format!("deleting published rows from {}", self.table);
            match &mut self.fence {
                None => deleted += within(&what, self.deleter.delete(&self.client, chunk)).await?,
                Some((sql, epoch)) => {
                    let statement = within(&what, sql.on(&self.client)).await?;
                    let row = within(&what, self.client.query_one(&statement, &[&chunk, &self.table, &*epoch])).await?;
                    if !row.get::<_, bool>(0) {
                        return Err(crate::db::fenced(&self.table, *epoch));
                    }
                    deleted += row.get::<_, i64>(1) as u64;
                }
            }
        }
        Ok(deleted)
    }

    async fn existing(&mut self, ids: &[i64]) -> Result<Vec<i64>, Error> {
        within("checking rows", cleanup::existing_ids(&self.client, &self.table, self.layout.id_column(), ids)).await
    }

    async fn rows(&mut self, ids: &[i64]) -> Result<Vec<PolledRow>, Error> {
        rows_by_id(&self.client, &self.table, ids, self.layout).await
    }

    async fn writers(&mut self) -> Result<Writers, Error> {
        let what = "reading the table's writers from pg_locks";
        let statement = within(what, self.writers.on(&self.client)).await?;
        let table = ident(&self.table);
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&table];
        let row = within(what, self.client.query_one(&statement, &params)).await?;
        Ok(Writers::Known(row.get(0)))
    }

    async fn maintain(&mut self) {
        if let Some((slot, statement)) = &mut self.slot
            && let Err(e) = outbox_postgres::slot::advance_to_current(&self.client, statement, slot).await
        {
            tracing::debug!(%slot, error = %e, "could not move the unused slot forward");
        }
    }

    async fn any_running(&mut self, writers: &[String]) -> Result<bool, Error> {
        if writers.is_empty() {
            return Ok(false);
        }
        let what = "checking the table's writers in pg_locks";
        let statement = within(what, self.any_running.on(&self.client)).await?;
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&writers];
        let row = within(what, self.client.query_one(&statement, &params)).await?;
        Ok(row.get(0))
    }

    async fn history(&mut self) -> Result<String, Error> {
        super::connect::history(&self.client).await
    }
}

/// The quiet-table watch's connection (see `crate::poll::quiet`): one statement asks every
/// quiet table of the source whether it holds a row above its mark, by the same index the
/// oldest-rows query reads (the session's [`PLANNER_SETTINGS`]), so dead index entries below
/// the mark are not walked. The session waits for no lock longer than [`WATCH_SESSION`] says:
/// a table locked by DDL fails the statement at once (the sources then read on their own)
/// instead of holding a lock request that would queue the application behind it.
///
/// The statement is prepared once for every table this session was asked about, the marks its
/// parameters: the set of quiet tables changes with every message (its table wakes, then goes
/// quiet again), and preparing a statement of sixteen subqueries each time cost more than the
/// messages. A table asked about before but not quiet now is asked above `i64::MAX` (one index
/// descent that finds nothing). A table dropped since fails the statement: the watch then
/// connects again and starts from the tables quiet then.
struct PgQuietProbe {
    client: Client,
    id_column: String,
    /// Every table asked about on this session, in the order of the statement's parameters.
    asked: Vec<Arc<str>>,
    /// The statement for `asked`.
    prepared: Option<Statement>,
}

/// The watch's session settings beside [`PLANNER_SETTINGS`].
const WATCH_SESSION: &str = "SET lock_timeout = '200ms'; SET statement_timeout = '5s'";

/// Connects the quiet-table watch of a source whose tables have `id_column`.
pub(crate) fn quiet_probe(target: PgTarget, id_column: &str) -> ConnectProbe {
    let id_column = id_column.to_string();
    Arc::new(move || {
        let (target, id_column) = (target.clone(), id_column.clone());
        Box::pin(async move {
            let client =
                within(&format!("connecting the quiet-table watch to {}", target.display()), target.connect()).await?;
            let settings = format!("{PLANNER_SETTINGS}; {WATCH_SESSION}");
            within("setting up the quiet-table watch's session", client.batch_execute(&settings)).await?;
            let probe = PgQuietProbe { client, id_column, asked: Vec::new(), prepared: None };
            Ok(Box::new(probe) as Box<dyn TableProbe>)
        })
    })
}

/// `SELECT EXISTS (SELECT 1 FROM t0 WHERE id > $1::int8), …`: the marks are the parameters, in
/// the order of `tables`; tables quoted.
fn holding_sql(tables: &[Arc<str>], id_column: &str) -> String {
    let id = ident(id_column);
    exists_each(tables, |i, table| format!("SELECT 1 FROM {} WHERE {id} > ${}::int8", ident(table), i + 1))
}

/// The statement's parameters: each of `asked` at its mark in `tables`, or above `i64::MAX`
/// (nothing) when it is not quiet now.
fn marks_of(asked: &[Arc<str>], tables: &[Watched]) -> Vec<i64> {
    asked.iter().map(|table| tables.iter().find(|w| &w.table == table).map_or(i64::MAX, |w| w.above)).collect()
}

/// For each of `tables`, in order, the column of its answer (its place in `asked`, which holds
/// every one of them).
fn answers_of<'a>(asked: &'a [Arc<str>], tables: &'a [Watched]) -> impl Iterator<Item = usize> + 'a {
    tables.iter().map(|w| asked.iter().position(|t| t == &w.table).unwrap_or_default())
}

impl TableProbe for PgQuietProbe {
    fn holding<'a>(&'a mut self, tables: &'a [Watched]) -> futures::future::BoxFuture<'a, Result<Vec<bool>, Error>> {
        Box::pin(async move {
            let what = "asking the quiet tables for rows";
            if tables.is_empty() {
                within(what, self.client.batch_execute("SELECT 1")).await?;
                return Ok(Vec::new());
            }
            let new: Vec<Arc<str>> =
                tables.iter().filter(|w| !self.asked.contains(&w.table)).map(|w| w.table.clone()).collect();
            let statement = match &self.prepared {
                Some(statement) if new.is_empty() => statement.clone(),
                _ => {
                    let mut asked = self.asked.clone();
                    asked.extend(new);
                    let statement = within(what, self.client.prepare(&holding_sql(&asked, &self.id_column))).await?;
                    (self.asked, self.prepared) = (asked, Some(statement.clone()));
                    statement
                }
            };
            let marks = marks_of(&self.asked, tables);
            let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> =
                marks.iter().map(|m| m as &(dyn tokio_postgres::types::ToSql + Sync)).collect();
            let row = within(what, self.client.query_one(&statement, &params)).await?;
            answers_of(&self.asked, tables)
                .map(|i| {
                    row.try_get::<_, bool>(i).map_err(|e| Error::from_db("reading the quiet-table watch's answer", e))
                })
                .collect()
        })
    }
}

/// Refuses polling where WAL-only messages (`storage = "wal"`) could be lost: polling cannot
/// read them and moves the stream's slot past them. Halts while the enqueue functions still
/// emit for this shard-partition (`setup` last ran with `storage = "wal"`), or while its slot
/// holds committed messages of its prefix not yet published.
pub(crate) async fn refuse_past_messages(client: &Client, checkpoint: &str, names: &StreamNames) -> Result<(), Error> {
    let sql = format!("SELECT storage FROM {} WHERE stream = $1", ident(checkpoint));
    // An older setup has no storage column: it never wrote WAL-only messages.
    let storage: Option<String> = client.query_opt(&sql, &[&names.table]).await.ok().flatten().and_then(|r| r.get(0));
    if storage.as_deref() == Some("wal") {
        return Err(Error::definite(
            format!(
                "the enqueue functions write WAL-only messages for {} (setup last ran with storage = \"wal\"), which polling cannot read",
                names.table
            ),
            "run `outbox-streamer setup` with this configuration first; messages already written are published by running this shard-partition with mode = \"cdc\" until they are",
        ));
    }
    let objects = super::objects(names.clone(), false);
    let waiting = outbox_postgres::teardown::waiting_messages(client, &objects).await;
    if waiting > 0 {
        return Err(Error::definite(
            format!(
                "{waiting} WAL-only message(s) of {} wait in slot {:?}; polling cannot read them and would move the slot past them",
                names.table, names.slot
            ),
            "run this shard-partition with mode = \"cdc\" (storage = \"table\" reads them too) until they are published, then switch to polling",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watched(table: &str, above: i64) -> Watched {
        Watched { table: Arc::from(table), above }
    }

    #[test]
    fn the_watch_asks_every_table_of_its_statement_and_reads_the_quiet_ones_answers() {
        let asked: Vec<Arc<str>> = ["t_a", "t_b", "t_c"].into_iter().map(Arc::from).collect();
        let quiet = [watched("t_c", 5), watched("t_a", -7)];
        assert_eq!(marks_of(&asked, &quiet), vec![-7, i64::MAX, 5]);
        assert_eq!(answers_of(&asked, &quiet).collect::<Vec<_>>(), vec![2, 0]);
        let sql = holding_sql(&asked, "id");
        assert_eq!(
            sql,
            r#"SELECT EXISTS (SELECT 1 FROM "t_a" WHERE "id" > $1::int8), EXISTS (SELECT 1 FROM "t_b" WHERE "id" > $2::int8), EXISTS (SELECT 1 FROM "t_c" WHERE "id" > $3::int8)"#
        );
    }
}
