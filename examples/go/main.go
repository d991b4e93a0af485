// Enqueue one outbox message inside a business transaction, with pgx (PostgreSQL).
// The order row and the outbox row commit together or not at all.
//
//	cd examples/go && OUTBOX_EXAMPLE_URL=postgres://app:secret@127.0.0.1:5432/app OUTBOX_EXAMPLE_TOPIC=orders go run .
package main

import (
	"context"
	"crypto/rand"
	"fmt"
	"os"

	"github.com/jackc/pgx/v5"
)

func env(name, fallback string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return fallback
}

func main() {
	ctx := context.Background()
	topic := env("OUTBOX_EXAMPLE_TOPIC", "orders")
	prefix := env("OUTBOX_EXAMPLE_PREFIX", "outbox")
	customer := env("OUTBOX_EXAMPLE_KEY", "customer-42")
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	traceID := fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])

	conn, err := pgx.Connect(ctx, os.Getenv("OUTBOX_EXAMPLE_URL"))
	if err != nil {
		fmt.Fprintln(os.Stderr, "connecting:", err)
		os.Exit(1)
	}
	defer conn.Close(ctx)

	var orderID int64
	err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error { // commits if the function returns nil
		if _, err := tx.Exec(ctx, "CREATE TABLE IF NOT EXISTS example_orders (id bigserial PRIMARY KEY, customer text, total numeric)"); err != nil {
			return err
		}
		if err := tx.QueryRow(ctx, "INSERT INTO example_orders (customer, total) VALUES ($1, 42.5) RETURNING id", customer).Scan(&orderID); err != nil {
			return err
		}
		payload := fmt.Sprintf(`{"order": %d, "customer": %q, "total": 42.5, "from": "go"}`, orderID, customer)
		headers := fmt.Sprintf(`{"trace-id": %q}`, traceID)
		_, err := tx.Exec(ctx, "SELECT "+prefix+"_enqueue($1, $2, $3, $4::jsonb)", topic, []byte(customer), []byte(payload), headers)
		return err
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "enqueuing:", err)
		os.Exit(1)
	}
	fmt.Printf("order %d committed with its outbox message (trace-id %s)\n", orderID, traceID)
}
