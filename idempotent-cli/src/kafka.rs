//! `idempotent kafka`: the partitions a Kafka consumer group's runners hold at a record that failed
//! (`Runner::hold_partition_on_failure`), listed, and each retried or skipped (feature `kafka`).

use clap::{Args, Subcommand};
use idempotent::broker::BrokerError;
use idempotent::broker::kafka::{ClientConfig, HeldPartitions};

use crate::Failure;
use crate::output::Output;

/// The consumer group whose held partitions to look at.
#[derive(Args, Debug)]
pub(crate) struct Group {
    /// The consumer group (the runner's `group`): its holds are on `<GROUP>.holds`.
    #[arg(long)]
    group: String,
    /// The Kafka cluster's bootstrap servers (host:port, comma-separated).
    #[arg(long, env = "KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    kafka_brokers: String,
    #[command(subcommand)]
    command: KafkaCommand,
}

#[derive(Subcommand, Debug)]
enum KafkaCommand {
    /// The partitions held now: the record each is held at, why, and what an operator asked.
    Held,
    /// Run a held partition's record again now (its next attempt; held again if it fails again).
    Retry {
        /// The topic.
        #[arg(long)]
        topic: String,
        /// The partition.
        #[arg(long)]
        partition: i32,
    },
    /// Dead-letter a held partition's record with a reason, and let the partition go on.
    Skip {
        /// The topic.
        #[arg(long)]
        topic: String,
        /// The partition.
        #[arg(long)]
        partition: i32,
        /// Why: on the dead letter, with why it was held.
        #[arg(long)]
        reason: String,
    },
}

/// Runs `idempotent kafka …`.
pub(crate) async fn run(group: Group, out: Output) -> Result<(), Failure> {
    let mut client = ClientConfig::new();
    client.set("bootstrap.servers", &group.kafka_brokers);
    let holds = HeldPartitions::new(client, &group.group);
    let done = match group.command {
        KafkaCommand::Held => holds.list().await.map(|held| out.held_partitions(&held)),
        KafkaCommand::Retry { topic, partition } => holds
            .retry(&topic, partition)
            .await
            .map(|hold| out.asked(&hold)),
        KafkaCommand::Skip {
            topic,
            partition,
            reason,
        } => holds
            .skip(&topic, partition, &reason)
            .await
            .map(|hold| out.asked(&hold)),
    };
    match done {
        Ok(()) => Ok(()),
        Err(BrokerError::NotHeld { reason }) => Err(Failure::NotFound(reason)),
        Err(error) => Err(error.into()),
    }
}
