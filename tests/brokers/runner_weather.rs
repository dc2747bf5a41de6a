//! The runners in bad weather, on real brokers: a RabbitMQ restart and a NATS restart in the
//! middle of a stream (`scripts/rabbitmq restart`, `scripts/nats restart`, through
//! `IDEMPOTENT_AMQP_CTL` and `IDEMPOTENT_NATS_CTL`, which those scripts print at start), and a
//! RabbitMQ memory alarm that blocks the runner's publishes (twice: one of them holds a runner made
//! from a channel, which must send nothing more until the broker confirmed what it gave up on).
//! Each case has the broker to itself (one at a time, in a test binary of their own): a restart
//! would break the other tests' runners made from a channel, which cannot reconnect.
#![cfg(all(feature = "rabbitmq", feature = "nats", feature = "sqlite"))]

mod support;

use std::time::Duration;

use idempotent::broker::RetryPolicy;
use idempotent::broker::nats::async_nats::jetstream::stream;
use lapin::{Connection, ConnectionProperties};
use support::{Kind, Shop, broker_ctl, broker_ctl_with, eventually};

/// One case at a time: each restarts a broker, or blocks it.
static ALONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The `metrics` recorder of this test binary, installed by the first case that asks.
fn recorder() -> &'static metrics_util::debugging::Snapshotter {
    static SNAPSHOTTER: std::sync::OnceLock<metrics_util::debugging::Snapshotter> =
        std::sync::OnceLock::new();
    SNAPSHOTTER.get_or_init(|| {
        let recorder = metrics_util::debugging::DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder
            .install()
            .expect("the only recorder of this test binary");
        snapshotter
    })
}

/// The runners' reconnects counted for `source` on `broker`, as the recorder saw them.
fn reconnects_recorded(broker: &str, source: &str) -> u64 {
    recorder()
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, _, _, _)| {
            let key = key.key();
            key.name() == idempotent::metrics::RUNNER_RECONNECTS
                && key
                    .labels()
                    .any(|l| l.key() == "broker" && l.value() == broker)
                && key
                    .labels()
                    .any(|l| l.key() == "source" && l.value() == source)
        })
        .map(|(_, _, _, value)| match value {
            metrics_util::debugging::DebugValue::Counter(n) => n,
            other => panic!("{other:?}"),
        })
        .sum()
}

mod rabbitmq {
    use super::*;
    use idempotent::broker::BeforeSettle;
    use idempotent::broker::rabbitmq::Runner;
    use lapin::options::BasicGetOptions;
    use support::amqp::{amqp_url, depth, publish, queue, start};

    /// Issue 21: the RabbitMQ runner ended about 2 s after a broker restart. It reconnects by itself: every
    /// message published before, during and after the restart is processed exactly once, and the
    /// runner is still running afterwards (it drains what is published after the restart).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_rabbitmq_restart_mid_stream_loses_nothing_and_the_runner_carries_on() {
        let _alone = ALONE.lock().await;
        recorder();
        let (connection, channel, queue) = queue().await;
        let shop = Shop::new().await;
        const BEFORE: usize = 300;
        for i in 0..BEFORE {
            publish(
                &channel,
                &queue,
                Some(&format!("before-{i}")),
                Kind::Slow(10),
            )
            .await;
        }
        drop((channel, connection));
        let runner = Runner::connect(amqp_url(), &queue).workers(4);
        let stats = runner.stats();
        let (shutdown, running) = start(runner, &shop);
        eventually(Duration::from_secs(60), async || {
            shop.effects().await.len() >= 20
        })
        .await;
        assert!(
            shop.effects().await.len() < BEFORE,
            "the runner finished before the restart"
        );
        // Away for 5 s: every connection attempt meanwhile is refused.
        broker_ctl_with(
            "IDEMPOTENT_AMQP_CTL",
            "IDEMPOTENT_AMQP_DOWNTIME=5",
            "restart",
        )
        .await;
        eventually(Duration::from_secs(60), async || stats().reconnects >= 1).await;
        assert!(!running.is_finished(), "the runner ended with the broker");

