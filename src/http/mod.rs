//! The `Idempotency-Key` HTTP header (IETF draft "The Idempotency-Key HTTP Header
//! Field") as a [`tower::Layer`] for axum, over any [`Store`] (feature `http`).
//!
//! For each request of a guarded method (POST and PATCH by default):
//!
//! | request | answer |
//! |---|---|
//! | no key, on a route that requires one | `400` |
//! | a key outside the length range (default 16..=255) or character set | `400` |
//! | a body longer than the limit | `413`, before it is buffered |
//! | no tenant from the extractor | `401` with `WWW-Authenticate` |
//! | the key with another fingerprint (method, path, canonical body) | `422` |
//! | a retry while the first attempt runs | with [`IdempotencyLayer::wait_for_outcome`], the first attempt's answer once it ends (or a run of its own if it released the key); after the wait, or without one, `409` `request_in_progress`, with `Retry-After` |
//! | a retry after an attempt whose outcome is unknown (its record noted) | `409` `request_outcome_unknown`, with `Retry-After` |
//! | a retry after the response aged out (`Options::response_retention`) | `410` `idempotency_response_expired`: processed, not run again |
//! | a retry after a `2xx` or `4xx` | the stored status, allow-listed headers and body, byte for byte, plus `Idempotent-Replayed: true` |
//! | the store unreachable | `503` with `Retry-After` (fail closed; wrap the store in [`Guarded`](crate::Guarded) to choose) |
//!
//! The layer's own answers are RFC 9457 problem details ([`problem_details`]), with
//! `type` `urn:oncedb:problem:<code>`; [`IdempotencyLayer::problem`] reshapes them.
//!
//! What the handler's outcome does to the record (each configurable; `docs/http.md` has
//! the whole table):
//!
//! - `2xx` (and `3xx`): completed; replayed.
//! - `401`, `403`, `408`, `429` ([`IdempotencyLayer::release_statuses`]): nothing
//!   happened yet, so the key is released and a retry runs.
//! - any other `4xx`: failed (a deterministic refusal); replayed.
//! - `5xx`: stored as failed and replayed ([`ServerErrors::Store`], the default), unless
//!   the handler put [`SideEffect::Unknown`] in the response's extensions (kept in flight
//!   with a note, for reconciliation: retries get `409`) or [`SideEffect::NotPerformed`]
//!   (released).
//! - No answer: the inner service returned an error (any error type that displays; axum
//!   routes have none): kept in flight with the note `service error: <error>`, the
//!   error passed on.
//! - A request that acquired its key runs to the end even when the client goes away
//!   ([`IdempotencyLayer::detached`]): a retry replays its outcome. A handler that panics
//!   drops the lease: the record stays in flight, never completed with a partial response.
//!
//! The key comes from the `Idempotency-Key` header by default, or from another header
//! (a webhook's `webhook-id`, GitHub's `X-GitHub-Delivery`) or a JSON Pointer into the
//! body (a Stripe event's `/id`): [`KeySource`]. The fingerprint covers the method, the
//! path and the whole canonical body, or only chosen fields of it
//! ([`IdempotencyLayer::fingerprint_fields`]).
//!
//! The scope of a key is the tenant (from the extractor: authentication, never the body),
//! and the method plus the matched route. The handler finds the key and tenant in the
//! request's [`IdempotencyContext`] extension, for operation ids sent downstream.

mod detach;
mod fingerprint;
mod stored;

use std::future::Future;
use std::ops::RangeInclusive;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::MatchedPath;
use axum::http::header::{CONTENT_LENGTH, CONTENT_TYPE, HeaderName, HeaderValue, RETRY_AFTER};
use axum::http::request::Parts;
use axum::http::{Method, Request, Response, StatusCode};

pub use fingerprint::{RAW_BODY, canonical_request, fields_request};
pub use stored::StoredResponse;

use crate::api::{Reservation, Scope};
use crate::base::{Error, MAX_NOTE_BYTES};
use crate::store::{Held, Store, StoreLease};

/// The request header.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// The header marking a replayed response.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";
/// The header marking a replay whose body was too large for the store: the status and
/// headers are the first attempt's, the body is empty.
pub const IDEMPOTENT_BODY_OMITTED: &str = "idempotent-body-omitted";

/// What a handler tells the layer about its side effect, in the response's extensions;
/// it overrides the layer's [`ServerErrors`] policy for that response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SideEffect {
    /// Nothing happened downstream (validated before any call, or the call was refused
    /// for sure): release the record so a retry runs.
    NotPerformed,
    /// The outcome is unknown (a provider timed out after the request left): keep the
    /// record in flight with a note, for reconciliation; retries get `409`.
    Unknown,
}

