//! The checks run on a loaded configuration; each error names the first bad setting
//! (`source[0].shards`, `kafka.properties."acks"`, …) and what to do about it.

use std::collections::HashSet;

use super::error::{ConfigError, invalid};
use super::sections::RabbitConfig;
use super::sections::{Config, MAX_PARTITIONS, MAX_SHARDS, MetricsConfig, SourceKind};
use super::stream::{BadRowPolicy, Delivery, Mode, SinkKind, Storage, StreamOverrides};

impl MetricsConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let Some(advertise) = &self.advertise else { return Ok(()) };
        if self.listen.is_none() {
            return Err(invalid(
                "metrics.advertise",
                "needs metrics.listen: it says where other hosts reach that address",
            ));
        }
        let valid = advertise.rsplit_once(':').is_some_and(|(host, port)| {
            !host.is_empty()
                && !host.contains(|c: char| c.is_whitespace() || c.is_control() || c == '/')
                && port.parse::<u16>().is_ok_and(|p| p > 0)
        });
        if !valid {
            return Err(invalid(
                "metrics.advertise",
                "must be host:port, the address other hosts reach metrics.listen at (e.g. \"10.0.0.7:9187\" or \"streamer-1.internal:9187\")",
            ));
        }
        Ok(())
    }
}

