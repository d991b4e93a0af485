//! Metric names, described once, and the recorder behind the Prometheus endpoint.
//!
//! Labels are low-cardinality: `source`, `shard`, `partition` (and `kind` for errors).

use std::net::SocketAddr;

use metrics::{Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge};
use metrics_exporter_prometheus::PrometheusBuilder;

pub(crate) const PUBLISHED_RECORDS: &str = "outbox_published_records_total";
pub(crate) const DELETED_ROWS: &str = "outbox_deleted_rows_total";
pub(crate) const DEAD_LETTERED_RECORDS: &str = "outbox_dead_lettered_records_total";
pub(crate) const SKIPPED_REPLAYED_ROWS: &str = "outbox_replayed_rows_skipped_total";
pub(crate) const SKIPPED_ROWS: &str = "outbox_skipped_rows_total";
pub(crate) const SWEPT_ROWS: &str = "outbox_swept_rows_total";
pub(crate) const SINK_FULL_WAITS: &str = "outbox_sink_full_waits_total";
pub(crate) const KAFKA_TXN_COMMITS: &str = "outbox_kafka_transaction_commits_total";
pub(crate) const KAFKA_TXN_ABORTS: &str = "outbox_kafka_transaction_aborts_total";
pub(crate) const KAFKA_TXN_COMMIT_SECONDS: &str = "outbox_kafka_transaction_commit_seconds";
pub(crate) const STATEMENT_WRITES: &str = "outbox_statement_logged_writes_total";
pub(crate) const ERRORS: &str = "outbox_errors_total";
pub(crate) const IN_FLIGHT_RECORDS: &str = "outbox_in_flight_records";
pub(crate) const IN_FLIGHT_BYTES: &str = "outbox_in_flight_bytes";
pub(crate) const REPLICATION_LAG_BYTES: &str = "outbox_replication_lag_bytes";
pub(crate) const BINLOG_LAG_SECONDS: &str = "outbox_binlog_lag_seconds";
pub(crate) const BINLOG_LAG_BYTES: &str = "outbox_binlog_lag_bytes";
pub(crate) const END_TO_END_LATENCY: &str = "outbox_end_to_end_latency_seconds";
pub(crate) const STREAM_STATE: &str = "outbox_stream_state";
pub(crate) const STREAM_SINK: &str = "outbox_stream_sink_info";
pub(crate) const CATCHUPS: &str = "outbox_catchups_total";
pub(crate) const CATCHUP_ROWS: &str = "outbox_catchup_rows_total";
pub(crate) const HISTORY_CHANGES: &str = "outbox_database_history_changes_total";
pub(crate) const POLL_QUERY_SECONDS: &str = "outbox_poll_query_seconds";
pub(crate) const POLL_ROWS_BELOW_MARK: &str = "outbox_poll_rows_below_mark_total";
pub(crate) const POLL_WATCH_PROBES: &str = "outbox_poll_watch_probes_total";
pub(crate) const OWNED_STREAMS: &str = "outbox_owned_streams";
pub(crate) const LEASE_CHANGES: &str = "outbox_lease_changes_total";
pub(crate) const ZK_SESSIONS_LOST: &str = "outbox_zookeeper_sessions_lost_total";
pub(crate) const OWNER_EPOCH: &str = "outbox_owner_epoch";
pub(crate) const API_REQUESTS: &str = "outbox_api_requests_total";
pub(crate) const API_MESSAGES: &str = "outbox_api_messages_total";
pub(crate) const API_OLDEST_PREPARED: &str = "outbox_api_oldest_prepared_seconds";
pub(crate) const API_CONNECTIONS_REFUSED: &str = "outbox_api_connections_refused_total";
pub(crate) const API_CHECKBACKS: &str = "outbox_api_checkbacks_total";

/// Latency buckets in seconds: 1 ms to 30 s.
const LATENCY_BUCKETS: &[f64] = &[0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0];

/// Values of the `kind` label of [`ERRORS`].
pub(crate) const ERROR_KINDS: &[&str] = &["source", "kafka_transient", "kafka_definite", "bad_row"];
/// The `kind` values of [`SKIPPED_ROWS`].
pub(crate) const SKIPPED_KINDS: &[&str] = &["operator", "deleted_bad_row", "untransactional_message"];

/// Values of [`STREAM_STATE`].
pub(crate) mod state {
    pub(crate) const STOPPED: f64 = 0.0;
    pub(crate) const STREAMING: f64 = 1.0;
    pub(crate) const RETRYING: f64 = 2.0;
    pub(crate) const HALTED: f64 = 3.0;
    pub(crate) const CATCHING_UP: f64 = 4.0;
}

