//! Idempotent message handlers: the effect happens once per message key, however often the broker
//! delivers the message.
//!
//! ```
//! use idempotent::{Handled, Inbox, idempotent};
//!
//! struct PaymentReceived {
//!     message_id: uuid::Uuid,
//!     order_id: i64,
//! }
//!
//! #[idempotent(key = "message_id", consumer = "orders")]
//! async fn on_payment_received(
//!     tx: &mut sqlx::SqliteConnection,
//!     msg: &PaymentReceived,
//! ) -> Result<(), sqlx::Error> {
//!     sqlx::query("UPDATE orders SET paid = paid + 1 WHERE id = ?1")
//!         .bind(msg.order_id)
//!         .execute(&mut *tx)
//!         .await?;
//!     Ok(())
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::sqlite::SqlitePoolOptions::new()
//!     .max_connections(1) // one in-memory database; use a file in real life
//!     .connect("sqlite::memory:")
//!     .await?;
//! sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY, paid INTEGER NOT NULL DEFAULT 0)")
//!     .execute(&pool)
//!     .await?;
//! sqlx::query("INSERT INTO orders (id) VALUES (7)").execute(&pool).await?;
//!
//! let inbox = Inbox::new(pool.clone());
//! inbox.migrate().await?;
//!
//! let msg = PaymentReceived { message_id: uuid::Uuid::new_v4(), order_id: 7 };
//! // The macro rewrote the handler to take the inbox instead of a connection.
//! assert!(matches!(on_payment_received(&inbox, &msg).await?, Handled::Processed(())));
//! // The broker delivers the same message again: the body does not run.
//! assert!(matches!(on_payment_received(&inbox, &msg).await?, Handled::Duplicate { .. }));
//!
//! let paid: i64 = sqlx::query_scalar("SELECT paid FROM orders WHERE id = 7").fetch_one(&pool).await?;
//! assert_eq!(paid, 1);
//! # Ok(()) }
//! ```
//!
//! # What the attribute does
//! [`#[idempotent(key = "...", consumer = "...")]`](idempotent) rewrites an `async fn` whose first
//! parameter is the transaction's connection (`&mut sqlx::PgConnection`,
//! `&mut sqlx::SqliteConnection` or `&mut sqlx::MySqlConnection`) and whose second is the message. The rewritten function takes an
//! [`Inbox`] instead of the connection, and on each call:
//!
//! 1. computes the key from the message's fields (an empty string key is an
//!    [`InboxError::Key`] error, before any database work);
//! 2. begins a transaction and claims `(consumer, key)` in the inbox table, as its first
//!    statement, an insert on the primary key with the database's own conflict handling:
//!    PostgreSQL `INSERT … ON CONFLICT DO NOTHING` (prepared once per session;
//!    `Inbox::with_pipelined_claim` sends it with the `BEGIN`, at the price the `postgres` module
//!    describes), SQLite `INSERT OR IGNORE` after `BEGIN IMMEDIATE`, MySQL `INSERT IGNORE`. A
//!    concurrent call with the same key waits there until the first one commits or rolls back;
//! 3. if the key was already claimed, rolls back and returns [`Handled::Duplicate`]; the body does
//!    not run;
//! 4. otherwise runs the body on the same transaction; when the body returns `Ok(v)`, checks that
//!    the transaction is still the one it began with nothing failed in it, and commits the body's
//!    work together with the inbox row, returning [`Handled::Processed(v)`](Handled). A body that
//!    carried on after a failed statement, or ended the transaction itself, gets
//!    [`InboxError::TransactionAborted`] or [`InboxError::TransactionEnded`] instead: never
//!    `Processed` for work that was not committed;
//! 5. when the body returns `Err(e)`, rolls back and returns [`Error::Handler(e)`](Error), or
//!    [`Error::Transient(e)`](Error) when the database failed under the body (a lost connection, a
//!    deadlock, a serialization failure, found in `e`'s sources whatever its type); a panic or a
//!    dropped future rolls back too. The key stays unclaimed, so a redelivery runs the body again.
//!
//! A consumer acknowledges `Ok` outcomes, redelivers after a back-off what
//! [`Error::is_retryable`] says may succeed, and dead-letters the rest. A body must not end the
//! transaction (`COMMIT`, `ROLLBACK`, on MySQL a statement that commits implicitly); nested
//! transactions (`tx.begin()`) are savepoints and fine.
//!
//! # Keys
//! - `key = "message_id"`: a field of the message; `key = "meta.message_id"`: a nested field;
//!   `key = ("order_id", "payment_id")`: a composite business key.
//! - The key's type must implement [`StableKey`]: UUIDs, strings, integers, byte strings and tuples
//!   of them; your own newtypes opt in. Floats, `Option`s, timestamps, [`CorrelationId`] and
//!   [`DeliveryTag`] are compile errors.
//! - Field names that say the value is not stable per message (correlation and causation ids,
//!   delivery tags and counts, redelivered flags, lock tokens, receipt handles, broker offsets and
//!   sequence numbers, receive timestamps) are compile errors, unless
//!   `allow_unstable_key = "why it is unique per message"` says otherwise.
//! - Keys are stored as bytes, in an injective encoding; encodings over 64 bytes are stored as
//!   their SHA-256 digest. See [`key`].
//!
//! # Lifecycle
//! - Retention: rows are kept [`Retention::DEFAULT`] (14 days) unless configured;
//!   [`Inbox::purge_expired`] deletes expired rows in batches and [`Inbox::spawn_purger`] does it in
//!   the background, one instance at a time.
//! - Calls to outside services: a handler parameter of type [`IdempotencyKey`] to pass on, and
//!   [`Inbox::call_once`] for a `pending → completed` record with a lease and a fencing token (see
//!   [`calls`]).
//! - `store_response` and `fingerprint` attribute arguments; [`Inbox::metrics`] and a `tracing`
//!   span per message.
//! - Batches: [`Inbox::handle_batch`] claims many keys in one statement and one transaction.
//! - The purge horizon: a message that says when it was sent (a UUIDv7 key, or
//!   `sent_at = "field"`) and is older than what its consumer's purges may have deleted is refused
//!   with [`InboxError::OlderThanHorizon`] rather than processed again (see [`Retention`]).
//! - The transactional [`outbox`]: a handler parameter `outbox: &mut Outbox` queues outgoing
//!   messages, which commit with the handler's effect, with ids derived from the consumer, the
//!   message's key and their position; a relay ([`Inbox::spawn_relay`]) publishes them at least
//!   once through RabbitMQ or NATS JetStream.
//! - Operations: [`Inbox::inspect`], [`Inbox::list`], [`Inbox::stuck_calls`], [`Inbox::stats`],
//!   [`Inbox::forget`] with an audit row (see [`operations`]); the tables' [`schema`] versions,
//!   which [`Inbox::migrate`] upgrades; [`metrics`] through the `metrics` facade; and the
//!   `idempotent` command-line tool (the `idempotent-cli` crate).
//!
//! # Speed
//! - A worker that handles messages one after another should call its handlers with
//!   [`Inbox::for_worker`]: the worker's inbox keeps its connection between messages and saves the
//!   two round trips sqlx's pool spends checking a connection as it is handed back and taken again
//!   (about a quarter more messages per second on PostgreSQL in the benchmark).
//! - On SQLite an inbox queues its own writers in the process, so make one inbox and clone it
//!   rather than making one per task.
//!
//! # Features
//! - `sqlite` (default): the inbox on SQLite, compiled in.
//! - `postgres`: the inbox on PostgreSQL.
//! - `mysql`: the inbox on MySQL and MariaDB.
//! - `rabbitmq`, `nats`: the [`broker`] runners for RabbitMQ and NATS JetStream.
//! - `http`: the `http` module, a tower layer and axum extractors that make HTTP routes idempotent by
//!   `Idempotency-Key` header, on the same inbox (PostgreSQL and SQLite).
#![warn(missing_docs, unreachable_pub)]
#![cfg_attr(docsrs, feature(doc_cfg))]

