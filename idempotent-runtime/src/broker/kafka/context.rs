//! The consumer's callbacks: rebalances, which forget revoked partitions, and the client's errors,
//! which tell the runner its broker is away.

use std::sync::{Arc, Mutex};

use rdkafka::TopicPartitionList;
use rdkafka::client::ClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer as _, ConsumerContext, Rebalance};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;
use tokio::sync::Notify;

use super::super::outage::Outage;
use super::partitions::{Partitions, TopicPartition};

/// The runner consumer's context.
pub(crate) struct RunnerContext {
    pub(super) partitions: Arc<Mutex<Partitions>>,
    pub(super) wake: Arc<Notify>,
    pub(super) outage: Mutex<Outage>,
}

impl RunnerContext {
    /// Notes that the broker answers again.
    pub(super) fn restored(&self) {
        self.outage().restored();
    }

    /// Notes that the broker failed with `error`: said once at `warn` until it answers again.
    pub(super) fn failed(&self, error: &(dyn std::error::Error + 'static)) {
        self.outage().failed(error);
    }

    fn outage(&self) -> std::sync::MutexGuard<'_, Outage> {
        self.outage.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl ClientContext for RunnerContext {
    fn error(&self, error: KafkaError, reason: &str) {
        let away = matches!(
            error.rdkafka_error_code(),
            Some(
                RDKafkaErrorCode::BrokerTransportFailure
                    | RDKafkaErrorCode::AllBrokersDown
                    | RDKafkaErrorCode::Resolve
                    | RDKafkaErrorCode::BrokerNotAvailable
            )
        );
        if away {
            self.failed(&std::io::Error::other(format!("{error}: {reason}")));
        } else {
            tracing::warn!(%error, reason, "the Kafka client reported an error");
        }
    }
}

impl ConsumerContext for RunnerContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(revoked) = rebalance {
            let revoked: Vec<TopicPartition> = revoked
                .elements()
                .iter()
                .map(|element| TopicPartition {
                    topic: element.topic().into(),
                    partition: element.partition(),
                })
                .collect();
            tracing::info!(
                partitions = revoked.len(),
                "partitions revoked; what they held is dropped"
            );
            let paused = self
                .partitions
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .revoked(&revoked);
            // Fetched again when assigned again, to this consumer or another.
            let mut resume = TopicPartitionList::new();
            for partition in &paused {
                resume.add_partition(&partition.topic, partition.partition);
            }
            if resume.count() > 0 {
                let _ = consumer.resume(&resume);
            }
            self.wake.notify_one();
        }
    }
}
