//! One shard-partition's publisher: a connection, one channel in confirm mode, and a task that
//! owns both.
//!
//! # Contract
//!
//! * [`Publisher::send`] never waits: it takes a place in the confirm window (or answers
//!   [`Offer::Full`]) and queues the message for the task, which publishes messages in the
//!   order they were sent. The returned [`Confirm`] resolves with the broker's confirm.
//! * Confirms resolve in publish order. A message is confirmed only when the broker acked it
//!   and did not return it (every message is `mandatory`: an unroutable one comes back as
//!   [`Class::Unroutable`]).
//! * After a failure that closes the channel or the connection (or a nack, or an overdue
//!   confirm), every message sent afterwards fails too (as transient: it is not at fault),
//!   until [`Publisher::reset`]: no later message can be confirmed after an earlier one
//!   failed, so the caller can resend from its last confirmed position without reordering.
//!   A definite failure of a message with nothing sent after it blocks nothing: the next
//!   message (a dead-letter copy) goes out on a new channel. The task reconnects as needed.
//! * Messages are persistent (`delivery_mode` 2) and carry a `message_id`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::FuturesOrdered;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};

use crate::classify::{Class, PublishError};

/// How to reach the broker.
#[derive(Clone)]
pub struct PublisherSettings {
    /// `amqp://` or `amqps://` with user, password, vhost and query (`heartbeat`, `frame_max`).
    pub uri: String,
    /// PEM certificates that sign the broker's certificate (amqps); none: the system's roots.
    pub ca_pem: Option<String>,
    /// A client certificate and its PKCS#8 key, both PEM (amqps).
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
    /// Messages that may wait for their confirm at once.
    pub confirm_window: usize,
    /// A message not confirmed this long after it was published fails (transient), and the
    /// connection is opened again: a broker that stopped answering (frozen, blocked by a
    /// resource alarm) holds nothing back for longer.
    pub confirm_timeout: Duration,
    /// A message still waiting to be published this long after it was handed over is not
    /// published (it fails, transient): after a pause of the process (a stalled VM), what was
    /// queued before it must not go out once another owner may have taken over. Under
    /// ZooKeeper coordination, below the lease's bound.
    pub max_queued: Duration,
    pub connect_timeout: Duration,
    /// Shown in the broker's connection list.
    pub connection_name: String,
}

impl std::fmt::Debug for PublisherSettings {
    /// Without the URI: it holds the password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PublisherSettings")
            .field("confirm_window", &self.confirm_window)
            .field("connection_name", &self.connection_name)
            .finish_non_exhaustive()
    }
}

/// One message, borrowed from the caller.
#[derive(Debug, Clone, Copy)]
pub struct Message<'a> {
    pub exchange: &'a str,
    pub routing_key: &'a str,
    pub payload: &'a [u8],
    pub message_id: &'a str,
    /// Headers, in order. A name given more than once (Kafka and tw-tkms allow it, an AMQP
    /// header table does not) becomes one header whose value is an array of the values in
    /// order; a name given once has its value as a long string.
    pub headers: &'a [(&'a str, &'a [u8])],
    /// The `timestamp` property, seconds since the epoch.
    pub timestamp_s: Option<u64>,
}

/// The AMQP header table of `headers` (see [`Message::headers`]).
/// Linear in the number of headers (a message may carry very many).
fn header_table(headers: &[(&str, &[u8])]) -> FieldTable {
    let text = |v: &[u8]| AMQPValue::LongString(LongString::from(v.to_vec()));
    let mut grouped: std::collections::HashMap<&str, Vec<&[u8]>> = std::collections::HashMap::new();
    for (name, value) in headers {
        grouped.entry(name).or_default().push(value);
    }
    let mut table = FieldTable::default();
    for (name, values) in grouped {
        let value = match values.as_slice() {
            [one] => text(one),
            many => AMQPValue::FieldArray(many.iter().map(|v| text(v)).collect::<Vec<_>>().into()),
        };
        table.insert(ShortString::from(name), value);
    }
    table
}

/// Why [`Publisher::send`] did not take a message.
#[derive(Debug)]
pub enum Offer {
    /// The confirm window is full: await [`Publisher::room`], then offer it again.
    Full,
    /// Refused before it was published.
    Refused(PublishError),
}

/// The longest exchange name, routing key or header name AMQP carries.
const SHORT_STRING_MAX: usize = 255;

/// Resolves with the message's confirm. Seeing a failure here counts it as seen (see
/// [`Fence`]).
#[derive(Debug)]
pub struct Confirm {
    rx: oneshot::Receiver<Result<(), PublishError>>,
    fence: Arc<Fence>,
}

