//! The transactional outbox: a handler's outgoing messages commit with its effect, and a relay
//! publishes them at least once, each with an id that stays the same however often it is published.
//!
//! A handler that publishes a follow-up event straight to the broker either loses it (published
//! after a commit, and the process died in between) or sends it for nothing (published before a
//! commit that then failed). With the outbox, the body queues the message and the inbox writes it
//! as a row in the handler's own transaction:
//!
//! ```text
//! #[idempotent(key = "message_id", consumer = "orders")]
//! async fn on_payment(tx: &mut sqlx::PgConnection, msg: &PaymentReceived, outbox: &mut Outbox)
//!     -> Result<(), ShopError> {
//!     sqlx::query("UPDATE orders SET paid = true WHERE id = $1").bind(msg.order_id).execute(&mut *tx).await?;
//!     outbox.send(OutgoingMessage::new(Destination::exchange("shop", "order.paid"), paid_event(msg)));
//!     Ok(())
//! }
//! ```
//! The parameter `outbox: &mut Outbox` is filled in by the rewritten handler, as an
//! `IdempotencyKey` parameter is. By hand, a claim has the same outbox:
//! ```
//! use idempotent_runtime::Inbox;
//! use idempotent_runtime::outbox::{Destination, OutgoingMessage};
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
//! # What holds
//! - **Rows commit with the effect.** The queued messages are written to `<table>_outbox` in the
//!   handler's transaction, right before its commit: a body that fails, panics or is cancelled, a
//!   duplicate, a failed commit leave no row; a committed body leaves exactly its rows.
//! - **Stable ids.** A message's id is derived from the consumer, the incoming message's key and
//!   its position among the handler's outgoing messages ([`Outbox::derived_id`], a UUID), unless
//!   it was given one ([`OutgoingMessage::with_id`]). A rerun of the body after a rollback queues
//!   the same messages and gets the same ids. The id is published as the broker's message id
//!   (AMQP `message_id`, NATS `Nats-Msg-Id`), so the downstream consumer's
//!   `#[idempotent(key = "message_id")]` drops a second publication of it as a duplicate.
//! - **At least once.** A relay ([`Inbox::spawn_relay`]) publishes committed rows through a
//!   [`Publisher`] and marks them sent only after the broker confirmed them (RabbitMQ: publisher
//!   confirms, persistent, mandatory; JetStream: the publish acknowledgement). A relay that dies
//!   after the confirmation and before marking leaves the rows pending, and they are published
//!   again: the stable id makes that harmless downstream.
//! - **Relays exclude each other.** Several relays (instances, or [`RelayOptions::workers`]) may
//!   run: each batch takes its rows in a transaction with `SELECT … FOR UPDATE SKIP LOCKED`
//!   (PostgreSQL, MySQL 8, MariaDB 10.6+), so no row is published by two relays at once; on SQLite
//!   the batch's `BEGIN IMMEDIATE` holds the database's one write lock while it publishes.
//!
//! # Outside a handler
//! Any transaction of yours can write outgoing messages, with ids derived from a key of yours (an
//! order id, an HTTP request's idempotency key) or given per message:
//! ```no_run
//! # use idempotent_runtime::outbox::{Destination, OutgoingMessage, Outbox};
//! # async fn demo(inbox: idempotent_runtime::Inbox<sqlx::Postgres>) -> Result<(), Box<dyn std::error::Error>> {
//! let mut tx = inbox.pool().begin().await?;
//! sqlx::query("INSERT INTO orders (id) VALUES (7)").execute(&mut *tx).await?;
//! let mut outbox = Outbox::new("checkout", "order-7")?;
//! outbox.send(OutgoingMessage::new(Destination::subject("ORDERS.created"), b"{}".to_vec()));
//! inbox.enqueue(&mut tx, outbox).await?;
//! tx.commit().await?;
//! # Ok(()) }
//! ```
//!
//! # The relay
//! A batch takes up to [`RelayOptions::batch_size`] due rows, publishes them concurrently, waits
//! for every confirmation (at most [`RelayOptions::publish_timeout`] each), marks the confirmed
//! ones sent, records the failures and commits. An idle relay polls with a back-off
//! ([`RelayOptions::min_poll_interval`] doubling to [`RelayOptions::max_poll_interval`]); on
//! PostgreSQL each transaction that wrote outgoing messages also sends a `NOTIFY` that wakes the
//! relays at its commit (`LISTEN` on the channel `<table>_outbox`, on a connection of the relay's
//! own: size the pool for it), so polling is only the fallback there.
//!
//! **One bad thing stays one bad thing.** What the broker refuses ([`PublishError::Rejected`]:
//! unroutable, an exchange that does not exist, a full queue that rejects publishes on RabbitMQ;
//! no stream for the subject, or the stream refusing it, on JetStream) counts an attempt of that
//! row and brings the row back after a back-off of its own (its `due_at`); after
//! [`RelayOptions::max_attempts`] the row is **parked**: left out of publishing, visible
//! ([`Inbox::parked_messages`], `idempotent outbox parked`) and retryable by hand
//! ([`Inbox::retry_parked`], `idempotent outbox retry`). Meanwhile every other row, of other
//! destinations and other ordering keys, goes out as before: a refusal never makes the relay as
//! a whole wait, and a key whose head waits for its next attempt takes no place in a batch from
//! a key that is ready. (A queue that stays full longer than the attempts last, about 8.5
//! minutes with the defaults, parks its rows: raise the attempts where queues stay full longer.)
//! A broker that cannot be reached, blocks publishers (a resource alarm) or does not confirm
//! within [`RelayOptions::publish_timeout`] ([`PublishError::Unavailable`]) counts no attempt:
//! the rows stay pending, and a batch that got nothing through makes the relay back off (100 ms
//! doubling to 10 s). RabbitMQ's publisher checks an exchange once before its
//! first publication there (RabbitMQ closes the channel of a publish to a missing exchange, which
//! would fail the others in flight on it), and waits for the confirmation of a publication the
//! relay gave up on before it sends that message again: under an alarm, each message reaches the
//! broker once.
//!
//! **Relays and writers do not deadlock.** On MySQL and MariaDB a batch runs at `READ
//! COMMITTED`: at InnoDB's default `REPEATABLE READ`, its `SKIP LOCKED` scan would leave
//! next-key locks (on the table's end too) that each insert of a writer waits for, while the
//! batch waited for a row such a writer had inserted: a deadlock (`1213`, or `1467` from the
//! auto-increment lock) that failed the writer's transaction. PostgreSQL's relays run at its
//! `READ COMMITTED`, and SQLite's take the one write lock in turn with writers.
//!
//! # Ordering keys
//! Messages with the same [ordering key](OutgoingMessage::with_ordering_key) are published in the
//! order their transactions committed, one at a time: a message of a key is published only after
//! the one before it was confirmed and marked sent. Each gets its key's next number from
//! `<table>_outbox_keys` in the writing transaction, which holds that key's row locked until it
//! commits, so the numbers follow the commits. What it costs:
//! - **Producers of one key take turns**: a second transaction writing a message of the same key
//!   waits for the first one's commit (or rollback) at that row; one more statement per keyed
//!   message. (Transactions write their keys in key order, so they never deadlock over them, and
//!   a relay locks no key's row.)
//! - **One message per key per batch**: a key's messages go out at most one per relay batch (a
//!   transaction and a broker round trip each, a few milliseconds), so one busy key gets hundreds
//!   of messages per second, not thousands; different keys go out side by side in a batch.
//! - **A key waits for its head**: a message the broker refuses holds up its key's later messages
//!   until it is sent or parked (and only its key's: while it waits for its next attempt, the
//!   batches take other keys). A parked message leaves its key's order: the later ones go on,
//!   and if it is retried by hand it is published after them.
//!
//! Messages without a key are published in row order within a batch and without any order
//! between batches and relays.
//!
//! # Retention and metrics
//! Sent rows are kept for the outbox's retention (24 hours unless
//! [`Inbox::with_outbox_retention`]), then deleted by the inbox's purge (with ordering keys whose
//! rows are all sent, untouched for as long). Parked rows are kept until retried. Relays record
//! published, retried and parked messages, the backlog and the age of its oldest message, and each
//! message's time from write to confirmation, through the `metrics` facade (see
//! [`metrics`](crate::metrics)), and run each batch in an `outbox_batch` tracing span.

