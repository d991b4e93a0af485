//! Polling a MySQL/MariaDB outbox table.
//!
//! Reads use `FORCE INDEX (PRIMARY)` (statistics can never pick another plan) in a UTC session
//! at READ COMMITTED, like the CDC cleanup, so deletes lock only the rows they delete.
//!
//! Writers come from `information_schema.INNODB_TRX` — transactions holding a table lock or
//! having modified rows. Reading it needs the `PROCESS` privilege; without it the low-water
//! mark stays at 0 (see `docs/polling.md` for the trade-off).

use std::time::Duration;

use outbox_mysql::binlog::Cell;
use outbox_mysql::decode::cell_of;
use outbox_mysql::mysql_async::prelude::Queryable;
use outbox_mysql::mysql_async::{Conn, Error as MyError, IsolationLevel, Opts, Row, TxOpts};
use outbox_mysql::setup::ident;

use super::cdc::id_list;
use super::checkpoint::Checkpoint;
use crate::error::Error;
use crate::layout::{Field, Layout};
use crate::poll::{ConnectProbe, PollTable, PolledRow, TableProbe, Watched, Writers, exists_each};
use crate::source::{DELETE_CHUNK, STATEMENT_TIMEOUT, within};

/// ER_SPECIFIC_ACCESS_DENIED_ERROR: "you need the PROCESS privilege".
const ACCESS_DENIED_NEED_PRIVILEGE: u16 = 1227;

/// One connection polling one table.
#[derive(Debug)]
pub(crate) struct MyPollTable {
    conn: Conn,
    table: String,
    select: String,
    layout: Layout,
    /// The checkpoint table and owner epoch that guard deletes (see [`Self::fenced_by`]).
    fence: Option<(String, i64)>,
    /// A fenced delete's transaction is open (a cancelled delete left it so: rolled back first).
    in_transaction: bool,
}

impl MyPollTable {
    /// Refuses a table read by key (see [`super::keyed`]): polling and the catch-up read rows
    /// in the order of their id.
    pub(crate) async fn connect(opts: &Opts, table: &str, layout: Layout) -> Result<Self, Error> {
        let mut conn =
            Conn::new(opts.clone()).await.map_err(|e| Error::from_db("connecting to MySQL/MariaDB", e).connecting())?;
        if layout.mapping().is_some() && super::keyed::is_text(&mut conn, table, layout.id_column()).await? {
            return Err(super::keyed::no_order(table, layout.id_column()));
        }
        for setting in ["SET SESSION time_zone = '+00:00'", "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED"] {
            conn.query_drop(setting).await.map_err(|e| Error::from_db("setting up the polling session", e))?;
        }
        let id = ident(layout.id_column());
        let select = format!(
            "SELECT {} FROM {}{} WHERE {id} > ? AND {id} <= ? ORDER BY {id} LIMIT ?",
            columns(layout),
            ident(table),
            id_index(layout)
        );
        Ok(Self { conn, table: table.to_string(), select, layout, fence: None, in_transaction: false })
    }

    /// Deletes only while `<checkpoint_table>` holds no newer owner epoch than `epoch` for
    /// this stream (read with a share lock in the delete's transaction).
    pub(crate) fn fenced_by(mut self, checkpoint_table: &str, epoch: i64) -> Self {
        self.fence = Some((checkpoint_table.to_string(), epoch));
        self
    }

    /// The connection, for the catch-up's position snapshot.
    pub(crate) fn conn(&mut self) -> &mut Conn {
        &mut self.conn
    }
}

/// The index hint of range reads by id: the primary key of tables whose `id` is it (the
/// optimizer otherwise may scan, and lock, more of a small table). A mapped table's identity
/// column (even one named `id`) need only have a unique index, not be the primary key —
/// forcing PRIMARY there would scan the whole table and sort it — so its index is left to the
/// optimizer.
pub(super) fn id_index(layout: Layout) -> &'static str {
    if matches!(layout, Layout::Columns(_)) { "" } else { " FORCE INDEX (PRIMARY)" }
}

