//! Enqueue one outbox message inside a business transaction, with tokio-postgres (PostgreSQL).
//! The order row and the outbox row commit together or not at all.
//!
//! ```sh
//! OUTBOX_EXAMPLE_URL=postgres://app:secret@127.0.0.1:5432/app OUTBOX_EXAMPLE_TOPIC=orders \
//!     cargo run --example enqueue_postgres
//! ```

use std::time::{SystemTime, UNIX_EPOCH};

use tokio_postgres::NoTls;

fn env(name: &str, fallback: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| fallback.to_string())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("OUTBOX_EXAMPLE_URL").map_err(|_| "set OUTBOX_EXAMPLE_URL to a postgres:// URL")?;
    let topic = env("OUTBOX_EXAMPLE_TOPIC", "orders");
    let prefix = env("OUTBOX_EXAMPLE_PREFIX", "outbox");
    let customer = env("OUTBOX_EXAMPLE_KEY", "customer-42");
    let trace_id = format!("{:x}", SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos());

    let (mut client, connection) = tokio_postgres::connect(&url, NoTls).await?;
    tokio::spawn(connection);
    let tx = client.transaction().await?; // rolled back if dropped before commit
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS example_orders (id bigserial PRIMARY KEY, customer text, total numeric)",
    )
    .await?;
    let order_id: i64 = tx
        .query_one("INSERT INTO example_orders (customer, total) VALUES ($1, 42.5) RETURNING id", &[&customer])
        .await?
        .get(0);
    let payload = format!(r#"{{"order": {order_id}, "customer": "{customer}", "total": 42.5, "from": "rust"}}"#);
    let headers = format!(r#"{{"trace-id": "{trace_id}"}}"#);
    tx.execute(
        &format!("SELECT {prefix}_enqueue($1, $2, $3, $4::text::jsonb)"),
        &[&topic, &customer.as_bytes(), &payload.as_bytes(), &headers],
    )
    .await?;
    tx.commit().await?;
    println!("order {order_id} committed with its outbox message (trace-id {trace_id})");
    Ok(())
}
