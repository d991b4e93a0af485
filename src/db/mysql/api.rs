//! The message API's table on MySQL/MariaDB (`<prefix>_api_message`, see
//! [`crate::api::store`]): the statements `setup` runs, and the [`MessageStore`] the API serves
//! from, over a pool of the streamer login's sessions (each in UTC, so times read as UTC).

use std::sync::Arc;

use futures::FutureExt;
use futures::future::BoxFuture;
use outbox_mysql::mysql_async::prelude::Queryable;
use outbox_mysql::mysql_async::{self, Opts, OptsBuilder, PoolConstraints, PoolOpts, TxOpts};
use outbox_mysql::setup::{SetupPlan, ident};

use crate::api::store::{
    Decided, Decision, DueMessage, MessageStore, MessageView, NewMessage, Prepared, SUMMARY_COUNT_CAP, State, Summary,
};

/// MariaDB's and MySQL's error for a duplicate unique key.
const ER_DUP_ENTRY: u16 = 1062;

/// `<prefix>_api_message`.
pub(super) fn table(prefix: &str) -> String {
    format!("{prefix}_api_message")
}

/// The table with the indexes its queries need (the idempotency key; the check-back's due
/// messages; the pruning of old decisions), and the streamer accounts' grants: the table,
/// INSERT on the outbox tables and EXECUTE on the enqueue procedure a commit calls. The token
/// and the idempotency key are binary strings, compared byte for byte whatever the database's
/// default collation: under a case-, accent- or trailing-space-blind one, `Order-7`, `order-7`
/// and `order-7 ` would be one idempotency key, and tokens `svc` and `SVC` one owner.
pub(super) fn setup_statements(plan: &SetupPlan) -> Vec<String> {
    let q = ident(&table(&plan.prefix));
    let db = ident(&plan.database);
    let mut sql = vec![format!(
        "CREATE TABLE IF NOT EXISTS {q} (\n\
         \x20   id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,\n\
         \x20   token VARBINARY(64) NOT NULL,\n\
         \x20   idempotency_key VARBINARY(200) NULL,\n\
         \x20   state VARCHAR(16) NOT NULL DEFAULT 'prepared',\n\
         \x20   shard INT NOT NULL,\n\
         \x20   topic VARCHAR(249) NOT NULL,\n\
         \x20   msg_key VARBINARY(2048) NULL,\n\
         \x20   payload LONGBLOB NULL,\n\
         \x20   headers JSON NULL,\n\
         \x20   business_key VARCHAR(256) NULL,\n\
         \x20   checkback_url VARCHAR(2048) NULL,\n\
         \x20   checks INT NOT NULL DEFAULT 0,\n\
         \x20   next_check_at TIMESTAMP(6) NULL,\n\
         \x20   created_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),\n\
         \x20   decided_at TIMESTAMP(6) NULL,\n\
         \x20   outbox_id BIGINT NULL,\n\
         \x20   UNIQUE KEY idempotency (token, idempotency_key),\n\
         \x20   KEY due (state, next_check_at),\n\
         \x20   KEY decided (state, decided_at),\n\
         \x20   CONSTRAINT api_message_state CHECK (state IN ('prepared', 'committed', 'rolled_back'))\n\
         ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
    )];
    for account in &plan.streamer_accounts {
        sql.push(format!("GRANT SELECT, INSERT, UPDATE, DELETE ON {db}.{q} TO {account}"));
        for t in &plan.tables {
            sql.push(format!("GRANT INSERT ON {db}.{} TO {account}", ident(t)));
        }
        sql.push(format!("GRANT EXECUTE ON PROCEDURE {db}.{} TO {account}", ident(&plan.enqueue_procedure())));
    }
    sql
}

