//! Idempotent message handlers: the effect happens once per message key, however often the broker
//! delivers the message.
//!
//! Brokers deliver at least once: a consumer that crashes after its commit but before its
//! acknowledgement, a lock that expires, a producer's retry, a message resubmitted from a
//! dead-letter queue days later each hand the same message to your handler again. The
//! [`#[idempotent]`](idempotent) attribute rewrites the handler to claim the message's key in an
//! inbox table, in the handler's own transaction, so the effect and the record that it happened
//! commit together or not at all; a second delivery finds the key and skips the body.
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
//! The rewritten handler returns [`Handled::Processed`] or [`Handled::Duplicate`] (acknowledge
//! both), or an [`Error`] whose [`is_retryable`](Error::is_retryable) says whether to redeliver
//! after a back-off or to dead-letter. [The guarantees](guide::guarantees) say exactly what
//! holds, and where it stops.
//!
//! # What is in the box
//! - **The attribute**, [`#[idempotent]`](idempotent): keys from fields, nested fields or tuples;
//!   keys that would lose or repeat effects are compile errors ([Keys](guide::keys)).
//! - **The inbox**, [`Inbox`], on PostgreSQL, SQLite and MySQL/MariaDB, with the claim by hand
//!   ([`Inbox::claim`]), batches ([`Inbox::handle_batch`]) and a worker's kept connection
//!   ([`Inbox::for_worker`]) ([Storage](guide::storage), [Performance](guide::performance)).
//! - **Retention and purge**, calls to outside services with a lease and a fencing token
//!   ([`Inbox::call_once`]), stored responses and fingerprints ([Lifecycle](guide::lifecycle)).
//! - **The transactional outbox** ([`outbox`]): follow-up messages commit with the effect, and a
//!   relay publishes them at least once with stable ids ([Outbox](guide::outbox)).
//! - **Broker runners** for RabbitMQ, NATS JetStream, Kafka and Amazon SQS ([`broker`], features
//!   `rabbitmq`, `nats`, `kafka`, `sqs`): the acknowledgement, retry and dead-letter rules, written once
//!   ([Brokers and runners](guide::brokers)).
//! - **HTTP `Idempotency-Key`** routes ([`http`], feature `http`): a tower layer and axum
//!   extractors on the same inbox ([HTTP APIs](guide::http)).
//! - **Operations**: the purge horizon, inspect and forget, the `idempotent` command-line tool and
//!   [`metrics`] ([Operating](guide::operating)); [`schema`] versions that
//!   [`Inbox::migrate`] upgrades ([Storage](guide::storage#schema-versions)).
//! - **Past one server**: Galera, a PostgreSQL standby, PgBouncer ([Running at scale](guide::scale)).
//!
//! # Features
//! - `sqlite` (default): the inbox on SQLite, compiled in.
//! - `postgres`: the inbox on PostgreSQL.
//! - `mysql`: the inbox on MySQL and MariaDB.
//! - `rabbitmq`, `nats`, `kafka`, `sqs`: the broker runners for RabbitMQ, NATS JetStream, Kafka and
//!   Amazon SQS, and the outbox's publishers. The outbox itself needs no feature.
//! - `http`: the `http` module, a tower layer and axum extractors that make HTTP routes idempotent
//!   by `Idempotency-Key` header, on the same inbox (PostgreSQL and SQLite).
//!
//! Your handlers' connection types must come from the same sqlx as ours ([`sqlx`] re-exports it).
//!
//! # The guides
//! [Guarantees](guide::guarantees) · [Keys](guide::keys) ·
//! [Brokers and runners](guide::brokers) (with `rabbitmq`, `nats`, `kafka` or `sqs`) · [Outbox](guide::outbox) ·
//! [HTTP APIs](guide::http) (with `http`) ·
//! [Lifecycle](guide::lifecycle) · [Operating](guide::operating) · [Storage](guide::storage) ·
//! [Running at scale](guide::scale) · [Performance](guide::performance) ·
//! [Architecture](guide::architecture) · [Testing the suite](guide::testing)
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
/// and whose second is the message, returning `Result<T, E>` (or an alias of it). A parameter of
/// type [`IdempotencyKey`] is filled in by the rewritten function, and so is one of type `&mut`
/// [`Outbox`](outbox::Outbox), through which the body queues outgoing messages that commit with
/// its effect (see [`outbox`]). It becomes a function that takes `&InboxFor<Connection>` in place
/// of the connection and returns `Result<Handled<T>, Error<E>>`:
/// [what it does](guide::guarantees#what-the-attribute-does) says step by step what that function
/// does, and [Keys](guide::keys) which keys the attribute refuses.
pub use idempotent_macros::idempotent;

