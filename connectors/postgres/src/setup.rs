//! The schema objects one shard-partition needs — table, publication, slot — as idempotent SQL,
//! the `outbox_enqueue` routing function, and the server checks that tell an operator what to
//! change before anything streams.
//!
//! Order matters: the publication is created before the slot, so every change the slot will
//! ever decode was written while the publication already existed.

use tokio_postgres::Client;

/// The names of one shard-partition's objects (derived by the core's `names` module).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamObjects {
    pub table: String,
    pub publication: String,
    pub slot: String,
    /// `storage = "wal"`: the application's messages are logical messages with the table's
    /// name as prefix (`<prefix>_emit`); the table stays, empty, for what is in flight.
    pub wal: bool,
}

/// What `setup` creates, shared by every shard-partition of a source.
#[derive(Debug, Clone)]
pub struct SetupPlan {
    /// Table prefix: tables are `<prefix>_<shard>_<partition>`.
    pub prefix: String,
    pub shards: u32,
    pub partitions: u32,
    pub streams: Vec<StreamObjects>,
    /// The login the streamer runs as; granted SELECT and DELETE on every table.
    pub streamer_role: Option<String>,
    /// Roles the application enqueues as (`setup --app-role`, and those an earlier setup
    /// granted): INSERT on every table and EXECUTE on the enqueue function.
    pub app_roles: Vec<String>,
    /// Whether the tables are outbox-streamer's own: created here, with the enqueue and emit
    /// functions and the application's grants. `false` for another outbox's tables (a
    /// drop-in layout), which belong to its application: only the publication, the slot, the
    /// checkpoint table and the streamer's grants are made for them.
    pub owns_tables: bool,
}

impl SetupPlan {
    /// `<prefix>_checkpoint`.
    pub fn checkpoint_table(&self) -> String {
        format!("{}_checkpoint", self.prefix)
    }

    /// `<prefix>_enqueue`.
    pub fn enqueue_function(&self) -> String {
        format!("{}_enqueue", self.prefix)
    }

    /// The enqueue function with its argument types, as GRANT and DROP name it.
    pub fn enqueue_signature(&self) -> String {
        format!("{}(text, bytea, bytea, jsonb, int)", ident(&self.enqueue_function()))
    }

    /// `<prefix>_emit`: writes a WAL-only message (see [`emit_function`]).
    pub fn emit_function(&self) -> String {
        format!("{}_emit", self.prefix)
    }

    /// The emit function with its argument types, as GRANT and DROP name it.
    pub fn emit_signature(&self) -> String {
        format!("{}(text, bytea, bytea, jsonb, int, int)", ident(&self.emit_function()))
    }

    /// Whether any shard-partition stores its messages in the WAL.
    pub fn any_wal(&self) -> bool {
        self.streams.iter().any(|s| s.wal)
    }
}

/// Quotes an identifier for SQL (`"name"`, doubling inner quotes).
pub fn ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Quotes a string literal for SQL.
pub fn literal(value: &str) -> String {
    format!("'{}'", value.replace('\'', "''"))
}

/// Checkpoint columns added after its first version: the published-up-to mark (the commit LSN
/// below which every transaction was published and deleted, stored with the delete), the
/// operator's skip lists (`outbox-streamer skip`), the storage, and the last catch-up's drain
/// snapshot with the WAL position read right after it (the stream skips what it drained).
const CHECKPOINT_LATER_COLUMNS: [(&str, &str); 6] = [
    ("published_lsn", "pg_lsn"),
    ("skip_ids", "text"),
    ("skip_transactions", "text"),
    ("storage", "text"),
    ("catchup_snapshot", "text"),
    ("catchup_snapshot_lsn", "pg_lsn"),
];

