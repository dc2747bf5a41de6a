//! Publishing the outbox's messages to RabbitMQ: persistent, mandatory, with publisher confirms.
//!
//! A publication's trouble stays its own. RabbitMQ answers a publish to an exchange that does not
//! exist by closing the channel (404), which would fail every other publication in flight on it:
//! a publisher with a connection of its own checks each exchange once, with a passive declare on
//! a channel kept for that, before it publishes there. A publication that was not confirmed in
//! time (the relay dropped it: a blocked connection, a slow broker) goes on by itself, and the
//! next publication of the same message waits for its confirmation instead of sending a second
//! copy. Each publication has a channel to itself until it is confirmed ([`ConfirmChannels`]), so
//! that a returned message is never taken for another's, and a refusal that closes the channel (a
//! message over the broker's `max_message_size`) is that publication's alone.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use lapin::options::ExchangeDeclareOptions;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ErrorKind,
    ExchangeKind,
};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;

use super::confirms::ConfirmChannels;
use super::is_refusal;
use crate::broker::error::BrokerError;
use crate::outbox::{Publication, PublishError, Publisher};

/// The most unconfirmed publications kept for a next publication of their message to wait for.
const MAX_ABANDONED: usize = 10_000;

/// Publishes a relay's outgoing messages to RabbitMQ (an [`outbox`](crate::outbox)
/// [`Publisher`]): each message persistent (`delivery_mode` 2), `mandatory`, with its id as the
/// `message_id` property and its headers as AMQP headers, on a channel in publisher-confirm mode
/// that carries no other unconfirmed publication (a returned message is then this one's: lapin
/// hands a return to whichever confirmation of its channel it resolves next). `Ok` means the broker
/// confirmed it (`basic.ack`), which for a durable queue means it is on disk.
///
/// | the broker | the relay |
/// |---|---|
/// | acknowledges | marks the row sent |
/// | returns it unroutable (no queue bound for the routing key), then acknowledges | [`PublishError::Rejected`]: an attempt; parked after the last |
/// | refuses it and closes its channel: no such exchange (404), no access to it for this user (403), a message over its `max_message_size` (406) | [`PublishError::Rejected`], as above, with the broker's code and reason |
/// | negatively acknowledges (`basic.nack`: a full queue that rejects publishes) | [`PublishError::Rejected`]: an attempt, the row's own back-off; parked after the last |
/// | blocks the connection (`connection.blocked`: a memory or disk alarm) | [`PublishError::Unavailable`] at once, nothing sent: left pending |
/// | a closed channel or connection (whatever code the error that closed the connection carries) | [`PublishError::Unavailable`]: left pending; a publisher made with [`connect`](Self::connect) connects again for the next message |
///
/// A publication the relay gave up on (no confirmation within its `publish_timeout`) is not
/// forgotten: it goes on, and the next publication of that message on the same connection waits
/// for the first one's confirmation rather than sending a second copy, so a broker that is slow to
/// confirm (under an alarm) gets each message once.
pub struct OutboxPublisher {
    url: Option<String>,
    /// The open connection's channels, if any: read (and cloned) by every publication, never held
    /// across an await.
    open: std::sync::Mutex<Option<Open>>,
    /// Held while the connection is made again, so that one publication does it.
    reopening: Mutex<()>,
    /// The channel that checks exchanges (a publisher with a connection of its own), held while
    /// it checks one.
    probe: Mutex<Option<Channel>>,
    /// Exchanges seen to exist on the current connection.
    exchanges: std::sync::Mutex<HashSet<String>>,
    /// Publications not confirmed when the relay stopped waiting for them, by message id.
    abandoned: std::sync::Mutex<HashMap<String, Abandoned>>,
}

struct Open {
    channels: Arc<ConfirmChannels>,
    /// Counts the connections, so that an abandoned publication is only waited for on its own.
    generation: u64,
}

/// A publication sent (or waiting for a channel to be sent on) and its confirmation still to come.
type Confirming = Pin<Box<dyn Future<Output = lapin::Result<Confirmation>> + Send>>;

/// A publication the relay stopped waiting for, going on in a task of its own (so that its
/// channel is given back when it is confirmed, whether or not the message is published again).
struct Abandoned {
    generation: u64,
    confirming: JoinHandle<lapin::Result<Confirmation>>,
}

/// The publication in flight: abandoned (kept for the next publication of its message) if it is
/// dropped before its confirmation.
struct InFlight<'a> {
    publisher: &'a OutboxPublisher,
    message_id: &'a str,
    generation: u64,
    confirming: Option<Confirming>,
}