impl Config {
    /// Checks every setting; the error names the first bad field.
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let brokers: Vec<&str> = self.kafka.brokers.split(',').map(str::trim).collect();
        if brokers.iter().any(|b| b.is_empty() || b.contains(|c: char| c.is_whitespace() || c.is_control())) {
            return Err(invalid(
                "kafka.brokers",
                "must list host:port entries separated by commas, none of them empty or with spaces (e.g. \"kafka-1:9092,kafka-2:9092\")",
            ));
        }
        if self.kafka.message_timeout_ms < 1000 {
            return Err(invalid("kafka.message_timeout_ms", "must be at least 1000"));
        }
        for key in self.kafka.properties.keys() {
            let field = format!("kafka.properties.{key:?}");
            match outbox_kafka::producer::reserved_property(key) {
                Some("message.timeout.ms") => {
                    return Err(invalid(
                        field,
                        "is set from kafka.message_timeout_ms, which outbox-streamer caps under [coordination] so a queued record cannot outlive the lease; remove it and set kafka.message_timeout_ms instead",
                    ));
                }
                Some(canonical) => {
                    let alias =
                        if canonical == key { String::new() } else { format!(" (librdkafka's alias of {canonical})") };
                    return Err(invalid(
                        field,
                        format!("is fixed by outbox-streamer for ordering and idempotence{alias}; remove it"),
                    ));
                }
                None => {}
            }
        }
        let password_sources = [
            self.kafka.properties.contains_key("sasl.password"),
            self.kafka.sasl_password_env.is_some(),
            self.kafka.sasl_password_file.is_some(),
        ];
        if let Some(tls) = &self.kafka.tls {
            tls.validate_for_kafka("kafka.tls", &self.kafka.properties)?;
        }
        if !is_kafka_topic_name(&self.kafka.progress_topic) {
            return Err(invalid(
                "kafka.progress_topic",
                "must be a Kafka topic name: 1 to 249 characters of [a-zA-Z0-9._-], not \".\" or \"..\"",
            ));
        }
        if !is_kafka_topic_name(&self.kafka.transactional_id_prefix) || self.kafka.transactional_id_prefix.len() > 100 {
            return Err(invalid("kafka.transactional_id_prefix", "must be 1 to 100 characters of [a-zA-Z0-9._-]"));
        }
        if password_sources.iter().filter(|set| **set).count() > 1 {
            return Err(invalid(
                "kafka.sasl_password_env",
                "give the SASL password once: properties.\"sasl.password\", sasl_password_env or sasl_password_file",
            ));
        }
        self.metrics.validate()?;
        if let Some(api) = &self.api {
            api.validate(&self.sources)?;
        }
        if let Some(r) = &self.rabbitmq {
            r.validate()?;
        }
        if self.sources.is_empty() {
            return Err(invalid("source", "at least one [[source]] is needed"));
        }
        if let Some(c) = &self.coordination {
            if c.connect.trim().is_empty() {
                return Err(invalid(
                    "coordination.connect",
                    "must list the ZooKeeper ensemble as host:port[,host:port…]",
                ));
            }
            if !c.root.starts_with('/') || c.root.len() < 2 {
                return Err(invalid(
                    "coordination.root",
                    "must be an absolute ZooKeeper path such as /outbox-streamer",
                ));
            }
            if c.cluster_name.is_empty() || c.cluster_name.contains('/') {
                return Err(invalid("coordination.cluster_name", "must be non-empty and without '/'"));
            }
            if !(2_000..=600_000).contains(&c.session_timeout_ms) {
                return Err(invalid(
                    "coordination.session_timeout_ms",
                    "must be between 2000 and 600000 (ZooKeeper negotiates it within 2 and 20 tick times)",
                ));
            }
            let bad_instance = |i: &str| {
                i.is_empty()
                    || i.chars().count() > 40
                    || i.contains(|c: char| c == '/' || c.is_whitespace() || c.is_control())
            };
            if c.instance.as_deref().is_some_and(bad_instance) {
                return Err(invalid(
                    "coordination.instance",
                    "must be 1 to 40 characters without '/', spaces, tabs or other control characters (it goes into node data and application_name); use e.g. the host name",
                ));
            }
            if c.yield_interval_s == Some(0) {
                return Err(invalid("coordination.yield_interval_s", "must be at least 1, or left out to never yield"));
            }
            if let Some(tls) = &c.tls {
                tls.validate_for_zookeeper("coordination.tls")?;
            }
        }
        let mut names = HashSet::new();
        let mut prefixes = HashSet::new();
        for (i, s) in self.sources.iter().enumerate() {
            let f = |field: &str| format!("source[{i}].{field}");
            if s.name.is_empty() || !s.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
                return Err(invalid(f("name"), "must be non-empty letters, digits, '_' or '-'"));
            }
            if !names.insert(s.name.clone()) {
                return Err(invalid(f("name"), format!("{:?} is used by two sources", s.name)));
            }
            if !prefixes.insert((s.url.redacted(), s.table_prefix.clone())) {
                return Err(invalid(f("table_prefix"), "two sources use the same database and prefix"));
            }
            if s.url.expose().trim().is_empty() {
                return Err(invalid(f("url"), "must be a connection URL"));
            }
            if !crate::names::valid_prefix(&s.table_prefix) {
                return Err(invalid(f("table_prefix"), "must be lowercase letters, digits and '_', at most 40"));
            }
            if let Some(slot_prefix) = &s.slot_prefix {
                if s.kind != SourceKind::Postgres {
                    return Err(invalid(f("slot_prefix"), "only PostgreSQL sources have replication slots"));
                }
                if !crate::names::valid_prefix(slot_prefix) {
                    return Err(invalid(f("slot_prefix"), "must be lowercase letters, digits and '_', at most 40"));
                }
            }
            if s.shards == 0 || s.shards > MAX_SHARDS {
                return Err(invalid(f("shards"), format!("must be between 1 and {MAX_SHARDS}")));
            }
            if s.partitions == 0 || s.partitions > MAX_PARTITIONS {
                return Err(invalid(f("partitions"), format!("must be between 1 and {MAX_PARTITIONS}")));
            }
            if s.heartbeat_interval_ms.is_some_and(|v| !(100..=3_600_000).contains(&v)) {
                return Err(invalid(f("heartbeat_interval_ms"), "must be between 100 and 3600000"));
            }
            if !(1..=87_600).contains(&s.log_retention_min_hours) {
                return Err(invalid(f("log_retention_min_hours"), "must be between 1 and 87600 (ten years)"));
            }
            if s.password_env.is_some() && s.password_file.is_some() {
                return Err(invalid(f("password_env"), "set password_env or password_file, not both"));
            }
            if let Some(tls) = &s.tls {
                tls.validate(&f("tls"))?;
            }
            check_layout(&f, s)?;
            if s.defaults.shard.is_some() || s.defaults.partition.is_some() {
                return Err(invalid(f("defaults"), "shard and partition belong in [[source.override]]"));
            }
            check_overrides(&f("defaults"), &s.defaults)?;
            for (j, o) in s.overrides.iter().enumerate() {
                let of = f(&format!("override[{j}]"));
                match o.shard {
                    None => return Err(invalid(format!("{of}.shard"), "is required in an override")),
                    Some(shard) if shard >= s.shards => {
                        return Err(invalid(format!("{of}.shard"), format!("must be below shards = {}", s.shards)));
                    }
                    _ => {}
                }
                if o.partition.is_some_and(|p| p >= s.partitions) {
                    return Err(invalid(
                        format!("{of}.partition"),
                        format!("must be below partitions = {}", s.partitions),
                    ));
                }
                check_overrides(&of, o)?;
            }
            for id in crate::names::all_streams(s.shards, s.partitions) {
                let st = s.settings_for(id);
                if st.storage == Storage::Wal && s.layout != crate::layout::LayoutKind::OutboxStreamer {
                    return Err(invalid(
                        f("defaults.storage"),
                        format!(
                            "shard-partition {id} uses storage = \"wal\" with layout = \"{}\": that layout's messages are rows of its tables; use storage = \"table\"",
                            s.layout.as_str()
                        ),
                    ));
                }
                if st.storage == Storage::Wal && st.mode == Mode::Polling {
                    return Err(invalid(
                        f("defaults.storage"),
                        format!(
                            "shard-partition {id} uses storage = \"wal\" with mode = \"polling\": WAL-only messages are in no table to poll; use mode = \"cdc\""
                        ),
                    ));
                }
                if st.sink == SinkKind::Rabbitmq {
                    if self.rabbitmq.is_none() {
                        return Err(invalid(
                            "rabbitmq",
                            format!(
                                "shard-partition {id} of source {:?} sets sink = \"rabbitmq\": add a [rabbitmq] section with its url",
                                s.name
                            ),
                        ));
                    }
                    if st.delivery == Delivery::ExactlyOnce {
                        return Err(invalid(
                            f("defaults.delivery"),
                            format!(
                                "shard-partition {id} sets delivery = \"exactly-once\" with sink = \"rabbitmq\": RabbitMQ has no transactional producer that survives a crash, so exactly-once is Kafka's only; use delivery = \"at-least-once\" and deduplicate by message_id (see docs/rabbitmq.md)"
                            ),
                        ));
                    }
                }
                if st.on_bad_row == BadRowPolicy::DeadLetter && st.dead_letter_topic.is_none() {
                    return Err(invalid(
                        f("defaults.dead_letter_topic"),
                        format!(
                            "shard-partition {id} uses on_bad_row = \"dead-letter\" but names no dead_letter_topic"
                        ),
                    ));
                }
            }
        }
        if let Some(c) = &self.coordination
            && c.connect.trim().is_empty()
        {
            return Err(invalid("coordination.connect", "must list ZooKeeper host:port pairs"));
        }
        Ok(())
    }
}

