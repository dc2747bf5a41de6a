//! The runner's consumer: a channel set up with the runner's queues, consumed, and made again
//! (on a new connection, where the runner can make one) whenever it is lost.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection};

use super::confirms::ConfirmChannels;
use super::delivery::{AmqpDelivery, RunnerSetup, SessionContext};
use super::is_refusal;
use crate::broker::error::BrokerError;
use crate::broker::outage::Outage;

/// Makes a connection to the broker, for a runner that reconnects by itself; see
/// [`Runner::with_connector`](super::Runner::with_connector).
pub type Connector =
    Arc<dyn Fn() -> BoxFuture<'static, Result<Connection, lapin::Error>> + Send + Sync>;

/// Where a runner's channels come from.
pub(super) enum ChannelSource {
    /// A channel the user made: used once, no reconnecting.
    Channel(Option<Channel>),
    /// New connections, as many as it takes.
    Connector(Connector),
}

/// A connection's channel and the runner's consumer on it.
struct ConsumerSession {
    /// The connection the runner made, if it did.
    connection: Option<Arc<Connection>>,
    channel: Channel,
    consumer: lapin::Consumer,
    context: Arc<SessionContext>,
}

/// Why a session could not be opened.
enum OpenError {
    /// The broker is away (or the connection broke): try again after a back-off.
    Lost(lapin::Error),
    /// The broker refused the runner's setup, or there is no way to reconnect: the runner stops.
    Fatal(BrokerError),
}

/// The runner's deliveries, from one session after another.
pub(super) struct ReconnectingConsumer {
    source: ChannelSource,
    setup: Arc<RunnerSetup>,
    session: Option<ConsumerSession>,
    outage: Outage,
}

impl ReconnectingConsumer {
    /// Returns a consumer of `setup`'s queue on channels from `source`, which says through
    /// `outage` when it loses the broker and when it is back.
    pub(super) fn new(source: ChannelSource, setup: Arc<RunnerSetup>, outage: Outage) -> Self {
        Self {
            source,
            setup,
            session: None,
            outage,
        }
    }

    /// The next delivery, reconnecting as long as it takes; an error only when the runner cannot
    /// go on.
    pub(super) async fn next(&mut self) -> Result<AmqpDelivery, BrokerError> {
        loop {
            let session = match self.session.as_mut() {
                Some(session) => session,
                None => match self.open().await {
                    Ok(session) => {
                        self.outage.restored();
                        self.session.insert(session)
                    }
                    Err(OpenError::Fatal(error)) => return Err(error),
                    Err(OpenError::Lost(error)) => {
                        let after = self.outage.failed(&error);
                        tokio::time::sleep(after).await;
                        continue;
                    }
                },
            };
            match session.consumer.next().await {
                Some(Ok(delivery)) => {
                    return Ok(AmqpDelivery {
                        delivery,
                        context: session.context.clone(),
                    });
                }
                Some(Err(error)) => {
                    self.session = None;
                    let after = self.outage.failed(&error);
                    tokio::time::sleep(after).await;
                }
                None => {
                    // The consumer ended without an error: the broker cancelled it, which it
                    // does when its queue is deleted, or the connection went away.
                    let session = self.session.take().expect("a session");
                    if let Some(error) = self.cancelled(&session).await {
                        return Err(error);
                    }
                    if let ChannelSource::Channel(slot) = &mut self.source {
                        // Consumed again on the same channel, if it is still open.
                        *slot = Some(session.channel.clone());
                    }
                    // Not at once: a broker that cancels again and again is not asked in a loop.
                    let ended = std::io::Error::other("the broker ended the runner's consumer");
                    let after = self.outage.failed(&ended);
                    tokio::time::sleep(after).await;
                }
            }
        }
    }

