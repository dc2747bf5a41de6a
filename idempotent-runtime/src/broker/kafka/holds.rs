//! Partitions held at a record that failed, for an operator: the runner's side (it parks the record,
//! says so on the group's holds topic, and follows that topic for the operator's retry or skip) and
//! the operator's ([`HeldPartitions`], the `idempotent kafka` command's side).
//!
//! The holds topic, `<group>.holds`, has one partition and is compacted (its records go to
//! partition 0 whatever it has). Its records, each keyed so
//! that compaction keeps the last of each:
//! - `held:<topic>:<partition>`: a runner parked the record at [`OFFSET_HEADER`] of that
//!   partition, with [`HOLD_HEADER`] (the hold's id), the reason and attempts, and its message id.
//!   A tombstone (no payload) under the same key: the hold ended (retried, or skipped).
//! - `command:<topic>:<partition>`: an operator's [`COMMAND_HEADER`] (`retry` or `skip`) for the
//!   hold [`HOLD_HEADER`] names, with the operator's reason for a skip.
//!
//! Whoever may write the holds topic steers the holds (a forged `held:` record hides or fakes one,
//! the newest record of a key wins): give write access to it as to the group's own topics.
//!
//! A retry applies to the hold it names only: a partition that was revoked and parked again by its
//! new owner (a new id) is not retried by a command meant for the old hold. A skip applies to the
//! record the hold parked (its partition and offset), also when it is parked again later: a runner
//! that reads the skip before the record fails again dead-letters it at once with the operator's
//! reason.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::message::{Header, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Message as _, Offset, TopicPartitionList};

use super::delivery::{KafkaDelivery, Settling, header};
use super::partitions::TopicPartition;
use super::reading::{ANSWER_WITHIN, Reader, blocking, read};
use super::{
    ATTEMPTS_HEADER, MESSAGE_ID_HEADER, OFFSET_HEADER, PARTITION_HEADER, REASON_HEADER,
    TOPIC_HEADER, produce, producer_config, topics,
};
use crate::broker::backoff::Backoff;
use crate::broker::error::BrokerError;
use crate::broker::route::Route;
use tokio_util::sync::CancellationToken as Shutdown;

/// The header, on the holds topic, that carries a hold's id.
pub const HOLD_HEADER: &str = "idempotent-hold";
/// The header, on the holds topic, that carries an operator's command: `retry` or `skip`.
pub const COMMAND_HEADER: &str = "idempotent-command";

/// The holds topic of consumer group `group`: `<group>.holds`.
pub fn holds_topic(group: &str) -> String {
    format!("{group}.holds")
}

/// A partition held at a record that failed, as its runner announced it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct HeldPartition {
    /// The topic.
    pub topic: String,
    /// The partition.
    pub partition: i32,
    /// The offset of the record it is held at.
    pub offset: i64,
    /// The record's message id, if it had one.
    pub message_id: Option<String>,
    /// Why the record failed.
    pub reason: String,
    /// The attempts it had.
    pub attempts: u32,
    /// When the runner parked it.
    pub held_since: Option<SystemTime>,
    /// The hold's id: a record parked again (after a restart, or by another runner) is a new hold.
    pub hold: String,
    /// What an operator asked for this hold that its runner has not done yet (a runner that is not
    /// running does it once it runs).
    pub asked: Option<Asked>,
}

/// An operator's command for a held partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Asked {
    /// Run the record again now (the attempt after its last); held again if it fails again.
    Retry,
    /// Dead-letter the record with the operator's reason, and go on with the partition.
    Skip {
        /// The operator's reason, on the dead letter.
        reason: String,
    },
}

/// What one record of the holds topic says.
#[derive(Debug, PartialEq)]
enum Said {
    Held(HeldPartition),
    Released(String, i32),
    Command(String, i32, String, Asked),
}

fn held_key(topic: &str, partition: i32) -> String {
    format!("held:{topic}:{partition}")
}

fn command_key(topic: &str, partition: i32) -> String {
    format!("command:{topic}:{partition}")
}

