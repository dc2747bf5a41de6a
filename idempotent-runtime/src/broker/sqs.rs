//! The runner for Amazon SQS (with `aws-sdk-sqs`): a queue long-polled, each message deleted once
//! its outcome is stored.
//!
//! ```no_run
//! # use idempotent_runtime as idempotent;
//! use idempotent::broker::sqs::Runner;
//! use idempotent::broker::{Message, RetryPolicy};
//! # async fn demo(client: aws_sdk_sqs::Client, inbox: idempotent::Inbox<sqlx::Sqlite>) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! // `client` from `aws_sdk_sqs::Client::new(&aws_config::load_from_env().await)`
//! let url = "https://sqs.eu-west-1.amazonaws.com/123456789012/payments";
//! let stats = Runner::new(client, url)
//!     .workers(4)
//!     .retry(RetryPolicy::new(5, std::time::Duration::from_secs(1)))
//!     .run(|| {
//!         let inbox = inbox.for_worker();
//!         move |message: Message| {
//!             let inbox = inbox.clone();
//!             async move {
//!                 // decode `message.payload`, call an #[idempotent] handler with `&inbox`
//!                 # let _ = (inbox, message);
//!                 # Ok::<_, idempotent::Error<std::convert::Infallible>>(idempotent::Handled::Processed(()))
//!             }
//!         }
//!     })
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! The key is the producer's id in the message attribute [`MESSAGE_ID_ATTRIBUTE`] (`message-id`,
//! which the [`OutboxPublisher`] sets; another with [`Runner::message_id_attribute`]), never SQS's
//! own `MessageId`: SQS gives a message sent twice (a producer's retry, a dead letter put back) a
//! new one. A message without the attribute is dead-lettered.
//!
//! - **Acknowledgements** are deletes, sent in batches (`DeleteMessageBatch`, up to ten, the
//!   deletes asked for while earlier batches are under way going out together), each counted
//!   done once SQS answered for its own entry. A delete that fails leaves the message to come back
//!   after its visibility timeout, and the inbox says it is a duplicate.
//! - **In flight**: a message whose handler runs has its visibility timeout extended
//!   (`ChangeMessageVisibility`, every half of the timeout), so SQS does not hand it to another
//!   consumer meanwhile. The timeout is the queue's, or [`Runner::visibility_timeout`].
//! - **Retries**: the message's visibility timeout set to the policy's delay (at most 12 hours,
//!   SQS's limit), so SQS hands it out again then. **Attempts** are SQS's own receive count
//!   (`ApproximateReceiveCount`): a crash's redelivery counts too, and a producer cannot set it.
//! - **Dead letters** go to the dead-letter queue of the queue's **redrive policy**, which the
//!   runner reads at start: sent there with the message's body and attributes (as many as SQS's
//!   ten allow, the message id first) and [`REASON_ATTRIBUTE`], [`ATTEMPTS_ATTRIBUTE`] and
//!   [`QUEUE_ATTRIBUTE`], then deleted. A message whose handler crashes the process every time
//!   is moved there by SQS itself after `maxReceiveCount` receives, without a reason. The runner
//!   refuses at start, with [`BrokerError::DeadLetterTarget`], a queue without a redrive policy,
//!   a dead-letter queue that does not exist, and a `maxReceiveCount` below the policy's
//!   `max_attempts` (SQS would move messages before their last attempt).
//! - **A dead letter that cannot be sent** (refused, not answered within the [publish
//!   timeout](Runner::publish_timeout)) does not stop the runner: the message is hidden for a
//!   back-off of its own (1 s, doubling, at most a minute) and tried again; the others go on.
//! - **SQS away** (refused connections, timeouts, throttling, its own errors): the runner says
//!   once at `warn` that it lost SQS, receives again after a back-off (100 ms, doubling, at most
//!   5 s, jittered), says at `info` when SQS answers again, counts it
//!   ([`RunnerStats::reconnects`], the `idempotent_runner_reconnects_total` metric), and never ends
//!   for it. Every request has a timeout of its own (a receive: its wait and the publish timeout;
//!   the others: the publish timeout), so an SQS that takes connections and never answers is away
//!   like one that refuses them. A queue deleted while the runner runs ends it with
//!   [`BrokerError::Cancelled`].
//! - The runner receives as many messages as it has workers free (batches: the batch size for
//!   each), at most ten per request, with long polls of 20 s ([`Runner::wait_time`]): none waits,
//!   hidden from other consumers, for a worker busy with another. On shutdown it
//!   stops receiving, settles what is in flight, and makes what it received but did not start
//!   visible again at once, with what a receive under way at the shutdown brings (it waits for
//!   that receive's answer, at most the wait time and the publish timeout).
//!
//! FIFO queues: SQS hands out a message group's messages in order and none of a group while one
//! of it is in flight, but one receive can bring several of a group, which several workers then
//! run at once. For per-group order, run one worker (or batches on one worker). Dead letters to a
//! FIFO dead-letter queue keep their group.

/// The SQS client this runner was built against: make the runner's client with it.
pub use aws_sdk_sqs;

mod dead_letters;
mod deletes;
mod delivery;
mod failure;
mod publisher;
mod queue;
mod receive;

pub use dead_letters::DeadLetterQueue;
pub use publisher::OutboxPublisher;

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::drive::{DeliveriesAtOnce, drive};
use super::error::BrokerError;
use super::options::RunnerOptions;
use super::outage::Outage;
use super::stats::RunnerStats;
use deletes::Deletes;
use delivery::{Context, SqsDelivery};
use queue::Queue;
use receive::Receiver;

