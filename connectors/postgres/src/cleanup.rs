//! Deleting published rows: one statement per acknowledged prefix, on an ordinary session.

use tokio_postgres::Client;
use tokio_postgres::types::ToSql;

use crate::prepared::Prepared;

use crate::setup::ident;

/// Deletes published rows of one table. The statement is prepared on a session's first delete
/// and reused, so each cleanup is one round trip with no parse or plan on the server.
#[derive(Debug)]
pub struct RowDeleter {
    /// The quoted table name.
    table: String,
    /// The quoted name of the table's row identity column.
    id: String,
    /// The ids' parameter as the statements compare it: `$1::int8[]`, or `$1::text[]::uuid[]`.
    ids: &'static str,
    /// Prepared on the session it was used with; a new session needs a new deleter.
    delete: Prepared,
    /// The delete that also stores the published-up-to mark (see [`Self::recording_in`]).
    recording: Option<Prepared>,
}

impl RowDeleter {
    /// Deletes rows of `table` by their integer `id_column` (ids bound as `i64`).
    pub fn new(table: &str, id_column: &str) -> Self {
        Self::comparing(table, id_column, "$1::int8[]")
    }

    /// Deletes rows of `table` by their uuid `id_column` (ids bound as their text).
    pub fn by_uuid(table: &str, id_column: &str) -> Self {
        Self::comparing(table, id_column, "$1::text[]::uuid[]")
    }

    fn comparing(table: &str, id_column: &str, ids: &'static str) -> Self {
        let (table, id) = (ident(table), ident(id_column));
        Self {
            delete: Prepared::new(format!("DELETE FROM {table} WHERE {id} = ANY({ids})")),
            table,
            id,
            ids,
            recording: None,
        }
    }

    /// Also offers [`Self::delete_and_record`], which stores the published-up-to mark of
    /// `stream` in `checkpoint_table` in the same statement (one transaction) as the delete.
    pub fn recording_in(mut self, checkpoint_table: &str, stream: &str) -> Self {
        let sql = format!(
            "WITH d AS (DELETE FROM {table} WHERE {id} = ANY({ids}) RETURNING 1),
                  n AS (SELECT count(*) AS n FROM d),
                  u AS (UPDATE {cp} SET published_lsn = $2::text::pg_lsn, updated_at = now()
                        WHERE stream = {stream} AND $3 AND (NOT $4 OR (SELECT n FROM n) = cardinality($1))
                        RETURNING 1)
             SELECT (SELECT n FROM n), (SELECT count(*) FROM u)",
            table = self.table,
            id = self.id,
            ids = self.ids,
            cp = ident(checkpoint_table),
            stream = crate::setup::literal(stream),
        );
        self.recording = Some(Prepared::new(sql));
        self
    }

    /// Deletes `ids` (of the type the deleter was made for) and, in the same statement, stores `lsn` as the stream's published-up-to
    /// mark — when `record`, and (with `expect_all`) only if every row was deleted. Returns the
    /// rows deleted and whether the mark was stored.
    pub async fn delete_and_record<T: ToSql + Sync>(
        &mut self,
        client: &Client,
        ids: &[T],
        lsn: &str,
        record: bool,
        expect_all: bool,
    ) -> Result<(u64, bool), tokio_postgres::Error> {
        let Some(recording) = &mut self.recording else {
            panic!("delete_and_record needs RowDeleter::recording_in");
        };
        let statement = recording.on(client).await?;
        let row = client.query_one(&statement, &[&ids, &lsn, &record, &expect_all]).await?;
        Ok((row.get::<_, i64>(0) as u64, row.get::<_, i64>(1) > 0))
    }

    /// Deletes `ids` in one statement (one implicit transaction) and returns the number of
    /// rows deleted. Rows already gone (a replay after a crash) are simply not counted.
    pub async fn delete<T: ToSql + Sync>(&mut self, client: &Client, ids: &[T]) -> Result<u64, tokio_postgres::Error> {
        if ids.is_empty() {
            return Ok(0);
        }
        let statement = self.delete.on(client).await?;
        client.execute(&statement, &[&ids]).await
    }
}

/// Which of `ids` (values of `id_column`) are still in `table`, ascending.
pub async fn existing_ids(
    client: &Client,
    table: &str,
    id_column: &str,
    ids: &[i64],
) -> Result<Vec<i64>, tokio_postgres::Error> {
    let id = ident(id_column);
    let sql = format!("SELECT {id}::int8 FROM {} WHERE {id} = ANY($1::int8[]) ORDER BY 1", ident(table));
    let rows = client.query(&sql, &[&ids]).await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// Which of `keys` (the text of values of the uuid `id_column`) are still in `table`.
pub async fn existing_uuids(
    client: &Client,
    table: &str,
    id_column: &str,
    keys: &[String],
) -> Result<Vec<String>, tokio_postgres::Error> {
    let id = ident(id_column);
    let sql = format!("SELECT {id}::text FROM {} WHERE {id} = ANY($1::text[]::uuid[])", ident(table));
    let rows = client.query(&sql, &[&keys]).await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}
