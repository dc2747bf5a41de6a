//! The layer a route opts in with, its configuration, and the tower service it wraps the route in.

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum_core::extract::Request;
use axum_core::response::{IntoResponse, Response};
use http::StatusCode;
use http::header::HeaderName;
use http::request::Parts;

use super::HttpBackend;
use super::fingerprint::Fingerprint;
use super::flow;
use super::problem::Documentation;
use super::request_key::DEFAULT_MAX_KEY_LEN;
use super::stored::{DEFAULT_STORED_HEADERS, stored_by_default};
use crate::calls::MAX_CALL_LEASE;
use crate::error::InboxError;
use crate::inbox::{Inbox, check_consumer};

/// Names the client a request comes from, given its head: the scope of its keys.
type ScopeFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// Says whether a response with this status is stored.
type StoreWhenFn = dyn Fn(StatusCode) -> bool + Send + Sync;

/// How a route's handler runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// In the transaction that claimed the key, which commits with the stored response.
    Transaction,
    /// Outside the database, under a pending call record with this lease.
    Lease(Duration),
}

/// A layer's configuration; see the builder methods of [`IdempotencyLayer`].
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) consumer: Arc<str>,
    pub(crate) mode: Mode,
    pub(crate) scope: Arc<ScopeFn>,
    pub(crate) require_key: bool,
    pub(crate) max_key_len: usize,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) max_request_body: usize,
    pub(crate) max_stored_body: usize,
    pub(crate) store_when: Arc<StoreWhenFn>,
    pub(crate) stored_headers: Vec<HeaderName>,
    pub(crate) retry_after: Duration,
    pub(crate) retention: Duration,
    pub(crate) store_patience: Duration,
    pub(crate) documentation: Option<Documentation>,
}

/// What every clone of a layer and of its services shares.
pub(crate) struct Shared<DB: HttpBackend> {
    /// The inbox as given.
    base: Inbox<DB>,
    /// The inbox with the layer's retention for its consumer.
    pub(crate) inbox: Inbox<DB>,
    pub(crate) config: Config,
}

impl<DB: HttpBackend> Clone for Shared<DB> {
    fn clone(&self) -> Self {
        Self {
            base: self.base.clone(),
            inbox: self.inbox.clone(),
            config: self.config.clone(),
        }
    }
}

/// A [`tower::Layer`] that makes the routes it wraps idempotent by `Idempotency-Key` header; see
/// the [module docs](super) for what it answers when.
///
/// Make one per way a route's handler runs, configure it, and add it to the routes that create
/// effects, in axum with `post(handler).layer(layer.clone())` or `Router::route_layer`. Clones
/// share their configuration and the keys in flight.
pub struct IdempotencyLayer<DB: HttpBackend> {
    shared: Arc<Shared<DB>>,
}

impl<DB: HttpBackend> Clone for IdempotencyLayer<DB> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

/// The consumer name of a layer's inbox rows unless configured otherwise.
pub const DEFAULT_CONSUMER: &str = "http";

/// How long stored responses are kept unless configured otherwise: 24 hours.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);

/// How long a leased route's client waits for its response to be stored unless configured
/// otherwise: 5 seconds (see [`IdempotencyLayer::store_patience`]).
pub const DEFAULT_STORE_PATIENCE: Duration = Duration::from_secs(5);

/// The most of a request body read (to fingerprint it) unless configured otherwise: 2 MiB,
/// axum's own default body limit.
pub const DEFAULT_MAX_REQUEST_BODY: usize = 2 * 1024 * 1024;

/// The longest response body stored unless configured otherwise: 256 KiB.
pub const DEFAULT_MAX_STORED_BODY: usize = 256 * 1024;

impl<DB: HttpBackend> IdempotencyLayer<DB> {
    /// Creates a layer whose routes' handlers write to the inbox's database: each request's key is
    /// claimed in a transaction that the handler takes with the
    /// [`IdempotentTx`](super::IdempotentTx) extractor, and its effect, the key and the stored
    /// response commit together after the handler answered. A handler may also leave the
    /// transaction alone; it stays open while the handler runs, so a handler that calls outside
    /// services belongs behind a [`leased`](Self::leased) layer.
    ///
    /// `scope` names the client a request comes from (the authenticated principal, an API key's
    /// id, put in the request's extensions by the authentication layer before this one): one
    /// client's key never reaches another client's stored response. `None` or an empty name is a
    /// `400`.
    pub fn transactional(
        inbox: Inbox<DB>,
        scope: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        Self::with_mode(inbox, Arc::new(scope), Mode::Transaction)
    }