pub(crate) fn describe() {
    describe_counter!(API_REQUESTS, Unit::Count, "message API requests answered, by endpoint and HTTP status");
    describe_counter!(
        API_MESSAGES,
        Unit::Count,
        "message API messages prepared, committed and rolled back, by token and outcome"
    );
    describe_gauge!(
        API_OLDEST_PREPARED,
        Unit::Seconds,
        "age of the oldest message API message still prepared (0 when none is)"
    );
    describe_counter!(
        API_CHECKBACKS,
        Unit::Count,
        "message API check-backs by outcome: committed, rolled_back, unknown, failed (no usable answer), given_up"
    );
    describe_counter!(
        API_CONNECTIONS_REFUSED,
        Unit::Count,
        "message API connections closed at once because api.max_connections were open"
    );
    describe_counter!(PUBLISHED_RECORDS, Unit::Count, "records acknowledged by Kafka");
    describe_counter!(DELETED_ROWS, Unit::Count, "outbox rows deleted after their records were acknowledged");
    describe_counter!(DEAD_LETTERED_RECORDS, Unit::Count, "bad rows sent to the dead-letter topic");
    describe_counter!(
        SKIPPED_REPLAYED_ROWS,
        Unit::Count,
        "rows of replayed transactions this stream had already published, not sent again"
    );
    describe_counter!(
        KAFKA_TXN_COMMITS,
        Unit::Count,
        "Kafka transactions committed with their progress record (delivery = exactly-once)"
    );
    describe_counter!(
        KAFKA_TXN_ABORTS,
        Unit::Count,
        "Kafka transactions aborted (delivery = exactly-once); their records are sent again in a new one"
    );
    describe_counter!(
        SKIPPED_ROWS,
        Unit::Count,
        "rows not published, by kind: operator (outbox-streamer skip), deleted_bad_row (a bad row deleted from the table)"
    );
    describe_counter!(
        SWEPT_ROWS,
        Unit::Count,
        "rows the log never carried, found in the table by the sweep and published"
    );
    describe_counter!(
        STATEMENT_WRITES,
        Unit::Count,
        "statement-logged writes to the outbox table seen in the binlog (their rows reach Kafka through the sweep)"
    );
    describe_counter!(ERRORS, Unit::Count, "errors by kind: source, kafka_transient, kafka_definite, bad_row");
    describe_gauge!(IN_FLIGHT_RECORDS, Unit::Count, "records handed to Kafka and not yet acknowledged");
    describe_gauge!(IN_FLIGHT_BYTES, Unit::Bytes, "bytes of records handed to Kafka and not yet acknowledged");
    describe_gauge!(
        REPLICATION_LAG_BYTES,
        Unit::Bytes,
        "WAL between the slot's confirmed position and the server's current one"
    );
    describe_gauge!(
        BINLOG_LAG_SECONDS,
        Unit::Seconds,
        "now minus the timestamp of the last binlog event read (0 when caught up)"
    );
    describe_gauge!(
        BINLOG_LAG_BYTES,
        Unit::Bytes,
        "binlog bytes the server has written after the stored checkpoint position"
    );
    describe_histogram!(END_TO_END_LATENCY, Unit::Seconds, "row created_at (database clock) to Kafka acknowledgement");
    describe_counter!(
        CATCHUPS,
        Unit::Count,
        "catch-ups by polling after a lost slot or binlog position, or a return from polling mode"
    );
    describe_counter!(CATCHUP_ROWS, Unit::Count, "rows sent by catch-ups");
    describe_counter!(
        HISTORY_CHANGES,
        Unit::Count,
        "sessions that found another database history than the last one (a failover, a restore): what was remembered by row id was dropped"
    );
    describe_histogram!(POLL_QUERY_SECONDS, Unit::Seconds, "duration of each oldest-rows query in polling mode");
    describe_histogram!(
        KAFKA_TXN_COMMIT_SECONDS,
        Unit::Seconds,
        "exactly-once: how long each Kafka transaction's commit took (the progress record sent, every report in, the commit)"
    );
    describe_counter!(
        POLL_ROWS_BELOW_MARK,
        Unit::Count,
        "polling: rows found below the low-water mark by the periodic rescan from the lowest id"
    );
    describe_counter!(
        POLL_WATCH_PROBES,
        Unit::Count,
        "polling: statements of the quiet-table watch, by outcome (ok, failed); while it fails, idle tables are read one by one"
    );
    describe_gauge!(OWNED_STREAMS, Unit::Count, "shard-partitions this instance holds the ZooKeeper lease of");
    describe_counter!(
        LEASE_CHANGES,
        Unit::Count,
        "leases by event: acquired, released (rebalance), yielded, lost (session expired)"
    );
    describe_counter!(
        ZK_SESSIONS_LOST,
        Unit::Count,
        "ZooKeeper sessions this instance lost (expired, closed or refused): every owned shard-partition stopped at once and the instance joined again"
    );
    describe_gauge!(OWNER_EPOCH, "the epoch of the lease this instance holds per shard-partition (0 when not held)");
    describe_gauge!(STREAM_SINK, "1 for the broker (label sink: kafka, rabbitmq) each shard-partition publishes to");
    describe_gauge!(
        STREAM_STATE,
        "0 stopped, 1 streaming, 2 retrying after an error, 3 halted (operator action needed), 4 catching up by polling"
    );
}

