//! The endpoints: authentication first, then the route; every answer is JSON, every refusal a
//! 4xx whose `error` says what is wrong and what would be right, and a database that cannot
//! be reached a 503 (retry). Nothing here logs a payload, a key or a token's secret.
//!
//! | request | answer |
//! |---|---|
//! | `POST /v1/messages` (one message, or `{"messages": [...]}`) | 201 with the ids (200 when every idempotency key named an earlier message) |
//! | `POST /v1/messages/{id}/commit` | 200 committed (also when it already was), with the `outbox_id` its record carries; 409 when rolled back; 202 with `?async=true` |
//! | `POST /v1/messages/{id}/rollback` | 200 rolled back (also when it already was); 409 when committed; 202 with `?async=true` |
//! | `GET /v1/messages/{id}` | 200 with its state |

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::json;

use super::request::{self, Refusal};
use super::store::{Decided, Decision, MessageStore, Prepared, id_as_string};
use super::tokens::{Token, Tokens};
use crate::config::ApiConfig;
use crate::metrics as m;

/// What every request needs: the settings, the tokens and the store.
pub(crate) struct Api {
    settings: ApiConfig,
    tokens: Tokens,
    store: Arc<dyn MessageStore>,
    /// The source's shard count.
    shards: u32,
    /// Places for asynchronous decisions still to run.
    deciding: Arc<tokio::sync::Semaphore>,
}

/// Asynchronous decisions waiting to run, per database session of the API.
const ASYNC_PER_SESSION: usize = 64;

impl std::fmt::Debug for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Api").field("listen", &self.settings.listen).finish_non_exhaustive()
    }
}

impl Api {
    pub(crate) fn new(settings: ApiConfig, tokens: Tokens, store: Arc<dyn MessageStore>, shards: u32) -> Self {
        let deciding = Arc::new(tokio::sync::Semaphore::new(settings.db_connections * ASYNC_PER_SESSION));
        Self { settings, tokens, store, shards, deciding }
    }

    pub(crate) fn settings(&self) -> &ApiConfig {
        &self.settings
    }
}

type Answer = Response<Full<Bytes>>;

