package outboxbench;

import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import java.util.concurrent.TimeUnit;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerConfig;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;
import org.apache.kafka.common.header.internals.RecordHeaders;
import org.apache.kafka.common.serialization.ByteArraySerializer;
import org.apache.kafka.connect.header.Header;
import org.apache.kafka.connect.source.SourceRecord;

import io.debezium.engine.DebeziumEngine;
import io.debezium.engine.RecordChangeEvent;
import io.debezium.engine.format.ChangeEventFormat;
import io.debezium.embedded.Connect;

/**
 * Comparison harness for outbox-bench: Debezium's embedded engine (the engine Debezium Server
 * runs) with the outbox EventRouter SMT, reading the outbox table outbox-bench created, and a
 * Kafka producer that publishes every routed record; a batch's offsets are marked processed
 * only after Kafka acknowledged all of its records.
 *
 * <p>Usage (the wrapper script builds this from outbox-bench's TOML):
 * {@code java -cp ... outboxbench.DebeziumOutboxHarness run|prepare} with system properties
 * {@code dbz.kind} (postgres|mariadb), {@code dbz.url} (the TOML's URL; {@code ${VAR}} is expanded
 * from the environment, so no password is on the command line), {@code dbz.table},
 * {@code dbz.brokers}, {@code dbz.linger.ms}, {@code dbz.state.dir}. Any system property
 * {@code dbz.engine.X=V} is passed to the engine as {@code X=V} (to override a default).
 *
 * <p>{@code prepare} (MariaDB only, run from the wrapper's {@code setup}) starts the connector
 * without a snapshot of data, waits for its first heartbeat, commits that binlog position and
 * the schema history to files and exits, so {@code run} reads the binlog from the moment
 * {@code setup} ran, as our streamer does.
 */
public final class DebeziumOutboxHarness {

    private static final String HEARTBEAT_PREFIX = "__debezium-heartbeat";

