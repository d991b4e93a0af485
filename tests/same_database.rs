//! Two sources that reach one database under different host names, with the same prefix,
//! are refused by `run` and `setup` (`src/same_database.rs`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::support::streamer::{Running, run_cli, scratch, source_config};
use crate::support::{mysql, pg, shared_services, unique};

const REFUSAL: Duration = Duration::from_secs(60);

/// `config` with a second source "alias" reaching the first one's database by `localhost`.
fn with_alias_source(config: &Path, kind: &str, url: &str, prefix: &str) -> PathBuf {
    let alias = url.replace("@127.0.0.1:", "@localhost:");
    assert_ne!(alias, url, "the service URL names 127.0.0.1");
    let text = std::fs::read_to_string(config).unwrap()
        + &format!(
            "\n[[source]]\nname = \"alias\"\nkind = \"{kind}\"\nurl = \"{alias}\"\ntable_prefix = \"{prefix}\"\nshards = 1\npartitions = 1\n"
        );
    let path = config.with_file_name("two-names.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// `setup` and `run` both fail naming the two sources and the fix, and `run` starts nothing.
async fn assert_refused(config: &Path, admin_url: &str, log: &Path) {
    let (ok, out, err) = run_cli(config, &["setup", "--admin-url", admin_url]);
    assert!(!ok, "setup must refuse:\n{out}\n{err}");
    assert!(err.contains(r#"sources "test" and "alias" reach the same database"#), "{err}");
    assert!(err.contains("table_prefix"), "the fix is named: {err}");
    let run = Running::start(config, log);
    let text = run.wait_for_log("reach the same database", REFUSAL).await;
    assert!(!text.contains("streaming"), "nothing streams:\n{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_database_under_two_host_names_is_refused() {
    let _services = shared_services().await;
    let db = pg::fresh_db().await;
    let prefix = unique("sd");
    let dir = scratch(&prefix);
    let config = source_config(&dir, "postgres", &db.streamer_url, &prefix, 1, 1, "");
    let (ok, out, err) = run_cli(&config, &["setup", "--admin-url", &db.admin_url]);
    assert!(ok, "setup of one source:\n{out}\n{err}");
    let two = with_alias_source(&config, "postgres", &db.streamer_url, &prefix);
    assert_refused(&two, &db.admin_url, &dir.join("run.log")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_database_under_two_host_names_is_refused() {
    let _services = shared_services().await;
    let mut db = mysql::fresh_db().await;
    let streamer_url = db.streamer_user("REPLICATION SLAVE, REPLICATION CLIENT").await;
    let prefix = unique("sm");
    let dir = scratch(&prefix);
    let config = source_config(&dir, "mysql", &streamer_url, &prefix, 1, 1, "");
    let (ok, out, err) = run_cli(&config, &["setup", "--admin-url", &db.admin_url]);
    assert!(ok, "setup of one source:\n{out}\n{err}");
    let two = with_alias_source(&config, "mysql", &streamer_url, &prefix);
    assert_refused(&two, &db.admin_url, &dir.join("run.log")).await;
}