impl Future for Confirm {
    type Output = Result<Result<(), PublishError>, oneshot::error::RecvError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        let polled = Pin::new(&mut self.rx).poll(cx);
        if let std::task::Poll::Ready(Ok(Err(e))) = &polled
            && Fence::counts(e)
        {
            self.fence.seen.fetch_add(1, Ordering::AcqRel);
        }
        polled
    }
}

/// Failures the task reported against failures the caller has seen. A message the caller sent
/// before it saw every earlier failure was sent *after* a failed one without knowing it: it
/// fails too (transient), so it cannot reach a queue before the failed message is dealt with —
/// even when the failed message closed its channel with nothing else in flight and the task
/// would open a new one (the case a dead-letter copy, sent once the failure is seen, needs).
/// A returned (unroutable) message is not counted: its channel stays open and the messages
/// after it were routed on their own (see docs/rabbitmq.md).
#[derive(Debug, Default)]
struct Fence {
    failed: std::sync::atomic::AtomicU64,
    seen: std::sync::atomic::AtomicU64,
}

impl Fence {
    /// Tells `reply` that its message failed, counting it.
    fn fail(&self, reply: oneshot::Sender<Result<(), PublishError>>, e: PublishError) {
        if Self::counts(&e) {
            self.failed.fetch_add(1, Ordering::AcqRel);
        }
        let _ = reply.send(Err(e));
    }

    /// Whether a failure fences the messages sent after it (see above).
    fn counts(e: &PublishError) -> bool {
        e.class != Class::Unroutable
    }
}

/// A message to publish, or a question for the task.
enum Job {
    Publish(Box<Publish>),
    Exchange { name: ShortString, reply: oneshot::Sender<Option<bool>> },
}

struct Publish {
    exchange: ShortString,
    routing_key: ShortString,
    payload: Vec<u8>,
    properties: BasicProperties,
    reply: oneshot::Sender<Result<(), PublishError>>,
    permit: OwnedSemaphorePermit,
    /// When the caller handed it over (see [`PublisherSettings::max_queued`]).
    queued: Instant,
    /// The failures the caller had seen when it sent this (see [`Fence`]).
    seen: u64,
}

/// See the module docs.
#[derive(Debug)]
pub struct Publisher {
    jobs: mpsc::UnboundedSender<Job>,
    window: Arc<Semaphore>,
    broken: Arc<AtomicBool>,
    fence: Arc<Fence>,
}

impl Publisher {
    /// Starts the publisher's task (it connects at the first message). Call inside a tokio
    /// runtime.
    pub fn new(settings: PublisherSettings) -> Self {
        let (jobs, rx) = mpsc::unbounded_channel();
        let window = Arc::new(Semaphore::new(settings.confirm_window.max(1)));
        let broken = Arc::new(AtomicBool::new(false));
        let fence = Arc::new(Fence::default());
        tokio::spawn(run(settings, rx, broken.clone(), fence.clone()));
        Self { jobs, window, broken, fence }
    }

    /// Queues `m` for publishing; see the module docs.
    pub fn send(&self, m: &Message<'_>) -> Result<Confirm, Offer> {
        if self.broken.load(Ordering::Acquire) {
            return Err(Offer::Refused(PublishError::transient(
                "an earlier message of this stream failed; it is sent again from the last confirmed one",
            )));
        }
        if m.routing_key.len() > SHORT_STRING_MAX {
            return Err(Offer::Refused(PublishError {
                class: Class::Unrepresentable,
                text: format!("a routing key of {} bytes; AMQP allows at most {SHORT_STRING_MAX}", m.routing_key.len()),
                exchange: None,
            }));
        }
        if let Some((name, _)) = m.headers.iter().find(|(name, _)| name.len() > SHORT_STRING_MAX) {
            return Err(Offer::Refused(PublishError {
                class: Class::Unrepresentable,
                text: format!("a header name of {} bytes; AMQP allows at most {SHORT_STRING_MAX}", name.len()),
                exchange: None,
            }));
        }
        if m.exchange.len() > SHORT_STRING_MAX {
            return Err(Offer::Refused(PublishError {
                class: Class::NoExchange,
                text: format!("an exchange name of {} bytes; AMQP allows at most {SHORT_STRING_MAX}", m.exchange.len()),
                exchange: Some(m.exchange.to_string()),
            }));
        }
        let (routing_key, exchange) = (ShortString::from(m.routing_key), ShortString::from(m.exchange));
        let permit = self.window.clone().try_acquire_owned().map_err(|_| Offer::Full)?;
        let headers = header_table(m.headers);
        let properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(ShortString::from(m.message_id))
            .with_headers(headers);
        let properties = match m.timestamp_s {
            Some(t) => properties.with_timestamp(t),
            None => properties,
        };
        let (reply, rx) = oneshot::channel();
        let job = Job::Publish(Box::new(Publish {
            exchange,
            routing_key,
            payload: m.payload.to_vec(),
            properties,
            reply,
            permit,
            queued: Instant::now(),
            seen: self.fence.seen.load(Ordering::Acquire),
        }));
        self.jobs.send(job).map_err(|_| Offer::Refused(PublishError::transient("the publisher's task ended")))?;
        Ok(Confirm { rx, fence: self.fence.clone() })
    }