/// Statements that must run in a transaction block (tables, publications, grants, function).
pub fn schema_statements(plan: &SetupPlan) -> Vec<String> {
    let mut sql = Vec::new();
    for s in &plan.streams {
        let table = ident(&s.table);
        if plan.owns_tables {
            sql.push(table_statement(&table));
        }
        sql.push(format!(
            "DO $$ BEGIN\n\
             \x20 IF NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = {pubname}) THEN\n\
             \x20   CREATE PUBLICATION {publication} FOR TABLE {table} WITH (publish = 'insert');\n\
             \x20 END IF;\n\
             END $$",
            pubname = literal(&s.publication),
            publication = ident(&s.publication),
        ));
        if let Some(role) = &plan.streamer_role {
            sql.push(format!("GRANT SELECT, DELETE ON {table} TO {}", ident(role)));
        }
    }
    let checkpoint = ident(&plan.checkpoint_table());
    sql.push(format!(
        "CREATE TABLE IF NOT EXISTS {checkpoint} (\n\
         \x20   stream text PRIMARY KEY,\n\
         \x20   catchup_pending boolean NOT NULL DEFAULT false,\n\
         \x20   catchup_started_at timestamptz,\n\
         \x20   last_catchup_at timestamptz,\n\
         \x20   last_catchup_rows bigint,\n\
         \x20   owner_epoch bigint NOT NULL DEFAULT 0,\n\
         \x20   updated_at timestamptz NOT NULL DEFAULT now()\n\
         )"
    ));
    // Columns added after the first version: each a statement of its own, so a table created
    // by an older setup is brought up to date.
    for (name, definition) in CHECKPOINT_LATER_COLUMNS {
        sql.push(format!("ALTER TABLE {checkpoint} ADD COLUMN IF NOT EXISTS {name} {definition}"));
    }
    let rows: Vec<String> = plan.streams.iter().map(|s| format!("({})", literal(&s.table))).collect();
    if !rows.is_empty() {
        sql.push(format!("INSERT INTO {checkpoint} (stream) VALUES {} ON CONFLICT DO NOTHING", rows.join(", ")));
        // What the functions written below do for each shard-partition: a polling stream
        // refuses to run while they emit WAL-only messages it cannot read.
        for storage in ["table", "wal"] {
            let streams: Vec<String> =
                plan.streams.iter().filter(|s| s.wal == (storage == "wal")).map(|s| literal(&s.table)).collect();
            if !streams.is_empty() {
                sql.push(format!(
                    "UPDATE {checkpoint} SET storage = '{storage}' WHERE stream IN ({})",
                    streams.join(", ")
                ));
            }
        }
    }
    if let Some(role) = &plan.streamer_role {
        sql.push(format!("GRANT SELECT, UPDATE ON {checkpoint} TO {}", ident(role)));
    }
    if !plan.owns_tables {
        return sql;
    }
    sql.push(emit_function(plan));
    sql.push(enqueue_function(plan));
    if let Some(role) = &plan.streamer_role {
        sql.push(format!("GRANT EXECUTE ON FUNCTION {} TO {}", plan.enqueue_signature(), ident(role)));
        sql.push(format!("GRANT EXECUTE ON FUNCTION {} TO {}", plan.emit_signature(), ident(role)));
    }
    sql.extend(crate::privileges::app_role_statements(plan));
    sql
}

/// The `CREATE TABLE` of one of outbox-streamer's own tables (`table` quoted).
fn table_statement(table: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {table} (\n\
         \x20   id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,\n\
             \x20   topic text NOT NULL,\n\
             \x20   msg_key bytea,\n\
             \x20   payload bytea,\n\
             \x20   headers jsonb,\n\
             \x20   kafka_partition int,\n\
             \x20   created_at timestamptz NOT NULL DEFAULT clock_timestamp()\n\
             ) WITH (\n\
             \x20   -- a queue: rows are inserted once and deleted soon after, so vacuum early and often\n\
             \x20   autovacuum_vacuum_scale_factor = 0,\n\
             \x20   autovacuum_vacuum_threshold = 5000,\n\
             \x20   autovacuum_vacuum_insert_scale_factor = 0,\n\
             \x20   autovacuum_vacuum_insert_threshold = 50000,\n\
             \x20   autovacuum_vacuum_cost_delay = 0,\n\
             \x20   autovacuum_analyze_scale_factor = 0,\n\
             \x20   autovacuum_analyze_threshold = 50000\n\
             )"
    )
}

