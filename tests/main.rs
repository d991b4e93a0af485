//! Integration tests against real PostgreSQL, MariaDB, Kafka and ZooKeeper.
//!
//! Start the services with `scripts/services up && eval "$(scripts/services env)"`, or run
//! everything with `scripts/test`. A missing service fails a test with that instruction.

mod support;

mod coordination;
mod examples;
mod health;
mod kafka_sasl;
mod mysql_cdc;
mod mysql_errors;
mod mysql_setup;
mod polling;
mod polling_mysql;
mod postgres_cdc;
mod postgres_errors;
mod postgres_faults;
mod smoke;
mod tls;
