//! The message API's table on PostgreSQL (`<prefix>_api_message`, see [`crate::api::store`]):
//! the statements `setup` runs, and the [`MessageStore`] the API serves from, over a small pool
//! of the streamer login's sessions.

use std::sync::{Arc, Mutex};

use futures::FutureExt;
use futures::future::BoxFuture;
use outbox_postgres::connect::PgTarget;
use outbox_postgres::setup::{SetupPlan, ident};
use tokio::sync::Semaphore;
use tokio_postgres::Client;

use crate::api::store::{
    Decided, Decision, DueMessage, MessageStore, MessageView, NewMessage, Prepared, SUMMARY_COUNT_CAP, State, Summary,
};

/// `<prefix>_api_message`.
pub(super) fn table(prefix: &str) -> String {
    format!("{prefix}_api_message")
}

/// The table, its two partial indexes (the check-back's due messages, the pruning of old
/// decisions: each covers only the rows its query reads) and the streamer login's grants: the
/// table, INSERT on the outbox tables and the enqueue (and emit) function a commit calls.
pub(super) fn setup_statements(plan: &SetupPlan) -> Vec<String> {
    let t = table(&plan.prefix);
    let q = ident(&t);
    let mut sql = vec![
        format!(
            "CREATE TABLE IF NOT EXISTS {q} (\n\
             \x20   id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,\n\
             \x20   token text NOT NULL,\n\
             \x20   idempotency_key text NULL,\n\
             \x20   state text NOT NULL DEFAULT 'prepared' CHECK (state IN ('prepared', 'committed', 'rolled_back')),\n\
             \x20   shard int NOT NULL,\n\
             \x20   topic text NOT NULL,\n\
             \x20   msg_key bytea NULL,\n\
             \x20   payload bytea NULL,\n\
             \x20   headers jsonb NULL,\n\
             \x20   business_key text NULL,\n\
             \x20   checkback_url text NULL,\n\
             \x20   checks int NOT NULL DEFAULT 0,\n\
             \x20   next_check_at timestamptz NULL,\n\
             \x20   created_at timestamptz NOT NULL DEFAULT now(),\n\
             \x20   decided_at timestamptz NULL,\n\
             \x20   outbox_id bigint NULL,\n\
             \x20   UNIQUE (token, idempotency_key)\n\
             )"
        ),
        format!(
            "CREATE INDEX IF NOT EXISTS {} ON {q} (next_check_at) WHERE state = 'prepared'",
            ident(&format!("{t}_due"))
        ),
        format!(
            "CREATE INDEX IF NOT EXISTS {} ON {q} (decided_at) WHERE state <> 'prepared'",
            ident(&format!("{t}_decided"))
        ),
    ];
    if let Some(role) = &plan.streamer_role {
        let role = ident(role);
        sql.push(format!("GRANT SELECT, INSERT, UPDATE, DELETE ON {q} TO {role}"));
        for s in &plan.streams {
            sql.push(format!("GRANT INSERT ON {} TO {role}", ident(&s.table)));
        }
        sql.push(format!("GRANT EXECUTE ON FUNCTION {} TO {role}", plan.enqueue_signature()));
        sql.push(format!(
            "GRANT EXECUTE ON FUNCTION {}(text, bytea, bytea, jsonb, int, int) TO {role}",
            ident(&plan.emit_function())
        ));
    }
    sql
}

/// The API's sessions: at most `size`, opened when needed, kept while they work. Each runs
/// with `statement_timeout` (a request's time) and checks every second that its client is
/// still there, so a statement whose request was abandoned does not outlive it.
struct Pool {
    target: PgTarget,
    idle: Mutex<Vec<Client>>,
    places: Semaphore,
    statement_timeout_ms: u64,
}

/// A session taken from the pool. Given back by [`Session::done`] once what it ran has
/// finished; dropped otherwise (an error, or a request abandoned at its timeout while a
/// statement may still run or wait for a lock): a session is never handed out mid-statement.
struct Session<'a> {
    client: Option<Client>,
    pool: &'a Pool,
    _place: tokio::sync::SemaphorePermit<'a>,
}

impl Pool {
    async fn get(&self) -> anyhow::Result<Session<'_>> {
        let place = self.places.acquire().await?;
        let idle = {
            let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            idle.retain(|c| !c.is_closed());
            idle.pop()
        };
        let client = match idle {
            Some(c) => c,
            None => {
                let c = self.target.connect().await?;
                c.batch_execute(&format!("SET statement_timeout = {}", self.statement_timeout_ms)).await?;
                // PostgreSQL 14 and later; older servers notice a gone client only when they answer.
                let _ = c.batch_execute("SET client_connection_check_interval = 1000").await;
                c
            }
        };
        Ok(Session { client: Some(client), pool: self, _place: place })
    }
}

