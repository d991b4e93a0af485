//! What `setup`'s own login needs before it creates anything, the application roles that
//! enqueue, and what blocks slot creation — each failure with the statement that fixes it.
//!
//! Checked up front, so that a missing privilege never leaves half a setup behind: tables and
//! publications are created in one transaction and the slots after it, and the slots need the
//! REPLICATION attribute that a table owner usually lacks.

use tokio_postgres::Client;

use crate::setup::{CheckFailure, SetupPlan, ident, literal};

/// The admin login's privileges for the objects of `plan` that do not exist yet or that it must
/// alter: CREATE on the database for missing publications, CREATE on the schema for missing
/// tables and the function, ownership of existing ones. A superuser passes. Slots need no
/// privilege of setup's login: when it lacks REPLICATION, setup creates them as the streamer.
/// Also checks that the streamer and application roles can reach the database and schema.
///
/// A prepared transaction found while a slot is still to be created is waited for up to
/// `prepared_wait` (see [`prepared_transactions`]).
pub async fn check_admin(
    client: &Client,
    plan: &SetupPlan,
    prepared_wait: std::time::Duration,
) -> Result<Vec<CheckFailure>, tokio_postgres::Error> {
    let mut failures = Vec::new();
    let row = client
        .query_one(
            "SELECT current_user::text, r.rolsuper, r.rolreplication, current_database()::text, current_schema()::text
             FROM pg_roles r WHERE r.rolname = current_user",
            &[],
        )
        .await?;
    let (admin, superuser, database): (String, bool, String) = (row.get(0), row.get(1), row.get(3));
    let Some(schema) = row.get::<_, Option<String>>(4) else {
        failures.push(CheckFailure {
            what: "no schema of the search_path exists, so setup has nowhere to create the tables".into(),
            fix: format!("CREATE SCHEMA IF NOT EXISTS {} AUTHORIZATION {}, or set search_path in the URL (options=-csearch_path%3Dapp)", ident(&admin), ident(&admin)),
        });
        return Ok(failures);
    };
    let tables: Vec<String> =
        plan.streams.iter().map(|s| s.table.clone()).chain(std::iter::once(plan.checkpoint_table())).collect();
    let publications: Vec<String> = plan.streams.iter().map(|s| s.publication.clone()).collect();
    let slots: Vec<String> = plan.streams.iter().map(|s| s.slot.clone()).collect();
    let counts = client
        .query_one(
            "SELECT (SELECT count(*) FROM pg_class c
                     WHERE c.relnamespace = current_schema()::regnamespace AND c.relname = ANY($1))::int,
                    (SELECT count(*) FROM pg_publication WHERE pubname = ANY($2))::int,
                    (SELECT count(*) FROM pg_replication_slots
                     WHERE slot_name = ANY($3) AND database = current_database())::int,
                    has_database_privilege(current_database(), 'CREATE'),
                    has_schema_privilege(current_schema(), 'CREATE')",
            &[&tables, &publications, &slots],
        )
        .await?;
    let (tables_present, publications_present, slots_present): (i32, i32, i32) =
        (counts.get(0), counts.get(1), counts.get(2));
    let (create_on_database, create_on_schema): (bool, bool) = (counts.get(3), counts.get(4));
    let admin_id = ident(&admin);
    if !superuser {
        if (publications_present as usize) < publications.len() && !create_on_database {
            failures.push(CheckFailure {
                what: format!("setup's login {admin:?} creates publications but lacks CREATE on database {database:?}"),
                fix: format!("GRANT CREATE ON DATABASE {} TO {admin_id};", ident(&database)),
            });
        }
        if (tables_present as usize) < tables.len() && !create_on_schema {
            failures.push(CheckFailure {
                what: format!("setup's login {admin:?} creates tables but lacks CREATE on schema {schema:?}"),
                fix: format!("GRANT CREATE ON SCHEMA {} TO {admin_id};", ident(&schema)),
            });
        }
    }
    // Existing tables and the function are altered, published and granted on: only their owner
    // (or a member of the owning role) may.
    let foreign = client
        .query(
            "SELECT c.relname::text, pg_get_userbyid(c.relowner)::text FROM pg_class c
             WHERE c.relnamespace = current_schema()::regnamespace AND c.relname = ANY($1)
               AND NOT pg_has_role(current_user, c.relowner, 'USAGE')
             UNION ALL
             SELECT p.proname::text || '()', pg_get_userbyid(p.proowner)::text FROM pg_proc p
             WHERE p.pronamespace = current_schema()::regnamespace
               AND p.proname::text IN ($2::text, regexp_replace($2::text, '_enqueue$', '_emit'))
               AND NOT pg_has_role(current_user, p.proowner, 'USAGE')
             ORDER BY 1",
            &[&tables, &plan.enqueue_function()],
        )
        .await?;
    for r in &foreign {
        let (object, owner): (String, String) = (r.get(0), r.get(1));
        let statement = match object.strip_suffix("()") {
            Some(function) => format!("ALTER FUNCTION {}.{} OWNER TO {admin_id};", ident(&schema), ident(function)),
            None => format!("ALTER TABLE {}.{} OWNER TO {admin_id};", ident(&schema), ident(&object)),
        };
        failures.push(CheckFailure {
            what: format!("{object} belongs to {owner:?}, and setup's login {admin:?} is neither it nor a member"),
            fix: format!("run setup as {owner:?} (OUTBOX_SETUP_URL), or {statement}"),
        });
    }
    if (slots_present as usize) < slots.len() {
        failures.extend(prepared_transactions(client, prepared_wait).await?);
    }
    let roles =
        plan.streamer_role.iter().map(|r| (r, "streamer")).chain(plan.app_roles.iter().map(|r| (r, "application")));
    for (role, what) in roles {
        let row = client
            .query_opt(
                "SELECT has_database_privilege(r.oid, current_database(), 'CONNECT'),
                        has_schema_privilege(r.oid, current_schema(), 'USAGE')
                 FROM pg_roles r WHERE r.rolname = $1",
                &[role],
            )
            .await?;
        let Some(row) = row else {
            if what == "application" {
                failures.push(CheckFailure {
                    what: format!("the application role {role:?} given with --app-role does not exist"),
                    fix: format!(
                        "CREATE ROLE {} LOGIN PASSWORD '…'; or pass the name of an existing role",
                        ident(role)
                    ),
                });
            }
            // A missing streamer role is reported by `check_server`.
            continue;
        };
        if !row.get::<_, bool>(0) {
            failures.push(CheckFailure {
                what: format!("the {what} role {role:?} cannot connect to database {database:?}"),
                fix: format!("GRANT CONNECT ON DATABASE {} TO {};", ident(&database), ident(role)),
            });
        }
        if !row.get::<_, bool>(1) {
            failures.push(CheckFailure {
                what: format!(
                    "the {what} role {role:?} has no USAGE on schema {schema:?}, where the outbox tables are"
                ),
                fix: format!("GRANT USAGE ON SCHEMA {} TO {};", ident(&schema), ident(role)),
            });
        }
    }
    Ok(failures)
}

