"""A service whose orders live in SQLite — a database outbox-streamer does not read — sending an
"order placed" message through the message API (docs/api.md): prepare, local work, commit or
roll back; and the check-back endpoint that tells the streamer what happened to an order when
the service died before deciding. Standard library only.

    OUTBOX_API_URL=http://127.0.0.1:8080 OUTBOX_API_TOKEN=... OUTBOX_EXAMPLE_TOPIC=orders \
    OUTBOX_EXAMPLE_DB=orders.sqlite OUTBOX_EXAMPLE_ORDER=order-7 python3 api_orders.py commit

Modes (the first argument):
  commit    prepare, insert the order, commit
  rollback  prepare, fail the local work, roll back
  crash     prepare, insert the order, then exit without deciding: the check-back decides
  serve     run the check-back endpoint on OUTBOX_EXAMPLE_LISTEN (host:port) until killed
"""

import http.server
import json
import os
import sqlite3
import sys
import urllib.error
import urllib.request

API = os.environ.get("OUTBOX_API_URL", "http://127.0.0.1:8080")
TOKEN = os.environ["OUTBOX_API_TOKEN"]
DB = os.environ.get("OUTBOX_EXAMPLE_DB", "orders.sqlite")


def call(method, path, body=None):
    """One API call; returns (status, JSON answer). Every call is idempotent: repeat on failure."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(API + path, data=data, method=method)
    request.add_header("Authorization", "Bearer " + TOKEN)
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read() or b"null")
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read() or b"null")


def orders():
    db = sqlite3.connect(DB)
    db.execute("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, total REAL NOT NULL)")
    return db


def place(mode):
    order = os.environ["OUTBOX_EXAMPLE_ORDER"]
    message = {
        "topic": os.environ["OUTBOX_EXAMPLE_TOPIC"],
        "key": order,
        "payload": {"order": order, "total": 42.5, "from": "python"},
        "headers": {"trace-id": "py-" + order},
        "business_key": order,
        "idempotency_key": order + "-placed",
    }
    if os.environ.get("OUTBOX_EXAMPLE_CHECKBACK_URL"):
        message["checkback_url"] = os.environ["OUTBOX_EXAMPLE_CHECKBACK_URL"]
    status, prepared = call("POST", "/v1/messages", message)
    if status not in (200, 201):
        sys.exit(f"prepare refused: {status} {prepared}")
    mid = prepared["id"]
    print(f"prepared message {mid} for {order}")
    db = orders()
    try:
        with db:  # the local transaction
            db.execute("INSERT INTO orders (id, total) VALUES (?, ?)", (order, 42.5))
            if mode == "rollback":
                raise RuntimeError("payment declined")
    except RuntimeError as why:
        status, answer = call("POST", f"/v1/messages/{mid}/rollback")
        print(f"local work failed ({why}); rollback: {status} {answer['state']}")
        return
    if mode == "crash":
        print("order stored; exiting before the commit call")
        os._exit(0)
    status, answer = call("POST", f"/v1/messages/{mid}/commit")
    print(f"order stored; commit: {status} {answer['state']}")


class CheckBack(http.server.BaseHTTPRequestHandler):
    """POST {"messages": [{"id", "business_key"}]}: commit what is in the orders table."""

    def do_POST(self):
        if self.headers.get("Authorization") != "Bearer " + TOKEN:
            self.send_error(401)
            return
        question = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        db = orders()
        decisions = []
        for m in question["messages"]:
            stored = db.execute("SELECT 1 FROM orders WHERE id = ?", (m["business_key"],)).fetchone()
            decisions.append({"id": m["id"], "decision": "commit" if stored else "rollback"})
        body = json.dumps({"decisions": decisions}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def serve():
    host, port = os.environ["OUTBOX_EXAMPLE_LISTEN"].rsplit(":", 1)
    server = http.server.ThreadingHTTPServer((host, int(port)), CheckBack)
    print(f"check-back endpoint on {host}:{port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "commit"
    if mode == "serve":
        serve()
    elif mode in ("commit", "rollback", "crash"):
        place(mode)
    else:
        sys.exit(__doc__)