/// Makes an async message handler idempotent.
///
/// ```text
/// #[idempotent(key = "message_id", consumer = "orders")]
/// #[idempotent(key = ("order_id", "payment_id"), consumer = "orders")]
/// #[idempotent(key = "meta.message_id", consumer = "orders", crate = "my_idempotent")]
/// #[idempotent(key = "delivery_tag", consumer = "ledger",
///              allow_unstable_key = "the ledger assigns delivery_tag once per transfer")]
/// #[idempotent(key = "message_id", consumer = "orders", sent_at = "meta.sent_at")]
/// ```
///
/// | argument | meaning |
/// |---|---|
/// | `key` | the message field (or fields) that identify the message; required |
/// | `consumer` | the name of this consumer's record, so that two services consuming one event each process it once; required, and must not change when the function is renamed |
/// | `fingerprint`, `fingerprint = ("a", "b")` | store a SHA-256 of the message's (or these fields') JSON; a duplicate with another fingerprint is [`InboxError::FingerprintMismatch`] |
/// | `store_response` | store the body's `Ok` value; a duplicate returns it in [`Handled::Duplicate`] |
/// | `allow_unstable_key` | a written reason to accept a key whose name looks unstable |
/// | `sent_at = "meta.sent_at"` | the field that says when the message was sent (a [`SentAt`]: `SystemTime`, a UUIDv7, an `Option` of these): a new message sent before its consumer's purge horizon is [`InboxError::OlderThanHorizon`]; a key that is a UUIDv7 says it without this |
/// | `crate` | the path of this crate when the dependency is renamed |
///
/// The function must be an `async fn` (or method taking `&self`) whose first parameter after `self`
/// is `&mut sqlx::PgConnection`, `&mut sqlx::SqliteConnection` or `&mut sqlx::MySqlConnection`
/// and whose second is the message,
/// returning `Result<T, E>` (or an alias of it). A parameter of type [`IdempotencyKey`] is filled
/// in by the rewritten function, and so is one of type `&mut` [`Outbox`](outbox::Outbox), through
/// which the body queues outgoing messages that commit with its effect (see [`outbox`]). It
/// becomes a function that takes
/// `&InboxFor<Connection>` in place of the connection and returns
/// `Result<Handled<T>, Error<E>>`; see the [crate docs](crate) for what it does.
pub use idempotent_macros::idempotent;

