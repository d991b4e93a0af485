// Enqueue one outbox message inside a business transaction, with JDBC (MariaDB/MySQL).
// MariaDB has no enqueue function: the row goes straight into the shard-partition's table.
//
//   OUTBOX_EXAMPLE_URL='jdbc:mariadb://127.0.0.1:3306/app?user=app&password=secret' \
//   OUTBOX_EXAMPLE_TOPIC=orders examples/java/run EnqueueMariaDb.java

import java.nio.charset.StandardCharsets;
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.Statement;
import java.util.UUID;

public class EnqueueMariaDb {
    public static void main(String[] args) throws Exception {
        String url = System.getenv("OUTBOX_EXAMPLE_URL");
        String topic = System.getenv().getOrDefault("OUTBOX_EXAMPLE_TOPIC", "orders");
        String table = System.getenv().getOrDefault("OUTBOX_EXAMPLE_TABLE", "outbox_0_0");
        String customer = System.getenv().getOrDefault("OUTBOX_EXAMPLE_KEY", "customer-42");
        String traceId = UUID.randomUUID().toString();
        try (Connection conn = DriverManager.getConnection(url)) {
            conn.setAutoCommit(false);
            conn.createStatement().execute(
                "CREATE TABLE IF NOT EXISTS example_orders "
                + "(id BIGINT AUTO_INCREMENT PRIMARY KEY, customer VARCHAR(64), total DECIMAL(10,2)) ENGINE=InnoDB");
            long orderId;
            try (PreparedStatement order = conn.prepareStatement(
                    "INSERT INTO example_orders (customer, total) VALUES (?, 42.5)", Statement.RETURN_GENERATED_KEYS)) {
                order.setString(1, customer);
                order.executeUpdate();
                try (ResultSet rs = order.getGeneratedKeys()) {
                    rs.next();
                    orderId = rs.getLong(1);
                }
            }
            String payload = "{\"order\": " + orderId + ", \"customer\": \"" + customer + "\", \"total\": 42.5, \"from\": \"java\"}";
            try (PreparedStatement enqueue = conn.prepareStatement(
                    "INSERT INTO `" + table + "` (topic, msg_key, payload, headers) VALUES (?, ?, ?, ?)")) {
                enqueue.setString(1, topic);
                enqueue.setBytes(2, customer.getBytes(StandardCharsets.UTF_8));
                enqueue.setBytes(3, payload.getBytes(StandardCharsets.UTF_8));
                enqueue.setString(4, "{\"trace-id\": \"" + traceId + "\"}");
                enqueue.executeUpdate();
            }
            conn.commit();
            System.out.println("order " + orderId + " committed with its outbox message (trace-id " + traceId + ")");
        }
    }
}
