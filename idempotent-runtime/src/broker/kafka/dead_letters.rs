//! A Kafka dead-letter topic as an operator reads it, and putting its records back on the topics
//! they came from. Kafka deletes no record: what was put back is noted on a topic of its own.

use std::collections::HashSet;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rdkafka::message::{Header, Headers as _, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Message as _};

use super::reading::{ANSWER_WITHIN, Reader, partitions, read};
use super::{
    ATTEMPTS_HEADER, MESSAGE_ID_HEADER, REASON_HEADER, TOPIC_HEADER, producer_config, topics,
};
use super::{delivery::header, produce};
use crate::broker::dead_letters::{DeadLetter, DeadLetterFilter};
use crate::broker::error::BrokerError;

/// The header, on the topic of what was put back, that names where a dead letter went.
const REDRIVEN_TO_HEADER: &str = "idempotent-redriven-to";

/// A Kafka dead-letter topic (the runner's `dead_letters`): its dead letters listed, and put back
/// on the topics they came from (the `idempotent dlq` command's Kafka side).
///
/// A listing reads the whole topic, every partition from its first record to its last, with a
/// consumer of its own that joins no group and commits nothing: the runners do not notice. A dead
/// letter's id is `<partition>:<offset>`, its age the record's timestamp (when the runner produced
/// it).
///
/// Kafka deletes no record, so a redrive notes each dead letter it put back on a topic of its own,
/// `<topic>.redriven` (a record keyed by the dead letter's id, made on the first redrive), and a
/// listing leaves out the dead letters noted there. A redrive produces each dead letter it takes
/// to the topic in its [`TOPIC_HEADER`], with its key (so the same partitioner sends it to the
/// same partition) and its headers less the runner's `idempotent-*` ([`MESSAGE_ID_HEADER`] kept,
/// so the consumer's inbox drops it if it was processed after all; the attempts start again at 1),
/// waits for every in-sync replica to have it (`acks=all`), and only then notes it. A source topic
/// the cluster does not have (a redrive never makes one) or a record the broker refuses stops the
/// redrive with [`BrokerError::DeadLetterTarget`], the dead letter kept. A note that fails after
/// the copy was produced stops the redrive with the error and leaves the dead letter listed beside
/// its copy: a second redrive puts it back again, and the inbox drops that copy.
#[derive(Clone)]
pub struct DeadLetterQueue {
    client: ClientConfig,
    topic: String,
    message_id_header: String,
}

impl std::fmt::Debug for DeadLetterQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeadLetterQueue")
            .field("topic", &self.topic)
            .finish_non_exhaustive()
    }
}

/// A dead letter as read, with its record.
type Read = (OwnedMessage, DeadLetter);

impl DeadLetterQueue {
    /// Returns the dead-letter topic `topic` of the cluster `client` connects to
    /// (`bootstrap.servers` at least).
    pub fn new(client: ClientConfig, topic: impl Into<String>) -> Self {
        Self {
            client,
            topic: topic.into(),
            message_id_header: MESSAGE_ID_HEADER.to_owned(),
        }
    }

    /// Reads the message id from header `name` (default [`MESSAGE_ID_HEADER`]), as the runner
    /// that dead-lettered them was told with [`Runner::message_id_header`](super::Runner::message_id_header).
    pub fn message_id_header(mut self, name: impl Into<String>) -> Self {
        self.message_id_header = name.into();
        self
    }

    /// Returns the topic's name.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// Returns the topic that notes what was put back: `<topic>.redriven`.
    pub fn redriven_topic(&self) -> String {
        format!("{}.redriven", self.topic)
    }

    /// Returns the dead letters `filter` takes, oldest first.
    pub async fn list(&self, filter: &DeadLetterFilter) -> Result<Vec<DeadLetter>, BrokerError> {
        let (read, _) = self.read_all().await?;
        Ok(filter
            .pick(&read, SystemTime::now())
            .map(|(_, letter)| letter.clone())
            .collect())
    }