/// The layout's columns, read by name (see [`super::cdc::record`]).
pub(super) fn columns(layout: Layout) -> String {
    [Field::Id, Field::Topic, Field::Key, Field::Payload, Field::Headers, Field::Partition, Field::CreatedAt]
        .into_iter()
        .filter_map(|field| layout.column(field))
        .chain(layout.header_columns().map(|(_, column)| column))
        .map(ident)
        .collect::<Vec<_>>()
        .join(", ")
}

fn polled(row: Row, layout: Layout) -> Result<PolledRow, Error> {
    Ok(super::cdc::record(&cells(row), layout))
}

/// A row's values by column name, as the binlog reader gives them.
pub(super) fn cells(row: Row) -> Vec<(String, Cell)> {
    let names: Vec<String> = row.columns_ref().iter().map(|c| c.name_str().into_owned()).collect();
    names.into_iter().zip(row.unwrap()).map(|(name, value)| (name, cell_of(&value))).collect()
}

/// The rows `ids` of `table` as they are now (ids not in the table are left out). With
/// `locking`, the read waits for a transaction still inserting one of them (READ COMMITTED,
/// so no gap is locked).
pub(crate) async fn rows_by_id(
    conn: &mut Conn,
    table: &str,
    ids: &[i64],
    locking: bool,
    layout: Layout,
) -> Result<Vec<PolledRow>, Error> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let id = ident(layout.id_column());
    let sql = format!(
        "SELECT {} FROM {} WHERE {id} IN ({}) ORDER BY {id}{}",
        columns(layout),
        ident(table),
        id_list(ids),
        if locking { " LOCK IN SHARE MODE" } else { "" }
    );
    let what = format!("reading rows of {table}");
    let rows: Vec<Row> = if locking {
        let mut opts = TxOpts::default();
        opts.with_isolation_level(IsolationLevel::ReadCommitted);
        let mut tx = within(&what, conn.start_transaction(opts)).await?;
        // Prepared (binary protocol), so values arrive typed as the polling reads get them.
        let rows = within(&what, tx.exec(sql, ())).await?;
        within(&what, tx.commit()).await?;
        rows
    } else {
        within(&what, conn.exec(sql, ())).await?
    };
    rows.into_iter().map(|row| polled(row, layout)).collect()
}

/// How often a stale `INNODB_TRX` is read again before the probe is left for the next rescan.
const FRESH_ATTEMPTS: u32 = 8;
/// Longer than InnoDB's 100 ms: the cache may be refreshed once nobody read it for that long.
const STALE_RETRY: Duration = Duration::from_millis(150);

impl MyPollTable {
    /// One read of the writers inside a canary transaction: `None` when the answer is older
    /// than the canary (stale).
    async fn read_writers(&mut self) -> Result<Option<Writers>, Error> {
        let what = "reading the table's writers";
        // One round trip: the canary transaction, the read, this session's id (asked, not
        // taken from the handshake: a proxy may hand out ids of its own), the end.
        let read = async {
            let mut result = self
                .conn
                .query_iter(
                    "START TRANSACTION WITH CONSISTENT SNAPSHOT;
                     SELECT CAST(trx_id AS CHAR), trx_mysql_thread_id,
                            trx_tables_locked > 0 OR trx_rows_modified > 0 OR trx_rows_locked > 0
                     FROM information_schema.INNODB_TRX;
                     SELECT CONNECTION_ID();
                     COMMIT",
                )
                .await?;
            result.collect::<Row>().await?;
            let rows = result.collect::<(String, u64, bool)>().await?;
            let me = result.collect::<u64>().await?.first().copied();
            result.drop_result().await?;
            Ok::<_, MyError>((rows, me))
        };
        let (rows, me) = match tokio::time::timeout(STATEMENT_TIMEOUT, read).await {
            Err(_) => return Err(Error::transient(format!("{what}: no answer; presumed dead"))),
            Ok(Ok(read)) => read,
            Ok(Err(e)) => {
                // The statements after a failed one did not run: end the canary transaction
                // (best effort: a broken connection fails the next statement anyway).
                let _ = tokio::time::timeout(STATEMENT_TIMEOUT, self.conn.query_drop("COMMIT")).await;
                match e {
                    MyError::Server(s) if s.code == ACCESS_DENIED_NEED_PRIVILEGE => return Ok(Some(Writers::Hidden)),
                    e => return Err(Error::from_db(what, e)),
                }
            }
        };
        let Some(me) = me else { return Ok(None) };
        if !rows.iter().any(|(_, thread, _)| *thread == me) {
            return Ok(None);
        }
        Ok(Some(Writers::Known(
            rows.into_iter().filter(|(_, thread, writing)| *writing && *thread != me).map(|(id, _, _)| id).collect(),
        )))
    }