/// Statements that must run outside a transaction block (slot creation). Only a slot of this
/// database counts as existing: when another database of the cluster has a slot of the name,
/// creating it fails ("already exists") instead of silently using a slot that decodes another
/// database.
pub fn slot_statements(plan: &SetupPlan) -> Vec<String> {
    plan.streams
        .iter()
        .map(|s| {
            format!(
                "SELECT pg_create_logical_replication_slot({slot}, 'pgoutput') \
                 WHERE NOT EXISTS (SELECT 1 FROM pg_replication_slots \
                 WHERE slot_name = {slot} AND database = current_database())",
                slot = literal(&s.slot)
            )
        })
        .collect()
}

/// Run right after creating `stream`'s slot: rows already in its table were written before the
/// slot existed and will never come through it, so `run` sends them by a catch-up first.
pub fn catch_up_statement(plan: &SetupPlan, stream: &StreamObjects) -> String {
    format!(
        "UPDATE {} SET catchup_pending = true, catchup_started_at = now(), updated_at = now() \
         WHERE stream = {} AND EXISTS (SELECT 1 FROM {})",
        ident(&plan.checkpoint_table()),
        literal(&stream.table),
        ident(&stream.table)
    )
}

/// The shard check and the partition of the key, shared by both functions. The partition is
/// `abs(first 4 bytes of md5(key) as a signed big-endian int) % partitions` (0 for a NULL key),
/// which any language can compute to insert into the table directly.
fn route(plan: &SetupPlan) -> String {
    format!(
        "\x20   IF p_shard IS NULL OR p_shard < 0 OR p_shard >= {shards} THEN\n\
         \x20       RAISE EXCEPTION 'outbox shard % does not exist: shards are 0..%', p_shard, {last_shard}\n\
         \x20           USING HINT = 'pass a shard below {shards}, or raise shards in the config and rerun outbox-streamer setup';\n\
         \x20   END IF;\n\
         \x20   IF p_key IS NOT NULL AND {partitions} > 1 THEN\n\
         \x20       part := abs(('x' || substr(md5(p_key), 1, 8))::bit(32)::int::bigint) % {partitions};\n\
         \x20   END IF;\n",
        shards = plan.shards,
        last_shard = plan.shards.saturating_sub(1),
        partitions = plan.partitions,
    )
}

/// A SQL boolean array literal: whether shard-partition (s, p) — at index
/// `s * partitions + p + 1` — stores its messages in the WAL.
fn wal_flags(plan: &SetupPlan) -> String {
    let mut flags = vec!["false"; (plan.shards * plan.partitions) as usize];
    for s in plan.streams.iter().filter(|s| s.wal) {
        // Tables are `<prefix>_<shard>_<partition>`, as the functions name them.
        let place = s.table.strip_prefix(&format!("{}_", plan.prefix)).and_then(|rest| {
            let (shard, partition) = rest.split_once('_')?;
            Some((shard.parse::<u32>().ok()?, partition.parse::<u32>().ok()?))
        });
        if let Some((shard, partition)) = place.filter(|&(s, p)| s < plan.shards && p < plan.partitions) {
            flags[(shard * plan.partitions + partition) as usize] = "true";
        }
    }
    format!("'{{{}}}'::boolean[]", flags.join(","))
}

/// `<prefix>_enqueue(topic, key, payload, headers, shard)`: inserts into the partition table of
/// the key, so one statement from any driver enqueues correctly — or, for a shard-partition
/// with `storage = "wal"`, emits the message with [`emit_function`]. Either way it returns the
/// message's `outbox-id`.
pub fn enqueue_function(plan: &SetupPlan) -> String {
    let prefix = &plan.prefix;
    format!(
        "CREATE OR REPLACE FUNCTION {prefix}_enqueue(\n\
         \x20   p_topic text, p_key bytea, p_payload bytea, p_headers jsonb DEFAULT NULL, p_shard int DEFAULT 0)\n\
         RETURNS bigint LANGUAGE plpgsql SECURITY INVOKER AS $fn$\n\
         DECLARE\n\
         \x20   part int := 0;\n\
         \x20   new_id bigint;\n\
         BEGIN\n\
         {route}\
         \x20   IF ({wal})[p_shard * {partitions} + part + 1] THEN\n\
         \x20       RETURN {prefix}_emit(p_topic, p_key, p_payload, p_headers, p_shard);\n\
         \x20   END IF;\n\
         \x20   EXECUTE format('INSERT INTO %I (topic, msg_key, payload, headers) VALUES ($1, $2, $3, $4) RETURNING id',\n\
         \x20                  '{prefix}_' || p_shard || '_' || part)\n\
         \x20       INTO new_id USING p_topic, p_key, p_payload, p_headers;\n\
         \x20   RETURN new_id;\n\
         END\n\
         $fn$",
        route = route(plan),
        wal = wal_flags(plan),
        partitions = plan.partitions,
    )
}

