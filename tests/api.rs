//! The transactional message API (docs/api.md) against real PostgreSQL, MariaDB and Kafka:
//! prepare → commit arrives once, in commit order with the outbox's other rows; rollback never
//! arrives; concurrent commit and rollback of one message — exactly one wins; idempotent
//! prepares; a streamer killed right after commits loses nothing; every malformed or
//! unauthorised request gets its 4xx; idle and surplus connections are closed.

use std::collections::HashSet;
use std::time::Duration;

use crate::support::api::{self, Client, OTHER_SECRET, SVC_SECRET};
use crate::support::database::{Database, Row};
use crate::support::metrics::free_addr;
use crate::support::streamer::Running;
use crate::support::world::{ARRIVAL, World};
use crate::support::{kafka, wait_until};

/// A world of two shards with the API on a free port; the streamer is started by the test.
async fn world<D: Database>(name: &str, extra: &str) -> (World<D>, std::net::SocketAddr) {
    let listen = free_addr();
    let w =
        crate::support::world::WorldBuilder::<D>::new(name).shards(2).config(&api::config(listen, extra)).build().await;
    (w, listen)
}

fn start<D: Database>(w: &World<D>, log: &str) -> Running {
    Running::start_with_env(&w.config, &w.dir.join(log), &api::env())
}

fn payload(text: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(text)
}

