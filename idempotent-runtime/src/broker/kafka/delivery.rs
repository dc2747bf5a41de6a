//! One Kafka record as the shared driver handles it: its message, and how it is settled (its
//! offset stored for the next commit, after its retry or dead letter is on its topic).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::message::{Header, Headers as _, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Message as _, Offset, TopicPartitionList};
use tokio::sync::Notify;

use super::super::delivery::Delivery;
use super::super::error::BrokerError;
use super::super::message::{Message, MessageId, Redelivered, StreamSequence};
use super::super::route::Route;
use super::super::stats::Counters;
use super::context::RunnerContext;
use super::holds::{Holds, skipped_reason};
use super::partitions::{Lease, Partitions};
use super::topics::RetryTopics;
use super::{
    ATTEMPT_HEADER, ATTEMPTS_HEADER, DUE_HEADER, OFFSET_HEADER, PARTITION_HEADER, REASON_HEADER,
    TOPIC_HEADER, produce,
};
use crate::markers::DeliveryTag;

/// What every record of one runner needs to be settled.
pub(super) struct Settling {
    pub(super) consumer: Arc<StreamConsumer<RunnerContext>>,
    pub(super) partitions: Arc<Mutex<Partitions>>,
    pub(super) wake: Arc<Notify>,
    pub(super) producer: FutureProducer,
    pub(super) retry: RetryTopics,
    pub(super) dead_letters: String,
    pub(super) message_id_header: String,
    pub(super) publish_timeout: Duration,
    pub(super) counters: Arc<Counters>,
    /// With [`Runner::hold_partition_on_failure`](super::Runner::hold_partition_on_failure): the
    /// runner's held partitions. Retries then wait in place, and a record that would be
    /// dead-lettered is parked.
    pub(super) holds: Option<Arc<Holds>>,
}

impl Settling {
    pub(super) fn partitions(&self) -> std::sync::MutexGuard<'_, Partitions> {
        self.partitions.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A record a worker has.
pub(super) struct KafkaDelivery {
    pub(super) lease: Lease,
    pub(super) settling: Arc<Settling>,
    /// Parked for an operator by its settling.
    parked: AtomicBool,
}

/// The value of the last header `name` of `record`, when it is text.
pub(super) fn header<'a>(record: &'a OwnedMessage, name: &str) -> Option<&'a str> {
    record
        .headers()?
        .iter()
        .filter(|header| header.key == name)
        .filter_map(|header| std::str::from_utf8(header.value?).ok())
        .last()
}

impl KafkaDelivery {
    pub(super) fn new(lease: Lease, settling: Arc<Settling>) -> Self {
        Self {
            lease,
            settling,
            parked: AtomicBool::new(false),
        }
    }

    fn header(&self, name: &str) -> Option<&str> {
        header(&self.lease.record, name)
    }

    /// Publishes the record to `topic` with its headers, less the runner's own, and `extra`;
    /// waits for the broker to have it (`acks=all`).
    async fn publish(
        &self,
        what: &'static str,
        topic: &str,
        extra: &[(&str, String)],
    ) -> Result<(), BrokerError> {
        let record = &self.lease.record;
        let mut headers = OwnedHeaders::new();
        let own = [ATTEMPT_HEADER, DUE_HEADER];
        for header in record.headers().into_iter().flat_map(|h| h.iter()) {
            if !own.contains(&header.key) && !extra.iter().any(|(name, _)| *name == header.key) {
                headers = headers.insert(header);
            }
        }
        for (name, value) in extra {
            headers = headers.insert(Header {
                key: name,
                value: Some(value.as_bytes()),
            });
        }
        let mut out = FutureRecord::<[u8], [u8]>::to(topic).headers(headers);
        if let Some(payload) = record.payload() {
            out = out.payload(payload);
        }
        if let Some(key) = record.key() {
            out = out.key(key);
        }
        let after = self.settling.publish_timeout;
        produce(&self.settling.producer, out, what, after, |error| {
            tracing::warn!(%error, topic, "the broker refused a {what}");
            BrokerError::Refused { what }
        })
        .await
    }

    /// Where the record first came from: a retry keeps the topic it was retried from.
    fn source(&self) -> String {
        let topic = self.lease.record.topic();
        match self.header(TOPIC_HEADER) {
            Some(source) if self.settling.retry.contains(topic) => source.to_owned(),
            _ => topic.to_owned(),
        }
    }

    /// Produces the record to the dead-letter topic with `route`'s reason and attempts, and then
    /// settles it.
    pub(super) async fn dead_letter(&self, route: &Route) -> Result<(), BrokerError> {
        self.publish_dead_letter(route).await?;
        self.done();
        Ok(())
    }

    /// Produces the record to the dead-letter topic with `route`'s reason and attempts, without
    /// settling it.
    pub(super) async fn publish_dead_letter(&self, route: &Route) -> Result<(), BrokerError> {
        let Route::DeadLetter { reason, attempts } = route else {
            unreachable!("a dead letter's route")
        };
        let record = &self.lease.record;
        self.publish(
            "dead letter",
            &self.settling.dead_letters,
            &[
                (REASON_HEADER, reason.clone()),
                (ATTEMPTS_HEADER, attempts.to_string()),
                (TOPIC_HEADER, self.source()),
                (PARTITION_HEADER, record.partition().to_string()),
                (OFFSET_HEADER, record.offset().to_string()),
            ],
        )
        .await
    }

