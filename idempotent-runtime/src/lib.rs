//! The runtime behind `#[idempotent]`: the [`Inbox`], its stores, key encoding and errors.
//!
//! Depend on the `idempotent-inbox` crate (its library is `idempotent`), which re-exports all of
//! this together with the attribute; this crate is its implementation. That crate's documentation
//! has the guides: <https://docs.rs/idempotent-inbox/latest/idempotent/guide/index.html>.
#![warn(missing_docs, unreachable_pub)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod batch;
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
pub mod broker;
pub mod calls;
mod clock;
mod error;
#[cfg(feature = "http")]
#[cfg_attr(docsrs, doc(cfg(feature = "http")))]
pub mod http;
#[cfg(feature = "http")]
mod in_flight;
mod inbox;
pub mod key;
mod markers;
pub mod metrics;
pub mod operations;
pub mod outbox;
mod retention;
mod retryable;
pub mod schema;
mod session;
mod store;
mod table;
mod tenants;
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;
// Continued by the runners and the HTTP layer, each behind its feature.
#[cfg_attr(
    not(any(
        feature = "http",
        feature = "rabbitmq",
        feature = "nats",
        feature = "kafka",
        feature = "sqs"
    )),
    allow(dead_code)
)]
mod trace_context;
mod transaction;

#[doc(hidden)]
pub mod __private;

pub use batch::{BatchOutcome, ClaimedBatch};
pub use calls::{CallLease, CallStart};
pub use clock::SentAt;
pub use error::{Error, Fault, InboxError, Stage};
pub use inbox::{Claim, ClaimOptions, Claimed, Handled, Inbox, InboxFor, MAX_CONSUMER_LEN};
pub use key::{
    AsMessageKey, IdempotencyKey, KeyBuilder, KeyError, MessageKey, StableKey, message_key,
};
pub use markers::{CorrelationId, DeliveryTag};
pub use metrics::MetricsSnapshot;
pub use operations::{AuditEntry, ConsumerStats, Cursor, Listing, Page, Record, StuckCall};
pub use retention::{Expired, PurgeReport, Purger, PurgerOptions, Retention};
pub use retryable::Retryable;
pub use schema::Migration;
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub use store::mysql;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use store::postgres;
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub use store::sqlite;
pub use store::{Backend, HandlerConnection, is_retryable};
pub use table::TableName;
pub use tenants::{TenantFailed, Tenants};