/// Rows written directly and messages committed through the API reach Kafka in commit order;
/// a rolled-back message never does; deciding twice is fine, deciding the other way is 409;
/// an idempotency key returns the same message before and after its commit; a batch is
/// prepared at once and its messages go in the order they are committed.
async fn commit_order_and_decisions<D: Database>() {
    let (w, listen) = world::<D>("api", "").await;
    // Everything at debug: still no payload, key, header or business key in the log.
    let mut env = api::env();
    env.push(("RUST_LOG", "debug".to_string()));
    let streamer = Running::start_with_env(&w.config, &w.dir.join("run.log"), &env);
    api::wait_until_serving(listen).await;
    let svc = Client::new(listen, SVC_SECRET);
    let topic = &w.topic;
    let mut db = w.db.connect().await;
    D::enqueue(&mut db, &w.prefix, &Row::new(topic, "A"), 0).await;
    let m1 = svc
        .prepare(&format!(
            r#"{{"topic": "{topic}", "key": "k1", "payload_base64": "{}", "headers": {{"trace": "t1", "x": "header-value-never-logged"}}, "business_key": "business-key-never-logged"}}"#,
            payload("M1")
        ))
        .await;
    let m2 = svc.prepare(&format!(r#"{{"topic": "{topic}", "payload_base64": "{}"}}"#, payload("M2"))).await;
    D::enqueue(&mut db, &w.prefix, &Row::new(topic, "B"), 0).await;
    let a = svc.decide(&m1, "commit").await;
    assert_eq!((a.status, a.body["state"].as_str()), (200, Some("committed")), "{a:?}");
    let m1_outbox_id = a.body["outbox_id"].as_str().expect("a commit names its outbox-id").to_string();
    let a = svc.decide(&m2, "rollback").await;
    assert_eq!((a.status, a.body["state"].as_str()), (200, Some("rolled_back")), "{a:?}");
    D::enqueue(&mut db, &w.prefix, &Row::new(topic, "C"), 0).await;
    let again = svc.decide(&m1, "commit").await;
    assert_eq!(again.status, 200, "committing twice is fine");
    assert_eq!(again.body["outbox_id"].as_str(), Some(m1_outbox_id.as_str()), "{again:?}");
    assert_eq!(svc.decide(&m2, "rollback").await.status, 200, "rolling back twice is fine");
    let a = svc.decide(&m1, "rollback").await;
    assert_eq!(a.status, 409, "{a:?}");
    assert!(a.error().contains("committed already"), "{a:?}");
    let a = svc.decide(&m2, "commit").await;
    assert_eq!(a.status, 409, "{a:?}");
    assert!(a.error().contains("rolled_back already"), "{a:?}");
    let got = svc.get(&format!("/v1/messages/{m1}")).await;
    assert_eq!(got.status, 200, "{got:?}");
    assert_eq!(got.body["state"], "committed");
    assert_eq!(got.body["business_key"], "business-key-never-logged");
    assert!(got.body["decided_at"].as_str().is_some_and(|t| t.ends_with('Z')), "{got:?}");
    assert_eq!(svc.get(&format!("/v1/messages/{m2}")).await.body["state"], "rolled_back");

    // Idempotent prepare: the same key names the same message, before and after its commit.
    let body = format!(r#"{{"topic": "{topic}", "payload_base64": "{}", "idempotency_key": "idem-1"}}"#, payload("I1"));
    let first = svc.post("/v1/messages", &body).await;
    assert_eq!((first.status, first.body["created"].as_bool()), (201, Some(true)), "{first:?}");
    let again = svc.post("/v1/messages", &body).await;
    assert_eq!((again.status, again.body["created"].as_bool()), (200, Some(false)), "{again:?}");
    assert_eq!(again.id(), first.id());
    assert_eq!(svc.decide(&first.id(), "commit").await.status, 200);
    let after = svc.post("/v1/messages", &body).await;
    assert_eq!((after.status, after.id(), after.body["state"].as_str()), (200, first.id(), Some("committed")));

    // A batch: prepared together, published in the order its messages are committed.
    let batch = format!(
        r#"{{"messages": [{{"topic": "{topic}", "payload_base64": "{}"}}, {{"topic": "{topic}", "payload_base64": "{}"}}, {{"topic": "{topic}", "payload_base64": "{}", "shard": 1}}]}}"#,
        payload("X1"),
        payload("X2"),
        payload("Y1")
    );
    let a = svc.post("/v1/messages", &batch).await;
    assert_eq!(a.status, 201, "{a:?}");
    let ids: Vec<String> =
        a.body["messages"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap().to_string()).collect();
    assert_eq!(ids.len(), 3);
    for id in [&ids[1], &ids[0], &ids[2]] {
        assert_eq!(svc.decide(id, "commit").await.status, 200);
    }

    // An asynchronous commit: 202 at once, committed right after; an unknown id and the other
    // decision get what a synchronous call would.
    let a1 = svc.prepare(&format!(r#"{{"topic": "{topic}", "payload_base64": "{}"}}"#, payload("A1"))).await;
    let a = svc.post(&format!("/v1/messages/{a1}/commit?async=true"), "").await;
    assert_eq!((a.status, a.body["state"].as_str()), (202, Some("deciding")), "{a:?}");
    wait_until("the asynchronous commit", ARRIVAL, || async {
        (svc.get(&format!("/v1/messages/{a1}")).await.body["state"] == "committed").then_some(())
    })
    .await;
    assert_eq!(svc.post("/v1/messages/999999999/commit?async=true", "").await.status, 404);
    assert_eq!(svc.post(&format!("/v1/messages/{a1}/rollback?async=true"), "").await.status, 409);
    assert_eq!(svc.post(&format!("/v1/messages/{a1}/commit?async=true"), "").await.status, 200);

    let records = kafka::read_at_least(topic, 1, 9, ARRIVAL).await;
    let payloads: Vec<String> = records.iter().map(|r| r.payload_str()).collect();
    let shard0: Vec<&str> = records
        .iter()
        .filter(|r| r.header("outbox-shard") == "0")
        .map(|r| r.payload.as_deref().map_or("", |p| std::str::from_utf8(p).unwrap()))
        .collect();
    assert_eq!(
        shard0,
        ["A", "B", "M1", "C", "I1", "X2", "X1", "A1"],
        "shard 0 in commit order, once each: {payloads:?}"
    );
    assert!(payloads.contains(&"Y1".to_string()), "{payloads:?}");
    assert_eq!(records.len(), 9, "nothing else, nothing twice: {payloads:?}");
    let m1_record = records.iter().find(|r| r.payload_str() == "M1").unwrap();
    assert_eq!(m1_record.key_str(), "k1");
    assert_eq!(m1_record.header("trace"), "t1");
    assert_eq!(m1_record.header("outbox-id"), m1_outbox_id, "the commit's answer names the record's outbox-id");
    for s in 0..2 {
        let table = w.table(s, 0);
        wait_until("the published rows to be deleted", ARRIVAL, || async {
            (w.db.count(&table).await == 0).then_some(())
        })
        .await;
    }
    let log = streamer.log_text();
    for secret in ["header-value-never-logged", "business-key-never-logged", SVC_SECRET] {
        assert!(!log.contains(secret), "{secret} is in the debug log");
    }
    assert!(streamer.stop(), "clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_commits_arrive_in_commit_order_and_rollbacks_never() {
    commit_order_and_decisions::<crate::support::pg::PgDb>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_commits_arrive_in_commit_order_and_rollbacks_never() {
    commit_order_and_decisions::<crate::support::mysql::MyDb>().await;
}

/// Each of 40 messages is committed and rolled back at the same moment: exactly one of the two
/// wins (200) and the other is told so (409); Kafka gets exactly the committed ones. Then
/// messages committed just before a SIGKILL all arrive after the restart.
async fn races_and_a_kill<D: Database>() {
    let (w, listen) = world::<D>("api_race", "db_connections = 16").await;
    let streamer = start(&w, "run.log");
    api::wait_until_serving(listen).await;
    let svc = Client::new(listen, SVC_SECRET);
    let topic = w.topic.clone();
    let messages: Vec<String> = (0..40)
        .map(|i| format!(r#"{{"topic": "{topic}", "payload_base64": "{}"}}"#, payload(&format!("r{i}"))))
        .collect();
    let a = svc.post("/v1/messages", &format!(r#"{{"messages": [{}]}}"#, messages.join(","))).await;
    assert_eq!(a.status, 201, "{a:?}");
    let ids: Vec<String> =
        a.body["messages"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap().to_string()).collect();
    let mut races = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let (c1, c2, id1, id2) = (svc.clone(), svc.clone(), id.clone(), id.clone());
        races.push(tokio::spawn(async move {
            let (commit, rollback) = tokio::join!(c1.decide(&id1, "commit"), c2.decide(&id2, "rollback"));
            (i, commit.status, rollback.status)
        }));
    }
    let mut committed = HashSet::new();
    for race in races {
        let (i, commit, rollback) = race.await.unwrap();
        match (commit, rollback) {
            (200, 409) => {
                committed.insert(format!("r{i}"));
            }
            (409, 200) => {}
            other => panic!("message r{i}: commit and rollback answered {other:?}; exactly one must win"),
        }
    }
    // A marker committed last: once it is read, everything committed before it was too.
    let marker = svc.prepare(&format!(r#"{{"topic": "{topic}", "payload_base64": "{}"}}"#, payload("end"))).await;
    assert_eq!(svc.decide(&marker, "commit").await.status, 200);
    let mut expected = committed.clone();
    expected.insert("end".into());
    let records = kafka::read_until_payloads(&topic, 1, &expected, ARRIVAL).await;
    let got: Vec<String> = records.iter().map(|r| r.payload_str()).collect();
    assert_eq!(got.len(), expected.len(), "each committed message once, no rolled-back one: {got:?}");

    // Commits right before a SIGKILL: every one arrives once the streamer is back.
    let mut killed = HashSet::new();
    for i in 0..20 {
        let id =
            svc.prepare(&format!(r#"{{"topic": "{topic}", "payload_base64": "{}"}}"#, payload(&format!("k{i}")))).await;
        assert_eq!(svc.decide(&id, "commit").await.status, 200);
        killed.insert(format!("k{i}"));
    }
    streamer.kill();
    let again = start(&w, "run2.log");
    let records = kafka::read_until_payloads(&topic, 1, &killed, ARRIVAL).await;
    let arrived: HashSet<String> = records.iter().map(|r| r.payload_str()).filter(|p| p.starts_with('k')).collect();
    assert_eq!(arrived, killed);
    assert!(again.stop(), "clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_a_commit_racing_a_rollback_has_one_winner_and_a_kill_loses_nothing() {
    races_and_a_kill::<crate::support::pg::PgDb>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_a_commit_racing_a_rollback_has_one_winner_and_a_kill_loses_nothing() {
    races_and_a_kill::<crate::support::mysql::MyDb>().await;
}

/// Every malformed, oversized or unauthorised request is refused with its 4xx and a message
/// that names what is wrong; nothing is prepared by any of them; another token's message is
/// not found; idle connections are closed after `header_timeout_ms` and connections past
/// `max_connections` at once; the API keeps serving throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_bad_requests_get_their_4xx_and_stalled_connections_are_closed() {
    let limits = "max_body_bytes = 2048\nmax_batch = 3\nmax_connections = 4\nheader_timeout_ms = 3000\nrequest_timeout_ms = 1500\ndb_connections = 2";
    let (w, listen) = world::<crate::support::pg::PgDb>("api_bad", limits).await;
    let streamer = start(&w, "run.log");
    api::wait_until_serving(listen).await;
    let topic = &w.topic;
    let svc = Client::new(listen, SVC_SECRET);
    let other = Client::new(listen, OTHER_SECRET);
    let nobody = Client { addr: listen, secret: None };
    let forged = Client::new(listen, "svc-secret-0123456789abcdeX");
    let ok = format!(r#"{{"topic": "{topic}", "payload": {{"n": 1}}}}"#);
    let cases: Vec<(&Client, &str, &str, String, u16, &str)> = vec![
        (&nobody, "POST", "/v1/messages", ok.clone(), 401, "Bearer"),
        (&forged, "POST", "/v1/messages", ok.clone(), 401, "Bearer"),
        (&svc, "POST", "/v1/messages", "{".into(), 400, "not JSON"),
        (&svc, "POST", "/v1/messages", format!(r#"{{"topic": "{topic}", "colour": 1}}"#), 400, "unknown field"),
        (&svc, "POST", "/v1/messages", r#"{"topic": "payments"}"#.into(), 403, "may not prepare to topic"),
        (&svc, "POST", "/v1/messages", format!(r#"{{"topic": "{topic}", "shard": 7}}"#), 400, "shard 7 does not exist"),
        (&other, "POST", "/v1/messages", format!(r#"{{"topic": "{topic}", "shard": 0}}"#), 403, "shard 0"),
        (
            &svc,
            "POST",
            "/v1/messages",
            format!(r#"{{"topic": "{topic}", "headers": {{"outbox-id": "1"}}}}"#),
            400,
            "streamer's own",
        ),
        (
            &svc,
            "POST",
            "/v1/messages",
            format!(r#"{{"topic": "{topic}", "business_key": "b", "checkback_url": "http://169.254.169.254/cb/"}}"#),
            403,
            "checkback_urls",
        ),
        (
            &svc,
            "POST",
            "/v1/messages",
            format!(r#"{{"topic": "{topic}", "payload": "{}"}}"#, "x".repeat(4000)),
            413,
            "max_body_bytes",
        ),
        (&svc, "POST", "/v1/messages", format!(r#"{{"messages": [{ok}, {ok}, {ok}, {ok}]}}"#), 413, "max_batch"),
        (&svc, "GET", "/v1/messages", String::new(), 405, "use POST"),
        (&svc, "DELETE", "/v1/messages/1", String::new(), 405, "use GET"),
        (&svc, "GET", "/v1/messages/abc", String::new(), 404, "no message"),
        (&svc, "GET", "/admin", String::new(), 404, "no endpoint"),
        (&svc, "POST", "/v1/messages/1/approve", String::new(), 404, "no endpoint"),
    ];
    for (client, method, path, body, status, words) in &cases {
        let a = client.call(method, path, Some(body)).await;
        assert_eq!(a.status, *status, "{method} {path} {body:.80}: {a:?}");
        assert!(a.error().contains(words), "{method} {path}: {a:?}");
    }
    // The wrong content type.
    let text = api::raw(
        listen,
        format!(
            "POST /v1/messages HTTP/1.1\r\nHost: t\r\nConnection: close\r\nAuthorization: Bearer {SVC_SECRET}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\r\n{ok}",
            ok.len()
        )
        .as_bytes(),
    )
    .await;
    assert_eq!(api::parse(&text).status, 415, "{text}");
    // Malformed HTTP and an oversized head get an HTTP error, not a crash.
    let text = api::raw(listen, b"NOT HTTP AT ALL\r\n\r\n").await;
    assert!(text.starts_with("HTTP/1.1 400"), "{text:?}");
    // (The server stops reading at 16 KiB; the unread rest may turn its close into a reset.)
    let big_head = format!("GET /v1/messages/1 HTTP/1.1\r\nHost: t\r\nX-Pad: {}\r\n\r\n", "p".repeat(20 * 1024));
    if let Ok(text) = api::try_raw(listen, big_head.as_bytes()).await {
        assert!(text.starts_with("HTTP/1.1 431"), "{text:.200}");
    }
    // Nothing above was prepared.
    let prepared = w.db.count(&format!("{}_api_message", w.prefix)).await;
    assert_eq!(prepared, 0, "no refused request stored a message");

    // Another token can neither see nor decide svc's message.
    let id = svc.prepare(&ok).await;
    assert_eq!(other.get(&format!("/v1/messages/{id}")).await.status, 404);
    assert_eq!(other.decide(&id, "commit").await.status, 404);
    assert_eq!(svc.get(&format!("/v1/messages/{id}")).await.body["state"], "prepared");

    // A message whose row another session holds: its commit times out (503) — and leaves no
    // session of the API stuck behind the lock: every other call is answered meanwhile.
    let locked = svc.prepare(&ok).await;
    let holder = w.db.connect().await;
    holder.batch_execute("BEGIN").await.unwrap();
    holder
        .execute(
            &format!("SELECT 1 FROM {}_api_message WHERE id = $1 FOR UPDATE", w.prefix),
            &[&locked.parse::<i64>().unwrap()],
        )
        .await
        .unwrap();
    assert_eq!(svc.decide(&locked, "commit").await.status, 503, "a commit held up by a lock times out");
    for _ in 0..5 {
        assert_eq!(svc.get(&format!("/v1/messages/{id}")).await.status, 200, "other calls are answered");
        svc.prepare(&ok).await;
    }
    holder.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(svc.decide(&locked, "commit").await.status, 200, "the commit goes through once the lock is gone");

    // An idle connection is closed after header_timeout_ms; a fifth one beyond the four
    // idle ones is closed at once; once they are gone the API answers again.
    let mut idle = Vec::new();
    for _ in 0..4 {
        idle.push(tokio::net::TcpStream::connect(listen).await.unwrap());
    }
    let surplus = api::try_raw(listen, format!("GET /v1/messages/{id} HTTP/1.1\r\nHost: t\r\n\r\n").as_bytes()).await;
    assert!(
        surplus.as_ref().is_ok_and(String::is_empty) || surplus.is_err(),
        "a connection past max_connections is closed unanswered: {surplus:?}"
    );
    for mut conn in idle {
        use tokio::io::AsyncReadExt;
        let mut buf = [0u8; 64];
        let read = tokio::time::timeout(Duration::from_secs(20), conn.read(&mut buf)).await;
        assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "an idle connection is closed by the server: {read:?}");
    }
    wait_until("the API to answer again", ARRIVAL, || async {
        (svc.get(&format!("/v1/messages/{id}")).await.status == 200).then_some(())
    })
    .await;
    let metrics = crate::support::metrics::try_get(streamer.metrics_addr(), "/metrics").await.unwrap();
    let refused = crate::support::metrics::sample(&metrics, "outbox_api_requests_total", &[("status", "401")]);
    assert!(refused.is_some_and(|n| n >= 2.0), "401s counted:\n{metrics}");
    assert!(!streamer.log_text().contains(SVC_SECRET), "a secret in the log");
    assert!(streamer.stop(), "clean stop");
}

/// `setup` refuses an `[api]` naming a missing source or a source of another layout, and a
/// token without a secret fails `run` at once naming the setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_wrong_api_settings_are_named() {
    let listen = free_addr();
    let w = World::postgres("apicfg").shards(2).build().await;
    let text = std::fs::read_to_string(&w.config).unwrap();
    let bad = w.dir.join("bad.toml");
    std::fs::write(
        &bad,
        format!("{text}\n{}", api::config(listen, "").replace("source = \"test\"", "source = \"nope\"")),
    )
    .unwrap();
    let (ok, _, err) = crate::support::streamer::run_cli(&bad, &["config"]);
    assert!(!ok && err.contains("api.source") && err.contains("nope"), "{err}");
    std::fs::write(&bad, format!("{text}\n{}", api::config(listen, ""))).unwrap();
    let run = Running::start(&bad, &w.dir.join("nosecret.log"));
    let log = run.wait_for_log("TEST_API_SVC", ARRIVAL).await;
    assert!(log.contains("api.token[0].secret_env"), "{log}");
}

/// With `[api.tls]` and a client CA: a caller with a certificate the CA signed prepares and
/// commits over TLS; one without a certificate, one that does not trust the server's CA and
/// one speaking plain HTTP get no answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_the_api_serves_tls_and_demands_a_client_certificate() {
    let tls = |name: &str| format!("{}/{name}", crate::support::env("OUTBOX_TLS_DIR"));
    let section = format!(
        "[api.tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\nclient_ca_file = \"{}\"",
        tls("server.pem"),
        tls("server.key"),
        tls("ca.pem")
    );
    // `[api.tls]` must come after the `[api]` keys and before the tokens.
    let listen = free_addr();
    let config = api::config(listen, "").replacen("\n[[api.token]]", &format!("\n{section}\n\n[[api.token]]"), 1);
    let w = crate::support::world::WorldBuilder::<crate::support::pg::PgDb>::new("api_tls")
        .shards(2)
        .config(&config)
        .build()
        .await;
    let streamer = start(&w, "run.log");
    let trusted = api::tls_connector(&tls("ca.pem"), Some((&tls("client.pem"), &tls("client.key"))));
    let prepare = api::request_bytes(
        "POST",
        "/v1/messages",
        &format!(r#"{{"topic": "{}", "payload_base64": "{}"}}"#, w.topic, payload("T1")),
    );
    let answer = wait_until("the API to answer over TLS", ARRIVAL, || async {
        api::try_tls(listen, &trusted, &prepare).await.ok().map(|text| api::parse(&text))
    })
    .await;
    assert_eq!(answer.status, 201, "{answer:?}");
    let commit = api::request_bytes("POST", &format!("/v1/messages/{}/commit", answer.id()), "");
    let done = api::parse(&api::try_tls(listen, &trusted, &commit).await.unwrap());
    assert_eq!(done.status, 200, "{done:?}");
    let records = kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    assert_eq!(records[0].payload_str(), "T1");

    let unanswered = |r: &std::io::Result<String>| r.as_ref().map_or(true, |t| !t.starts_with("HTTP/"));
    let anonymous = api::tls_connector(&tls("ca.pem"), None);
    let r = api::try_tls(listen, &anonymous, &prepare).await;
    assert!(unanswered(&r), "no client certificate, no answer: {r:?}");
    let distrustful = api::tls_connector(&tls("other-ca.pem"), Some((&tls("client.pem"), &tls("client.key"))));
    let r = api::try_tls(listen, &distrustful, &prepare).await;
    assert!(r.is_err(), "a server the client cannot verify: {r:?}");
    let r = api::try_raw(listen, &prepare).await;
    assert!(unanswered(&r), "plain HTTP gets no HTTP answer: {r:?}");
    assert_eq!(w.db.count(&format!("{}_api_message", w.prefix)).await, 1, "only the trusted caller's message");
    assert!(streamer.stop(), "clean stop");
}

/// Messages left prepared are checked back at their service: its commit and rollback answers
/// are taken, `unknown` is asked again and then honoured, and a message never decided is given
/// up after `max_checks` — rolled back or left prepared, as `after_max_checks` says — with an
/// ERROR; a message without a check-back URL is never asked about. The check-back
/// authenticates with the token's secret.
async fn check_back<D: Database>(after: &str) {
    let caller = api::Caller::start().await;
    let listen = free_addr();
    let extra = format!("check_after_s = 1\ncheckback_retry_s = 1\nmax_checks = 3\nafter_max_checks = \"{after}\"");
    let w = crate::support::world::WorldBuilder::<D>::new("api_cb")
        .shards(2)
        .config(&api::config_checking_back(listen, &extra, &[&caller.prefix()]))
        .build()
        .await;
    let streamer = start(&w, "run.log");
    api::wait_until_serving(listen).await;
    let svc = Client::new(listen, SVC_SECRET);
    let topic = &w.topic;
    let mut ids = std::collections::BTreeMap::new();
    for key in ["commit-1", "rollback-1", "later-1", "never-1", "silent-1"] {
        let body = format!(
            r#"{{"topic": "{topic}", "payload_base64": "{}", "business_key": "{key}", "checkback_url": "{}"}}"#,
            payload(key),
            caller.url()
        );
        ids.insert(key, svc.prepare(&body).await);
    }
    let plain = svc.prepare(&format!(r#"{{"topic": "{topic}", "payload_base64": "{}"}}"#, payload("plain"))).await;
    let given_up = if after == "rollback" { "rolled_back" } else { "prepared" };
    let want = [
        ("commit-1", "committed", 0),
        ("rollback-1", "rolled_back", 0),
        ("later-1", "committed", 1),
        ("never-1", given_up, 3),
        ("silent-1", given_up, 3),
    ];
    wait_until("every checked-back message to reach its state", ARRIVAL, || async {
        for (key, state, checks) in want {
            let a = svc.get(&format!("/v1/messages/{}", ids[key])).await;
            if a.body["state"] != state || a.body["checks"] != checks {
                return None;
            }
        }
        Some(())
    })
    .await;
    let expected: HashSet<String> = ["commit-1", "later-1"].map(String::from).into();
    let records = kafka::read_until_payloads(topic, 1, &expected, ARRIVAL).await;
    let got: Vec<String> = records.iter().map(|r| r.payload_str()).collect();
    assert_eq!(got.len(), 2, "only the committed ones, once: {got:?}");
    let asked = caller.ids_asked();
    assert_eq!(asked.iter().filter(|i| **i == ids["never-1"]).count(), 3, "asked max_checks times: {asked:?}");
    assert!(!asked.contains(&plain), "a message without a check-back URL is never asked about");
    let plain_now = svc.get(&format!("/v1/messages/{plain}")).await;
    assert_eq!((plain_now.body["state"].as_str(), plain_now.body["checks"].as_i64()), (Some("prepared"), Some(0)));
    let auth = format!("Bearer {SVC_SECRET}");
    assert!(caller.asked.lock().unwrap().iter().all(|(a, _)| *a == auth), "the check-back authenticates");
    streamer.wait_for_metric("outbox_api_checkbacks_total", &[("outcome", "given_up")], 2.0, ARRIVAL).await;
    streamer.wait_for_metric("outbox_api_oldest_prepared_seconds", &[], 1.0, ARRIVAL).await;
    let log = streamer.log_text();
    assert!(log.contains("check-backs decided nothing"), "an ERROR names the given-up messages:\n{log}");
    let (_, status, _) = crate::support::streamer::run_cli_code(&w.config, &["status"]);
    let shown =
        if after == "rollback" { "1 prepared (the oldest".to_string() } else { "3 prepared (the oldest".to_string() };
    assert!(status.contains(&format!("message API (source \"test\"): {shown}")), "status shows the API:\n{status}");
    let decided = if after == "rollback" { "2 committed and 3 rolled back" } else { "2 committed and 1 rolled back" };
    assert!(status.contains(decided), "{status}");
    assert_eq!(status.contains("2 given up by the check-back"), after == "leave", "{status}");
    assert!(!log.contains(SVC_SECRET), "no secret in the log");
    assert!(streamer.stop(), "clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_a_message_left_prepared_is_checked_back_and_rolled_back_after_max_checks() {
    check_back::<crate::support::pg::PgDb>("rollback").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_a_message_left_prepared_is_checked_back_and_left_after_max_checks() {
    check_back::<crate::support::mysql::MyDb>("leave").await;
}

/// Two instances under ZooKeeper serve the API over one database: exactly one runs the
/// check-back; once it is killed, the other takes it over.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_two_instances_run_one_check_back_and_the_survivor_takes_over() {
    let caller = api::Caller::start().await;
    let (first, second) = (free_addr(), free_addr());
    let coordination = crate::support::cluster::coordination(
        &crate::support::unique("apicb"),
        &crate::support::env("OUTBOX_ZK_CONNECT"),
    );
    let extra = "check_after_s = 1\ncheckback_retry_s = 1";
    let config = format!("{}\n{coordination}", api::config_checking_back(first, extra, &[&caller.prefix()]));
    let w = crate::support::world::WorldBuilder::<crate::support::pg::PgDb>::new("api_two")
        .shards(2)
        .config(&config)
        .build()
        .await;
    let other = crate::support::cluster::config_with(&w.config, &first.to_string(), &second.to_string(), "second.toml");
    let a = start(&w, "a.log");
    let b = Running::start_with_env(&other, &w.dir.join("b.log"), &api::env());
    api::wait_until_serving(first).await;
    api::wait_until_serving(second).await;
    let body = |key: &str| {
        format!(
            r#"{{"topic": "{}", "payload_base64": "{}", "business_key": "{key}", "checkback_url": "{}"}}"#,
            w.topic,
            payload(key),
            caller.url()
        )
    };
    let (ca, cb) = (Client::new(first, SVC_SECRET), Client::new(second, SVC_SECRET));
    let mut ids = Vec::new();
    for i in 0..6 {
        let client = if i % 2 == 0 { &ca } else { &cb };
        ids.push(client.prepare(&body(&format!("commit-{i}"))).await);
    }
    let all_committed = |ids: Vec<String>, client: Client| async move {
        wait_until("every message to be committed by the check-back", ARRIVAL, || async {
            for id in &ids {
                if client.get(&format!("/v1/messages/{id}")).await.body["state"] != "committed" {
                    return None;
                }
            }
            Some(())
        })
        .await
    };
    all_committed(ids.clone(), ca.clone()).await;
    let committed = |run: &Running| {
        let run_metrics = run.metrics_addr();
        async move {
            let text = crate::support::metrics::try_get(run_metrics, "/metrics").await.unwrap_or_default();
            crate::support::metrics::sample(&text, "outbox_api_checkbacks_total", &[("outcome", "committed")])
                .unwrap_or(0.0)
        }
    };
    let (na, nb) = (committed(&a).await, committed(&b).await);
    assert_eq!(na + nb, 6.0, "each message decided once: {na} + {nb}");
    assert!(na == 0.0 || nb == 0.0, "one instance asks: {na} and {nb}");
    let (survivor, survivor_client) = if na > 0.0 {
        a.kill();
        (b, cb)
    } else {
        b.kill();
        (a, ca)
    };
    let mut later = Vec::new();
    for i in 6..9 {
        later.push(survivor_client.prepare(&body(&format!("commit-{i}"))).await);
    }
    all_committed(later, survivor_client.clone()).await;
    assert!(committed(&survivor).await >= 3.0, "the survivor took the check-back over");
    assert!(survivor.stop(), "clean stop");
}

/// On a MariaDB database whose default collation ignores case, accents and trailing spaces,
/// idempotency keys that differ only so are different messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_idempotency_keys_are_compared_byte_for_byte() {
    let listen = free_addr();
    let w = crate::support::world::WorldBuilder::<crate::support::mysql::MyDb>::new("api_keys")
        .shards(2)
        .before_setup("ALTER DATABASE CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci")
        .config(&api::config(listen, ""))
        .build()
        .await;
    let streamer = start(&w, "run.log");
    api::wait_until_serving(listen).await;
    let svc = Client::new(listen, SVC_SECRET);
    let mut ids = HashSet::new();
    for key in ["Order-7", "order-7", "ordér-7", "order-7 "] {
        let body = format!(r#"{{"topic": "{}", "idempotency_key": "{key}"}}"#, w.topic);
        let a = svc.post("/v1/messages", &body).await;
        assert_eq!((a.status, a.body["created"].as_bool()), (201, Some(true)), "{key:?}: {a:?}");
        ids.insert(a.id());
    }
    assert_eq!(ids.len(), 4, "four keys, four messages");
    assert!(streamer.stop(), "clean stop");
}

/// `teardown` leaves the message API's table while it holds a prepared message — and with it
/// the enqueue routine a commit needs — and drops it (revoking its grants on MariaDB) with
/// `--drop-pending`.
async fn teardown_keeps_prepared_messages<D: Database>() {
    let listen = free_addr();
    let w = crate::support::world::WorldBuilder::<D>::new("api_td")
        .shards(2)
        .config(&api::config(listen, ""))
        .build()
        .await;
    let streamer = start(&w, "run.log");
    api::wait_until_serving(listen).await;
    let svc = Client::new(listen, SVC_SECRET);
    let body = |p: &str| format!(r#"{{"topic": "{}", "payload_base64": "{}"}}"#, w.topic, payload(p));
    svc.prepare(&body("left")).await;
    let sent = svc.prepare(&body("sent")).await;
    assert_eq!(svc.decide(&sent, "commit").await.status, 200);
    kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    let table = w.table(0, 0);
    wait_until("the committed row to be deleted", ARRIVAL, || async { (w.db.count(&table).await == 0).then_some(()) })
        .await;
    assert!(streamer.stop(), "clean stop");
    let teardown = |flags: &[&str]| {
        let mut args = vec!["teardown", "--admin-url", w.db.admin_url()];
        args.extend_from_slice(flags);
        let (ok, out, err) = crate::support::streamer::run_cli(&w.config, &args);
        (ok, format!("{out}{err}"))
    };
    let api_table = format!("{}_api_message", w.prefix);
    // A stopped streamer's binlog dump threads may linger a moment on MariaDB.
    let (ok, out) = wait_until("the stopped streamer's sessions to end", ARRIVAL, || async {
        let (ok, out) = teardown(&["--yes"]);
        (!out.contains("a streamer is running")).then_some((ok, out))
    })
    .await;
    assert!(!ok, "{out}");
    assert!(out.contains(&format!("left message API table \"{api_table}\" (1 message still prepared)")), "{out}");
    assert!(
        out.contains(&format!("table \"{api_table}\" remains and still needs them")),
        "the enqueue routine stays:\n{out}"
    );
    let (ok, out) = teardown(&["--yes", "--drop-pending"]);
    assert!(ok, "{out}");
    assert!(out.contains(&format!("dropped message API table \"{api_table}\" (1 message still prepared)")), "{out}");
    if D::KIND == "mysql" {
        assert!(out.contains(&format!("on \"{api_table}\"")), "its grants are revoked:\n{out}");
    }
    assert!(out.contains("teardown complete: nothing that setup creates is left"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_teardown_keeps_the_message_table_while_a_message_is_prepared() {
    teardown_keeps_prepared_messages::<crate::support::pg::PgDb>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_teardown_keeps_the_message_table_while_a_message_is_prepared() {
    teardown_keeps_prepared_messages::<crate::support::mysql::MyDb>().await;
}