fn answer(status: StatusCode, body: serde_json::Value) -> Answer {
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn refused(r: Refusal) -> Answer {
    let status = StatusCode::from_u16(r.status).unwrap_or(StatusCode::BAD_REQUEST);
    let mut response = answer(status, json!({ "error": r.message }));
    if status == StatusCode::UNAUTHORIZED {
        response.headers_mut().insert(hyper::header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    response
}

/// A database failure: logged with its cause (which holds no row data), answered 503.
fn unavailable(what: &str, e: &anyhow::Error) -> Refusal {
    tracing::error!(error = format!("{e:#}"), "message API: {what} failed");
    Refusal::new(503, format!("the message store is unavailable ({what} failed); nothing changed, retry later"))
}

/// The route a request asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Prepare,
    Decide(i64, Decision),
    Get(i64),
}

impl Route {
    fn label(self) -> &'static str {
        match self {
            Self::Prepare => "prepare",
            Self::Decide(_, Decision::Commit) => "commit",
            Self::Decide(_, Decision::Rollback) => "rollback",
            Self::Get(_) => "get",
        }
    }
}

/// Which route `method` and `path` name.
fn route(method: &Method, path: &str) -> Result<Route, Refusal> {
    let rest = path.strip_prefix("/v1/messages").ok_or_else(|| {
        Refusal::new(404, format!("no endpoint {path}; the API's paths start with /v1/messages (docs/api.md)"))
    })?;
    let allow = |allowed: &str| Refusal::new(405, format!("{method} is not allowed on {path}: use {allowed}"));
    let id = |text: &str| {
        text.parse::<i64>()
            .ok()
            .filter(|id| *id > 0 && !text.starts_with('0') && text.bytes().all(|b| b.is_ascii_digit()))
            .ok_or_else(|| {
                Refusal::new(404, format!("no message {text:?}: ids are the positive integers prepare answers"))
            })
    };
    let segments: Vec<&str> = rest.split('/').collect();
    match segments.as_slice() {
        [""] | ["", ""] => (method == Method::POST).then_some(Route::Prepare).ok_or_else(|| allow("POST")),
        ["", text] => (method == Method::GET).then(|| id(text).map(Route::Get)).ok_or_else(|| allow("GET"))?,
        ["", text, action @ ("commit" | "rollback")] => {
            let decision = if *action == "commit" { Decision::Commit } else { Decision::Rollback };
            (method == Method::POST)
                .then(|| id(text).map(|id| Route::Decide(id, decision)))
                .ok_or_else(|| allow("POST"))?
        }
        _ => Err(Refusal::new(404, format!("no endpoint {path} (docs/api.md)"))),
    }
}

/// Answers one request within `request_timeout_ms`, counting it by route and status.
pub(crate) async fn handle(api: &Api, request: Request<Incoming>) -> Answer {
    let timeout = Duration::from_millis(api.settings.request_timeout_ms);
    let (label, response) = match tokio::time::timeout(timeout, respond(api, request)).await {
        Ok(done) => done,
        Err(_) => (
            "timeout",
            refused(Refusal::new(
                503,
                "the request took longer than api.request_timeout_ms; it may or may not have taken effect: repeat it (every call is idempotent)",
            )),
        ),
    };
    metrics::counter!(m::API_REQUESTS, "endpoint" => label, "status" => response.status().as_str().to_string())
        .increment(1);
    response
}

async fn respond(api: &Api, request: Request<Incoming>) -> (&'static str, Answer) {
    let route = match route(request.method(), request.uri().path()) {
        Ok(r) => r,
        Err(r) => return ("unknown", refused(r)),
    };
    let label = route.label();
    let authorization = request.headers().get(hyper::header::AUTHORIZATION).map(|v| v.as_bytes());
    let Some(token) = api.tokens.authenticate(authorization) else {
        return (
            label,
            refused(Refusal::new(401, "authenticate with Authorization: Bearer <a secret of [[api.token]]>")),
        );
    };
    let token = token.clone();
    let result = match route {
        Route::Prepare => prepare(api, &token, request).await,
        Route::Decide(id, decision) => {
            let asynchronous = request.uri().query().is_some_and(|q| q.split('&').any(|p| p == "async=true"));
            decide(api, &token, id, decision, asynchronous).await
        }
        Route::Get(id) => get(api, &token, id).await,
    };
    (label, result.unwrap_or_else(refused))
}

/// Reads the body: at most `max_body_bytes` (413 beyond, told by Content-Length or counted).
async fn body(api: &Api, request: Request<Incoming>) -> Result<Bytes, Refusal> {
    let limit = api.settings.max_body_bytes;
    let too_big = || {
        Refusal::new(
            413,
            format!("the body is over api.max_body_bytes ({limit} bytes); send fewer messages per request"),
        )
    };
    let declared =
        request.headers().get(hyper::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_big());
    }
    let json = request
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(';').next().is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json")));
    if !json {
        return Err(Refusal::new(415, "send the body as Content-Type: application/json"));
    }
    match Limited::new(request.into_body(), limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => Err(too_big()),
        Err(_) => Err(Refusal::new(400, "the body could not be read to its end")),
    }
}

#[derive(serde::Serialize)]
struct PreparedAnswer {
    #[serde(serialize_with = "id_as_string")]
    id: i64,
    state: super::store::State,
    created: bool,
}

impl From<&Prepared> for PreparedAnswer {
    fn from(p: &Prepared) -> Self {
        Self { id: p.id, state: p.state, created: p.created }
    }
}

async fn prepare(api: &Api, token: &Token, request: Request<Incoming>) -> Result<Answer, Refusal> {
    let body = body(api, request).await?;
    let (messages, batch) = request::parse(&body, token, api.shards, api.settings.max_batch)?;
    let prepared =
        api.store.prepare(&messages, api.settings.check_after_s).await.map_err(|e| unavailable("prepare", &e))?;
    let created = prepared.iter().filter(|p| p.created).count() as u64;
    metrics::counter!(m::API_MESSAGES, "token" => token.name.clone(), "outcome" => "prepared").increment(created);
    let status = if created > 0 { StatusCode::CREATED } else { StatusCode::OK };
    let answers: Vec<PreparedAnswer> = prepared.iter().map(PreparedAnswer::from).collect();
    let body =
        if batch { json!({ "messages": answers }) } else { serde_json::to_value(&answers[0]).unwrap_or_default() };
    Ok(answer(status, body))
}