/// `<prefix>_emit(topic, key, payload, headers, shard, kafka_partition)`: writes the message
/// as a transactional logical message whose prefix is the table name of its shard-partition
/// (routed like [`enqueue_function`]), in the envelope the streamer reads ([`crate::envelope`],
/// version 1). Nothing is stored in a table; the message leaves with its transaction's commit,
/// and not at all on rollback. Returns its `outbox-id` (its LSN).
/// A shard-partition with table storage refuses it (its stream may run in polling mode).
pub fn emit_function(plan: &SetupPlan) -> String {
    let prefix = &plan.prefix;
    format!(
        "CREATE OR REPLACE FUNCTION {prefix}_emit(\n\
         \x20   p_topic text, p_key bytea, p_payload bytea, p_headers jsonb DEFAULT NULL, p_shard int DEFAULT 0,\n\
         \x20   p_kafka_partition int DEFAULT NULL)\n\
         RETURNS bigint LANGUAGE plpgsql SECURITY INVOKER AS $fn$\n\
         DECLARE\n\
         \x20   part int := 0;\n\
         \x20   topic bytea := convert_to(p_topic, 'UTF8');\n\
         \x20   headers bytea := convert_to(p_headers::text, 'UTF8');\n\
         \x20   at pg_lsn;\n\
         BEGIN\n\
         {route}\
         \x20   IF NOT ({wal})[p_shard * {partitions} + part + 1] THEN\n\
         \x20       RAISE EXCEPTION 'outbox shard-partition %/% stores its messages in a table', p_shard, part\n\
         \x20           USING HINT = 'call {prefix}_enqueue(), or set storage = \"wal\" for it and rerun outbox-streamer setup';\n\
         \x20   END IF;\n\
         \x20   IF topic IS NULL OR octet_length(topic) NOT BETWEEN 1 AND 249 THEN\n\
         \x20       RAISE EXCEPTION 'outbox topic must be 1 to 249 bytes, not %', coalesce(octet_length(topic), 0);\n\
         \x20   END IF;\n\
         \x20   IF p_kafka_partition < 0 THEN\n\
         \x20       RAISE EXCEPTION 'outbox kafka_partition % is not a partition number (0 or more)', p_kafka_partition;\n\
         \x20   END IF;\n\
         \x20   at := pg_logical_emit_message(true, '{prefix}_' || p_shard || '_' || part,\n\
         \x20       '\\x01'::bytea || substr(int4send(octet_length(topic)), 3) || topic\n\
         \x20       || CASE WHEN p_key IS NULL THEN '\\xffffffff'::bytea ELSE int4send(octet_length(p_key)) || p_key END\n\
         \x20       || CASE WHEN p_payload IS NULL THEN '\\xffffffff'::bytea ELSE int4send(octet_length(p_payload)) || p_payload END\n\
         \x20       || CASE WHEN headers IS NULL THEN '\\xffffffff'::bytea ELSE int4send(octet_length(headers)) || headers END\n\
         \x20       || int4send(coalesce(p_kafka_partition, -1))\n\
         \x20       || int8send((extract(epoch FROM clock_timestamp()) * 1000000)::bigint));\n\
         \x20   RETURN (at - '0/0'::pg_lsn)::bigint;\n\
         END\n\
         $fn$",
        route = route(plan),
        wal = wal_flags(plan),
        partitions = plan.partitions,
    )
}