impl Session<'_> {
    fn client(&mut self) -> &mut Client {
        self.client.as_mut().expect("a session holds its client until done or dropped")
    }

    /// What the session ran has finished: it goes back to the pool.
    fn done(mut self) {
        if let Some(c) = self.client.take().filter(|c| !c.is_closed()) {
            self.pool.idle.lock().unwrap_or_else(|e| e.into_inner()).push(c);
        }
    }
}

/// The [`MessageStore`] of one PostgreSQL source.
pub(super) struct PgMessages {
    pool: Pool,
    /// Quoted: the table and the enqueue function.
    table: String,
    enqueue: String,
    /// The check-back's lock (an advisory lock keyed by the table's name) and the session
    /// that holds it.
    lock_name: String,
    leader: tokio::sync::Mutex<Option<Client>>,
}

impl PgMessages {
    pub(super) fn new(target: PgTarget, prefix: &str, sessions: usize, statement_timeout_ms: u64) -> Arc<Self> {
        let lock_name = format!("outbox-streamer check-back {}.{}", target.database(), table(prefix));
        Arc::new(Self {
            pool: Pool { target, idle: Mutex::new(Vec::new()), places: Semaphore::new(sessions), statement_timeout_ms },
            table: ident(&table(prefix)),
            enqueue: ident(&format!("{prefix}_enqueue")),
            lock_name,
            leader: tokio::sync::Mutex::new(None),
        })
    }
}

/// RFC 3339 in UTC, as `GET` answers times.
const UTC_TEXT: &str = "YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"";

