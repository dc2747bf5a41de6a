//! Publishing the outbox's messages to RabbitMQ: persistent, mandatory, with publisher confirms.

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use tokio::sync::Mutex;

use crate::broker::BrokerError;
use crate::outbox::{Publication, PublishError, Publisher};

/// Publishes a relay's outgoing messages to RabbitMQ (an [`outbox`](crate::outbox)
/// [`Publisher`]): each message persistent (`delivery_mode` 2), `mandatory`, with its id as the
/// `message_id` property and its headers as AMQP headers, on a channel in publisher-confirm mode.
/// `Ok` means the broker confirmed it (`basic.ack`), which for a durable queue means it is on disk.
///
/// | the broker | the relay |
/// |---|---|
/// | acknowledges | marks the row sent |
/// | returns it unroutable (no queue bound for the routing key), then acknowledges | [`PublishError::Rejected`]: an attempt; parked after the last |
/// | negatively acknowledges (`basic.nack`: it could not take it, a queue refusing publishes when full) | [`PublishError::Unavailable`]: left pending |
/// | a closed channel or connection | [`PublishError::Unavailable`]; a publisher made with [`connect`](Self::connect) connects again for the next message |
pub struct OutboxPublisher {
    url: Option<String>,
    /// The open channel, if any: read (and cloned) by every publication, never held across an
    /// await.
    open: std::sync::Mutex<Option<Open>>,
    /// Held while the channel is opened again, so that one publication does it.
    reopening: Mutex<()>,
}

struct Open {
    // Held so that the connection lives as long as its channel.
    _connection: Option<Connection>,
    channel: Channel,
}

impl std::fmt::Debug for OutboxPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutboxPublisher")
            .field("reconnects", &self.url.is_some())
            .finish_non_exhaustive()
    }
}

impl OutboxPublisher {
    /// A publisher on `channel`, which it puts in publisher-confirm mode. Once the channel is
    /// closed, every publication fails as [`PublishError::Unavailable`]: make a new publisher
    /// (and relay), or use [`connect`](Self::connect).
    pub async fn new(channel: Channel) -> Result<Self, BrokerError> {
        confirm(&channel).await?;
        Ok(Self {
            url: None,
            open: std::sync::Mutex::new(Some(Open {
                _connection: None,
                channel,
            })),
            reopening: Mutex::new(()),
        })
    }

    /// A publisher with a connection of its own to `url` (`amqp://…`), which it opens again when
    /// it was lost.
    pub async fn connect(url: &str) -> Result<Self, BrokerError> {
        let open = open(url).await?;
        Ok(Self {
            url: Some(url.to_owned()),
            open: std::sync::Mutex::new(Some(open)),
            reopening: Mutex::new(()),
        })
    }

    /// The open channel, if it is still connected.
    fn current(&self) -> Option<Channel> {
        let open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        open.as_ref()
            .filter(|open| open.channel.status().connected())
            .map(|open| open.channel.clone())
    }

    /// The channel to publish on: the open one, or a new one when it closed and the publisher has
    /// a URL.
    async fn channel(&self) -> Result<Channel, PublishError> {
        if let Some(channel) = self.current() {
            return Ok(channel);
        }
        let Some(url) = &self.url else {
            return Err(PublishError::unavailable(
                "the publisher's channel is closed",
            ));
        };
        let _reopening = self.reopening.lock().await;
        if let Some(channel) = self.current() {
            return Ok(channel); // another publication opened it meanwhile
        }
        let reopened = self::open(url).await.map_err(PublishError::unavailable)?;
        let channel = reopened.channel.clone();
        *self.open.lock().unwrap_or_else(|e| e.into_inner()) = Some(reopened);
        Ok(channel)
    }
}

async fn confirm(channel: &Channel) -> Result<(), BrokerError> {
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(BrokerError::broker)
}

async fn open(url: &str) -> Result<Open, BrokerError> {
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .map_err(BrokerError::broker)?;
    let channel = connection
        .create_channel()
        .await
        .map_err(BrokerError::broker)?;
    confirm(&channel).await?;
    Ok(Open {
        _connection: Some(connection),
        channel,
    })
}

impl Publisher for OutboxPublisher {
    async fn publish(&self, publication: &Publication) -> Result<(), PublishError> {
        let channel = self.channel().await?;
        let mut headers = FieldTable::default();
        for (name, value) in &publication.headers {
            headers.insert(
                ShortString::from(name.as_str()),
                AMQPValue::LongString(LongString::from(value.as_str())),
            );
        }
        let properties = BasicProperties::default()
            .with_message_id(publication.message_id.as_str().into())
            .with_delivery_mode(2)
            .with_headers(headers);
        let destination = &publication.destination;
        let confirmation = channel
            .basic_publish(
                destination.exchange.as_str().into(),
                destination.routing_key.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &publication.payload,
                properties,
            )
            .await
            .map_err(PublishError::unavailable)?
            .await
            .map_err(PublishError::unavailable)?;
        match confirmation {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(returned)) => Err(PublishError::rejected(format!(
                "returned by the broker: {} {} (exchange {:?}, routing key {:?})",
                returned.reply_code,
                returned.reply_text,
                destination.exchange,
                destination.routing_key
            ))),
            Confirmation::Nack(_) => Err(PublishError::unavailable(
                "the broker did not take the message (basic.nack)",
            )),
            Confirmation::NotRequested => Err(PublishError::unavailable(
                "the channel is not in publisher-confirm mode",
            )),
        }
    }
}
