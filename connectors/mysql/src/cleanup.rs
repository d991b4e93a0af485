//! Deleting published rows by id without touching any other row.
//!
//! `DELETE … WHERE id IN (…)` looks harmless, but for a list covering much of a small table
//! the optimizer picks a full scan, and a locking full scan waits on every row an open
//! transaction has just inserted — the application's row lock stalls the cleanup (and, with a
//! lock wait timeout, restarts the stream). Joining a `JSON_TABLE` of the ids to the primary key
//! makes every row an `eq_ref` lookup: only the listed rows are ever locked.
//! (MariaDB 10.6+, MySQL 8.0.4+.)

use crate::setup::ident;

/// The statement deleting exactly the rows whose `id_column` is one of `ids` from `table`;
/// `ids` must not be empty, and `id_column` should have a unique index.
pub fn delete_by_ids(table: &str, id_column: &str, ids: &[i64]) -> String {
    let list = ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
    format!(
        "DELETE t FROM JSON_TABLE('[{list}]', '$[*]' COLUMNS (id BIGINT PATH '$')) AS d \
         STRAIGHT_JOIN {} AS t ON t.{} = d.id",
        ident(table),
        ident(id_column)
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn lists_the_ids_as_json() {
        let sql = super::delete_by_ids("outbox_0_0", "id", &[3, 5]);
        assert!(sql.contains("JSON_TABLE('[3,5]'"), "{sql}");
        assert!(sql.contains("STRAIGHT_JOIN `outbox_0_0` AS t ON t.`id` = d.id"), "{sql}");
    }
}