impl InFlight<'_> {
    async fn confirmation(&mut self) -> lapin::Result<Confirmation> {
        let confirming = self.confirming.as_mut().expect("awaited once");
        let confirmation = confirming.await;
        self.confirming = None;
        confirmation
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let Some(confirming) = self.confirming.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut abandoned = self.publisher.abandoned();
        if abandoned.len() < MAX_ABANDONED {
            abandoned.insert(
                self.message_id.to_owned(),
                Abandoned {
                    generation: self.generation,
                    confirming: runtime.spawn(confirming),
                },
            );
        }
    }
}

impl std::fmt::Debug for OutboxPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutboxPublisher")
            .field("reconnects", &self.url.is_some())
            .finish_non_exhaustive()
    }
}

impl OutboxPublisher {
    /// Creates a publisher that opens its channels on `connection`. It cannot connect again: once
    /// the connection is lost, every publication fails as [`PublishError::Unavailable`]. Prefer
    /// [`connect`](Self::connect).
    pub fn new(connection: Connection) -> Self {
        Self::with(
            None,
            Open {
                channels: ConfirmChannels::on(Arc::new(connection)),
                generation: 0,
            },
        )
    }

    /// Creates a publisher with a connection of its own to `url` (`amqp://…`), which it makes
    /// again when it was lost.
    pub async fn connect(url: &str) -> Result<Self, BrokerError> {
        let connection = Connection::connect(url, ConnectionProperties::default())
            .await
            .map_err(BrokerError::broker)?;
        Ok(Self::with(
            Some(url.to_owned()),
            Open {
                channels: ConfirmChannels::on(Arc::new(connection)),
                generation: 0,
            },
        ))
    }

    fn with(url: Option<String>, open: Open) -> Self {
        Self {
            url,
            open: std::sync::Mutex::new(Some(open)),
            reopening: Mutex::new(()),
            probe: Mutex::new(None),
            exchanges: std::sync::Mutex::default(),
            abandoned: std::sync::Mutex::default(),
        }
    }