/// The message attribute that carries a message's id, by default: the key.
pub const MESSAGE_ID_ATTRIBUTE: &str = "message-id";
/// The attribute that carries a dead letter's reason.
pub const REASON_ATTRIBUTE: &str = "idempotent-reason";
/// The attribute that carries the number of attempts a dead letter had.
pub const ATTEMPTS_ATTRIBUTE: &str = "idempotent-attempts";
/// The attribute that names the queue a dead letter came from.
pub const QUEUE_ATTRIBUTE: &str = "idempotent-queue";

/// How long a receive waits on SQS for messages, by default (SQS's longest).
const DEFAULT_WAIT_TIME: Duration = Duration::from_secs(20);

/// Consumes an SQS queue and settles each message by its handler's outcome; see the [module
/// docs](self).
pub struct Runner {
    client: aws_sdk_sqs::Client,
    queue_url: String,
    message_id_attribute: String,
    visibility_timeout: Option<Duration>,
    wait_time: Duration,
    options: RunnerOptions,
}

impl fmt::Debug for Runner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Runner")
            .field("queue_url", &self.queue_url)
            .field("workers", &self.options.workers)
            .field("retry", &self.options.retry)
            .finish_non_exhaustive()
    }
}

impl Runner {
    /// Creates a runner on the queue at `queue_url`, with one worker and the default
    /// [`RetryPolicy`](super::RetryPolicy); its dead letters go to the queue its redrive policy names.
    pub fn new(client: aws_sdk_sqs::Client, queue_url: impl Into<String>) -> Self {
        Self {
            client,
            queue_url: queue_url.into(),
            message_id_attribute: MESSAGE_ID_ATTRIBUTE.to_owned(),
            visibility_timeout: None,
            wait_time: DEFAULT_WAIT_TIME,
            options: RunnerOptions::default(),
        }
    }

    /// Takes the message id, the key, from the message attribute `name` (default
    /// [`MESSAGE_ID_ATTRIBUTE`]).
    pub fn message_id_attribute(mut self, name: impl Into<String>) -> Self {
        self.message_id_attribute = name.into();
        self
    }

    /// Receives messages with this visibility timeout instead of the queue's, and extends it by as
    /// much while a handler runs: whole seconds (rounded up), from 1 s to 12 hours.
    pub fn visibility_timeout(mut self, timeout: Duration) -> Self {
        let seconds = timeout.as_secs_f64().ceil().max(1.0);
        let longest = delivery::LONGEST_VISIBILITY.as_secs_f64();
        self.visibility_timeout = Some(Duration::from_secs_f64(seconds.min(longest)));
        self
    }

    /// Waits at most `wait` (whole seconds, at most 20) on SQS for messages in each receive
    /// (default 20 s).
    pub fn wait_time(mut self, wait: Duration) -> Self {
        self.wait_time = wait;
        self
    }

    super::options::runner_builder! {
        /// Runs `workers` handlers at once (and receives as many messages at a time).
        workers;
        /// Waits at most `timeout` for SQS to take a dead letter the runner sends (default
        /// [`DEFAULT_PUBLISH_TIMEOUT`](super::DEFAULT_PUBLISH_TIMEOUT), 10 s); past it, the message
        /// is hidden for a back-off and tried again.
        publish_timeout;
        /// Reads the queue's redrive policy, then consumes until the shutdown token is cancelled (or
        /// the queue is deleted), with a handler from `new_worker` per worker. Returns what it counted.
        run;
    }

    /// Checks the queue, receives from it and drives the workers.
    async fn consume<W, P, PF>(
        self,
        workers: Vec<W>,
        take: DeliveriesAtOnce,
        process: P,
    ) -> Result<RunnerStats, BrokerError>
    where
        W: Send + 'static,
        P: FnMut(W, Vec<SqsDelivery>) -> PF,
        PF: Future<Output = W> + Send + 'static,
    {
        let shutdown = self.options.shutdown.clone();
        let Some(queue) = Queue::find(
            &self.client,
            &self.queue_url,
            self.options.retry.max_attempts,
            &shutdown,
        )
        .await?
        else {
            return Ok(self.options.counters.snapshot());
        };
        let context = Arc::new(Context {
            client: self.client.clone(),
            deletes: Deletes::start(
                self.client.clone(),
                self.queue_url.clone(),
                self.options.publish_timeout,
            ),
            in_flight: Arc::default(),
            queue_url: self.queue_url.clone(),
            dead_letters: queue.dead_letters,
            message_id_attribute: self.message_id_attribute,
            visibility_timeout: self.visibility_timeout.unwrap_or(queue.visibility_timeout),
            publish_timeout: self.options.publish_timeout,
        });
        let mut receiver = Receiver {
            context,
            size: self.options.workers * take.most,
            wait: self.wait_time,
            received: VecDeque::new(),
            count: 0,
            under_way: None,
            linger: take.linger,
            handed_out: None,
            outage: Outage::new(
                "sqs",
                self.queue_url.clone(),
                Some(self.options.counters.clone()),
            ),
        };
        let deliveries = futures_util::stream::unfold(&mut receiver, |receiver| async move {
            let delivery = receiver.next().await;
            Some((delivery, receiver))
        });
        let driven = drive(deliveries, shutdown, workers, take, process).await;
        receiver.hand_back().await;
        driven?;
        Ok(self.options.counters.snapshot())
    }
}
