//! The three accounts of docs/configure-postgres.md and docs/configure-mysql.md, created by
//! running the docs' own SQL blocks (with this test's names and passwords), then `setup` as
//! the documented owner with `--app-role`, the application enqueueing as its own login, and
//! the streamer delivering to Kafka. Before the documented grants are complete, `setup` must
//! refuse without creating anything and print statements that, run as printed, fix it.

use std::time::Duration;

use mysql_async::prelude::Queryable;

use crate::support::streamer::{Running, run_cli, scratch, source_config};
use crate::support::{exclusive_services, kafka, mysql, pg, shared_services, unique, wait_until};

const ARRIVAL: Duration = Duration::from_secs(60);

/// The SQL block after `<!-- accounts:<which> -->` in `doc`, one statement per line.
fn documented_block(doc: &str, which: &str) -> Vec<String> {
    let text = std::fs::read_to_string(format!("{}/docs/{doc}", env!("CARGO_MANIFEST_DIR"))).expect("reading the doc");
    let marker = format!("<!-- accounts:{which} -->");
    let after = text.split_once(&marker).unwrap_or_else(|| panic!("{doc} has no {marker}")).1;
    let block = after.split_once("```sql\n").expect("a sql block").1.split_once("```").expect("its end").0;
    block.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with("--")).map(str::to_string).collect()
}

/// The doc's names and placeholders replaced by this test's.
fn with_names(statement: &str, names: &[(&str, &str)]) -> String {
    let mut out = statement.to_string();
    for (from, to) in names {
        out = replace_word(&out, from, to);
    }
    out
}

/// Replaces `from` where it stands as a whole word (not inside a longer identifier).
fn replace_word(text: &str, from: &str, to: &str) -> String {
    let is_word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find(from) {
        let before = rest[..at].chars().next_back();
        let after = rest[at + from.len()..].chars().next();
        out.push_str(&rest[..at]);
        if before.is_some_and(is_word) || after.is_some_and(is_word) {
            out.push_str(from);
        } else {
            out.push_str(to);
        }
        rest = &rest[at + from.len()..];
    }
    out.push_str(rest);
    out
}

/// The statements after "fix: " in setup's failure lines.
fn printed_fixes(stderr: &str) -> Vec<String> {
    stderr
        .lines()
        .filter_map(|l| l.split_once("; fix: ").map(|(_, fix)| fix.trim().trim_end_matches(';').to_string()))
        .collect()
}