    /// The delete of [`PollTable::delete`]; the caller rolls back what this leaves open.
    async fn delete_rows(&mut self, ids: &[i64], what: &str) -> Result<u64, Error> {
        if ids.is_empty() {
            return Ok(0);
        }
        let chunks: Vec<&[i64]> = ids.chunks(DELETE_CHUNK).collect();
        let delete = |chunk: &[i64]| outbox_mysql::cleanup::delete_by_ids(&self.table, self.layout.id_column(), chunk);
        let Some((checkpoint, epoch)) = &self.fence else {
            // Each statement is its own transaction (the session is READ COMMITTED): a crash
            // between two chunks leaves rows that are published again, as after any crash.
            let mut deleted = 0;
            for chunk in chunks {
                within(what, self.conn.query_drop(delete(chunk))).await?;
                deleted += self.conn.affected_rows();
            }
            return Ok(deleted);
        };
        // Three round trips: begin; the epoch, share-locked until the commit; the delete and
        // the commit.
        self.in_transaction = true;
        within(what, self.conn.query_drop("SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION")).await?;
        let stored: Option<i64> =
            within(what, self.conn.exec_first(Checkpoint::new(checkpoint).lock_epoch(), (&self.table,))).await?;
        if stored.is_none_or(|stored| stored > *epoch) {
            return Err(crate::db::fenced(&self.table, *epoch));
        }
        let mut deleted = 0;
        for (i, chunk) in chunks.iter().enumerate() {
            let mut sql = delete(chunk);
            if i + 1 == chunks.len() {
                sql.push_str("; COMMIT");
            }
            let result = within(what, self.conn.query_iter(sql)).await?;
            deleted += result.affected_rows();
            within(what, result.drop_result()).await?;
        }
        self.in_transaction = false;
        Ok(deleted)
    }
}

impl PollTable for MyPollTable {
    async fn oldest(&mut self, after: i64, upto: i64, limit: u32) -> Result<Vec<PolledRow>, Error> {
        let read = tokio::time::timeout(STATEMENT_TIMEOUT, self.conn.exec(&self.select, (after, upto, limit)));
        let Ok(result) = read.await else {
            return Err(Error::transient(format!(
                "reading the oldest rows of {}: no answer within {STATEMENT_TIMEOUT:?}; the connection is presumed dead",
                self.table
            )));
        };
        let rows: Vec<Row> =
            result.map_err(|e| Error::from_db(&format!("reading the oldest rows of {}", self.table), e))?;
        rows.into_iter().map(|row| polled(row, self.layout)).collect()
    }

    async fn delete(&mut self, ids: &[i64]) -> Result<u64, Error> {
        let what = format!("deleting published rows from {}", self.table);
        if self.in_transaction {
            // A delete was cancelled inside its transaction.
            within(&what, self.conn.query_drop("ROLLBACK")).await?;
            self.in_transaction = false;
        }
        let deleted = self.delete_rows(ids, &what).await;
        if deleted.is_err() && self.in_transaction {
            // Best effort, and the delete's own error is the one returned: a connection that
            // cannot roll back is broken, and the session's next statement says so.
            if let Ok(Ok(())) = tokio::time::timeout(STATEMENT_TIMEOUT, self.conn.query_drop("ROLLBACK")).await {
                self.in_transaction = false;
            }
        }
        deleted
    }

    async fn existing(&mut self, ids: &[i64]) -> Result<Vec<i64>, Error> {
        within("checking rows", self.conn.query(existing_sql(&self.table, self.layout, ids))).await
    }

    async fn rows(&mut self, ids: &[i64]) -> Result<Vec<PolledRow>, Error> {
        rows_by_id(&mut self.conn, &self.table, ids, false, self.layout).await
    }

