//! A statement prepared on a session's first use and reused after: each later run is one
//! round trip (Bind, Execute, Sync) with no parse or plan on the server. An unprepared
//! `query(&str, …)` costs two round trips and a Close, every time.

use tokio_postgres::{Client, Statement};

/// One SQL text and, once run, its statement on the session it ran on. A statement belongs to
/// its session: a new session needs a new `Prepared`.
#[derive(Debug)]
pub struct Prepared {
    sql: String,
    statement: Option<Statement>,
}

impl Prepared {
    pub fn new(sql: impl Into<String>) -> Self {
        Self { sql: sql.into(), statement: None }
    }

    /// The statement on `client`'s session, prepared there the first time.
    pub async fn on(&mut self, client: &Client) -> Result<Statement, tokio_postgres::Error> {
        if let Some(statement) = &self.statement {
            return Ok(statement.clone());
        }
        let statement = client.prepare(&self.sql).await?;
        self.statement = Some(statement.clone());
        Ok(statement)
    }
}