        let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
            .await
            .unwrap();
        let channel = connection.create_channel().await.unwrap();
        const AFTER: usize = 50;
        for i in 0..AFTER {
            publish(&channel, &queue, Some(&format!("after-{i}")), Kind::Ok).await;
        }
        eventually(Duration::from_secs(120), async || {
            shop.effects().await.len() == BEFORE + AFTER && depth(&connection, &queue).await == 0
        })
        .await;
        assert!(!running.is_finished(), "the runner ended");
        shutdown.cancel();
        let stats = running.await.unwrap().expect("a graceful shutdown");
        let effects = shop.effects().await;
        assert!(
            effects.values().all(|n| *n == 1),
            "an effect happened twice: {effects:?}"
        );
        assert_eq!(stats.processed as usize, BEFORE + AFTER);
        assert_eq!(stats.reconnects, 1, "{stats:?}");
        assert_eq!(reconnects_recorded("rabbitmq", &queue), 1);
    }

    /// Clears the memory alarm when dropped, whatever the test came to.
    struct Alarm;

    impl Drop for Alarm {
        fn drop(&mut self) {
            let ctl = std::env::var("IDEMPOTENT_AMQP_CTL").unwrap();
            let _ = std::process::Command::new("sh")
                .arg("-c")
                .arg(format!("{ctl} alarm off"))
                .status();
        }
    }

    /// Issue 21: the runner's own retry and dead-letter publishes had no timeout, so a worker
    /// waited out a whole memory alarm (and so did a shutdown). The publish times out; the
    /// delivery is handed back to the broker (nothing lost) while the alarm lasts, the runner
    /// shuts down on request during the alarm, and after it each message is settled once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_memory_alarm_times_the_runners_publishes_out_and_loses_nothing() {
        let _alone = ALONE.lock().await;
        let (connection, channel, queue) = queue().await;
        let shop = Shop::new().await;
        publish(&channel, &queue, Some("flaky"), Kind::Flaky(1)).await;
        publish(&channel, &queue, Some("poison"), Kind::Poison).await;
        let runner = || {
            Runner::connect(amqp_url(), &queue)
                .workers(2)
                .retry(RetryPolicy::new(3, Duration::from_millis(100)))
                .publish_timeout(Duration::from_secs(1))
        };
        let first = runner();
        let dead = first.dead_letters();
        let stats = first.stats();
        broker_ctl("IDEMPOTENT_AMQP_CTL", "alarm on").await;
        let alarm = Alarm;
        let (shutdown, running) = start(first, &shop);
        // Both publishes (a retry, a dead letter) are blocked: each times out, and its delivery
        // is handed back, while the alarm is still on.
        eventually(Duration::from_secs(60), async || stats().released >= 2).await;
        assert!(!running.is_finished());
        assert!(!shop.effects().await.contains_key("flaky"));
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(60), running)
            .await
            .expect("the runner shut down during the alarm")
            .unwrap()
            .unwrap();
        drop(alarm);
        let (shutdown, running) = start(runner(), &shop);
        eventually(Duration::from_secs(120), async || {
            shop.effects().await.contains_key("flaky")
                && depth(&connection, &queue).await == 0
                && depth(&connection, &dead).await >= 1
        })
        .await;
        shutdown.cancel();
        running.await.unwrap().unwrap();
        let effects = shop.effects().await;
        assert_eq!(effects.get("flaky"), Some(&1), "{effects:?}");
        assert!(!effects.contains_key("poison"));
    }
    /// A runner made from a channel publishes its retries and dead letters on that channel, and
    /// lapin hands a returned message to whichever confirmation of the channel it resolves next.
    /// A publish given up on is still confirmed later: had the channel been lent again before
    /// that, the next publication's return could reach the confirmation given up on (a dead
    /// letter to a queue that is gone would read as confirmed, and its message be acknowledged
    /// and lost). So nothing more goes out on the channel until that confirmation came. A memory
    /// alarm holds the first message's retry past its timeout; the second's, due while the first
    /// is unconfirmed, must give up without being sent. When the alarm clears, each message is
    /// retried once more: the delay queue then holds the first message twice (the copy given up
    /// on came through) and the second once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_runner_on_one_channel_sends_nothing_while_a_publish_it_gave_up_on_is_unconfirmed() {
        let _alone = ALONE.lock().await;
        let (connection, channel, queue) = queue().await;
        let shop = Shop::new().await;
        publish(&channel, &queue, Some("first"), Kind::Flaky(1)).await;
        publish(&channel, &queue, Some("second"), Kind::Flaky(1)).await;
        let timeout = Duration::from_secs(2);
        // Long enough that every copy is still in the delay queue at the end.
        let policy = RetryPolicy::new(3, Duration::from_secs(600));
        let delay = policy.delay_after(1);
        // The second retry starts half a timeout after the first: it is due once the first is
        // given up on, and still within its own timeout then.
        let hook: BeforeSettle = std::sync::Arc::new(move |message, _| {
            let later = message.message_id.to_string() == "second";
            Box::pin(async move {
                if later {
                    tokio::time::sleep(timeout / 2).await;
                }
            })
        });
        let runner = Runner::new(connection.create_channel().await.unwrap(), &queue)
            .workers(2)
            .retry(policy)
            .publish_timeout(timeout)
            .before_settle(hook);
        let stats = runner.stats();
        broker_ctl("IDEMPOTENT_AMQP_CTL", "alarm on").await;
        let alarm = Alarm;
        let (shutdown, running) = start(runner, &shop);
        eventually(Duration::from_secs(60), async || stats().released >= 2).await;
        assert_eq!(stats().retried, 0);
        drop(alarm);
        // The channel's publications reach the broker in order: once both later retries are
        // confirmed, whatever went out before them is in the delay queue.
        eventually(Duration::from_secs(60), async || stats().retried >= 2).await;
        shutdown.cancel();
        let stats = running.await.unwrap().unwrap();
        assert_eq!((stats.retried, stats.released), (2, 2), "{stats:?}");
        let delay_queue = format!("{queue}.retry.{}ms", delay.as_millis());
        let mut copies = Vec::new();
        while let Some(copy) = channel
            .basic_get(
                delay_queue.as_str().into(),
                BasicGetOptions { no_ack: true },
            )
            .await
            .unwrap()
        {
            let id = copy.delivery.properties.message_id().clone().unwrap();
            copies.push(id.to_string());
        }
        copies.sort();
        assert_eq!(
            copies,
            ["first", "first", "second"],
            "a retry went out while another was unconfirmed"
        );
        assert_eq!(depth(&connection, &queue).await, 0);
    }
}

