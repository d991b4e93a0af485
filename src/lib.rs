//! outbox-streamer moves transactional-outbox rows from PostgreSQL (logical replication) and
//! MySQL/MariaDB (binlog) to Kafka, in commit order per shard-partition, and deletes each row
//! only after Kafka acknowledged it.
//!
//! # Architecture
//!
//! ```text
//!            ┌──────────── one task per shard-partition ─────────────┐
//!  database ─┤ Source (db/<name>/) ─▶ streamer.rs ─▶ Sink (sink/)     │─▶ Kafka
//!            │        ▲                    │ ordered acks (ack.rs)    │
//!            │        └─ delete, then move the slot ◀─┘              │
//!            └───────────────────────────────────────────────────────┘
//! ```
//!
//! * The core (this crate) owns the vocabulary — [`record::OutboxRecord`], positions, the
//!   [`source::Source`] and [`sink::Sink`] contracts — and the loop in [`streamer`], generic
//!   over both. Each database is one folder behind [`db::Database`]; the broker is chosen in
//!   [`sink`]. Connector crates
//!   (`outbox-postgres`, `outbox-kafka`, …) only speak their system's protocol; the core
//!   depends on them, never the reverse.
//! * Delivery is at least once: a row is deleted, and the slot moved past it, only after its
//!   record and every record before it were acknowledged. See `docs/architecture.md`.

// Only `outbox-kafka`'s queue_events.rs may use `unsafe` (the workspace denies it; this crate
// forbids it outright).
#![forbid(unsafe_code)]

pub(crate) mod ack;
pub(crate) mod api;
pub(crate) mod catchup;
pub mod cli;
pub(crate) mod config;
pub(crate) mod coordination;
pub(crate) mod db;
pub(crate) mod dberror;
pub(crate) mod error;
pub(crate) mod halt;
pub(crate) mod health;
pub(crate) mod job;
pub(crate) mod layout;
pub(crate) mod lease;
pub(crate) mod metrics;
pub(crate) mod names;
pub(crate) mod policy;
pub mod poll;
pub(crate) mod progress;
pub(crate) mod record;
pub(crate) mod replay;
pub(crate) mod row_keys;
pub(crate) mod run;
pub(crate) mod same_database;
pub(crate) mod secret;
pub(crate) mod sink;
pub(crate) mod skip;
pub(crate) mod source;
pub(crate) mod streamer;
pub(crate) mod sweep;
pub mod tls;
