//! Integration tests against real PostgreSQL, MariaDB, Kafka and ZooKeeper.
//!
//! Start the services with `scripts/services up && eval "$(scripts/services env)"`, or run
//! everything with `scripts/test`. A missing service fails a test with that instruction.

// Only `outbox-kafka`'s queue_events.rs may use `unsafe` (the workspace denies it; this crate
// forbids it outright).
#![forbid(unsafe_code)]

mod support;

mod accounts;
mod api;
mod bad_rows;
mod cleanup_beside_reading;
mod config_cli;
mod coordination_fencing;
mod coordination_ownership;
mod coordination_workload;
mod database_crash;
mod database_failover;
mod debezium;
mod debezium_text_keys;
mod debezium_uuid;
mod exactly_once;
mod examples;
mod faults;
mod halt_retry;
mod health;
mod kafka_sasl;
mod latency;
mod log_rule;
mod mysql_cdc;
mod mysql_errors;
mod mysql_setup;
mod mysql_wal;
mod mysql_xa;
mod polling;
mod polling_mysql;
mod polling_quiet;
mod postgres_cdc;
mod postgres_errors;
mod postgres_faults;
mod postgres_wal;
mod rabbitmq;
mod same_database;
mod smoke;
mod status;
mod sweep;
mod teardown;
mod tls;
mod tw_tkms;
mod workload;