    async fn writers(&mut self) -> Result<Writers, Error> {
        // INNODB_TRX is a cache that InnoDB refreshes only once nobody read it for 100 ms, so
        // frequent readers (this poller among them) can be shown an old list that lacks a
        // writer. A transaction of this session's own, started before the read, must be in
        // the answer: then the list is newer than the moment the writers are wanted for.
        for attempt in 0..FRESH_ATTEMPTS {
            if attempt > 0 {
                tokio::time::sleep(STALE_RETRY).await;
            }
            match self.read_writers().await? {
                Some(writers) => return Ok(writers),
                None => continue,
            }
        }
        Ok(Writers::Unknown)
    }

    async fn any_running(&mut self, writers: &[String]) -> Result<bool, Error> {
        if writers.is_empty() {
            return Ok(false);
        }
        let list = writers.iter().map(|w| format!("'{}'", w.replace('\'', ""))).collect::<Vec<_>>().join(",");
        let query = self
            .conn
            .query_first(format!("SELECT COUNT(*) FROM information_schema.INNODB_TRX WHERE trx_id IN ({list})"));
        let n: Option<i64> = within("checking the table's writers", query).await?;
        Ok(n.unwrap_or(0) > 0)
    }

    async fn history(&mut self) -> Result<String, Error> {
        super::connect::history(&mut self.conn).await
    }
}

/// The quiet-table watch's connection (see `crate::poll::quiet`): one statement asks every
/// quiet table of the source whether it holds a row above its mark, by the index the
/// oldest-rows query reads. A plain `SELECT` is a consistent read: it waits for no row lock,
/// and for a table's metadata lock (DDL) at most a second (`lock_wait_timeout`), failing the
/// statement (the sources then read on their own).
struct MyQuietProbe {
    conn: Conn,
    layout: Layout,
}

/// Connects the quiet-table watch of a source of `layout`.
pub(crate) fn quiet_probe(opts: Opts, layout: Layout) -> ConnectProbe {
    std::sync::Arc::new(move || {
        let opts = opts.clone();
        Box::pin(async move {
            let mut conn = within("connecting the quiet-table watch to MySQL/MariaDB", Conn::new(opts)).await?;
            for setting in
                ["SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED", "SET SESSION lock_wait_timeout = 1"]
            {
                within("setting up the quiet-table watch's session", conn.query_drop(setting)).await?;
            }
            Ok(Box::new(MyQuietProbe { conn, layout }) as Box<dyn TableProbe>)
        })
    })
}

/// `SELECT EXISTS (SELECT 1 FROM t0 WHERE id > m0), …`: marks are integers, tables quoted.
fn holding_sql(tables: &[Watched], layout: Layout) -> String {
    let id = ident(layout.id_column());
    exists_each(tables, |_, w| {
        format!("SELECT 1 FROM {}{} WHERE {id} > {}", ident(&w.table), id_index(layout), w.above)
    })
}

impl TableProbe for MyQuietProbe {
    fn holding<'a>(&'a mut self, tables: &'a [Watched]) -> futures::future::BoxFuture<'a, Result<Vec<bool>, Error>> {
        Box::pin(async move {
            let what = "asking the quiet tables for rows";
            if tables.is_empty() {
                within(what, self.conn.query_drop("SELECT 1")).await?;
                return Ok(Vec::new());
            }
            let sql = holding_sql(tables, self.layout);
            let row: Option<Row> = within(what, self.conn.query_first(sql)).await?;
            let row = row.ok_or_else(|| Error::transient("the quiet-table watch's statement returned no row"))?;
            (0..tables.len())
                .map(|i| match row.get_opt::<i64, usize>(i) {
                    Some(Ok(n)) => Ok(n != 0),
                    _ => Err(Error::transient(format!("the quiet-table watch's answer {i} is not a number"))),
                })
                .collect()
        })
    }
}

/// Which of `ids` are still in `table`, ascending.
pub(super) fn existing_sql(table: &str, layout: Layout, ids: &[i64]) -> String {
    let id = ident(layout.id_column());
    format!("SELECT {id} FROM {} WHERE {id} IN ({}) ORDER BY {id}", ident(table), id_list(ids))
}
