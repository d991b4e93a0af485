//! The transactional message API (docs/api.md), for services that cannot write the outbox row
//! in their own transaction: they **prepare** a message, do their work, then **commit** or
//! **roll back** it. A commit turns the prepared message into an outbox row of its
//! shard-partition, in one transaction of the API source's database, so the CDC (or polling)
//! streamer publishes it like any other row, in commit order.
//!
//! ```text
//!   caller ──HTTP──▶ server.rs (limits, TLS) ──▶ routes.rs (auth, endpoints)
//!                                                   │ request.rs (body checks), tokens.rs (grants)
//!                                                   ▼
//!                                        store.rs: MessageStore ◀── db/<database>/api.rs
//!                                                   │ commit: <prefix>_enqueue in the same transaction
//!                                                   ▼
//!                                        <prefix>_<shard>_<partition> ──▶ the streamer
//! ```
//!
//! Served by `run` when `[api]` is set; beside it run the check-back ([`checkback`]: asking the
//! caller about a message left prepared) and a task that prunes decided messages older than
//! `keep_decisions_s` and publishes the age of the oldest prepared message.

mod checkback;
mod client;
mod request;
mod routes;
mod server;
pub(crate) mod store;
mod tokens;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use futures::future::BoxFuture;
use tokio::sync::watch;

use crate::config::{ApiConfig, Config};
use crate::metrics as m;
pub(crate) use store::MessageStore;

/// How often decided messages are pruned and the oldest prepared one measured.
const HOUSEKEEPING_EVERY: Duration = Duration::from_secs(10);
/// Decided messages deleted per pruning statement.
const PRUNE_BATCH: u32 = 5_000;

/// Binds `[api] listen` and returns the tasks that serve it and keep its table, until `stop`
/// turns true. `Ok(None)` without `[api]`. A token whose secret cannot be read, unreadable
/// TLS files or an address in use are errors: `run` stops before streaming.
pub(crate) async fn start(
    config: &Config,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<Option<Vec<BoxFuture<'static, ()>>>> {
    let Some(api) = &config.api else { return Ok(None) };
    let source = config
        .sources
        .iter()
        .find(|s| s.name == api.source)
        .with_context(|| format!("api.source: names no [[source]] ({:?})", api.source))?;
    let tokens = tokens::Tokens::load(api)?;
    let tls = server::tls_acceptor(api)?;
    let store = crate::db::of(source.kind).message_store(source, api)?;
    let listener = tokio::net::TcpListener::bind(api.listen)
        .await
        .with_context(|| format!("api.listen: cannot listen on {}", api.listen))?;
    tracing::info!(listen = %api.listen, tls = tls.is_some(), source = %source.name, "serving the message API");
    let client =
        client::Client::new(api.checkback_ca_file.as_deref(), Duration::from_millis(api.checkback_timeout_ms))?;
    let routes = Arc::new(routes::Api::new(api.clone(), tokens.clone(), store.clone(), source.shards));
    let serve: BoxFuture<'static, ()> = Box::pin(server::serve(listener, tls, routes, stop.clone()));
    let check: BoxFuture<'static, ()> =
        Box::pin(checkback::run(api.clone(), store.clone(), tokens, client, stop.clone()));
    let keep: BoxFuture<'static, ()> = Box::pin(housekeeping(api.clone(), store, stop));
    Ok(Some(vec![serve, check, keep]))
}

/// Prunes decided messages past `keep_decisions_s` and publishes the oldest prepared one's age.
async fn housekeeping(api: ApiConfig, store: Arc<dyn MessageStore>, mut stop: watch::Receiver<bool>) {
    let mut every = tokio::time::interval(HOUSEKEEPING_EVERY);
    loop {
        tokio::select! {
            _ = every.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        loop {
            match store.prune(api.keep_decisions_s, PRUNE_BATCH).await {
                Ok(n) if n == u64::from(PRUNE_BATCH) => continue,
                Ok(_) => break,
                Err(e) => {
                    tracing::warn!(
                        error = format!("{e:#}"),
                        "message API: pruning decided messages failed; retrying later"
                    );
                    break;
                }
            }
        }
        match store.oldest_prepared_age().await {
            Ok(age) => metrics::gauge!(m::API_OLDEST_PREPARED).set(age.unwrap_or(0.0)),
            Err(e) => {
                tracing::warn!(error = format!("{e:#}"), "message API: reading the oldest prepared message failed")
            }
        }
    }
}
