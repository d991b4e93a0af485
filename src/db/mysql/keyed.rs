//! A mapped table identified by a text key (Debezium's outbox table with its uuid `id` in a
//! `CHAR(36)`): finding out that it is one, and reading and deleting its rows by key. See
//! `crate::row_keys` for the surrogate ids the core sees, and `docs/drop-in.md` for what such a
//! table cannot have (polling, catch-up, sweep).

use outbox_mysql::binlog::Cell;
use outbox_mysql::mysql_async::prelude::Queryable;
use outbox_mysql::mysql_async::{Conn, IsolationLevel, Row, TxOpts, Value};
use outbox_mysql::setup::ident;

use crate::error::Error;
use crate::layout::Layout;
use crate::poll::PolledRow;
use crate::source::within;

/// Whether `table`'s `column` is text (`char`/`varchar`): such an id is a key, not a number (a
/// missing table or column is not: the usual checks name it). Any other type that is not an
/// integer (MariaDB's `UUID`, `BINARY(16)`) can be neither, and is an error naming the fix.
pub(crate) async fn is_text(conn: &mut Conn, table: &str, column: &str) -> Result<bool, Error> {
    let found: Option<String> = conn
        .exec_first(
            "SELECT DATA_TYPE FROM information_schema.COLUMNS \
             WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? AND COLUMN_NAME = ?",
            (table, column),
        )
        .await
        .map_err(|e| Error::from_db(&format!("reading the type of {table}.{column}"), e))?;
    match found {
        Some(t) if is_text_type(&t) => Ok(true),
        Some(t) if !is_integer_type(&t) => Err(Error::definite(
            format!("{table}.{column} identifies rows and has type {t}, which is neither an integer nor a text key"),
            format!(
                "keep a uuid id in CHAR(36) (ALTER TABLE {t_} MODIFY {c} CHAR(36) NOT NULL), or give the table an order (ALTER TABLE {t_} ADD COLUMN seq BIGINT NOT NULL AUTO_INCREMENT UNIQUE) and set [source.columns] id = \"seq\"",
                t_ = ident(table),
                c = ident(column)
            ),
        )),
        _ => Ok(false),
    }
}

/// The `information_schema` data types of integer ids.
pub(crate) fn is_integer_type(data_type: &str) -> bool {
    matches!(data_type.to_ascii_lowercase().as_str(), "tinyint" | "smallint" | "mediumint" | "int" | "bigint")
}

/// The `information_schema` data types read as keys.
pub(crate) fn is_text_type(data_type: &str) -> bool {
    matches!(data_type.to_ascii_lowercase().as_str(), "char" | "varchar")
}

/// `key` as an SQL string literal, for the statements a halt prints.
pub(crate) fn literal(key: &str) -> String {
    format!("'{}'", key.replace('\\', "\\\\").replace('\'', "''"))
}

/// The statement deleting the rows whose `column` is one of `n` keys bound as parameters.
pub(crate) fn delete_sql(table: &str, column: &str, n: usize) -> String {
    format!("DELETE FROM {} WHERE {} IN ({})", ident(table), ident(column), placeholders(n))
}

fn placeholders(n: usize) -> String {
    vec!["?"; n].join(",")
}

/// Which of `keys` (surrogate and key) are still in `table`, as surrogates, ascending.
pub(crate) async fn existing(
    conn: &mut Conn,
    table: &str,
    column: &str,
    keys: &[(i64, String)],
) -> Result<Vec<i64>, Error> {
    if keys.is_empty() {
        return Ok(Vec::new());
    }
    let sql =
        format!("SELECT {c} FROM {} WHERE {c} IN ({})", ident(table), placeholders(keys.len()), c = ident(column));
    let params: Vec<&str> = keys.iter().map(|(_, k)| k.as_str()).collect();
    let found: Vec<String> = within("checking rows", conn.exec(sql, params)).await?;
    let mut ids: Vec<i64> = keys.iter().filter(|(_, k)| found.contains(k)).map(|(id, _)| *id).collect();
    ids.sort_unstable();
    Ok(ids)
}