/// What the layer does with a `5xx` response the handler did not mark with a
/// [`SideEffect`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerErrors {
    /// Store it and replay it to retries, as for any other answer (the default, as
    /// Stripe does: a retry learns what the first attempt answered).
    Store,
    /// Release the key: a retry runs the handler again. For handlers whose 5xx always
    /// means nothing happened.
    Release,
    /// Keep the record in flight with a note, for reconciliation; retries get `409`.
    KeepInFlight,
}

/// The key and tenant of a guarded request, in its extensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyContext {
    /// The tenant the extractor returned.
    pub tenant: String,
    /// The operation: the method and the matched route (`POST /v1/payments`).
    pub operation: String,
    /// The `Idempotency-Key`, without the quotes of its structured-field form.
    pub key: String,
}

impl IdempotencyContext {
    /// A stable operation id for downstream calls, one per record: tenant, operation and
    /// key, each prefixed with its length (`3:org14:POST /v1/pay16:7ccf419e-...`), so no
    /// two (tenant, operation, key) triples share an id whatever characters they hold.
    pub fn operation_id(&self) -> String {
        [&self.tenant, &self.operation, &self.key]
            .iter()
            .map(|part| format!("{}:{part}", part.len()))
            .collect()
    }
}

type TenantFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;
type FingerprintFn = dyn Fn(&Parts, &[u8]) -> Vec<u8> + Send + Sync;
type ProblemFn = dyn Fn(&Problem) -> Response<Body> + Send + Sync;

/// The layer's settings, set through [`IdempotencyLayer`]'s builder methods.
#[derive(Clone)]
struct Settings {
    required: bool,
    key_bytes: RangeInclusive<usize>,
    max_body_bytes: usize,
    methods: Vec<Method>,
    replay_headers: Vec<HeaderName>,
    retry_after_secs: u32,
    release_statuses: Vec<StatusCode>,
    server_errors: ServerErrors,
    detached: bool,
    www_authenticate: HeaderValue,
    problem: Option<Arc<ProblemFn>>,
    tenant: Arc<TenantFn>,
    fingerprint: Arc<FingerprintFn>,
    key_source: KeySource,
    /// How long a retry waits for the first attempt's outcome before `409`.
    wait: std::time::Duration,
}

/// Where the layer reads a request's idempotency key.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeySource {
    /// A request header, sent once: a structured-field string (quoted) or a bare token.
    /// The default is `Idempotency-Key`; webhooks carry theirs in `webhook-id`
    /// (Standard Webhooks) or `X-GitHub-Delivery` (GitHub).
    Header(HeaderName),
    /// The string or number that a JSON Pointer (RFC 6901) names in the JSON body, such
    /// as `/id` for a Stripe event. The body is read (up to the size limit) before the
    /// key: a body that is not JSON, or has nothing there, has no key.
    Body(String),
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("required", &self.required)
            .field("key_bytes", &self.key_bytes)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("methods", &self.methods)
            .field("replay_headers", &self.replay_headers)
            .finish_non_exhaustive()
    }
}

impl Settings {
    /// The defaults [`IdempotencyLayer::new`] documents.
    fn new(tenant: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> Self {
        Settings {
            required: true,
            key_bytes: 16..=255,
            max_body_bytes: 1 << 20,
            methods: vec![Method::POST, Method::PATCH],
            replay_headers: vec![CONTENT_TYPE, axum::http::header::LOCATION],
            retry_after_secs: 1,
            release_statuses: vec![
                StatusCode::UNAUTHORIZED,
                StatusCode::FORBIDDEN,
                StatusCode::REQUEST_TIMEOUT,
                StatusCode::TOO_MANY_REQUESTS,
            ],
            server_errors: ServerErrors::Store,
            detached: true,
            www_authenticate: HeaderValue::from_static("Bearer"),
            problem: None,
            tenant: Arc::new(tenant),
            fingerprint: Arc::new(canonical_request),
            key_source: KeySource::Header(HeaderName::from_static(IDEMPOTENCY_KEY)),
            wait: std::time::Duration::ZERO,
        }
    }
}

/// The [`tower::Layer`]: wrap routes that create side effects.
#[derive(Debug, Clone)]
pub struct IdempotencyLayer<S> {
    store: S,
    settings: Arc<Settings>,
}

impl<S: Store + Clone> IdempotencyLayer<S> {
    /// A layer keeping its records in `store`, with `tenant` telling each request's
    /// tenant (from authentication, never the body; `None` answers `401`). Keys
    /// required, 16..=255 bytes, bodies up to 1 MiB, POST and PATCH guarded,
    /// `content-type` and `location` replayed, `Retry-After: 1`, the default fingerprint
    /// ([`canonical_request`]); the methods below change each.
    pub fn new(
        store: S,
        tenant: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        IdempotencyLayer {
            store,
            settings: Arc::new(Settings::new(tenant)),
        }
    }

