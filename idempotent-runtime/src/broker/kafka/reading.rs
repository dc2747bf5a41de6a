//! Reading whole topics with a consumer that joins no group and commits nothing: how the operator's
//! side (dead letters, held partitions) reads what the runners wrote.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::OwnedMessage;
use rdkafka::{ClientConfig, Message as _, Offset, TopicPartitionList};

use crate::broker::error::BrokerError;

/// The most records one reading takes.
const MOST_READ: usize = 100_000;
/// How long one request to the cluster may take.
pub(super) const ANSWER_WITHIN: Duration = Duration::from_secs(10);
/// How long reading a whole topic may take.
const READ_WITHIN: Duration = Duration::from_secs(60);

/// A consumer that reads topics by assigning their partitions itself.
#[derive(Clone)]
pub(super) struct Reader(std::sync::Arc<BaseConsumer>);

impl Reader {
    /// A reader of the cluster `client` connects to, under the group id `group` (which it never
    /// joins: it assigns partitions itself and commits nothing).
    pub(super) fn new(client: &ClientConfig, group: String) -> Result<Self, BrokerError> {
        let mut config = client.clone();
        config
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "false")
            .set("allow.auto.create.topics", "false");
        Ok(Self(std::sync::Arc::new(
            config.create().map_err(BrokerError::broker)?,
        )))
    }
}

/// The partitions of `topic`; `None` when the cluster has no such topic.
pub(super) async fn partitions(
    reader: &Reader,
    topic: &str,
) -> Result<Option<Vec<i32>>, BrokerError> {
    let (reader, topic) = (reader.clone(), topic.to_owned());
    blocking(move || {
        let metadata = reader
            .0
            .fetch_metadata(Some(&topic), ANSWER_WITHIN)
            .map_err(BrokerError::broker)?;
        let found = metadata
            .topics()
            .iter()
            .find(|found| found.name() == topic && found.error().is_none())
            .filter(|found| !found.partitions().is_empty());
        Ok(found.map(|found| found.partitions().iter().map(|p| p.id()).collect()))
    })
    .await
}

/// Every record of `topic`, up to [`MOST_READ`]; `None` when the cluster has no such topic.
pub(super) async fn read(
    reader: &Reader,
    topic: &str,
) -> Result<Option<Vec<OwnedMessage>>, BrokerError> {
    let Some(partitions) = partitions(reader, topic).await? else {
        return Ok(None);
    };
    let (reader, topic) = (reader.clone(), topic.to_owned());
    blocking(move || {
        let mut assigned = TopicPartitionList::new();
        // Where each partition's reading is, and where it ends.
        let mut next: HashMap<i32, (i64, i64)> = HashMap::new();
        for partition in partitions {
            let (low, high) = reader
                .0
                .fetch_watermarks(&topic, partition, ANSWER_WITHIN)
                .map_err(BrokerError::broker)?;
            if high > low {
                assigned
                    .add_partition_offset(&topic, partition, Offset::Offset(low))
                    .map_err(BrokerError::broker)?;
                next.insert(partition, (low, high));
            }
        }
        let mut records = Vec::new();
        if next.is_empty() {
            return Ok(Some(records));
        }
        reader.0.assign(&assigned).map_err(BrokerError::broker)?;
        let started = Instant::now();
        while next.values().any(|(at, end)| at < end) && records.len() < MOST_READ {
            if started.elapsed() > READ_WITHIN {
                return Err(BrokerError::Timeout {
                    what: "the reading of a dead-letter topic",
                    after: READ_WITHIN,
                });
            }
            match reader.0.poll(Duration::from_millis(500)) {
                Some(Ok(record)) => {
                    if let Some((at, end)) = next.get_mut(&record.partition())
                        && record.offset() < *end
                    {
                        *at = (*at).max(record.offset() + 1);
                        records.push(record.detach());
                    }
                }
                Some(Err(error)) => return Err(BrokerError::broker(error)),
                // Past offsets that hold no record (a transaction's markers): the position says.
                None => {
                    let position = reader.0.position().map_err(BrokerError::broker)?;
                    for element in position.elements() {
                        if let (Some((at, _)), Offset::Offset(offset)) =
                            (next.get_mut(&element.partition()), element.offset())
                        {
                            *at = (*at).max(offset);
                        }
                    }
                }
            }
        }
        reader.0.unassign().map_err(BrokerError::broker)?;
        Ok(Some(records))
    })
    .await
}

/// Runs the client's blocking `work` off the runtime's threads.
pub(super) async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, BrokerError> + Send + 'static,
) -> Result<T, BrokerError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(BrokerError::broker)?
}