/// What `max_slot_wal_keep_size` (as `SHOW` prints it) risks for `storage = "wal"`: a slot
/// that falls that far behind is invalidated, and the messages it had not delivered are in no
/// table to catch up from. `None` for `-1` (no limit).
pub fn wal_retention_risk(max_slot_wal_keep_size: &str) -> Option<String> {
    (max_slot_wal_keep_size.trim() != "-1").then(|| {
        format!(
            "max_slot_wal_keep_size = {max_slot_wal_keep_size}: a slot that falls that far behind (a long Kafka outage, a stopped streamer) is invalidated, and its unsent WAL-only messages are lost; set it to -1 (ALTER SYSTEM SET max_slot_wal_keep_size = -1; SELECT pg_reload_conf()) and watch the disk and outbox_replication_lag_bytes instead"
        )
    })
}

/// Whether every role may call `pg_logical_emit_message` (PostgreSQL's default): then any
/// login of the database can forge a WAL-only message of a `wal` shard-partition. Returns the
/// warning with the statements that restrict it to `roles` (the application and streamer roles).
pub async fn emit_forgery_risk(client: &Client, roles: &[String]) -> Result<Option<String>, tokio_postgres::Error> {
    let public: bool = client
        .query_one(
            "SELECT coalesce(bool_or(has_function_privilege('public', p.oid, 'EXECUTE')), false)
             FROM pg_proc p WHERE p.proname = 'pg_logical_emit_message' AND p.pronamespace = 'pg_catalog'::regnamespace",
            &[],
        )
        .await?
        .get(0);
    if !public {
        return Ok(None);
    }
    Ok(Some(format!(
        "every role of this database may call pg_logical_emit_message, so any login can forge a WAL-only outbox message; rerun setup with --restrict-emit as a superuser, or have one run: {}; (other tools that emit logical messages, such as a CDC heartbeat, need the grant too)",
        restrict_emit_statements(client, roles).await?.join("; ")
    )))
}

/// The statements that let only `roles` call `pg_logical_emit_message` in this database: every
/// overload the server has (PostgreSQL 17 adds a `flush` argument), revoked from PUBLIC and
/// granted to each role.
pub async fn restrict_emit_statements(client: &Client, roles: &[String]) -> Result<Vec<String>, tokio_postgres::Error> {
    let overloads: Vec<String> = client
        .query(
            "SELECT p.oid::regprocedure::text FROM pg_proc p
             WHERE p.proname = 'pg_logical_emit_message' AND p.pronamespace = 'pg_catalog'::regnamespace ORDER BY 1",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut statements: Vec<String> =
        overloads.iter().map(|f| format!("REVOKE EXECUTE ON FUNCTION pg_catalog.{f} FROM PUBLIC")).collect();
    for role in roles {
        for f in &overloads {
            statements.push(format!("GRANT EXECUTE ON FUNCTION pg_catalog.{f} TO {}", ident(role)));
        }
    }
    Ok(statements)
}

/// Where [`apply`] stopped: the schema step (nothing of it committed) or a slot (the schema
/// committed, and the slots before it created); re-running `setup` completes either.
#[derive(Debug)]
pub enum ApplyError {
    Schema(tokio_postgres::Error),
    Slot { slot: String, created: Vec<String>, error: tokio_postgres::Error },
}

impl std::fmt::Display for ApplyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Schema(e) => write!(
                f,
                "creating tables, publications, grants and the enqueue function failed, and nothing of it was kept: {}",
                describe(e)
            ),
            Self::Slot { slot, created, error } => write!(
                f,
                "the tables, publications, grants and enqueue function were created; creating slot {slot:?} failed: {}; {}; fix the cause and run setup again, which completes it",
                describe(error),
                if created.is_empty() {
                    "no slot was created".to_string()
                } else {
                    format!("slots created: {}", created.join(", "))
                }
            ),
        }
    }
}

impl std::error::Error for ApplyError {}

