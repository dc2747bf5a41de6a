//! The runner's receives: long polls of up to ten messages, made again after a back-off while SQS
//! is away, and what was received but not started handed back at shutdown.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use aws_sdk_sqs::types::{
    ChangeMessageVisibilityBatchRequestEntry, Message, MessageSystemAttributeName,
};
use tokio::task::JoinHandle;

use super::deletes::MOST_PER_BATCH;
use super::delivery::{Context, InFlight, SqsDelivery, within};
use super::failure::Failure;
use crate::broker::error::BrokerError;
use crate::broker::outage::Outage;

/// Receives a queue's messages for the runner, `size` (at most ten) per request.
pub(super) struct Receiver {
    pub(super) context: Arc<Context>,
    pub(super) size: usize,
    pub(super) wait: Duration,
    /// Messages received and not yet handed out, with when their receive was answered.
    pub(super) received: VecDeque<(Message, Instant)>,
    pub(super) count: u64,
    pub(super) outage: Outage,
    /// The receive under way, if any.
    pub(super) under_way: Option<JoinHandle<Result<Received, Failure>>>,
    /// How long a worker waits for more deliveries once it has one (batch mode's linger).
    pub(super) linger: Duration,
    /// When the last delivery was handed out.
    pub(super) handed_out: Option<Instant>,
}

/// What one receive brought: each message with when it came.
type Received = Vec<(Message, Instant)>;

/// The longest a receive waits on SQS for messages (SQS's limit).
const MOST_WAIT: Duration = Duration::from_secs(20);

/// One receive of up to `size` (at most ten) messages, waiting at most `wait` for them, and for
/// SQS's answer at most the publish timeout longer; each message with when it came.
async fn receive(context: Arc<Context>, size: usize, wait: Duration) -> Result<Received, Failure> {
    let wait = wait.min(MOST_WAIT);
    let request = async {
        context
            .client
            .receive_message()
            .queue_url(&context.queue_url)
            .max_number_of_messages(size.clamp(1, MOST_PER_BATCH) as i32)
            .wait_time_seconds(wait.as_secs() as i32)
            .visibility_timeout(context.visibility_timeout.as_secs() as i32)
            .message_attribute_names("All")
            .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
            .message_system_attribute_names(MessageSystemAttributeName::MessageGroupId)
            .send()
            .await
            .map(|answer| answer.messages.unwrap_or_default())
            .map_err(|error| Failure::of(&error, &context.queue_url))
    };
    let messages = within(wait + context.publish_timeout, request).await?;
    let now = Instant::now();
    Ok(messages.into_iter().map(|message| (message, now)).collect())
}

impl Receiver {
    /// The next message, receiving until one comes; receives that fail (SQS is away) are made again
    /// after a back-off. An error only when the queue is gone.
    ///
    /// Each receive runs as a task of its own, kept in `under_way` until it answers, so that a
    /// shutdown can take what a receive under way brings. A caller that stops waiting (a worker's
    /// linger ended) leaves the receive to be answered into this future, which waits until a
    /// worker asks again: so a worker that lingers for more receives without waiting on SQS, and a
    /// message that waited here longer than half its visibility timeout is not handed out but made
    /// visible again (SQS may have handed it to another consumer meanwhile).
    pub(super) async fn next(&mut self) -> Result<SqsDelivery, BrokerError> {
        loop {
            let stale_after = self.context.visibility_timeout / 2;
            let mut stale = Vec::new();
            while let Some((message, received_at)) = self.received.pop_front() {
                if received_at.elapsed() > stale_after {
                    stale.push(message);
                    continue;
                }
                if !stale.is_empty() {
                    self.make_visible(&stale).await;
                }
                self.count += 1;
                self.handed_out = Some(Instant::now());
                return Ok(SqsDelivery {
                    message,
                    number: self.count,
                    received_at,
                    _in_flight: InFlight::new(&self.context.in_flight),
                    context: self.context.clone(),
                });
            }
            if !stale.is_empty() {
                self.make_visible(&stale).await;
            }
            // A worker lingers for more: what is left of its linger.
            let lingering = self
                .handed_out
                .map(|at| self.linger.saturating_sub(at.elapsed()))
                .filter(|left| !left.is_zero());
            let under_way = self.under_way.get_or_insert_with(|| {
                // As many as the workers not busy with one can take (at least one: the caller is
                // a free worker); without waiting while a worker lingers for more.
                let busy = self.context.in_flight.load(Ordering::SeqCst);
                let size = self.size.saturating_sub(busy).max(1);
                let wait = if lingering.is_some() {
                    Duration::ZERO
                } else {
                    self.wait
                };
                tokio::spawn(receive(self.context.clone(), size, wait))
            });
            let received = under_way.await;
            self.under_way = None;
            match received {
                Ok(Ok(messages)) => {
                    self.outage.restored();
                    if messages.is_empty()
                        && let Some(left) = lingering
                    {
                        // Nothing more now: no receive again before the linger is over.
                        tokio::time::sleep(left).await;
                    }
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

    /// Makes `messages` visible again at once.
    async fn make_visible(&self, messages: &[Message]) {
        let context = &self.context;
        make_visible(
            &context.client,
            &context.queue_url,
            messages,
            context.publish_timeout,
        )
        .await;
    }

    /// Makes what was received but not started visible again at once, for the next consumer: the
    /// messages received before, and those the receive under way brings.
    pub(super) async fn hand_back(&mut self) {
        let answer_within = self.wait + self.context.publish_timeout;
        if let Some(under_way) = self.under_way.take()
            && let Ok(Ok(Ok(messages))) = tokio::time::timeout(answer_within, under_way).await
        {
            self.received.extend(messages);
        }
        let received: Vec<_> = self
            .received
            .drain(..)
            .map(|(message, _)| message)
            .collect();
        self.make_visible(&received).await;
    }
}

/// Makes `messages`, received from the queue at `url`, visible again at once (in batches of ten,
/// each waiting at most `timeout`); should that fail, they come back after their visibility
/// timeout.
pub(super) async fn make_visible<'a>(
    client: &aws_sdk_sqs::Client,
    url: &str,
    messages: impl IntoIterator<Item = &'a Message>,
    timeout: Duration,
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
        let request = client
            .change_message_visibility_batch()
            .queue_url(url)
            .set_entries(Some(entries))
            .send();
        let _ = tokio::time::timeout(timeout, request).await;
    }
}