mod nats {
    use super::*;
    use idempotent::broker::nats::Runner;
    use support::jetstream::{publish, setup, start, unfinished};

    /// Issue 21: the NATS runner ended about 11 s after a server restart (an acknowledgement
    /// timed out). It carries on: every message published before and after the restart is
    /// processed exactly once, and the runner is still running afterwards.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_nats_restart_mid_stream_loses_nothing_and_the_runner_carries_on() {
        let _alone = ALONE.lock().await;
        recorder();
        // A message whose acknowledgement the restart swallowed comes back after 3 s.
        let (jetstream, mut consumer, prefix) = setup(Duration::from_secs(3)).await;
        let stream_name = format!("S_{prefix}");
        let storage = jetstream
            .get_stream(&stream_name)
            .await
            .unwrap()
            .cached_info()
            .config
            .storage;
        assert_eq!(
            storage,
            stream::StorageType::File,
            "the stream must outlive the restart"
        );
        let shop = Shop::new().await;
        const BEFORE: usize = 300;
        for i in 0..BEFORE {
            publish(
                &jetstream,
                &prefix,
                Some(&format!("before-{i}")),
                Kind::Slow(10),
            )
            .await;
        }
        let runner = Runner::new(
            jetstream.clone(),
            consumer.clone(),
            format!("{prefix}.dead"),
        )
        .workers(4);
        let stats = runner.stats();
        let (shutdown, running) = start(runner, &shop);
        eventually(Duration::from_secs(60), async || {
            shop.effects().await.len() >= 20
        })
        .await;
        assert!(
            shop.effects().await.len() < BEFORE,
            "the runner finished before the restart"
        );
        // Away for 12 s: longer than an acknowledgement's timeout and the consumer's ack_wait.
        broker_ctl_with(
            "IDEMPOTENT_NATS_CTL",
            "IDEMPOTENT_NATS_DOWNTIME=12",
            "restart",
        )
        .await;
        eventually(Duration::from_secs(60), async || stats().reconnects >= 1).await;
        assert!(!running.is_finished(), "the runner ended with the server");
        const AFTER: usize = 50;
        for i in 0..AFTER {
            publish(&jetstream, &prefix, Some(&format!("after-{i}")), Kind::Ok).await;
        }
        eventually(Duration::from_secs(120), async || {
            shop.effects().await.len() == BEFORE + AFTER && unfinished(&mut consumer).await == 0
        })
        .await;
        assert!(!running.is_finished(), "the runner ended");
        shutdown.cancel();
        let stats = running.await.unwrap().expect("a graceful shutdown");
        let effects = shop.effects().await;
        assert!(
            effects.values().all(|n| *n == 1),
            "an effect happened twice: {effects:?}"
        );
        assert_eq!(stats.processed as usize, BEFORE + AFTER);
        assert!(stats.reconnects >= 1, "{stats:?}");
        let name = format!("S_{prefix}/shop");
        assert_eq!(reconnects_recorded("nats", &name), stats.reconnects);
    }
}

