//! The configuration's unit tests: defaults, override layers, `${VAR}` expansion and the errors
//! that name a setting without showing a secret.

use super::sections::{DEFAULT_PARTITIONS, DEFAULT_SHARDS, hostname};
use super::stream::Compression;
use super::*;
use crate::names::StreamId;

const MINIMAL: &str = r#"
    [[source]]
    name = "app"
    kind = "postgres"
    url = "postgres://u:pw@localhost/app"
"#;

#[test]
fn defaults() {
    let c = Config::from_toml(MINIMAL).unwrap();
    let s = &c.sources[0];
    assert_eq!((s.shards, s.partitions), (DEFAULT_SHARDS, DEFAULT_PARTITIONS));
    assert_eq!(s.settings_for(StreamId { shard: 0, partition: 0 }), StreamSettings::default());
    assert!(c.coordination.is_none());
}

#[test]
fn overrides_apply_shard_then_partition() {
    let c = Config::from_toml(&format!(
        "{MINIMAL}
        partitions = 2
        [source.defaults]
        linger_ms = 10
        [[source.override]]
        shard = 1
        linger_ms = 0
        compression = \"zstd\"
        [[source.override]]
        shard = 1
        partition = 1
        compression = \"none\"
        "
    ))
    .unwrap();
    let s = &c.sources[0];
    assert_eq!(s.settings_for(StreamId { shard: 0, partition: 0 }).linger_ms, 10);
    let a = s.settings_for(StreamId { shard: 1, partition: 0 });
    assert_eq!((a.linger_ms, a.compression), (0, Compression::Zstd));
    let b = s.settings_for(StreamId { shard: 1, partition: 1 });
    assert_eq!((b.linger_ms, b.compression), (0, Compression::None));
    let names = |shard, partition| -> Vec<String> {
        s.layers_for(StreamId { shard, partition }).into_iter().map(|(name, _)| name).collect()
    };
    assert_eq!(names(0, 0), ["defaults"]);
    assert_eq!(names(1, 0), ["defaults", "override[0] (shard 1)"]);
    assert_eq!(names(1, 1), ["defaults", "override[0] (shard 1)", "override[1] (shard 1, partition 1)"]);
}

#[test]
fn a_slot_prefix_renames_the_slots_only() {
    let c = Config::from_toml(&format!("{MINIMAL}slot_prefix = \"outbox_billing\"")).unwrap();
    let names = c.sources[0].stream_names(StreamId { shard: 1, partition: 0 });
    assert_eq!((names.table.as_str(), names.slot.as_str()), ("outbox_1_0", "outbox_billing_1_0"));
    let err = Config::from_toml(&format!("{MINIMAL}slot_prefix = \"Billing\"")).unwrap_err().to_string();
    assert!(err.starts_with("source[0].slot_prefix:"), "{err}");
    let mysql = MINIMAL.replace("postgres", "mysql");
    let err = Config::from_toml(&format!("{mysql}slot_prefix = \"x\"")).unwrap_err().to_string();
    assert!(err.contains("only PostgreSQL sources"), "{err}");
}

#[test]
fn errors_name_the_field() {
    let err = |extra: &str| Config::from_toml(&format!("{MINIMAL}{extra}")).unwrap_err().to_string();
    assert!(err("shards = 0").starts_with("source[0].shards:"));
    assert!(err("[[source.override]]\nshard = 5").contains("source[0].override[0].shard"));
    assert!(err("[source.defaults]\non_bad_row = \"dead-letter\"").contains("dead_letter_topic"));
    assert!(err("bogus = 1").contains("unknown field"));
    assert!(err("[source.defaults]\nmax_in_flight_bytes = 0").contains("max_in_flight_bytes"));
    assert!(err("[source.defaults]\nhalt_retry_ms = 50").contains("defaults.halt_retry_ms: must be between 100"));
    let e = Config::from_toml("[kafka.properties]\nacks = \"1\"\n[[source]]\nname=\"a\"\nkind=\"postgres\"\nurl=\"x\"")
        .unwrap_err();
    assert!(e.to_string().contains("kafka.properties.\"acks\""), "{e}");
}

