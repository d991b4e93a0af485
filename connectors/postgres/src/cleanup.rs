//! Deleting published rows: one statement per acknowledged prefix, on an ordinary session.

use tokio_postgres::{Client, Statement};

use crate::setup::ident;

/// Deletes published rows of one table. The statement is prepared on a session's first delete
/// and reused, so each cleanup is one round trip with no parse or plan on the server.
#[derive(Debug)]
pub struct RowDeleter {
    sql: String,
    /// Prepared on the session it was used with; a new session needs a new deleter.
    prepared: Option<Statement>,
}

impl RowDeleter {
    pub fn new(table: &str) -> Self {
        Self { sql: format!("DELETE FROM {} WHERE id = ANY($1)", ident(table)), prepared: None }
    }

    /// Deletes `ids` in one statement (one implicit transaction) and returns the number of
    /// rows deleted. Rows already gone (a replay after a crash) are simply not counted.
    pub async fn delete(&mut self, client: &Client, ids: &[i64]) -> Result<u64, tokio_postgres::Error> {
        if ids.is_empty() {
            return Ok(0);
        }
        let statement = match &self.prepared {
            Some(statement) => statement.clone(),
            None => {
                let statement = client.prepare(&self.sql).await?;
                self.prepared = Some(statement.clone());
                statement
            }
        };
        client.execute(&statement, &[&ids]).await
    }
}

/// Which of `ids` are still in `table`: used after a reconnect to skip replayed rows that were
/// already published and deleted.
pub async fn existing_ids(client: &Client, table: &str, ids: &[i64]) -> Result<Vec<i64>, tokio_postgres::Error> {
    let sql = format!("SELECT id FROM {} WHERE id = ANY($1) ORDER BY id", ident(table));
    let rows = client.query(&sql, &[&ids]).await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}
