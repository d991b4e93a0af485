//! PostgreSQL for outbox-streamer: the schema objects and checks (`setup`) and their removal
//! (`teardown`), the logical replication stream decoded into outbox changes (`stream`,
//! `pgoutput`, `values`), and the plain SQL the streamer runs beside it (`cleanup`, `slot`).
//!
//! # Replication
//!
//! ```text
//!  app txn ──INSERT──▶ outbox_<s>_<p> ──WAL──▶ slot outbox_<s>_<p> (pgoutput, publish=insert)
//!                                                     │ proto 1: whole committed txns only
//!                         pgwire-replication ◀────────┘ Begin, Relation, Insert…, Commit
//!                                 │ decode (pgoutput.rs)
//!                                 ▼
//!                          Change::{Begin, Insert, Commit, KeepAlive}
//! ```
//!
//! # Positions
//!
//! The slot's `confirmed_flush_lsn` is the resume point. It is moved only through
//! [`stream::ReplicationStream::confirm`] with a transaction's commit end LSN, after that
//! transaction's rows were published and deleted; the server re-sends everything after it.
//!
//! # Error handling
//!
//! Connection and server errors surface as [`stream::StreamError`]; the caller decides to
//! reconnect. A second reader of the same slot is refused by the server (SQLSTATE 55006),
//! which is PostgreSQL's own single-owner fence.

// Only `outbox-kafka`'s queue_events.rs may use `unsafe` (the workspace denies it; this crate
// forbids it outright).
#![forbid(unsafe_code)]

pub mod cleanup;
pub mod connect;
pub mod envelope;
pub mod pgoutput;
pub mod prepared;
pub mod privileges;
pub mod setup;
pub mod slot;
pub mod stream;
pub mod teardown;
pub mod tls;
pub mod values;

pub use pgwire_replication::Lsn;