mod operations;
mod publisher;
mod relay;

use std::time::Duration;

pub use crate::inbox::outgoing::{Destination, MAX_TEXT_LEN, Outbox, OutgoingMessage};
pub use operations::{OutboxRecord, OutboxState, OutboxStats};
pub use publisher::{Publication, PublishError, Publisher};
pub use relay::{Relay, RelayOptions, RelayReport, RelayStats};

use crate::error::InboxError;
use crate::inbox::outgoing;
use crate::inbox::{Config, Inbox, check_name};
use crate::key::AsMessageKey;
use crate::metrics::OutboxMetrics;
use crate::retention::Retention;
use crate::store::Backend;

impl Outbox {
    /// An empty outbox for a transaction of your own, whose messages' ids derive from `origin` (a
    /// name such as `"checkout"`, as a consumer's name is) and `key` (any
    /// [`StableKey`](crate::StableKey) value that is the same each time the same work is done
    /// again: an order id, an HTTP request's idempotency key), as a handler's derive from its
    /// consumer and message key. Write it with [`Inbox::enqueue`]. Errors: an empty or too long
    /// origin, an empty key.
    pub fn new<K: AsMessageKey + ?Sized>(origin: &str, key: &K) -> Result<Self, InboxError> {
        check_name(origin).map_err(|reason| InboxError::ConsumerName {
            name: origin.to_owned(),
            reason,
        })?;
        Ok(Self::of(origin, key.as_message_key()?.into_owned()))
    }
}

