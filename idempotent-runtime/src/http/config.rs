//! A layer's configuration, its defaults, and what every clone of a layer and of its services
//! shares.

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use http::header::HeaderName;
use http::request::Parts;

use super::fingerprint::Fingerprint;
use super::problem::{Documentation, Rejection};
use super::request_key::DEFAULT_MAX_KEY_LEN;
use super::stored::{DEFAULT_STORED_HEADERS, stored_by_default};
use crate::inbox::Inbox;
use crate::store::try_claim::HttpBackend;
use crate::tenants::Tenants;

/// The consumer name of a layer's inbox rows unless configured otherwise.
pub const DEFAULT_CONSUMER: &str = "http";

/// How long stored responses are kept unless configured otherwise: 24 hours.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);

/// How long a leased route's client waits for its response to be stored unless configured
/// otherwise: 5 seconds (see [`IdempotencyLayer::store_patience`](super::IdempotencyLayer::store_patience)).
pub const DEFAULT_STORE_PATIENCE: Duration = Duration::from_secs(5);

/// The most of a request body read (to fingerprint it) unless configured otherwise: 2 MiB,
/// axum's own default body limit.
pub const DEFAULT_MAX_REQUEST_BODY: usize = 2 * 1024 * 1024;

/// The longest response body stored unless configured otherwise: 256 KiB.
pub const DEFAULT_MAX_STORED_BODY: usize = 256 * 1024;

/// Names the client a request comes from, given its head: the scope of its keys.
pub(crate) type ScopeFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// Names the tenant a request belongs to, given its head.
pub(crate) type TenantFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// Says whether a response with this status is stored.
pub(crate) type StoreWhenFn = dyn Fn(StatusCode) -> bool + Send + Sync;

/// How a route's handler runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// In the transaction that claimed the key, which commits with the stored response.
    Transaction,
    /// Outside the database, under a pending call record with this lease.
    Lease(Duration),
}

/// A layer's configuration; see the builder methods of [`IdempotencyLayer`](super::IdempotencyLayer).
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
    /// How long a twin waits for the request in flight before it gets `409`; `None`: not at all.
    pub(crate) wait_for_first: Option<Duration>,
    pub(crate) documentation: Option<Documentation>,
}

impl Config {
    /// Returns the defaults of a layer whose clients are named by `scope` and whose handlers run
    /// in `mode`.
    pub(crate) fn new(scope: Arc<ScopeFn>, mode: Mode) -> Self {
        Self {
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
            wait_for_first: None,
            documentation: None,
        }
    }
}

/// What every clone of a layer and of its services shares.
pub(crate) struct LayerState<DB: HttpBackend> {
    /// The inbox as given.
    base: Inbox<DB>,
    /// The inbox with the layer's retention for its consumer.
    pub(crate) inbox: Inbox<DB>,
    /// The tenants' inboxes, when each request is served on its tenant's.
    by_tenant: Option<ByTenant<DB>>,
    pub(crate) config: Config,
}

/// The tenants of a layer that serves each request on its tenant's inbox.
struct ByTenant<DB: HttpBackend> {
    /// As given.
    base: Tenants<DB>,
    /// Each with the layer's retention for its consumer.
    tenants: Tenants<DB>,
    /// Names a request's tenant.
    tenant: Arc<TenantFn>,
}

impl<DB: HttpBackend> Clone for ByTenant<DB> {
    fn clone(&self) -> Self {
        Self {
            base: self.base.clone(),
            tenants: self.tenants.clone(),
            tenant: self.tenant.clone(),
        }
    }
}

impl<DB: HttpBackend> Clone for LayerState<DB> {
    fn clone(&self) -> Self {
        Self {
            base: self.base.clone(),
            inbox: self.inbox.clone(),
            by_tenant: self.by_tenant.clone(),
            config: self.config.clone(),
        }
    }
}

impl<DB: HttpBackend> LayerState<DB> {
    /// Returns what a layer made of `inbox` and `config` shares: the inbox keeps the layer's rows
    /// for the configured retention.
    pub(crate) fn new(inbox: Inbox<DB>, config: Config) -> Self {
        Self {
            inbox: retained(&inbox, &config),
            base: inbox,
            by_tenant: None,
            config,
        }
    }

    /// Returns the same serving each request on the inbox of the tenant `tenant` names, of
    /// `tenants`.
    pub(crate) fn by_tenant(mut self, tenants: Tenants<DB>, tenant: Arc<TenantFn>) -> Self {
        self.by_tenant = Some(ByTenant {
            tenants: retained_tenants(&tenants, &self.config),
            base: tenants,
            tenant,
        });
        self
    }

    /// Returns the same with `change` applied to the configuration (and the inboxes' retention
    /// following it).
    pub(crate) fn reconfigured(mut self, change: impl FnOnce(&mut Config)) -> Self {
        change(&mut self.config);
        self.inbox = retained(&self.base, &self.config);
        if let Some(by_tenant) = &mut self.by_tenant {
            by_tenant.tenants = retained_tenants(&by_tenant.base, &self.config);
        }
        self
    }

    /// The inbox a request with this head is served on: its tenant's, if the layer serves
    /// tenants.
    pub(crate) fn inbox_for(&self, parts: &Parts) -> Result<&Inbox<DB>, Rejection> {
        let Some(by_tenant) = &self.by_tenant else {
            return Ok(&self.inbox);
        };
        let tenant = (by_tenant.tenant)(parts)
            .filter(|tenant| !tenant.is_empty())
            .ok_or(Rejection::NoTenant)?;
        by_tenant
            .tenants
            .inbox(&tenant)
            .map_err(|_| Rejection::UnknownTenant { tenant })
    }

    /// The tenants' inboxes with the layer's retention, if the layer serves tenants.
    pub(crate) fn tenants(&self) -> Option<&Tenants<DB>> {
        self.by_tenant.as_ref().map(|by_tenant| &by_tenant.tenants)
    }
}

/// `inbox`, keeping the layer's rows for the configured retention.
fn retained<DB: HttpBackend>(inbox: &Inbox<DB>, config: &Config) -> Inbox<DB> {
    inbox
        .clone()
        .with_consumer_retention(&config.consumer, config.retention)
}

/// Each of `tenants`' inboxes [`retained`].
fn retained_tenants<DB: HttpBackend>(tenants: &Tenants<DB>, config: &Config) -> Tenants<DB> {
    tenants
        .iter()
        .fold(Tenants::new(), |retained, (name, inbox)| {
            retained.with(name, self::retained(inbox, config))
        })
}