/// The server's message, SQLSTATE and hint of a database error; the driver's text otherwise.
pub fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => {
            let hint = db.hint().map(|h| format!(" (hint: {h})")).unwrap_or_default();
            format!("{} [SQLSTATE {}]{hint}", db.message(), db.code().code())
        }
        None => e.to_string(),
    }
}

/// Runs the plan's schema statements in one transaction (as a login that may create and own
/// them); nothing of it is kept on error.
pub async fn apply_schema(client: &mut Client, plan: &SetupPlan) -> Result<(), ApplyError> {
    schema_transaction(client, plan).await.map_err(ApplyError::Schema)
}

/// Creates each missing slot on its own, after [`apply_schema`], as a login with REPLICATION
/// (setup's own, or the streamer's when setup's lacks it), and marks a table that already holds
/// rows for a catch-up.
pub async fn create_slots(client: &Client, plan: &SetupPlan) -> Result<(), ApplyError> {
    client.batch_execute("SET client_min_messages = warning").await.map_err(ApplyError::Schema)?;
    let mut created = Vec::new();
    for (stream, stmt) in plan.streams.iter().zip(slot_statements(plan)) {
        let slot = async {
            let made = client.query(&stmt, &[]).await?.len() == 1;
            if made {
                client.batch_execute(&catch_up_statement(plan, stream)).await?;
            }
            Ok::<_, tokio_postgres::Error>(made)
        };
        match slot.await {
            Ok(true) => created.push(stream.slot.clone()),
            Ok(false) => {}
            Err(error) => return Err(ApplyError::Slot { slot: stream.slot.clone(), created, error }),
        }
    }
    Ok(())
}

async fn schema_transaction(client: &mut Client, plan: &SetupPlan) -> Result<(), tokio_postgres::Error> {
    // `IF NOT EXISTS` on a re-run is expected, not news: keep the server's NOTICEs out.
    client.batch_execute("SET client_min_messages = warning").await?;
    let tx = client.transaction().await?;
    // Two setups racing on a fresh database would both try CREATE TABLE; serialise them.
    tx.batch_execute("SELECT pg_advisory_xact_lock(hashtext('outbox-streamer setup'))").await?;
    for stmt in schema_statements(plan) {
        tx.batch_execute(&stmt).await?;
    }
    tx.commit().await
}

/// One failed server check: what is wrong and what to change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckFailure {
    pub what: String,
    pub fix: String,
}

impl std::fmt::Display for CheckFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}; fix: {}", self.what, self.fix)
    }
}