/// Issue 21: the consumer examples exited when their broker restarted (no restart loop). They
/// carry on through the runner's own reconnect: a consumer process started before the restart
/// processes what the producer publishes before and after it, each payment once, and is still
/// running.
mod examples {
    use super::*;
    use std::process::Stdio;
    use std::sync::{Arc, Mutex};
    use tokio::io::{AsyncBufReadExt, BufReader};
    use tokio::process::Command;

    const MESSAGES: usize = 40;

    struct Example {
        producer: &'static str,
        consumer: &'static str,
        destination: [String; 2],
        url: (&'static str, String),
        ctl: &'static str,
    }

    impl Example {
        fn command(&self, program: &str, database: &str) -> Command {
            let mut command = Command::new(support::example(program));
            command
                .args(&self.destination)
                .env(self.url.0, &self.url.1)
                .env("DATABASE_URL", database)
                .kill_on_drop(true);
            command
        }

        async fn produce(&self, database: &str) {
            let status = self
                .command(self.producer, database)
                .args(["--messages", &MESSAGES.to_string()])
                .stdout(Stdio::null())
                .status()
                .await
                .unwrap();
            assert!(status.success());
        }
    }

    async fn consumer_survives_a_restart(example: Example) {
        let dir = tempfile::tempdir().unwrap();
        let database = format!("sqlite://{}", dir.path().join("ledger.db").display());
        example.produce(&database).await;
        let mut consumer = example
            .command(example.consumer, &database)
            .args(["--workers", "2"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let lines = Arc::new(Mutex::new(Vec::<String>::new()));
        let mut stdout = BufReader::new(consumer.stdout.take().unwrap()).lines();
        let read = lines.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = stdout.next_line().await {
                read.lock().unwrap().push(line);
            }
        });
        let processed = || {
            lines
                .lock()
                .unwrap()
                .iter()
                .filter(|l| l.starts_with("PROCESSED"))
                .count()
        };
        eventually(Duration::from_secs(60), async || processed() == MESSAGES).await;
        broker_ctl(example.ctl, "restart").await;
        example.produce(&database).await;
        eventually(Duration::from_secs(120), async || {
            processed() == 2 * MESSAGES
        })
        .await;
        assert!(
            consumer.try_wait().unwrap().is_none(),
            "the consumer exited: {:#?}",
            lines.lock().unwrap()
        );
        consumer.kill().await.unwrap();
        let pool = sqlx::SqlitePool::connect(&database).await.unwrap();
        let effects: Vec<(String, i64)> =
            sqlx::query_as("SELECT message_id, COUNT(*) FROM ledger GROUP BY message_id")
                .fetch_all(&pool)
                .await
                .unwrap();
        assert_eq!(effects.len(), 2 * MESSAGES);
        assert!(effects.iter().all(|(_, n)| *n == 1), "{effects:?}");
    }

    fn env(name: &str) -> String {
        std::env::var(name)
            .unwrap_or_else(|_| panic!("{name} is not set: run the tests with scripts/test"))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_rabbitmq_consumer_example_survives_a_broker_restart() {
        let _alone = ALONE.lock().await;
        consumer_survives_a_restart(Example {
            producer: "rabbitmq_producer",
            consumer: "rabbitmq_consumer",
            destination: [
                "--queue".into(),
                format!("payments-{}", uuid::Uuid::new_v4().simple()),
            ],
            url: ("IDEMPOTENT_AMQP_URL", env("IDEMPOTENT_AMQP_URL")),
            ctl: "IDEMPOTENT_AMQP_CTL",
        })
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_nats_consumer_example_survives_a_server_restart() {
        let _alone = ALONE.lock().await;
        consumer_survives_a_restart(Example {
            producer: "nats_producer",
            consumer: "nats_consumer",
            destination: [
                "--stream".into(),
                format!("PAYMENTS_{}", uuid::Uuid::new_v4().simple()),
            ],
            url: ("IDEMPOTENT_NATS_URL", env("IDEMPOTENT_NATS_URL")),
            ctl: "IDEMPOTENT_NATS_CTL",
        })
        .await;
    }
}