    public static void main(String[] args) throws Exception {
        String mode = args.length > 0 ? args[0] : "run";
        boolean prepare = mode.equals("prepare");
        String kind = req("dbz.kind");
        String table = req("dbz.table");
        Path stateDir = Path.of(req("dbz.state.dir"));
        Files.createDirectories(stateDir);
        Url url = Url.parse(expandEnv(req("dbz.url")));

        Properties p = new Properties();
        p.setProperty("name", "outbox-bench-debezium");
        p.setProperty("topic.prefix", "dbzbench");
        p.setProperty("offset.storage", "org.apache.kafka.connect.storage.FileOffsetBackingStore");
        Path offsets = stateDir.resolve("offsets.dat");
        p.setProperty("offset.storage.file.filename", offsets.toString());
        p.setProperty("database.hostname", url.host);
        p.setProperty("database.port", Integer.toString(url.port));
        p.setProperty("database.user", url.user);
        p.setProperty("database.password", url.password);
        if (kind.equals("postgres")) {
            p.setProperty("connector.class", "io.debezium.connector.postgresql.PostgresConnector");
            p.setProperty("database.dbname", url.database);
            p.setProperty("plugin.name", "pgoutput");
            // outbox-streamer setup created a pgoutput slot and a publication (publish = 'insert')
            // of this table, both named like the table: Debezium uses them as they are.
            p.setProperty("slot.name", table);
            p.setProperty("publication.name", table);
            p.setProperty("publication.autocreate.mode", "disabled");
            p.setProperty("snapshot.mode", "no_data");
            p.setProperty("table.include.list", "public." + table);
        } else {
            p.setProperty("connector.class", "io.debezium.connector.mysql.MySqlConnector");
            p.setProperty("database.server.id", Long.toString(5_400_000L + ProcessHandle.current().pid() % 100_000));
            p.setProperty("database.include.list", url.database);
            p.setProperty("table.include.list", url.database + "." + table);
            p.setProperty("schema.history.internal", "io.debezium.storage.file.history.FileSchemaHistory");
            p.setProperty("schema.history.internal.file.filename", stateDir.resolve("schema-history.dat").toString());
            p.setProperty("schema.history.internal.store.only.captured.tables.ddl", "true");
            p.setProperty("include.schema.changes", "false");
            // The streamer's account has no RELOAD/LOCK TABLES: read the schema without locks.
            p.setProperty("snapshot.locking.mode", "none");
            // With offsets from `prepare`: resume from them. Without (prepare failed): snapshot
            // the table, so rows written while the JVM started are not missed.
            p.setProperty("snapshot.mode", prepare || Files.exists(offsets) ? "no_data" : "initial");
            p.setProperty("database.ssl.mode", "disabled");
        }
        // The outbox event router, mapped onto outbox-streamer's columns.
        p.setProperty("transforms", "outbox");
        p.setProperty("transforms.outbox.type", "io.debezium.transforms.outbox.EventRouter");
        p.setProperty("transforms.outbox.table.field.event.id", "id");
        p.setProperty("transforms.outbox.table.field.event.key", "msg_key");
        p.setProperty("transforms.outbox.table.field.event.payload", "payload");
        p.setProperty("transforms.outbox.route.by.field", "topic");
        p.setProperty("transforms.outbox.route.topic.replacement", "${routedByValue}");
        p.setProperty("transforms.outbox.table.fields.additional.placement", "id:header:outbox-id");
        if (prepare) {
            p.setProperty("heartbeat.interval.ms", "200");
            p.setProperty("offset.flush.interval.ms", "0");
        }
        for (Map.Entry<Object, Object> e : System.getProperties().entrySet()) {
            String k = e.getKey().toString();
            if (k.startsWith("dbz.engine.")) {
                p.setProperty(k.substring("dbz.engine.".length()), e.getValue().toString());
            }
        }

        Properties kp = new Properties();
        kp.setProperty(ProducerConfig.BOOTSTRAP_SERVERS_CONFIG, req("dbz.brokers"));
        kp.setProperty(ProducerConfig.ACKS_CONFIG, "all");
        kp.setProperty(ProducerConfig.ENABLE_IDEMPOTENCE_CONFIG, "true");
        kp.setProperty(ProducerConfig.LINGER_MS_CONFIG, System.getProperty("dbz.linger.ms", "5"));
        kp.setProperty(ProducerConfig.COMPRESSION_TYPE_CONFIG, "lz4");
        kp.setProperty(ProducerConfig.CLIENT_ID_CONFIG, "outbox-bench-debezium");

        CountDownLatch done = new CountDownLatch(1);
        boolean[] failed = {false};
        CountDownLatch prepared = new CountDownLatch(1);
        try (KafkaProducer<byte[], byte[]> producer =
                new KafkaProducer<>(kp, new ByteArraySerializer(), new ByteArraySerializer())) {
            Sink sink = new Sink(producer, prepare ? prepared : null);
            DebeziumEngine<RecordChangeEvent<SourceRecord>> engine = DebeziumEngine
                    .create(ChangeEventFormat.of(Connect.class))
                    .using(p)
                    .notifying(sink)
                    .using((success, message, error) -> {
                        if (!success) {
                            failed[0] = true;
                            System.err.println("debezium engine stopped: " + message);
                            if (error != null) {
                                error.printStackTrace();
                            }
                        }
                        done.countDown();
                        prepared.countDown();
                    })
                    .build();
            ExecutorService executor = Executors.newSingleThreadExecutor();
            executor.execute(engine);
            Runtime.getRuntime().addShutdownHook(new Thread(() -> {
                closeQuietly(engine);
                try {
                    done.await(30, TimeUnit.SECONDS);
                } catch (InterruptedException e) {
                    Thread.currentThread().interrupt();
                }
            }));
            if (prepare) {
                boolean ok = prepared.await(60, TimeUnit.SECONDS) && !failed[0];
                closeQuietly(engine);
                done.await(30, TimeUnit.SECONDS);
                executor.shutdownNow();
                System.err.println(ok ? "prepared: binlog position and schema history stored in " + stateDir
                        : "prepare failed: the engine stopped, or no heartbeat within 60 s");
                Runtime.getRuntime().halt(ok && Files.exists(offsets) ? 0 : 1);
            }
            done.await();
            executor.shutdownNow();
        }
        // A failed engine must end the process (non-daemon threads would keep it alive).
        if (failed[0]) {
            Runtime.getRuntime().halt(1);
        }
    }

    static void closeQuietly(DebeziumEngine<?> engine) {
        try {
            engine.close();
        } catch (Exception e) {
            // already stopped (e.g. after a failure): nothing to close
        }
    }