/// Runs the streamer until payloads 0 to 5 are in `topic`, each once, and stops it.
async fn delivered_once(config: &std::path::Path, dir: &std::path::Path, topic: &str) {
    let run = Running::start(config, &dir.join("run.log"));
    let records = kafka::read_at_least(topic, 1, 6, ARRIVAL).await;
    let mut payloads: Vec<String> = records.iter().map(|r| r.payload_str()).collect();
    payloads.sort();
    assert_eq!(payloads, ["0", "1", "2", "3", "4", "5"], "every enqueued message arrives once");
    assert!(run.stop(), "exits 0 on SIGTERM");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_accounts_as_documented_with_app_role() {
    let _services = shared_services().await;
    let db = pg::fresh_db().await;
    let database: String = db.admin.query_one("SELECT current_database()::text", &[]).await.unwrap().get(0);
    let (owner, streamer, app) = (format!("{database}_owner"), format!("{database}_st"), format!("{database}_app"));
    let password = format!("pw-{}", unique("a"));
    let quoted = format!("'{password}'");
    let names = [
        ("outbox_owner", owner.as_str()),
        ("outbox_streamer", streamer.as_str()),
        ("orders_app", app.as_str()),
        ("app", database.as_str()),
        ("'…'", quoted.as_str()),
    ];
    let block = documented_block("configure-postgres.md", "postgres");
    assert!(block.len() >= 6, "{block:?}");
    // First without the owner's CREATE grants: setup refuses, creates nothing, and says what
    // to grant.
    let (grants, rest): (Vec<&String>, Vec<&String>) = block.iter().partition(|s| s.contains("CREATE ON"));
    for statement in &rest {
        db.admin.batch_execute(&with_names(statement, &names)).await.expect("the documented statement runs");
    }
    let hostport = db.admin_url.split('@').nth(1).unwrap().rsplit_once('/').unwrap().0.to_string();
    let url = |role: &str| format!("postgres://{role}:{password}@{hostport}/{database}");
    let prefix = unique("acc");
    let dir = scratch(&prefix);
    let topic = kafka::fresh_topic("acc", 1).await;
    let config = source_config(&dir, "postgres", &url(&streamer), &prefix, 1, 2, "");
    let setup = |extra: &[&str]| {
        let mut args = vec!["setup", "--admin-url"];
        let admin = url(&owner);
        args.push(&admin);
        args.extend_from_slice(extra);
        run_cli(&config, &args)
    };
    let (ok, out, err) = setup(&["--app-role", &app]);
    assert!(!ok, "setup must refuse without the owner's CREATE grants:\n{out}\n{err}");
    assert!(err.contains("nothing was created"), "{err}");
    assert!(!err.contains(&password), "no password in messages: {err}");
    let fixes = printed_fixes(&err);
    assert!(fixes.iter().any(|f| f.starts_with("GRANT CREATE ON DATABASE")), "{err}");
    assert!(fixes.iter().any(|f| f.starts_with("GRANT CREATE ON SCHEMA")), "{err}");
    let tables: i64 = db
        .admin
        .query_one("SELECT count(*) FROM pg_tables WHERE tablename LIKE $1", &[&format!("{prefix}%")])
        .await
        .unwrap()
        .get(0);
    assert_eq!(tables, 0, "a refused setup leaves nothing behind");
    // The fixes as printed, then the documented block's grants (already given, harmless).
    for fix in fixes {
        db.admin.batch_execute(&fix).await.unwrap_or_else(|e| panic!("the printed fix {fix:?} runs: {e}"));
    }
    for statement in grants {
        db.admin.batch_execute(&with_names(statement, &names)).await.expect("the documented grant runs");
    }
    let ghost = format!("{database}_ghost");
    let (ok, out, err) = setup(&["--app-role", &ghost]);
    assert!(!ok && err.contains("does not exist") && err.contains("nothing was created"), "{out}\n{err}");
    let (ok, out, err) = setup(&["--app-role", &app]);
    assert!(ok, "setup as the documented owner with --app-role:\n{out}\n{err}");
    assert!(!err.contains("NOTICE") && !out.contains("NOTICE"), "no server notices: {out}{err}");
    let slots: i64 = db
        .admin
        .query_one("SELECT count(*) FROM pg_replication_slots WHERE database = current_database()", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(slots, 2, "the owner has no REPLICATION: setup created the slots as the streamer");

    // The application enqueues through the function and by INSERT … RETURNING, and may do no more.
    let app_client = pg::connect(&url(&app)).await;
    let enqueue = format!("SELECT {prefix}_enqueue($1, $2::bytea, $3::bytea)");
    for n in 0..4 {
        let key = format!("key-{n}");
        app_client
            .query_one(&enqueue, &[&topic, &key.as_bytes(), &format!("{n}").as_bytes()])
            .await
            .unwrap_or_else(|e| panic!("the app role enqueues: {e:?}"));
    }
    let id: i64 = app_client
        .query_one(
            &format!("INSERT INTO {prefix}_0_0 (topic, payload) VALUES ($1, '4'::bytea) RETURNING id"),
            &[&topic],
        )
        .await
        .expect("INSERT … RETURNING id as the app role")
        .get(0);
    assert!(id > 0);
    let denied = app_client.batch_execute(&format!("DELETE FROM {prefix}_0_0")).await;
    assert!(denied.is_err(), "the app role cannot delete outbox rows");

    // More partitions later: the earlier app role gets the new tables without --app-role.
    let config = source_config(&dir, "postgres", &url(&streamer), &prefix, 1, 3, "");
    let (ok, out, err) = run_cli(&config, &["setup", "--admin-url", &url(&owner)]);
    assert!(ok && out.contains(&app), "setup grants the earlier app role again:\n{out}\n{err}");
    app_client
        .batch_execute(&format!("INSERT INTO {prefix}_0_2 (topic, payload) VALUES ('{topic}', '5'::bytea)"))
        .await
        .expect("the app role inserts into a partition added later");

    delivered_once(&config, &dir, &topic).await;
}

/// A fresh database with a source config of one shard-partition, and a transaction prepared in
/// it and left undecided: (database, its gid, config).
async fn prepared_on_a_fresh_db(name: &str) -> (pg::PgDb, String, std::path::PathBuf) {
    let db = pg::fresh_db().await;
    let prefix = unique(name);
    let dir = scratch(&prefix);
    db.admin.batch_execute("CREATE TABLE business (n int)").await.unwrap();
    let gid = unique("gid");
    db.admin
        .batch_execute(&format!("BEGIN; INSERT INTO business VALUES (1); PREPARE TRANSACTION '{gid}'"))
        .await
        .expect("a prepared transaction (the services allow them)");
    let config = source_config(&dir, "postgres", &db.streamer_url, &prefix, 1, 1, "");
    (db, gid, config)
}

/// A leftover prepared transaction makes a new slot wait for ever: setup refuses, names it,
/// and the printed ROLLBACK PREPARED, run as printed, lets setup complete. Exclusive: the
/// leftover is cluster-wide and would hold up every other test's setup meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_setup_names_an_undecided_prepared_transaction() {
    let _services = exclusive_services().await;
    let (db, gid, config) = prepared_on_a_fresh_db("prp").await;
    let (ok, out, err) = run_cli(&config, &["setup", "--admin-url", &db.admin_url, "--prepared-wait", "1"]);
    if ok {
        pg::roll_back_prepared(&db.admin_url, std::slice::from_ref(&gid)).await;
    }
    assert!(!ok, "setup must refuse while a prepared transaction is undecided:\n{out}\n{err}");
    assert!(err.contains(&gid), "{err}");
    let fix = err
        .lines()
        .find(|l| l.contains(&gid))
        .and_then(|l| l.split("or ").last())
        .map(|f| f.trim().trim_end_matches(';').to_string())
        .expect("a fix");
    assert!(fix.starts_with("ROLLBACK PREPARED"), "{err}");
    db.admin.batch_execute(&fix).await.unwrap_or_else(|e| panic!("the printed fix {fix:?} runs: {e}"));
    let (ok, out, err) = run_cli(&config, &["setup", "--admin-url", &db.admin_url]);
    assert!(ok, "setup after the fix:\n{out}\n{err}");
}

/// A prepared transaction that its transaction manager decides while setup looks (XA on a busy
/// cluster) is waited for, not refused: setup completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_setup_waits_for_a_prepared_transaction_decided_meanwhile() {
    let _services = shared_services().await;
    let (db, gid, config) = prepared_on_a_fresh_db("prw").await;
    let admin_url = db.admin_url.clone();
    let setup = {
        let config = config.clone();
        tokio::task::spawn_blocking(move || run_cli(&config, &["setup", "--admin-url", &admin_url]))
    };
    // Setup has seen the prepared transaction once its session has asked for them.
    wait_until("setup to look at the prepared transactions", Duration::from_secs(60), || async {
        let n: i64 = db
            .admin
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
                   AND pid <> pg_backend_pid() AND query LIKE '%FROM pg_prepared_xacts%'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        (n > 0).then_some(())
    })
    .await;
    db.admin.batch_execute(&format!("COMMIT PREPARED '{gid}'")).await.expect("deciding it");
    let (ok, out, err) = setup.await.unwrap();
    assert!(ok, "setup waits for a prepared transaction decided meanwhile:\n{out}\n{err}");
    assert!(!err.contains(&gid), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_accounts_as_documented_with_app_role_and_enqueue_procedure() {
    let _services = shared_services().await;
    let mut db = mysql::fresh_db().await;
    let n = db.name.clone();
    let (owner, streamer, app) = (format!("{n}_o"), format!("{n}_s"), format!("{n}_a"));
    let password = format!("pw-{}", unique("m"));
    let quoted = format!("'{password}'");
    let names = [
        ("outbox_owner", owner.as_str()),
        ("outbox_streamer", streamer.as_str()),
        ("orders_app", app.as_str()),
        ("app", n.as_str()),
        ("10.%", "127.0.0.1"),
        ("'…'", quoted.as_str()),
    ];
    let block = documented_block("configure-mysql.md", "mariadb");
    assert!(block.len() >= 6, "{block:?}");
    // First without the owner's grant option: setup refuses and prints the GRANT.
    let (owner_db_grant, rest): (Vec<&String>, Vec<&String>) =
        block.iter().partition(|s| s.contains("WITH GRANT OPTION"));
    for statement in &rest {
        db.conn.query_drop(with_names(statement, &names)).await.expect("the documented statement runs");
    }
    db.conn
        .query_drop(format!("GRANT CREATE, ALTER, SELECT, INSERT ON `{n}`.* TO '{owner}'@'127.0.0.1'"))
        .await
        .unwrap();
    let hostport = db.admin_url.split('@').nth(1).unwrap().split('/').next().unwrap().to_string();
    let url = |user: &str| format!("mysql://{user}:{password}@{hostport}/{n}");
    let prefix = unique("macc");
    let dir = scratch(&prefix);
    let topic = kafka::fresh_topic("macc", 1).await;
    let config = source_config(&dir, "mysql", &url(&streamer), &prefix, 1, 2, "");
    let app_account = format!("{app}@127.0.0.1");
    let (ok, out, err) = run_cli(&config, &["setup", "--admin-url", &url(&owner), "--app-role", &app_account]);
    assert!(!ok, "setup must refuse without the owner's grant option:\n{out}\n{err}");
    assert!(err.contains("nothing was created") && err.contains("GRANT OPTION"), "{err}");
    assert!(!err.contains(&password), "no password in messages: {err}");
    let tables: Vec<String> = db.conn.query("SHOW TABLES").await.unwrap();
    assert!(tables.is_empty(), "a refused setup leaves nothing behind: {tables:?}");
    let fixes = printed_fixes(&err);
    assert_eq!(fixes.len(), 1, "{err}");
    db.conn.query_drop(&fixes[0]).await.unwrap_or_else(|e| panic!("the printed fix {:?} runs: {e}", fixes[0]));
    for statement in owner_db_grant {
        db.conn.query_drop(with_names(statement, &names)).await.expect("the documented grant runs");
    }
    let ghost = format!("{n}_ghost");
    let (ok, out, err) = run_cli(&config, &["setup", "--admin-url", &url(&owner), "--app-role", &ghost]);
    assert!(!ok && err.contains("does not exist") && err.contains("nothing was created"), "{out}\n{err}");
    let (ok, out, err) = run_cli(&config, &["setup", "--admin-url", &url(&owner), "--app-role", &app_account]);
    assert!(ok, "setup as the documented owner with --app-role:\n{out}\n{err}");

    // The procedure routes a key to the same partition as PostgreSQL's function.
    let mut app_conn = mysql_async::Conn::new(mysql_async::Opts::from_url(&url(&app)).unwrap()).await.unwrap();
    let pg_db = pg::fresh_db().await;
    let pg_prefix = unique("route");
    let pg_config = source_config(&scratch(&pg_prefix), "postgres", &pg_db.streamer_url, &pg_prefix, 1, 2, "");
    let (ok, out, err) = run_cli(&pg_config, &["setup", "--admin-url", &pg_db.admin_url]);
    assert!(ok, "{out}{err}");
    for k in 0..6 {
        let key = format!("key-{k}");
        let ids: Vec<u64> = app_conn
            .exec(format!("CALL {prefix}_enqueue(?, ?, ?, NULL, 0)"), (&topic, &key, format!("{k}")))
            .await
            .unwrap_or_else(|e| panic!("the app account enqueues: {e}"));
        assert_eq!(ids.len(), 1, "the procedure answers the new id");
        let in_second: Option<i64> = db
            .conn
            .exec_first(format!("SELECT count(*) FROM {prefix}_0_1 WHERE msg_key = ? AND id = ?"), (&key, ids[0]))
            .await
            .unwrap();
        let mariadb_partition = in_second.unwrap_or(0);
        pg_db
            .admin
            .query_one(&format!("SELECT {pg_prefix}_enqueue('t', $1::bytea, NULL)"), &[&key.as_bytes()])
            .await
            .unwrap();
        let pg_partition: i64 = pg_db
            .admin
            .query_one(&format!("SELECT count(*) FROM {pg_prefix}_0_1 WHERE msg_key = $1::bytea"), &[&key.as_bytes()])
            .await
            .unwrap()
            .get(0);
        assert_eq!(mariadb_partition, pg_partition, "key {key}: the same partition on both databases");
    }
    let bad = app_conn.query_drop(format!("CALL {prefix}_enqueue('{topic}', 'k', 'p', NULL, 7)")).await;
    assert!(format!("{bad:?}").contains("shard 7 does not exist"), "{bad:?}");
    let denied = app_conn.query_drop(format!("DELETE FROM {prefix}_0_0")).await;
    assert!(denied.is_err(), "the app account cannot delete outbox rows");
    app_conn.disconnect().await.unwrap();

    delivered_once(&config, &dir, &topic).await;
}

#[test]
fn whole_words_only() {
    assert_eq!(
        replace_word("GRANT CONNECT ON DATABASE app TO orders_app;", "app", "x"),
        "GRANT CONNECT ON DATABASE x TO orders_app;"
    );
    assert_eq!(replace_word("ON app.* TO", "app", "db"), "ON db.* TO");
}

/// Outbox objects created by another login (an earlier setup as a superuser): setup as the new
/// owner names each object and its owner, and the printed ALTER … OWNER statements, run as
/// printed, let it complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_setup_names_objects_owned_by_another_role() {
    // Alone: setup refuses to create a slot while any database of the cluster holds a prepared
    // transaction, and other tests prepare some; its list of fixes must be this test's only.
    let _services = exclusive_services().await;
    let db = pg::fresh_db().await;
    let prefix = unique("own");
    let dir = scratch(&prefix);
    let config = source_config(&dir, "postgres", &db.streamer_url, &prefix, 1, 1, "");
    let (ok, out, err) = run_cli(&config, &["setup", "--admin-url", &db.admin_url]);
    assert!(ok, "{out}{err}");
    let database: String = db.admin.query_one("SELECT current_database()::text", &[]).await.unwrap().get(0);
    let owner = format!("{database}_new");
    let password = format!("pw-{}", unique("o"));
    db.admin
        .batch_execute(&format!(
            "CREATE ROLE {owner} LOGIN PASSWORD '{password}'; GRANT CONNECT, CREATE ON DATABASE {database} TO {owner}; \
             GRANT CREATE ON SCHEMA public TO {owner}"
        ))
        .await
        .unwrap();
    let hostport = db.admin_url.split('@').nth(1).unwrap().rsplit_once('/').unwrap().0.to_string();
    let owner_url = format!("postgres://{owner}:{password}@{hostport}/{database}");
    let (ok, out, err) = run_cli(&config, &["setup", "--admin-url", &owner_url]);
    assert!(!ok, "{out}{err}");
    let fixes: Vec<String> = printed_fixes(&err)
        .iter()
        .map(|f| f.rsplit(", or ").next().unwrap().trim_end_matches(';').to_string())
        .collect();
    assert_eq!(fixes.len(), 4, "two tables and the two functions: {err}");
    assert!(fixes.iter().all(|f| f.starts_with("ALTER ")), "{err}");
    for fix in &fixes {
        db.admin.batch_execute(fix).await.unwrap_or_else(|e| panic!("the printed fix {fix:?} runs: {e}"));
    }
    let (ok, out, err) = run_cli(&config, &["setup", "--admin-url", &owner_url]);
    assert!(ok, "setup as the new owner after the printed fixes:\n{out}\n{err}");
}