impl MessageStore for PgMessages {
    fn prepare<'a>(
        &'a self,
        messages: &'a [NewMessage],
        check_after_s: u64,
    ) -> BoxFuture<'a, anyhow::Result<Vec<Prepared>>> {
        async move {
            let mut session = self.pool.get().await?;
            let tx = session.client().transaction().await?;
            let insert = tx
                .prepare(&format!(
                    "INSERT INTO {} (token, idempotency_key, shard, topic, msg_key, payload, headers, business_key, \
                     checkback_url, next_check_at) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7::text::jsonb, $8, $9, now() + $10::float8 * interval '1 second') \
                     ON CONFLICT (token, idempotency_key) DO NOTHING RETURNING id",
                    self.table
                ))
                .await?;
            let mut prepared = Vec::with_capacity(messages.len());
            for m in messages {
                let shard = m.shard as i32;
                let row = tx
                    .query_opt(
                        &insert,
                        &[
                            &m.token,
                            &m.idempotency_key,
                            &shard,
                            &m.topic,
                            &m.key,
                            &m.payload,
                            &m.headers,
                            &m.business_key,
                            &m.checkback_url,
                            &m.checkback_url.as_ref().map(|_| check_after_s as f64),
                        ],
                    )
                    .await?;
                prepared.push(match row {
                    Some(row) => Prepared { id: row.get(0), state: State::Prepared, created: true },
                    None => {
                        let row = tx
                            .query_one(
                                &format!("SELECT id, state FROM {} WHERE token = $1 AND idempotency_key = $2", self.table),
                                &[&m.token, &m.idempotency_key],
                            )
                            .await?;
                        Prepared { id: row.get(0), state: State::parse(row.get(1))?, created: false }
                    }
                });
            }
            tx.commit().await?;
            session.done();
            Ok(prepared)
        }
        .boxed()
    }

    fn decide<'a>(&'a self, token: &'a str, id: i64, decision: Decision) -> BoxFuture<'a, anyhow::Result<Decided>> {
        async move {
            let mut session = self.pool.get().await?;
            let tx = session.client().transaction().await?;
            let row = tx
                .query_opt(
                    &format!("SELECT state, outbox_id FROM {} WHERE id = $1 AND token = $2 FOR UPDATE", self.table),
                    &[&id, &token],
                )
                .await?;
            let decided = match &row {
                None => Some(Decided::NotFound),
                Some(row) => match State::parse(row.get(0))? {
                    State::Prepared => None,
                    state if state == decision.state() => Some(Decided::Already { outbox_id: row.get(1) }),
                    state => Some(Decided::Conflict(state)),
                },
            };
            if let Some(decided) = decided {
                tx.rollback().await?;
                session.done();
                return Ok(decided);
            }
            // Every SET expression reads the row as it was, so the enqueue gets the message.
            let outbox_id = match decision {
                Decision::Commit => format!("{}(topic, msg_key, payload, headers, shard)", self.enqueue),
                Decision::Rollback => "NULL".into(),
            };
            let row = tx
                .query_one(
                    &format!(
                        "UPDATE {} SET state = $2, decided_at = now(), next_check_at = NULL, outbox_id = {outbox_id}, \
                         msg_key = NULL, payload = NULL, headers = NULL WHERE id = $1 RETURNING outbox_id",
                        self.table
                    ),
                    &[&id, &decision.state().as_str()],
                )
                .await?;
            tx.commit().await?;
            session.done();
            Ok(Decided::Now { outbox_id: row.get(0) })
        }
        .boxed()
    }

    fn get<'a>(&'a self, token: &'a str, id: i64) -> BoxFuture<'a, anyhow::Result<Option<MessageView>>> {
        async move {
            let mut session = self.pool.get().await?;
            let row = session
                .client()
                .query_opt(
                    &format!(
                        "SELECT id, state, to_char(created_at AT TIME ZONE 'UTC', '{UTC_TEXT}'), \
                         to_char(decided_at AT TIME ZONE 'UTC', '{UTC_TEXT}'), shard, topic, business_key, checks \
                         FROM {} WHERE id = $1 AND token = $2",
                        self.table
                    ),
                    &[&id, &token],
                )
                .await?;
            session.done();
            row.map(|r| {
                Ok(MessageView {
                    id: r.get(0),
                    state: State::parse(r.get(1))?,
                    prepared_at: r.get(2),
                    decided_at: r.get(3),
                    shard: r.get::<_, i32>(4) as u32,
                    topic: r.get(5),
                    business_key: r.get(6),
                    checks: r.get(7),
                })
            })
            .transpose()
        }
        .boxed()
    }

    fn prune(&self, keep_s: u64, limit: u32) -> BoxFuture<'_, anyhow::Result<u64>> {
        async move {
            let mut session = self.pool.get().await?;
            let pruned = session
                .client()
                .execute(
                    &format!(
                        "DELETE FROM {t} WHERE id IN (SELECT id FROM {t} WHERE state <> 'prepared' \
                         AND decided_at < now() - $1::float8 * interval '1 second' LIMIT $2)",
                        t = self.table
                    ),
                    &[&(keep_s as f64), &i64::from(limit)],
                )
                .await?;
            session.done();
            Ok(pruned)
        }
        .boxed()
    }

    fn oldest_prepared_age(&self) -> BoxFuture<'_, anyhow::Result<Option<f64>>> {
        async move {
            let mut session = self.pool.get().await?;
            let age = session
                .client()
                .query_one(
                    &format!(
                        "SELECT extract(epoch FROM now() - min(created_at))::float8 FROM {} WHERE state = 'prepared'",
                        self.table
                    ),
                    &[],
                )
                .await?
                .get(0);
            session.done();
            Ok(age)
        }
        .boxed()
    }

    fn due(&self, limit: u32) -> BoxFuture<'_, anyhow::Result<Vec<DueMessage>>> {
        async move {
            let mut session = self.pool.get().await?;
            let rows = session
                .client()
                .query(
                    &format!(
                        "SELECT id, token, business_key, checkback_url, checks FROM {} \
                         WHERE state = 'prepared' AND next_check_at <= now() ORDER BY next_check_at LIMIT $1",
                        self.table
                    ),
                    &[&i64::from(limit)],
                )
                .await?;
            session.done();
            Ok(rows
                .iter()
                .map(|r| DueMessage {
                    id: r.get(0),
                    token: r.get(1),
                    business_key: r.get::<_, Option<String>>(2).unwrap_or_default(),
                    checkback_url: r.get::<_, Option<String>>(3).unwrap_or_default(),
                    checks: r.get(4),
                })
                .collect())
        }
        .boxed()
    }

    fn checked(&self, id: i64, retry_in_s: Option<u64>) -> BoxFuture<'_, anyhow::Result<()>> {
        async move {
            let mut session = self.pool.get().await?;
            session
                .client()
                .execute(
                    &format!(
                        "UPDATE {} SET checks = checks + 1, next_check_at = now() + $2::float8 * interval '1 second' \
                         WHERE id = $1 AND state = 'prepared'",
                        self.table
                    ),
                    &[&id, &retry_in_s.map(|s| s as f64)],
                )
                .await?;
            session.done();
            Ok(())
        }
        .boxed()
    }

    fn lead(&self) -> BoxFuture<'_, anyhow::Result<bool>> {
        async move {
            let mut leader = self.leader.lock().await;
            if let Some(client) = leader.as_ref() {
                // The lock lives as long as its session: a session that answers still holds it.
                if client.simple_query("SELECT 1").await.is_ok() {
                    return Ok(true);
                }
                *leader = None;
            }
            let client = self.pool.target.connect().await?;
            let held: bool =
                client.query_one("SELECT pg_try_advisory_lock(hashtext($1))", &[&self.lock_name]).await?.get(0);
            if held {
                *leader = Some(client);
            }
            Ok(held)
        }
        .boxed()
    }

    fn summary(&self) -> BoxFuture<'_, anyhow::Result<Summary>> {
        async move {
            let mut session = self.pool.get().await?;
            let count = |state: &str| {
                format!(
                    "(SELECT count(*) FROM (SELECT 1 FROM {} WHERE state = '{state}' LIMIT {SUMMARY_COUNT_CAP}) c)",
                    self.table
                )
            };
            let row = session
                .client()
                .query_one(
                    &format!(
                        "SELECT {}, {}, {}, \
                         (SELECT count(*) FROM {t} WHERE state = 'prepared' AND next_check_at IS NULL AND checks > 0), \
                         (SELECT coalesce(sum(checks), 0)::bigint FROM {t} WHERE state = 'prepared'), \
                         (SELECT extract(epoch FROM now() - min(created_at))::float8 FROM {t} WHERE state = 'prepared')",
                        count("prepared"),
                        count("committed"),
                        count("rolled_back"),
                        t = self.table
                    ),
                    &[],
                )
                .await?;
            session.done();
            Ok(Summary {
                prepared: row.get(0),
                committed: row.get(1),
                rolled_back: row.get(2),
                given_up: row.get(3),
                checks: row.get(4),
                oldest_prepared_s: row.get(5),
            })
        }
        .boxed()
    }
}