    /// Why `session`'s consumer ended: [`BrokerError::Cancelled`] when its queue is gone.
    async fn cancelled(&self, session: &ConsumerSession) -> Option<BrokerError> {
        let queue = self.setup.queue.as_str();
        let probe = async {
            // On a channel of its own where it can: a missing queue closes the channel it is
            // asked on.
            let channel = match &session.connection {
                Some(connection) => connection.create_channel().await?,
                None => session.channel.clone(),
            };
            let declared = channel
                .queue_declare(
                    queue.into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..QueueDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await;
            if declared.is_ok() && session.connection.is_some() {
                let _ = channel.close(200, "".into()).await;
            }
            declared
        };
        match tokio::time::timeout(self.setup.publish_timeout, probe).await {
            Ok(Err(error)) if is_refusal(&error, session.connection.as_deref()) => {
                tracing::warn!(queue, %error, "the broker cancelled the runner's consumer");
                Some(BrokerError::Cancelled {
                    source_name: queue.to_owned(),
                })
            }
            _ => {
                tracing::warn!(
                    queue,
                    "the runner's consumer ended while its queue is there; consuming again"
                );
                None
            }
        }
    }

    /// A channel (a new connection's, where the runner can make one) set up for the runner, and
    /// its consumer.
    async fn open(&mut self) -> Result<ConsumerSession, OpenError> {
        let (connection, channel) = match &mut self.source {
            ChannelSource::Channel(channel) => match channel.take() {
                Some(channel) => (None, channel),
                None => {
                    return Err(OpenError::Fatal(BrokerError::Broker(
                        "the runner's channel was lost, and a runner made from a channel cannot \
                         reconnect (make it with Runner::connect)"
                            .into(),
                    )));
                }
            },
            ChannelSource::Connector(connect) => {
                let connection = connect().await.map_err(OpenError::Lost)?;
                let channel = connection.create_channel().await.map_err(OpenError::Lost)?;
                (Some(Arc::new(connection)), channel)
            }
        };
        let setup = &self.setup;
        let classify = |error: lapin::Error| {
            if is_refusal(&error, connection.as_deref()) {
                OpenError::Fatal(BrokerError::broker(error))
            } else {
                OpenError::Lost(error)
            }
        };
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(classify)?;
        channel
            .basic_qos(setup.prefetch, BasicQosOptions::default())
            .await
            .map_err(classify)?;
        for (delay, queue) in &setup.retry_queues {
            let mut arguments = FieldTable::default();
            arguments.insert(
                "x-message-ttl".into(),
                AMQPValue::LongLongInt(delay.as_millis().min(i64::MAX as u128) as i64),
            );
            arguments.insert(
                "x-dead-letter-exchange".into(),
                AMQPValue::LongString("".into()),
            );
            arguments.insert(
                "x-dead-letter-routing-key".into(),
                AMQPValue::LongString(setup.queue.as_str().into()),
            );
            declare(&channel, queue, arguments)
                .await
                .map_err(classify)?;
        }
        declare(&channel, &setup.dead_letters, FieldTable::default())
            .await
            .map_err(|error| {
                if is_refusal(&error, connection.as_deref()) {
                    OpenError::Fatal(BrokerError::DeadLetterTarget {
                        target: setup.dead_letters.clone(),
                        reason: format!("the broker refused to declare the queue: {error}"),
                    })
                } else {
                    OpenError::Lost(error)
                }
            })?;
        let consumer = channel
            .basic_consume(
                setup.queue.as_str().into(),
                setup.consumer_tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(classify)?;
        let publishing = match &connection {
            Some(connection) => ConfirmChannels::on(connection.clone()),
            None => ConfirmChannels::only(channel.clone()),
        };
        let context = Arc::new(SessionContext {
            publishing,
            setup: setup.clone(),
        });
        Ok(ConsumerSession {
            connection,
            channel,
            consumer,
            context,
        })
    }
}

impl ReconnectingConsumer {
    /// Cancels the consumer, and hands back the deliveries received but not started.
    pub(super) async fn close(&mut self) {
        if let Some(mut session) = self.session.take() {
            let tag = session.consumer.tag();
            let cancelled = session
                .channel
                .basic_cancel(tag, BasicCancelOptions::default())
                .await;
            if cancelled.is_ok() {
                while let Ok(Some(Ok(delivery))) =
                    tokio::time::timeout(Duration::from_millis(100), session.consumer.next()).await
                {
                    let _ = delivery
                        .nack(BasicNackOptions {
                            requeue: true,
                            ..BasicNackOptions::default()
                        })
                        .await;
                }
            }
        }
    }
}

/// Declares a durable queue with `arguments`.
async fn declare(
    channel: &Channel,
    queue: &str,
    arguments: FieldTable,
) -> Result<(), lapin::Error> {
    channel
        .queue_declare(queue.into(), QueueDeclareOptions::durable(), arguments)
        .await
        .map(drop)
}