fn check_overrides(field: &str, o: &StreamOverrides) -> Result<(), ConfigError> {
    if o.linger_ms.is_some_and(|v| v > 60_000) {
        return Err(invalid(format!("{field}.linger_ms"), "must be at most 60000"));
    }
    if o.max_in_flight_bytes == Some(0) {
        return Err(invalid(format!("{field}.max_in_flight_bytes"), "must be greater than 0"));
    }
    if o.cleanup_interval_ms == Some(0) {
        return Err(invalid(format!("{field}.cleanup_interval_ms"), "must be greater than 0"));
    }
    if o.cleanup_max_rows == Some(0) {
        return Err(invalid(format!("{field}.cleanup_max_rows"), "must be greater than 0"));
    }
    if o.status_interval_ms.is_some_and(|v| !(10..=60_000).contains(&v)) {
        return Err(invalid(format!("{field}.status_interval_ms"), "must be between 10 and 60000"));
    }
    if o.poll_batch.is_some_and(|v| v == 0 || v > 100_000) {
        return Err(invalid(format!("{field}.poll_batch"), "must be between 1 and 100000"));
    }
    if o.poll_interval_ms.is_some_and(|v| !(1..=60_000).contains(&v)) {
        return Err(invalid(format!("{field}.poll_interval_ms"), "must be between 1 and 60000"));
    }
    if o.sweep_interval_ms.is_some_and(|v| !(100..=3_600_000).contains(&v)) {
        return Err(invalid(format!("{field}.sweep_interval_ms"), "must be between 100 and 3600000"));
    }
    if o.halt_retry_ms.is_some_and(|v| !(100..=300_000).contains(&v)) {
        return Err(invalid(format!("{field}.halt_retry_ms"), "must be between 100 and 300000"));
    }
    if o.transaction_interval_ms.is_some_and(|v| !(1..=60_000).contains(&v)) {
        return Err(invalid(format!("{field}.transaction_interval_ms"), "must be between 1 and 60000"));
    }
    if o.transaction_max_records.is_some_and(|v| !(1..=1_000_000).contains(&v)) {
        return Err(invalid(format!("{field}.transaction_max_records"), "must be between 1 and 1000000"));
    }
    if o.exchange.as_deref().is_some_and(|e| e.len() > 255 || e.contains(|c: char| c.is_control())) {
        return Err(invalid(
            format!("{field}.exchange"),
            "must be a RabbitMQ exchange name: at most 255 bytes, no control characters",
        ));
    }
    if o.dead_letter_topic.as_deref().is_some_and(|t| !is_kafka_topic_name(t)) {
        return Err(invalid(
            format!("{field}.dead_letter_topic"),
            "must be a Kafka topic name: 1 to 249 characters of [a-zA-Z0-9._-], not \".\" or \"..\"",
        ));
    }
    Ok(())
}

