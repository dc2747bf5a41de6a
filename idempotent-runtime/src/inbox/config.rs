//! What an inbox is configured with, and the `with_…` methods that replace it.

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
            #[cfg(feature = "testing")]
            injected: self.injected,
        }
    }
}

impl<DB: Backend> Inbox<DB> {
    /// Returns the same inbox in another table; `name` must pass [`TableName::new`].
    pub fn with_table(self, name: &str) -> Result<Self, InboxError> {
        let table = TableName::new(name)?;
        Ok(self.with_config(|config| Config {
            statements: Statements::new(DB::DIALECT, &table).with_pooling(config.statements.pooled),
            table,
            ..config.clone()
        }))
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

    /// Returns how long rows are kept.
    pub fn retention(&self) -> &Retention {
        &self.config.retention
    }
}

#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
impl Inbox<sqlx::Postgres> {
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