    /// The settings to change: shared with the services already built only until the
    /// first change (copy on write).
    fn settings_mut(&mut self) -> &mut Settings {
        Arc::make_mut(&mut self.settings)
    }

    /// Whether a guarded request without a key is refused (`true`) or passed through.
    pub fn required(mut self, required: bool) -> Self {
        self.settings_mut().required = required;
        self
    }

    /// Accepted key lengths in bytes.
    pub fn key_bytes(mut self, range: RangeInclusive<usize>) -> Self {
        self.settings_mut().key_bytes = range;
        self
    }

    /// The largest request body accepted, in bytes.
    pub fn max_body_bytes(mut self, max: usize) -> Self {
        self.settings_mut().max_body_bytes = max;
        self
    }

    /// The methods guarded; others pass through.
    pub fn methods(mut self, methods: Vec<Method>) -> Self {
        self.settings_mut().methods = methods;
        self
    }

    /// Response headers stored and replayed (the rest are not stored). Credentials and
    /// hop-by-hop headers are refused with [`Error::InvalidOptions`]: a replay of
    /// `set-cookie` or `authorization` would hand one user's session to another user of
    /// the same tenant, and hop-by-hop headers describe one connection.
    pub fn replay_headers(mut self, headers: Vec<HeaderName>) -> Result<Self, Error> {
        const REFUSED: [&str; 12] = [
            "set-cookie",
            "cookie",
            "authorization",
            "proxy-authorization",
            "www-authenticate",
            "proxy-authenticate",
            "connection",
            "keep-alive",
            "transfer-encoding",
            "te",
            "trailer",
            "upgrade",
        ];
        if let Some(refused) = headers.iter().find(|h| REFUSED.contains(&h.as_str())) {
            return Err(Error::InvalidOptions(format!(
                "the header {refused} must not be replayed"
            )));
        }
        self.settings_mut().replay_headers = headers;
        Ok(self)
    }

    /// The `Retry-After` of a `409` or `503`, in whole seconds (rounded up). Default 1 s.
    pub fn retry_after(mut self, after: std::time::Duration) -> Self {
        let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
        self.settings_mut().retry_after_secs = u32::try_from(secs).unwrap_or(u32::MAX);
        self
    }

    /// Statuses after which the key is released, so a retry runs the handler again: the
    /// answers that say nothing happened yet. Default `401`, `403`, `408`, `429`. Every
    /// other `4xx` is stored and replayed.
    pub fn release_statuses(mut self, statuses: Vec<StatusCode>) -> Self {
        self.settings_mut().release_statuses = statuses;
        self
    }

    /// What a `5xx` does to the record; see [`ServerErrors`]. Default
    /// [`ServerErrors::Store`].
    pub fn server_errors(mut self, policy: ServerErrors) -> Self {
        self.settings_mut().server_errors = policy;
        self
    }

    /// The `WWW-Authenticate` of a `401` (no tenant). Default `Bearer`.
    pub fn www_authenticate(mut self, challenge: HeaderValue) -> Self {
        self.settings_mut().www_authenticate = challenge;
        self
    }

    /// Renders the layer's own answers (a [`Problem`]) instead of the default problem
    /// details ([`problem_details`]); `Retry-After` and `WWW-Authenticate` are added
    /// after it.
    pub fn problem(
        mut self,
        render: impl Fn(&Problem) -> Response<Body> + Send + Sync + 'static,
    ) -> Self {
        self.settings_mut().problem = Some(Arc::new(render));
        self
    }

    /// Whether a request that acquired its key runs to the end even if the client goes
    /// away (default `true`): the handler and the storing of its answer run on the
    /// request's task and, if the client goes away before they end, on a task of their
    /// own from there, so a retry finds the outcome instead of a record left in flight.
    /// With `false`, a dropped request drops the lease and the record stays in flight.
    pub fn detached(mut self, detached: bool) -> Self {
        self.settings_mut().detached = detached;
        self
    }

    /// Where the key is read: [`KeySource`]. Default the `Idempotency-Key` header. A
    /// body pointer that is not a JSON Pointer is refused with [`Error::InvalidOptions`].
    pub fn key_source(mut self, source: KeySource) -> Result<Self, Error> {
        if let KeySource::Body(pointer) = &source
            && (pointer.is_empty() || !fingerprint::is_pointer(pointer))
        {
            return Err(Error::InvalidOptions(format!(
                "{pointer:?} is not a JSON Pointer to a body field (RFC 6901, such as \"/id\")"
            )));
        }
        self.settings_mut().key_source = source;
        Ok(self)
    }