/// What `record` of the holds topic says; `None` for a record this module did not write.
fn said(record: &OwnedMessage) -> Option<Said> {
    let key = std::str::from_utf8(record.key()?).ok()?;
    let (kind, rest) = key.split_once(':')?;
    let (topic, partition) = rest.rsplit_once(':')?;
    let (topic, partition) = (topic.to_owned(), partition.parse().ok()?);
    let text = |name| header(record, name).map(str::to_owned);
    match kind {
        "held" if record.payload().is_none() => Some(Said::Released(topic, partition)),
        "held" => Some(Said::Held(HeldPartition {
            topic,
            partition,
            offset: text(OFFSET_HEADER)?.parse().ok()?,
            message_id: text(MESSAGE_ID_HEADER),
            reason: text(REASON_HEADER).unwrap_or_default(),
            attempts: text(ATTEMPTS_HEADER)
                .and_then(|n| n.parse().ok())
                .unwrap_or_default(),
            held_since: record
                .timestamp()
                .to_millis()
                .and_then(|ms| u64::try_from(ms).ok())
                .map(|ms| UNIX_EPOCH + Duration::from_millis(ms)),
            hold: text(HOLD_HEADER)?,
            asked: None,
        })),
        "command" => {
            let hold = text(HOLD_HEADER)?;
            let asked = match text(COMMAND_HEADER)?.as_str() {
                "retry" => Asked::Retry,
                "skip" => Asked::Skip {
                    reason: text(REASON_HEADER).unwrap_or_default(),
                },
                _ => return None,
            };
            Some(Said::Command(topic, partition, hold, asked))
        }
        _ => None,
    }
}

/// A record for the holds topic: `key`, `headers`, and a payload (none: a tombstone).
fn record<'a>(
    topic: &'a str,
    key: &'a str,
    headers: &'a [(&'a str, String)],
    payload: Option<&'a [u8]>,
) -> FutureRecord<'a, [u8], [u8]> {
    let mut owned = OwnedHeaders::new();
    for (name, value) in headers {
        owned = owned.insert(Header {
            key: name,
            value: Some(value.as_bytes()),
        });
    }
    // Partition 0 always, whatever the topic has (a broker's auto-creation may make more): the
    // records of the topic are read in the order they were written.
    let mut out = FutureRecord::<[u8], [u8]>::to(topic)
        .partition(0)
        .key(key.as_bytes())
        .headers(owned);
    if let Some(payload) = payload {
        out = out.payload(payload);
    }
    out
}

/// The partitions a consumer group's runners hold, as an operator sees and steers them (the
/// `idempotent kafka` command's side of [`Runner::hold_partition_on_failure`](super::Runner::hold_partition_on_failure)).
///
/// [`list`](Self::list) reads the group's holds topic whole, with a consumer of its own that joins
/// no group and commits nothing, and leaves out holds the group has committed past (a record that
/// succeeded after a restart). [`retry`](Self::retry) and [`skip`](Self::skip) write a command for
/// the partition's current hold on that topic; the runner that holds it follows the topic and acts
/// on it within moments, or, when none runs, the next one does.
#[derive(Clone)]
pub struct HeldPartitions {
    client: ClientConfig,
    group: String,
}

impl std::fmt::Debug for HeldPartitions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeldPartitions")
            .field("group", &self.group)
            .finish_non_exhaustive()
    }
}

impl HeldPartitions {
    /// Returns the held partitions of consumer group `group`, in the cluster `client` connects to
    /// (`bootstrap.servers` at least).
    pub fn new(client: ClientConfig, group: impl Into<String>) -> Self {
        Self {
            client,
            group: group.into(),
        }
    }

    /// Returns the group's holds topic, `<group>.holds`.
    pub fn topic(&self) -> String {
        holds_topic(&self.group)
    }

    /// Returns the partitions held now, by topic and partition. [`BrokerError::NotHeld`] when the
    /// cluster has no holds topic for the group (no runner of it holds partitions on failure).
    pub async fn list(&self) -> Result<Vec<HeldPartition>, BrokerError> {
        let topic = self.topic();
        let reader = Reader::new(&self.client, format!("{topic}.reader"))?;
        let Some(records) = read(&reader, &topic).await? else {
            return Err(BrokerError::NotHeld {
                reason: format!(
                    "the cluster has no topic {topic}: no runner of group {} holds partitions on failure",
                    self.group
                ),
            });
        };
        let mut held: BTreeMap<(String, i32), HeldPartition> = BTreeMap::new();
        for record in &records {
            match said(record) {
                Some(Said::Held(hold)) => {
                    held.insert((hold.topic.clone(), hold.partition), hold);
                }
                Some(Said::Released(topic, partition)) => {
                    held.remove(&(topic, partition));
                }
                Some(Said::Command(topic, partition, id, asked)) => {
                    if let Some(hold) = held.get_mut(&(topic, partition))
                        && hold.hold == id
                    {
                        hold.asked = Some(asked);
                    }
                }
                None => {}
            }
        }
        if held.is_empty() {
            return Ok(Vec::new());
        }
        // A hold the group committed past is over (its record succeeded under a runner that did not
        // know of the hold): the committed offset never passes a parked record.
        let committed = self.committed(held.keys().cloned().collect()).await?;
        Ok(held
            .into_values()
            .filter(|hold| {
                committed
                    .get(&(hold.topic.clone(), hold.partition))
                    .is_none_or(|committed| *committed <= hold.offset)
            })
            .collect())
    }