pub use idempotent_runtime::{
    AsMessageKey, Backend, CallLease, CallStart, Claim, ClaimOptions, Claimed, ClaimedBatch,
    CorrelationId, DeliveryTag, Error, Fault, Handled, HandlerConnection, IdempotencyKey, Inbox,
    InboxError, InboxFor, KeyBuilder, KeyError, MAX_CONSUMER_LEN, MessageKey, MetricsSnapshot,
    PurgeReport, Purger, PurgerOptions, Retention, Retryable, StableKey, Stage, TableName, calls,
    is_retryable, key, message_key,
};
// Operating an inbox: the purge horizon, inspect and forget, schema versions, metrics.
pub use idempotent_runtime::{
    AuditEntry, ConsumerStats, Cursor, Expired, Listing, Migration, Page, Record, SentAt,
    StuckCall, metrics, operations, schema,
};
// The transactional outbox.
pub use idempotent_runtime::outbox;

#[cfg(any(feature = "rabbitmq", feature = "nats"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "rabbitmq", feature = "nats"))))]
pub use idempotent_runtime::broker;
#[cfg(feature = "http")]
#[cfg_attr(docsrs, doc(cfg(feature = "http")))]
pub use idempotent_runtime::http;
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub use idempotent_runtime::mysql;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use idempotent_runtime::postgres;
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub use idempotent_runtime::sqlite;

/// The sqlx this crate was built against; your handlers' connection types must come from the same
/// version.
pub use idempotent_runtime::__private::sqlx;

#[doc(hidden)]
pub use idempotent_runtime::__private;

/// The guides: one page per topic, each with its samples run as doc tests.
pub mod guide {
    #[doc = include_str!("../docs/guarantees.md")]
    pub mod guarantees {}
    #[doc = include_str!("../docs/keys.md")]
    pub mod keys {}
    #[doc = include_str!("../docs/brokers.md")]
    #[cfg(any(feature = "rabbitmq", feature = "nats"))]
    #[cfg_attr(docsrs, doc(cfg(any(feature = "rabbitmq", feature = "nats"))))]
    pub mod brokers {}
    #[doc = include_str!("../docs/outbox.md")]
    pub mod outbox {}
    #[doc = include_str!("../docs/http.md")]
    #[cfg(feature = "http")]
    #[cfg_attr(docsrs, doc(cfg(feature = "http")))]
    pub mod http {}
    #[doc = include_str!("../docs/lifecycle.md")]
    pub mod lifecycle {}
    #[doc = include_str!("../docs/operating.md")]
    pub mod operating {}
    #[doc = include_str!("../docs/storage.md")]
    pub mod storage {}
    #[doc = include_str!("../docs/scale.md")]
    pub mod scale {}
    #[doc = include_str!("../docs/performance.md")]
    pub mod performance {}
    #[doc = include_str!("../docs/architecture.md")]
    pub mod architecture {}
    #[doc = include_str!("../docs/testing.md")]
    pub mod testing {}
}