    /// Fingerprints only the body fields these JSON Pointers (RFC 6901) name, with the
    /// method and path ([`fields_request`]): a retry that changes another field (a
    /// timestamp) replays, one that changes a named field gets `422`. A pointer that is
    /// not a JSON Pointer is refused with [`Error::InvalidOptions`].
    pub fn fingerprint_fields(mut self, pointers: Vec<String>) -> Result<Self, Error> {
        if let Some(bad) = pointers.iter().find(|p| !fingerprint::is_pointer(p)) {
            return Err(Error::InvalidOptions(format!(
                "{bad:?} is not a JSON Pointer (RFC 6901)"
            )));
        }
        self.settings_mut().fingerprint =
            Arc::new(move |parts: &Parts, body: &[u8]| fields_request(parts, body, &pointers));
        Ok(self)
    }

    /// How long a retry that finds the first attempt still running waits for its
    /// outcome ([`Store::wait_finished`]) and answers it, before it answers `409` as
    /// without a wait. If the first attempt released the key meanwhile, the retry runs
    /// the handler itself. Default zero: `409` at once.
    pub fn wait_for_outcome(mut self, wait: std::time::Duration) -> Self {
        self.settings_mut().wait = wait;
        self
    }

    /// Replaces the request fingerprint (bytes compared between attempts of one key).
    pub fn fingerprint(
        mut self,
        fingerprint: impl Fn(&Parts, &[u8]) -> Vec<u8> + Send + Sync + 'static,
    ) -> Self {
        self.settings_mut().fingerprint = Arc::new(fingerprint);
        self
    }
}

impl<S: Store + Clone, I> tower::Layer<I> for IdempotencyLayer<S> {
    type Service = Idempotency<S, I>;

    fn layer(&self, inner: I) -> Self::Service {
        Idempotency {
            store: self.store.clone(),
            settings: Arc::clone(&self.settings),
            inner,
        }
    }
}

/// The service the layer wraps around a route.
#[derive(Debug, Clone)]
pub struct Idempotency<S, I> {
    store: S,
    settings: Arc<Settings>,
    inner: I,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// Any request body is accepted (so the layer composes inside body-changing layers such
/// as a request body limit); the handler gets the buffered body as an axum [`Body`].
impl<S, I, B> tower::Service<Request<B>> for Idempotency<S, I>
where
    S: Store + Clone,
    I: tower::Service<Request<Body>, Response = Response<Body>> + Clone + Send + 'static,
    I::Error: std::fmt::Display + Send + 'static,
    I::Future: Send + 'static,
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<axum::BoxError>,
{
    type Response = Response<Body>;
    type Error = I::Error;
    type Future = BoxFuture<Result<Response<Body>, I::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), I::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let request = request.map(Body::new);
        // The readied service serves this call; a clone waits for the next one.
        let ready = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, ready);
        let (store, settings) = (self.store.clone(), Arc::clone(&self.settings));
        if !settings.detached {
            return Box::pin(async move {
                let response = guard(store, Arc::clone(&settings), inner, request).await?;
                Ok(present(&settings, response))
            });
        }
        // Detaching: a client that goes away drops this future, not the guarded request,
        // which finishes (reserve, handler, stored answer) on a task of its own from
        // there. A reserve whose client left is followed by its handler, so no record is
        // left for a handler that never ran.
        let guarded = detach::Detaching::new(Box::pin(guard(
            store,
            Arc::clone(&settings),
            inner,
            request,
        )));
        Box::pin(async move {
            let response = guarded.await.unwrap_or_else(|| {
                // The handler panicked: its lease dropped, the record stays in flight.
                Ok(refuse(StatusCode::INTERNAL_SERVER_ERROR, "handler_failed"))
            })?;
            Ok(present(&settings, response))
        })
    }
}

/// An answer the layer gives itself (never one of the handler's), in the response's
/// extensions: what [`IdempotencyLayer::problem`] renders.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The status.
    pub status: StatusCode,
    /// A stable code (`idempotency_key_required`, `request_in_progress`, ...), also the
    /// last part of the default body's `type`.
    pub code: &'static str,
    /// A short human summary of the code.
    pub title: &'static str,
}

