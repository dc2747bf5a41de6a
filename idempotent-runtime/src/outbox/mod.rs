//! The transactional outbox: a handler's outgoing messages commit with its effect, and a relay
//! publishes them at least once, each with an id that stays the same however often it is published.
//!
//! A handler queues messages on an [`Outbox`] (an `outbox: &mut Outbox` parameter of an
//! `#[idempotent]` handler, filled in by the rewritten function, or [`Claimed::outbox`](crate::Claimed::outbox) by hand);
//! the inbox writes them in the handler's transaction, right before its commit; a relay
//! ([`Inbox::spawn_relay`], with a [`Publisher`]) publishes the committed rows and marks them sent
//! once the broker confirmed them. [`Inbox::enqueue`] writes an [`Outbox`] in any transaction of
//! yours.
//!
//! ```
//! # use idempotent_runtime as idempotent;
//! use idempotent::Inbox;
//! use idempotent::outbox::{Destination, OutgoingMessage};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let inbox = Inbox::<sqlx::Sqlite>::in_memory().await?;
//! if let Some(mut claimed) = inbox.claim("orders", "payment-1").await? {
//!     // the handler's statements on `claimed.connection()`, then:
//!     let paid = OutgoingMessage::new(Destination::exchange("shop", "order.paid"), b"{}".to_vec());
//!     claimed.outbox().send(paid);
//!     claimed.commit().await?; // the effect, the key and the outgoing message, together
//! }
//! assert_eq!(inbox.outbox_stats().await?.pending, 1);
//! # Ok(()) }
//! ```
//!
//! The guide "Outbox" says what holds and how (ids, confirmations, parking, ordering keys, the
//! relays' locks, retention and metrics) and what is tested: `idempotent::guide::outbox` in the
//! `idempotent-inbox` crate
//! (<https://docs.rs/idempotent-inbox/latest/idempotent/guide/outbox/index.html>).

mod operations;
mod publisher;
mod relay;

use std::time::Duration;

pub use crate::inbox::outgoing::{Destination, MAX_TEXT_LEN, Outbox, OutgoingMessage};
pub use operations::{HeldKey, OutboxRecord, OutboxState, OutboxStats};
pub use publisher::{Publication, PublishError, Publisher};
pub use relay::{Relay, RelayOptions, RelayReport, RelayStats};

use crate::error::{InboxError, Stage};
use crate::inbox::outgoing;
use crate::inbox::{Config, Inbox, check_name};
use crate::key::AsMessageKey;
use crate::metrics::OutboxMetrics;
use crate::retention::Retention;
use crate::store::{Backend, KeyShare, database_error};

impl Outbox {
    /// Creates an empty outbox for a transaction of your own, whose messages' ids derive from
    /// `origin` (a name such as `"checkout"`, as a consumer's name is) and `key` (any
    /// [`StableKey`](crate::StableKey) value that is the same each time the same work is done
    /// again: an order id, an HTTP request's idempotency key), as a handler's derive from its
    /// consumer and message key. Write it with [`Inbox::enqueue`]. Errors: an empty or too long
    /// origin, an empty key.
    pub fn new<K: AsMessageKey + ?Sized>(origin: &str, key: &K) -> Result<Self, InboxError> {
        check_name(origin).map_err(|reason| InboxError::ConsumerName {
            name: origin.to_owned(),
            reason,
        })?;
        Ok(Self::of(None, origin, key.as_message_key()?.into_owned()))
    }
}

impl<DB: Backend> Inbox<DB> {
    /// Writes `outbox`'s messages to the outbox table on `conn`, in the transaction you have open
    /// there, so that they commit with it (and, on PostgreSQL, with a `NOTIFY` that wakes the
    /// relays when it commits).
    /// Outside a transaction each row commits on its own. Refuses the whole outbox, writing
    /// nothing, if a message cannot be sent as it is ([`InboxError::Outgoing`]).
    pub async fn enqueue(
        &self,
        conn: &mut DB::Connection,
        outbox: Outbox,
    ) -> Result<(), InboxError> {
        let statements = &self.config.statements.outbox;
        outgoing::write::<DB>(conn, statements, &outbox).await?;
        if outbox.is_empty() {
            return Ok(());
        }
        // The commit is yours, so the wake-up goes in your transaction, sent as it commits.
        DB::outbox_notify(conn, statements)
            .await
            .map_err(database_error(Stage::Outbox))
    }

    /// Starts a relay of this inbox's outbox: tokio tasks that publish committed outgoing messages
    /// through `publisher` until the returned [`Relay`] is shut down, stopped or dropped. Safe to
    /// start in every instance (see the [module docs](self)). Each worker takes a connection of the
    /// pool for each batch and holds it while the broker confirms the batch; on PostgreSQL with
    /// [`RelayOptions::listen`] one more connection listens for as long as the relay runs.
    pub fn spawn_relay<P: Publisher>(&self, publisher: P, options: RelayOptions) -> Relay {
        spawn_relay_of(std::slice::from_ref(self), publisher, options)
    }

    /// Runs one relay batch now, with `publisher`: for tests, and for programs that drive the
    /// relay themselves (a scheduled job). Metrics are recorded as a relay's are.
    pub async fn relay_once<P: Publisher>(
        &self,
        publisher: &P,
        options: &RelayOptions,
    ) -> Result<RelayReport, InboxError> {
        let metrics = OutboxMetrics::new(&self.table().to_string());
        relay::batch(self, publisher, options, &metrics, KeyShare::ALL).await
    }

    /// On PostgreSQL, whether the relays are woken by `NOTIFY` when outgoing messages are
    /// committed (default on): after a handler's commit, in a statement of its own that one task
    /// per inbox sends for a burst of commits (see the guide "Outbox"); in your transaction for
    /// [`enqueue`](Self::enqueue). Turn it off when every relay only polls
    /// ([`RelayOptions::listen`] off): each `NOTIFY` is one more transaction for the database.
    /// Does nothing on the other databases.
    pub fn with_outbox_notify(self, notify: bool) -> Self {
        self.with_config(|config| {
            let mut config = config.clone();
            config.statements.outbox = config.statements.outbox.clone().notifying(notify);
            config
        })
    }

    /// Keeps sent outgoing messages for `retention` after they were sent (default 24 hours), then
    /// the purge deletes them.
    pub fn with_outbox_retention(self, retention: Duration) -> Self {
        self.with_config(|config| Config {
            retention: Retention {
                outbox: retention,
                ..config.retention.clone()
            },
            ..config.clone()
        })
    }
}

/// Starts one relay of the outboxes of `inboxes`; see [`Tenants::spawn_relay`](crate::Tenants::spawn_relay).
pub(crate) fn spawn_relay_of<DB: Backend, P: Publisher>(
    inboxes: &[Inbox<DB>],
    publisher: P,
    options: RelayOptions,
) -> Relay {
    relay::spawn(inboxes, publisher, options)
}