/// The rows `keys` of `table` as they are now, in the order of their surrogates; rows not in
/// the table are left out. A locking read (READ COMMITTED, no gap locks) waits for a
/// transaction still inserting one of them, which the binlog may show first.
pub(crate) async fn rows_by_key(
    conn: &mut Conn,
    table: &str,
    keys: &[(i64, String)],
    layout: Layout,
) -> Result<Vec<PolledRow>, Error> {
    if keys.is_empty() {
        return Ok(Vec::new());
    }
    let sql = format!(
        "SELECT {} FROM {} WHERE {} IN ({}) LOCK IN SHARE MODE",
        super::poll::columns(layout),
        ident(table),
        ident(layout.id_column()),
        placeholders(keys.len())
    );
    let params: Vec<Value> = keys.iter().map(|(_, k)| Value::from(k.as_str())).collect();
    let what = format!("reading rows of {table}");
    let mut opts = TxOpts::default();
    opts.with_isolation_level(IsolationLevel::ReadCommitted);
    let mut tx = within(&what, conn.start_transaction(opts)).await?;
    let rows: Vec<Row> = within(&what, tx.exec(sql, params)).await?;
    within(&what, tx.commit()).await?;
    let mut found: Vec<(i64, PolledRow)> = Vec::with_capacity(rows.len());
    let id_column = layout.id_column();
    for row in rows {
        let values = super::poll::cells(row);
        let key = values.iter().find(|(n, _)| n == id_column).and_then(|(_, c)| match c {
            Cell::Bytes(b) => Some(String::from_utf8_lossy(b).into_owned()),
            _ => None,
        });
        let Some((surrogate, key)) = key.and_then(|key| keys.iter().find(|(_, k)| *k == key)) else { continue };
        let record = super::cdc::record_as(&values, layout, Some(*surrogate)).map_err(|e| e.keyed(literal(key)));
        found.push((*surrogate, record));
    }
    found.sort_by_key(|(id, _)| *id);
    Ok(found.into_iter().map(|(_, row)| row).collect())
}

/// A table read by key cannot be polled or caught up: nothing orders its rows. The error names
/// the column that would give it an order.
pub(crate) fn no_order(table: &str, column: &str) -> Error {
    Error::definite(
        format!(
            "cannot poll or catch up {table}, whose rows are identified by the text {column} alone: nothing orders its rows"
        ),
        format!(
            "add a column the database numbers (ALTER TABLE {} ADD COLUMN seq BIGINT NOT NULL AUTO_INCREMENT UNIQUE) and set [source.columns] id = \"seq\"; see docs/drop-in.md",
            ident(table)
        ),
    )
}

/// A statement-logged write to a table read by key: its rows are in the table but not in the
/// binlog, and without an order there is no sweep to find them, so the stream halts.
pub(crate) fn statement_write(table: &str, column: &str, txn: &str, stream: &str) -> Error {
    Error::definite(
        format!(
            "transaction {txn} inserted into {table} with binlog_format=STATEMENT or MIXED: the binlog holds the statement, not the rows, and a table identified by the text {column} alone cannot be swept for them"
        ),
        format!(
            "set binlog_format=ROW for every session that writes the outbox (SET GLOBAL binlog_format=ROW, and reconnect them); then either have every row in the table sent: give it an order (ALTER TABLE {} ADD COLUMN seq BIGINT NOT NULL AUTO_INCREMENT UNIQUE;), set [source.columns] id = \"seq\" and mode = \"polling\", run until {table} is empty, then remove mode = \"polling\" (the next run catches up and streams again); or discard that transaction's rows with `outbox-streamer skip --stream {stream} --transaction {txn}` and DELETE them from {table} yourself",
            ident(table)
        ),
    )
}