/// Checks the server before setup creates anything: logical WAL, room for the slots and
/// senders still to be created, and the streamer role's REPLICATION attribute.
pub async fn check_server(client: &Client, plan: &SetupPlan) -> Result<Vec<CheckFailure>, tokio_postgres::Error> {
    let mut failures = Vec::new();
    let wal_level: String = client.query_one("SHOW wal_level", &[]).await?.get(0);
    if wal_level != "logical" {
        failures.push(CheckFailure {
            what: format!("wal_level is '{wal_level}', logical decoding needs 'logical'"),
            fix: "set wal_level = logical in postgresql.conf (or ALTER SYSTEM SET wal_level = logical) and restart PostgreSQL".into(),
        });
    }
    let slot_names: Vec<String> = plan.streams.iter().map(|s| s.slot.clone()).collect();
    let row = client
        .query_one(
            "SELECT current_setting('max_replication_slots')::int,
                    (SELECT count(*) FROM pg_replication_slots)::int,
                    (SELECT count(*) FROM pg_replication_slots
                     WHERE slot_name = ANY($1) AND database = current_database())::int,
                    current_setting('max_wal_senders')::int,
                    (SELECT count(*) FROM pg_stat_replication)::int",
            &[&slot_names],
        )
        .await?;
    let (max_slots, used_slots, ours, max_senders, used_senders): (i32, i32, i32, i32, i32) =
        (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
    let missing = plan.streams.len() as i32 - ours;
    if used_slots + missing > max_slots {
        failures.push(CheckFailure {
            what: format!("max_replication_slots is {max_slots} with {used_slots} in use; {missing} more are needed"),
            fix: format!(
                "raise max_replication_slots to at least {} and restart PostgreSQL, or drop unused slots",
                used_slots + missing
            ),
        });
    }
    if used_senders + plan.streams.len() as i32 > max_senders {
        failures.push(CheckFailure {
            what: format!(
                "max_wal_senders is {max_senders} with {used_senders} in use; each shard-partition streams through one"
            ),
            fix: format!(
                "raise max_wal_senders to at least {} and restart PostgreSQL",
                used_senders + plan.streams.len() as i32
            ),
        });
    }
    if let Some(role) = &plan.streamer_role {
        let row = client
            .query_opt("SELECT rolreplication OR rolsuper, rolcanlogin FROM pg_roles WHERE rolname = $1", &[role])
            .await?;
        match row {
            None => failures.push(CheckFailure {
                what: format!("the streamer role {role:?} does not exist"),
                fix: format!(
                    "CREATE ROLE {} LOGIN REPLICATION PASSWORD '…' (see docs/configure-postgres.md)",
                    ident(role)
                ),
            }),
            Some(r) => {
                if !r.get::<_, bool>(0) {
                    failures.push(CheckFailure {
                        what: format!("the streamer role {role:?} lacks the REPLICATION attribute"),
                        fix: format!("ALTER ROLE {} REPLICATION", ident(role)),
                    });
                }
                if !r.get::<_, bool>(1) {
                    failures.push(CheckFailure {
                        what: format!("the streamer role {role:?} cannot log in"),
                        fix: format!("ALTER ROLE {} LOGIN", ident(role)),
                    });
                }
            }
        }
    }
    Ok(failures)
}

/// A slot name of the plan that this database cannot use: another database's slot (names are
/// cluster-wide), a physical slot, or a slot of another output plugin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TakenSlot {
    pub slot: String,
    /// The slot's database; empty for a physical slot.
    pub database: String,
    /// The slot is this database's (then its plugin is not pgoutput).
    pub in_this_database: bool,
    pub plugin: String,
}

/// The plan's slot names that exist but are not this database's `pgoutput` slots. `setup`
/// must refuse them: reporting ready on another database's slot leaves `run` unable to
/// stream.
pub async fn taken_slots(client: &Client, plan: &SetupPlan) -> Result<Vec<TakenSlot>, tokio_postgres::Error> {
    let slot_names: Vec<String> = plan.streams.iter().map(|s| s.slot.clone()).collect();
    let rows = client
        .query(
            "SELECT slot_name::text, coalesce(database::text, ''), database IS NOT DISTINCT FROM current_database(),
                    coalesce(plugin::text, '')
             FROM pg_replication_slots
             WHERE slot_name = ANY($1)
               AND (database IS DISTINCT FROM current_database() OR plugin IS DISTINCT FROM 'pgoutput')
             ORDER BY slot_name",
            &[&slot_names],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| TakenSlot { slot: r.get(0), database: r.get(1), in_this_database: r.get(2), plugin: r.get(3) })
        .collect())
}

