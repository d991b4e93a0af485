// A service whose orders live in SQLite — a database outbox-streamer does not read — sending an
// "order placed" message through the message API (docs/api.md): prepare, local work, commit or
// roll back; and the check-back endpoint that tells the streamer what happened to an order when
// the service died before deciding. JDK HTTP client and server, sqlite-jdbc (pom.xml).
//
//   OUTBOX_API_URL=http://127.0.0.1:8080 OUTBOX_API_TOKEN=... OUTBOX_EXAMPLE_TOPIC=orders \
//   OUTBOX_EXAMPLE_DB=orders.sqlite OUTBOX_EXAMPLE_ORDER=order-7 examples/java/run ApiOrders.java commit
//
// Modes: commit | rollback | crash (exit after the local work, before deciding) | serve (the
// check-back endpoint on OUTBOX_EXAMPLE_LISTEN, host:port, until killed).

import com.sun.net.httpserver.HttpExchange;
import com.sun.net.httpserver.HttpServer;
import java.io.IOException;
import java.net.InetSocketAddress;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.charset.StandardCharsets;
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.SQLException;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

public class ApiOrders {
    static final String API = env("OUTBOX_API_URL", "http://127.0.0.1:8080");
    static final String TOKEN = System.getenv("OUTBOX_API_TOKEN");
    static final String DB = "jdbc:sqlite:" + env("OUTBOX_EXAMPLE_DB", "orders.sqlite");
    static final HttpClient HTTP = HttpClient.newBuilder().connectTimeout(Duration.ofSeconds(10)).build();

    static String env(String name, String otherwise) {
        String v = System.getenv(name);
        return v == null || v.isEmpty() ? otherwise : v;
    }

    /** A JSON string literal. */
    static String quote(String s) {
        StringBuilder b = new StringBuilder("\"");
        for (char c : s.toCharArray()) {
            if (c == '"' || c == '\\') b.append('\\').append(c);
            else if (c < 0x20) b.append(String.format("\\u%04x", (int) c));
            else b.append(c);
        }
        return b.append('"').toString();
    }

    /** The value of the first "field": "value" in a flat JSON answer (enough for these answers). */
    static String field(String json, String name) {
        Matcher m = Pattern.compile("\"" + name + "\"\\s*:\\s*\"([^\"]*)\"").matcher(json);
        return m.find() ? m.group(1) : null;
    }

    /** One API call: the status and the body. Every call is idempotent: repeat it on failure. */
    static HttpResponse<String> call(String path, String body) throws IOException, InterruptedException {
        HttpRequest request = HttpRequest.newBuilder(URI.create(API + path))
                .timeout(Duration.ofSeconds(30))
                .header("Authorization", "Bearer " + TOKEN)
                .header("Content-Type", "application/json")
                .POST(HttpRequest.BodyPublishers.ofString(body == null ? "" : body))
                .build();
        return HTTP.send(request, HttpResponse.BodyHandlers.ofString());
    }

    static Connection orders() throws SQLException {
        Connection db = DriverManager.getConnection(DB);
        db.createStatement().execute("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, total REAL NOT NULL)");
        return db;
    }

    static void place(String mode) throws Exception {
        String order = System.getenv("OUTBOX_EXAMPLE_ORDER");
        String checkback = System.getenv("OUTBOX_EXAMPLE_CHECKBACK_URL");
        String message = "{\"topic\": " + quote(System.getenv("OUTBOX_EXAMPLE_TOPIC"))
                + ", \"key\": " + quote(order)
                + ", \"payload\": {\"order\": " + quote(order) + ", \"total\": 42.5, \"from\": \"java\"}"
                + ", \"headers\": {\"trace-id\": " + quote("java-" + order) + "}"
                + ", \"business_key\": " + quote(order)
                + ", \"idempotency_key\": " + quote(order + "-placed")
                + (checkback == null ? "" : ", \"checkback_url\": " + quote(checkback))
                + "}";
        HttpResponse<String> prepared = call("/v1/messages", message);
        if (prepared.statusCode() != 200 && prepared.statusCode() != 201) {
            throw new IllegalStateException("prepare refused: " + prepared.statusCode() + " " + prepared.body());
        }
        String id = field(prepared.body(), "id");
        System.out.println("prepared message " + id + " for " + order);
        try (Connection db = orders()) {
            db.setAutoCommit(false);
            try (PreparedStatement insert = db.prepareStatement("INSERT INTO orders (id, total) VALUES (?, ?)")) {
                insert.setString(1, order);
                insert.setDouble(2, 42.5);
                insert.executeUpdate();
                if (mode.equals("rollback")) throw new SQLException("payment declined");
                db.commit();
            } catch (SQLException why) {
                db.rollback();
                HttpResponse<String> r = call("/v1/messages/" + id + "/rollback", null);
                System.out.println("local work failed (" + why.getMessage() + "); rollback: " + r.statusCode() + " " + field(r.body(), "state"));
                return;
            }
        }
        if (mode.equals("crash")) {
            System.out.println("order stored; exiting before the commit call");
            Runtime.getRuntime().halt(0);
        }
        HttpResponse<String> r = call("/v1/messages/" + id + "/commit", null);
        System.out.println("order stored; commit: " + r.statusCode() + " " + field(r.body(), "state"));
    }

    /** POST {"messages": [{"id", "business_key"}]}: commit what is in the orders table. */
    static void checkBack(HttpExchange exchange) throws IOException {
        try (exchange) {
            if (!("Bearer " + TOKEN).equals(exchange.getRequestHeaders().getFirst("Authorization"))) {
                exchange.sendResponseHeaders(401, -1);
                return;
            }
            String question = new String(exchange.getRequestBody().readAllBytes(), StandardCharsets.UTF_8);
            Matcher m = Pattern.compile("\\{\\s*\"id\"\\s*:\\s*\"([^\"]*)\"\\s*,\\s*\"business_key\"\\s*:\\s*\"([^\"]*)\"\\s*\\}").matcher(question);
            List<String> decisions = new ArrayList<>();
            try (Connection db = orders(); PreparedStatement find = db.prepareStatement("SELECT 1 FROM orders WHERE id = ?")) {
                while (m.find()) {
                    find.setString(1, m.group(2));
                    boolean stored = find.executeQuery().next();
                    decisions.add("{\"id\": " + quote(m.group(1)) + ", \"decision\": \"" + (stored ? "commit" : "rollback") + "\"}");
                }
            } catch (SQLException e) {
                exchange.sendResponseHeaders(503, -1);
                return;
            }
            byte[] body = ("{\"decisions\": [" + String.join(", ", decisions) + "]}").getBytes(StandardCharsets.UTF_8);
            exchange.getResponseHeaders().set("Content-Type", "application/json");
            exchange.sendResponseHeaders(200, body.length);
            exchange.getResponseBody().write(body);
        }
    }

    static void serve() throws IOException {
        String[] hostPort = System.getenv("OUTBOX_EXAMPLE_LISTEN").split(":");
        HttpServer server = HttpServer.create(new InetSocketAddress(hostPort[0], Integer.parseInt(hostPort[1])), 16);
        server.createContext("/", ApiOrders::checkBack);
        server.start();
        System.out.println("check-back endpoint on " + hostPort[0] + ":" + hostPort[1]);
    }

    public static void main(String[] args) throws Exception {
        String mode = args.length > 0 ? args[0] : "commit";
        switch (mode) {
            case "serve" -> serve();
            case "commit", "rollback", "crash" -> place(mode);
            default -> throw new IllegalArgumentException("mode: commit | rollback | crash | serve");
        }
    }
}
