//! The check-back: a message still prepared `check_after_s` after its prepare is asked about
//! at its `checkback_url`, in batches per URL and token:
//!
//! ```text
//! POST <checkback_url>   Authorization: Bearer <the token's secret>
//! {"messages": [{"id": "42", "business_key": "order-7"}, …]}
//!
//! 200 {"decisions": [{"id": "42", "decision": "commit" | "rollback" | "unknown"}, …]}
//! ```
//!
//! A commit or rollback answer is taken as if the caller had sent it; `unknown`, a message the
//! answer leaves out, an answer that is not 2xx JSON and a failed call are fruitless: the
//! message is asked again after `checkback_retry_s`, doubled each time (at most an hour, or
//! `checkback_retry_s` when longer). After `max_checks` fruitless ones it is rolled back or
//! left for an operator (`after_max_checks`), with an ERROR naming it and
//! `outbox_api_checkbacks_total{outcome="given_up"}`.
//!
//! Exactly one instance asks: the one holding the database's lock of the message table
//! ([`MessageStore::lead`]); when its session ends, another instance takes over within
//! [`EVERY`]. A decision taken twice (two instances for a moment, or a caller's own call
//! racing the check-back) is harmless: the message's row lock lets one decide.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::client::Client;
use super::store::{Decided, Decision, DueMessage, MessageStore, id_as_string};
use super::tokens::Tokens;
use crate::config::{AfterMaxChecks, ApiConfig};
use crate::metrics as m;

/// How often due messages are looked for (and the lock tried by an instance without it).
pub(crate) const EVERY: Duration = Duration::from_secs(1);
/// The longest wait between two check-backs of one message (unless `checkback_retry_s` is longer).
const MAX_RETRY_S: u64 = 3600;

#[derive(Debug, Serialize)]
struct Question<'a> {
    messages: Vec<Asked<'a>>,
}

#[derive(Debug, Serialize)]
struct Asked<'a> {
    #[serde(serialize_with = "id_as_string")]
    id: i64,
    business_key: &'a str,
}

#[derive(Debug, Deserialize)]
struct Answer {
    decisions: Vec<Told>,
}

#[derive(Debug, Deserialize)]
struct Told {
    id: String,
    decision: String,
}

