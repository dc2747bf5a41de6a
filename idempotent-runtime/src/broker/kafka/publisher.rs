//! Publishing the outbox's messages to Kafka, waiting for each delivery report (`acks=all`).

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use super::{MESSAGE_ID_HEADER, producer_config, refused};
use crate::outbox::{Publication, PublishError, Publisher};

/// Publishes a relay's outgoing messages to Kafka (an [`outbox`](crate::outbox) [`Publisher`]):
/// to the topic the destination names ([`Destination::topic`]), keyed by the message's ordering
/// key (so that one key goes to one partition, in the order the relay publishes it), with the
/// message's id in the [`MESSAGE_ID_HEADER`] header, where the Kafka runner reads its key, and its
/// headers as record headers. The producer is idempotent with `acks=all`: `Ok` means every in-sync
/// replica has it.
///
/// | Kafka | the relay |
/// |---|---|
/// | the delivery report says it is written | marks the row sent |
/// | no such topic (and no auto-creation), too large, not authorized, a destination with an exchange | [`PublishError::Rejected`]: an attempt; parked after the last |
/// | no report within the publish timeout, brokers away, the producer's queue full | [`PublishError::Unavailable`]: left pending |
///
/// [`Destination::topic`]: crate::outbox::Destination::topic
#[derive(Clone)]
pub struct OutboxPublisher {
    producer: FutureProducer,
    timeout: Duration,
}

impl std::fmt::Debug for OutboxPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutboxPublisher")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl OutboxPublisher {
    /// Creates a publisher with the client settings of `client` (`bootstrap.servers` at least),
    /// with `acks=all`, `enable.idempotence=true` and a delivery timeout of `timeout`.
    pub fn new(client: &ClientConfig, timeout: Duration) -> Result<Self, KafkaError> {
        Ok(Self {
            producer: producer_config(client, timeout).create()?,
            timeout,
        })
    }
}

impl Publisher for OutboxPublisher {
    async fn publish(&self, publication: &Publication) -> Result<(), PublishError> {
        let destination = &publication.destination;
        if !destination.exchange.is_empty() {
            return Err(PublishError::rejected(format!(
                "Kafka has no exchanges (this message is for exchange {:?}): send it to a topic",
                destination.exchange
            )));
        }
        let topic = destination.routing_key.as_str();
        let mut headers = OwnedHeaders::new().insert(Header {
            key: MESSAGE_ID_HEADER,
            value: Some(publication.message_id.as_bytes()),
        });
        for (name, value) in &publication.headers {
            headers = headers.insert(Header {
                key: name,
                value: Some(value.as_bytes()),
            });
        }
        let mut record = FutureRecord::<str, [u8]>::to(topic)
            .payload(&publication.payload)
            .headers(headers);
        if let Some(key) = &publication.ordering_key {
            record = record.key(key.as_str());
        }
        let sent = self.producer.send(record, self.timeout);
        match tokio::time::timeout(self.timeout + Duration::from_secs(1), sent).await {
            Err(elapsed) => Err(PublishError::unavailable(elapsed)),
            Ok(Ok(_)) => Ok(()),
            Ok(Err((error, _))) if refused(&error) => {
                Err(PublishError::rejected(format!("{error} (topic {topic:?})")))
            }
            Ok(Err((error, _))) => Err(PublishError::unavailable(error)),
        }
    }
}
