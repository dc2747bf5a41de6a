//! Real brokers end to end: the producer and consumer examples as separate processes, on RabbitMQ,
//! on NATS JetStream, on SQS and on Kafka (the mock cluster of `support/kafka.rs`, in this test's
//! process, which the examples reach on loopback), and a consumer that is SIGKILLed after its
//! commit but before the runner's acknowledgement, again and again. Every effect happens once,
//! every copy the producer retried and every redelivery after a kill is a detected duplicate, and
//! nothing is left behind.
#![cfg(all(feature = "sqlite", feature = "rabbitmq", feature = "nats"))]

mod support;

use std::process::Stdio;
use std::time::Duration;

use support::example;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

/// How many payments, how many of them sent twice, and how many consumers are killed: 40, 8 and 4,
/// or `IDEMPOTENT_KILL_RUN="messages retries kills"` for a longer run (`"5000 1000 30"`).
#[derive(Clone, Copy)]
struct Run {
    messages: usize,
    retries: usize,
    kills: usize,
}

impl Run {
    fn from_env() -> Self {
        let Ok(run) = std::env::var("IDEMPOTENT_KILL_RUN") else {
            return Run {
                messages: 40,
                retries: 8,
                kills: 4,
            };
        };
        let numbers: Vec<usize> = run
            .split_whitespace()
            .map(|n| n.parse().expect("IDEMPOTENT_KILL_RUN: three numbers"))
            .collect();
        let [messages, retries, kills] = numbers[..] else {
            panic!("IDEMPOTENT_KILL_RUN is \"messages retries kills\", not {run:?}");
        };
        assert!(
            retries <= messages,
            "IDEMPOTENT_KILL_RUN: more retries than messages"
        );
        Run {
            messages,
            retries,
            kills,
        }
    }
}

fn env(name: &str) -> String {
    std::env::var(name)
        .unwrap_or_else(|_| panic!("{name} is not set: run the tests with scripts/test"))
}

/// What comes back after a consumer is killed.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Redelivery {
    /// The delivery it had not acknowledged, flagged as redelivered (RabbitMQ, JetStream, SQS).
    Flagged,
    /// Every record past its partition's committed offset, unflagged: Kafka commits the offsets
    /// the runner stored every `auto.commit.interval.ms`, so a kill may undo a few commits.
    FromCommittedOffset,
}

/// One broker's producer and consumer examples, on a destination of the test's own.
struct Broker {
    producer: &'static str,
    consumer: &'static str,
    /// `--queue name` or `--stream NAME`, and what else both examples take.
    destination: Vec<String>,
    url: (&'static str, String),
    redelivery: Redelivery,
    /// How long the last consumer waits with nothing to do before it ends.
    idle: &'static str,
}

impl Broker {
    fn command(&self, program: &str, database: &str, extra: &[&str]) -> Command {
        let mut command = Command::new(example(program));
        command
            .args(&self.destination)
            .args(extra)
            .env(self.url.0, &self.url.1)
            .env("DATABASE_URL", database)
            .stdout(Stdio::piped())
            .kill_on_drop(true);
        command
    }
}

/// Publishes `run.messages` payments (`run.retries` of them twice), runs consumers that each commit
/// three payments and are SIGKILLed before acknowledging the third, `run.kills` times, then one that runs
/// until the destination is idle; checks every line they printed and the ledger.
async fn killed_after_commit_before_ack(broker: Broker, run: Run, publications: usize) {
    let Run {
        messages,
        retries,
        kills,
    } = run;
    let dir = tempfile::tempdir().unwrap();
    let database = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let published = broker
        .command(
            broker.producer,
            &database,
            &["--messages", &messages.to_string()],
        )
        .args(["--retries", &retries.to_string()])
        .stdout(Stdio::null())
        .status()
        .await
        .unwrap();
    assert!(published.success());

    let mut lines = Vec::new();
    for _ in 0..kills {
        let mut child = broker
            .command(broker.consumer, &database, &["--pause-after-commit", "3"])
            .spawn()
            .unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap()).lines();
        let paused = tokio::time::timeout(Duration::from_secs(60), async {
            while let Some(line) = stdout.next_line().await.unwrap() {
                let paused = line.starts_with("PAUSED");
                lines.push(line);
                if paused {
                    return true;
                }
            }
            false
        })
        .await
        .expect("the consumer paused in time");
        assert!(paused, "the consumer exited before its pause: {lines:#?}");
        child.kill().await.unwrap(); // SIGKILL: no ack, no goodbye to the broker
    }
    let output = broker
        .command(
            broker.consumer,
            &database,
            &["--exit-when-idle", broker.idle],
        )
        .output()
        .await
        .unwrap();
    assert!(output.status.success());
    lines.extend(
        String::from_utf8(output.stdout)
            .unwrap()
            .lines()
            .map(String::from),
    );

