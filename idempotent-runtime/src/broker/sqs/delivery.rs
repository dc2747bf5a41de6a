//! One SQS message as the shared driver handles it: its key and attempt, and how each route
//! settles it (delete, a longer visibility timeout, or a dead letter sent and then deleted).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::{MessageAttributeValue, MessageSystemAttributeName};

use super::deletes::Deletes;
use super::failure::Failure;
use super::{ATTEMPTS_ATTRIBUTE, QUEUE_ATTRIBUTE, REASON_ATTRIBUTE};
use crate::broker::delivery::Delivery;
use crate::broker::error::BrokerError;
use crate::broker::message::{Message, MessageId, Redelivered};
use crate::broker::route::Route;
use crate::markers::DeliveryTag;

/// The most message attributes SQS keeps on a message.
const MOST_ATTRIBUTES: usize = 10;

/// The longest visibility timeout SQS allows (12 hours), counted from the message's receive.
pub(super) const LONGEST_VISIBILITY: Duration = Duration::from_secs(12 * 60 * 60);

/// Kept off the 12 hours, for the clocks' difference and the request's way to SQS.
const VISIBILITY_MARGIN: Duration = Duration::from_secs(30);

/// What every delivery of one runner needs to settle.
#[derive(Debug)]
pub(super) struct Context {
    pub(super) client: Client,
    pub(super) queue_url: String,
    pub(super) dead_letters: String,
    pub(super) message_id_attribute: String,
    pub(super) visibility_timeout: Duration,
    /// How long any request but a receive waits for SQS's answer (the runner's publish timeout).
    pub(super) publish_timeout: Duration,
    pub(super) deletes: Deletes,
    /// The messages handed to workers and not yet settled.
    pub(super) in_flight: Arc<AtomicUsize>,
}

impl Context {
    /// Waits at most the publish timeout for `request`; past it, SQS is unavailable.
    pub(super) async fn within<T>(
        &self,
        request: impl Future<Output = Result<T, Failure>>,
    ) -> Result<T, Failure> {
        within(self.publish_timeout, request).await
    }
}

/// Waits at most `timeout` for `request`; past it, SQS is unavailable.
pub(super) async fn within<T>(
    timeout: Duration,
    request: impl Future<Output = Result<T, Failure>>,
) -> Result<T, Failure> {
    tokio::time::timeout(timeout, request)
        .await
        .unwrap_or_else(|_| {
            Err(Failure::Unavailable(format!(
                "SQS did not answer within {timeout:?}"
            )))
        })
}

/// A message handed to a worker and not yet settled, counted in [`Context::in_flight`] until it
/// is dropped.
pub(super) struct InFlight(Arc<AtomicUsize>);

