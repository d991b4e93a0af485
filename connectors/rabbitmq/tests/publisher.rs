//! The publisher against the real RabbitMQ that `scripts/services up` starts
//! (`OUTBOX_RABBITMQ_URL`, `OUTBOX_RABBITMQ_TLS_URL`, `OUTBOX_TLS_DIR` from `scripts/services env`).

use std::time::Duration;

use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use outbox_rabbitmq::{Class, Message, Offer, Publisher, PublisherSettings};

const DEADLINE: Duration = Duration::from_secs(30);

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set: run `eval \"$(scripts/services env)\"` first"))
}

fn settings(uri: String, ca_pem: Option<String>) -> PublisherSettings {
    PublisherSettings {
        uri,
        ca_pem,
        identity: None,
        confirm_window: 64,
        confirm_timeout: Duration::from_secs(30),
        max_queued: Duration::from_secs(30),
        connect_timeout: Duration::from_secs(10),
        connection_name: "outbox-rabbitmq test".into(),
    }
}

/// A durable direct exchange and an exclusive queue bound to it with routing key `k`.
async fn topology(name: &str) -> (Connection, Channel, String) {
    let conn = Connection::connect(&env("OUTBOX_RABBITMQ_URL"), ConnectionProperties::default()).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    let durable = ExchangeDeclareOptions { durable: true, ..Default::default() };
    ch.exchange_declare(name.into(), ExchangeKind::Direct, durable, FieldTable::default()).await.unwrap();
    let queue = format!("{name}-q");
    let exclusive = QueueDeclareOptions { exclusive: true, ..Default::default() };
    ch.queue_declare(queue.as_str().into(), exclusive, FieldTable::default()).await.unwrap();
    ch.queue_bind(queue.as_str().into(), name.into(), "k".into(), QueueBindOptions::default(), FieldTable::default())
        .await
        .unwrap();
    (conn, ch, queue)
}

async fn publish(
    p: &Publisher,
    exchange: &str,
    routing_key: &str,
    payload: &str,
) -> Result<(), outbox_rabbitmq::PublishError> {
    let id = format!("id-{payload}");
    let headers: [(&str, &[u8]); 2] = [("outbox-id", payload.as_bytes()), ("app", b"h")];
    let m = Message {
        exchange,
        routing_key,
        payload: payload.as_bytes(),
        message_id: &id,
        headers: &headers,
        timestamp_s: None,
    };
    let confirm = loop {
        match p.send(&m) {
            Ok(c) => break c,
            Err(Offer::Full) => p.room().await,
            Err(Offer::Refused(e)) => return Err(e),
        }
    };
    tokio::time::timeout(DEADLINE, confirm).await.expect("a confirm within the deadline").expect("the task answers")
}

