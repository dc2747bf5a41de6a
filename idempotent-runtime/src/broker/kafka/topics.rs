//! The runner's own topics: one retry topic per delay of its policy, and the dead-letter topic,
//! made at start when they are missing.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::producer::FutureProducer;
use rdkafka::types::RDKafkaErrorCode;

use super::super::error::BrokerError;
use super::super::outage::Outage;
use super::super::retry::RetryPolicy;
use tokio_util::sync::CancellationToken as Shutdown;

/// The retry topics of a runner: `<prefix>.<delay>ms`, one per delay its policy waits, so that
/// every record of one retry topic waits the same time and they come due in their order.
#[derive(Debug, Clone, Default)]
pub(super) struct RetryTopics {
    /// The delays, shortest first.
    delays: Vec<Duration>,
    /// Their topics, in the same order.
    names: Vec<String>,
}

impl RetryTopics {
    pub(super) fn new(prefix: String, policy: &RetryPolicy) -> Self {
        let mut delays = BTreeSet::new();
        let mut attempt = 1;
        // Delays never shrink and stop growing at the longest: the first repeat ends the list.
        while attempt < policy.max_attempts {
            let delay = policy.delay_after(attempt);
            if !delays.insert(delay) {
                break;
            }
            attempt += 1;
        }
        let delays: Vec<Duration> = delays.into_iter().collect();
        let names = delays
            .iter()
            .map(|delay| format!("{prefix}.{}ms", delay.as_millis()))
            .collect();
        Self { delays, names }
    }

    /// The topic of a retry that waits `after`: the first whose delay is as long, or the last.
    /// `None` when the policy has no retries.
    pub(super) fn topic(&self, after: Duration) -> Option<&str> {
        let index = self.delays.iter().position(|delay| *delay >= after);
        let name = match index {
            Some(index) => self.names.get(index),
            None => self.names.last(),
        };
        name.map(String::as_str)
    }

    /// The retry topics.
    pub(super) fn names(&self) -> &[String] {
        &self.names
    }

    /// Whether `topic` is one of them.
    pub(super) fn contains(&self, topic: &str) -> bool {
        self.names.iter().any(|name| name == topic)
    }
}

/// How long one metadata request or topic creation may take.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Makes the `retry` topics and the `dead_letters` topic where they are missing, with as many
/// partitions as the largest of `sources`. A broker that does not answer is waited for (until
/// `shutdown`); a broker that has no `CreateTopics` makes them by asking for their metadata (its
/// auto-creation). [`BrokerError::DeadLetterTarget`] when the dead-letter topic cannot be made.
pub(super) async fn ensure(
    client: &ClientConfig,
    producer: &FutureProducer,
    sources: &[String],
    retry: &[String],
    dead_letters: &str,
    shutdown: &Shutdown,
) -> Result<(), BrokerError> {
    let mut outage = Outage::new("kafka", dead_letters.to_owned(), None);
    let (existing, brokers) = loop {
        match metadata(producer, None).await {
            Ok(found) => break found,
            Err(error) => {
                let after = outage.failed(&error);
                tokio::select! {
                    () = tokio::time::sleep(after) => {}
                    () = shutdown.cancelled() => return Ok(()),
                }
            }
        }
    };
    outage.restored();
    let partitions = sources
        .iter()
        .filter_map(|topic| existing.get(topic).copied())
        .max()
        .unwrap_or(1)
        .max(1);
    let missing: Vec<&str> = retry
        .iter()
        .map(String::as_str)
        .chain([dead_letters])
        .filter(|topic| !existing.contains_key(*topic))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let still_missing = make(client, producer, &missing, partitions, brokers, &[]).await;
    if let Some((topic, refusal)) = still_missing.into_iter().next() {
        let reason = format!("the topic is missing and could not be made: {refusal}");
        return Err(if topic == dead_letters {
            BrokerError::DeadLetterTarget {
                target: topic.to_owned(),
                reason,
            }
        } else {
            BrokerError::broker(std::io::Error::other(format!(
                "retry topic {topic}: {reason}"
            )))
        });
    }
    Ok(())
}

