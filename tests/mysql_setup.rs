//! `outbox-streamer setup` against real MariaDB, as the documented least-privilege user.

use mysql_async::prelude::Queryable;

use crate::support::streamer::{run_cli, scratch, source_config};
use crate::support::{mysql, shared_services, unique};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_creates_tables_checkpoints_and_grants_idempotently() {
    let _services = shared_services().await;
    let mut db = mysql::fresh_db().await;
    let streamer_url = db.streamer_user("REPLICATION SLAVE, REPLICATION CLIENT").await;
    let prefix = unique("ms");
    let dir = scratch(&prefix);
    let config = source_config(&dir, "mysql", &streamer_url, &prefix, 2, 1, "");

    let (ok, out, err) = run_cli(&config, &["setup", "--dry-run"]);
    assert!(ok && out.contains(&format!("CREATE TABLE IF NOT EXISTS `{prefix}_0_0`")), "{out}{err}");

    let (ok, out, err) = run_cli(&config, &["setup", "--admin-url", &db.admin_url]);
    assert!(ok, "setup failed:\n{out}\n{err}");
    let checkpoint = format!("{prefix}_checkpoint");
    let rows: Vec<(String, String, String)> =
        db.conn.query(format!("SELECT stream, gtid, binlog_file FROM {checkpoint} ORDER BY stream")).await.unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0].0, format!("{prefix}_0_0"));
    assert!(rows[0].1.contains('-'), "a MariaDB GTID position: {:?}", rows[0]);
    assert!(!rows[0].2.is_empty(), "a binlog file: {:?}", rows[0]);

    // A second run changes nothing, even after the server's position moved.
    db.conn.query_drop(format!("INSERT INTO {prefix}_0_0 (topic, payload) VALUES ('t', 'p')")).await.unwrap();
    let (ok, out, err) = run_cli(&config, &["setup", "--admin-url", &db.admin_url]);
    assert!(ok, "second setup failed:\n{out}\n{err}");
    let again: Vec<(String, String, String)> =
        db.conn.query(format!("SELECT stream, gtid, binlog_file FROM {checkpoint} ORDER BY stream")).await.unwrap();
    assert_eq!(again, rows, "setup never moves an existing checkpoint");

    // The streamer user can do exactly its job.
    let opts = mysql_async::Opts::from_url(&streamer_url).unwrap();
    let mut streamer = mysql_async::Conn::new(opts).await.unwrap();
    let n: Option<i64> = streamer.query_first(format!("SELECT count(*) FROM {prefix}_0_0")).await.unwrap();
    assert_eq!(n, Some(1));
    streamer.query_drop(format!("DELETE FROM {prefix}_0_0")).await.unwrap();
    streamer
        .query_drop(format!("UPDATE {checkpoint} SET owner_epoch = 1 WHERE stream = '{prefix}_0_0'"))
        .await
        .unwrap();
    let denied = streamer.query_drop(format!("DROP TABLE {prefix}_0_0")).await;
    assert!(denied.is_err(), "the streamer user must not be able to drop tables");
    streamer.disconnect().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_names_a_missing_replication_grant_and_the_fix() {
    let _services = shared_services().await;
    let mut db = mysql::fresh_db().await;
    let streamer_url = db.streamer_user("").await;
    let prefix = unique("mg");
    let dir = scratch(&prefix);
    let config = source_config(&dir, "mysql", &streamer_url, &prefix, 1, 1, "");
    let (ok, out, err) = run_cli(&config, &["setup", "--admin-url", &db.admin_url]);
    assert!(!ok, "setup must fail:\n{out}\n{err}");
    assert!(err.contains("GRANT REPLICATION SLAVE, BINLOG MONITOR ON *.*"), "{err}");
    assert!(!err.contains("pw-"), "no password in errors: {err}");
    let tables: Vec<String> = db.conn.query("SHOW TABLES").await.unwrap();
    assert!(tables.is_empty(), "nothing is created when a check fails");
}

/// The admin password can stay out of the process arguments: `setup --help` says how, and
/// `--admin-password-env` reads it from the environment for a URL that has none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_takes_the_admin_password_from_the_environment() {
    let _services = shared_services().await;
    let mut db = mysql::fresh_db().await;
    let streamer_url = db.streamer_user("REPLICATION SLAVE, REPLICATION CLIENT").await;
    let prefix = unique("mp");
    let dir = scratch(&prefix);
    let config = source_config(&dir, "mysql", &streamer_url, &prefix, 1, 1, "");

    let (ok, help, _) = run_cli(&config, &["setup", "--help"]);
    assert!(ok && help.contains("OUTBOX_SETUP_URL") && help.contains("--admin-password-env"), "{help}");

    let (scheme, rest) = db.admin_url.split_once("://").unwrap();
    let (userinfo, host) = rest.rsplit_once('@').unwrap();
    let (user, password) = userinfo.split_once(':').unwrap();
    let bare_url = format!("{scheme}://{user}@{host}");
    let setup = |env: &[(&str, &str)]| {
        let out = std::process::Command::new(crate::support::streamer::bin())
            .arg("--config")
            .arg(&config)
            .args(["setup", "--admin-url", &bare_url, "--admin-password-env", "OUTBOX_TEST_ADMIN_PASSWORD"])
            .env_remove("OUTBOX_TEST_ADMIN_PASSWORD")
            .envs(env.iter().copied())
            .output()
            .unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (ok, err) = setup(&[]);
    assert!(!ok && err.contains("OUTBOX_TEST_ADMIN_PASSWORD is not set"), "{err}");
    let (ok, err) = setup(&[("OUTBOX_TEST_ADMIN_PASSWORD", password)]);
    assert!(ok, "setup with the password from the environment failed:\n{err}");
    let tables: Vec<String> = db.conn.query("SHOW TABLES").await.unwrap();
    assert!(tables.contains(&format!("{prefix}_0_0")), "{tables:?}");
}
