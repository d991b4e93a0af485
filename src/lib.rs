//! outbox-streamer moves transactional-outbox rows from PostgreSQL (logical replication) and
//! MySQL/MariaDB (binlog) to Kafka, in commit order per shard-partition, and deletes each row
//! only after Kafka acknowledged it.
//!
//! # Architecture
//!
//! ```text
//!            ┌──────────── one task per shard-partition ─────────────┐
//!  database ─┤ Source (postgres.rs) ─▶ streamer.rs ─▶ outbox-kafka    │─▶ Kafka
//!            │        ▲                    │ ordered acks (ack.rs)    │
//!            │        └─ delete, then move the slot ◀─┘              │
//!            └───────────────────────────────────────────────────────┘
//! ```
//!
//! * The core (this crate) owns the vocabulary — [`record::OutboxRecord`], positions, the
//!   [`source::Source`] contract — and the loop in [`streamer`]. Connector crates
//!   (`outbox-postgres`, `outbox-kafka`, …) only speak their system's protocol; the core
//!   depends on them, never the reverse.
//! * Delivery is at least once: a row is deleted, and the slot moved past it, only after its
//!   record and every record before it were acknowledged. See `docs/architecture.md`.

pub mod ack;
pub mod bench;
pub mod catchup;
pub mod cli;
pub mod config;
pub mod connect;
pub mod coordination;
pub mod dberror;
pub mod halt;
pub mod health;
pub mod lease;
pub mod metrics;
pub mod mysql;
pub mod names;
pub mod poll;
pub mod postgres;
pub mod record;
pub mod run;
pub mod same_database;
pub mod secret;
pub mod skip;
pub mod source;
pub mod streamer;
pub mod sweep;
pub mod tls;