/// Makes `topics` of `partitions` partitions, replicated on up to three of the cluster's `brokers`,
/// with the topic settings `config`: with `CreateTopics`, or else by asking for their metadata (the broker's auto-creation, for a
/// broker without `CreateTopics` or one that refused it to this client). Returns those still
/// missing, with why.
pub(super) async fn make<'a>(
    client: &ClientConfig,
    producer: &FutureProducer,
    topics: &[&'a str],
    partitions: usize,
    brokers: usize,
    config: &[(&str, &str)],
) -> Vec<(&'a str, String)> {
    let replication = i32::try_from(brokers.clamp(1, 3)).unwrap_or(1);
    let mut missing = Vec::new();
    for (topic, refusal) in create(client, topics, partitions, replication, config).await {
        let made = metadata(producer, Some(topic))
            .await
            .is_ok_and(|(existing, _)| existing.contains_key(topic));
        if !made {
            missing.push((topic, refusal));
        }
    }
    missing
}

/// The topics the cluster has with their partition counts, and how many brokers it has.
pub(super) async fn metadata(
    producer: &FutureProducer,
    topic: Option<&str>,
) -> Result<(BTreeMap<String, usize>, usize), BrokerError> {
    let producer = producer.clone();
    let topic = topic.map(str::to_owned);
    tokio::task::spawn_blocking(move || {
        use rdkafka::producer::Producer as _;
        let metadata = producer
            .client()
            .fetch_metadata(topic.as_deref(), ADMIN_TIMEOUT)
            .map_err(BrokerError::broker)?;
        let existing = metadata
            .topics()
            .iter()
            .filter(|topic| topic.error().is_none() && !topic.partitions().is_empty())
            .map(|topic| (topic.name().to_owned(), topic.partitions().len()))
            .collect();
        Ok((existing, metadata.brokers().len()))
    })
    .await
    .map_err(BrokerError::broker)?
}

/// Creates `topics`; returns those it could not create, with why.
async fn create<'a>(
    client: &ClientConfig,
    topics: &[&'a str],
    partitions: usize,
    replication: i32,
    config: &[(&str, &str)],
) -> Vec<(&'a str, String)> {
    let admin: AdminClient<DefaultClientContext> = match client.create() {
        Ok(admin) => admin,
        Err(error) => return topics.iter().map(|t| (*t, error.to_string())).collect(),
    };
    let partitions = i32::try_from(partitions).unwrap_or(i32::MAX);
    let new: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|topic| {
            let new = NewTopic::new(topic, partitions, TopicReplication::Fixed(replication));
            config
                .iter()
                .fold(new, |new, (name, value)| new.set(name, value))
        })
        .collect();
    let options = AdminOptions::new()
        .operation_timeout(Some(ADMIN_TIMEOUT))
        .request_timeout(Some(ADMIN_TIMEOUT));
    match admin.create_topics(&new, &options).await {
        Err(error) => topics.iter().map(|t| (*t, error.to_string())).collect(),
        Ok(results) => topics
            .iter()
            .zip(results)
            .filter_map(|(topic, result)| match result {
                Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => None,
                Err((_, code)) => Some((*topic, code.to_string())),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_topic_per_delay_the_longest_shared() {
        let policy = RetryPolicy::new(10, Duration::from_secs(1)).max_delay(Duration::from_secs(4));
        let topics = RetryTopics::new("ledger.retry".into(), &policy);
        assert_eq!(
            topics.names(),
            [
                "ledger.retry.1000ms",
                "ledger.retry.2000ms",
                "ledger.retry.4000ms"
            ]
        );
        assert_eq!(
            topics.topic(policy.delay_after(9)),
            Some("ledger.retry.4000ms")
        );
        assert!(topics.contains("ledger.retry.2000ms") && !topics.contains("ledger"));
        let once = RetryTopics::new("x".into(), &RetryPolicy::new(1, Duration::from_secs(1)));
        assert!(once.names().is_empty(), "one attempt: no retries");
        let many = RetryPolicy::new(u32::MAX, Duration::from_millis(1)).multiplier(1.0);
        assert_eq!(RetryTopics::new("x".into(), &many).names(), ["x.1ms"]);
    }
}