/// Runs the check-back until `stop` turns true.
pub(super) async fn run(
    api: ApiConfig,
    store: Arc<dyn MessageStore>,
    tokens: Tokens,
    client: Client,
    mut stop: watch::Receiver<bool>,
) {
    let mut every = tokio::time::interval(EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut leading = false;
    loop {
        tokio::select! {
            _ = every.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        match store.lead().await {
            Ok(lead) => {
                if lead != leading {
                    tracing::info!(
                        leading = lead,
                        "message API: this instance {} the check-back",
                        if lead { "runs" } else { "no longer runs" }
                    );
                    leading = lead;
                }
            }
            Err(e) => {
                tracing::warn!(
                    error = format!("{e:#}"),
                    "message API: the check-back's lock cannot be taken or checked; retrying"
                );
                leading = false;
            }
        }
        if !leading {
            continue;
        }
        if let Err(e) = round(&api, store.as_ref(), &tokens, &client).await {
            tracing::warn!(error = format!("{e:#}"), "message API: a check-back round failed; retrying");
        }
    }
}

/// Asks about every due message (a batch per URL and token), and takes what it is told.
async fn round(api: &ApiConfig, store: &dyn MessageStore, tokens: &Tokens, client: &Client) -> anyhow::Result<()> {
    let due = store.due(api.checkback_batch * 4).await?;
    let mut groups: BTreeMap<(&str, &str), Vec<&DueMessage>> = BTreeMap::new();
    for message in &due {
        groups.entry((message.token.as_str(), message.checkback_url.as_str())).or_default().push(message);
    }
    for ((token, url), messages) in groups {
        for batch in messages.chunks(api.checkback_batch as usize) {
            let told = match tokens.secret_of(token) {
                Some(secret) => ask(client, url, secret, batch).await,
                None => Err(anyhow::anyhow!(
                    "token {token:?} is no longer configured, so the check-back cannot authenticate"
                )),
            };
            let told = told.unwrap_or_else(|e| {
                metrics::counter!(m::API_CHECKBACKS, "outcome" => "failed").increment(batch.len() as u64);
                tracing::warn!(
                    error = format!("{e:#}"),
                    token,
                    messages = batch.len(),
                    "message API: a check-back call failed; asking again later"
                );
                BTreeMap::new()
            });
            for message in batch {
                let decision = match told.get(&message.id).map(String::as_str) {
                    Some("commit") => Some(Decision::Commit),
                    Some("rollback") => Some(Decision::Rollback),
                    _ => None,
                };
                match decision {
                    Some(d) => decided(store, message, d).await?,
                    None => fruitless(api, store, message).await?,
                }
            }
        }
    }
    Ok(())
}

/// One call: the messages' ids and business keys; what the answer decided, by id (answers
/// with another value than commit or rollback are kept and count as unknown).
async fn ask(client: &Client, url: &str, secret: &str, batch: &[&DueMessage]) -> anyhow::Result<BTreeMap<i64, String>> {
    let question =
        Question { messages: batch.iter().map(|m| Asked { id: m.id, business_key: &m.business_key }).collect() };
    let (status, body) = client.post(url, secret, serde_json::to_vec(&question)?).await?;
    anyhow::ensure!((200..300).contains(&status), "the check-back endpoint answered HTTP {status}");
    let answer: Answer = serde_json::from_slice(&body).map_err(|e| {
        anyhow::anyhow!("the check-back answer is not {{\"decisions\": [{{\"id\", \"decision\"}}]}} ({e})")
    })?;
    Ok(answer.decisions.into_iter().filter_map(|t| Some((t.id.parse().ok()?, t.decision))).collect())
}

async fn decided(store: &dyn MessageStore, message: &DueMessage, decision: Decision) -> anyhow::Result<()> {
    let outcome = store.decide(&message.token, message.id, decision).await?;
    metrics::counter!(m::API_CHECKBACKS, "outcome" => decision.state().as_str()).increment(1);
    if matches!(outcome, Decided::Now { .. }) {
        metrics::counter!(m::API_MESSAGES, "token" => message.token.clone(), "outcome" => decision.state().as_str())
            .increment(1);
        tracing::info!(id = message.id, token = %message.token, decision = decision.state().as_str(), "message API: a check-back decided a message");
    }
    Ok(())
}

/// Counts a fruitless check-back: asks again later, or gives the message up.
async fn fruitless(api: &ApiConfig, store: &dyn MessageStore, message: &DueMessage) -> anyhow::Result<()> {
    let checks = message.checks.max(0) as u32 + 1;
    if checks < api.max_checks {
        metrics::counter!(m::API_CHECKBACKS, "outcome" => "unknown").increment(1);
        return store.checked(message.id, Some(retry_in(api.checkback_retry_s, checks))).await;
    }
    metrics::counter!(m::API_CHECKBACKS, "outcome" => "given_up").increment(1);
    match api.after_max_checks {
        AfterMaxChecks::Rollback => {
            store.checked(message.id, None).await?;
            let outcome = store.decide(&message.token, message.id, Decision::Rollback).await?;
            if matches!(outcome, Decided::Now { .. }) {
                metrics::counter!(m::API_MESSAGES, "token" => message.token.clone(), "outcome" => "rolled_back")
                    .increment(1);
            }
            tracing::error!(
                id = message.id,
                token = %message.token,
                checks,
                "message API: {checks} check-backs decided nothing (api.max_checks): the message is rolled back, as api.after_max_checks = \"rollback\" says"
            );
        }
        AfterMaxChecks::Leave => {
            store.checked(message.id, None).await?;
            tracing::error!(
                id = message.id,
                token = %message.token,
                checks,
                "message API: {checks} check-backs decided nothing (api.max_checks): the message stays prepared and is asked about no more; decide it with POST /v1/messages/{}/commit or /rollback",
                message.id
            );
        }
    }
    Ok(())
}

/// The wait before check-back number `checks + 1`: `base` doubled for each fruitless one
/// after the first, at most [`MAX_RETRY_S`] (or `base`, when longer).
fn retry_in(base: u64, checks: u32) -> u64 {
    let doubled = base.saturating_mul(1u64 << (checks.saturating_sub(1)).min(20));
    doubled.min(MAX_RETRY_S.max(base))
}

#[cfg(test)]
mod tests {
    use super::retry_in;

    #[test]
    fn retries_back_off_to_an_hour() {
        assert_eq!([1, 2, 3, 4].map(|c| retry_in(60, c)), [60, 120, 240, 480]);
        assert_eq!(retry_in(60, 100), 3600);
        assert_eq!(retry_in(7200, 5), 7200, "a longer base is kept");
        assert_eq!(retry_in(1, 0), 1);
    }
}