async fn decide(api: &Api, token: &Token, id: i64, decision: Decision, asynchronous: bool) -> Result<Answer, Refusal> {
    // An asynchronous decision is answered 202 only for a message it can decide: the rest get
    // what a synchronous call would. At most `ASYNC_PER_SESSION` × `db_connections` wait to
    // run; past that, a decision is taken before the answer, which slows the callers down.
    let place = match asynchronous {
        true => api.deciding.clone().try_acquire_owned().ok(),
        false => None,
    };
    if let Some(place) = place {
        match api.store.get(&token.name, id).await.map_err(|e| unavailable("reading a message", &e))? {
            None => return Err(not_found(id)),
            Some(view) if view.state == super::store::State::Prepared => {}
            Some(view) if view.state == decision.state() => {
                return Ok(answer(StatusCode::OK, json!({ "id": id.to_string(), "state": view.state.as_str() })));
            }
            Some(view) => return Err(conflict(id, view.state, decision)),
        }
        let (store, name) = (api.store.clone(), token.name.clone());
        tokio::spawn(async move {
            let _place = place;
            // Failing here leaves the message prepared: the check-back decides it.
            match store.decide(&name, id, decision).await {
                Ok(outcome) => count(&name, decision, outcome),
                Err(e) => {
                    unavailable(
                        if decision == Decision::Commit {
                            "an asynchronous commit"
                        } else {
                            "an asynchronous rollback"
                        },
                        &e,
                    );
                }
            }
        });
        return Ok(answer(StatusCode::ACCEPTED, json!({ "id": id.to_string(), "state": "deciding" })));
    }
    let outcome = api
        .store
        .decide(&token.name, id, decision)
        .await
        .map_err(|e| unavailable(if decision == Decision::Commit { "commit" } else { "rollback" }, &e))?;
    count(&token.name, decision, outcome);
    match outcome {
        Decided::Now { outbox_id } | Decided::Already { outbox_id } => {
            let mut body = json!({ "id": id.to_string(), "state": decision.state().as_str() });
            if let Some(outbox_id) = outbox_id {
                body["outbox_id"] = json!(outbox_id.to_string());
            }
            Ok(answer(StatusCode::OK, body))
        }
        Decided::Conflict(state) => Err(Refusal::new(
            409,
            format!(
                "message {id} is {} already: it cannot be {}",
                state.as_str(),
                decision.state().as_str().replace('_', " ")
            ),
        )),
        Decided::NotFound => Err(not_found(id)),
    }
}

fn count(token: &str, decision: Decision, outcome: Decided) {
    if matches!(outcome, Decided::Now { .. }) {
        metrics::counter!(m::API_MESSAGES, "token" => token.to_string(), "outcome" => decision.state().as_str())
            .increment(1);
    }
}

fn conflict(id: i64, state: super::store::State, decision: Decision) -> Refusal {
    Refusal::new(
        409,
        format!(
            "message {id} is {} already: it cannot be {}",
            state.as_str(),
            decision.state().as_str().replace('_', " ")
        ),
    )
}

fn not_found(id: i64) -> Refusal {
    Refusal::new(404, format!("no message {id} of this token (decided messages are kept for api.keep_decisions_s)"))
}

async fn get(api: &Api, token: &Token, id: i64) -> Result<Answer, Refusal> {
    match api.store.get(&token.name, id).await.map_err(|e| unavailable("reading a message", &e))? {
        Some(view) => Ok(answer(StatusCode::OK, serde_json::to_value(view).unwrap_or_default())),
        None => Err(not_found(id)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_name_their_routes_and_nothing_else_does() {
        assert_eq!(route(&Method::POST, "/v1/messages").unwrap(), Route::Prepare);
        assert_eq!(route(&Method::POST, "/v1/messages/").unwrap(), Route::Prepare);
        assert_eq!(route(&Method::GET, "/v1/messages/12").unwrap(), Route::Get(12));
        assert_eq!(route(&Method::POST, "/v1/messages/12/commit").unwrap(), Route::Decide(12, Decision::Commit));
        assert_eq!(route(&Method::POST, "/v1/messages/12/rollback").unwrap(), Route::Decide(12, Decision::Rollback));
        for (method, path, status) in [
            (Method::GET, "/v1/messages", 405),
            (Method::DELETE, "/v1/messages/12", 405),
            (Method::GET, "/v1/messages/12/commit", 405),
            (Method::GET, "/v1/messages/-1", 404),
            (Method::GET, "/v1/messages/+1", 404),
            (Method::GET, "/v1/messages/0", 404),
            (Method::GET, "/v1/messages/012", 404),
            (Method::GET, "/v1/messages/99999999999999999999", 404),
            (Method::POST, "/v1/messages/12/abort", 404),
            (Method::GET, "/metrics", 404),
            (Method::GET, "/v1/messagesX", 404),
        ] {
            assert_eq!(route(&method, path).unwrap_err().status, status, "{method} {path}");
        }
    }
}
