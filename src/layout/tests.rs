use outbox_tw_tkms::{Compression, StoredMessage, encode};

use super::*;

fn stored(m: &StoredMessage) -> RawRow {
    RawRow { payload: Some(encode(m, Compression::Gzip)), ..RawRow::default() }
}

fn message() -> StoredMessage {
    StoredMessage {
        topic: "payments".into(),
        partition: Some(2),
        key: Some("customer-7".into()),
        timestamp_ms: Some(1_600_000_000_001),
        value: b"{\"amount\": 3}".to_vec(),
        headers: vec![("b".into(), b"2".to_vec()), ("a".into(), b"1".to_vec()), ("a".into(), b"3".to_vec())],
        insert_timestamp_ms: Some(1_600_000_000_500),
    }
}

#[test]
fn a_tw_tkms_message_becomes_the_record_its_proxy_would_send() {
    let r = Layout::TwTkms.record(41, stored(&message())).unwrap();
    assert_eq!(r.id, 41);
    assert_eq!(r.topic, "payments");
    assert_eq!(r.key.as_deref(), Some(&b"customer-7"[..]));
    assert_eq!(r.payload.as_deref(), Some(&b"{\"amount\": 3}"[..]));
    assert_eq!(r.kafka_partition, Some(2));
    assert_eq!(r.timestamp_ms, Some(1_600_000_000_001));
    assert_eq!(r.created_at_micros, Some(1_600_000_000_500_000));
    // Stored order, repeated names kept.
    let names: Vec<&str> = r.headers.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["b", "a", "a"]);
    assert!(r.in_table);

    let bare = StoredMessage { partition: None, key: None, timestamp_ms: None, value: Vec::new(), ..message() };
    let r = Layout::TwTkms.record(1, stored(&bare)).unwrap();
    assert_eq!((r.kafka_partition, r.key, r.timestamp_ms), (None, None, None));
    assert_eq!(r.payload.as_deref(), Some(&b""[..]), "tw-tkms sends an empty value, not a tombstone");
}

#[test]
fn a_message_that_cannot_be_sent_names_the_row_and_keeps_its_bytes() {
    let cases = [
        (RawRow::default(), "is NULL"),
        (RawRow { payload: Some(vec![0, 0, 5, 1, 2, 3]), ..RawRow::default() }, "does not decompress as gzip"),
        (RawRow { payload: Some(vec![0, 0, 7]), ..RawRow::default() }, "compression type 7"),
        (stored(&StoredMessage { topic: String::new(), ..message() }), "topic 0 bytes long"),
        (stored(&StoredMessage { partition: Some(u32::MAX), ..message() }), "partition above"),
        (stored(&StoredMessage { timestamp_ms: Some(u64::MAX), ..message() }), "timestamp"),
        (stored(&StoredMessage { headers: vec![("Outbox-Id".into(), b"1".to_vec())], ..message() }), "is reserved"),
    ];
    for (raw, reason) in cases {
        let e = Layout::TwTkms.record(9, raw.clone()).unwrap_err();
        assert_eq!((e.id, e.column), (Some(9), "message"), "{e}");
        assert!(e.reason.contains(reason), "{reason}: {e}");
        assert_eq!(e.raw.map(|r| *r), Some(raw), "the stored bytes go to a dead-letter copy as they are");
    }
}

#[test]
fn reasons_never_quote_the_message() {
    let secret = "card-4111111111111111";
    let m = StoredMessage { topic: format!("{secret}{}", "x".repeat(300)), ..message() };
    let e = Layout::TwTkms.record(3, stored(&m)).unwrap_err().to_string();
    assert!(!e.contains(secret), "{e}");
    let m = StoredMessage { headers: vec![(format!("outbox-{secret}"), Vec::new())], ..message() };
    let e = Layout::TwTkms.record(3, stored(&m)).unwrap_err().to_string();
    assert!(e.contains("outbox-"), "{e}");
}

#[test]
fn each_layout_names_its_columns() {
    assert_eq!(Layout::OutboxStreamer.column(Field::Key), Some("msg_key"));
    assert_eq!(Layout::TwTkms.column(Field::Payload), Some("message"));
    assert_eq!(Layout::TwTkms.column(Field::Topic), None);
    assert_eq!(LayoutKind::TwTkms.default_table_prefix(), "outgoing_message");
}

#[test]
fn setup_names_a_missing_table_or_column_and_how_to_create_it() {
    let tables = vec!["outgoing_message_0_0".to_string(), "outgoing_message_0_1".to_string()];
    let row = |t: &str, c: &str, ty: &str| (t.to_string(), c.to_string(), ty.to_string());
    let found = vec![row("outgoing_message_0_0", "id", "bigint"), row("outgoing_message_0_0", "message", "text")];
    let problems = Layout::TwTkms.check_tables(&tables, &found, true, false);
    assert_eq!(problems.len(), 2, "{problems:?}");
    assert!(problems[0].0.contains("outgoing_message_0_0.message has type text"), "{problems:?}");
    assert!(problems[1].0.contains("outgoing_message_0_1") && problems[1].0.contains("does not exist"));
    assert!(
        problems[1].1.contains("CREATE TABLE outgoing_message_0_1 (id BIGSERIAL PRIMARY KEY, message BYTEA NOT NULL)")
    );
    let good = vec![row("outgoing_message_0_0", "id", "bigint"), row("outgoing_message_0_0", "message", "mediumblob")];
    assert!(Layout::TwTkms.check_tables(&tables[..1], &good, false, false).is_empty());
    assert!(Layout::OutboxStreamer.check_tables(&tables, &[], true, false).is_empty());
}