    /// Creates a layer whose routes' handlers do not write to the inbox's database (they call a
    /// payment provider, send an email): before the handler runs, the key is recorded as a pending
    /// call with `lease` (see [`calls`](crate::calls)), in a transaction of its own, and the stored
    /// response is committed when the handler answered. A request whose handler died mid-way (a
    /// crash) holds its key until the lease runs out; after that a retry runs the handler again.
    /// Choose a lease longer than the handler ever takes, and pass
    /// [`RequestKey::idempotency_key`](super::RequestKey::idempotency_key) on to the services it
    /// calls. `scope` as for [`transactional`](Self::transactional). A lease that is zero or longer
    /// than [`MAX_CALL_LEASE`] is [`InboxError::Lease`].
    pub fn leased(
        inbox: Inbox<DB>,
        scope: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
        lease: Duration,
    ) -> Result<Self, InboxError> {
        if lease.is_zero() || lease > MAX_CALL_LEASE {
            return Err(InboxError::Lease {
                lease,
                reason: "it must be more than zero and at most a year (MAX_CALL_LEASE)",
            });
        }
        Ok(Self::with_mode(inbox, Arc::new(scope), Mode::Lease(lease)))
    }

    fn with_mode(inbox: Inbox<DB>, scope: Arc<ScopeFn>, mode: Mode) -> Self {
        let config = Config {
            consumer: DEFAULT_CONSUMER.into(),
            mode,
            scope,
            require_key: true,
            max_key_len: DEFAULT_MAX_KEY_LEN,
            fingerprint: Fingerprint::default(),
            max_request_body: DEFAULT_MAX_REQUEST_BODY,
            max_stored_body: DEFAULT_MAX_STORED_BODY,
            store_when: Arc::new(stored_by_default),
            stored_headers: DEFAULT_STORED_HEADERS.to_vec(),
            retry_after: Duration::from_secs(1),
            retention: DEFAULT_RETENTION,
            store_patience: DEFAULT_STORE_PATIENCE,
            documentation: None,
        };
        Self {
            shared: Arc::new(Shared {
                inbox: inbox
                    .clone()
                    .with_consumer_retention(&config.consumer, config.retention),
                base: inbox,
                config,
            }),
        }
    }

    /// The same layer with `change` applied to its configuration.
    fn configure(self, change: impl FnOnce(&mut Config)) -> Self {
        let mut shared = Arc::unwrap_or_clone(self.shared);
        change(&mut shared.config);
        shared.inbox = shared
            .base
            .clone()
            .with_consumer_retention(&shared.config.consumer, shared.config.retention);
        Self {
            shared: Arc::new(shared),
        }
    }

    /// Sets the consumer name of the layer's inbox rows (`"http"` by default). Use the name for
    /// HTTP keys only: a message consumer of the same name would share their records. Two layers of
    /// one API share a name, so that a key cannot be used on two routes (their fingerprints differ:
    /// `422`); give separate APIs separate names.
    pub fn consumer(self, name: &str) -> Result<Self, InboxError> {
        check_consumer(name)?;
        Ok(self.configure(|config| config.consumer = name.into()))
    }

    /// Lets requests without an `Idempotency-Key` through to the handler, which then runs as it
    /// would without the layer (by default they get a `400`).
    pub fn key_optional(self) -> Self {
        self.configure(|config| config.require_key = false)
    }

    /// Sets the longest key accepted, in characters (255 by default); a longer one is a `400`.
    pub fn max_key_len(self, max: usize) -> Self {
        self.configure(|config| config.max_key_len = max)
    }

    /// Sets what of a request its fingerprint covers (method, path, query and body by default).
    pub fn fingerprint(self, fingerprint: Fingerprint) -> Self {
        self.configure(|config| config.fingerprint = fingerprint)
    }

    /// Sets the longest request body accepted, in bytes: the layer reads the whole body to
    /// fingerprint it before the handler runs. A longer one is a `413` (2 MiB by default).
    pub fn max_request_body(self, max: usize) -> Self {
        self.configure(|config| config.max_request_body = max)
    }

    /// Sets the longest response body stored, in bytes (256 KiB by default). A longer or endless
    /// (streamed) body is passed on to the client as it comes, and its response is stored
    /// without it: a replay has the stored status and headers, an empty body and
    /// `Idempotent-Body-Omitted: true`.
    pub fn max_stored_body(self, max: usize) -> Self {
        self.configure(|config| config.max_stored_body = max)
    }