/// The title of each of the layer's codes.
fn title(code: &str) -> &'static str {
    match code {
        "idempotency_key_required" => "An idempotency key is required",
        "invalid_idempotency_key" => "The Idempotency-Key header is malformed",
        "duplicate_idempotency_key" => "More than one Idempotency-Key header",
        "request_body_too_large" => "The request body is too large",
        "unauthorized" => "No tenant could be told from the request",
        "invalid_tenant" => "The tenant name is too long",
        "route_too_long" => "The route is too long to scope a key",
        "idempotency_key_reused" => "The key was used with a different request",
        "idempotency_response_expired" => {
            "The request with this key was processed; its response is no longer stored"
        }
        "request_in_progress" => "A request with this key is still being processed",
        "request_outcome_unknown" => {
            "The first request with this key has an unknown outcome, awaiting reconciliation"
        }
        "idempotency_store_unavailable" => "The idempotency store cannot be reached",
        "idempotency_store_full" => "The idempotency store is full",
        "idempotency_store_busy" => "The idempotency store is busy with this key",
        "stored_response_unreadable" => "The stored response cannot be read",
        "response_unreadable" => "The response could not be read whole",
        "handler_failed" => "The handler failed",
        _ => "The request could not be processed",
    }
}

/// The layer's own answer: RFC 9457 problem details (`application/problem+json`, with
/// `type`, `title`, `status`), the [`Problem`] in its extensions for
/// [`IdempotencyLayer::problem`] to re-render.
fn refuse(status: StatusCode, code: &'static str) -> Response<Body> {
    let problem = Problem {
        status,
        code,
        title: title(code),
    };
    let mut response = problem_details(&problem);
    response.extensions_mut().insert(problem);
    response
}

/// The default rendering of a [`Problem`].
pub fn problem_details(problem: &Problem) -> Response<Body> {
    let body = format!(
        "{{\"type\":\"urn:oncedb:problem:{}\",\"title\":\"{}\",\"status\":{}}}",
        problem.code,
        problem.title,
        problem.status.as_u16()
    );
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = problem.status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
}

/// The layer's own answers as the application wants them: re-rendered by its hook, with
/// its `WWW-Authenticate` on a `401`, and a `Retry-After` kept.
fn present(settings: &Settings, response: Response<Body>) -> Response<Body> {
    let Some(problem) = response.extensions().get::<Problem>().cloned() else {
        return response;
    };
    let retry_after = response.headers().get(RETRY_AFTER).cloned();
    let mut response = match &settings.problem {
        Some(render) => render(&problem),
        None => response,
    };
    if let Some(retry_after) = retry_after {
        response.headers_mut().insert(RETRY_AFTER, retry_after);
    }
    if problem.status == StatusCode::UNAUTHORIZED {
        response.headers_mut().insert(
            axum::http::header::WWW_AUTHENTICATE,
            settings.www_authenticate.clone(),
        );
    }
    response
}

fn retry_later(status: StatusCode, error: &'static str, secs: u32) -> Response<Body> {
    let mut response = refuse(status, error);
    response
        .headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from(secs));
    response
}

/// A request refused before the store is asked: status and error code.
struct Refusal(StatusCode, &'static str);

impl Refusal {
    fn response(&self) -> Response<Body> {
        refuse(self.0, self.1)
    }
}

/// The key from header `name`: a structured-field string (quoted) or a bare token.
fn read_key(
    parts: &Parts,
    name: &HeaderName,
    settings: &Settings,
) -> Result<Option<String>, Refusal> {
    let mut values = parts.headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        // The draft: a client must not send more than one key.
        return Err(Refusal(
            StatusCode::BAD_REQUEST,
            "duplicate_idempotency_key",
        ));
    }
    let bad = || Refusal(StatusCode::BAD_REQUEST, "invalid_idempotency_key");
    let text = value.to_str().map_err(|_| bad())?;
    let key = text
        .strip_prefix('"')
        .and_then(|rest| rest.strip_suffix('"'))
        .unwrap_or(text);
    checked_key(key, settings).map(Some)
}

/// `key` if its length is in range and it is printable ASCII without quotes or
/// backslashes.
fn checked_key(key: &str, settings: &Settings) -> Result<String, Refusal> {
    let allowed = |c: char| c.is_ascii_graphic() && c != '"' && c != '\\';
    if !settings.key_bytes.contains(&key.len()) || !key.chars().all(allowed) {
        return Err(Refusal(StatusCode::BAD_REQUEST, "invalid_idempotency_key"));
    }
    Ok(key.to_owned())
}

/// The key a JSON Pointer names in the body; `None` if it names no string or number.
fn body_key(body: &[u8], pointer: &str, settings: &Settings) -> Result<Option<String>, Refusal> {
    match fingerprint::pointer_text(body, pointer) {
        Some(key) => checked_key(&key, settings).map(Some),
        None => Ok(None),
    }
}

/// Reads the body, refusing one over the limit before buffering it.
async fn read_body(parts: &Parts, body: Body, settings: &Settings) -> Result<Bytes, Refusal> {
    let too_large = || Refusal(StatusCode::PAYLOAD_TOO_LARGE, "request_body_too_large");
    let declared = parts
        .headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|len| len > settings.max_body_bytes as u64) {
        return Err(too_large());
    }
    axum::body::to_bytes(body, settings.max_body_bytes)
        .await
        .map_err(|_| too_large())
}