/// Creating a logical slot waits until every transaction that had an xid when it started has
/// ended, in every database of the cluster. A prepared (two-phase) transaction never ends by
/// itself, so setup would wait for ever: the ones still undecided after `wait` (an XA transaction
/// manager decides its branches within moments, a leftover never) are refused, each named with its two outcomes (ones prepared meanwhile are left to the slot's
/// own wait, which the next check reports). Only asked when a slot is still to be created.
pub async fn prepared_transactions(
    client: &Client,
    wait: std::time::Duration,
) -> Result<Vec<CheckFailure>, tokio_postgres::Error> {
    const SQL: &str =
        "SELECT gid, database::text, owner::text, prepared::text FROM pg_prepared_xacts ORDER BY prepared";
    let first: Vec<String> = client.query(SQL, &[]).await?.iter().map(|r| r.get(0)).collect();
    let deadline = tokio::time::Instant::now() + wait;
    let mut rows = Vec::new();
    while !first.is_empty() {
        rows = client.query(SQL, &[]).await?;
        rows.retain(|r| first.contains(&r.get::<_, String>(0)));
        if rows.is_empty() || tokio::time::Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    Ok(rows
        .iter()
        .map(|r| {
            let (gid, database, owner, prepared): (String, String, String, String) =
                (r.get(0), r.get(1), r.get(2), r.get(3));
            CheckFailure {
                what: format!(
                    "prepared transaction {gid:?} (database {database:?}, owner {owner:?}, since {prepared}) is still undecided \
                     after {} s; creating a replication slot waits until it ends",
                    wait.as_secs()
                ),
                fix: format!(
                    "have its transaction manager decide it (or give it longer with setup --prepared-wait), or, in \
                     database {database:?} as {owner:?} or a superuser: COMMIT PREPARED {lit}; or ROLLBACK PREPARED {lit};",
                    lit = literal(&gid)
                ),
            }
        })
        .collect())
}

/// Sessions whose open transaction holds an xid, oldest first, for the message while slot
/// creation waits on them: (pid, database, state, seconds open).
pub async fn open_transactions(client: &Client, older_than_s: f64) -> Result<Vec<String>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT pid, coalesce(datname::text, ''), coalesce(state, ''),
                    extract(epoch FROM now() - xact_start)::float8
             FROM pg_stat_activity
             WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid()
               AND xact_start < now() - make_interval(secs => $1)
             ORDER BY xact_start",
            &[&older_than_s],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| {
            let (pid, database, state, open): (i32, String, String, f64) = (r.get(0), r.get(1), r.get(2), r.get(3));
            format!("pid {pid} in database {database:?} ({state}) open for {open:.0} s")
        })
        .collect())
}