/// Many messages without waiting for each: all confirmed, delivered in order, persistent, with
/// their message id and headers.
#[tokio::test]
async fn messages_are_confirmed_and_arrive_in_order_with_their_headers() {
    let name = format!("outbox-test-order-{}", std::process::id());
    let (_conn, ch, queue) = topology(&name).await;
    let p = Publisher::new(settings(env("OUTBOX_RABBITMQ_URL"), None));
    const N: usize = 500;
    let mut confirms = Vec::new();
    for i in 0..N {
        let payload = format!("m{i}");
        let id = format!("id-{payload}");
        let headers: [(&str, &[u8]); 1] = [("outbox-id", payload.as_bytes())];
        let m = Message {
            exchange: &name,
            routing_key: "k",
            payload: payload.as_bytes(),
            message_id: &id,
            headers: &headers,
            timestamp_s: None,
        };
        loop {
            match p.send(&m) {
                Ok(c) => {
                    confirms.push(c);
                    break;
                }
                Err(Offer::Full) => p.room().await,
                Err(Offer::Refused(e)) => panic!("refused: {e}"),
            }
        }
    }
    for c in confirms {
        tokio::time::timeout(DEADLINE, c).await.unwrap().unwrap().unwrap();
    }
    let mut consumer = ch
        .basic_consume(queue.as_str().into(), "t".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .unwrap();
    for i in 0..N {
        let d = tokio::time::timeout(DEADLINE, consumer.next()).await.unwrap().unwrap().unwrap();
        assert_eq!(d.data, format!("m{i}").as_bytes(), "publish order");
        assert_eq!(d.properties.delivery_mode(), &Some(2), "persistent");
        assert_eq!(d.properties.message_id().as_ref().map(|s| s.as_str().to_string()), Some(format!("id-m{i}")));
        let headers = d.properties.headers().clone().unwrap();
        assert!(
            matches!(headers.inner().get("outbox-id"), Some(AMQPValue::LongString(v)) if v.as_bytes() == format!("m{i}").as_bytes())
        );
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
}

/// An unroutable message comes back as a definite failure and leaves the channel usable; a
/// missing exchange is definite too (the broker closes the channel). Alone, it holds nothing
/// back: the next message goes out on a new channel. With messages sent after it, those fail
/// (transient: not at fault) and so does everything until the reset, so none of them can be
/// confirmed before it is resent.
#[tokio::test]
async fn unroutable_and_missing_exchange_are_definite_and_the_publisher_recovers() {
    let name = format!("outbox-test-fail-{}", std::process::id());
    let (_conn, ch, queue) = topology(&name).await;
    let p = Publisher::new(settings(env("OUTBOX_RABBITMQ_URL"), None));
    assert_eq!(p.exchange_exists(&name).await, Some(true));
    assert_eq!(p.exchange_exists("outbox-test-no-such-exchange").await, Some(false));
    publish(&p, &name, "k", "a").await.unwrap();
    let e = publish(&p, &name, "nobody-listens", "x").await.unwrap_err();
    assert_eq!(e.class, Class::Unroutable, "{e}");
    assert!(e.to_string().contains("NO_ROUTE"), "{e}");
    publish(&p, &name, "k", "b").await.unwrap();
    let e = publish(&p, "outbox-test-no-such-exchange", "k", "y").await.unwrap_err();
    assert_eq!(e.class, Class::NoExchange, "{e}");
    assert_eq!(e.exchange.as_deref(), Some("outbox-test-no-such-exchange"));
    publish(&p, &name, "k", "c").await.unwrap();
    // Now with a message behind the failing one.
    let send = |exchange: &str, payload: &str| {
        let headers: [(&str, &[u8]); 0] = [];
        let m = Message {
            exchange,
            routing_key: "k",
            payload: payload.as_bytes(),
            message_id: payload,
            headers: &headers,
            timestamp_s: None,
        };
        p.send(&m).unwrap_or_else(|_| panic!("{payload} taken"))
    };
    let failing = send("outbox-test-no-such-exchange", "y2");
    let behind = send(&name, "held-back");
    assert_eq!(tokio::time::timeout(DEADLINE, failing).await.unwrap().unwrap().unwrap_err().class, Class::NoExchange);
    assert_eq!(tokio::time::timeout(DEADLINE, behind).await.unwrap().unwrap().unwrap_err().class, Class::Transient);
    let e = publish(&p, &name, "k", "refused-until-reset").await.unwrap_err();
    assert_eq!(e.class, Class::Transient, "{e}");
    p.reset();
    publish(&p, &name, "k", "d").await.unwrap();
    let mut consumer = ch
        .basic_consume(queue.as_str().into(), "t".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .unwrap();
    for want in ["a", "b", "c", "d"] {
        let d = tokio::time::timeout(DEADLINE, consumer.next()).await.unwrap().unwrap().unwrap();
        assert_eq!(d.data, want.as_bytes());
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
}

/// amqps with the private CA works; a wrong password and an unknown CA are transient failures
/// that say what happened.
#[tokio::test]
async fn tls_with_the_ca_and_refusals() {
    let name = format!("outbox-test-tls-{}", std::process::id());
    let (_conn, _ch, _queue) = topology(&name).await;
    let dir = env("OUTBOX_TLS_DIR");
    let ca = std::fs::read_to_string(format!("{dir}/ca.pem")).unwrap();
    let p = Publisher::new(settings(env("OUTBOX_RABBITMQ_TLS_URL"), Some(ca)));
    publish(&p, &name, "k", "over-tls").await.unwrap();
    let other = std::fs::read_to_string(format!("{dir}/other-ca.pem")).unwrap();
    let p = Publisher::new(settings(env("OUTBOX_RABBITMQ_TLS_URL"), Some(other)));
    let e = publish(&p, &name, "k", "x").await.unwrap_err();
    assert_eq!(e.class, Class::Transient, "{e}");
    let url = env("OUTBOX_RABBITMQ_URL");
    let (head, tail) = url.split_once('@').unwrap();
    let user = head.rsplit_once(':').unwrap().0;
    let p = Publisher::new(settings(format!("{user}:wrong-password@{tail}"), None));
    let e = publish(&p, &name, "k", "x").await.unwrap_err();
    assert_eq!(e.class, Class::Transient, "{e}");
    assert!(!e.to_string().contains("wrong-password"), "no secret in errors: {e}");
    assert!(e.to_string().contains("cannot connect"), "{e}");
}
