//! What an inbox is configured with, and the `with_…` methods that replace it.

use std::sync::Arc;
use std::time::Duration;

use super::Inbox;
use crate::error::InboxError;
use crate::retention::Retention;
use crate::store::{Backend, Statements};
use crate::table::TableName;

/// What an inbox is configured with; shared by its clones, replaced whole by the `with_…`
/// methods.
pub(crate) struct Config<DB: Backend> {
    pub(crate) table: TableName,
    pub(crate) statements: Statements,
    pub(crate) settings: DB::Settings,
    pub(crate) retention: Retention,
    /// The tenant this inbox is, in a [`Tenants`](crate::Tenants): its claims' outgoing messages
    /// get ids of their own.
    pub(crate) tenant: Option<Arc<str>>,
    /// What the testing kit makes go wrong in every claimed transaction.
    #[cfg(feature = "testing")]
    pub(crate) injected: Option<Injected>,
}

/// What the testing kit makes go wrong in every claimed transaction of an inbox.
#[cfg(feature = "testing")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Injected {
    /// Rolled back where it would commit: a crash between the body and the commit.
    CrashBeforeCommit,
    /// Its connection ended by the server right after the claim, so that the body's statements
    /// fail as after a restart or a cut connection.
    ConnectionLostAfterClaim,
}

// Not derived: that would ask for `DB: Clone`.
impl<DB: Backend> Clone for Config<DB> {
    fn clone(&self) -> Self {
        Self {
            table: self.table.clone(),
            statements: self.statements.clone(),
            settings: self.settings.clone(),
            retention: self.retention.clone(),
            tenant: self.tenant.clone(),
            #[cfg(feature = "testing")]
            injected: self.injected,
        }
    }
}

impl<DB: Backend> Inbox<DB> {
    /// Returns the same inbox in another table (in the same schema, if it was
    /// [made for one](Inbox::with_schema)); `name` must pass [`TableName::new`].
    pub fn with_table(self, name: &str) -> Result<Self, InboxError> {
        let table = match self.config.table.schema() {
            Some(schema) => TableName::new(name)?.in_schema(schema)?,
            None => TableName::new(name)?,
        };
        Ok(self.in_tables(table))
    }

    /// The same inbox on `table`'s tables, its statements built again for them with the settings
    /// they had. The keys its HTTP layers handle are those of the new tables: a twin in another
    /// table is not one.
    pub(crate) fn in_tables(self, table: TableName) -> Self {
        #[cfg(feature = "http")]
        let this = Self {
            in_flight: Default::default(),
            ..self
        };
        #[cfg(not(feature = "http"))]
        let this = self;
        this.with_config(|config| {
            let mut statements = Statements::new(DB::DIALECT, &table);
            statements.outbox = statements
                .outbox
                .notifying(config.statements.outbox.notifies());
            Config {
                statements: statements.with_pooling(config.statements.pooled),
                table,
                ..config.clone()
            }
        })
    }

    /// Keeps rows for `retention` after they were processed (see [`Retention`] for the default and
    /// why), for every consumer without an override.
    pub fn with_retention(self, retention: Duration) -> Self {
        self.with_config(|config| Config {
            retention: Retention {
                default: retention,
                ..config.retention.clone()
            },
            ..config.clone()
        })
    }

    /// Keeps `consumer`'s rows for `retention`.
    pub fn with_consumer_retention(self, consumer: &str, retention: Duration) -> Self {
        self.with_config(|config| {
            let mut per_consumer = config.retention.per_consumer.clone();
            per_consumer.insert(consumer.to_owned(), retention);
            Config {
                retention: Retention {
                    per_consumer,
                    ..config.retention.clone()
                },
                ..config.clone()
            }
        })
    }

    /// Sets the margin for producers' clocks running ahead of the database's, when a message's
    /// send time is checked against its consumer's purge horizon; see
    /// [`Retention::skew_margin`].
    pub fn with_clock_skew_margin(self, margin: Duration) -> Self {
        self.with_config(|config| Config {
            retention: Retention {
                skew_margin: margin,
                ..config.retention.clone()
            },
            ..config.clone()
        })
    }