/// The [`MessageStore`] of one MySQL/MariaDB source.
pub(super) struct MyMessages {
    pool: mysql_async::Pool,
    /// Quoted: the table and the enqueue procedure.
    table: String,
    enqueue: String,
    /// The check-back's lock (`GET_LOCK`, named for the database and table) and the session
    /// that holds it.
    opts: Opts,
    lock_name: String,
    leader: tokio::sync::Mutex<Option<mysql_async::Conn>>,
}

/// A `GET_LOCK` name for `text`: itself when it fits the server's 64 characters, else a
/// stable hash of it (FNV-1a), so every instance names the same lock.
fn lock_name(text: &str) -> String {
    if text.chars().count() <= 64 {
        return text.to_string();
    }
    let hash = text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    format!("outbox-streamer check-back {hash:016x}")
}

impl MyMessages {
    pub(super) fn new(opts: Opts, prefix: &str, sessions: usize, request_timeout_ms: u64) -> anyhow::Result<Arc<Self>> {
        let constraints = PoolConstraints::new(0, sessions.max(1))
            .ok_or_else(|| anyhow::anyhow!("api.db_connections: {sessions} is not a pool size"))?;
        let database = opts.db_name().unwrap_or_default().to_string();
        let opts: Opts = OptsBuilder::from_opts(opts)
            .pool_opts(PoolOpts::default().with_constraints(constraints))
            .init(vec![
                "SET time_zone = '+00:00'".to_string(),
                // A request abandoned at its timeout does not leave its session waiting on a lock.
                format!("SET SESSION innodb_lock_wait_timeout = {}", request_timeout_ms.div_ceil(1000).max(1)),
            ])
            .into();
        Ok(Arc::new(Self {
            pool: mysql_async::Pool::new(opts.clone()),
            table: ident(&table(prefix)),
            enqueue: ident(&format!("{prefix}_enqueue")),
            lock_name: lock_name(&format!("outbox-streamer check-back {database}.{}", table(prefix))),
            opts,
            leader: tokio::sync::Mutex::new(None),
        }))
    }
}

/// RFC 3339 in UTC (the sessions' time zone), as `GET` answers times.
const UTC_TEXT: &str = "%Y-%m-%dT%H:%i:%s.%fZ";

