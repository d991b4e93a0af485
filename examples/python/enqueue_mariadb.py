"""Enqueue one outbox message inside a business transaction, with PyMySQL (MariaDB/MySQL).

MariaDB has no enqueue function: the row goes straight into the shard-partition's table
(`<prefix>_<shard>_<partition>`; with one partition per shard that is `<prefix>_0_0`).

    OUTBOX_EXAMPLE_URL=mysql://app:secret@127.0.0.1:3306/app OUTBOX_EXAMPLE_TOPIC=orders \
        examples/python/run enqueue_mariadb.py
"""

import json
import os
import uuid
from urllib.parse import unquote, urlparse

import pymysql

url = urlparse(os.environ["OUTBOX_EXAMPLE_URL"])
topic = os.environ.get("OUTBOX_EXAMPLE_TOPIC", "orders")
table = os.environ.get("OUTBOX_EXAMPLE_TABLE", "outbox_0_0")
customer = os.environ.get("OUTBOX_EXAMPLE_KEY", "customer-42")
trace_id = str(uuid.uuid4())

conn = pymysql.connect(
    host=url.hostname,
    port=url.port or 3306,
    user=unquote(url.username),
    password=unquote(url.password or ""),
    database=url.path.lstrip("/"),
    autocommit=False,
)
try:
    with conn.cursor() as cur:
        cur.execute(
            "CREATE TABLE IF NOT EXISTS example_orders "
            "(id BIGINT AUTO_INCREMENT PRIMARY KEY, customer VARCHAR(64), total DECIMAL(10,2)) ENGINE=InnoDB"
        )
        cur.execute("INSERT INTO example_orders (customer, total) VALUES (%s, %s)", (customer, 42.5))
        order_id = cur.lastrowid
        payload = json.dumps({"order": order_id, "customer": customer, "total": 42.5, "from": "python"})
        cur.execute(
            f"INSERT INTO `{table}` (topic, msg_key, payload, headers) VALUES (%s, %s, %s, %s)",
            (topic, customer.encode(), payload.encode(), json.dumps({"trace-id": trace_id})),
        )
    conn.commit()
finally:
    conn.close()

print(f"order {order_id} committed with its outbox message (trace-id {trace_id})")
