//! Many tenants, each with an inbox (and outbox) of its own: the tenant a message belongs to picks
//! its inbox, one migration brings every tenant's tables up to date, and one relay serves every
//! tenant's outbox fairly.
//!
//! A tenant's inbox is any [`Inbox`]: in a schema of its own on a pool the tenants share
//! ([`Inbox::with_schema`], PostgreSQL; [`Tenants::by_schema`] makes them all), or on a database
//! of its own with a pool of its own (one URL per tenant, any backend). The guide "Running at
//! scale" shows both
//! (<https://docs.rs/idempotent-inbox/latest/idempotent/guide/scale/index.html#tenants>).

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use crate::error::InboxError;
use crate::inbox::Inbox;
use crate::outbox::{Publisher, Relay, RelayOptions};
use crate::retention::{self, PurgeReport, Purger, PurgerOptions};
use crate::schema::Migration;
use crate::store::Backend;

/// The inboxes of a service's tenants, by tenant: the handler of a message looks its tenant's
/// inbox up with [`inbox`](Self::inbox) (the tenant is whatever the message says it is: a header,
/// a field, a routing key) and calls the `#[idempotent]` handler with it. A message of a tenant
/// that is not here gets [`InboxError::UnknownTenant`], which is not retryable (a runner
/// dead-letters it with that reason).
///
/// Cheap to clone (the inboxes are shared).
///
/// ```no_run
/// # use idempotent_runtime as idempotent;
/// # async fn demo(pool: sqlx::PgPool, tenant: &str) -> Result<(), idempotent::InboxError> {
/// use idempotent::Tenants;
///
/// let tenants = Tenants::by_schema(&idempotent::Inbox::new(pool), ["acme", "globex"])?;
/// tenants.migrate().await.map_err(|failed| failed.error)?;
/// // For each message: its tenant's inbox, then the handler with it.
/// let inbox = tenants.inbox(tenant)?;
/// # let _ = inbox;
/// # Ok(()) }
/// ```
pub struct Tenants<DB: Backend> {
    inboxes: Arc<BTreeMap<String, Inbox<DB>>>,
}

/// A tenant whose tables [`Tenants::migrate`] could not bring up to date: the tenants before it
/// (in the order of their names) were migrated, those after it were not tried.
#[derive(Debug, thiserror::Error)]
#[error("tenant {tenant:?}: {error}")]
#[non_exhaustive]
pub struct TenantFailed {
    /// The tenant.
    pub tenant: String,
    /// What failed.
    #[source]
    pub error: InboxError,
}

impl<DB: Backend> Tenants<DB> {
    /// No tenants yet.
    pub fn new() -> Self {
        Self {
            inboxes: Arc::default(),
        }
    }

    /// The same tenants and `tenant`, whose messages go to `inbox` (replacing the inbox it had).
    /// The outgoing messages its handlers queue get ids derived with the tenant's name too (see
    /// [`Outbox::derived_id`](crate::outbox::Outbox::derived_id)): the same key in two tenants
    /// is two messages downstream.
    pub fn with(self, tenant: &str, inbox: Inbox<DB>) -> Self {
        let mut inboxes = Arc::unwrap_or_clone(self.inboxes);
        inboxes.insert(tenant.to_owned(), inbox.for_tenant(tenant));
        Self {
            inboxes: Arc::new(inboxes),
        }
    }

    /// The inbox of `tenant`; [`InboxError::UnknownTenant`] if there is none.
    pub fn inbox(&self, tenant: &str) -> Result<&Inbox<DB>, InboxError> {
        self.inboxes
            .get(tenant)
            .ok_or_else(|| InboxError::UnknownTenant {
                tenant: tenant.to_owned(),
            })
    }

    /// The tenants and their inboxes, in the order of their names.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Inbox<DB>)> {
        self.inboxes
            .iter()
            .map(|(tenant, inbox)| (tenant.as_str(), inbox))
    }

    /// How many tenants there are.
    pub fn len(&self) -> usize {
        self.inboxes.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.inboxes.is_empty()
    }

    /// [Migrates](Inbox::migrate) every tenant's tables, one tenant after another in the order of
    /// their names; stops at the first that fails. Safe to call from every instance at start-up,
    /// as `migrate` is.
    pub async fn migrate(&self) -> Result<Vec<(String, Migration)>, TenantFailed> {
        let mut migrated = Vec::with_capacity(self.len());
        for (tenant, inbox) in self.iter() {
            let migration = inbox.migrate().await.map_err(|error| TenantFailed {
                tenant: tenant.to_owned(),
                error,
            })?;
            migrated.push((tenant.to_owned(), migration));
        }
        Ok(migrated)
    }

    /// Starts one relay for every tenant's outbox: its workers go round the tenants, one batch
    /// of each per round (each worker starting its rounds at another tenant, and each round one
    /// tenant further), so a tenant with a backlog delays the others by one batch a round, not by
    /// its backlog. One `publisher` serves them all. On PostgreSQL with
    /// [`RelayOptions::listen`], one connection listens for every tenant of a database (their
    /// tables share a name, and so a channel); an idle relay looks at every tenant each time it
    /// polls. Otherwise as [`Inbox::spawn_relay`]; the tenants added afterwards are not served.
    pub fn spawn_relay<P: Publisher>(&self, publisher: P, options: RelayOptions) -> Relay {
        let inboxes: Vec<Inbox<DB>> = self.inboxes.values().cloned().collect();
        crate::outbox::spawn_relay_of(&inboxes, publisher, options)
    }

    /// Starts one purger for every tenant: every `options.interval` it purges the tenants one
    /// after another, as [`Inbox::spawn_purger`] purges one (each tenant's retention is its
    /// inbox's, and an instance purging a tenant's tables makes the others skip that tenant). A
    /// tenant whose purge fails is logged and tried again next time; the others are purged all the
    /// same. The tenants added afterwards are not purged.
    pub fn spawn_purger(&self, options: PurgerOptions) -> Purger {
        let tenants = self.clone();
        retention::spawn(options, "every tenant's".to_owned(), move |batch, pause| {
            let tenants = tenants.clone();
            Box::pin(async move {
                let mut total = PurgeReport::default();
                for (tenant, inbox) in tenants.iter() {
                    match inbox.purge(batch, pause).await {
                        Ok(report) => total.add(&report),
                        Err(error) => {
                            tracing::warn!(tenant, table = %inbox.table(), %error, "a tenant's purge failed; trying again later");
                        }
                    }
                }
                Ok(total)
            })
        })
    }
}

#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
impl Tenants<sqlx::Postgres> {
    /// A tenant for each of `schemas`, named after its schema, whose inbox is `inbox` in that
    /// schema ([`Inbox::with_schema`]): the same pool, which they share, and the same settings.
    pub fn by_schema<'a>(
        inbox: &Inbox<sqlx::Postgres>,
        schemas: impl IntoIterator<Item = &'a str>,
    ) -> Result<Self, InboxError> {
        schemas
            .into_iter()
            .try_fold(Self::new(), |tenants, schema| {
                Ok(tenants.with(schema, inbox.clone().with_schema(schema)?))
            })
    }
}

impl<DB: Backend> Default for Tenants<DB> {
    fn default() -> Self {
        Self::new()
    }
}

impl<DB: Backend> Clone for Tenants<DB> {
    fn clone(&self) -> Self {
        Self {
            inboxes: self.inboxes.clone(),
        }
    }
}

impl<DB: Backend> fmt::Debug for Tenants<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}