    /** Publishes each routed record; marks a batch processed only once Kafka acknowledged it. */
    static final class Sink implements DebeziumEngine.ChangeConsumer<RecordChangeEvent<SourceRecord>> {
        private final KafkaProducer<byte[], byte[]> producer;
        private final CountDownLatch prepared;

        Sink(KafkaProducer<byte[], byte[]> producer, CountDownLatch prepared) {
            this.producer = producer;
            this.prepared = prepared;
        }

        @Override
        public void handleBatch(List<RecordChangeEvent<SourceRecord>> records,
                DebeziumEngine.RecordCommitter<RecordChangeEvent<SourceRecord>> committer) throws InterruptedException {
            List<Future<RecordMetadata>> sent = new ArrayList<>(records.size());
            boolean heartbeat = false;
            for (RecordChangeEvent<SourceRecord> event : records) {
                SourceRecord r = event.record();
                if (r.topic() != null && r.topic().startsWith(HEARTBEAT_PREFIX)) {
                    heartbeat = true;
                    continue;
                }
                if (r.value() == null || prepared != null) {
                    continue; // tombstones are not produced by the router for inserts; nothing to send
                }
                RecordHeaders headers = new RecordHeaders();
                for (Header h : r.headers()) {
                    headers.add(h.key(), headerBytes(h.value()));
                }
                sent.add(producer.send(new ProducerRecord<>(r.topic(), null, bytes(r.key()), bytes(r.value()), headers)));
            }
            for (Future<RecordMetadata> f : sent) {
                try {
                    f.get();
                } catch (ExecutionException e) {
                    throw new RuntimeException("Kafka did not acknowledge a record", e.getCause());
                }
            }
            for (RecordChangeEvent<SourceRecord> event : records) {
                committer.markProcessed(event);
            }
            committer.markBatchFinished();
            if (heartbeat && prepared != null) {
                prepared.countDown();
            }
        }
    }

    static byte[] bytes(Object v) {
        if (v == null) {
            return null;
        }
        if (v instanceof byte[] b) {
            return b;
        }
        if (v instanceof ByteBuffer bb) {
            ByteBuffer d = bb.duplicate();
            byte[] out = new byte[d.remaining()];
            d.get(out);
            return out;
        }
        return v.toString().getBytes(StandardCharsets.UTF_8);
    }

    /** Header values as text (`outbox-id` as a decimal number, as outbox-streamer writes it). */
    static byte[] headerBytes(Object v) {
        if (v == null) {
            return null;
        }
        if (v instanceof byte[] || v instanceof ByteBuffer) {
            return bytes(v);
        }
        return v.toString().getBytes(StandardCharsets.UTF_8);
    }

    static String req(String name) {
        String v = System.getProperty(name);
        if (v == null || v.isEmpty()) {
            throw new IllegalArgumentException("missing system property " + name);
        }
        return v;
    }

    /** Expands {@code ${VAR}} from the environment. */
    static String expandEnv(String s) {
        Matcher m = Pattern.compile("\\$\\{([A-Za-z_][A-Za-z0-9_]*)\\}").matcher(s);
        StringBuilder out = new StringBuilder();
        while (m.find()) {
            String v = System.getenv(m.group(1));
            if (v == null) {
                throw new IllegalArgumentException("environment variable " + m.group(1) + " is not set");
            }
            m.appendReplacement(out, Matcher.quoteReplacement(v));
        }
        m.appendTail(out);
        return out.toString();
    }

    /** scheme://user:password@host:port/database[?…] */
    record Url(String user, String password, String host, int port, String database) {
        static Url parse(String s) throws IOException {
            Matcher m = Pattern.compile("^[a-z]+://([^:@/]+)(?::([^@]*))?@([^:/?]+)(?::(\\d+))?/([^?]+).*$").matcher(s);
            if (!m.matches()) {
                throw new IOException("cannot parse the database URL");
            }
            String pw = m.group(2) == null ? "" : java.net.URLDecoder.decode(m.group(2), StandardCharsets.UTF_8);
            int port = m.group(4) == null ? (s.startsWith("postgres") ? 5432 : 3306) : Integer.parseInt(m.group(4));
            return new Url(m.group(1), pw, m.group(3), port, m.group(5));
        }
    }
}
