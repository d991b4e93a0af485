//! Kafka with SASL: the services' broker has a second listener that requires SCRAM-SHA-256 or
//! PLAIN (`OUTBOX_KAFKA_SASL_BROKERS`, user `OUTBOX_KAFKA_SASL_USER`). The streamer
//! authenticates with the password from an environment variable or a file, and a wrong
//! password is reported without the password.

use std::path::PathBuf;
use std::time::Duration;

use tokio_postgres::types::ToSql;

use crate::support::pg::PgDb;
use crate::support::streamer::Running;
use crate::support::world::World;
use crate::support::{env, kafka};

const ARRIVAL: Duration = Duration::from_secs(120);

/// The world's config pointed at the SASL listener with `mechanism` and `password_line`
/// (`sasl_password_env = …` or `sasl_password_file = …`).
fn sasl_config(w: &World<PgDb>, name: &str, mechanism: &str, password_line: &str) -> PathBuf {
    let text = std::fs::read_to_string(&w.config).unwrap();
    let text = text.replace(&kafka::brokers(), &env("OUTBOX_KAFKA_SASL_BROKERS")).replace(
        "message_timeout_ms = 10000\n",
        &format!(
            "message_timeout_ms = 10000\n{password_line}\nproperties = {{ \"security.protocol\" = \"SASL_PLAINTEXT\", \"sasl.mechanism\" = \"{mechanism}\", \"sasl.username\" = \"{}\" }}\n",
            env("OUTBOX_KAFKA_SASL_USER")
        ),
    );
    let path = w.dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scram_and_plain_authenticate_and_a_wrong_password_is_reported_without_it() {
    let w = World::postgres("sasl").build().await;
    let table = w.table(0, 0);
    let password = env("OUTBOX_KAFKA_SASL_PASSWORD");
    let insert = format!("INSERT INTO {table} (topic, payload) VALUES ($1, $2)");
    let send = |payload: &'static str| {
        let insert = insert.clone();
        let topic = w.topic.clone();
        let admin = &w.db.admin;
        async move { admin.execute(&insert, &[&topic as &(dyn ToSql + Sync), &payload.as_bytes()]).await.unwrap() }
    };

    // SCRAM-SHA-256, the password from an environment variable.
    let scram = sasl_config(&w, "scram.toml", "SCRAM-SHA-256", "sasl_password_env = \"TEST_KAFKA_PASSWORD\"");
    // OUTBOX_KAFKA_BROKERS (set for the tests) would override the config's brokers.
    let brokers = ("OUTBOX_KAFKA_BROKERS", env("OUTBOX_KAFKA_SASL_BROKERS"));
    let streamer = Running::start_with_env(
        &scram,
        &w.dir.join("scram.log"),
        &[("TEST_KAFKA_PASSWORD", password.clone()), brokers.clone()],
    );
    send("over-scram").await;
    kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    w.wait_drained(&table).await;
    assert!(streamer.stop());

    // PLAIN, the password from a file.
    let file = w.dir.join("kafka-password");
    std::fs::write(&file, format!("{password}\n")).unwrap();
    let plain = sasl_config(&w, "plain.toml", "PLAIN", &format!("sasl_password_file = \"{}\"", file.display()));
    let streamer = Running::start_with_env(&plain, &w.dir.join("plain.log"), std::slice::from_ref(&brokers));
    send("over-plain").await;
    let records = kafka::read_at_least(&w.topic, 1, 2, ARRIVAL).await;
    assert_eq!(records.iter().map(|r| r.payload_str()).collect::<Vec<_>>(), ["over-scram", "over-plain"]);
    w.wait_drained(&table).await;
    assert!(streamer.stop());

    // A wrong password: nothing is deleted, the log says authentication failed, never the secret.
    let wrong = format!("{password}-wrong");
    let streamer =
        Running::start_with_env(&scram, &w.dir.join("wrong.log"), &[("TEST_KAFKA_PASSWORD", wrong.clone()), brokers]);
    send("not-delivered").await;
    let log = streamer.wait_for_log("uthentication", ARRIVAL).await;
    assert!(!log.contains(&password), "the log shows the password:\n{log}");
    assert_eq!(w.db.count(&table).await, 1, "the row stays until Kafka takes it");
    drop(streamer);
}