/// A guarded request with its key, before its reservation.
struct Keyed {
    tenant: String,
    operation: String,
    key: String,
    scope: Scope,
    fingerprint: Vec<u8>,
    body: Bytes,
}

/// What the checks before the reservation decided.
enum Admitted {
    /// Answered by the layer (a refusal).
    Refused(Response<Body>),
    /// No key on a route that does not require one: the handler runs unguarded.
    Unguarded(Body),
    Keyed(Keyed),
}

/// Reads the key, the tenant and the body, and refuses what the table in the module's
/// documentation says.
async fn admit(parts: &Parts, body: Body, settings: &Settings) -> Admitted {
    let required = || refuse(StatusCode::BAD_REQUEST, "idempotency_key_required");
    let header_key = match &settings.key_source {
        KeySource::Header(name) => match read_key(parts, name, settings) {
            Ok(Some(key)) => Some(key),
            Ok(None) if settings.required => return Admitted::Refused(required()),
            Ok(None) => return Admitted::Unguarded(body),
            Err(refusal) => return Admitted::Refused(refusal.response()),
        },
        KeySource::Body(_) => None,
    };
    let Some(tenant) = (settings.tenant)(parts) else {
        return Admitted::Refused(refuse(StatusCode::UNAUTHORIZED, "unauthorized"));
    };
    let body = match read_body(parts, body, settings).await {
        Ok(body) => body,
        Err(refusal) => return Admitted::Refused(refusal.response()),
    };
    let key = match (header_key, &settings.key_source) {
        (Some(key), _) => key,
        (None, KeySource::Body(pointer)) => match body_key(&body, pointer, settings) {
            Ok(Some(key)) => key,
            Ok(None) if settings.required => return Admitted::Refused(required()),
            Ok(None) => return Admitted::Unguarded(Body::from(body)),
            Err(refusal) => return Admitted::Refused(refusal.response()),
        },
        (None, KeySource::Header(_)) => return Admitted::Unguarded(Body::from(body)),
    };
    let route = parts
        .extensions
        .get::<MatchedPath>()
        .map_or_else(|| parts.uri.path().to_owned(), |m| m.as_str().to_owned());
    let operation = format!("{} {route}", parts.method);
    if tenant.len() > crate::base::MAX_SCOPE_PART_BYTES {
        return Admitted::Refused(refuse(StatusCode::BAD_REQUEST, "invalid_tenant"));
    }
    if operation.len() > crate::base::MAX_SCOPE_PART_BYTES {
        return Admitted::Refused(refuse(StatusCode::INTERNAL_SERVER_ERROR, "route_too_long"));
    }
    Admitted::Keyed(Keyed {
        scope: Scope::new(&tenant, &operation),
        fingerprint: (settings.fingerprint)(parts, &body),
        tenant,
        operation,
        key,
        body,
    })
}

/// Reserves the key: the lease, or the layer's answer (a replay, a refusal, `409`). A
/// retry that finds the first attempt running waits for its outcome as long as
/// [`IdempotencyLayer::wait_for_outcome`] says, and reserves again once it ended.
async fn reserve<S: Store>(
    store: &S,
    keyed: &Keyed,
    settings: &Settings,
) -> Result<S::Lease, Response<Body>> {
    let deadline = tokio::time::Instant::from_std(crate::base::deadline_after(settings.wait));
    loop {
        let reserved = store
            .reserve(&keyed.scope, keyed.key.as_bytes(), &keyed.fingerprint)
            .await
            .map_err(|err| store_error(&err, settings))?;
        let note = match reserved {
            Reservation::Acquired(lease) => return Ok(lease),
            Reservation::InFlight { note, .. } => note,
            Reservation::Completed(record) | Reservation::Failed(record) => {
                return Err(replay(record.response().unwrap_or_default()));
            }
            // Processed, with nothing left to replay: not run again.
            Reservation::Expired(_) => {
                return Err(refuse(StatusCode::GONE, "idempotency_response_expired"));
            }
            Reservation::Mismatch => {
                return Err(refuse(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "idempotency_key_reused",
                ));
            }
        };
        // A note is the layer's (or a reconciler's) mark of an outcome unknown, which
        // no wait settles; without one the first attempt is still running, or died
        // before it could say.
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if note.is_some() || left.is_zero() {
            let code = match note {
                Some(_) => "request_outcome_unknown",
                None => "request_in_progress",
            };
            return Err(retry_later(
                StatusCode::CONFLICT,
                code,
                settings.retry_after_secs,
            ));
        }
        store
            .wait_finished(&keyed.scope, keyed.key.as_bytes(), left)
            .await
            .map_err(|err| store_error(&err, settings))?;
    }
}