    /// Asks the runner that holds `partition` of `topic` to run its record again now (the attempt
    /// after its last: held again if it fails again). Returns the hold. [`BrokerError::NotHeld`]
    /// when that partition is not held.
    pub async fn retry(&self, topic: &str, partition: i32) -> Result<HeldPartition, BrokerError> {
        self.ask(topic, partition, Asked::Retry).await
    }

    /// Asks the runner that holds `partition` of `topic` to dead-letter its record with `reason`
    /// (the dead letter's reason says an operator skipped it, and why it was held) and to go on with
    /// the partition. Returns the hold. [`BrokerError::NotHeld`] when that partition is not held.
    pub async fn skip(
        &self,
        topic: &str,
        partition: i32,
        reason: &str,
    ) -> Result<HeldPartition, BrokerError> {
        let reason = reason.to_owned();
        self.ask(topic, partition, Asked::Skip { reason }).await
    }

    async fn ask(
        &self,
        topic: &str,
        partition: i32,
        asked: Asked,
    ) -> Result<HeldPartition, BrokerError> {
        let mut hold = self
            .list()
            .await?
            .into_iter()
            .find(|hold| hold.topic == topic && hold.partition == partition)
            .ok_or_else(|| BrokerError::NotHeld {
                reason: format!("partition {partition} of {topic} is not held"),
            })?;
        let mut headers = vec![(HOLD_HEADER, hold.hold.clone())];
        let command = match &asked {
            Asked::Retry => "retry",
            Asked::Skip { reason } => {
                headers.push((REASON_HEADER, reason.clone()));
                "skip"
            }
        };
        headers.push((COMMAND_HEADER, command.to_owned()));
        let producer: FutureProducer = producer_config(&self.client, ANSWER_WITHIN)
            .create()
            .map_err(BrokerError::broker)?;
        let holds = self.topic();
        let key = command_key(topic, partition);
        let out = record(&holds, &key, &headers, Some(command.as_bytes()));
        produce(&producer, out, "command", ANSWER_WITHIN, |error| {
            BrokerError::broker(std::io::Error::other(format!(
                "the broker refused the command: {error}"
            )))
        })
        .await?;
        hold.asked = Some(asked);
        Ok(hold)
    }

    /// The offsets the group committed on `partitions`, where it committed one.
    async fn committed(
        &self,
        partitions: Vec<(String, i32)>,
    ) -> Result<HashMap<(String, i32), i64>, BrokerError> {
        let mut config = self.client.clone();
        // The group's own id, to read its offsets; it never subscribes, so it never joins.
        config
            .set("group.id", &self.group)
            .set("enable.auto.commit", "false");
        let consumer: rdkafka::consumer::BaseConsumer =
            config.create().map_err(BrokerError::broker)?;
        blocking(move || {
            let mut list = TopicPartitionList::new();
            for (topic, partition) in &partitions {
                list.add_partition(topic, *partition);
            }
            let committed = consumer
                .committed_offsets(list, ANSWER_WITHIN)
                .map_err(BrokerError::broker)?;
            Ok(committed
                .elements()
                .iter()
                .filter_map(|element| match element.offset() {
                    Offset::Offset(offset) => {
                        Some(((element.topic().to_owned(), element.partition()), offset))
                    }
                    _ => None,
                })
                .collect())
        })
        .await
    }
}

/// A record this runner parked.
#[derive(Debug, Clone)]
struct Parking {
    offset: i64,
    hold: String,
    reason: String,
    attempts: u32,
}