impl RabbitConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let url = self.url.expose();
        let Some(rest) = url.strip_prefix("amqp://").or_else(|| url.strip_prefix("amqps://")) else {
            return Err(invalid(
                "rabbitmq.url",
                "must start with amqp:// or amqps:// (e.g. \"amqps://outbox@mq.internal:5671/%2f\")",
            ));
        };
        let user = rest.split_once('@').map(|(userinfo, _)| userinfo.split(':').next().unwrap_or_default());
        if user.is_none_or(str::is_empty) {
            return Err(invalid(
                "rabbitmq.url",
                "must name the user (amqp://user@host:5672/%2f): without one the client logs in as guest, which RabbitMQ refuses from other hosts",
            ));
        }
        if rest.contains('?') {
            return Err(invalid(
                "rabbitmq.url",
                "must not carry a query: set heartbeat_s, frame_max and the TLS table in [rabbitmq] instead",
            ));
        }
        if self.password_env.is_some() && self.password_file.is_some() {
            return Err(invalid("rabbitmq.password_env", "set password_env or password_file, not both"));
        }
        if !(1..=600).contains(&self.heartbeat_s) {
            return Err(invalid("rabbitmq.heartbeat_s", "must be between 1 and 600"));
        }
        if !(4096..=1_048_576).contains(&self.frame_max) {
            return Err(invalid("rabbitmq.frame_max", "must be between 4096 and 1048576"));
        }
        if !(1..=65_535).contains(&self.confirm_window) {
            return Err(invalid("rabbitmq.confirm_window", "must be between 1 and 65535"));
        }
        if !(100..=3_600_000).contains(&self.confirm_timeout_ms) {
            return Err(invalid("rabbitmq.confirm_timeout_ms", "must be between 100 and 3600000"));
        }
        if !(100..=600_000).contains(&self.connect_timeout_ms) {
            return Err(invalid("rabbitmq.connect_timeout_ms", "must be between 100 and 600000"));
        }
        if let Some(tls) = &self.tls {
            tls.validate("rabbitmq.tls")?;
            if !url.starts_with("amqps://") {
                return Err(invalid("rabbitmq.url", "must start with amqps:// when [rabbitmq.tls] is set"));
            }
            if tls.mode != crate::tls::TlsMode::VerifyFull || tls.server_name.is_some() {
                return Err(invalid(
                    "rabbitmq.tls.mode",
                    "RabbitMQ TLS always verifies the broker against the URL's host: use mode = \"verify-full\" without server_name",
                ));
            }
        }
        Ok(())
    }
}