async fn guard<S, I>(
    store: S,
    settings: Arc<Settings>,
    mut inner: I,
    request: Request<Body>,
) -> Result<Response<Body>, I::Error>
where
    S: Store,
    I: tower::Service<Request<Body>, Response = Response<Body>>,
    I::Error: std::fmt::Display,
{
    if !settings.methods.contains(request.method()) {
        return inner.call(request).await;
    }
    let (mut parts, body) = request.into_parts();
    let keyed = match admit(&parts, body, &settings).await {
        Admitted::Refused(response) => return Ok(response),
        Admitted::Unguarded(body) => return inner.call(Request::from_parts(parts, body)).await,
        Admitted::Keyed(keyed) => keyed,
    };
    let asked = std::time::Instant::now();
    let lease = match reserve(&store, &keyed, &settings).await {
        Ok(lease) => lease,
        Err(answer) => return Ok(answer),
    };
    // Renewed while the handler runs, so that a retry never takes over a handler that
    // is still running; the handler can read the lease's state (`Extension<LeaseWatch>`).
    let held = Held::start((lease, asked), store.lease_timeout());
    parts.extensions.insert(held.watch.clone());
    let Keyed {
        tenant,
        operation,
        key,
        body,
        ..
    } = keyed;
    parts.extensions.insert(IdempotencyContext {
        tenant,
        operation,
        key,
    });
    let answer = inner
        .call(Request::from_parts(parts, Body::from(body)))
        .await;
    let lease = match held.stop().await {
        Ok(lease) => lease,
        Err(err) => {
            log::warn!("idempotency: ending the lease: {err}");
            return answer;
        }
    };
    match answer {
        Ok(response) => Ok(finish(lease, response, &settings, store.max_response_bytes()).await),
        Err(err) => {
            // No answer, so nothing to store and no telling what happened downstream:
            // in flight with a note (outcome unknown), and the error to the caller.
            let note = format!("service error: {err}");
            if let Err(noted) = lease
                .note(
                    note.as_bytes()
                        .get(..note.len().min(MAX_NOTE_BYTES))
                        .unwrap_or_default(),
                )
                .await
            {
                log::warn!("idempotency: noting a service error: {noted}");
            }
            Err(err)
        }
    }
}

fn store_error(err: &Error, settings: &Settings) -> Response<Body> {
    match err {
        Error::Unavailable { .. } => retry_later(
            StatusCode::SERVICE_UNAVAILABLE,
            "idempotency_store_unavailable",
            settings.retry_after_secs,
        ),
        Error::Full => retry_later(
            StatusCode::SERVICE_UNAVAILABLE,
            "idempotency_store_full",
            settings.retry_after_secs,
        ),
        // Another caller holds the record's lock (its first attempt may be running).
        Error::TimedOut { .. } => retry_later(
            StatusCode::SERVICE_UNAVAILABLE,
            "idempotency_store_busy",
            settings.retry_after_secs,
        ),
        Error::KeyTooLong { .. } | Error::ScopeTooLong { .. } | Error::EmptyKey => {
            refuse(StatusCode::BAD_REQUEST, "invalid_idempotency_key")
        }
        _ => refuse(StatusCode::INTERNAL_SERVER_ERROR, "idempotency_store_error"),
    }
}

fn replay(stored: &[u8]) -> Response<Body> {
    match StoredResponse::decode(stored) {
        Some(stored) => {
            let mut response = stored.into_response();
            response
                .headers_mut()
                .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
            response
        }
        None => refuse(
            StatusCode::INTERNAL_SERVER_ERROR,
            "stored_response_unreadable",
        ),
    }
}