impl MessageStore for MyMessages {
    fn prepare<'a>(
        &'a self,
        messages: &'a [NewMessage],
        check_after_s: u64,
    ) -> BoxFuture<'a, anyhow::Result<Vec<Prepared>>> {
        async move {
            let mut conn = self.pool.get_conn().await?;
            let mut tx = conn.start_transaction(TxOpts::default()).await?;
            let insert = format!(
                "INSERT INTO {} (token, idempotency_key, shard, topic, msg_key, payload, headers, business_key, \
                 checkback_url, next_check_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, NOW(6) + INTERVAL ? SECOND)",
                self.table
            );
            let mut prepared = Vec::with_capacity(messages.len());
            for m in messages {
                let params: Vec<mysql_async::Value> = vec![
                    m.token.clone().into(),
                    m.idempotency_key.clone().into(),
                    m.shard.into(),
                    m.topic.clone().into(),
                    m.key.clone().into(),
                    m.payload.clone().into(),
                    m.headers.clone().into(),
                    m.business_key.clone().into(),
                    m.checkback_url.clone().into(),
                    m.checkback_url.as_ref().map(|_| check_after_s).into(),
                ];
                match tx.exec_drop(&insert, params).await {
                    Ok(()) => {
                        let id = tx.last_insert_id().ok_or_else(|| anyhow::anyhow!("the server named no new id"))?;
                        prepared.push(Prepared { id: id as i64, state: State::Prepared, created: true });
                    }
                    Err(mysql_async::Error::Server(e)) if e.code == ER_DUP_ENTRY => {
                        // A locking read: it sees the latest committed row, not the snapshot.
                        let (id, state): (i64, String) = tx
                            .exec_first(
                                format!(
                                    "SELECT id, state FROM {} WHERE token = ? AND idempotency_key = ? LOCK IN SHARE MODE",
                                    self.table
                                ),
                                (&m.token, &m.idempotency_key),
                            )
                            .await?
                            .ok_or_else(|| anyhow::anyhow!("a duplicate idempotency key whose message is gone"))?;
                        prepared.push(Prepared { id, state: State::parse(&state)?, created: false });
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            tx.commit().await?;
            Ok(prepared)
        }
        .boxed()
    }

    fn decide<'a>(&'a self, token: &'a str, id: i64, decision: Decision) -> BoxFuture<'a, anyhow::Result<Decided>> {
        async move {
            type Row = (String, i32, String, Option<Vec<u8>>, Option<Vec<u8>>, Option<String>, Option<i64>);
            let mut conn = self.pool.get_conn().await?;
            let mut tx = conn.start_transaction(TxOpts::default()).await?;
            let row: Option<Row> = tx
                .exec_first(
                    format!(
                        "SELECT state, shard, topic, msg_key, payload, headers, outbox_id FROM {} WHERE id = ? AND token = ? FOR UPDATE",
                        self.table
                    ),
                    (id, token),
                )
                .await?;
            let Some((state, shard, topic, key, payload, headers, written)) = row else { return Ok(Decided::NotFound) };
            let state = State::parse(&state)?;
            if state != State::Prepared {
                return Ok(if state == decision.state() {
                    Decided::Already { outbox_id: written }
                } else {
                    Decided::Conflict(state)
                });
            }
            let outbox_id: Option<i64> = match decision {
                Decision::Commit => {
                    tx.exec_first(format!("CALL {}(?, ?, ?, ?, ?)", self.enqueue), (topic, key, payload, headers, shard))
                        .await?
                }
                Decision::Rollback => None,
            };
            tx.exec_drop(
                format!(
                    "UPDATE {} SET state = ?, decided_at = NOW(6), next_check_at = NULL, outbox_id = ?, \
                     msg_key = NULL, payload = NULL, headers = NULL WHERE id = ?",
                    self.table
                ),
                (decision.state().as_str(), outbox_id, id),
            )
            .await?;
            tx.commit().await?;
            Ok(Decided::Now { outbox_id })
        }
        .boxed()
    }

    fn get<'a>(&'a self, token: &'a str, id: i64) -> BoxFuture<'a, anyhow::Result<Option<MessageView>>> {
        async move {
            type Row = (i64, String, String, Option<String>, i32, String, Option<String>, i32);
            let mut conn = self.pool.get_conn().await?;
            let row: Option<Row> = conn
                .exec_first(
                    format!(
                        "SELECT id, state, DATE_FORMAT(created_at, '{UTC_TEXT}'), DATE_FORMAT(decided_at, '{UTC_TEXT}'), \
                         shard, topic, business_key, checks FROM {} WHERE id = ? AND token = ?",
                        self.table
                    ),
                    (id, token),
                )
                .await?;
            row.map(|(id, state, prepared_at, decided_at, shard, topic, business_key, checks)| {
                Ok(MessageView {
                    id,
                    state: State::parse(&state)?,
                    prepared_at,
                    decided_at,
                    shard: shard as u32,
                    topic,
                    business_key,
                    checks,
                })
            })
            .transpose()
        }
        .boxed()
    }

    fn prune(&self, keep_s: u64, limit: u32) -> BoxFuture<'_, anyhow::Result<u64>> {
        async move {
            let mut conn = self.pool.get_conn().await?;
            conn.exec_drop(
                format!(
                    "DELETE FROM {} WHERE state IN ('committed', 'rolled_back') AND decided_at < NOW(6) - INTERVAL ? SECOND LIMIT ?",
                    self.table
                ),
                (keep_s, limit),
            )
            .await?;
            Ok(conn.affected_rows())
        }
        .boxed()
    }

    fn oldest_prepared_age(&self) -> BoxFuture<'_, anyhow::Result<Option<f64>>> {
        async move {
            let mut conn = self.pool.get_conn().await?;
            let age: Option<Option<f64>> = conn
                .query_first(format!(
                    "SELECT TIMESTAMPDIFF(MICROSECOND, MIN(created_at), NOW(6)) / 1e6 FROM {} WHERE state = 'prepared'",
                    self.table
                ))
                .await?;
            Ok(age.flatten())
        }
        .boxed()
    }

    fn due(&self, limit: u32) -> BoxFuture<'_, anyhow::Result<Vec<DueMessage>>> {
        async move {
            let mut conn = self.pool.get_conn().await?;
            type Row = (i64, String, Option<String>, Option<String>, i32);
            let rows: Vec<Row> = conn
                .exec(
                    format!(
                        "SELECT id, token, business_key, checkback_url, checks FROM {} \
                         WHERE state = 'prepared' AND next_check_at <= NOW(6) ORDER BY next_check_at LIMIT ?",
                        self.table
                    ),
                    (limit,),
                )
                .await?;
            Ok(rows
                .into_iter()
                .map(|(id, token, business_key, checkback_url, checks)| DueMessage {
                    id,
                    token,
                    business_key: business_key.unwrap_or_default(),
                    checkback_url: checkback_url.unwrap_or_default(),
                    checks,
                })
                .collect())
        }
        .boxed()
    }

    fn checked(&self, id: i64, retry_in_s: Option<u64>) -> BoxFuture<'_, anyhow::Result<()>> {
        async move {
            let mut conn = self.pool.get_conn().await?;
            conn.exec_drop(
                format!(
                    "UPDATE {} SET checks = checks + 1, next_check_at = NOW(6) + INTERVAL ? SECOND \
                     WHERE id = ? AND state = 'prepared'",
                    self.table
                ),
                (retry_in_s, id),
            )
            .await?;
            Ok(())
        }
        .boxed()
    }

    fn lead(&self) -> BoxFuture<'_, anyhow::Result<bool>> {
        async move {
            let mut leader = self.leader.lock().await;
            if let Some(conn) = leader.as_mut() {
                // The lock lives as long as its session: a session that answers still holds it.
                if conn.ping().await.is_ok() {
                    return Ok(true);
                }
                *leader = None;
            }
            let mut conn = mysql_async::Conn::new(self.opts.clone()).await?;
            let held: Option<Option<i64>> = conn.exec_first("SELECT GET_LOCK(?, 0)", (&self.lock_name,)).await?;
            if held.flatten() == Some(1) {
                *leader = Some(conn);
                Ok(true)
            } else {
                conn.disconnect().await.ok();
                Ok(false)
            }
        }
        .boxed()
    }

    fn summary(&self) -> BoxFuture<'_, anyhow::Result<Summary>> {
        async move {
            let mut conn = self.pool.get_conn().await?;
            let count = |state: &str| {
                format!(
                    "(SELECT COUNT(*) FROM (SELECT 1 FROM {} WHERE state = '{state}' LIMIT {SUMMARY_COUNT_CAP}) c)",
                    self.table
                )
            };
            type Row = (i64, i64, i64, i64, i64, Option<f64>);
            let row: Option<Row> = conn
                .query_first(format!(
                    "SELECT {}, {}, {}, \
                     (SELECT COUNT(*) FROM {t} WHERE state = 'prepared' AND next_check_at IS NULL AND checks > 0), \
                     (SELECT CAST(COALESCE(SUM(checks), 0) AS SIGNED) FROM {t} WHERE state = 'prepared'), \
                     (SELECT TIMESTAMPDIFF(MICROSECOND, MIN(created_at), NOW(6)) / 1e6 FROM {t} WHERE state = 'prepared')",
                    count("prepared"),
                    count("committed"),
                    count("rolled_back"),
                    t = self.table
                ))
                .await?;
            let (prepared, committed, rolled_back, given_up, checks, oldest_prepared_s) = row.unwrap_or_default();
            Ok(Summary { prepared, given_up, committed, rolled_back, checks, oldest_prepared_s })
        }
        .boxed()
    }
}