    /// The record is settled: its offset goes to the next commit once every earlier one of its
    /// partition is settled too.
    pub(super) fn done(&self) {
        let lease = &self.lease;
        let commit =
            self.settling
                .partitions()
                .settled(&lease.partition, lease.hold, lease.record.offset());
        if let Some(offset) = commit {
            let mut offsets = TopicPartitionList::new();
            let stored = offsets
                .add_partition_offset(
                    &lease.partition.topic,
                    lease.partition.partition,
                    Offset::Offset(offset),
                )
                .and_then(|()| self.settling.consumer.store_offsets(&offsets));
            if let Err(error) = stored {
                // Revoked meanwhile: its new owner delivers it again, and the inbox says duplicate.
                tracing::debug!(%error, topic = %lease.partition.topic, partition = lease.partition.partition, offset, "could not store an offset");
            }
        }
        self.settling.wake.notify_one();
    }
}

impl Delivery for KafkaDelivery {
    const RELEASE_DELAYS: bool = true;

    fn message(&self) -> Result<Message, String> {
        let record = &self.lease.record;
        let name = self.settling.message_id_header.as_str();
        let message_id = self
            .header(name)
            .filter(|id| !id.is_empty())
            .ok_or_else(|| format!("the record has no {name} header: it has no key"))?;
        let attempt = if let Some(attempt) = self.lease.attempt {
            // Retried in place by this runner.
            attempt
        } else if self.settling.retry.contains(record.topic()) {
            self.header(ATTEMPT_HEADER)
                .and_then(|attempt| attempt.parse::<u32>().ok())
                .filter(|attempt| *attempt >= 1)
                .ok_or_else(|| {
                    format!(
                        "a record on retry topic {} without a valid {ATTEMPT_HEADER} header",
                        record.topic()
                    )
                })?
        } else {
            // On the runner's own topics only: a producer's header does not count.
            1
        };
        let headers = record
            .headers()
            .into_iter()
            .flat_map(|headers| headers.iter())
            .filter_map(|header| {
                let value = std::str::from_utf8(header.value?).ok()?;
                Some((header.key.to_owned(), value.to_owned()))
            })
            .collect();
        let offset = u64::try_from(record.offset()).unwrap_or_default();
        Ok(Message {
            message_id: MessageId(message_id.to_owned()),
            payload: record.payload().unwrap_or_default().to_vec(),
            headers,
            attempt,
            delivery_tag: DeliveryTag(offset),
            redelivered: Redelivered(attempt > 1),
            stream_sequence: Some(StreamSequence(offset)),
        })
    }

    async fn settle(&self, route: &Route) -> Result<(), BrokerError> {
        let record = &self.lease.record;
        if let Some(holds) = &self.settling.holds {
            match route {
                Route::Ack => {}
                Route::Retry { attempt, after } => {
                    // In place: the rest of the partition waits for it.
                    let mut lease = self.lease.clone();
                    lease.attempt = Some(*attempt);
                    let due = tokio::time::Instant::now() + *after;
                    self.settling.partitions().handed_back(lease, due);
                    self.settling.wake.notify_one();
                    return Ok(());
                }
                Route::DeadLetter { reason, attempts } => {
                    let partition = &self.lease.partition;
                    let Some(skipped) = holds.skipped(partition, record.offset()) else {
                        holds.park(self, reason, *attempts).await?;
                        self.parked.store(true, Ordering::Relaxed);
                        self.settling.wake.notify_one();
                        return Ok(());
                    };
                    let route = Route::DeadLetter {
                        reason: skipped_reason(&skipped, reason),
                        attempts: *attempts,
                    };
                    return self.dead_letter(&route).await;
                }
            }
        }
        match route {
            Route::Ack => {}
            Route::Retry { attempt, after } => {
                let due = (SystemTime::now() + *after)
                    .duration_since(UNIX_EPOCH)
                    .unwrap_or_default();
                // In whole milliseconds, rounded up: a retry is never handed out before its
                // back-off (rounded down, one came 0.2 ms early once fetches were prompt).
                let due =
                    due.as_millis() + u128::from(!due.subsec_nanos().is_multiple_of(1_000_000));
                // A policy that retries has a retry topic for each of its delays.
                let topic = self.settling.retry.topic(*after);
                let topic = topic.ok_or(BrokerError::Refused { what: "retry" })?;
                self.publish(
                    "retry",
                    topic,
                    &[
                        (ATTEMPT_HEADER, attempt.to_string()),
                        (DUE_HEADER, due.to_string()),
                        (TOPIC_HEADER, self.source()),
                    ],
                )
                .await?;
            }
            Route::DeadLetter { .. } => return self.dead_letter(route).await,
        }
        self.done();
        Ok(())
    }

    fn parked(&self) -> bool {
        self.parked.load(Ordering::Relaxed)
    }

    async fn release(self, after: Duration) {
        let due = tokio::time::Instant::now() + after;
        self.settling.partitions().handed_back(self.lease, due);
        self.settling.wake.notify_one();
    }
}