    /// The same inbox as `tenant`'s (see [`Config::tenant`]).
    pub(crate) fn for_tenant(self, tenant: &str) -> Self {
        self.with_config(|config| Config {
            tenant: Some(tenant.into()),
            ..config.clone()
        })
    }

    /// Returns how long rows are kept.
    pub fn retention(&self) -> &Retention {
        &self.config.retention
    }
}

#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
impl Inbox<sqlx::Postgres> {
    /// Returns the same inbox for a tenant whose tables are in `schema`: every statement of the
    /// inbox, its outbox, its relays, its purge and [`migrate`](Inbox::migrate) names its tables
    /// in that schema, and every transaction a handler gets from it (a claim, a batch, an HTTP
    /// request) begins with `SET LOCAL search_path TO "<schema>"`, so that the handler's own
    /// statements name that schema's tables without saying so. Tenants in schemas of one database
    /// share one pool (a pool per tenant would take as many connections); see [`Tenants`](crate::Tenants)
    /// and the guide "Running at scale"
    /// (<https://docs.rs/idempotent-inbox/latest/idempotent/guide/scale/index.html#tenants>).
    ///
    /// The `search_path` is the schema alone: a table the tenants share is named with its
    /// schema (`public.plans`). `schema` follows [`TableName`]'s rules, up to 63 characters;
    /// the schema itself is yours to create.
    ///
    /// ```no_run
    /// # use idempotent_runtime as idempotent;
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), idempotent::InboxError> {
    /// let acme = idempotent::Inbox::new(pool.clone()).with_schema("tenant_acme")?;
    /// let globex = idempotent::Inbox::new(pool).with_schema("tenant_globex")?;
    /// acme.migrate().await?; // creates tenant_acme.idempotent_inbox and the rest
    /// globex.migrate().await?;
    /// # Ok(()) }
    /// ```
    pub fn with_schema(self, schema: &str) -> Result<Self, InboxError> {
        let table = self.config.table.clone().in_schema(schema)?;
        Ok(self.in_tables(table))
    }

    /// Returns the same inbox, sending the claim in one message with its `BEGIN`: one round trip
    /// less per message, at the price the [`postgres` module docs](crate::postgres) describe (a
    /// committed duplicate is reported by the server as a unique violation, which it logs at
    /// `ERROR` with the statement, and leaves a dead row version). Both claims wait for a
    /// concurrent claim of the same key in the same way. (Only PostgreSQL has it: its protocol lets
    /// the claim ride in the `BEGIN`'s message while the inbox still learns the outcome, from the
    /// statement's error.)
    pub fn with_pipelined_claim(self) -> Self {
        self.with_settings(|_| crate::store::postgres::pipelined())
    }

    /// Returns the same inbox, for a pool whose connections go through a pooler in transaction mode
    /// (PgBouncer's `pool_mode = transaction`), which hands each transaction whichever server
    /// session is free. The inbox then prepares none of its statements, runs those it sends
    /// outside a handler's transaction (a duplicate's stored response, [`is_processed`](Self::is_processed),
    /// the steps of a call, each purge batch) in a transaction of their own, holds the purger's
    /// lock with a transaction left open for the purge's length instead of a session's lock, and
    /// claims with the quiet claim whatever [`with_pipelined_claim`](Self::with_pipelined_claim)
    /// said. Without it, [`migrate`](Self::migrate) refuses such a pool with
    /// [`InboxError::TransactionPooling`].
    ///
    /// The handlers' own statements need the same care: the guide "Running at scale" gives the
    /// pool's and PgBouncer's settings that make sqlx work through such a pooler
    /// (<https://docs.rs/idempotent-inbox/latest/idempotent/guide/scale/index.html#pgbouncer>).
    pub fn with_transaction_pooling(self) -> Self {
        self.with_config(|config| Config {
            statements: config.statements.clone().with_pooling(true),
            ..config.clone()
        })
    }
}

#[cfg(feature = "testing")]
impl<DB: Backend> Inbox<DB> {
    /// Returns the same inbox, with `injected` going wrong in each claimed transaction.
    pub(crate) fn injecting(self, injected: Injected) -> Self {
        self.with_config(|config| Config {
            injected: Some(injected),
            ..config.clone()
        })
    }
}
