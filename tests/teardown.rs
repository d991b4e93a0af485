//! `outbox-streamer teardown` against real PostgreSQL, MariaDB and ZooKeeper: a dry run changes
//! nothing; a table with rows stays (with its shard-partition's other objects) unless
//! `--drop-pending`; a running streamer's objects and another database's slot are never
//! touched; the cluster's ZooKeeper nodes go once no instance runs; a second run finds nothing;
//! `setup` works again afterwards.

use std::path::Path;
use std::time::Duration;

use mysql_async::prelude::Queryable;
use outbox_zookeeper::paths::ClusterPaths;
use tokio_postgres::types::ToSql;

use crate::support::streamer::{Running, run_cli, scratch, source_config};
use crate::support::world::World;
use crate::support::{env, kafka, mysql, pg, shared_services, unique, wait_until};

const ARRIVAL: Duration = Duration::from_secs(120);
const SETTLE: Duration = Duration::from_secs(60);

fn teardown(config: &Path, admin_url: &str, flags: &[&str]) -> (bool, String) {
    let mut args = vec!["teardown", "--admin-url", admin_url];
    args.extend_from_slice(flags);
    let (ok, out, err) = run_cli(config, &args);
    (ok, format!("{out}{err}"))
}

/// `teardown` as docs/operations.md runs it: the admin URL without its password in
/// `OUTBOX_SETUP_URL`, the password from the variable `--admin-password-env` names.
fn teardown_as_documented(config: &Path, admin_url: &str, flags: &[&str]) -> (bool, String) {
    let (scheme, rest) = admin_url.split_once("://").unwrap();
    let (userinfo, host) = rest.rsplit_once('@').unwrap();
    let (user, password) = userinfo.split_once(':').unwrap();
    let out = std::process::Command::new(crate::support::streamer::bin())
        .arg("--config")
        .arg(config)
        .args(["teardown", "--admin-password-env", "OUTBOX_TEST_OWNER_PW"])
        .args(flags)
        .env("OUTBOX_SETUP_URL", format!("{scheme}://{user}@{host}"))
        .env("OUTBOX_TEST_OWNER_PW", password)
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!text.contains(password), "the admin password is never shown:\n{text}");
    (out.status.success(), text)
}

/// What of `prefix` exists in the test database (the cluster's slots of this database only):
/// one sorted line per object.
async fn pg_objects(admin: &tokio_postgres::Client, prefix: &str) -> Vec<String> {
    let rows = admin
        .query(
            "SELECT 'table ' || relname FROM pg_class WHERE relkind = 'r' AND relnamespace = 'public'::regnamespace
             UNION ALL SELECT 'publication ' || pubname FROM pg_publication
             UNION ALL SELECT 'slot ' || slot_name FROM pg_replication_slots WHERE database = current_database()
             UNION ALL SELECT 'function ' || proname FROM pg_proc WHERE pronamespace = 'public'::regnamespace",
            &[],
        )
        .await
        .unwrap();
    let mut objects: Vec<String> = rows
        .iter()
        .map(|r| r.get::<_, String>(0))
        .filter(|o| o.split_once(' ').is_some_and(|(_, name)| name.starts_with(prefix)))
        .collect();
    let checkpoint = format!("{prefix}_checkpoint");
    if objects.contains(&format!("table {checkpoint}")) {
        for row in admin.query(&format!("SELECT stream FROM {checkpoint}"), &[]).await.unwrap() {
            objects.push(format!("checkpoint row {}", row.get::<_, String>(0)));
        }
    }
    objects.sort();
    objects
}

/// The objects `setup` creates for `tables` (PostgreSQL), as [`pg_objects`] lists them.
fn pg_setup_objects(prefix: &str, tables: &[&str]) -> Vec<String> {
    let mut objects = vec![
        format!("function {prefix}_emit"),
        format!("function {prefix}_enqueue"),
        format!("table {prefix}_checkpoint"),
    ];
    for t in tables {
        objects.extend([format!("table {t}"), format!("publication {t}"), format!("slot {t}")]);
        objects.push(format!("checkpoint row {t}"));
    }
    objects.sort();
    objects
}

async fn insert_pg(admin: &tokio_postgres::Client, table: &str, topic: &str, payloads: &[&str]) {
    let sql = format!("INSERT INTO {table} (topic, payload) VALUES ($1, $2)");
    for p in payloads {
        admin.execute(&sql, &[&topic as &(dyn ToSql + Sync), &p.as_bytes()]).await.unwrap();
    }
}

