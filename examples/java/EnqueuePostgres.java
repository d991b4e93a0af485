// Enqueue one outbox message inside a business transaction, with JDBC (PostgreSQL).
// The order row and the outbox row commit together or not at all. With
// OUTBOX_EXAMPLE_FUNCTION=emit it calls <prefix>_emit, which writes a WAL-only message (no outbox
// row) for a shard-partition with storage = "wal"; <prefix>_enqueue does the same for such a
// shard-partition by itself. Both answer the message's outbox-id.
//
//   OUTBOX_EXAMPLE_URL='jdbc:postgresql://127.0.0.1:5432/app?user=app&password=secret' \
//   OUTBOX_EXAMPLE_TOPIC=orders examples/java/run EnqueuePostgres.java

import java.nio.charset.StandardCharsets;
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.util.UUID;

public class EnqueuePostgres {
    public static void main(String[] args) throws Exception {
        String url = System.getenv("OUTBOX_EXAMPLE_URL");
        String topic = System.getenv().getOrDefault("OUTBOX_EXAMPLE_TOPIC", "orders");
        String prefix = System.getenv().getOrDefault("OUTBOX_EXAMPLE_PREFIX", "outbox");
        String customer = System.getenv().getOrDefault("OUTBOX_EXAMPLE_KEY", "customer-42");
        String function = "emit".equals(System.getenv("OUTBOX_EXAMPLE_FUNCTION")) ? "emit" : "enqueue";
        String traceId = UUID.randomUUID().toString();
        try (Connection conn = DriverManager.getConnection(url)) {
            conn.setAutoCommit(false);
            conn.createStatement().execute(
                "CREATE TABLE IF NOT EXISTS example_orders (id bigserial PRIMARY KEY, customer text, total numeric)");
            long orderId;
            try (PreparedStatement order = conn.prepareStatement(
                    "INSERT INTO example_orders (customer, total) VALUES (?, 42.5) RETURNING id")) {
                order.setString(1, customer);
                try (ResultSet rs = order.executeQuery()) {
                    rs.next();
                    orderId = rs.getLong(1);
                }
            }
            String payload = "{\"order\": " + orderId + ", \"customer\": \"" + customer + "\", \"total\": 42.5, \"from\": \"java\"}";
            long outboxId;
            try (PreparedStatement enqueue = conn.prepareStatement(
                    "SELECT " + prefix + "_" + function + "(?, ?, ?, ?::jsonb)")) {
                enqueue.setString(1, topic);
                enqueue.setBytes(2, customer.getBytes(StandardCharsets.UTF_8));
                enqueue.setBytes(3, payload.getBytes(StandardCharsets.UTF_8));
                enqueue.setString(4, "{\"trace-id\": \"" + traceId + "\"}");
                try (ResultSet rs = enqueue.executeQuery()) {
                    rs.next();
                    outboxId = rs.getLong(1);
                }
            }
            conn.commit();
            System.out.println("order " + orderId + " committed with its outbox message " + outboxId
                + " (trace-id " + traceId + ")");
        }
    }
}
