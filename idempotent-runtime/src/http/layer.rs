//! The layer a route opts in with, and its builder methods.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use http::header::HeaderName;
use http::request::Parts;

use super::config::{Config, LayerState, Mode, ScopeFn, TenantFn};
use super::fingerprint::Fingerprint;
use super::problem::Documentation;
use super::service::Idempotent;
use crate::calls::MAX_CALL_LEASE;
use crate::error::InboxError;
use crate::inbox::{Inbox, check_consumer};
use crate::store::try_claim::HttpBackend;
use crate::tenants::Tenants;

/// A [`tower::Layer`] that makes the routes it wraps idempotent by `Idempotency-Key` header; see
/// the [module docs](super) for what it answers when.
///
/// Make one per way a route's handler runs, configure it, and add it to the routes that create
/// effects, in axum with `post(handler).layer(layer.clone())` or `Router::route_layer`. Clones
/// share their configuration and the keys in flight.
pub struct IdempotencyLayer<DB: HttpBackend> {
    shared: Arc<LayerState<DB>>,
}

impl<DB: HttpBackend> Clone for IdempotencyLayer<DB> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

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
        Self {
            shared: Arc::new(LayerState::new(inbox, Config::new(scope, mode))),
        }
    }

    /// The same layer with `change` applied to its configuration.
    fn configure(self, change: impl FnOnce(&mut Config)) -> Self {
        Self {
            shared: Arc::new(Arc::unwrap_or_clone(self.shared).reconfigured(change)),
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

    /// Lets a twin wait for the request in flight with its key, up to `patience`, and then answers
    /// it as a retry is answered (the stored response's replay, or `422` if the twin's request is
    /// another), instead of refusing it at once with `409`. A client that sends a request again
    /// before the first has answered (its timeout was shorter than the handler, a user's second
    /// click, a proxy's retry) then gets the answer rather than an error to handle.
    ///
    /// The twin follows the first request wherever it runs: on this instance it is woken as the
    /// first ends; on another instance (its claim, or its pending call, in the database), it checks
    /// again at growing intervals of up to 50 milliseconds. If the first ends without storing a
    /// response (see [`store_when`](Self::store_when)), the twin runs the handler itself, as a
    /// retry would. A twin still waiting after `patience` gets the `409` with `Retry-After`, as it
    /// would have at once without this; so does one whose client went away meanwhile (it stops
    /// waiting). By default twins do not wait: the IETF draft's answer is `409` at once. Choose a
    /// patience that covers the handler's usual time and is shorter than the clients' timeouts.
    pub fn wait_for_first(self, patience: Duration) -> Self {
        self.configure(|config| config.wait_for_first = Some(patience))
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
    /// consumer. (A layer [`by_tenant`](Self::by_tenant) stores them in its
    /// [`tenants`](Self::tenants)' inboxes instead.)
    pub fn inbox(&self) -> &Inbox<DB> {
        &self.shared.inbox
    }

    /// Serves each request on its tenant's inbox, of `tenants` (see [`Tenants`]): `tenant` names
    /// the tenant from the request's head (a header, the host, the organization of the principal
    /// an authentication layer put in the extensions). The request's key, effect and stored
    /// response are then in that tenant's tables (its schema, its database), and a key of one
    /// tenant is not another's: the same key sent for two tenants runs twice, once in each.
    /// A request without a tenant (`None`, or an empty name) is `400` (`tenant_missing`), one for
    /// a tenant that `tenants` does not hold `400` (`tenant_unknown`). The inbox the layer was
    /// made with then serves no request; spawn the purgers from [`tenants`](Self::tenants).
    ///
    /// ```no_run
    /// # use idempotent_runtime as idempotent;
    /// # fn demo(pool: sqlx::PgPool) -> Result<(), idempotent::InboxError> {
    /// use idempotent::Tenants;
    /// use idempotent::http::IdempotencyLayer;
    ///
    /// let tenants = Tenants::by_schema(&idempotent::Inbox::new(pool.clone()), ["acme", "globex"])?;
    /// let header = |parts: &http::request::Parts, name: &str| {
    ///     parts.headers.get(name)?.to_str().ok().map(str::to_owned)
    /// };
    /// let layer = IdempotencyLayer::transactional(idempotent::Inbox::new(pool), move |parts| {
    ///     header(parts, "x-client")
    /// })
    /// .by_tenant(tenants, move |parts| header(parts, "x-tenant"));
    /// # let _ = layer;
    /// # Ok(()) }
    /// ```
    pub fn by_tenant(
        self,
        tenants: Tenants<DB>,
        tenant: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        let tenant: Arc<TenantFn> = Arc::new(tenant);
        Self {
            shared: Arc::new(Arc::unwrap_or_clone(self.shared).by_tenant(tenants, tenant)),
        }
    }

    /// Returns the tenants' inboxes a layer [`by_tenant`](Self::by_tenant) stores responses in,
    /// each keeping the layer's rows for its [`retention`](Self::retention): spawn the purger from
    /// these (`layer.tenants().unwrap().spawn_purger(…)`). `None` for a layer of one inbox.
    pub fn tenants(&self) -> Option<&Tenants<DB>> {
        self.shared.tenants()
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
            .field("wait_for_first", &config.wait_for_first)
            .field("documentation", &config.documentation)
            .finish_non_exhaustive()
    }
}

impl<S, DB: HttpBackend> tower::Layer<S> for IdempotencyLayer<DB> {
    type Service = Idempotent<S, DB>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotent::new(inner, self.shared.clone())
    }
}
