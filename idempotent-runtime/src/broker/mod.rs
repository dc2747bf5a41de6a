//! Broker runners: what a consumer does with each outcome, written once.
//!
//! A runner takes deliveries from a broker (a RabbitMQ queue, a NATS JetStream pull consumer, Kafka
//! topics in a consumer group, an SQS queue: the `rabbitmq`, `nats`, `kafka` and `sqs` modules),
//! hands each [`Message`] to a handler (typically an `#[idempotent]` function called with a
//! worker's inbox, made with [`Inbox::for_worker`](crate::Inbox::for_worker)), and settles the
//! delivery only once the outcome is known: acknowledged when processed or a duplicate, delivered
//! again after a back-off ([`RetryPolicy`]) when the error [is
//! retryable](crate::Error::is_retryable) and attempts are left, dead-lettered otherwise. A handler
//! that panics is a retryable failure of its message (the panic's message is the reason), never the
//! end of the runner. A [`Shutdown`] token stops it gracefully; it ends with a [`BrokerError`] only
//! when it cannot go on, never because its broker restarted. Dead letters are read and put back
//! with [`DeadLetter`] and [`DeadLetterFilter`] and each broker's `DeadLetterQueue` (SQS,
//! RabbitMQ, NATS and Kafka; the `idempotent dlq` command).
//!
//! The guide "Brokers and runners" says what each outcome does on each broker, how restarts and
//! unpublishable retries are handled, batch mode, and what is tested: `idempotent::guide::brokers`
//! in the `idempotent-inbox` crate
//! (<https://docs.rs/idempotent-inbox/latest/idempotent/guide/brokers/index.html>).

#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub mod kafka;
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub mod nats;
#[cfg(feature = "rabbitmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
pub mod rabbitmq;
#[cfg(feature = "sqs")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqs")))]
pub mod sqs;

mod backoff;
mod batch;
mod dead_letters;
mod delivery;
mod drive;
mod error;
mod message;
mod one_at_a_time;
mod options;
mod outage;
mod panicked;
mod retry;
mod route;
mod settle;
mod stats;

pub use batch::{BatchBody, Batches};
pub use dead_letters::{DeadLetter, DeadLetterFilter};
pub use error::BrokerError;
pub use message::{DeliveryCount, Message, MessageId, Redelivered, StreamSequence};
pub use options::DEFAULT_PUBLISH_TIMEOUT;
pub use retry::RetryPolicy;
pub use route::Route;
pub use settle::BeforeSettle;
pub use stats::RunnerStats;

/// Stops a runner gracefully when cancelled; see the [module docs](self).
pub use tokio_util::sync::CancellationToken as Shutdown;
