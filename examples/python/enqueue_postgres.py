"""Enqueue one outbox message inside a business transaction, with psycopg (PostgreSQL).

The order row and the outbox row commit together or not at all; outbox-streamer publishes the
message to Kafka after the commit, keyed by the customer, with a trace-id header.
With OUTBOX_EXAMPLE_FUNCTION=emit it calls `<prefix>_emit`, which writes a WAL-only message (no
outbox row) for a shard-partition with `storage = "wal"`; `<prefix>_enqueue` does the same for
such a shard-partition by itself. Both answer the message's outbox-id.

    OUTBOX_EXAMPLE_URL=postgresql://app:secret@127.0.0.1:5432/app OUTBOX_EXAMPLE_TOPIC=orders \
        examples/python/run enqueue_postgres.py
"""

import json
import os
import uuid

import psycopg

url = os.environ["OUTBOX_EXAMPLE_URL"]
topic = os.environ.get("OUTBOX_EXAMPLE_TOPIC", "orders")
prefix = os.environ.get("OUTBOX_EXAMPLE_PREFIX", "outbox")
customer = os.environ.get("OUTBOX_EXAMPLE_KEY", "customer-42")
function = {"enqueue": "enqueue", "emit": "emit"}[os.environ.get("OUTBOX_EXAMPLE_FUNCTION", "enqueue")]
trace_id = str(uuid.uuid4())

with psycopg.connect(url) as conn:  # one transaction, committed when the block ends
    conn.execute("CREATE TABLE IF NOT EXISTS example_orders (id bigserial PRIMARY KEY, customer text, total numeric)")
    order_id = conn.execute(
        "INSERT INTO example_orders (customer, total) VALUES (%s, %s) RETURNING id", (customer, 42.5)
    ).fetchone()[0]
    payload = json.dumps({"order": order_id, "customer": customer, "total": 42.5, "from": "python"})
    outbox_id = conn.execute(
        f"SELECT {prefix}_{function}(%s, %s, %s, %s::jsonb)",
        (topic, customer.encode(), payload.encode(), json.dumps({"trace-id": trace_id})),
    ).fetchone()[0]

print(f"order {order_id} committed with its outbox message {outbox_id} (trace-id {trace_id})")