pub use idempotent_runtime::{
    AsMessageKey, Backend, CallLease, CallStart, Claim, ClaimOptions, Claimed, ClaimedBatch,
    CorrelationId, DeliveryTag, Error, Fault, Handled, HandlerConnection, IdempotencyKey, Inbox,
    InboxError, InboxFor, KeyBuilder, KeyError, MAX_CONSUMER_LEN, MessageKey, MetricsSnapshot,
    PurgeReport, Purger, PurgerOptions, Retention, Retryable, StableKey, Stage, TableName, calls,
    is_retryable, key, message_key,
};
// Many tenants, each with an inbox of its own.
pub use idempotent_runtime::{TenantFailed, Tenants};
// Operating an inbox: the purge horizon, inspect and forget, schema versions, metrics.
pub use idempotent_runtime::{
    AuditEntry, ConsumerStats, Cursor, Expired, Listing, Migration, Page, Record, SentAt,
    StuckCall, metrics, operations, schema,
};
// The transactional outbox.
pub use idempotent_runtime::outbox;

#[cfg(any(
    feature = "rabbitmq",
    feature = "nats",
    feature = "kafka",
    feature = "sqs"
))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(
        feature = "rabbitmq",
        feature = "nats",
        feature = "kafka",
        feature = "sqs"
    )))
)]
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
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub use idempotent_runtime::testing;

/// The sqlx this crate was built against; your handlers' connection types must come from the same
/// version.
pub use idempotent_runtime::__private::sqlx;

#[doc(hidden)]
pub use idempotent_runtime::__private;

/// The guides: one page per topic, each with its samples run as doc tests.
///
/// - [Guarantees](guide::guarantees): what the attribute does step by step, what holds, how it is
///   tested, and where it stops.
/// - [Keys](guide::keys): what to key a handler on, and the checks that refuse unstable keys.
/// - [Brokers and runners](guide::brokers): RabbitMQ and NATS JetStream runners; Kafka's and SQS's
///   rules.
/// - [Outbox](guide::outbox): outgoing messages that commit with the effect, and their relays.
/// - [HTTP APIs](guide::http): `Idempotency-Key` routes with a tower layer and axum extractors.
/// - [Lifecycle](guide::lifecycle): retention and purge, calls to outside services, stored
///   responses and fingerprints, batches, tracing.
/// - [Operating](guide::operating): the purge horizon, inspect and forget, the command-line tool,
///   metrics.
/// - [Storage](guide::storage): the tables, each database's claim, schema versions.
/// - [Running at scale](guide::scale): many instances, Galera, a PostgreSQL standby, PgBouncer.
/// - [Performance](guide::performance): what each part costs, measured.
/// - [Architecture](guide::architecture): the crates and modules, and which way the arrows point.
/// - [Testing your handlers](guide::testing_handlers) (feature `testing`): your handler delivered
///   twice, in copies at once and dropped at each await point, checked against one delivery.
/// - [Testing the suite](guide::testing): the servers `scripts/test` starts, and your own.
pub mod guide {
    #[doc = include_str!("../docs/guarantees.md")]
    pub mod guarantees {}
    #[doc = include_str!("../docs/keys.md")]
    pub mod keys {}
    #[doc = include_str!("../docs/brokers.md")]
    #[cfg(any(
        feature = "rabbitmq",
        feature = "nats",
        feature = "kafka",
        feature = "sqs"
    ))]
    #[cfg_attr(
        docsrs,
        doc(cfg(any(
            feature = "rabbitmq",
            feature = "nats",
            feature = "kafka",
            feature = "sqs"
        )))
    )]
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
    #[doc = include_str!("../docs/handler_testing.md")]
    #[cfg(all(feature = "testing", feature = "sqlite"))]
    #[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
    pub mod testing_handlers {}
    #[doc = include_str!("../docs/testing.md")]
    pub mod testing {}
}