/// Values that look set but name nothing usable are refused with the field and the fix.
#[test]
fn blank_brokers_topics_and_instance_names_are_refused() {
    // Not the process environment: OUTBOX_KAFKA_BROKERS would replace the brokers tested.
    let err = |text: String| with_env(&text, &[]).unwrap_err().to_string();
    let quote = |s: &str| toml::Value::String(s.into()).to_string();
    for brokers in [" , ", "", "a:9092,,b:9092", "a:9092, \t"] {
        let e = err(format!("[kafka]\nbrokers = {}\n{MINIMAL}", quote(brokers)));
        assert!(e.starts_with("kafka.brokers:") && e.contains("host:port"), "{brokers:?}: {e}");
    }
    for topic in ["   ", "dead letters", "dlq/x", "..", "é", &"t".repeat(250)] {
        let e = err(format!(
            "{MINIMAL}\n[source.defaults]\non_bad_row = \"dead-letter\"\ndead_letter_topic = {}",
            quote(topic)
        ));
        assert!(e.contains("defaults.dead_letter_topic") && e.contains("[a-zA-Z0-9._-]"), "{topic:?}: {e}");
    }
    let ok = format!("{MINIMAL}\n[source.defaults]\non_bad_row = \"dead-letter\"\ndead_letter_topic = \"app.dlq_1-x\"");
    assert!(with_env(&ok, &[]).is_ok());
    for instance in ["a\tb", "a b", "a\nb", "a\u{0}b", "a\u{a0}b"] {
        let e = err(format!(
            "[coordination]\nkind = \"zookeeper\"\nconnect = \"zk:2181\"\ninstance = {}\n{MINIMAL}",
            quote(instance)
        ));
        assert!(e.starts_with("coordination.instance:"), "{instance:?}: {e}");
    }
}

/// The address published for `status`: `advertise`, else `listen` with this host's name for
/// an unspecified address; a malformed or orphaned `advertise` names the field.
#[test]
fn the_metrics_address_published_for_status() {
    let load = |metrics: &str| with_env(&format!("[metrics]\n{metrics}\n{MINIMAL}"), &[]);
    let c = load("listen = \"127.0.0.1:9187\"").unwrap();
    assert_eq!(c.metrics.advertised_address().as_deref(), Some("127.0.0.1:9187"));
    assert!(!c.metrics.ready_when_halted, "a halt is not ready by default");
    let c = load("listen = \"0.0.0.0:9187\"\nready_when_halted = true").unwrap();
    assert_eq!(c.metrics.advertised_address(), Some(format!("{}:9187", hostname())));
    assert!(c.metrics.ready_when_halted);
    let c = load("listen = \"0.0.0.0:9187\"\nadvertise = \"10.0.0.7:9187\"").unwrap();
    assert_eq!(c.metrics.advertised_address().as_deref(), Some("10.0.0.7:9187"));
    assert_eq!(load("").unwrap().metrics.advertised_address(), None);
    for bad in ["10.0.0.7", "h:0", ":9187", "a b:1", "h:port"] {
        let e = load(&format!("listen = \"0.0.0.0:9187\"\nadvertise = \"{bad}\"")).unwrap_err().to_string();
        assert!(e.starts_with("metrics.advertise:") && e.contains("host:port"), "{bad:?}: {e}");
    }
    let e = load("advertise = \"h:1\"").unwrap_err().to_string();
    assert!(e.starts_with("metrics.advertise:") && e.contains("metrics.listen"), "{e}");
}

/// The properties the producer fixes, and the message timeout it bounds, are refused under
/// every librdkafka name.
#[test]
fn reserved_kafka_properties_are_refused_under_their_aliases() {
    let with_property = |key: &str| {
        Config::from_toml(&format!("[kafka.properties]\n{key:?} = \"1\"\n{MINIMAL}")).map_err(|e| e.to_string())
    };
    for key in ["message.timeout.ms", "delivery.timeout.ms", "Delivery.Timeout.Ms"] {
        let e = with_property(key).unwrap_err();
        assert!(e.contains(key) && e.contains("kafka.message_timeout_ms"), "{e}");
    }
    for (key, canonical) in [
        ("acks", "acks"),
        ("request.required.acks", "acks"),
        ("max.in.flight", "max.in.flight.requests.per.connection"),
        ("max.in.flight.requests.per.connection", "max.in.flight.requests.per.connection"),
        ("enable.idempotence", "enable.idempotence"),
        ("partitioner", "partitioner"),
    ] {
        let e = with_property(key).unwrap_err();
        assert!(e.contains(&format!("{key:?}")) && e.contains("fixed"), "{e}");
        assert_eq!(e.contains("alias"), key != canonical, "{e}");
    }
    assert!(with_property("batch.size").is_ok());
}

