//! TLS to the databases. The services' servers use a private CA (`$OUTBOX_TLS_DIR`).
//! PostgreSQL rejects plaintext from members of `outbox_tls_required` and accepts members of
//! `outbox_cert_auth` by client certificate alone (see `scripts/services`); MariaDB users are
//! created `REQUIRE SSL`. Both the SQL and the replication/binlog session must be encrypted.

use std::time::Duration;

use mysql_async::prelude::Queryable;
use tokio_postgres::types::ToSql;

use crate::support::pg::PgDb;
use crate::support::streamer::{Running, run_cli};
use crate::support::world::World;
use crate::support::{env, kafka, wait_until};

const ARRIVAL: Duration = Duration::from_secs(120);

fn tls_file(name: &str) -> String {
    format!("{}/{name}", env("OUTBOX_TLS_DIR"))
}

/// The world's config with its `[source.tls]` table replaced by `tls` and its URL by `url`.
fn variant(w: &World<PgDb>, name: &str, url: &str, tls: &str) -> std::path::PathBuf {
    rewrite(&w.config, &w.db.streamer_url, name, url, tls)
}

fn rewrite(config: &std::path::Path, old_url: &str, name: &str, url: &str, tls: &str) -> std::path::PathBuf {
    let text = std::fs::read_to_string(config).unwrap();
    let (head, _) = text.split_once("[source.tls]").expect("the world's config has a tls table");
    let text = format!("{head}{tls}\n").replace(old_url, url);
    let path = config.with_file_name(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn verify_full() -> String {
    format!("\n[source.tls]\nmode = \"verify-full\"\nca_file = \"{}\"\n", tls_file("ca.pem"))
}

fn wrong_ca() -> String {
    format!("[source.tls]\nmode = \"verify-ca\"\nca_file = \"{}\"", tls_file("other-ca.pem"))
}

/// Creates a group role once; concurrent creators tolerate each other.
async fn ensure_role(w: &World<PgDb>, sql: &str) {
    let body = format!("DO $$ BEGIN {sql}; EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$");
    w.db.admin.batch_execute(&body).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_sessions_are_encrypted_verified_and_a_client_certificate_logs_in() {
    let w = World::postgres("tls").config(&verify_full()).build().await;
    let table = w.table(0, 0);
    let role = w.db.streamer_url.split("://").nth(1).unwrap().split(':').next().unwrap().to_string();
    ensure_role(&w, "CREATE ROLE outbox_tls_required NOLOGIN").await;
    w.db.admin.batch_execute(&format!("GRANT outbox_tls_required TO {role}")).await.unwrap();
    let insert = format!("INSERT INTO {table} (topic, payload) VALUES ($1, $2)");
    let send = |payload: &'static str| {
        let (insert, topic, admin) = (insert.clone(), w.topic.clone(), &w.db.admin);
        async move { admin.execute(&insert, &[&topic as &(dyn ToSql + Sync), &payload.as_bytes()]).await.unwrap() }
    };

    // verify-full with the CA, SCRAM inside TLS: rows flow and both sessions are encrypted.
    let streamer = w.start("verify-full.log");
    send("over-tls").await;
    kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    w.wait_drained(&table).await;
    let encrypted: Vec<(String, bool)> = w
        .db
        .admin
        .query(
            "SELECT a.backend_type, s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) WHERE a.usename = $1",
            &[&role],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert!(encrypted.iter().any(|(kind, _)| kind == "walsender"), "no replication session: {encrypted:?}");
    assert!(encrypted.iter().all(|(_, ssl)| *ssl), "a session of {role} is not encrypted: {encrypted:?}");
    let (ok, out, err) = run_cli(&w.config, &["status"]);
    assert!(ok, "status over TLS failed:\n{out}\n{err}");
    assert!(streamer.stop());

    // Plaintext is refused by the server for this role, and the error says why.
    let plain = variant(&w, "plain.toml", &w.db.streamer_url, "");
    let (ok, out, err) = run_cli(&plain, &["status"]);
    assert!(!ok, "plaintext status succeeded:\n{out}");
    assert!(err.contains("no encryption"), "the error does not name the missing encryption:\n{err}");

    // A CA that did not sign the server's certificate: refused before any password is sent.
    let (ok, out, err) = run_cli(&variant(&w, "wrong-ca.toml", &w.db.streamer_url, &wrong_ca()), &["status"]);
    assert!(!ok, "status with the wrong CA succeeded:\n{out}");
    assert!(
        err.contains("UnknownIssuer") || err.contains("certificate"),
        "the error does not name the certificate:\n{err}"
    );
    let password = w.db.streamer_url.split(':').nth(2).unwrap().split('@').next().unwrap();
    assert!(!err.contains(password), "the error shows the password:\n{err}");

    // A client certificate (CN outbox_cert_client) instead of a password, on both sessions.
    ensure_role(&w, "CREATE ROLE outbox_cert_auth NOLOGIN").await;
    ensure_role(&w, "CREATE ROLE outbox_cert_client").await;
    let database = w.db.streamer_url.rsplit('/').next().unwrap();
    w.db.admin
        .batch_execute(&format!(
            "ALTER ROLE outbox_cert_client LOGIN REPLICATION; GRANT outbox_cert_auth TO outbox_cert_client; \
             GRANT CONNECT ON DATABASE {database} TO outbox_cert_client; GRANT {role} TO outbox_cert_client"
        ))
        .await
        .unwrap();
    let host_db = w.db.streamer_url.split('@').nth(1).unwrap();
    let cert_url = format!("postgres://outbox_cert_client@{host_db}");
    let cert_tls = format!(
        "[source.tls]\nmode = \"verify-full\"\nca_file = \"{}\"\ncert_file = \"{}\"\nkey_file = \"{}\"",
        tls_file("ca.pem"),
        tls_file("client.pem"),
        tls_file("client.key")
    );
    let cert_config = variant(&w, "cert.toml", &cert_url, &cert_tls);
    let streamer = Running::start(&cert_config, &w.dir.join("cert.log"));
    send("by-certificate").await;
    let records = kafka::read_at_least(&w.topic, 1, 2, ARRIVAL).await;
    assert_eq!(records.iter().map(|r| r.payload_str()).collect::<Vec<_>>(), ["over-tls", "by-certificate"]);
    w.wait_drained(&table).await;
    wait_until("the certificate login's replication session", ARRIVAL, || async {
        let n: i64 =
            w.db.admin
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
                 WHERE a.usename = 'outbox_cert_client' AND a.backend_type = 'walsender' AND s.ssl \
                 AND s.client_dn = '/CN=outbox_cert_client'",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
        (n == 1).then_some(())
    })
    .await;
    assert!(streamer.stop());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_sql_and_binlog_sessions_are_encrypted_and_verified() {
    let w = World::mysql("mtls").config(&verify_full()).build().await;
    let user = w.streamer_url.split("://").nth(1).unwrap().split(':').next().unwrap().to_string();
    let mut admin = w.admin().await;
    admin.query_drop(format!("ALTER USER '{user}'@'127.0.0.1' REQUIRE SSL")).await.unwrap();

    let streamer = w.start("verify-full.log");
    admin
        .exec_drop(
            format!("INSERT INTO {} (topic, payload) VALUES (?, ?)", w.table(0, 0)),
            (&w.topic, b"over-tls".to_vec()),
        )
        .await
        .unwrap();
    let records = kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    assert_eq!(records[0].payload_str(), "over-tls");
    w.wait_drained(&w.table(0, 0)).await;
    let (ok, out, err) = run_cli(&w.config, &["status"]);
    assert!(ok, "status over TLS failed:\n{out}\n{err}");
    assert!(streamer.stop());

    // The user may not log in without TLS; the error names the login, never its password.
    let plain = rewrite(&w.config, &w.streamer_url, "plain.toml", &w.streamer_url, "");
    let (ok, out, err) = run_cli(&plain, &["status"]);
    assert!(!ok, "plaintext status succeeded:\n{out}");
    assert!(err.contains("Access denied"), "unexpected error:\n{err}");
    let password = w.streamer_url.split(':').nth(2).unwrap().split('@').next().unwrap();
    assert!(!err.contains(password), "the error shows the password:\n{err}");

    // A CA that did not sign the server's certificate.
    let (ok, out, err) =
        run_cli(&rewrite(&w.config, &w.streamer_url, "wrong-ca.toml", &w.streamer_url, &wrong_ca()), &["status"]);
    assert!(!ok, "status with the wrong CA succeeded:\n{out}");
    assert!(
        err.contains("UnknownIssuer") || err.contains("certificate"),
        "the error does not name the certificate:\n{err}"
    );
    admin.disconnect().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_ownership_runs_over_tls_with_a_client_certificate_and_a_wrong_ca_is_refused() {
    let cluster = crate::support::unique("ztls");
    // The server demands a client certificate (`ssl.clientAuth=need`).
    let coordination = format!(
        "\n[coordination]\nkind = \"zookeeper\"\nconnect = \"{}\"\ncluster_name = \"{cluster}\"\ninstance = \"tls-one\"\n\
         [coordination.tls]\nca_file = \"{}\"\ncert_file = \"{}\"\nkey_file = \"{}\"\n",
        env("OUTBOX_ZK_TLS_CONNECT"),
        tls_file("ca.pem"),
        tls_file("client.pem"),
        tls_file("client.key")
    );
    let w = World::postgres("ztls").config(&coordination).build().await;
    let table = w.table(0, 0);
    let streamer = w.start("zk-tls.log");
    w.db.admin
        .execute(
            &format!("INSERT INTO {table} (topic, payload) VALUES ($1, $2)"),
            &[&w.topic, &b"owned-over-tls".as_slice()],
        )
        .await
        .unwrap();
    let records = kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    assert_eq!(records[0].payload_str(), "owned-over-tls");
    assert!(!records[0].header("outbox-owner-epoch").is_empty(), "the record carries the lease's epoch");
    w.wait_drained(&table).await;
    let (ok, json, err) = run_cli(&w.config, &["status", "--json"]);
    assert!(ok, "status over ZooKeeper TLS failed:\n{json}\n{err}");
    let rows: Vec<serde_json::Value> = serde_json::from_str(&json).unwrap();
    assert_eq!(rows[0]["owner"].as_str(), Some("tls-one"), "{json}");

    // The same ensemble with a CA that did not sign its certificate: no session.
    let text = std::fs::read_to_string(&w.config).unwrap().replace(&tls_file("ca.pem"), &tls_file("other-ca.pem"));
    let wrong = w.dir.join("zk-wrong-ca.toml");
    std::fs::write(&wrong, text).unwrap();
    let (ok, out, err) = run_cli(&wrong, &["status"]);
    assert!(!ok, "status with the wrong ZooKeeper CA succeeded:\n{out}");
    assert!(err.contains("coordination"), "the error does not name the coordination settings:\n{err}");

    // The right CA but no client certificate: the server refuses the handshake.
    let text = std::fs::read_to_string(&w.config).unwrap();
    let without_cert: String = text
        .lines()
        .filter(|l| !l.starts_with("cert_file") && !l.starts_with("key_file"))
        .collect::<Vec<_>>()
        .join("\n");
    let no_cert = w.dir.join("zk-no-cert.toml");
    std::fs::write(&no_cert, without_cert).unwrap();
    let (ok, out, err) = run_cli(&no_cert, &["status"]);
    assert!(!ok, "status without a client certificate succeeded:\n{out}");
    assert!(err.contains("coordination"), "the error does not name the coordination settings:\n{err}");
    assert!(streamer.stop());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_records_travel_over_verified_tls_with_a_client_certificate() {
    let w = World::postgres("ktls").build().await;
    let table = w.table(0, 0);
    let tls_brokers = env("OUTBOX_KAFKA_TLS_BROKERS");
    let kafka_tls = format!(
        "[kafka.tls]\nca_file = \"{}\"\ncert_file = \"{}\"\nkey_file = \"{}\"\n\n[[source]]",
        tls_file("ca.pem"),
        tls_file("client.pem"),
        tls_file("client.key")
    );
    let text = std::fs::read_to_string(&w.config).unwrap().replace(&kafka::brokers(), &tls_brokers).replacen(
        "[[source]]",
        &kafka_tls,
        1,
    );
    let config = w.dir.join("kafka-tls.toml");
    std::fs::write(&config, &text).unwrap();
    // OUTBOX_KAFKA_BROKERS (set for the tests) would override the config's brokers.
    let brokers = [("OUTBOX_KAFKA_BROKERS", tls_brokers.clone())];
    let streamer = Running::start_with_env(&config, &w.dir.join("kafka-tls.log"), &brokers);
    w.db.admin
        .execute(&format!("INSERT INTO {table} (topic, payload) VALUES ($1, $2)"), &[&w.topic, &b"via-tls".as_slice()])
        .await
        .unwrap();
    let records = kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    assert_eq!(records[0].payload_str(), "via-tls");
    w.wait_drained(&table).await;
    assert!(streamer.stop());

    // The wrong CA: nothing is acknowledged, so the row stays, and the log says why.
    let wrong = w.dir.join("kafka-wrong-ca.toml");
    std::fs::write(&wrong, text.replace(&tls_file("ca.pem"), &tls_file("other-ca.pem"))).unwrap();
    let streamer = Running::start_with_env(&wrong, &w.dir.join("kafka-wrong-ca.log"), &brokers);
    w.db.admin
        .execute(&format!("INSERT INTO {table} (topic, payload) VALUES ($1, $2)"), &[&w.topic, &b"never".as_slice()])
        .await
        .unwrap();
    streamer.wait_for_log("certificate verify failed", ARRIVAL).await;
    assert_eq!(w.db.count(&table).await, 1, "the row stays until Kafka takes it");
    drop(streamer);
}
