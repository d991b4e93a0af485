//! `outbox-streamer skip` on PostgreSQL: adds to the stream's skip list (or discards its backlog) in
//! its checkpoint row, refused while the stream is being read (see `crate::cli::skip`).

use anyhow::{Context, bail};

use super::connect::pg_target;
use crate::config::SourceConfig;
use crate::names::{StreamId, StreamNames, checkpoint_table};
use crate::skip::{SkipList, What, add, done_message};

pub(super) async fn skip(source: &SourceConfig, id: StreamId, what: &What) -> anyhow::Result<String> {
    let names = source.stream_names(id);
    let checkpoint = checkpoint_table(&source.table_prefix);
    let target = pg_target(source, None)?;
    let mut client = target.connect().await.with_context(|| format!("connecting to {}", target.display()))?;
    let state = outbox_postgres::slot::state(&client, &names.slot).await?;
    if let Some(pid) = state.active_pid {
        bail!(
            "the stream is running: slot {:?} is held by backend {pid}; stop its streamer (or wait until it halts), then run this again",
            names.slot
        );
    }
    if let What::Message { at, id } = what {
        message_waits(&client, &names, at, *id).await?;
    }
    let layout = source.layout();
    let keyed = layout.mapping().is_some() && super::keyed::is_uuid(&client, &names.table, layout.id_column()).await?;
    let what = &match what {
        What::Id(id) if keyed => bail!(
            "--id {id}: {} is identified by the uuid {} alone; give --id the uuid the halt message names",
            names.table,
            layout.id_column()
        ),
        What::Key(key) if !keyed => bail!(
            "--id {key:?}: {} is identified by the integer {}; give --id the number the halt message names",
            names.table,
            layout.id_column()
        ),
        what => what.clone(),
    };
    let (table, cp) = (outbox_postgres::setup::ident(&names.table), outbox_postgres::setup::ident(&checkpoint));
    let tx = client.build_transaction().isolation_level(tokio_postgres::IsolationLevel::RepeatableRead).start().await?;
    let row = tx
        .query_opt(
            &format!("SELECT skip_ids, skip_transactions FROM {cp} WHERE stream = $1 FOR UPDATE"),
            &[&names.table],
        )
        .await
        .with_context(|| format!("reading {checkpoint} (run `outbox-streamer setup` if a column is missing)"))?
        .with_context(|| format!("{checkpoint} has no row for {}; run `outbox-streamer setup`", names.table))?;
    let mut list = SkipList::parse(row.get(0), row.get(1)).map_err(anyhow::Error::msg)?;
    let deleted = match what {
        What::Backlog => {
            // The snapshot is taken by this statement, and the WAL position read after it:
            // every transaction the delete sees committed before that position.
            let end: String = tx.query_one("SELECT pg_current_wal_insert_lsn()::text", &[]).await?.get(0);
            let deleted = tx.execute(&format!("DELETE FROM {table}"), &[]).await?;
            tx.execute(
                &format!("UPDATE {cp} SET published_lsn = $2::text::pg_lsn, updated_at = now() WHERE stream = $1"),
                &[&names.table, &end],
            )
            .await?;
            tx.commit().await?;
            client
                .execute(
                    "SELECT pg_replication_slot_advance($1, $2::text::pg_lsn) FROM pg_replication_slots
                     WHERE slot_name = $1 AND confirmed_flush_lsn < $2::text::pg_lsn",
                    &[&names.slot, &end],
                )
                .await
                .with_context(|| format!("moving slot {} to {end}", names.slot))?;
            return Ok(done_message(what, deleted));
        }
        What::Id(row_id) => {
            let id = outbox_postgres::setup::ident(source.layout().id_column());
            tx.execute(&format!("DELETE FROM {table} WHERE {id} = $1::int8"), &[row_id]).await?
        }
        What::Key(key) => {
            let id = outbox_postgres::setup::ident(layout.id_column());
            tx.execute(&format!("DELETE FROM {table} WHERE {id} = $1::text::uuid"), &[key])
                .await
                .with_context(|| format!("--id {key:?}: not a uuid of {}", names.table))?
        }
        What::Transaction(_) | What::Message { .. } => 0,
    };
    let end: String = tx.query_one("SELECT pg_current_wal_insert_lsn()::text", &[]).await?.get(0);
    add(&mut list, what, &end);
    tx.execute(
        &format!("UPDATE {cp} SET skip_ids = $2, skip_transactions = $3, updated_at = now() WHERE stream = $1"),
        &[&names.table, &list.ids_text(), &list.transactions_text()],
    )
    .await?;
    tx.commit().await?;
    Ok(done_message(what, deleted))
}

/// Refuses `--message` unless a message of the stream's prefix at that LSN waits in its slot:
/// a mistyped LSN, or one already published, would otherwise be accepted and change nothing
/// while the halt it was meant to clear stays.
async fn message_waits(client: &tokio_postgres::Client, names: &StreamNames, at: &str, id: i64) -> anyhow::Result<()> {
    let objects = super::objects(names.clone(), true);
    let waits = outbox_postgres::teardown::message_waits(client, &objects, id).await.with_context(|| {
        format!("reading slot {:?} to find the message {at} (nothing changed; if the slot is lost, `outbox-streamer setup` names the fix)", names.slot)
    })?;
    if !waits {
        bail!(
            "no WAL-only message of {} at {at} (outbox-id {id}) waits in slot {:?}: the LSN is mistyped, names another stream's message, or it was published already; nothing changed. Use the LSN or outbox-id the halt message names",
            names.table,
            names.slot
        );
    }
    Ok(())
}
