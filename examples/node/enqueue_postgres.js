// Enqueue one outbox message inside a business transaction, with node-postgres (PostgreSQL).
// The order row and the outbox row commit together or not at all.
//
//   OUTBOX_EXAMPLE_URL=postgres://app:secret@127.0.0.1:5432/app OUTBOX_EXAMPLE_TOPIC=orders \
//     npm --prefix examples/node install && npm --prefix examples/node start
'use strict';
const crypto = require('node:crypto');
const { Client } = require('pg');

async function main() {
  const topic = process.env.OUTBOX_EXAMPLE_TOPIC || 'orders';
  const prefix = process.env.OUTBOX_EXAMPLE_PREFIX || 'outbox';
  const customer = process.env.OUTBOX_EXAMPLE_KEY || 'customer-42';
  const traceId = crypto.randomUUID();
  const client = new Client({ connectionString: process.env.OUTBOX_EXAMPLE_URL });
  await client.connect();
  try {
    await client.query('BEGIN');
    await client.query('CREATE TABLE IF NOT EXISTS example_orders (id bigserial PRIMARY KEY, customer text, total numeric)');
    const { rows } = await client.query('INSERT INTO example_orders (customer, total) VALUES ($1, 42.5) RETURNING id', [customer]);
    const orderId = rows[0].id;
    const payload = JSON.stringify({ order: Number(orderId), customer, total: 42.5, from: 'node' });
    await client.query(`SELECT ${prefix}_enqueue($1, $2, $3, $4::jsonb)`, [
      topic, Buffer.from(customer), Buffer.from(payload), JSON.stringify({ 'trace-id': traceId }),
    ]);
    await client.query('COMMIT');
    console.log(`order ${orderId} committed with its outbox message (trace-id ${traceId})`);
  } catch (e) {
    await client.query('ROLLBACK');
    throw e;
  } finally {
    await client.end();
  }
}

main().catch((e) => { console.error('enqueuing:', e.message); process.exit(1); });
