//! Broker runners: what a consumer does with each outcome, written once.
//!
//! A runner takes deliveries from a broker (a RabbitMQ queue, a NATS JetStream pull consumer),
//! hands each to a handler (typically an `#[idempotent]` function called with a worker's inbox),
//! and settles the delivery by the outcome, only once the outcome is known:
//!
//! | outcome | the runner |
//! |---|---|
//! | `Ok(Processed)`, `Ok(Duplicate)` | acknowledges the delivery |
//! | an error that [is retryable](crate::Error::is_retryable), attempts left | has the broker deliver it again after a back-off ([`RetryPolicy`]), never at once |
//! | a retryable error on the last attempt, any other error | dead-letters it, with the reason and the attempt count in its headers; never an acknowledgement that loses it silently |
//! | a message without the producer's id | dead-letters it: it has no key |
//!
//! A body's error is retryable when the database failed under it, or when the body marked it so
//! with [`Retryable`](crate::Retryable) among its sources (a downstream 503, a timeout calling
//! another service): in one-message and batch mode alike. Attempts count this runner's own
//! deliveries only (see each broker's module): a header a producer sets does not shorten them, and
//! a dead letter put back on purpose starts again.
//!
//! Workers run concurrently, each with a handler of its own (make each one's inbox with
//! [`Inbox::for_worker`](crate::Inbox::for_worker)), one delivery at a time; the runner asks the
//! broker for no more deliveries than there are workers. A [`Shutdown`] token stops it gracefully:
//! it takes no more deliveries, lets those in flight finish and settles them, then returns; a
//! delivery whose effect was committed is acknowledged before the runner returns.
//!
//! **Restarts are weather.** A runner does not end because its broker went away: it reconnects by
//! itself (a capped, jittered back-off between attempts, from 100 ms to 5 s), says so through
//! `tracing` (`warn` when the broker is lost, `info` when it is back) and counts it
//! ([`RunnerStats::reconnects`] and the
//! [`idempotent_runner_reconnects_total`](crate::metrics::RUNNER_RECONNECTS) counter). It returns an
//! error only when it cannot go on ([`BrokerError`]): its queue or consumer was deleted
//! ([`BrokerError::Cancelled`], never `Ok`), or its setup is wrong, found at start before any
//! delivery is taken (a NATS consumer without explicit acks, a dead-letter target that does not
//! work).
//!
//! **One bad thing stays one bad thing.** A retry or dead letter the broker does not take (it is
//! unroutable, refused, or not confirmed within the runner's publish timeout, 10 s by default, as
//! during a memory alarm) does not stop the runner: that delivery goes back to the broker after a
//! back-off of its own (1 s, doubling per failure of that message, at most a minute; counted in
//! [`RunnerStats::released`]), and the others flow.
//!
//! The handler receives a [`Message`]: the producer's id ([`MessageId`], the key to use), the
//! payload and headers, and the broker's per-delivery facts in types that are not
//! [`StableKey`]s, so that keying on them is a compile error.

#[cfg(doc)]
use crate::key::StableKey;

#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub mod nats;
#[cfg(feature = "rabbitmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
pub mod rabbitmq;

mod backoff;
mod batch;
mod delivery;
mod drive;
mod error;
mod message;
mod one_at_a_time;
mod options;
mod outage;
mod retry;
mod route;
mod settle;
mod stats;

pub use batch::{BatchBody, Batches};
pub use error::BrokerError;
pub use message::{DeliveryCount, Message, MessageId, Redelivered, StreamSequence};
pub use options::DEFAULT_PUBLISH_TIMEOUT;
pub use retry::RetryPolicy;
pub use route::Route;
pub use settle::BeforeSettle;
pub use stats::RunnerStats;

/// Stops a runner gracefully when cancelled; see the [module docs](self).
pub use tokio_util::sync::CancellationToken as Shutdown;