    let count = |what: &str| lines.iter().filter(|l| l.starts_with(what)).count();
    assert_eq!(count("PROCESSED"), messages, "{lines:#?}");
    let duplicates = publications - messages + kills;
    let why = "every retried copy that reached the consumer and every redelivery after a kill is \
               a detected duplicate";
    match broker.redelivery {
        Redelivery::Flagged => {
            assert_eq!(count("DUPLICATE"), duplicates, "{why}: {lines:#?}");
            assert!(
                lines
                    .iter()
                    .filter(|l| l.starts_with("DUPLICATE") && l.ends_with("redelivered=true"))
                    .count()
                    >= kills,
                "the redelivered copies came with the broker's redelivered flag: {lines:#?}"
            );
        }
        Redelivery::FromCommittedOffset => {
            assert!(count("DUPLICATE") >= duplicates, "{why}: {lines:#?}");
        }
    }
    assert_eq!(count("RETRY") + count("DEAD-LETTER") + count("REJECTED"), 0);
    let last = lines.last().unwrap();
    assert!(last.starts_with("IDLE"), "{last}");

    let pool = sqlx::SqlitePool::connect(&database).await.unwrap();
    let effects: Vec<(String, i64)> =
        sqlx::query_as("SELECT message_id, COUNT(*) FROM ledger GROUP BY message_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(effects.len(), messages);
    assert!(effects.iter().all(|(_, n)| *n == 1), "{effects:?}");
}

#[tokio::test]
async fn rabbitmq_consumer_killed_after_its_commit_before_its_ack_has_each_effect_once() {
    let queue = format!("payments-{}", uuid::Uuid::new_v4().simple());
    let broker = Broker {
        producer: "rabbitmq_producer",
        consumer: "rabbitmq_consumer",
        destination: vec!["--queue".into(), queue],
        url: ("IDEMPOTENT_AMQP_URL", env("IDEMPOTENT_AMQP_URL")),
        redelivery: Redelivery::Flagged,
        idle: "3",
    };
    // RabbitMQ keeps the producer's retried copies: each reaches the consumer.
    let run = Run::from_env();
    killed_after_commit_before_ack(broker, run, run.messages + run.retries).await;
}

#[tokio::test]
async fn nats_consumer_killed_after_its_commit_before_its_ack_has_each_effect_once() {
    let stream = format!("PAYMENTS_{}", uuid::Uuid::new_v4().simple());
    let broker = Broker {
        producer: "nats_producer",
        consumer: "nats_consumer",
        // A killed consumer's unacknowledged message comes back after a second.
        destination: vec!["--stream".into(), stream, "--ack-wait".into(), "1".into()],
        url: ("IDEMPOTENT_NATS_URL", env("IDEMPOTENT_NATS_URL")),
        redelivery: Redelivery::Flagged,
        idle: "3",
    };
    // JetStream drops the producer's retried copies itself (`Nats-Msg-Id` in its window).
    let run = Run::from_env();
    killed_after_commit_before_ack(broker, run, run.messages).await;
}

#[cfg(feature = "sqs")]
#[tokio::test]
async fn sqs_consumer_killed_after_its_commit_before_its_delete_has_each_effect_once() {
    let queue = format!("payments-{}", uuid::Uuid::new_v4().simple());
    let broker = Broker {
        producer: "sqs_producer",
        consumer: "sqs_consumer",
        // A killed consumer's undeleted message comes back after two seconds.
        destination: vec![
            "--queue".into(),
            queue,
            "--visibility-timeout".into(),
            "2".into(),
        ],
        url: ("IDEMPOTENT_SQS_URL", env("IDEMPOTENT_SQS_URL")),
        redelivery: Redelivery::Flagged,
        idle: "3",
    };
    // A standard queue keeps the producer's retried copies: each reaches the consumer.
    let run = Run::from_env();
    killed_after_commit_before_ack(broker, run, run.messages + run.retries).await;
}

#[cfg(feature = "kafka")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_consumer_killed_after_its_commit_before_its_offset_commit_has_each_effect_once() {
    let kafka = support::kafka::Kafka::start();
    let topic = kafka.topic("payments", 4).await;
    let broker = Broker {
        producer: "kafka_producer",
        consumer: "kafka_consumer",
        // A killed consumer's partitions go to the next one after three seconds.
        destination: vec![
            "--topic".into(),
            topic.clone(),
            "--session-timeout".into(),
            "3".into(),
        ],
        url: ("KAFKA_BROKERS", kafka.servers().to_owned()),
        redelivery: Redelivery::FromCommittedOffset,
        // The last consumer waits for the killed one's session to end before it is given its
        // partitions.
        idle: "10",
    };
    // Kafka keeps the producer's retried copies (new offsets): each reaches the consumer.
    let run = Run::from_env();
    killed_after_commit_before_ack(broker, run, run.messages + run.retries).await;
    for (partition, (end, committed)) in kafka.lag("ledger", &topic).await {
        assert_eq!(
            committed.unwrap_or(0),
            end,
            "partition {partition}: the last consumer committed every offset at its shutdown"
        );
    }
}