/// Whether the broker accepts `name` as a topic name.
fn is_kafka_topic_name(name: &str) -> bool {
    (1..=249).contains(&name.len())
        && name != "."
        && name != ".."
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// `layout` and `[source.columns]` agree, and a mapping names what a record needs.
fn check_layout(f: &dyn Fn(&str) -> String, s: &super::SourceConfig) -> Result<(), ConfigError> {
    use crate::layout::LayoutKind;
    let mapped = matches!(s.layout, LayoutKind::Columns | LayoutKind::Debezium);
    if let Some(table) = &s.table {
        if s.layout == LayoutKind::OutboxStreamer || s.shards != 1 || s.partitions != 1 {
            return Err(invalid(
                f("table"),
                "names another outbox's one table: only with a layout other than ours and shards = partitions = 1",
            ));
        }
        let ok = table.chars().next().is_some_and(|c| c.is_ascii_lowercase() || c == '_')
            && table.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            && table.len() <= 63;
        if !ok {
            return Err(invalid(f("table"), "must be lowercase letters, digits and '_', at most 63"));
        }
    }
    if s.columns.is_some() && !mapped {
        return Err(invalid(f("columns"), "a column mapping needs layout = \"columns\" or \"debezium\""));
    }
    let Some(m) = s.mapping else {
        if mapped {
            return Err(invalid(
                f("columns"),
                "layout = \"columns\" needs [source.columns] naming at least the topic column (topic) or one topic (fixed_topic)",
            ));
        }
        return Ok(());
    };
    match (&m.topic, &m.fixed_topic) {
        (None, None) => {
            return Err(invalid(
                f("columns.topic"),
                "name the topic column (topic) or one topic for every row (fixed_topic)",
            ));
        }
        (Some(_), Some(_)) => {
            return Err(invalid(f("columns.fixed_topic"), "set topic (a column) or fixed_topic, not both"));
        }
        (None, Some(t)) if t.is_empty() || t.len() > 249 => {
            return Err(invalid(f("columns.fixed_topic"), "must be a topic name of 1 to 249 characters"));
        }
        _ => {}
    }
    if m.id.as_deref().is_some_and(|c| c.is_empty() || c.len() > 64) {
        return Err(invalid(
            f("columns.id"),
            "must name the table's increasing integer column (1 to 64 characters), or be left out for `id`",
        ));
    }
    if m.topic_prefix.is_some() && m.topic.is_none() {
        return Err(invalid(f("columns.topic_prefix"), "prefixes the topic column's value: set topic too"));
    }
    let prefix = crate::record::RESERVED_HEADER_PREFIX;
    for (name, column) in &m.header_columns {
        if name.is_empty() || column.is_empty() {
            return Err(invalid(f("columns.header_columns"), "header names and columns must not be empty"));
        }
        if name.get(..prefix.len()).is_some_and(|p| p.eq_ignore_ascii_case(prefix)) {
            return Err(invalid(
                f("columns.header_columns"),
                format!("header {name:?} starts with \"{prefix}\", which is reserved for the streamer's own headers"),
            ));
        }
    }
    Ok(())
}