    /// Puts the dead letters `filter` takes back on the topics they came from (with `dry_run`, only
    /// says which it would), oldest first; returns them. A failure to put one back stops the
    /// redrive there: those before it are back on their topics, the rest stay.
    pub async fn redrive(
        &self,
        filter: &DeadLetterFilter,
        dry_run: bool,
    ) -> Result<Vec<DeadLetter>, BrokerError> {
        let (read, reader) = self.read_all().await?;
        let picked: Vec<&Read> = filter
            .pick(&read, SystemTime::now())
            .filter(|(_, letter)| letter.source.is_some())
            .collect();
        if dry_run || picked.is_empty() {
            return Ok(picked
                .into_iter()
                .map(|(_, letter)| letter.clone())
                .collect());
        }
        let producer: FutureProducer = producer_config(&self.client, ANSWER_WITHIN)
            .create()
            .map_err(BrokerError::broker)?;
        let redriven = self.redriven_topic();
        let mut noting = false;
        let mut present = HashSet::new();
        let mut moved = Vec::new();
        for (record, letter) in picked {
            let source = letter.source.as_deref().unwrap_or_default();
            if !present.contains(source) {
                if partitions(&reader, source).await?.is_none() {
                    return Err(BrokerError::DeadLetterTarget {
                        target: source.to_owned(),
                        reason: "the cluster has no such topic (a redrive makes none)".into(),
                    });
                }
                present.insert(source.to_owned());
            }
            if !noting {
                self.make_redriven(&producer).await?;
                noting = true;
            }
            let mut headers = OwnedHeaders::new();
            for header in record.headers().into_iter().flat_map(|h| h.iter()) {
                if !header.key.to_ascii_lowercase().starts_with("idempotent-") {
                    headers = headers.insert(header);
                }
            }
            let mut copy = FutureRecord::<[u8], [u8]>::to(source).headers(headers);
            if let Some(payload) = record.payload() {
                copy = copy.payload(payload);
            }
            if let Some(key) = record.key() {
                copy = copy.key(key);
            }
            produce(
                &producer,
                copy,
                "dead letter's copy",
                ANSWER_WITHIN,
                |error| BrokerError::DeadLetterTarget {
                    target: source.to_owned(),
                    reason: format!("the broker refused the copy: {error}"),
                },
            )
            .await?;
            let note = FutureRecord::<[u8], [u8]>::to(&redriven)
                .key(letter.id.as_bytes())
                .headers(OwnedHeaders::new().insert(Header {
                    key: REDRIVEN_TO_HEADER,
                    value: Some(source.as_bytes()),
                }));
            produce(
                &producer,
                note,
                "note of a redrive",
                ANSWER_WITHIN,
                |error| BrokerError::DeadLetterTarget {
                    target: redriven.clone(),
                    reason: format!("the broker refused the note: {error}"),
                },
            )
            .await?;
            moved.push(letter.clone());
        }
        Ok(moved)
    }

    /// Makes the topic that notes what was put back, where it is missing: one partition, by the
    /// broker's auto-creation or with `CreateTopics`.
    async fn make_redriven(&self, producer: &FutureProducer) -> Result<(), BrokerError> {
        let redriven = self.redriven_topic();
        let (existing, brokers) = topics::metadata(producer, Some(&redriven)).await?;
        if existing.contains_key(&redriven) {
            return Ok(());
        }
        match topics::make(&self.client, producer, &[&redriven], 1, brokers, &[])
            .await
            .pop()
        {
            None => Ok(()),
            Some((_, reason)) => Err(BrokerError::DeadLetterTarget {
                target: redriven.clone(),
                reason: format!("the topic that notes what was put back cannot be made: {reason}"),
            }),
        }
    }

    /// Reads the dead letters not yet put back, oldest first, with the reader that read them.
    async fn read_all(&self) -> Result<(Vec<Read>, Reader), BrokerError> {
        let reader = Reader::new(&self.client, format!("{}.reader", self.topic))?;
        let Some(records) = read(&reader, &self.topic).await? else {
            return Err(BrokerError::DeadLetterTarget {
                target: self.topic.clone(),
                reason: "the cluster has no such topic".into(),
            });
        };
        let noted: HashSet<String> = read(&reader, &self.redriven_topic())
            .await?
            .unwrap_or_default()
            .iter()
            .filter_map(|note| note.key())
            .map(|key| String::from_utf8_lossy(key).into_owned())
            .collect();
        let mut read: Vec<Read> = records
            .into_iter()
            .map(|record| {
                let letter = letter_of(&record, &self.message_id_header);
                (record, letter)
            })
            .filter(|(_, letter)| !noted.contains(&letter.id))
            .collect();
        read.sort_by_key(|(record, letter)| {
            (letter.dead_lettered_at, record.partition(), record.offset())
        });
        Ok((read, reader))
    }
}

/// What the runner wrote on the dead letter `record`.
fn letter_of(record: &OwnedMessage, message_id_header: &str) -> DeadLetter {
    let text = |name: &str| {
        header(record, name)
            .filter(|value| !value.is_empty())
            .map(str::to_owned)
    };
    let headers = record
        .headers()
        .into_iter()
        .flat_map(|headers| headers.iter())
        .map(|header| {
            let value = header
                .value
                .map(String::from_utf8_lossy)
                .unwrap_or_default();
            (header.key.to_owned(), value.into_owned())
        })
        .collect();
    DeadLetter {
        id: format!("{}:{}", record.partition(), record.offset()),
        message_id: text(message_id_header),
        reason: text(REASON_HEADER),
        attempts: text(ATTEMPTS_HEADER).and_then(|n| n.parse().ok()),
        source: text(TOPIC_HEADER),
        dead_lettered_at: record
            .timestamp()
            .to_millis()
            .and_then(|ms| u64::try_from(ms).ok())
            .map(|ms| UNIX_EPOCH + Duration::from_millis(ms)),
        headers,
        payload: record.payload().unwrap_or_default().to_vec(),
    }
}