/// After setup: the streamer role can read and delete every table (checked, not assumed).
pub async fn check_privileges(client: &Client, plan: &SetupPlan) -> Result<Vec<CheckFailure>, tokio_postgres::Error> {
    let Some(role) = &plan.streamer_role else { return Ok(Vec::new()) };
    let mut failures = Vec::new();
    for s in &plan.streams {
        let row = client
            .query_one(
                "SELECT has_table_privilege($1, $2, 'SELECT'), has_table_privilege($1, $2, 'DELETE')",
                &[role, &ident(&s.table)],
            )
            .await?;
        if !(row.get::<_, bool>(0) && row.get::<_, bool>(1)) {
            failures.push(CheckFailure {
                what: format!("role {role:?} cannot SELECT and DELETE on {}", s.table),
                fix: format!("GRANT SELECT, DELETE ON {} TO {}", ident(&s.table), ident(role)),
            });
        }
    }
    Ok(failures)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> SetupPlan {
        SetupPlan {
            prefix: "outbox".into(),
            shards: 2,
            partitions: 3,
            streams: vec![StreamObjects {
                wal: false,
                table: "outbox_0_0".into(),
                publication: "outbox_0_0".into(),
                slot: "outbox_0_0".into(),
            }],
            streamer_role: Some("outbox_streamer".into()),
            app_roles: vec!["orders_app".into()],
            owns_tables: true,
        }
    }

    #[test]
    fn another_outboxs_tables_are_left_alone() {
        let theirs = SetupPlan { owns_tables: false, ..plan() };
        let sql = schema_statements(&theirs).join(";\n");
        assert!(!sql.contains("CREATE TABLE IF NOT EXISTS \"outbox_0_0\""), "{sql}");
        assert!(!sql.contains("FUNCTION") && !sql.contains("orders_app"), "{sql}");
        assert!(sql.contains("CREATE PUBLICATION \"outbox_0_0\" FOR TABLE \"outbox_0_0\""));
        assert!(sql.contains("GRANT SELECT, DELETE ON \"outbox_0_0\" TO \"outbox_streamer\""));
        assert!(sql.contains("CREATE TABLE IF NOT EXISTS \"outbox_checkpoint\""));
    }

    #[test]
    fn quoting() {
        assert_eq!(ident(r#"a"b"#), r#""a""b""#);
        assert_eq!(literal("it's"), "'it''s'");
    }

    #[test]
    fn plan_creates_publication_insert_only_and_grants() {
        let sql = schema_statements(&plan()).join(";\n");
        assert!(sql.contains("CREATE TABLE IF NOT EXISTS \"outbox_0_0\""));
        assert!(sql.contains("WITH (publish = 'insert')"));
        assert!(sql.contains("GRANT SELECT, DELETE ON \"outbox_0_0\" TO \"outbox_streamer\""));
        assert!(sql.contains("% 3"), "routes over 3 partitions");
        assert!(sql.contains("GRANT INSERT, SELECT (id) ON \"outbox_0_0\" TO \"orders_app\""));
        assert!(sql.contains(
            "GRANT EXECUTE ON FUNCTION \"outbox_enqueue\"(text, bytea, bytea, jsonb, int) TO \"orders_app\""
        ));
        let slots = slot_statements(&plan());
        assert_eq!(slots.len(), 1);
        assert!(slots[0].contains("pg_create_logical_replication_slot('outbox_0_0', 'pgoutput')"));
        assert!(slots[0].contains("database = current_database()"), "another database's slot is not ours");
        let catch_up = catch_up_statement(&plan(), &plan().streams[0]);
        assert!(catch_up.contains("UPDATE \"outbox_checkpoint\" SET catchup_pending = true"));
        assert!(catch_up.contains("WHERE stream = 'outbox_0_0' AND EXISTS (SELECT 1 FROM \"outbox_0_0\")"));
    }

    #[test]
    fn wal_flags_mark_the_wal_shard_partitions_for_both_functions() {
        let mut plan = plan();
        plan.streams.push(StreamObjects {
            wal: true,
            table: "outbox_1_2".into(),
            publication: "outbox_1_2".into(),
            slot: "outbox_1_2".into(),
        });
        // Index s * partitions + p + 1: shard 1, partition 2 is the sixth of six.
        assert_eq!(wal_flags(&plan), "'{false,false,false,false,false,true}'::boolean[]");
        assert!(plan.any_wal());
        let sql = schema_statements(&plan).join(";\n");
        assert!(sql.contains("RETURN outbox_emit(p_topic, p_key, p_payload, p_headers, p_shard)"));
        assert!(sql.contains("pg_logical_emit_message(true, 'outbox_' || p_shard || '_' || part"));
        assert!(sql.contains(
            "GRANT EXECUTE ON FUNCTION \"outbox_emit\"(text, bytea, bytea, jsonb, int, int) TO \"orders_app\""
        ));
    }

    #[test]
    fn only_an_unlimited_slot_wal_keep_size_is_safe_for_wal_storage() {
        assert_eq!(wal_retention_risk("-1"), None);
        let risk = wal_retention_risk("10GB").unwrap();
        assert!(risk.contains("10GB") && risk.contains("-1"), "{risk}");
    }
}