/// What the runner knows of the holds topic and of its own parked records.
#[derive(Debug, Default)]
struct View {
    /// The records this runner parked, by partition (the last parking of each).
    mine: HashMap<TopicPartition, Parking>,
    /// Every hold announced on the topic, by id: where a skip command points.
    announced: HashMap<String, (TopicPartition, i64)>,
    /// Records an operator skipped that this runner does not hold now: dead-lettered with the
    /// reason if they fail again.
    skips: HashMap<(TopicPartition, i64), String>,
}

/// The runner's side of its held partitions: it parks records and follows the operator's
/// commands.
pub(super) struct Holds {
    client: ClientConfig,
    topic: String,
    view: Mutex<View>,
}

impl Holds {
    /// Makes the holds topic of `group` where it is missing (one partition, compacted).
    pub(super) async fn start(
        client: &ClientConfig,
        producer: &FutureProducer,
        group: &str,
    ) -> Result<Self, BrokerError> {
        let topic = holds_topic(group);
        // The whole cluster's metadata: asked for by name, a missing topic would be auto-created,
        // with the broker's settings rather than these.
        let (existing, brokers) = topics::metadata(producer, None).await?;
        if !existing.contains_key(&topic) {
            let compacted = [("cleanup.policy", "compact")];
            let missing = topics::make(client, producer, &[&topic], 1, brokers, &compacted).await;
            if let Some((_, reason)) = missing.into_iter().next() {
                return Err(BrokerError::broker(std::io::Error::other(format!(
                    "the holds topic {topic} is missing and could not be made: {reason}"
                ))));
            }
        }
        Ok(Self {
            client: client.clone(),
            topic,
            view: Mutex::default(),
        })
    }

    fn view(&self) -> std::sync::MutexGuard<'_, View> {
        self.view.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The operator's reason, when the record at `offset` of `partition` was skipped.
    pub(super) fn skipped(&self, partition: &TopicPartition, offset: i64) -> Option<String> {
        self.view().skips.get(&(partition.clone(), offset)).cloned()
    }

    /// Parks `delivery`'s record, which failed for `reason` after `attempts`, and says so on the
    /// holds topic. The record is parked before it is announced, so that a command for the hold
    /// always finds it; an announcement the broker does not take un-parks it again (in flight, for
    /// the settler to hand back after a back-off), with the error.
    pub(super) async fn park(
        &self,
        delivery: &KafkaDelivery,
        reason: &str,
        attempts: u32,
    ) -> Result<(), BrokerError> {
        let lease = &delivery.lease;
        let settling = &delivery.settling;
        let offset = lease.record.offset();
        let hold = uuid::Uuid::new_v4().simple().to_string();
        let parking = Parking {
            offset,
            hold: hold.clone(),
            reason: reason.to_owned(),
            attempts,
        };
        self.view().mine.insert(lease.partition.clone(), parking);
        settling.partitions().park(lease.clone());
        let message_id = header(&lease.record, &settling.message_id_header)
            .unwrap_or_default()
            .to_owned();
        let headers = [
            (TOPIC_HEADER, lease.partition.topic.to_string()),
            (PARTITION_HEADER, lease.partition.partition.to_string()),
            (OFFSET_HEADER, offset.to_string()),
            (REASON_HEADER, reason.to_owned()),
            (ATTEMPTS_HEADER, attempts.to_string()),
            (HOLD_HEADER, hold),
            (MESSAGE_ID_HEADER, message_id),
        ];
        let key = held_key(&lease.partition.topic, lease.partition.partition);
        let out = record(&self.topic, &key, &headers, Some(b"held"));
        let after = settling.publish_timeout;
        let said = produce(&settling.producer, out, "hold", after, |error| {
            tracing::warn!(%error, topic = self.topic, "the broker refused a hold's announcement");
            BrokerError::Refused { what: "hold" }
        })
        .await;
        if said.is_err() {
            // Back in flight: the settler hands it back and it runs again after a back-off.
            settling.partitions().take_parked(&lease.partition, offset);
        }
        said
    }

    /// Says on the holds topic that `partition`'s hold ended (best effort: a listing also leaves
    /// out holds the group committed past).
    async fn release(&self, settling: &Settling, partition: &TopicPartition) {
        let key = held_key(&partition.topic, partition.partition);
        let out = record(&self.topic, &key, &[], None);
        let after = settling.publish_timeout;
        let said = produce(&settling.producer, out, "hold's end", after, |error| {
            BrokerError::broker(std::io::Error::other(error.to_string()))
        })
        .await;
        if let Err(error) = said {
            tracing::debug!(%error, "could not say that a hold ended");
        }
    }