    fn abandoned(&self) -> std::sync::MutexGuard<'_, HashMap<String, Abandoned>> {
        self.abandoned.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn exchanges(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.exchanges.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Returns the channels and their generation, if their connection is still open.
    fn current(&self) -> Option<(Arc<ConfirmChannels>, u64)> {
        let open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        open.as_ref()
            .filter(|open| open.channels.connected())
            .map(|open| (open.channels.clone(), open.generation))
    }

    /// Returns the channels to publish on: the open connection's, or a new connection's when it
    /// was lost (when the publisher has a URL).
    async fn channels(&self) -> Result<(Arc<ConfirmChannels>, u64), PublishError> {
        if let Some(current) = self.current() {
            return Ok(current);
        }
        let Some(url) = &self.url else {
            return Err(PublishError::unavailable(
                "the publisher's connection is closed",
            ));
        };
        let _reopening = self.reopening.lock().await;
        if let Some(current) = self.current() {
            return Ok(current); // another publication connected meanwhile
        }
        let connection = Connection::connect(url, ConnectionProperties::default())
            .await
            .map_err(PublishError::unavailable)?;
        // Another connection: what was known of the last one's exchanges is checked again, and
        // the publications abandoned on it will never be confirmed.
        self.exchanges().clear();
        *self.probe.lock().await = None;
        self.abandoned().clear();
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let generation = open.as_ref().map_or(0, |open| open.generation) + 1;
        let channels = ConfirmChannels::on(Arc::new(connection));
        *open = Some(Open {
            channels: channels.clone(),
            generation,
        });
        Ok((channels, generation))
    }

    /// Checks that `exchange` exists, once per connection, with a passive declare on a channel of
    /// its own (RabbitMQ closes the channel that names an exchange it does not have).
    async fn check_exchange(
        &self,
        connection: &Connection,
        exchange: &str,
    ) -> Result<(), PublishError> {
        if exchange.is_empty() || self.exchanges().contains(exchange) {
            return Ok(());
        }
        let mut probe = self.probe.lock().await;
        if self.exchanges().contains(exchange) {
            return Ok(());
        }
        let channel = match probe.take().filter(|c| c.status().connected()) {
            Some(channel) => channel,
            None => connection
                .create_channel()
                .await
                .map_err(PublishError::unavailable)?,
        };
        let declared = channel
            .exchange_declare(
                exchange.into(),
                ExchangeKind::Direct,
                ExchangeDeclareOptions {
                    passive: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await;
        match declared {
            Ok(()) => {
                *probe = Some(channel);
                self.exchanges().insert(exchange.to_owned());
                Ok(())
            }
            Err(error) => {
                Err(refusal(&error, connection).unwrap_or_else(|| PublishError::unavailable(error)))
            }
        }
    }

    /// Waits for the confirmation of an earlier publication of `message_id` the relay gave up on,
    /// if there is one on the channel of `generation`.
    async fn earlier(
        &self,
        message_id: &str,
        generation: u64,
    ) -> Option<lapin::Result<Confirmation>> {
        let earlier = self.abandoned().remove(message_id)?;
        if earlier.generation != generation {
            return None;
        }
        let mut in_flight = InFlight {
            publisher: self,
            message_id,
            generation,
            confirming: Some(Box::pin(async move {
                earlier.confirming.await.map_err(|ended| {
                    lapin::Error::from(std::io::Error::other(format!(
                        "the abandoned publication's task ended: {ended}"
                    )))
                })?
            })),
        };
        Some(in_flight.confirmation().await)
    }
}

/// Returns the broker's refusal that `error` is, if it is one ([`is_refusal`]: RabbitMQ closed the
/// channel), as [`PublishError::Rejected`] with the broker's code and reason. The channel carried
/// one publication or one exchange check, so the refusal is that one's: no such exchange (404), no
/// access to it (403), a message over `max_message_size` (406).
fn refusal(error: &lapin::Error, connection: &Connection) -> Option<PublishError> {
    match error.kind() {
        ErrorKind::ProtocolError(amqp) if is_refusal(error, Some(connection)) => Some(
            PublishError::rejected(format!("{} {}", amqp.get_id(), amqp.get_message())),
        ),
        _ => None,
    }
}

impl Publisher for OutboxPublisher {
    async fn publish(&self, publication: &Publication) -> Result<(), PublishError> {
        let (channels, generation) = self.channels().await?;
        let destination = &publication.destination;
        let exchange = destination.exchange.as_str();
        let confirmation = match self.earlier(&publication.message_id, generation).await {
            Some(confirmation) => confirmation,
            None => {
                if let Some(connection) = channels.connection() {
                    if connection.status().blocked() {
                        // Sent now, it would wait in the client's buffer and reach the broker
                        // after the alarm, whatever the relay made of it meanwhile.
                        return Err(PublishError::unavailable(
                            "the broker blocks publishing (connection.blocked: a resource alarm)",
                        ));
                    }
                    self.check_exchange(connection, exchange).await?;
                }
                let confirming = send(channels.clone(), publication);
                let mut in_flight = InFlight {
                    publisher: self,
                    message_id: &publication.message_id,
                    generation,
                    confirming: Some(confirming),
                };
                in_flight.confirmation().await
            }
        };
        let confirmation = match confirmation {
            Ok(confirmation) => confirmation,
            Err(error) => {
                let refused = channels
                    .connection()
                    .and_then(|connection| refusal(&error, connection));
                return Err(match refused {
                    Some(refused) => {
                        // Checked again before the next publication there: it may be gone.
                        self.exchanges().remove(exchange);
                        // Opened again: what the broker read at their opening (its
                        // `max_message_size`) may have changed since.
                        channels.close_idle();
                        refused
                    }
                    None => PublishError::unavailable(error),
                });
            }
        };
        match confirmation {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(returned)) => Err(PublishError::rejected(format!(
                "returned by the broker: {} {} (exchange {:?}, routing key {:?})",
                returned.reply_code,
                returned.reply_text,
                destination.exchange,
                destination.routing_key
            ))),
            Confirmation::Nack(_) => Err(PublishError::rejected(format!(
                "refused by the broker (basic.nack: a queue that is full and rejects publishes) \
                 (exchange {:?}, routing key {:?})",
                destination.exchange, destination.routing_key
            ))),
            Confirmation::NotRequested => Err(PublishError::unavailable(
                "the channel is not in publisher-confirm mode",
            )),
        }
    }
}

/// Sends `publication` on a channel of `channels`: a future of its own data, which outlives the
/// relay's wait.
fn send(channels: Arc<ConfirmChannels>, publication: &Publication) -> Confirming {
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
    let exchange = ShortString::from(publication.destination.exchange.as_str());
    let routing_key = ShortString::from(publication.destination.routing_key.as_str());
    let payload = publication.payload.clone();
    Box::pin(async move {
        let lent = channels.lend().await?;
        lent.publish(exchange, routing_key, &payload, properties)
            .await
    })
}
