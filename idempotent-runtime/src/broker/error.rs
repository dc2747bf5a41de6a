//! Why a runner stopped ([`BrokerError`]), and an error with its causes on one line.

use std::fmt;
use std::time::Duration;

/// Why a runner stopped other than by its [`Shutdown`](super::Shutdown).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BrokerError {
    /// The broker's client failed in a way the runner cannot recover from by itself: a channel it
    /// was given (the RabbitMQ runner's `Runner::new`) lost its connection, or the broker refused the
    /// runner's setup (a queue it declares, its consumer). Deliveries not acknowledged are
    /// delivered again by the broker.
    #[error("the broker failed")]
    Broker(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The broker refused a message the runner published (a retry or a dead letter), or could not
    /// route it. The runner does not stop for this: it hands the delivery back to the broker after
    /// a back-off (see [`RunnerStats::released`](super::RunnerStats::released)).
    #[error("the broker refused the {what} of a message")]
    Refused {
        /// What was published: "retry" or "dead letter".
        what: &'static str,
    },
    /// The broker did not confirm a message the runner published within the runner's publish
    /// timeout (a memory or disk alarm blocks publishers). The runner does not stop for this: it
    /// hands the delivery back to the broker after a back-off.
    #[error("the broker did not confirm the {what} of a message within {after:?}")]
    Timeout {
        /// What was published: "retry" or "dead letter".
        what: &'static str,
        /// The publish timeout.
        after: Duration,
    },
    /// The broker cancelled the runner's consumer: its queue was deleted (RabbitMQ), or its
    /// consumer or stream (JetStream). Not a shutdown: nothing is consumed any more.
    #[error("the broker cancelled the consumer of {source_name}: it was deleted")]
    Cancelled {
        /// The queue, or the JetStream consumer.
        source_name: String,
    },
    /// The JetStream consumer does not acknowledge each message on its own (its ack policy is
    /// `All` or `None`): with several workers finishing out of order, one acknowledgement would
    /// settle messages still in flight, and a crash would lose them. Found at start; use
    /// `AckPolicy::Explicit`.
    #[error("the consumer's ack policy is {found}; the runner needs AckPolicy::Explicit")]
    AckPolicy {
        /// The consumer's ack policy.
        found: String,
    },
    /// The dead-letter target does not work: no JetStream stream captures the dead-letter subject,
    /// or RabbitMQ refused to declare the dead-letter queue. Found at start, before any delivery
    /// is taken.
    #[error("dead letters cannot go to {target}: {reason}")]
    DeadLetterTarget {
        /// The subject or queue.
        target: String,
        /// Why.
        reason: String,
    },
    /// An operator asked to retry or skip a held partition that is not held (Kafka's
    /// [`HeldPartitions`](super::kafka::HeldPartitions)), or the group holds none.
    #[error("nothing to do: {reason}")]
    NotHeld {
        /// Why, for a person to read.
        reason: String,
    },
}

impl BrokerError {
    pub(crate) fn broker(error: impl std::error::Error + Send + Sync + 'static) -> Self {
        BrokerError::Broker(Box::new(error))
    }
}

/// An error and its causes, on one line.
pub(crate) struct ErrorChain<'a>(pub(crate) &'a (dyn std::error::Error + 'static));

impl fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(cause) = source {
            write!(f, ": {cause}")?;
            source = cause.source();
        }
        Ok(())
    }
}