/// Stores a `2xx` or `4xx` and answers it; leaves a `5xx` in flight unless the handler
/// said nothing happened.
async fn finish<L: StoreLease>(
    lease: L,
    response: Response<Body>,
    settings: &Settings,
    max_response: usize,
) -> Response<Body> {
    let status = response.status();
    let marked = response.extensions().get::<SideEffect>().copied();
    let action = match marked {
        Some(SideEffect::NotPerformed) => Some(ServerErrors::Release),
        Some(SideEffect::Unknown) => Some(ServerErrors::KeepInFlight),
        None if settings.release_statuses.contains(&status) => Some(ServerErrors::Release),
        None if status.is_server_error() => Some(settings.server_errors),
        None => None,
    };
    match action {
        Some(ServerErrors::Release) => {
            if let Err(err) = lease.release().await {
                log::warn!("idempotency: releasing after {status}: {err}");
            }
            return response;
        }
        Some(ServerErrors::KeepInFlight) => {
            let note = format!("HTTP {status}: outcome unknown");
            if let Err(err) = lease.note(note.as_bytes()).await {
                log::warn!("idempotency: noting {status}: {err}");
            }
            return response;
        }
        Some(ServerErrors::Store) | None => {}
    }
    let (parts, body) = response.into_parts();
    let limit = body_limit(&parts, &settings.replay_headers, max_response);
    let hint = body.size_hint();
    let Some(upper) = hint.upper() else {
        // A streaming body (server-sent events): never buffered, never stored. Nothing
        // can be replayed, so the key is released and a retry runs the handler again;
        // keep such routes out of the layer unless that is harmless.
        if let Err(err) = lease.release().await {
            log::warn!("idempotency: releasing after a streaming response: {err}");
        }
        return Response::from_parts(parts, body);
    };
    if usize::try_from(upper).map_or(true, |upper| upper > limit) {
        // Too large for the store: the response goes out unbuffered, and the record keeps
        // its status and headers with an empty body and `Idempotent-Body-Omitted`, so a
        // retry learns the outcome without running the handler again.
        let mut omitted = StoredResponse::capture(&parts, &[], &settings.replay_headers);
        omitted.headers.push((
            HeaderName::from_static(IDEMPOTENT_BODY_OMITTED),
            HeaderValue::from_static("true"),
        ));
        save(lease, status, &omitted.encode()).await;
        return Response::from_parts(parts, body);
    }
    let Ok(body) = axum::body::to_bytes(body, limit).await else {
        // The body ended early or grew past its size hint: nothing whole to replay, so
        // the record stays in flight, noted (outcome unknown), for reconciliation.
        let note = format!("HTTP {status}: the response body could not be read: outcome unknown");
        if let Err(err) = lease.note(note.as_bytes()).await {
            log::warn!("idempotency: noting an unreadable response: {err}");
        }
        return refuse(StatusCode::INTERNAL_SERVER_ERROR, "response_unreadable");
    };
    let stored = StoredResponse::capture(&parts, &body, &settings.replay_headers);
    save(lease, status, &stored.encode()).await;
    Response::from_parts(parts, Body::from(body))
}

/// Stores an answer: a `4xx` or `5xx` as failed, anything else as completed.
async fn save<L: StoreLease>(lease: L, status: StatusCode, encoded: &[u8]) {
    let saved = if status.is_client_error() || status.is_server_error() {
        lease.fail(encoded).await
    } else {
        lease.complete(encoded).await
    };
    if let Err(err) = saved {
        // The side effect happened but its record was not stored (a lost or fenced
        // lease, an unreachable store): answer it, and let the record resolve by
        // reconciliation or expiry.
        log::warn!("idempotency: storing the response: {err}");
    }
}

/// The largest body that fits, with the response's stored headers, in a store that
/// accepts responses of `max_response` bytes.
fn body_limit(
    parts: &axum::http::response::Parts,
    allow: &[HeaderName],
    max_response: usize,
) -> usize {
    let headers = StoredResponse::capture(parts, &[], allow).encode().len();
    max_response.saturating_sub(headers)
}

#[cfg(test)]
mod tests {
    use axum::http::StatusCode;
    use axum::http::header::{CONTENT_TYPE, HeaderName, RETRY_AFTER, SET_COOKIE};

    use crate::api::{Db, Options};
    use crate::base::Error;
    use crate::http::{IdempotencyLayer, Settings, store_error};

    #[test]
    fn a_store_that_timed_out_is_retried_later_and_a_refused_login_is_not() {
        let settings = Settings::new(|_| Some("t".to_owned()));
        let busy = store_error(
            &Error::TimedOut {
                engine: "postgres",
                message: "canceling statement due to statement timeout".to_owned(),
            },
            &settings,
        );
        assert_eq!(busy.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(busy.headers().contains_key(RETRY_AFTER));
        let login = store_error(
            &Error::Authentication {
                engine: "redis",
                message: "WRONGPASS".to_owned(),
            },
            &settings,
        );
        assert_eq!(login.status(), StatusCode::INTERNAL_SERVER_ERROR);
    }

    #[test]
    fn credentials_and_hop_by_hop_headers_are_never_replayed() {
        let db = Db::open(Options::in_memory()).unwrap();
        let settings = || IdempotencyLayer::new(db.clone(), |_| Some("t".to_owned()));
        assert!(settings().replay_headers(vec![CONTENT_TYPE]).is_ok());
        for refused in [
            SET_COOKIE,
            HeaderName::from_static("authorization"),
            HeaderName::from_static("connection"),
            HeaderName::from_static("transfer-encoding"),
        ] {
            let answer = settings().replay_headers(vec![CONTENT_TYPE, refused.clone()]);
            assert!(answer.is_err(), "{refused} accepted");
        }
    }
}