/// `teardown` of the message API's table (see [`crate::db::teardown::message_table_verdict`]):
/// `None` when there is none. Counted and dropped under an exclusive lock, so no message is
/// prepared between the count and the drop.
pub(super) async fn tear_down(
    client: &mut Client,
    prefix: &str,
    source_busy: Option<&str>,
    options: crate::db::teardown::Options,
) -> Option<crate::db::teardown::Line> {
    use crate::db::teardown::{Line, Object, Verdict, message_table_verdict};
    let name = table(prefix);
    let q = ident(&name);
    let exists: bool = match client.query_one("SELECT to_regclass($1) IS NOT NULL", &[&q]).await {
        Ok(row) => row.get(0),
        Err(e) => return Some(Line::Note(format!("cannot look for the message API table {name:?}: {e}"))),
    };
    if !exists {
        return None;
    }
    let count = format!("SELECT count(*) FROM {q} WHERE state = 'prepared'");
    let prepared: i64 = match client.query_one(&count, &[]).await {
        Ok(row) => row.get(0),
        Err(e) => {
            return Some(Line::Leave(vec![Object::MessageTable { name, prepared: 0 }], super::teardown::reason(&e)));
        }
    };
    let object = |prepared| Object::MessageTable { name: name.clone(), prepared };
    let verdict = message_table_verdict(prepared, source_busy, options.drop_pending);
    match (verdict, options.act) {
        (Verdict::Leave(why), _) => Some(Line::Leave(vec![object(prepared)], why)),
        (Verdict::Drop, false) => Some(Line::Drop(vec![object(prepared)])),
        (Verdict::Drop, true) => {
            let dropped = async {
                let tx = client.transaction().await?;
                tx.batch_execute(&format!("LOCK TABLE {q} IN ACCESS EXCLUSIVE MODE")).await?;
                let now: i64 = tx.query_one(&count, &[]).await?.get(0);
                if now > 0 && !options.drop_pending {
                    return Ok(Err(now));
                }
                tx.batch_execute(&format!("DROP TABLE {q}")).await?;
                tx.commit().await?;
                Ok::<_, tokio_postgres::Error>(Ok(now))
            };
            Some(match dropped.await {
                Ok(Ok(now)) => Line::Drop(vec![object(now)]),
                Ok(Err(now)) => Line::Leave(vec![object(now)], crate::db::teardown::PREPARED_REASON.into()),
                Err(e) => Line::Leave(vec![object(prepared)], super::teardown::reason(&e)),
            })
        }
    }
}