/// Waits until no session of the streamer's login is left in the test database (a stopped
/// streamer's backends end a moment after the process).
async fn wait_no_pg_sessions(admin: &tokio_postgres::Client, streamer_url: &str) {
    let role = streamer_url.split("://").nth(1).and_then(|r| r.split(':').next()).unwrap().to_string();
    wait_until("the streamer's sessions to end", SETTLE, || async {
        let n: i64 =
            admin.query_one("SELECT count(*) FROM pg_stat_activity WHERE usename = $1", &[&role]).await.unwrap().get(0);
        (n == 0).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_teardown_keeps_unpublished_rows_until_told_and_setup_works_again() {
    let w = World::postgres("tdp").shards(2).build().await;
    let (t0, t1) = (w.table(0, 0), w.table(1, 0));
    insert_pg(&w.db.admin, &t1, &w.topic, &["a", "b", "c"]).await;
    let before = pg_objects(&w.db.admin, &w.prefix).await;
    assert_eq!(before, pg_setup_objects(&w.prefix, &[&t0, &t1]));

    // A dry run says what it would do and changes nothing.
    let (ok, out) = teardown_as_documented(&w.config, &w.db.admin_url, &[]);
    assert!(!ok, "something would be left, so the dry run exits 1:\n{out}");
    assert!(
        out.contains(&format!(
            "would drop table \"{t0}\" (empty), publication \"{t0}\", replication slot \"{t0}\", checkpoint row \"{t0}\"\n"
        )),
        "{out}"
    );
    assert!(out.contains(&format!("would leave table \"{t1}\" (3 rows never published), publication \"{t1}\", replication slot \"{t1}\", checkpoint row \"{t1}\": its rows were never published")), "{out}");
    assert!(out.contains(&format!("checkpoint table \"{}_checkpoint\": table \"{t1}\" remains", w.prefix)), "{out}");
    assert!(out.contains("dry run: nothing was changed"), "{out}");
    assert_eq!(pg_objects(&w.db.admin, &w.prefix).await, before, "a dry run changes nothing");

    // --yes: the empty shard-partition goes whole; the one with rows stays whole, and so do the
    // function and the checkpoint table it needs.
    let (ok, out) = teardown(&w.config, &w.db.admin_url, &["--yes"]);
    assert!(!ok, "{out}");
    assert!(out.contains(&format!("  dropped table \"{t0}\" (empty), publication \"{t0}\", replication slot \"{t0}\", checkpoint row \"{t0}\"\n")), "{out}");
    assert!(out.contains(&format!("  left table \"{t1}\" (3 rows never published)")), "{out}");
    assert!(out.contains("not everything was removed"), "{out}");
    assert_eq!(pg_objects(&w.db.admin, &w.prefix).await, pg_setup_objects(&w.prefix, &[&t1]));
    assert_eq!(w.db.count(&t1).await, 3);

    // --drop-pending: the rows go too, counted.
    let (ok, out) = teardown(&w.config, &w.db.admin_url, &["--yes", "--drop-pending"]);
    assert!(ok, "{out}");
    assert!(out.contains(&format!("  dropped table \"{t1}\" (3 rows never published), publication \"{t1}\", replication slot \"{t1}\", checkpoint row \"{t1}\"\n")), "{out}");
    assert!(out.contains("--drop-pending discarded 3 row(s) that were never published"), "{out}");
    assert!(
        out.contains(&format!("dropped function public.{}_enqueue(text, bytea, bytea, jsonb, integer)", w.prefix))
            && out.contains(&format!(
                "dropped function public.{}_emit(text, bytea, bytea, jsonb, integer, integer)",
                w.prefix
            )),
        "{out}"
    );
    assert!(out.contains("teardown complete: nothing that setup creates is left"), "{out}");
    assert_eq!(pg_objects(&w.db.admin, &w.prefix).await, Vec::<String>::new());

    // Idempotent.
    let (ok, out) = teardown_as_documented(&w.config, &w.db.admin_url, &["--yes", "--drop-pending"]);
    assert!(ok && out.contains("nothing to tear down"), "{out}");

    // setup starts afresh, and the stream works.
    let (ok, out, err) = run_cli(&w.config, &["setup", "--admin-url", &w.db.admin_url]);
    assert!(ok, "{out}{err}");
    assert_eq!(pg_objects(&w.db.admin, &w.prefix).await, before);
    let streamer = w.start("after-teardown.log");
    insert_pg(&w.db.admin, &t0, &w.topic, &["after"]).await;
    let records = kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    assert_eq!(records[0].payload_str(), "after");
    assert!(streamer.stop());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_teardown_refuses_a_running_streamer_and_never_touches_another_databases_slot() {
    let w = World::postgres("tdr").shards(2).build().await;
    let other = pg::fresh_db().await;
    let (t0, t1) = (w.table(0, 0), w.table(1, 0));
    let other_db = other.admin_url.rsplit('/').next().unwrap().to_string();
    // Shard 1's slot name now belongs to another database (slot names are cluster-wide).
    w.db.admin.execute("SELECT pg_drop_replication_slot($1)", &[&t1]).await.unwrap();
    other.admin.execute("SELECT pg_create_logical_replication_slot($1, 'pgoutput')", &[&t1]).await.unwrap();
    let other_slot = || async {
        let row = other
            .admin
            .query_opt("SELECT database::text FROM pg_replication_slots WHERE slot_name = $1", &[&t1])
            .await
            .unwrap();
        row.map(|r| r.get::<_, String>(0))
    };

    let streamer = w.start("running.log");
    wait_until("the streamer to hold shard 0's slot", SETTLE, || async {
        let active: Option<bool> =
            w.db.admin
                .query_opt("SELECT active FROM pg_replication_slots WHERE slot_name = $1", &[&t0])
                .await
                .unwrap()
                .map(|r| r.get(0));
        (active == Some(true)).then_some(())
    })
    .await;
    let before = pg_objects(&w.db.admin, &w.prefix).await;
    let (ok, out) = teardown(&w.config, &w.db.admin_url, &["--yes", "--drop-pending"]);
    assert!(!ok, "{out}");
    assert!(out.contains(&format!("  left table \"{t0}\" (empty), publication \"{t0}\", replication slot \"{t0}\", checkpoint row \"{t0}\": replication slot \"{t0}\" is in use by pid ")), "{out}");
    assert!(out.contains("a streamer is running; stop it first"), "{out}");
    assert!(out.contains(&format!("  left table \"{t1}\" (empty), publication \"{t1}\", checkpoint row \"{t1}\": a streamer is running: the streamer login")), "{out}");
    let note = format!("note: replication slot \"{t1}\" is database \"{other_db}\"'s slot, not this source's");
    assert!(out.contains(&note), "{out}");
    assert_eq!(pg_objects(&w.db.admin, &w.prefix).await, before, "nothing of a running streamer is touched");

    assert!(streamer.stop());
    wait_no_pg_sessions(&w.db.admin, &w.db.streamer_url).await;
    let (ok, out) = teardown(&w.config, &w.db.admin_url, &["--yes"]);
    assert!(ok, "{out}");
    assert!(
        out.contains(&format!("  dropped table \"{t1}\" (empty), publication \"{t1}\", checkpoint row \"{t1}\"\n")),
        "the other database's slot is not named as dropped:\n{out}"
    );
    assert!(out.contains(&note), "{out}");
    assert_eq!(pg_objects(&w.db.admin, &w.prefix).await, Vec::<String>::new());
    assert_eq!(other_slot().await, Some(other_db.clone()), "the other database's slot is untouched");
    let (ok, out) = teardown(&w.config, &w.db.admin_url, &["--yes"]);
    assert!(ok && out.contains("nothing to tear down") && out.contains(&note), "{out}");
    other.admin.execute("SELECT pg_drop_replication_slot($1)", &[&t1]).await.unwrap();
}

/// What of `prefix` exists in a MariaDB database: tables, checkpoint rows, table grants and
/// routines, one sorted line each.
async fn my_objects(conn: &mut mysql_async::Conn, db: &str, prefix: &str) -> Vec<String> {
    let tables: Vec<String> =
        conn.exec("SELECT TABLE_NAME FROM information_schema.TABLES WHERE TABLE_SCHEMA = ?", (db,)).await.unwrap();
    let mut objects: Vec<String> = tables.iter().map(|t| format!("table {t}")).collect();
    let checkpoint = format!("{prefix}_checkpoint");
    if tables.contains(&checkpoint) {
        let rows: Vec<String> = conn.query(format!("SELECT stream FROM {db}.{checkpoint}")).await.unwrap();
        objects.extend(rows.iter().map(|r| format!("checkpoint row {r}")));
    }
    let grants: Vec<(String, String, String)> =
        conn.exec("SELECT User, Table_name, Table_priv FROM mysql.tables_priv WHERE Db = ?", (db,)).await.unwrap();
    objects.extend(grants.iter().map(|(u, t, p)| format!("grant {p} on {t} to {u}")));
    let routines: Vec<String> = conn
        .exec("SELECT ROUTINE_NAME FROM information_schema.ROUTINES WHERE ROUTINE_SCHEMA = ?", (db,))
        .await
        .unwrap();
    objects.extend(routines.iter().map(|r| format!("routine {r}")));
    objects.sort();
    objects
}

/// Sessions of `user` whose command matches `command` (a LIKE pattern), read as the admin.
async fn my_sessions(admin_url: &str, user: &str, command: &str) -> i64 {
    let mut conn = mysql_async::Conn::new(mysql_async::Opts::from_url(admin_url).unwrap()).await.unwrap();
    let n: Option<i64> = conn
        .exec_first(
            "SELECT count(*) FROM information_schema.PROCESSLIST WHERE USER = ? AND COMMAND LIKE ?",
            (user, command),
        )
        .await
        .unwrap();
    conn.disconnect().await.unwrap();
    n.unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_teardown_refuses_a_running_streamer_keeps_unpublished_rows_and_revokes_grants() {
    let _services = shared_services().await;
    let mut db = mysql::fresh_db().await;
    let url = db.streamer_user("REPLICATION SLAVE, REPLICATION CLIENT").await;
    let user = format!("{}_s", db.name);
    let prefix = unique("tdm");
    let topic = kafka::fresh_topic("tdm", 1).await;
    let dir = scratch(&prefix);
    let config = source_config(&dir, "mysql", &url, &prefix, 2, 1, "");
    let (ok, out, err) = run_cli(&config, &["setup", "--admin-url", &db.admin_url]);
    assert!(ok, "{out}{err}");
    let (t0, t1, checkpoint) = (format!("{prefix}_0_0"), format!("{prefix}_1_0"), format!("{prefix}_checkpoint"));
    let before = my_objects(&mut db.conn, &db.name, &prefix).await;
    for t in [&t0, &t1, &checkpoint] {
        assert!(before.contains(&format!("table {t}")), "{before:?}");
    }
    assert!(before.iter().filter(|o| o.starts_with("grant ")).count() >= 3, "setup granted on every table: {before:?}");

    // A running streamer: nothing is touched.
    let streamer = Running::start(&config, &dir.join("running.log"));
    wait_until("the streamer's binlog sessions", SETTLE, || async {
        (my_sessions(&db.admin_url, &user, "Binlog Dump%").await == 2).then_some(())
    })
    .await;
    let (ok, out) = teardown(&config, &db.admin_url, &["--yes", "--drop-pending"]);
    assert!(!ok, "{out}");
    assert!(out.contains(&format!("  left table \"{t0}\" (empty), checkpoint row \"{t0}\", grants to '{user}'@'127.0.0.1' on \"{t0}\": a streamer is running: the streamer login \"{user}\" has sessions (id ")), "{out}");
    assert_eq!(my_objects(&mut db.conn, &db.name, &prefix).await, before);
    assert!(streamer.stop());
    wait_until("the streamer's sessions to end", SETTLE, || async {
        (my_sessions(&db.admin_url, &user, "%").await == 0).then_some(())
    })
    .await;

    // Rows never published keep their table, its checkpoint row and grants, and the shared objects.
    db.conn
        .query_drop(format!("INSERT INTO {t1} (topic, payload) VALUES ('{topic}', 'a'), ('{topic}', 'b')"))
        .await
        .unwrap();
    let (ok, out) = teardown(&config, &db.admin_url, &[]);
    assert!(!ok && out.contains(&format!("would leave table \"{t1}\" (2 rows never published)")), "{out}");
    assert_eq!(my_objects(&mut db.conn, &db.name, &prefix).await, before, "a dry run changes nothing");
    let (ok, out) = teardown(&config, &db.admin_url, &["--yes"]);
    assert!(!ok, "{out}");
    assert!(
        out.contains(&format!(
            "  dropped table \"{t0}\" (empty), checkpoint row \"{t0}\", grants to '{user}'@'127.0.0.1' on \"{t0}\"\n"
        )),
        "{out}"
    );
    assert!(
        out.contains(&format!("  left table \"{t1}\" (2 rows never published), checkpoint row \"{t1}\", grants to")),
        "{out}"
    );
    assert!(
        out.contains(&format!("checkpoint table \"{checkpoint}\"")) && out.contains(&format!("table \"{t1}\" remains")),
        "{out}"
    );
    let left: Vec<String> = before.iter().filter(|o| !o.contains(&t0)).cloned().collect();
    assert_eq!(my_objects(&mut db.conn, &db.name, &prefix).await, left);

    let (ok, out) = teardown(&config, &db.admin_url, &["--yes", "--drop-pending"]);
    assert!(ok, "{out}");
    assert!(
        out.contains(&format!("  dropped table \"{t1}\" (2 rows never published), checkpoint row \"{t1}\"")),
        "{out}"
    );
    assert!(out.contains("--drop-pending discarded 2 row(s)"), "{out}");
    assert_eq!(my_objects(&mut db.conn, &db.name, &prefix).await, Vec::<String>::new(), "grants are revoked too");
    let (ok, out) = teardown(&config, &db.admin_url, &["--yes"]);
    assert!(ok && out.contains("nothing to tear down"), "{out}");

    // setup starts afresh (new checkpoints at the current position), and the stream works.
    let (ok, out, err) = run_cli(&config, &["setup", "--admin-url", &db.admin_url]);
    assert!(ok, "{out}{err}");
    assert_eq!(my_objects(&mut db.conn, &db.name, &prefix).await, before);
    let streamer = Running::start(&config, &dir.join("after-teardown.log"));
    db.conn.query_drop(format!("INSERT INTO {t0} (topic, payload) VALUES ('{topic}', 'after')")).await.unwrap();
    let records = kafka::read_at_least(&topic, 1, 1, ARRIVAL).await;
    assert_eq!(records[0].payload_str(), "after", "the rows discarded before are not sent");
    assert!(streamer.stop());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn teardown_removes_the_clusters_zookeeper_nodes_once_no_instance_runs() {
    let cluster = unique("tdz");
    let extra = format!(
        "\n[coordination]\nkind = \"zookeeper\"\nconnect = \"{}\"\ncluster_name = \"{cluster}\"\nsession_timeout_ms = 3000\n",
        env("OUTBOX_ZK_CONNECT")
    );
    let w = World::postgres("tdz").config(&extra).build().await;
    let table = w.table(0, 0);
    let zk =
        outbox_zookeeper::connect(&outbox_zookeeper::SessionSettings::new(env("OUTBOX_ZK_CONNECT"))).await.unwrap();
    let paths = ClusterPaths::new("/outbox-streamer", &cluster);
    let key = format!("test.{table}");
    let base = paths.base().to_string();

    let streamer = w.start("coordinated.log");
    wait_until("the instance to hold the lease", SETTLE, || async {
        outbox_zookeeper::lease::holder(&zk, &paths, &key).await.unwrap().map(|_| ())
    })
    .await;
    let (ok, out) = teardown(&w.config, &w.db.admin_url, &["--yes"]);
    assert!(!ok, "{out}");
    assert!(out.contains(&format!("  left ZooKeeper node {base} and the ")), "{out}");
    assert!(out.contains("are registered: they are running; stop them first"), "{out}");
    assert!(out.contains(&format!("  left table \"{table}\" (empty)")), "{out}");
    assert!(zk.check_stat(&base).await.unwrap().is_some());

    assert!(streamer.stop());
    wait_until("the instance's nodes to go", SETTLE, || async {
        let members = outbox_zookeeper::members::list(&zk, &paths).await.unwrap();
        let lease = outbox_zookeeper::lease::holder(&zk, &paths, &key).await.unwrap();
        (members.is_empty() && lease.is_none()).then_some(())
    })
    .await;
    wait_no_pg_sessions(&w.db.admin, &w.db.streamer_url).await;
    let (ok, out) = teardown(&w.config, &w.db.admin_url, &[]);
    assert!(ok && out.contains(&format!("  would drop ZooKeeper node {base} and the ")), "{out}");
    assert!(zk.check_stat(&base).await.unwrap().is_some(), "a dry run changes nothing");
    let (ok, out) = teardown(&w.config, &w.db.admin_url, &["--yes"]);
    assert!(ok, "{out}");
    assert!(out.contains(&format!("  dropped ZooKeeper node {base} and the ")), "{out}");
    assert_eq!(zk.check_stat(&base).await.unwrap(), None);
    assert!(zk.check_stat("/outbox-streamer").await.unwrap().is_some(), "the root of every cluster stays");
    let (ok, out) = teardown(&w.config, &w.db.admin_url, &["--yes"]);
    assert!(ok && out.contains("nothing to tear down"), "{out}");
}
