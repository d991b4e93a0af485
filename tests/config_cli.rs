//! The configuration file on the command line: `config --effective` shows every
//! shard-partition's settings as they apply, each override on its own shard-partitions only,
//! and no secret (TOML or JSON); a missing file is reported once, with the fix.

use std::process::Command;

use crate::support::streamer::{bin, scratch};
use crate::support::unique;

const SECRETS: [&str; 4] = ["sasl-Secret-1", "keypass-Secret-2", "url-Secret-3", "file-Secret-4"];

fn config_cli(config: &std::path::Path, args: &[&str]) -> String {
    let out = Command::new(bin())
        .arg("--config")
        .arg(config)
        .args(args)
        .env("EFF_TEST_SASL", SECRETS[0])
        .output()
        .expect("running outbox-streamer");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "config {args:?} failed:\n{stdout}{stderr}");
    for secret in SECRETS {
        assert!(!stdout.contains(secret) && !stderr.contains(secret), "{secret} shown:\n{stdout}{stderr}");
    }
    stdout
}

#[test]
fn config_effective_shows_each_override_on_its_shard_partitions_and_no_secret() {
    let dir = scratch(&unique("effective"));
    let password_file = dir.join("mysql-password");
    std::fs::write(&password_file, format!("{}\n", SECRETS[3])).unwrap();
    let config = dir.join("outbox-streamer.toml");
    std::fs::write(
        &config,
        format!(
            r#"[kafka]
brokers = "127.0.0.1:9092"
sasl_password_env = "EFF_TEST_SASL"
[kafka.properties]
"sasl.mechanism" = "SCRAM-SHA-256"
"sasl.username" = "outbox"
"ssl.key.password" = "{key}"

[coordination]
kind = "zookeeper"
connect = "127.0.0.1:2181"
# A secret where no secret belongs: the output masks it all the same.
instance = "${{EFF_TEST_SASL}}"

[[source]]
name = "app"
kind = "postgres"
url = "postgres://streamer:{url}@db.internal:5432/app"
shards = 2
partitions = 2
[source.defaults]
linger_ms = 10
[[source.override]]
shard = 1
linger_ms = 0
compression = "zstd"
[[source.override]]
shard = 1
partition = 1
compression = "none"

[[source]]
name = "orders"
kind = "mysql"
url = "mysql://streamer@db.internal:3306/orders"
password_file = "{file}"
shards = 1
"#,
            key = SECRETS[1],
            url = SECRETS[2],
            file = password_file.display()
        ),
    )
    .unwrap();

    let check = config_cli(&config, &["config"]);
    assert!(check.contains("valid; 2 source(s), 5 shard-partition(s)"), "{check}");

    let json: serde_json::Value =
        serde_json::from_str(&config_cli(&config, &["config", "--effective", "--json"])).unwrap();
    let app = &json["source"][0];
    assert_eq!(app["url"], "postgres://streamer:***@db.internal:5432/app");
    assert_eq!(app["password"], "in the url (masked)");
    let stream = |shard: u64, partition: u64| {
        app["stream"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["shard"] == shard && s["partition"] == partition)
            .unwrap_or_else(|| panic!("stream {shard}/{partition} in {app}"))
            .clone()
    };
    let s00 = stream(0, 0);
    assert_eq!((s00["linger_ms"].as_u64(), s00["compression"].as_str()), (Some(10), Some("lz4")));
    assert_eq!(s00["set_by"], serde_json::json!({"linger_ms": "defaults"}));
    let s01 = stream(0, 1);
    assert_eq!((s01["linger_ms"].as_u64(), s01["compression"].as_str()), (Some(10), Some("lz4")));
    let s10 = stream(1, 0);
    assert_eq!((s10["linger_ms"].as_u64(), s10["compression"].as_str()), (Some(0), Some("zstd")));
    assert_eq!(
        s10["set_by"],
        serde_json::json!({"linger_ms": "override[0] (shard 1)", "compression": "override[0] (shard 1)"})
    );
    let s11 = stream(1, 1);
    assert_eq!((s11["linger_ms"].as_u64(), s11["compression"].as_str()), (Some(0), Some("none")));
    assert_eq!(s11["set_by"]["compression"], "override[1] (shard 1, partition 1)");
    assert_eq!((s11["table"].as_str(), s11["slot"].as_str()), (Some("outbox_1_1"), Some("outbox_1_1")));
    let orders = &json["source"][1];
    assert_eq!(orders["password"], format!("from file {}", password_file.display()));
    assert_eq!(orders["stream"][0]["linger_ms"], 5, "another source's defaults are the built-in ones");
    assert!(orders["stream"][0].get("slot").is_none(), "MariaDB has no slots");
    assert_eq!(json["kafka"]["properties"]["ssl.key.password"], "***");
    assert_eq!(json["kafka"]["properties"]["sasl.username"], "outbox");
    assert_eq!(json["kafka"]["sasl_password"], "from environment variable EFF_TEST_SASL");
    assert_eq!(json["coordination"]["instance"], "***");

    let text = config_cli(&config, &["config", "--effective"]);
    let toml: toml::Value = text.parse().unwrap_or_else(|e| panic!("the output is TOML: {e}\n{text}"));
    assert_eq!(toml["source"][0]["stream"][2]["linger_ms"].as_integer(), Some(0));
    assert_eq!(toml["source"][0]["stream"][2]["shard"].as_integer(), Some(1));
    assert_eq!(toml["source"][0]["stream"][1]["linger_ms"].as_integer(), Some(10));
}

#[test]
fn a_missing_config_file_is_reported_once_with_the_fix() {
    let missing = scratch(&unique("missing")).join("nowhere.toml");
    let out = Command::new(bin()).arg("--config").arg(&missing).arg("status").output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert_eq!(stderr.lines().count(), 1, "one line:\n{stderr}");
    assert_eq!(stderr.matches("No such file or directory").count(), 1, "the cause once:\n{stderr}");
    assert!(stderr.contains(&format!("cannot read config file {}", missing.display())), "{stderr}");
    assert!(stderr.contains("--config FILE or OUTBOX_CONFIG"), "{stderr}");
}