    /// Follows the holds topic from its start until `shutdown`, acting on the commands for the
    /// records this runner parked.
    pub(super) async fn follow(self: Arc<Self>, settling: Arc<Settling>, shutdown: Shutdown) {
        let consumer = match self.follower() {
            Ok(consumer) => consumer,
            Err(error) => {
                tracing::error!(%error, topic = self.topic, "cannot follow the holds topic: operators' commands are not seen");
                return;
            }
        };
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        loop {
            let received = tokio::select! {
                () = shutdown.cancelled() => return,
                received = consumer.recv() => received.map(|record| record.detach()),
            };
            match received {
                Ok(record) => {
                    backoff.reset();
                    if let Some(said) = said(&record) {
                        self.heard(&settling, said).await;
                    }
                }
                Err(error) => {
                    tracing::debug!(%error, topic = self.topic, "reading the holds topic failed");
                    tokio::time::sleep(backoff.next()).await;
                }
            }
        }
    }

    fn follower(&self) -> Result<StreamConsumer, BrokerError> {
        let mut config = self.client.clone();
        config
            .set("group.id", format!("{}.follower", self.topic))
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "false")
            .set("fetch.wait.max.ms", "100");
        let consumer: StreamConsumer = config.create().map_err(BrokerError::broker)?;
        let mut assigned = TopicPartitionList::new();
        assigned
            .add_partition_offset(&self.topic, 0, Offset::Beginning)
            .map_err(BrokerError::broker)?;
        consumer.assign(&assigned).map_err(BrokerError::broker)?;
        Ok(consumer)
    }

    /// Acts on what one record of the holds topic says.
    async fn heard(&self, settling: &Arc<Settling>, said: Said) {
        match said {
            Said::Held(hold) => {
                let partition = TopicPartition {
                    topic: hold.topic.as_str().into(),
                    partition: hold.partition,
                };
                self.view()
                    .announced
                    .insert(hold.hold, (partition, hold.offset));
            }
            Said::Released(..) => {}
            Said::Command(topic, partition, hold, asked) => {
                let partition = TopicPartition {
                    topic: topic.as_str().into(),
                    partition,
                };
                match asked {
                    Asked::Retry => self.retry(settling, &partition, &hold).await,
                    Asked::Skip { reason } => {
                        self.skip(settling, partition, &hold, reason).await;
                    }
                }
            }
        }
    }

    /// Makes the record this runner parked under `hold` due now, as its next attempt.
    async fn retry(&self, settling: &Settling, partition: &TopicPartition, hold: &str) {
        let parking = self.view().mine.get(partition).cloned();
        let Some(parking) = parking.filter(|parking| parking.hold == hold) else {
            return;
        };
        if !settling.partitions().is_parked(partition, parking.offset) {
            return;
        }
        // The hold's end is said before the record runs again: said after, it could land after
        // the announcement of the record held again, and hide that hold from the operator.
        self.forget(partition, parking.offset);
        self.release(settling, partition).await;
        let next = parking.attempts.saturating_add(1);
        if settling
            .partitions()
            .unpark(partition, parking.offset, next)
        {
            tracing::info!(topic = %partition.topic, partition = partition.partition, offset = parking.offset, "an operator retries a held record");
            settling.wake.notify_one();
        }
    }

    /// Forgets this runner's parking of `partition` if it is the one at `offset` (a later record
    /// of the partition may be parked by now, and its parking stays).
    fn forget(&self, partition: &TopicPartition, offset: i64) {
        let mut view = self.view();
        if view
            .mine
            .get(partition)
            .is_some_and(|parking| parking.offset == offset)
        {
            view.mine.remove(partition);
        }
    }

    /// Dead-letters the record `hold` parked with the operator's `reason`, if this runner holds it
    /// now; otherwise remembers the skip, for when the record fails again here.
    async fn skip(
        &self,
        settling: &Arc<Settling>,
        partition: TopicPartition,
        hold: &str,
        reason: String,
    ) {
        let offset = {
            let view = self.view();
            let mine = view
                .mine
                .get(&partition)
                .filter(|parking| parking.hold == hold);
            match (mine, view.announced.get(hold)) {
                (Some(parking), _) => parking.offset,
                (None, Some((announced, offset))) if *announced == partition => *offset,
                // A hold never announced: nothing to skip.
                _ => return,
            }
        };
        let Some(lease) = settling.partitions().take_parked(&partition, offset) else {
            self.view()
                .skips
                .insert((partition.clone(), offset), reason);
            return;
        };
        // This runner's parking of that record (under this hold, or one made since).
        let (failure, attempts) = self
            .mine_at(&partition, offset)
            .map_or((String::new(), lease.attempt.unwrap_or(1)), |parking| {
                (parking.reason, parking.attempts)
            });
        tracing::info!(topic = %partition.topic, partition = partition.partition, offset, "an operator skips a held record");
        let delivery = KafkaDelivery::new(lease, settling.clone());
        let route = Route::DeadLetter {
            reason: skipped_reason(&reason, &failure),
            attempts,
        };
        match delivery.publish_dead_letter(&route).await {
            Ok(()) => {
                settling.counters.count(&route, false);
                // Forgotten, and its end said, before the partition goes on: after, a later record
                // of it parked meanwhile would lose its parking (no retry would find it) and its
                // announcement could land before this end (the listing would not show it).
                self.forget(&partition, offset);
                self.release(settling, &partition).await;
                delivery.done();
            }
            Err(error) => {
                // Parked again: the hold stays, and the operator can skip it again.
                tracing::warn!(%error, "could not dead-letter a skipped record; it stays held");
                self.view()
                    .skips
                    .insert((partition.clone(), offset), reason);
                settling.partitions().park(delivery.lease);
            }
        }
        settling.wake.notify_one();
    }

    fn mine_at(&self, partition: &TopicPartition, offset: i64) -> Option<Parking> {
        self.view()
            .mine
            .get(partition)
            .filter(|parking| parking.offset == offset)
            .cloned()
    }
}