impl InFlight {
    pub(super) fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Self(count.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One received message.
pub(super) struct SqsDelivery {
    pub(super) message: aws_sdk_sqs::types::Message,
    /// The runner's count of the deliveries it received: this one's number.
    pub(super) number: u64,
    /// When its receive was answered: SQS's 12 hours of visibility count from there.
    pub(super) received_at: Instant,
    pub(super) _in_flight: InFlight,
    pub(super) context: Arc<Context>,
}

impl SqsDelivery {
    fn receipt_handle(&self) -> &str {
        self.message.receipt_handle().unwrap_or_default()
    }

    fn system_attribute(&self, name: &MessageSystemAttributeName) -> Option<&str> {
        self.message
            .attributes()
            .and_then(|attributes| attributes.get(name))
            .map(String::as_str)
    }

    /// How many times SQS has handed this message out, this time included.
    fn receive_count(&self) -> u32 {
        self.system_attribute(&MessageSystemAttributeName::ApproximateReceiveCount)
            .and_then(|count| count.parse().ok())
            .unwrap_or(1)
            .max(1)
    }

    /// Makes the message visible again after `after`, in whole seconds, and no later than SQS
    /// allows: 12 hours after its receive.
    async fn hide_for(&self, after: Duration) -> Result<(), BrokerError> {
        let left =
            LONGEST_VISIBILITY.saturating_sub(self.received_at.elapsed() + VISIBILITY_MARGIN);
        let seconds = after.min(left).as_secs_f64().ceil() as i32;
        let context = &self.context;
        let hidden = context.within(async {
            context
                .client
                .change_message_visibility()
                .queue_url(&context.queue_url)
                .receipt_handle(self.receipt_handle())
                .visibility_timeout(seconds)
                .send()
                .await
                .map(|_| ())
                .map_err(|error| Failure::of(&error, &context.queue_url))
        });
        hidden.await.map_err(BrokerError::broker)
    }

    /// Sends the dead letter of this message to the dead-letter queue: its body and attributes, and
    /// the reason, the attempts and the queue it came from.
    async fn send_dead_letter(&self, reason: &str, attempts: u32) -> Result<(), BrokerError> {
        let context = &self.context;
        let ours = [
            (REASON_ATTRIBUTE, reason.to_owned()),
            (ATTEMPTS_ATTRIBUTE, attempts.to_string()),
            (QUEUE_ATTRIBUTE, context.queue_url.clone()),
        ];
        let mut send = context
            .client
            .send_message()
            .queue_url(&context.dead_letters)
            .message_body(self.message.body().unwrap_or_default());
        for (name, value) in ours {
            send = send.message_attributes(name, text_attribute(value));
        }
        // The message's own attributes, as many as SQS's ten leave room for: the message id first.
        let mut own: Vec<_> = self
            .message
            .message_attributes()
            .into_iter()
            .flatten()
            .filter(|(name, _)| !name.starts_with("idempotent-"))
            .collect();
        own.sort_by_key(|(name, _)| **name != context.message_id_attribute);
        for (name, value) in own.into_iter().take(MOST_ATTRIBUTES - 3) {
            send = send.message_attributes(name, value.clone());
        }
        if context.dead_letters.ends_with(".fifo") {
            let group = self
                .system_attribute(&MessageSystemAttributeName::MessageGroupId)
                .unwrap_or("idempotent-dead-letters");
            send = send
                .message_group_id(group)
                .message_deduplication_id(self.message.message_id().unwrap_or("none"));
        }
        let after = context.publish_timeout;
        match tokio::time::timeout(after, send.send()).await {
            Err(_) => Err(BrokerError::Timeout {
                what: "dead letter",
                after,
            }),
            Ok(Err(error)) => Err(match Failure::of(&error, &context.dead_letters) {
                Failure::Unavailable(reason) => BrokerError::broker(Failure::Unavailable(reason)),
                _ => BrokerError::Refused {
                    what: "dead letter",
                },
            }),
            Ok(Ok(_)) => Ok(()),
        }
    }
}

/// The text of a message attribute of type `String` or `Number` (and their custom subtypes).
pub(super) fn text_of(value: &MessageAttributeValue) -> Option<&str> {
    let kind = value.data_type();
    (kind.starts_with("String") || kind.starts_with("Number"))
        .then(|| value.string_value())
        .flatten()
}

/// A message attribute of type `String`.
pub(super) fn text_attribute(value: impl Into<String>) -> MessageAttributeValue {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()
        .expect("the data type is set")
}

impl Delivery for SqsDelivery {
    const RELEASE_DELAYS: bool = true;

    fn message(&self) -> Result<Message, String> {
        let attributes = self.message.message_attributes();
        let name = &self.context.message_id_attribute;
        let message_id = attributes
            .and_then(|all| all.get(name))
            .and_then(text_of)
            .filter(|id| !id.is_empty())
            .ok_or_else(|| format!("the message has no {name} attribute: it has no key"))?;
        let mut headers: Vec<(String, String)> = attributes
            .into_iter()
            .flatten()
            .filter_map(|(name, value)| Some((name.clone(), text_of(value)?.to_owned())))
            .collect();
        headers.sort();
        let attempt = self.receive_count();
        Ok(Message {
            message_id: MessageId(message_id.to_owned()),
            payload: self.message.body().unwrap_or_default().as_bytes().to_vec(),
            headers,
            attempt,
            delivery_tag: DeliveryTag(self.number),
            redelivered: Redelivered(attempt > 1),
            stream_sequence: None,
        })
    }

    async fn settle(&self, route: &Route) -> Result<(), BrokerError> {
        match route {
            Route::Ack => self
                .context
                .deletes
                .delete(self.receipt_handle())
                .await
                .map_err(BrokerError::broker),
            Route::Retry { after, .. } => self.hide_for(*after).await,
            Route::DeadLetter { reason, attempts } => {
                self.send_dead_letter(reason, *attempts).await?;
                // Sent: the original goes. Should the delete fail, the message comes back after
                // its visibility timeout and is dead-lettered again (a second copy there).
                self.context
                    .deletes
                    .delete(self.receipt_handle())
                    .await
                    .map_err(BrokerError::broker)
            }
        }
    }

    async fn release(self, after: Duration) {
        let _ = self.hide_for(after).await;
    }

    async fn keep_alive(&self) {
        // Extended at half of the timeout, each time by a whole one: the message stays invisible
        // to other consumers while its handler runs.
        let every = (self.context.visibility_timeout / 2).max(Duration::from_millis(500));
        loop {
            tokio::time::sleep(every).await;
            let _ = self.hide_for(self.context.visibility_timeout).await;
        }
    }
}
