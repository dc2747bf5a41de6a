//! What a relay hands a broker: the [`Publisher`] trait, the [`Publication`] it publishes, and how
//! a publication fails. A leaf: the broker's publishers (`broker/rabbitmq/publisher.rs`,
//! `broker/nats/publisher.rs`, `broker/kafka/publisher.rs`, `broker/sqs/publisher.rs`) implement
//! it, and the relay calls it.

use std::future::Future;

use crate::inbox::outgoing::Destination;

/// One outgoing message as a relay hands it to a [`Publisher`]: a row of the outbox.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Publication {
    /// The message's id: publish it as the broker's message id (AMQP `message_id`, NATS
    /// `Nats-Msg-Id`), so that the downstream consumer's inbox keys on it. The same on every
    /// publication of this message. (Kafka: the `message-id` header; SQS: the `message-id`
    /// attribute.)
    pub message_id: String,
    /// Where it goes.
    pub destination: Destination,
    /// Its payload.
    pub payload: Vec<u8>,
    /// Its headers, in the order they were added.
    pub headers: Vec<(String, String)>,
    /// Its ordering key, if it has one (the relay has already made sure that no other message of
    /// this key is in flight).
    pub ordering_key: Option<String>,
    /// Which attempt this is, from 1: the broker refused it `attempt - 1` times before.
    pub attempt: u32,
}

impl Publication {
    /// The first attempt at publishing `message` under the id `message_id`, as a relay hands it to
    /// a publisher: for testing a [`Publisher`] on its own.
    pub fn new(
        message_id: impl Into<String>,
        message: &crate::inbox::outgoing::OutgoingMessage,
    ) -> Self {
        Self {
            message_id: message_id.into(),
            destination: message.destination().clone(),
            payload: message.payload().to_vec(),
            headers: message.headers().to_vec(),
            ordering_key: message.ordering_key().map(str::to_owned),
            attempt: 1,
        }
    }
}

/// Why a publication failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PublishError {
    /// The broker refused this message, for good or for now: the trouble of the message or of its
    /// destination (RabbitMQ returned it unroutable, has no such exchange, or a full queue that
    /// rejects publishes refused it with `basic.nack`; no JetStream stream captures its subject,
    /// or the stream refused it; it is too large). The relay counts it as an attempt of this row,
    /// tries the row again after the row's own back-off, and parks it after the last attempt;
    /// the other rows, of other destinations and other ordering keys, go on meanwhile.
    #[error("the broker refused the message: {reason}")]
    Rejected {
        /// What the broker said, for a person to read.
        reason: String,
    },
    /// The broker could not be reached, blocks publishers (a resource alarm), or did not confirm
    /// in time: not this message's trouble. The relay leaves the row as it was, without counting
    /// an attempt, and publishes it again in a later batch; a batch that got nothing through makes
    /// the relay back off before its next one.
    #[error("the broker is unavailable")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl PublishError {
    /// Returns [`PublishError::Unavailable`] for `error`.
    pub fn unavailable(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        PublishError::Unavailable(error.into())
    }

    /// Returns [`PublishError::Rejected`] with `reason`.
    pub fn rejected(reason: impl Into<String>) -> Self {
        PublishError::Rejected {
            reason: reason.into(),
        }
    }
}

/// Publishes outgoing messages to a broker, and says when the broker has them: a relay marks a row
/// sent only once [`publish`](Publisher::publish) returned `Ok`, so `Ok` must mean the broker
/// confirmed the message (RabbitMQ's publisher confirm of a persistent message, JetStream's
/// publish acknowledgement), not that it was written to a socket.
///
/// The implementations are `broker::rabbitmq::OutboxPublisher`, `broker::nats::OutboxPublisher`,
/// `broker::kafka::OutboxPublisher` and `broker::sqs::OutboxPublisher` (features `rabbitmq`,
/// `nats`, `kafka` and `sqs`); implement it for another broker. A relay calls it concurrently for the
/// messages of one batch, except those of one ordering key: it publishes them one after another,
/// each once the one before returned `Ok`.
pub trait Publisher: Send + Sync + 'static {
    /// Publishes `publication` and waits for the broker's confirmation.
    fn publish(
        &self,
        publication: &Publication,
    ) -> impl Future<Output = Result<(), PublishError>> + Send;
}

impl<P: Publisher> Publisher for std::sync::Arc<P> {
    fn publish(
        &self,
        publication: &Publication,
    ) -> impl Future<Output = Result<(), PublishError>> + Send {
        (**self).publish(publication)
    }
}
