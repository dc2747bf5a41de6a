//! Publishing the outbox's messages to NATS JetStream, waiting for each publish acknowledgement.

use async_nats::HeaderMap;
use async_nats::jetstream::{self, context::PublishErrorKind};

use crate::outbox::{Publication, PublishError, Publisher};

/// Publishes a relay's outgoing messages to NATS JetStream (an [`outbox`](crate::outbox)
/// [`Publisher`]): to the destination's subject ([`Destination::subject`]), with the message's
/// id in the `Nats-Msg-Id` header and its headers as NATS headers. `Ok` means a stream stored it
/// (the publish acknowledgement; a stream that drops it as a duplicate of an id it has seen within
/// its duplicate window acknowledges it too).
///
/// | JetStream | the relay |
/// |---|---|
/// | acknowledges (stored, or a duplicate) | marks the row sent |
/// | no stream captures the subject; the message is larger than the server takes; a destination with an exchange | [`PublishError::Rejected`]: an attempt; parked after the last |
/// | the stream refuses it (full with `DiscardPolicy::New`, or another error of the stream's) | [`PublishError::Rejected`]: an attempt, the row's own back-off; parked after the last |
/// | no acknowledgement in time, a lost connection (the client reconnects by itself) | [`PublishError::Unavailable`]: left pending |
///
/// [`Destination::subject`]: crate::outbox::Destination::subject
#[derive(Debug, Clone)]
pub struct OutboxPublisher {
    jetstream: jetstream::Context,
}

impl OutboxPublisher {
    /// Creates a publisher on `jetstream`.
    pub fn new(jetstream: jetstream::Context) -> Self {
        Self { jetstream }
    }
}

impl Publisher for OutboxPublisher {
    async fn publish(&self, publication: &Publication) -> Result<(), PublishError> {
        let destination = &publication.destination;
        if !destination.exchange.is_empty() {
            return Err(PublishError::rejected(format!(
                "NATS has no exchanges (this message is for exchange {:?}): send it to a subject",
                destination.exchange
            )));
        }
        let mut headers = HeaderMap::new();
        headers.insert(
            async_nats::header::NATS_MESSAGE_ID,
            publication.message_id.as_str(),
        );
        for (name, value) in &publication.headers {
            headers.append(name.as_str(), value.as_str());
        }
        let acknowledged = async {
            self.jetstream
                .publish_with_headers(
                    destination.routing_key.clone(),
                    headers,
                    publication.payload.clone().into(),
                )
                .await?
                .await
        };
        match acknowledged.await {
            Ok(_) => Ok(()),
            Err(error) => match error.kind() {
                PublishErrorKind::StreamNotFound
                | PublishErrorKind::MaxPayloadExceeded
                | PublishErrorKind::WrongLastMessageId
                | PublishErrorKind::WrongLastSequence => Err(PublishError::rejected(format!(
                    "{error} (subject {:?})",
                    destination.routing_key
                ))),
                PublishErrorKind::Other => match stream_refusal(&error) {
                    Some(refusal) => Err(PublishError::rejected(format!(
                        "the stream refused the message: {refusal} (subject {:?})",
                        destination.routing_key
                    ))),
                    None => Err(PublishError::unavailable(error)),
                },
                _ => Err(PublishError::unavailable(error)),
            },
        }
    }
}

/// What the stream said, when it answered the publication with an error of its own (full, with
/// `DiscardPolicy::New`; a message larger than it takes): the destination's trouble, not the
/// server's.
fn stream_refusal(error: &async_nats::jetstream::context::PublishError) -> Option<String> {
    std::error::Error::source(error)
        .filter(|source| source.is::<jetstream::Error>())
        .map(ToString::to_string)
}
