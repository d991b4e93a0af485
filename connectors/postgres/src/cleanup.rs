//! Deleting published rows: one statement per acknowledged prefix, on an ordinary session.

use tokio_postgres::Client;

use crate::setup::ident;

/// Deletes `ids` from `table` in one statement (one implicit transaction) and returns the
/// number of rows deleted. Rows already gone (a replay after a crash) are simply not counted.
pub async fn delete_rows(client: &Client, table: &str, ids: &[i64]) -> Result<u64, tokio_postgres::Error> {
    if ids.is_empty() {
        return Ok(0);
    }
    let sql = format!("DELETE FROM {} WHERE id = ANY($1)", ident(table));
    client.execute(&sql, &[&ids]).await
}

/// Which of `ids` are still in `table`: used after a reconnect to skip replayed rows that were
/// already published and deleted.
pub async fn existing_ids(client: &Client, table: &str, ids: &[i64]) -> Result<Vec<i64>, tokio_postgres::Error> {
    let sql = format!("SELECT id FROM {} WHERE id = ANY($1) ORDER BY id", ident(table));
    let rows = client.query(&sql, &[&ids]).await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}