#[test]
fn debug_never_shows_the_password() {
    let c = Config::from_toml(MINIMAL).unwrap();
    assert!(!format!("{c:?}").contains("pw@"));
}

/// `${VAR}` references in `text` read from `vars` only.
fn with_env(text: &str, vars: &[(&str, &str)]) -> Result<Config, ConfigError> {
    let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    Config::from_toml_with(text, &|name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
}

/// [`MINIMAL`] with the password from `${PW}`.
fn from_env() -> String {
    MINIMAL.replace(":pw@", ":${PW}@")
}

#[test]
fn env_expansion_names_an_unset_variable_and_where_it_is_used() {
    let e = with_env(&from_env(), &[]).unwrap_err().to_string();
    assert!(e.contains("${PW}") && e.contains("source[0].url"), "{e}");
    let c = with_env(&from_env(), &[("PW", "plain")]).unwrap();
    assert_eq!(c.sources[0].url.expose(), "postgres://u:plain@localhost/app");
    assert!(with_env("no = \"vars\"", &[]).unwrap_err().to_string().contains("unknown field"));
}

/// An environment value is a string's content, whatever it holds: quotes and backslashes
/// do not break the file, and nothing in it becomes a key.
#[test]
fn env_values_are_string_contents_never_toml() {
    for pw in [r#"a"b"#, r"a\b", "a\"\nshards = 9\n#", "a'b\n[[source]]"] {
        let c = with_env(&from_env(), &[("PW", pw)]).unwrap_or_else(|e| panic!("{pw:?}: {e}"));
        assert_eq!(c.sources.len(), 1, "{pw:?}");
        assert_eq!(c.sources[0].shards, DEFAULT_SHARDS, "{pw:?} injected a key");
        assert_eq!(c.sources[0].url.expose(), format!("postgres://u:{pw}@localhost/app"));
    }
    // Only string values expand: a reference cannot stand for a number or a table.
    assert!(with_env(&format!("{MINIMAL}shards = ${{N}}"), &[("N", "3")]).is_err());
    let c = with_env("[[source]]\nname = \"app\"\nkind = \"${KIND}\"\nurl = \"x\"", &[("KIND", "mysql")]).unwrap();
    assert_eq!(c.sources[0].kind, SourceKind::Mysql);
}

/// No error about the file shows a secret: neither an expanded value nor the text of the
/// line it is on.
#[test]
fn config_errors_never_show_secret_values() {
    let secret = "s3cret-value";
    let cases: Vec<(String, Vec<(&str, &str)>)> = vec![
        // A syntax error on the line of a literal password.
        (format!("[[source]]\nname = \"a\"\nkind = \"postgres\"\nurl = \"postgres://u:{secret}@h/db\" x"), vec![]),
        // An expanded value of the wrong kind.
        (format!("{MINIMAL}\n[source.defaults]\nmode = \"${{S}}\""), vec![("S", secret)]),
        (format!("{}\n[metrics]\nlisten = \"${{S}}\"", from_env()), vec![("PW", "x"), ("S", secret)]),
        (format!("{}\nbogus = \"${{S}}\"", from_env()), vec![("PW", secret), ("S", secret)]),
    ];
    for (text, vars) in cases {
        let e = with_env(&text, &vars).unwrap_err().to_string();
        assert!(!e.contains(secret), "the error shows the secret: {e}");
        assert!(e.contains("line "), "the error says where: {e}");
    }
}

#[test]
fn wal_storage_is_per_shard_partition_and_needs_cdc() {
    let c =
        Config::from_toml(&format!("{MINIMAL}\n[[source.override]]\nshard = 0\npartition = 0\nstorage = \"wal\"\n"))
            .unwrap();
    let s = &c.sources[0];
    assert_eq!(s.settings_for(StreamId { shard: 0, partition: 0 }).storage, Storage::Wal);
    assert_eq!(s.settings_for(StreamId { shard: 0, partition: 1 }).storage, Storage::Table);
    let polling = format!("{MINIMAL}\n[source.defaults]\nstorage = \"wal\"\nmode = \"polling\"\n");
    let e = Config::from_toml(&polling).unwrap_err().to_string();
    assert!(e.contains("storage") && e.contains("mode = \"cdc\""), "{e}");
    let mysql = MINIMAL.replace("postgres", "mysql") + "\n[source.defaults]\nstorage = \"wal\"\n";
    assert!(Config::from_toml(&mysql).is_ok(), "MariaDB/MySQL: a BLACKHOLE table");
    let e = Config::from_toml(&format!("{MINIMAL}\n[source.defaults]\nstorage = \"heap\"\n")).unwrap_err().to_string();
    assert!(e.contains("storage") || e.contains("heap"), "{e}");
}

#[test]
fn delivery_is_per_shard_partition_in_every_mode() {
    let text = format!(
        "{MINIMAL}\n[[source.override]]\nshard = 1\ndelivery = \"exactly-once\"\ntransaction_interval_ms = 50\n"
    );
    let c = Config::from_toml(&text).unwrap();
    let s = &c.sources[0];
    let eo = s.settings_for(StreamId { shard: 1, partition: 0 });
    assert_eq!((eo.delivery, eo.transaction_interval_ms), (Delivery::ExactlyOnce, 50));
    assert_eq!(s.settings_for(StreamId { shard: 0, partition: 0 }).delivery, Delivery::AtLeastOnce);
    assert_eq!(c.kafka.progress_topic, "outbox-streamer-progress");
    let polling = format!("{MINIMAL}\n[source.defaults]\ndelivery = \"exactly-once\"\nmode = \"polling\"\n");
    let polling = Config::from_toml(&polling).unwrap();
    assert_eq!(polling.sources[0].settings_for(StreamId { shard: 0, partition: 0 }).delivery, Delivery::ExactlyOnce);
    let e = Config::from_toml(&format!("{MINIMAL}\n[source.defaults]\ntransaction_max_records = 0\n"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("transaction_max_records"), "{e}");
    let e =
        Config::from_toml(&format!("{MINIMAL}\n[source.defaults]\ndelivery = \"twice\"\n")).unwrap_err().to_string();
    assert!(e.contains("delivery") || e.contains("twice"), "{e}");
    let bad_topic = format!("[kafka]\nprogress_topic = \"no spaces\"\n{MINIMAL}");
    let e = Config::from_toml(&bad_topic).unwrap_err().to_string();
    assert!(e.contains("kafka.progress_topic"), "{e}");
}

#[test]
fn a_rabbitmq_shard_partition_needs_the_section_and_refuses_exactly_once() {
    let rabbit = "[rabbitmq]\nurl = \"amqp://outbox:pw@mq:5672/%2f\"\n";
    let on_shard_1 = "[[source.override]]\nshard = 1\nsink = \"rabbitmq\"\n";
    let e = Config::from_toml(&format!("{MINIMAL}{on_shard_1}")).unwrap_err().to_string();
    assert!(e.contains("rabbitmq") && e.contains("[rabbitmq] section"), "{e}");
    let c = Config::from_toml(&format!("{MINIMAL}{on_shard_1}{rabbit}")).unwrap();
    let s = &c.sources[0];
    assert_eq!(s.settings_for(StreamId { shard: 1, partition: 0 }).sink, SinkKind::Rabbitmq);
    assert_eq!(s.settings_for(StreamId { shard: 0, partition: 0 }).sink, SinkKind::Kafka);
    let e = Config::from_toml(&format!("{MINIMAL}{on_shard_1}delivery = \"exactly-once\"\n{rabbit}"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("exactly-once") && e.contains("at-least-once") && e.contains("shard-partition 1/0"), "{e}");
}

#[test]
fn rabbitmq_settings_are_checked_without_showing_the_password() {
    let with =
        |extra: &str| Config::from_toml(&format!("{MINIMAL}[rabbitmq]\n{extra}")).map(|_| ()).unwrap_err().to_string();
    let e = with("url = \"http://outbox:hunter2@mq/\"");
    assert!(e.contains("rabbitmq.url") && e.contains("amqp://") && !e.contains("hunter2"), "{e}");
    let e = with("url = \"amqp://outbox:hunter2@mq/%2f?heartbeat=5\"");
    assert!(e.contains("query") && !e.contains("hunter2"), "{e}");
    let e = with("url = \"amqp://outbox@mq/%2f\"\nconfirm_window = 0");
    assert!(e.contains("rabbitmq.confirm_window"), "{e}");
    let e = with("url = \"amqp://outbox@mq/%2f\"\nheartbeat_s = 0");
    assert!(e.contains("rabbitmq.heartbeat_s"), "{e}");
}

#[test]
fn the_rabbitmq_uri_carries_the_password_from_a_file_and_the_limits() {
    let path = std::env::temp_dir().join(format!("outbox-rabbit-password-{}", std::process::id()));
    std::fs::write(&path, "p@ss word\nignored\n").unwrap();
    let c = Config::from_toml(&format!(
        "{MINIMAL}[rabbitmq]\nurl = \"amqp://outbox@mq:5672/%2f\"\npassword_file = \"{}\"\nheartbeat_s = 7\n",
        path.display()
    ))
    .unwrap();
    let uri = c.rabbitmq.unwrap().connection_uri().unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(uri, "amqp://outbox:p%40ss%20word@mq:5672/%2f?heartbeat=7&frame_max=131072");
}

#[test]
fn a_tw_tkms_layout_names_its_tables_as_tw_tkms_does() {
    let c = Config::from_toml(&format!("{MINIMAL}\nlayout = \"tw-tkms\"")).unwrap();
    let s = &c.sources[0];
    assert_eq!(s.layout(), crate::layout::Layout::TwTkms);
    assert_eq!(s.stream_names(StreamId { shard: 1, partition: 0 }).table, "outgoing_message_1_0");
    let ours = Config::from_toml(MINIMAL).unwrap();
    assert_eq!(ours.sources[0].stream_names(StreamId { shard: 0, partition: 0 }).table, "outbox_0_0");
    let own = Config::from_toml(&format!("{MINIMAL}\nlayout = \"tw-tkms\"\ntable_prefix = \"tkms\"")).unwrap();
    assert_eq!(own.sources[0].table_prefix, "tkms");
    let e = Config::from_toml(&format!("{MINIMAL}\nlayout = \"tw-tkms\"\n[source.defaults]\nstorage = \"wal\""))
        .unwrap_err()
        .to_string();
    assert!(e.contains("storage") && e.contains("tw-tkms"), "{e}");
    let e = Config::from_toml(&format!("{MINIMAL}\nlayout = \"debezium-ish\"")).unwrap_err().to_string();
    assert!(e.contains("layout") || e.contains("variant"), "{e}");
}

#[test]
fn a_debezium_layout_maps_the_event_routers_columns_and_checks_the_mapping() {
    let c = Config::from_toml(&format!(
        "{MINIMAL}\nlayout = \"debezium\"\n[source.columns]\nheader_columns = {{ id = \"event_id\" }}"
    ))
    .unwrap();
    let layout = c.sources[0].layout();
    assert_eq!(layout.column(crate::layout::Field::Topic), Some("aggregatetype"));
    assert_eq!(c.sources[0].table_prefix, "outbox");
    assert!(Config::from_toml(&format!("{MINIMAL}\nlayout = \"debezium\"")).is_ok(), "the defaults alone");
    let err = |extra: &str| Config::from_toml(&format!("{MINIMAL}\n{extra}")).unwrap_err().to_string();
    assert!(err("layout = \"columns\"").contains("source[0].columns"));
    assert!(err("layout = \"columns\"\n[source.columns]\npayload = \"p\"").contains("columns.topic"));
    assert!(err("[source.columns]\ntopic = \"t\"").contains("layout"));
    assert!(
        err("layout = \"columns\"\n[source.columns]\ntopic = \"t\"\nheader_columns = { outbox-id = \"x\" }")
            .contains("reserved")
    );
    assert!(err("layout = \"columns\"\n[source.columns]\ntopic = \"t\"\nfixed_topic = \"u\"").contains("not both"));
    assert!(
        err("layout = \"columns\"\n[source.columns]\nfixed_topic = \"u\"\ntopic_prefix = \"x\"")
            .contains("topic_prefix")
    );
}

#[test]
fn a_table_setting_names_another_outboxs_one_table() {
    let one = "shards = 1\npartitions = 1";
    let c = Config::from_toml(&format!("{MINIMAL}\n{one}\nlayout = \"debezium\"\ntable = \"outbox\"")).unwrap();
    let names = c.sources[0].stream_names(StreamId { shard: 0, partition: 0 });
    assert_eq!((names.table.as_str(), names.slot.as_str()), ("outbox", "outbox_0_0"));
    let err = |extra: &str| Config::from_toml(&format!("{MINIMAL}\n{extra}")).unwrap_err().to_string();
    assert!(err(&format!("{one}\ntable = \"outbox\"")).contains("source[0].table"), "not for our own layout");
    assert!(err("layout = \"debezium\"\ntable = \"outbox\"\nshards = 2\npartitions = 1").contains("shards"));
    assert!(err(&format!("{one}\nlayout = \"debezium\"\ntable = \"Out-box\"")).contains("lowercase"));
}

#[test]
fn api_settings_are_checked_and_named() {
    let api = |body: &str| Config::from_toml(&format!("{MINIMAL}\n[api]\nlisten = \"127.0.0.1:8080\"\n{body}"));
    let token = "[[api.token]]\nname = \"svc\"\nsecret_env = \"S\"\ntopics = [\"orders\"]";
    let ok = api(&format!("source = \"app\"\n{token}")).unwrap();
    let a = ok.api.as_ref().unwrap();
    assert_eq!((a.max_body_bytes, a.max_batch, a.check_after_s), (1024 * 1024, 500, 180));
    let cases: &[(&str, &str)] = &[
        ("source = \"nope\"\n[[api.token]]\nname = \"svc\"\nsecret_env = \"S\"\ntopics = [\"o\"]", "api.source"),
        ("source = \"app\"", "api.token"),
        (
            "source = \"app\"\nmax_body_bytes = 10\n[[api.token]]\nname = \"svc\"\nsecret_env = \"S\"\ntopics = [\"o\"]",
            "api.max_body_bytes",
        ),
        ("source = \"app\"\n[[api.token]]\nname = \"svc\"\ntopics = [\"o\"]", "api.token[0].secret_env"),
        (
            "source = \"app\"\n[[api.token]]\nname = \"svc\"\nsecret_env = \"S\"\ntopics = [\"o*x\"]",
            "api.token[0].topics",
        ),
        (
            "source = \"app\"\n[[api.token]]\nname = \"s v c\"\nsecret_env = \"S\"\ntopics = [\"o\"]",
            "api.token[0].name",
        ),
        (
            "source = \"app\"\n[[api.token]]\nname = \"svc\"\nsecret_env = \"S\"\ntopics = [\"o\"]\nshards = [5]",
            "api.token[0].shards",
        ),
        (
            "source = \"app\"\n[[api.token]]\nname = \"svc\"\nsecret_env = \"S\"\ntopics = [\"o\"]\ncheckback_urls = [\"https://a.internal\"]",
            "api.token[0].checkback_urls",
        ),
        (
            "source = \"app\"\n[[api.token]]\nname = \"svc\"\nsecret_env = \"S\"\ntopics = [\"o\"]\n[[api.token]]\nname = \"svc\"\nsecret_env = \"T\"\ntopics = [\"o\"]",
            "api.token[1].name",
        ),
    ];
    for (body, field) in cases {
        let e = api(body).unwrap_err().to_string();
        assert!(e.contains(field), "{body}: {e}");
    }
}
