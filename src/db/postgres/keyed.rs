//! A mapped table identified by a uuid (Debezium's documented table): finding out that it is
//! one, and reading its rows by key. See `crate::row_keys` for the surrogate ids the core
//! sees, and `docs/drop-in.md` for what such a table cannot have (polling, catch-up, sweep).

use tokio_postgres::Client;

use crate::error::Error;
use crate::layout::Layout;
use crate::poll::PolledRow;
use outbox_postgres::setup::ident;

/// Whether `table`'s `column` is of type uuid (a missing table or column is not: the usual
/// checks name it).
pub(crate) async fn is_uuid(client: &Client, table: &str, column: &str) -> Result<bool, Error> {
    let row = client
        .query_opt(
            "SELECT a.atttypid = 'uuid'::regtype FROM pg_attribute a \
             WHERE a.attrelid = to_regclass($1) AND a.attname = $2 AND NOT a.attisdropped",
            &[&ident(table), &column],
        )
        .await
        .map_err(|e| Error::from_db(&format!("reading the type of {table}.{column}"), e))?;
    Ok(row.is_some_and(|r| r.get(0)))
}

/// The rows `keys` (surrogate id and uuid text) of `table` as they are now, in the order of
/// their surrogates; rows not in the table are left out.
pub(crate) async fn rows_by_key(
    client: &Client,
    table: &str,
    keys: &[(i64, String)],
    layout: Layout,
) -> Result<Vec<PolledRow>, Error> {
    if keys.is_empty() {
        return Ok(Vec::new());
    }
    let select = super::poll::select_list(client, table, layout, true).await?;
    let id = ident(layout.id_column());
    let sql = format!("SELECT {select} FROM {} WHERE {id} = ANY($1::text[]::uuid[])", ident(table));
    let texts: Vec<&str> = keys.iter().map(|(_, k)| k.as_str()).collect();
    let rows =
        client.query(&sql, &[&texts]).await.map_err(|e| Error::from_db(&format!("reading rows of {table}"), e))?;
    let key_at = rows.first().map_or(0, |r| r.len() - 1);
    let mut found = Vec::with_capacity(rows.len());
    for row in &rows {
        let key: String = row.get(key_at);
        let Some(&(surrogate, _)) = keys.iter().find(|(_, k)| *k == key) else { continue };
        let named = format!("'{key}'");
        let polled = match super::poll::polled(row, layout)? {
            Ok(mut record) => Ok({
                record.id = surrogate;
                record
            }),
            Err(mut invalid) => Err({
                invalid.id = Some(surrogate);
                invalid.keyed(named)
            }),
        };
        found.push((surrogate, polled));
    }
    found.sort_by_key(|(id, _)| *id);
    Ok(found.into_iter().map(|(_, row)| row).collect())
}

/// A table read by key cannot be caught up, polled or swept: there is no order to read it in.
/// The error names the column that would give it one.
pub(crate) fn no_order(table: &str, column: &str, what: &str) -> Error {
    Error::definite(
        format!("{what} {table}, whose rows are identified by the uuid {column} alone: nothing orders its rows"),
        format!(
            "add a column the database numbers (ALTER TABLE {} ADD COLUMN seq bigint GENERATED ALWAYS AS IDENTITY UNIQUE) and set [source.columns] id = \"seq\"; see docs/drop-in.md",
            ident(table)
        ),
    )
}