/// Puts every series of one shard-partition (`labels`: source, shard, partition) on
/// `/metrics` before anything happens to it: counters at their current value (0 for a new
/// one), [`ERRORS`] once per kind, nothing in flight. Dashboards and `rate()` alerts then see
/// the shard-partition from the start instead of from its first message. Called when its
/// task starts.
pub(crate) fn init_stream(labels: &[(&'static str, String); 3]) {
    for name in [
        PUBLISHED_RECORDS,
        DELETED_ROWS,
        DEAD_LETTERED_RECORDS,
        SKIPPED_REPLAYED_ROWS,
        SWEPT_ROWS,
        STATEMENT_WRITES,
        CATCHUPS,
        CATCHUP_ROWS,
        HISTORY_CHANGES,
        SINK_FULL_WAITS,
        KAFKA_TXN_COMMITS,
        KAFKA_TXN_ABORTS,
    ] {
        counter!(name, labels).increment(0);
    }
    for kind in SKIPPED_KINDS {
        let [a, b, c] = labels.clone();
        counter!(SKIPPED_ROWS, &[a, b, c, ("kind", kind.to_string())]).increment(0);
    }
    for kind in ERROR_KINDS {
        let [a, b, c] = labels.clone();
        counter!(ERRORS, &[a, b, c, ("kind", kind.to_string())]).increment(0);
    }
    for name in [IN_FLIGHT_RECORDS, IN_FLIGHT_BYTES] {
        gauge!(name, labels).set(0.0);
    }
    gauge!(STREAM_STATE, labels).set(state::STOPPED);
}

/// Installs the global recorder and serves `/metrics`, `/healthz`, `/readyz` and `/streams` on
/// `listen` (see [`crate::health`]).
pub(crate) async fn serve(listen: SocketAddr, health: crate::health::HealthSettings) -> anyhow::Result<()> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(metrics_exporter_prometheus::Matcher::Full(END_TO_END_LATENCY.into()), LATENCY_BUCKETS)?
        .set_buckets_for_metric(metrics_exporter_prometheus::Matcher::Full(POLL_QUERY_SECONDS.into()), LATENCY_BUCKETS)?
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Full(KAFKA_TXN_COMMIT_SECONDS.into()),
            LATENCY_BUCKETS,
        )?
        .install_recorder()?;
    describe();
    crate::health::serve(listen, handle.clone(), health).await?;
    // Histograms are drained into their buckets by upkeep; without the exporter's own HTTP
    // listener nothing else runs it.
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(5));
        loop {
            tick.tick().await;
            handle.run_upkeep();
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    const ALL: &[&str] = &[
        super::PUBLISHED_RECORDS,
        super::DELETED_ROWS,
        super::DEAD_LETTERED_RECORDS,
        super::SKIPPED_REPLAYED_ROWS,
        super::KAFKA_TXN_COMMITS,
        super::KAFKA_TXN_ABORTS,
        super::SKIPPED_ROWS,
        super::SWEPT_ROWS,
        super::STATEMENT_WRITES,
        super::ERRORS,
        super::IN_FLIGHT_RECORDS,
        super::IN_FLIGHT_BYTES,
        super::REPLICATION_LAG_BYTES,
        super::BINLOG_LAG_SECONDS,
        super::BINLOG_LAG_BYTES,
        super::END_TO_END_LATENCY,
        super::STREAM_STATE,
        super::STREAM_SINK,
        super::CATCHUPS,
        super::CATCHUP_ROWS,
        super::HISTORY_CHANGES,
        super::POLL_QUERY_SECONDS,
        super::KAFKA_TXN_COMMIT_SECONDS,
        super::POLL_ROWS_BELOW_MARK,
        super::POLL_WATCH_PROBES,
        super::OWNED_STREAMS,
        super::LEASE_CHANGES,
        super::ZK_SESSIONS_LOST,
        super::OWNER_EPOCH,
        super::API_REQUESTS,
        super::API_MESSAGES,
        super::API_OLDEST_PREPARED,
        super::API_CONNECTIONS_REFUSED,
        super::API_CHECKBACKS,
    ];

    /// Every metric is in docs/metrics.md, and the Grafana dashboard uses only real names.
    #[test]
    fn docs_and_dashboard_match_the_metrics() {
        let docs = include_str!("../docs/metrics.md");
        for name in ALL {
            assert!(docs.contains(&format!("`{name}")), "{name} is not documented in docs/metrics.md");
        }
        let dashboard = include_str!("../docs/grafana-dashboard.json");
        for word in dashboard.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if let Some(name) = word.strip_prefix("outbox_") {
                let base = ["_bucket", "_sum", "_count"].iter().fold(word, |w, s| w.strip_suffix(s).unwrap_or(w));
                assert!(ALL.contains(&base), "the dashboard uses unknown metric outbox_{name}");
            }
        }
    }
}