    /// Resolves when the confirm window may have room.
    pub async fn room(&self) {
        let _ = self.window.acquire().await;
    }

    /// A new session begins: messages may be sent again after a failure.
    pub fn reset(&self) {
        self.broken.store(false, Ordering::Release);
        // Failures of the last session's messages count as seen, awaited or not.
        self.fence.seen.store(self.fence.failed.load(Ordering::Acquire), Ordering::Release);
    }

    /// Whether `exchange` exists (`None`: the broker cannot be asked now).
    pub async fn exchange_exists(&self, exchange: &str) -> Option<bool> {
        if exchange.len() > SHORT_STRING_MAX {
            return Some(false);
        }
        let name = ShortString::from(exchange);
        let (reply, answer) = oneshot::channel();
        self.jobs.send(Job::Exchange { name, reply }).ok()?;
        answer.await.ok().flatten()
    }
}

struct Link {
    connection: Connection,
    channel: Channel,
}

async fn connect(s: &PublisherSettings) -> Result<Link, PublishError> {
    let runtime = lapin::runtime::default_runtime().map_err(|e| PublishError::from(&e))?;
    let properties = ConnectionProperties::default().with_connection_name(LongString::from(s.connection_name.clone()));
    let identity = s.identity.clone().map(|(pem, key)| OwnedIdentity::PKCS8 { pem, key });
    let tls = OwnedTLSConfig { identity, cert_chain: s.ca_pem.clone() };
    let connecting = Connection::connect_with_config(&s.uri, properties, tls, runtime);
    let connection = tokio::time::timeout(s.connect_timeout, connecting)
        .await
        .map_err(|_| PublishError::transient(format!("no connection to RabbitMQ within {:?}", s.connect_timeout)))?
        .map_err(|e| PublishError::transient(format!("cannot connect to RabbitMQ: {e}")))?;
    let channel = connection.create_channel().await.map_err(|e| PublishError::from(&e))?;
    channel.confirm_select(ConfirmSelectOptions::default()).await.map_err(|e| PublishError::from(&e))?;
    Ok(Link { connection, channel })
}

/// A published message waiting for its confirm: what the broker said, whom to tell, its
/// window place, and its `message_id`.
type Pending =
    (Result<Said, PublishError>, oneshot::Sender<Result<(), PublishError>>, OwnedSemaphorePermit, Option<ShortString>);
type Confirming = Pin<Box<dyn Future<Output = Pending> + Send>>;