/// The reason on a dead letter an operator skipped.
pub(super) fn skipped_reason(operator: &str, failure: &str) -> String {
    crate::broker::route::truncate_for_header(format!(
        "skipped by an operator: {operator} (held after: {failure})"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::Timestamp;

    fn control(key: &str, headers: &[(&str, &str)], payload: Option<&[u8]>) -> OwnedMessage {
        let mut owned = OwnedHeaders::new();
        for (name, value) in headers {
            owned = owned.insert(Header {
                key: name,
                value: Some(value.as_bytes()),
            });
        }
        OwnedMessage::new(
            payload.map(<[u8]>::to_vec),
            Some(key.as_bytes().to_vec()),
            "g.holds".into(),
            Timestamp::CreateTime(1_000),
            0,
            0,
            Some(owned),
        )
    }

    #[test]
    fn the_holds_topic_records_say_what_they_were_written_for() {
        let held = control(
            "held:orders.eu:3",
            &[
                (OFFSET_HEADER, "41"),
                (HOLD_HEADER, "h1"),
                (REASON_HEADER, "poison"),
                (ATTEMPTS_HEADER, "2"),
                (MESSAGE_ID_HEADER, "order-9"),
            ],
            Some(b"held"),
        );
        let Some(Said::Held(hold)) = said(&held) else {
            panic!("a hold: {:?}", said(&held))
        };
        assert_eq!(
            (
                hold.topic.as_str(),
                hold.partition,
                hold.offset,
                hold.attempts
            ),
            ("orders.eu", 3, 41, 2)
        );
        assert_eq!(hold.message_id.as_deref(), Some("order-9"));
        assert_eq!(
            said(&control("held:orders.eu:3", &[], None)),
            Some(Said::Released("orders.eu".into(), 3))
        );
        let skip = control(
            "command:orders.eu:3",
            &[
                (HOLD_HEADER, "h1"),
                (COMMAND_HEADER, "skip"),
                (REASON_HEADER, "bad data"),
            ],
            Some(b"skip"),
        );
        assert_eq!(
            said(&skip),
            Some(Said::Command(
                "orders.eu".into(),
                3,
                "h1".into(),
                Asked::Skip {
                    reason: "bad data".into()
                }
            ))
        );
        // What this module did not write is not read as anything.
        for key in ["other", "held:x", "held:x:y", "command:x:1", "nope:x:1"] {
            assert_eq!(said(&control(key, &[], Some(b"x"))), None, "{key}");
        }
        let unknown = control(
            "command:t:0",
            &[(HOLD_HEADER, "h"), (COMMAND_HEADER, "explode")],
            Some(b"x"),
        );
        assert_eq!(said(&unknown), None);
    }
}
