//! What each shard-partition's streamer is doing, asked of the running instances.
//!
//! ```text
//!  without [coordination]   [metrics] listen of this config (or --metrics-address)
//!                           ── GET /streams ──▶ the instance's states
//!  under ZooKeeper          lease holder ──▶ its member node's `metrics` address
//!                           ── GET /streams ──▶ the owner's state of that shard-partition
//! ```
//!
//! Each instance is asked once, within [`ASK_DEADLINE`]. An instance that cannot be asked
//! leaves its shard-partitions `unknown`, with the reason, never guessed.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::health::{StreamerState, StreamsReport};

/// How long one instance may take to answer `GET /streams`.
pub(super) const ASK_DEADLINE: Duration = Duration::from_secs(3);
/// The longest answer read; a report is a few hundred bytes per shard-partition.
const MAX_ANSWER: u64 = 4 * 1024 * 1024;

/// A streamer's state as `status` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(super) enum Seen {
    Starting,
    /// Streaming, with rows still in the table.
    Streaming,
    /// Streaming, and the table is empty.
    CaughtUp,
    CatchingUp,
    Retrying,
    Halted,
    /// No instance runs it.
    NotRunning,
    /// No instance could be asked; the reason says why.
    #[default]
    Unknown,
}

impl Seen {
    pub(super) fn word(self) -> &'static str {
        match self {
            Seen::Starting => "starting",
            Seen::Streaming => "streaming",
            Seen::CaughtUp => "caught-up",
            Seen::CatchingUp => "catching-up",
            Seen::Retrying => "retrying",
            Seen::Halted => "halted",
            Seen::NotRunning => "not running",
            Seen::Unknown => "unknown",
        }
    }
}

impl From<StreamerState> for Seen {
    fn from(state: StreamerState) -> Self {
        match state {
            StreamerState::Starting => Seen::Starting,
            StreamerState::Streaming => Seen::Streaming,
            StreamerState::CatchingUp => Seen::CatchingUp,
            StreamerState::Retrying => Seen::Retrying,
            StreamerState::Halted => Seen::Halted,
        }
    }
}

/// One shard-partition's streamer as learned from the instances.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub(super) struct Observed {
    pub state: Seen,
    /// Why it halted, retries, catches up, is not running, or is unknown.
    pub reason: Option<String>,
    /// Seconds in this state, as its instance reported.
    pub for_s: Option<u64>,
    /// The instance that reported it: its name under coordination, else `pid <N>`.
    pub instance: Option<String>,
    /// Where that instance was asked.
    pub address: Option<String>,
}

impl Observed {
    fn of(state: Seen, reason: impl Into<String>) -> Self {
        Self { state, reason: Some(reason.into()), ..Self::default() }
    }

    /// Streaming with an empty table is caught up.
    pub(super) fn settle(&mut self, pending: Option<i64>) {
        if self.state == Seen::Streaming && pending == Some(0) {
            self.state = Seen::CaughtUp;
        }
    }
}

/// The answer of one instance to `GET /streams`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Asked {
    Report(StreamsReport),
    /// Nothing listens at the address.
    Refused(String),
    /// It did not answer in time, or not with a streams report.
    Failed(String),
}

/// Asks the instance at `address` (`host:port`) for its streams.
pub(super) async fn ask(address: &str) -> Asked {
    match tokio::time::timeout(ASK_DEADLINE, fetch(address)).await {
        Ok(asked) => asked,
        Err(_) => Asked::Failed(format!("no answer within {} s", ASK_DEADLINE.as_secs())),
    }
}

/// Asks every address once, concurrently.
pub(super) async fn ask_all(addresses: impl IntoIterator<Item = String>) -> BTreeMap<String, Asked> {
    let addresses: Vec<String> = addresses.into_iter().collect();
    let answers = futures::future::join_all(addresses.iter().map(|a| ask(a))).await;
    addresses.into_iter().zip(answers).collect()
}

async fn fetch(address: &str) -> Asked {
    let mut conn = match tokio::net::TcpStream::connect(address).await {
        Ok(conn) => conn,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => return Asked::Refused(e.to_string()),
        Err(e) => return Asked::Failed(e.to_string()),
    };
    let request = format!("GET /streams HTTP/1.0\r\nHost: {address}\r\nConnection: close\r\n\r\n");
    if let Err(e) = conn.write_all(request.as_bytes()).await {
        return Asked::Failed(e.to_string());
    }
    let mut answer = Vec::new();
    if let Err(e) = conn.take(MAX_ANSWER).read_to_end(&mut answer).await {
        return Asked::Failed(e.to_string());
    }
    parse_answer(&answer)
}