/// `teardown` of the message API's table (see [`crate::db::teardown::message_table_verdict`]):
/// `None` when there is none. The grants on it are revoked once it is dropped (MariaDB and
/// MySQL keep table grants after `DROP TABLE`).
pub(super) async fn tear_down(
    conn: &mut mysql_async::Conn,
    plan: &outbox_mysql::teardown::TeardownPlan,
    source_busy: Option<&str>,
    options: crate::db::teardown::Options,
) -> Vec<crate::db::teardown::Line> {
    use crate::db::teardown::{Line, Object, Verdict, message_table_verdict};
    use outbox_mysql::teardown::TableGrant;
    let name = table(&plan.table_prefix);
    let q = format!("{}.{}", ident(&plan.database), ident(&name));
    let exists: Result<Option<i64>, _> = conn
        .exec_first(
            "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = ? AND table_name = ?",
            (&plan.database, &name),
        )
        .await;
    match exists {
        Ok(Some(n)) if n > 0 => {}
        Ok(_) => return Vec::new(),
        Err(e) => return vec![Line::Note(format!("cannot look for the message API table {name:?}: {e}"))],
    }
    let count = format!("SELECT COUNT(*) FROM {q} WHERE state = 'prepared'");
    let prepared: i64 = match conn.query_first(&count).await {
        Ok(n) => n.unwrap_or(0),
        Err(e) => {
            return vec![Line::Leave(vec![Object::MessageTable { name, prepared: 0 }], super::teardown::reason(&e))];
        }
    };
    let object = |prepared| Object::MessageTable { name: name.clone(), prepared };
    match (message_table_verdict(prepared, source_busy, options.drop_pending), options.act) {
        (Verdict::Leave(why), _) => return vec![Line::Leave(vec![object(prepared)], why)],
        (Verdict::Drop, false) => return vec![Line::Drop(vec![object(prepared)])],
        (Verdict::Drop, true) => {}
    }
    if let Err(e) = conn.query_drop(format!("DROP TABLE {q}")).await {
        return vec![Line::Leave(vec![object(prepared)], super::teardown::reason(&e))];
    }
    let mut lines = vec![Line::Drop(vec![object(prepared)])];
    let grants: Result<Vec<TableGrant>, _> = conn
        .exec_map(
            "SELECT User, Host, Table_name, Table_priv FROM mysql.tables_priv WHERE Db = ? AND Table_name = ?",
            (&plan.database, &name),
            |(user, host, table, privileges)| TableGrant { user, host, table, privileges },
        )
        .await;
    match grants {
        Ok(grants) => {
            for grant in grants {
                let object = Object::Grants { grantee: grant.grantee(), table: grant.table.clone() };
                lines.push(match outbox_mysql::teardown::revoke(conn, plan, &grant).await {
                    Ok(()) => Line::Drop(vec![object]),
                    Err(e) => Line::Leave(vec![object], super::teardown::reason(&e)),
                });
            }
        }
        Err(e) => lines.push(Line::Note(format!(
            "cannot read mysql.tables_priv ({e}): grants on {name:?} are not revoked; SHOW GRANTS for the streamer's login and REVOKE them"
        ))),
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::lock_name;

    #[test]
    fn lock_names_fit_the_servers_limit_and_are_stable() {
        assert_eq!(lock_name("short"), "short");
        let long = "outbox-streamer check-back a_database_with_a_long_name.a_prefix_of_forty_characters_api_message";
        assert_eq!(lock_name(long), lock_name(long));
        assert!(lock_name(long).len() <= 64);
        assert_ne!(lock_name(long), lock_name(&long.replace("forty", "fifty")));
    }
}
