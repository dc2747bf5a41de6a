//! The runner's receives: long polls of up to ten messages, made again after a back-off while SQS
//! is away, and what was received but not started handed back at shutdown.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_sqs::types::{
    ChangeMessageVisibilityBatchRequestEntry, Message, MessageSystemAttributeName,
};
use tokio::task::JoinHandle;

use super::deletes::MOST_PER_BATCH;
use super::delivery::{Context, SqsDelivery};
use super::failure::Failure;
use crate::broker::error::BrokerError;
use crate::broker::outage::Outage;

/// Receives a queue's messages for the runner, `size` (at most ten) per request.
pub(super) struct Receiver {
    pub(super) context: Arc<Context>,
    pub(super) size: usize,
    pub(super) wait: Duration,
    pub(super) received: VecDeque<Message>,
    pub(super) count: u64,
    pub(super) outage: Outage,
    /// The receive under way, if any.
    pub(super) under_way: Option<JoinHandle<Result<Vec<Message>, Failure>>>,
}

/// One receive of up to `size` (at most ten) messages, waiting at most `wait` for them.
async fn receive(
    context: Arc<Context>,
    size: usize,
    wait: Duration,
) -> Result<Vec<Message>, Failure> {
    context
        .client
        .receive_message()
        .queue_url(&context.queue_url)
        .max_number_of_messages(size.clamp(1, MOST_PER_BATCH) as i32)
        .wait_time_seconds(wait.as_secs().min(20) as i32)
        .visibility_timeout(context.visibility_timeout.as_secs() as i32)
        .message_attribute_names("All")
        .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
        .message_system_attribute_names(MessageSystemAttributeName::MessageGroupId)
        .send()
        .await
        .map(|answer| answer.messages.unwrap_or_default())
        .map_err(|error| Failure::of(&error, &context.queue_url))
}

impl Receiver {
    /// The next message, receiving until one comes; receives that fail (SQS is away) are made again
    /// after a back-off. An error only when the queue is gone.
    ///
    /// Each receive runs as a task of its own, kept in `under_way` until it answers: a caller that
    /// stops waiting (the runner's shutdown) leaves it running, and [`hand_back`](Self::hand_back)
    /// takes what it brings.
    pub(super) async fn next(&mut self) -> Result<SqsDelivery, BrokerError> {
        loop {
            if let Some(message) = self.received.pop_front() {
                self.count += 1;
                return Ok(SqsDelivery {
                    message,
                    number: self.count,
                    context: self.context.clone(),
                });
            }
            let under_way = self.under_way.get_or_insert_with(|| {
                tokio::spawn(receive(self.context.clone(), self.size, self.wait))
            });
            let received = under_way.await;
            self.under_way = None;
            match received {
                Ok(Ok(messages)) => {
                    self.outage.restored();
                    self.received.extend(messages);
                }
                Ok(Err(Failure::NoQueue(_))) => {
                    return Err(BrokerError::Cancelled {
                        source_name: self.context.queue_url.clone(),
                    });
                }
                Ok(Err(failure)) => {
                    let after = self.outage.failed(&failure);
                    tokio::time::sleep(after).await;
                }
                Err(panicked) => std::panic::resume_unwind(panicked.into_panic()),
            }
        }
    }

    /// Makes what was received but not started visible again at once, for the next consumer: the
    /// messages received before, and those the receive under way brings.
    pub(super) async fn hand_back(&mut self) {
        if let Some(under_way) = self.under_way.take()
            && let Ok(Ok(messages)) = under_way.await
        {
            self.received.extend(messages);
        }
        let received: Vec<_> = self.received.drain(..).collect();
        // Should this fail, the messages come back after their visibility timeout instead.
        make_visible(&self.context.client, &self.context.queue_url, &received).await;
    }
}

/// Makes `messages`, received from the queue at `url`, visible again at once (in batches of ten);
/// should that fail, they come back after their visibility timeout.
pub(super) async fn make_visible<'a>(
    client: &aws_sdk_sqs::Client,
    url: &str,
    messages: impl IntoIterator<Item = &'a Message>,
) {
    let messages: Vec<&Message> = messages.into_iter().collect();
    for chunk in messages.chunks(MOST_PER_BATCH) {
        let entries = chunk
            .iter()
            .enumerate()
            .map(|(n, message)| {
                ChangeMessageVisibilityBatchRequestEntry::builder()
                    .id(n.to_string())
                    .receipt_handle(message.receipt_handle().unwrap_or_default())
                    .visibility_timeout(0)
                    .build()
                    .expect("id and receipt handle are set")
            })
            .collect();
        let _ = client
            .change_message_visibility_batch()
            .queue_url(url)
            .set_entries(Some(entries))
            .send()
            .await;
    }
}