/// An HTTP answer: a 200 with a [`StreamsReport`], or why not.
fn parse_answer(answer: &[u8]) -> Asked {
    let text = String::from_utf8_lossy(answer);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return Asked::Failed("not an HTTP answer".into());
    };
    let status = head.lines().next().unwrap_or_default();
    match status.split_whitespace().nth(1) {
        Some("200") => {}
        Some("404") => {
            return Asked::Failed(
                "answered 404 to /streams: an outbox-streamer of an earlier version, or another program".into(),
            );
        }
        _ => return Asked::Failed(format!("answered {status:?}")),
    }
    match serde_json::from_str(body) {
        Ok(report) => Asked::Report(report),
        Err(e) => Asked::Failed(format!("not a streams report: {e}")),
    }
}

/// The address to ask for the local instance: `listen` with an unspecified IP (`0.0.0.0`,
/// `[::]`) replaced by loopback.
pub(super) fn local_address(listen: SocketAddr) -> String {
    let mut addr = listen;
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr {
            SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    addr.to_string()
}

/// The state of `key` reported by an instance that answered.
fn reported(report: &StreamsReport, key: &str, address: &str) -> Option<Observed> {
    let stream = report.streams.get(key)?;
    Some(Observed {
        state: stream.state.into(),
        reason: stream.reason.clone(),
        for_s: Some(stream.for_s),
        instance: Some(report.instance.clone().unwrap_or_else(|| format!("pid {}", report.pid))),
        address: Some(address.to_string()),
    })
}

/// Without coordination: the instance at `address` (none known: `None`) answered `asked`
/// about `key`. `slot_reader` is the backend pid reading the shard-partition's PostgreSQL
/// slot, if any: when nothing answers at the address, a slot in use means a streamer runs
/// elsewhere, so the state is unknown rather than "not running".
pub(super) fn uncoordinated(
    key: &str,
    address: Option<&str>,
    asked: Option<&Asked>,
    slot_reader: Option<i32>,
) -> Observed {
    let (Some(address), Some(asked)) = (address, asked) else {
        return Observed::of(
            Seen::Unknown,
            "this config has no [metrics] listen to ask the streamer at: set it (as the running instance has it) or pass --metrics-address",
        );
    };
    let mut seen = match asked {
        Asked::Report(report) => reported(report, key, address)
            .unwrap_or_else(|| Observed::of(Seen::NotRunning, format!("the instance at {address} does not run it"))),
        Asked::Refused(_) => match slot_reader {
            Some(pid) => Observed::of(
                Seen::Unknown,
                format!(
                    "nothing answers at {address}, but backend pid {pid} reads the slot: a streamer on another host? (pass --metrics-address)"
                ),
            ),
            None => Observed::of(Seen::NotRunning, format!("nothing answers at {address}")),
        },
        Asked::Failed(e) => Observed::of(Seen::Unknown, format!("cannot ask {address}: {e}")),
    };
    seen.address = Some(address.to_string());
    seen
}

/// Under coordination: the lease of `key` is held by `holder` (or nobody); `addresses` maps
/// each live member's instance name to its published metrics address (`None`: it publishes
/// none); `asked` holds the answers.
pub(super) fn coordinated(
    key: &str,
    holder: Option<&str>,
    addresses: &BTreeMap<String, Option<String>>,
    asked: &BTreeMap<String, Asked>,
) -> Observed {
    let Some(owner) = holder else {
        return Observed::of(Seen::NotRunning, "no instance holds its lease");
    };
    let mut seen = match addresses.get(owner) {
        None => Observed::of(Seen::Unknown, format!("its owner {owner} is not a live member")),
        Some(None) => Observed::of(
            Seen::Unknown,
            format!(
                "its owner {owner} publishes no metrics address: set [metrics] listen there (an earlier version publishes none)"
            ),
        ),
        Some(Some(address)) => {
            let mut seen = match asked.get(address) {
                Some(Asked::Report(report)) if report.instance.as_deref() != Some(owner) => Observed::of(
                    Seen::Unknown,
                    format!(
                        "{address}, published by {owner}, answers as {}",
                        report.instance.as_deref().unwrap_or("an instance without coordination")
                    ),
                ),
                Some(Asked::Report(report)) => reported(report, key, address).unwrap_or_else(|| {
                    Observed::of(Seen::Starting, format!("{owner} holds the lease and has not started it yet"))
                }),
                Some(Asked::Refused(e) | Asked::Failed(e)) => {
                    Observed::of(Seen::Unknown, format!("cannot ask its owner {owner} at {address}: {e}"))
                }
                None => Observed::of(Seen::Unknown, format!("{owner} at {address} was not asked")),
            };
            seen.address = Some(address.clone());
            seen
        }
    };
    seen.instance = Some(owner.to_string());
    seen
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::StreamReport;

    fn report(instance: Option<&str>, streams: &[(&str, StreamerState, Option<&str>)]) -> StreamsReport {
        StreamsReport {
            instance: instance.map(str::to_string),
            pid: 42,
            streams: streams
                .iter()
                .map(|(k, state, reason)| {
                    (k.to_string(), StreamReport { state: *state, reason: reason.map(str::to_string), for_s: 7 })
                })
                .collect(),
        }
    }

    #[test]
    fn without_coordination_the_local_instance_is_asked() {
        let answered = Asked::Report(report(None, &[("a.t0", StreamerState::Halted, Some("row id=7"))]));
        let halted = uncoordinated("a.t0", Some("127.0.0.1:9"), Some(&answered), None);
        assert_eq!((halted.state, halted.reason.as_deref(), halted.for_s), (Seen::Halted, Some("row id=7"), Some(7)));
        assert_eq!(halted.instance.as_deref(), Some("pid 42"));
        assert_eq!(uncoordinated("a.t1", Some("127.0.0.1:9"), Some(&answered), None).state, Seen::NotRunning);

        let refused = Asked::Refused("connection refused".into());
        assert_eq!(uncoordinated("a.t0", Some("127.0.0.1:9"), Some(&refused), None).state, Seen::NotRunning);
        let elsewhere = uncoordinated("a.t0", Some("127.0.0.1:9"), Some(&refused), Some(1234));
        assert_eq!(elsewhere.state, Seen::Unknown, "a slot in use is not a stopped streamer");
        assert!(elsewhere.reason.unwrap().contains("pid 1234"));
        let failed = Asked::Failed("no answer within 3 s".into());
        assert_eq!(uncoordinated("a.t0", Some("127.0.0.1:9"), Some(&failed), None).state, Seen::Unknown);
        let nowhere = uncoordinated("a.t0", None, None, None);
        assert!(nowhere.state == Seen::Unknown && nowhere.reason.unwrap().contains("[metrics] listen"));
    }

    #[test]
    fn under_coordination_the_owner_is_asked() {
        let addresses = BTreeMap::from([
            ("one".to_string(), Some("h1:9".to_string())),
            ("old".to_string(), None),
            ("moved".to_string(), Some("h2:9".to_string())),
        ]);
        let asked = BTreeMap::from([
            ("h1:9".to_string(), Asked::Report(report(Some("one"), &[("a.t0", StreamerState::Streaming, None)]))),
            ("h2:9".to_string(), Asked::Report(report(Some("someone-else"), &[]))),
        ]);
        let owned = coordinated("a.t0", Some("one"), &addresses, &asked);
        assert_eq!((owned.state, owned.instance.as_deref()), (Seen::Streaming, Some("one")));
        assert_eq!(coordinated("a.t1", Some("one"), &addresses, &asked).state, Seen::Starting);
        assert_eq!(coordinated("a.t0", None, &addresses, &asked).state, Seen::NotRunning);
        for owner in ["old", "moved", "gone"] {
            let seen = coordinated("a.t0", Some(owner), &addresses, &asked);
            assert_eq!((seen.state, seen.instance.as_deref()), (Seen::Unknown, Some(owner)), "{seen:?}");
        }
    }

    #[test]
    fn answers_are_parsed_or_refused_with_the_reason() {
        let body =
            serde_json::to_string(&report(Some("one"), &[("a.t0", StreamerState::Retrying, Some("x"))])).unwrap();
        let ok = format!("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{body}\n");
        assert!(matches!(parse_answer(ok.as_bytes()), Asked::Report(r) if r.instance.as_deref() == Some("one")));
        let old = b"HTTP/1.1 404 Not Found\r\n\r\ntry /metrics";
        assert!(matches!(parse_answer(old), Asked::Failed(e) if e.contains("earlier version")));
        assert!(matches!(parse_answer(b"SSH-2.0-OpenSSH"), Asked::Failed(_)));
        assert!(
            matches!(parse_answer(b"HTTP/1.1 200 OK\r\n\r\n<html>"), Asked::Failed(e) if e.contains("not a streams report"))
        );
    }

    #[test]
    fn an_unspecified_listen_address_is_asked_on_loopback() {
        assert_eq!(local_address("0.0.0.0:9187".parse().unwrap()), "127.0.0.1:9187");
        assert_eq!(local_address("[::]:9187".parse().unwrap()), "[::1]:9187");
        assert_eq!(local_address("10.0.0.7:9187".parse().unwrap()), "10.0.0.7:9187");
    }

    #[test]
    fn streaming_with_an_empty_table_is_caught_up() {
        let mut seen = Observed { state: Seen::Streaming, ..Observed::default() };
        seen.settle(Some(3));
        assert_eq!(seen.state, Seen::Streaming);
        seen.settle(Some(0));
        assert_eq!(seen.state, Seen::CaughtUp);
    }
}