#[test]
fn a_debezium_mapping_routes_as_the_event_router_does() {
    let m: &'static Mapping = Box::leak(Box::new(
        Mapping { header_columns: [("id".to_string(), "event_id".to_string())].into(), ..Mapping::default() }
            .with_debezium_defaults(),
    ));
    let layout = Layout::Columns(m);
    assert_eq!(layout.column(Field::Topic), Some("aggregatetype"));
    assert_eq!(layout.column(Field::Key), Some("aggregateid"));
    assert_eq!(layout.column(Field::Payload), Some("payload"));
    assert_eq!(layout.header_columns().collect::<Vec<_>>(), [("id", "event_id")]);
    let raw = RawRow {
        topic: Some(b"Order".to_vec()),
        key: Some(b"o-1".to_vec()),
        payload: Some(b"{}".to_vec()),
        extra_headers: vec![("id".into(), b"u-1".to_vec())],
        ..RawRow::default()
    };
    let r = layout.record(5, raw).unwrap();
    assert_eq!(r.topic, "outbox.event.Order");
    assert_eq!(r.headers, [("id".to_string(), b"u-1".to_vec())]);
    let fixed = Box::leak(Box::new(Mapping { fixed_topic: Some("orders".into()), ..Mapping::default() }));
    let r = Layout::Columns(fixed).record(6, RawRow { topic: Some(b"ignored".to_vec()), ..RawRow::default() });
    assert_eq!(r.unwrap().topic, "orders");
}

#[test]
fn setup_explains_that_a_uuid_id_needs_an_integer_id_beside_it() {
    let m: &'static Mapping = Box::leak(Box::new(Mapping::default().with_debezium_defaults()));
    let row = |c: &str, ty: &str| ("outbox_0_0".to_string(), c.to_string(), ty.to_string());
    let found = vec![
        row("id", "uuid"),
        row("aggregatetype", "character varying"),
        row("aggregateid", "text"),
        row("payload", "jsonb"),
    ];
    let tables = ["outbox_0_0".to_string()];
    assert!(Layout::Columns(m).check_tables(&tables, &found, true, true).is_empty(), "CDC reads it by key");
    assert_eq!(uuid_keyed(Layout::Columns(m), &tables, &found, true), tables);
    assert!(uuid_keyed(Layout::TwTkms, &tables, &found, true).is_empty());
    let problems = Layout::Columns(m).check_tables(&tables, &found, true, false);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(problems[0].0.contains("outbox_0_0.id has type uuid"), "{problems:?}");
    assert!(
        problems[0].1.contains(
            "ALTER TABLE \"outbox_0_0\" ADD COLUMN \"seq\" bigint GENERATED ALWAYS AS IDENTITY UNIQUE; then set id = \"seq\""
        ),
        "{problems:?}"
    );
    // Named as the mapping's `id`, the added column identifies rows; the uuid is a header.
    let with_seq: &'static Mapping =
        Box::leak(Box::new(Mapping { id: Some("seq".into()), ..Mapping::default() }.with_debezium_defaults()));
    let layout = Layout::Columns(with_seq);
    assert_eq!((layout.id_column(), layout.header_columns().collect()), ("seq", vec![("id", "id")]));
    let problems = layout.check_tables(&tables, &found, false, false);
    assert!(problems.len() == 1 && problems[0].0.contains("has no column seq"), "{problems:?}");
    assert!(problems[0].1.contains("ALTER TABLE `outbox_0_0` ADD COLUMN `seq` BIGINT NOT NULL AUTO_INCREMENT UNIQUE"));
    let mut found = found;
    found.push(row("seq", "bigint"));
    assert!(layout.check_tables(&tables, &found, true, false).is_empty());
    let missing = layout.id_column_problems(&tables, &found, &[], &tables, true);
    assert!(missing.len() == 1 && missing[0].1.contains("CREATE UNIQUE INDEX \"outbox_0_0_seq_key\""), "{missing:?}");
    let chosen = layout.id_column_problems(&tables, &found, &tables, &[], false);
    assert!(chosen.len() == 1 && chosen[0].0.contains("not numbered by the database"), "{chosen:?}");
    assert!(chosen[0].1.contains("ALTER TABLE `outbox_0_0` MODIFY `seq` BIGINT NOT NULL AUTO_INCREMENT;"));
    assert!(layout.id_column_problems(&tables, &found, &tables, &tables, true).is_empty());
}

#[test]
fn a_column_named_with_another_case_is_named_as_the_table_has_it() {
    let m: &'static Mapping =
        Box::leak(Box::new(Mapping { id: Some("seq".into()), ..Mapping::default() }.with_debezium_defaults()));
    let row = |c: &str, ty: &str| ("outbox_0_0".to_string(), c.to_string(), ty.to_string());
    let found = vec![
        row("id", "char"),
        row("Seq", "bigint"),
        row("aggregatetype", "varchar"),
        row("aggregateid", "varchar"),
        row("payload", "json"),
    ];
    let problems = Layout::Columns(m).check_tables(&["outbox_0_0".to_string()], &found, false, false);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(problems[0].0.contains("has a column Seq, not seq"), "{problems:?}");
    assert!(problems[0].1.contains("\"Seq\""), "{problems:?}");
}