impl<DB: Backend> Inbox<DB> {
    /// Writes `outbox`'s messages to the outbox table on `conn`, in the transaction you have open
    /// there, so that they commit with it (and, on PostgreSQL, wake the relays when it commits).
    /// Outside a transaction each row commits on its own. Refuses the whole outbox, writing
    /// nothing, if a message cannot be sent as it is ([`InboxError::Outgoing`]).
    pub async fn enqueue(
        &self,
        conn: &mut DB::Connection,
        outbox: Outbox,
    ) -> Result<(), InboxError> {
        outgoing::write::<DB>(conn, &self.config.statements.outbox, &outbox).await
    }

    /// Starts a relay of this inbox's outbox: tokio tasks that publish committed outgoing messages
    /// through `publisher` until the returned [`Relay`] is shut down, stopped or dropped. Safe to
    /// start in every instance (see the [module docs](self)). Each worker takes a connection of the
    /// pool for each batch and holds it while the broker confirms the batch; on PostgreSQL with
    /// [`RelayOptions::listen`] one more connection listens for as long as the relay runs.
    pub fn spawn_relay<P: Publisher>(&self, publisher: P, options: RelayOptions) -> Relay {
        relay::spawn(self, publisher, options)
    }

    /// Runs one relay batch now, with `publisher`: for tests, and for programs that drive the
    /// relay themselves (a scheduled job). Metrics are recorded as a relay's are.
    pub async fn relay_once<P: Publisher>(
        &self,
        publisher: &P,
        options: &RelayOptions,
    ) -> Result<RelayReport, InboxError> {
        let metrics = OutboxMetrics::new(self.table().as_str());
        relay::batch(self, publisher, options, &metrics).await
    }

    /// On PostgreSQL, whether a transaction that writes outgoing messages sends the `NOTIFY` that
    /// wakes the relays at its commit (default on). Turn it off when every relay only polls
    /// ([`RelayOptions::listen`] off): PostgreSQL queues each notification at the commit, under a
    /// lock that commits which notify take in turn, and the statement is one more round trip.
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