/// Grants for the application roles: INSERT on every table (and SELECT on `id`, which
/// `INSERT … RETURNING id` and the enqueue function read back) and EXECUTE on the function.
/// The function runs with the caller's rights, so these grants are all an application needs.
pub fn app_role_statements(plan: &SetupPlan) -> Vec<String> {
    let mut sql = Vec::new();
    for role in &plan.app_roles {
        let role = ident(role);
        for s in &plan.streams {
            sql.push(format!("GRANT INSERT, SELECT (id) ON {} TO {role}", ident(&s.table)));
        }
        sql.push(format!("GRANT EXECUTE ON FUNCTION {} TO {role}", plan.enqueue_signature()));
        sql.push(format!("GRANT EXECUTE ON FUNCTION {} TO {role}", plan.emit_signature()));
    }
    sql
}

/// Roles other than the owner and the streamer that may INSERT into any existing table of the
/// plan: the application roles of an earlier setup, granted again on tables added since (more
/// shards or partitions) so that raising the counts never breaks an application.
pub async fn existing_app_roles(client: &Client, plan: &SetupPlan) -> Result<Vec<String>, tokio_postgres::Error> {
    let tables: Vec<String> = plan.streams.iter().map(|s| s.table.clone()).collect();
    let streamer = plan.streamer_role.clone().unwrap_or_default();
    let rows = client
        .query(
            "SELECT DISTINCT r.rolname::text FROM pg_class c, aclexplode(c.relacl) a, pg_roles r
             WHERE c.relnamespace = current_schema()::regnamespace AND c.relname = ANY($1)
               AND a.privilege_type = 'INSERT' AND a.grantee = r.oid AND a.grantee <> c.relowner
               AND r.rolname <> $2
             ORDER BY 1",
            &[&tables, &streamer],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// Whether setup's login may create replication slots itself.
pub async fn can_replicate(client: &Client) -> Result<bool, tokio_postgres::Error> {
    Ok(client
        .query_one("SELECT rolsuper OR rolreplication FROM pg_roles WHERE rolname = current_user", &[])
        .await?
        .get(0))
}