/// The task: publishes jobs in order and releases confirms in order.
async fn run(
    settings: PublisherSettings,
    mut rx: mpsc::UnboundedReceiver<Job>,
    broken: Arc<AtomicBool>,
    fence: Arc<Fence>,
) {
    let mut link: Option<Link> = None;
    let mut pending: FuturesOrdered<Confirming> = FuturesOrdered::new();
    let mut returns = Returns::default();
    loop {
        tokio::select! {
            biased;
            Some((said, reply, permit, message_id)) = pending.next(), if !pending.is_empty() => {
                let mut outcome = returns.settle(message_id.as_ref(), said);
                if let Err(e) = &mut outcome && e.class != Class::Unroutable {
                    if broken.load(Ordering::Acquire) && e.class != Class::Rejected {
                        // The channel closed for an earlier message: this one is not at fault.
                        *e = PublishError::transient(format!("an earlier message of this stream failed ({e})"));
                    }
                    // Only what was sent after it could be confirmed out of order; a message that
                    // failed alone (the caller sends a suspect one alone) leaves nothing to hold
                    // back, and what the caller sends next (a dead-letter copy) goes out.
                    if e.is_transient() || !(pending.is_empty() && rx.is_empty()) {
                        broken.store(true, Ordering::Release);
                    }
                    // The channel is closed, or a confirm never came: start over.
                    link = None;
                    returns = Returns::default();
                }
                match outcome {
                    Ok(()) => {
                        let _ = reply.send(Ok(()));
                    }
                    Err(e) => fence.fail(reply, e),
                }
                drop(permit);
            }
            job = rx.recv() => match job {
                None => break,
                Some(Job::Exchange { name, reply }) => {
                    let _ = reply.send(exchange_exists(&settings, &mut link, name).await);
                }
                Some(Job::Publish(job)) => {
                    let Publish { exchange, routing_key, payload, properties, reply, permit, queued, seen } = *job;
                    if broken.load(Ordering::Acquire) || seen < fence.failed.load(Ordering::Acquire) {
                        fence.fail(reply, PublishError::transient("an earlier message of this stream failed"));
                        continue;
                    }
                    if queued.elapsed() > settings.max_queued {
                        broken.store(true, Ordering::Release);
                        fence.fail(reply, PublishError::transient(format!(
                            "the message waited {:?} to be published, longer than {:?} (the process was paused, or RabbitMQ blocked publishers): it is not sent from this queue",
                            queued.elapsed(),
                            settings.max_queued
                        )));
                        continue;
                    }
                    let channel = match usable(&settings, &mut link).await {
                        Ok(channel) => channel,
                        Err(e) => {
                            broken.store(true, Ordering::Release);
                            fence.fail(reply, e);
                            continue;
                        }
                    };
                    let options = BasicPublishOptions { mandatory: true, immediate: false };
                    let name = exchange.as_str().to_string();
                    let message_id = properties.message_id().clone();
                    let limit = settings.confirm_timeout;
                    let publishing = channel.basic_publish(exchange, routing_key, options, &payload, properties);
                    let Ok(published) = tokio::time::timeout(limit, publishing).await else {
                        // RabbitMQ blocks publishers under a memory or disk alarm: the frame is not
                        // even written. Fail loudly and start over on a new connection.
                        broken.store(true, Ordering::Release);
                        link = None;
                        fence.fail(reply, PublishError::transient(format!(
                            "RabbitMQ did not take the message within {limit:?}: it blocks publishers (a memory or disk alarm: see `rabbitmqctl status`), or stopped answering"
                        )));
                        continue;
                    };
                    match published {
                        Ok(confirm) => {
                            pending.push_back(Box::pin(async move {
                                let outcome = match tokio::time::timeout(limit, confirm).await {
                                    Ok(confirm) => settled(confirm).map_err(|e| e.of_exchange(name)),
                                    Err(_) => Err(PublishError::transient(format!(
                                        "RabbitMQ did not confirm the message within {limit:?} (the broker stopped answering, or a resource alarm blocks publishers)"
                                    ))),
                                };
                                (outcome, reply, permit, message_id)
                            }));
                        }
                        Err(e) => {
                            broken.store(true, Ordering::Release);
                            link = None;
                            fence.fail(reply, PublishError::from(&e).of_exchange(name));
                        }
                    }
                }
            }
        }
    }
    if let Some(link) = link {
        let _ = link.connection.close(200, ShortString::from("outbox-streamer stopping")).await;
    }
}

/// The channel to publish on, connecting (again) when there is none or it closed.
async fn usable(settings: &PublisherSettings, link: &mut Option<Link>) -> Result<Channel, PublishError> {
    if let Some(l) = link
        && !(l.connection.status().connected() && l.channel.status().connected())
    {
        *link = None;
    }
    if link.is_none() {
        *link = Some(connect(settings).await?);
    }
    Ok(link.as_ref().map(|l| l.channel.clone()).expect("connected above"))
}

/// Asks on a channel of its own: a passive declare of a missing exchange closes its channel.
async fn exchange_exists(settings: &PublisherSettings, link: &mut Option<Link>, name: ShortString) -> Option<bool> {
    usable(settings, link).await.ok()?;
    let channel = link.as_ref()?.connection.create_channel().await.ok()?;
    let options = ExchangeDeclareOptions { passive: true, ..ExchangeDeclareOptions::default() };
    let answer = match channel.exchange_declare(name, ExchangeKind::Direct, options, FieldTable::default()).await {
        Ok(()) => Some(true),
        Err(e) if crate::classify::classify(&e) == Class::NoExchange => Some(false),
        Err(_) => None,
    };
    let _ = channel.close(200, ShortString::from("checked")).await;
    answer
}

/// What a message's confirm said: acked or nacked, and the return it carried, if any.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Said {
    nacked: bool,
    returned: Option<Returned>,
}

