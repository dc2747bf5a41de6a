//! A real broker end to end: RabbitMQ (`IDEMPOTENT_AMQP_URL`, started by `scripts/test`), the
//! `rabbitmq_producer` and `rabbitmq_consumer` examples as separate processes, and a consumer that
//! is SIGKILLed after its commit but before its acknowledgement, again and again.
#![cfg(feature = "sqlite")]

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions,
    QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

fn amqp_url() -> String {
    std::env::var("IDEMPOTENT_AMQP_URL").expect(
        "IDEMPOTENT_AMQP_URL is not set: run the tests with scripts/test, which starts RabbitMQ",
    )
}

/// An example's program, as `cargo build --examples` builds it (`scripts/test` does, first).
fn example(name: &str) -> PathBuf {
    let deps = std::env::current_exe().unwrap();
    let path = deps
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(name);
    assert!(
        path.exists(),
        "{} is not built: run `cargo build --all-features --examples` first (scripts/test does)",
        path.display()
    );
    path
}

fn consumer(queue: &str, database: &str, extra: &[&str]) -> Command {
    let mut command = Command::new(example("rabbitmq_consumer"));
    command
        .args(["--queue", queue])
        .args(extra)
        .env("IDEMPOTENT_AMQP_URL", amqp_url())
        .env("DATABASE_URL", database)
        .stdout(Stdio::piped())
        .kill_on_drop(true);
    command
}

#[tokio::test]
async fn consumer_killed_after_its_commit_before_its_ack_has_each_effect_once() {
    const MESSAGES: usize = 40;
    const RETRIES: usize = 8;
    const KILLS: usize = 4;
    let queue = format!("payments-{}", uuid::Uuid::new_v4().simple());
    let dir = tempfile::tempdir().unwrap();
    let database = format!("sqlite://{}", dir.path().join("ledger.db").display());

    let published = Command::new(example("rabbitmq_producer"))
        .args(["--queue", &queue, "--messages", &MESSAGES.to_string()])
        .args(["--retries", &RETRIES.to_string()])
        .env("IDEMPOTENT_AMQP_URL", amqp_url())
        .status()
        .await
        .unwrap();
    assert!(published.success());

    let mut lines = Vec::new();
    for _ in 0..KILLS {
        // Each run commits three payments and dies before acknowledging the third.
        let mut child = consumer(&queue, &database, &["--pause-after-commit", "3"])
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
    let output = consumer(&queue, &database, &["--exit-when-idle", "2"])
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
    assert_eq!(count("PROCESSED"), MESSAGES, "{lines:#?}");
    assert_eq!(
        count("DUPLICATE"),
        RETRIES + KILLS,
        "every producer retry and every redelivery after a kill is a detected duplicate: {lines:#?}"
    );
    assert_eq!(count("RETRY") + count("DEAD-LETTER") + count("REJECTED"), 0);
    // The redelivered copies came with the broker's redelivered flag and new delivery tags.
    assert!(
        lines
            .iter()
            .filter(|l| l.starts_with("DUPLICATE") && l.ends_with("redelivered=true"))
            .count()
            >= KILLS
    );

    let pool = sqlx::SqlitePool::connect(&database).await.unwrap();
    let effects: Vec<(String, i64)> =
        sqlx::query_as("SELECT message_id, COUNT(*) FROM ledger GROUP BY message_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(effects.len(), MESSAGES);
    assert!(effects.iter().all(|(_, n)| *n == 1), "{effects:?}");
    let rows: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM idempotent_inbox WHERE consumer = 'ledger'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(rows, MESSAGES as i64);

    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    let remaining = channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    assert_eq!(remaining.message_count(), 0, "the queue is not empty");
}

/// Why keying on the delivery tag is a compile error: the broker's redelivery of one message comes
/// with a new tag, and on another channel a different message gets a tag already seen.
#[tokio::test]
async fn delivery_tags_change_on_redelivery_and_repeat_across_channels() {
    let queue = format!("tags-{}", uuid::Uuid::new_v4().simple());
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap();
    let publisher = connection.create_channel().await.unwrap();
    publisher
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    for id in ["first-message", "second-message"] {
        publisher
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                b"{}",
                BasicProperties::default().with_message_id(id.into()),
            )
            .await
            .unwrap();
    }

    let consume = |channel: lapin::Channel| {
        let queue = queue.clone();
        async move {
            channel.basic_qos(1, Default::default()).await.unwrap();
            channel
                .basic_consume(
                    queue.as_str().into(),
                    "".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .unwrap()
        }
    };
    let id = |d: &lapin::message::Delivery| d.properties.message_id().as_ref().unwrap().to_string();

    let channel_a = connection.create_channel().await.unwrap();
    let mut a = consume(channel_a.clone()).await;
    let first = a.next().await.unwrap().unwrap();
    first
        .nack(BasicNackOptions {
            requeue: true,
            ..Default::default()
        })
        .await
        .unwrap();
    let again = a.next().await.unwrap().unwrap();
    assert_eq!(
        id(&again),
        id(&first),
        "the broker redelivered the same message"
    );
    assert!(!first.redelivered && again.redelivered);
    assert_ne!(
        again.delivery_tag, first.delivery_tag,
        "a redelivery gets a new tag"
    );
    again.ack(BasicAckOptions::default()).await.unwrap();
    channel_a.close(200, "done".into()).await.unwrap();

    let mut b = consume(connection.create_channel().await.unwrap()).await;
    let second = b.next().await.unwrap().unwrap();
    assert_ne!(id(&second), id(&first));
    assert_eq!(
        second.delivery_tag, first.delivery_tag,
        "another message on another channel reuses a tag"
    );
    second.ack(BasicAckOptions::default()).await.unwrap();
}