    /// Sets which responses are stored, by status ([`stored_by_default`](super::stored_by_default)
    /// unless configured). A response that is not stored leaves nothing behind: the transaction
    /// rolls back, or the pending call is released, so that a retry runs the handler again.
    pub fn store_when(self, store: impl Fn(StatusCode) -> bool + Send + Sync + 'static) -> Self {
        self.configure(|config| config.store_when = Arc::new(store))
    }

    /// Also stores and replays the response header `name` (besides
    /// [`DEFAULT_STORED_HEADERS`](super::DEFAULT_STORED_HEADERS)).
    pub fn store_header(self, name: HeaderName) -> Self {
        self.configure(|config| {
            if !config.stored_headers.contains(&name) {
                config.stored_headers.push(name);
            }
        })
    }

    /// Sets the `Retry-After` of a `409` when the other request's end is unknown (on transactional
    /// routes): 1 second by default. (Under a lease it is the rest of the lease.)
    pub fn retry_after(self, after: Duration) -> Self {
        self.configure(|config| config.retry_after = after)
    }

    /// Sets how long stored responses are kept (24 hours by default); the purge of
    /// [`inbox`](Self::inbox) deletes them after that, and a request with the key runs again.
    pub fn retention(self, retention: Duration) -> Self {
        self.configure(|config| config.retention = retention)
    }

    /// Sets how long a leased route's client waits for its response to be stored when the database
    /// cannot store it for now (a lock held elsewhere, a connection lost): 5 seconds by default.
    /// After that the client gets `503` with `Retry-After` (`idempotency_store_pending`) instead
    /// of the handler's response, and the layer goes on storing it, keeping the call's lease
    /// alive, for a minute or one lease, whichever is longer; meanwhile retries get `409`, then the replay. (Each
    /// attempt to store is cut off after this long too.)
    pub fn store_patience(self, patience: Duration) -> Self {
        self.configure(|config| config.store_patience = patience.max(Duration::from_millis(1)))
    }

    /// Names the documentation of the route's idempotency keys, as the IETF draft asks: the
    /// layer's problems about the key (`400` for a missing or unusable key, `409` for a key in
    /// use, `422` for a reused key) then have it as their `type` and in a
    /// `Link: <uri>; rel="describedby"` header. Without it their `type` is `about:blank`.
    pub fn documentation(self, uri: http::Uri) -> Self {
        self.configure(|config| config.documentation = Some(Documentation::new(&uri)))
    }

    /// Returns the inbox the layer stores responses in: the one it was made with, keeping the
    /// layer's rows for its [`retention`](Self::retention). Spawn the purger from this one
    /// (`layer.inbox().spawn_purger(…)`), or give yours the same retention for the layer's
    /// consumer.
    pub fn inbox(&self) -> &Inbox<DB> {
        &self.shared.inbox
    }
}

impl<DB: HttpBackend> fmt::Debug for IdempotencyLayer<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let config = &self.shared.config;
        f.debug_struct("IdempotencyLayer")
            .field("consumer", &config.consumer)
            .field("mode", &config.mode)
            .field("require_key", &config.require_key)
            .field("max_key_len", &config.max_key_len)
            .field("fingerprint", &config.fingerprint)
            .field("max_request_body", &config.max_request_body)
            .field("max_stored_body", &config.max_stored_body)
            .field("stored_headers", &config.stored_headers)
            .field("retry_after", &config.retry_after)
            .field("retention", &config.retention)
            .field("store_patience", &config.store_patience)
            .field("documentation", &config.documentation)
            .finish_non_exhaustive()
    }
}

impl<S, DB: HttpBackend> tower::Layer<S> for IdempotencyLayer<DB> {
    type Service = Idempotent<S, DB>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotent {
            inner,
            shared: self.shared.clone(),
        }
    }
}

/// The service [`IdempotencyLayer`] wraps a route in.
pub struct Idempotent<S, DB: HttpBackend> {
    inner: S,
    shared: Arc<Shared<DB>>,
}

impl<S: Clone, DB: HttpBackend> Clone for Idempotent<S, DB> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: fmt::Debug, DB: HttpBackend> fmt::Debug for Idempotent<S, DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotent")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, DB> tower::Service<Request> for Idempotent<S, DB>
where
    S: tower::Service<Request, Error = Infallible> + Clone + Send + 'static,
    S::Response: IntoResponse,
    S::Future: Send + 'static,
    DB: HttpBackend,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        // The service that was polled ready handles this request; a clone waits for the next.
        let ready = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, ready);
        Box::pin(flow::handle(self.shared.clone(), inner, request))
    }
}