/// A message the broker returned (unroutable), as a confirm carried it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Returned {
    /// The returned message's own `message_id`: the confirm that carries a return is not
    /// always that message's (lapin hands a return to the next confirm it resolves, and a
    /// broker's `multiple` ack resolves an earlier message first).
    message_id: Option<ShortString>,
    text: String,
}

/// Gives each return to the message it belongs to. Confirms are settled in publish order,
/// and a message's return comes before its ack, so a return carried by an earlier message's
/// confirm is kept until that message's turn.
#[derive(Debug, Default)]
struct Returns {
    elsewhere: std::collections::HashMap<ShortString, String>,
}

impl Returns {
    /// The outcome of the message `own` from what its confirm said.
    fn settle(&mut self, own: Option<&ShortString>, said: Result<Said, PublishError>) -> Result<(), PublishError> {
        let unroutable = |text: String| PublishError { class: Class::Unroutable, exchange: None, text };
        let Said { nacked, returned } = said?;
        match returned {
            Some(r) if r.message_id.is_none() || r.message_id.as_ref() == own => return Err(unroutable(r.text)),
            Some(Returned { message_id: Some(id), text }) => {
                self.elsewhere.insert(id, text);
            }
            _ => {}
        }
        if let Some(text) = own.and_then(|id| self.elsewhere.remove(id)) {
            return Err(unroutable(text));
        }
        if nacked {
            return Err(PublishError {
                class: Class::Rejected,
                text: "RabbitMQ nacked the message: a queue it routes to refused it (full, with x-overflow = reject-publish), or the broker could not store it".into(),
                exchange: None,
            });
        }
        Ok(())
    }
}

fn settled(confirm: Result<Confirmation, lapin::Error>) -> Result<Said, PublishError> {
    let returned = |r: lapin::message::BasicReturnMessage| Returned {
        message_id: r.delivery.properties.message_id().clone(),
        text: format!(
            "RabbitMQ returned the message: {} {} (exchange {:?}, routing key {:?})",
            r.reply_code,
            r.reply_text.as_str(),
            r.delivery.exchange.as_str(),
            r.delivery.routing_key.as_str()
        ),
    };
    match confirm {
        Ok(Confirmation::Ack(r)) => Ok(Said { nacked: false, returned: r.map(returned) }),
        Ok(Confirmation::Nack(r)) => Ok(Said { nacked: true, returned: r.map(returned) }),
        Ok(Confirmation::NotRequested) => Err(PublishError::transient("the channel is not in confirm mode")),
        Err(e) => Err(PublishError::from(&e)),
    }
}

#[cfg(test)]
mod tests {
    use lapin::types::{AMQPValue, LongString};

    #[test]
    fn a_repeated_header_name_becomes_an_array_in_order() {
        let table = super::header_table(&[("h", b"1"), ("a", b"x"), ("h", b"2")]);
        let text = |v: &str| AMQPValue::LongString(LongString::from(v.as_bytes().to_vec()));
        assert_eq!(table.inner().get("a"), Some(&text("x")));
        assert_eq!(table.inner().get("h"), Some(&AMQPValue::FieldArray(vec![text("1"), text("2")].into())));
    }

    #[test]
    fn a_return_carried_by_an_earlier_confirm_fails_its_own_message() {
        use super::{Returned, Returns, Said};
        use crate::classify::Class;
        let id = |s: &str| Some(lapin::types::ShortString::from(s.to_string()));
        let returned = |s: &str| Some(Returned { message_id: id(s), text: format!("{s} returned") });
        let mut r = Returns::default();
        // Message 1's confirm (a `multiple` ack) carries message 2's return.
        let first = r.settle(id("1").as_ref(), Ok(Said { nacked: false, returned: returned("2") }));
        assert!(first.is_ok(), "message 1 was routed: {first:?}");
        let second = r.settle(id("2").as_ref(), Ok(Said { nacked: false, returned: None })).unwrap_err();
        assert_eq!((second.class, second.text.as_str()), (Class::Unroutable, "2 returned"));
        // Its own return, and one carried for a later message while this one was nacked.
        let own = r.settle(id("3").as_ref(), Ok(Said { nacked: false, returned: returned("3") })).unwrap_err();
        assert_eq!(own.class, Class::Unroutable);
        let nacked = r.settle(id("4").as_ref(), Ok(Said { nacked: true, returned: returned("5") })).unwrap_err();
        assert_eq!(nacked.class, Class::Rejected);
        assert_eq!(
            r.settle(id("5").as_ref(), Ok(Said { nacked: false, returned: None })).unwrap_err().class,
            Class::Unroutable
        );
    }
}
