//! `idempotent dlq` against a local SQS (`IDEMPOTENT_SQS_URL`, moto's server), RabbitMQ
//! (`IDEMPOTENT_AMQP_URL`) and NATS JetStream (`IDEMPOTENT_NATS_URL`), as `scripts/test` starts
//! them: dead letters the runners wrote, listed by reason, shown, put back (a dry run first) with
//! their message id kept and their attempts starting again, and the mistakes an operator makes
//! refused with a sentence.
#![cfg(all(feature = "sqs", feature = "rabbitmq", feature = "nats"))]

use std::collections::HashMap;
use std::process::{Command, Output};
use std::time::Duration;

use idempotent::broker::sqs::aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
use idempotent::broker::sqs::aws_sdk_sqs::types::{MessageAttributeValue, QueueAttributeName};
use idempotent::broker::sqs::aws_sdk_sqs::{self, Client};
use idempotent::broker::sqs::{MESSAGE_ID_ATTRIBUTE, Runner};
use idempotent::broker::{Message, Shutdown};
use idempotent::{Error, Handled};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_idempotent");

fn endpoint() -> String {
    std::env::var("IDEMPOTENT_SQS_URL").expect(
        "IDEMPOTENT_SQS_URL is not set: run the tests with scripts/test, which starts a local SQS",
    )
}

fn sqs() -> Client {
    let config = aws_sdk_sqs::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(endpoint())
        .credentials_provider(Credentials::new("test", "test", None, None, "tests"))
        .http_client(aws_smithy_http_client::Builder::new().build_http())
        .build();
    Client::from_conf(config)
}

/// Runs `idempotent dlq` with `args` (and the local SQS's endpoint for an SQS queue).
fn dlq(args: &[&str]) -> Output {
    let mut command = Command::new(BIN);
    command.arg("dlq");
    if args.iter().any(|arg| arg.starts_with("--sqs")) {
        command.args(["--sqs-endpoint", &endpoint()]);
    }
    command
        .args(args)
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env_remove("AWS_ENDPOINT_URL")
        .output()
        .expect("run the idempotent binary")
}

fn json(args: &[&str]) -> Value {
    let mut args = args.to_vec();
    args.push("--json");
    let out = dlq(&args);
    assert!(
        out.status.success(),
        "idempotent dlq {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("--json prints JSON")
}

async fn queue_url(
    client: &Client,
    name: &str,
    attributes: HashMap<QueueAttributeName, String>,
) -> String {
    let made = client
        .create_queue()
        .queue_name(name)
        .set_attributes(Some(attributes))
        .send()
        .await
        .unwrap();
    made.queue_url().unwrap().to_owned()
}

async fn send(client: &Client, queue: &str, id: &str, body: &str) {
    let id = MessageAttributeValue::builder()
        .data_type("String")
        .string_value(id)
        .build()
        .unwrap();
    client
        .send_message()
        .queue_url(queue)
        .message_body(body)
        .message_attributes(MESSAGE_ID_ATTRIBUTE, id)
        .message_attributes(
            "order-id",
            MessageAttributeValue::builder()
                .data_type("String")
                .string_value("7")
                .build()
                .unwrap(),
        )
        .send()
        .await
        .unwrap();
}

async fn depth(client: &Client, queue: &str) -> u64 {
    let attributes = client
        .get_queue_attributes()
        .queue_url(queue)
        .attribute_names(QueueAttributeName::All)
        .send()
        .await
        .unwrap();
    let attributes = attributes.attributes().unwrap();
    [
        QueueAttributeName::ApproximateNumberOfMessages,
        QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
    ]
    .iter()
    .map(|name| attributes[name].parse::<u64>().unwrap())
    .sum()
}

/// The (message id, attempt) of each message a handler of [`handler`] took.
type Seen = std::sync::Arc<std::sync::Mutex<Vec<(String, u32)>>>;

/// A runner's worker: a message whose body starts with `poison` fails with "poison: …", one that
/// starts with `declined` with "card declined", unless `cured`; each is noted in `seen`.
fn handler(seen: &Seen, cured: bool) -> impl FnMut(Message) -> HandlerFuture + Send + 'static {
    let seen = seen.clone();
    move |message: Message| {
        let seen = seen.clone();
        Box::pin(async move {
            seen.lock()
                .unwrap()
                .push((message.message_id.0.clone(), message.attempt));
            let body = String::from_utf8_lossy(&message.payload).into_owned();
            if !cured && body.starts_with("poison") {
                return Err(Error::Handler(format!(
                    "poison: {body} can never be handled"
                )));
            }
            if !cured && body.starts_with("declined") {
                return Err(Error::Handler("card declined".to_owned()));
            }
            Ok(Handled::Processed(()))
        })
    }
}

/// A handler's future.
type HandlerFuture =
    std::pin::Pin<Box<dyn Future<Output = Result<Handled<()>, Error<String>>> + Send>>;

/// Waits until the runner counted `expected` outcomes (processed or dead-lettered), then shuts it
/// down; returns what the handlers saw.
async fn until_settled(
    running: tokio::task::JoinHandle<
        Result<idempotent::broker::RunnerStats, idempotent::broker::BrokerError>,
    >,
    stats: impl Fn() -> idempotent::broker::RunnerStats,
    shutdown: Shutdown,
    seen: Seen,
    expected: usize,
) -> Vec<(String, u32)> {
    for _ in 0..600 {
        let now = stats();
        if (now.processed + now.dead_lettered) as usize >= expected {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    let stats = running.await.unwrap().unwrap();
    assert_eq!(
        (stats.processed + stats.dead_lettered) as usize,
        expected,
        "{stats:?}"
    );
    let mut seen = seen.lock().unwrap().clone();
    seen.sort();
    seen
}

/// Runs the SQS runner on `queue` with [`handler`] until `expected` messages are settled.
async fn run(client: &Client, queue: &str, cured: bool, expected: usize) -> Vec<(String, u32)> {
    let seen = Seen::default();
    let shutdown = Shutdown::new();
    let runner = Runner::new(client.clone(), queue)
        .wait_time(Duration::from_secs(1))
        .shutdown_on(shutdown.clone());
    let stats = runner.stats();
    let worker = handler(&seen, cured);
    let mut workers = Some(worker);
    let running = tokio::spawn(runner.run(move || workers.take().expect("one worker")));
    until_settled(running, stats, shutdown, seen, expected).await
}

/// Runs the RabbitMQ runner on `queue` with [`handler`] until `expected` messages are settled.
async fn run_rabbitmq(queue: &str, cured: bool, expected: usize) -> Vec<(String, u32)> {
    let seen = Seen::default();
    let shutdown = Shutdown::new();
    let runner = idempotent::broker::rabbitmq::Runner::connect(amqp_url(), queue)
        .shutdown_on(shutdown.clone());
    let stats = runner.stats();
    let worker = handler(&seen, cured);
    let mut workers = Some(worker);
    let running = tokio::spawn(runner.run(move || workers.take().expect("one worker")));
    until_settled(running, stats, shutdown, seen, expected).await
}

fn amqp_url() -> String {
    std::env::var("IDEMPOTENT_AMQP_URL").expect(
        "IDEMPOTENT_AMQP_URL is not set: run the tests with scripts/test, which starts RabbitMQ",
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_listed_by_reason_shown_and_put_back_with_their_id_and_fresh_attempts() {
    let client = sqs();
    let name = format!("orders-{}", uuid::Uuid::new_v4().simple());
    let dead = queue_url(&client, &format!("{name}-dead"), HashMap::new()).await;
    let arn = client
        .get_queue_attributes()
        .queue_url(&dead)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await
        .unwrap()
        .attributes()
        .unwrap()[&QueueAttributeName::QueueArn]
        .clone();
    let redrive = format!(r#"{{"deadLetterTargetArn":"{arn}","maxReceiveCount":"10"}}"#);
    let queue = queue_url(
        &client,
        &name,
        HashMap::from([(QueueAttributeName::RedrivePolicy, redrive)]),
    )
    .await;
    send(&client, &queue, "p-1", "poison one").await;
    send(&client, &queue, "p-2", "poison two").await;
    send(&client, &queue, "d-1", "declined").await;
    run(&client, &queue, false, 3).await;
    assert_eq!(depth(&client, &dead).await, 3);

    let listed = json(&["--sqs", &queue, "list"]);
    let letters = listed["dead_letters"].as_array().unwrap();
    assert_eq!(letters.len(), 3, "{listed}");
    assert!(
        letters
            .iter()
            .all(|l| l["source"] == queue.as_str() && l["attempts"] == 1)
    );
    let poisoned = json(&["--sqs", &queue, "list", "--reason", "POISON"]);
    let mut ids: Vec<&str> = poisoned["dead_letters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["message_id"].as_str().unwrap())
        .collect();
    ids.sort();
    assert_eq!(ids, ["p-1", "p-2"]);
    assert!(
        json(&["--sqs", &queue, "list", "--older-than", "1h"])["dead_letters"]
            .as_array()
            .unwrap()
            .is_empty()
    );
    // Listing hides nothing for long: the three are visible again for the next reader.
    let shown = json(&["--sqs-dlq", &dead, "show", "--message-id", "d-1"]);
    let letter = &shown["dead_letters"][0];
    assert_eq!(letter["reason"], "card declined");
    assert_eq!(letter["headers"]["order-id"], "7");
    assert_eq!(letter["payload"], "declined");
    let table = dlq(&["--sqs", &queue, "list"]);
    let table = String::from_utf8(table.stdout).unwrap();
    assert!(
        table.contains("MESSAGE ID") && table.contains("card declined"),
        "{table}"
    );
    let missing = dlq(&["--sqs", &queue, "show", "--message-id", "nope"]);
    assert_eq!(missing.status.code(), Some(2));

    let dry = json(&[
        "--sqs",
        &queue,
        "redrive",
        "--reason",
        "poison",
        "--dry-run",
    ]);
    assert_eq!(dry["redriven"].as_array().unwrap().len(), 2, "{dry}");
    assert_eq!(
        (depth(&client, &dead).await, depth(&client, &queue).await),
        (3, 0)
    );
    // The consumer's inbox processed p-1 already (its dead letter is a copy from before a
    // fix, say): the redrive's audit line says so.
    let dir = tempfile::tempdir().unwrap();
    let database = format!("sqlite://{}", dir.path().join("orders.db").display());
    let migrated = Command::new(BIN)
        .args(["--url", &database, "migrate"])
        .output()
        .unwrap();
    assert!(migrated.status.success());
    let pool = idempotent::sqlx::SqlitePool::connect(&database)
        .await
        .unwrap();
    let inbox = idempotent::Inbox::new(pool);
    let claimed = inbox
        .claim("orders", "p-1")
        .await
        .unwrap()
        .expect("a new key");
    claimed.commit().await.unwrap();
    let without_url = dlq(&["--sqs", &queue, "redrive", "--consumer", "orders"]);
    assert_eq!(without_url.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&without_url.stderr).contains("--url"));
    let moved = json(&[
        "--sqs",
        &queue,
        "redrive",
        "--reason",
        "poison",
        "--consumer",
        "orders",
        "--url",
        &database,
    ]);
    let redriven = moved["redriven"].as_array().unwrap();
    assert_eq!(redriven.len(), 2, "{moved}");
    for letter in redriven {
        assert_eq!(letter["audited"], true, "{moved}");
        let processed = !letter["processed_at"].is_null();
        assert_eq!(processed, letter["message_id"] == "p-1", "{moved}");
    }
    let audit = Command::new(BIN)
        .args([
            "--url",
            &database,
            "audit",
            "--consumer",
            "orders",
            "--json",
        ])
        .output()
        .unwrap();
    let audit: Value = serde_json::from_slice(&audit.stdout).unwrap();
    let entries = audit["audit"].as_array().expect("audit entries");
    assert_eq!(entries.len(), 2, "{audit}");
    assert!(
        entries.iter().all(|e| {
            let reason = e["reason"].as_str().unwrap();
            reason.contains("put back from") && reason.contains("poison")
        }),
        "{audit}"
    );
    assert_eq!(
        (depth(&client, &dead).await, depth(&client, &queue).await),
        (1, 2)
    );
    // The fixed consumer takes them: their own ids, on their first attempt again.
    let handled = run(&client, &queue, true, 2).await;
    assert_eq!(handled, [("p-1".into(), 1), ("p-2".into(), 1)]);
    let left = json(&["--sqs", &queue, "list"]);
    assert_eq!(left["dead_letters"][0]["message_id"], "d-1", "{left}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mistakes_are_refused_with_a_sentence() {
    let client = sqs();
    let bare = queue_url(
        &client,
        &format!("bare-{}", uuid::Uuid::new_v4().simple()),
        HashMap::new(),
    )
    .await;
    let cases: [(&[&str], &str); 4] = [
        (&["--sqs", &bare, "list"], "no redrive policy"),
        (
            &[
                "--sqs",
                &format!("{}/000000000000/nope", endpoint()),
                "list",
            ],
            "does not exist",
        ),
        (&["list"], "name the dead-letter queue"),
        (&["--sqs", &bare, "list", "--limit", "0"], "at least 1"),
    ];
    for (args, expected) in cases {
        let out = dlq(args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(said.contains(expected), "{args:?}: {said}");
    }
    let without = Command::new(BIN)
        .args(["dlq", "--sqs", &bare, "list"])
        .env_remove("AWS_ACCESS_KEY_ID")
        .env_remove("AWS_SECRET_ACCESS_KEY")
        .output()
        .unwrap();
    assert_eq!(without.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&without.stderr).contains("AWS_ACCESS_KEY_ID"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_dead_letters_are_listed_and_put_back_with_their_id_and_fresh_attempts() {
    use idempotent::broker::rabbitmq::lapin::options::{BasicPublishOptions, QueueDeclareOptions};
    use idempotent::broker::rabbitmq::lapin::types::FieldTable;
    use idempotent::broker::rabbitmq::lapin::{BasicProperties, Connection, ConnectionProperties};

    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    let queue = format!("orders-{}", uuid::Uuid::new_v4().simple());
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    for (id, body) in [
        ("p-1", "poison one"),
        ("p-2", "poison two"),
        ("d-1", "declined"),
    ] {
        channel
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                BasicProperties::default()
                    .with_message_id(id.into())
                    .with_delivery_mode(2),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }
    run_rabbitmq(&queue, false, 3).await;
    let rabbitmq = |args: &[&str]| {
        let mut all = vec!["--rabbitmq", queue.as_str(), "--amqp-url"];
        let url = amqp_url();
        all.push(&url);
        all.extend_from_slice(args);
        json(&all)
    };
    let listed = rabbitmq(&["list"]);
    let letters = listed["dead_letters"].as_array().unwrap();
    assert_eq!(letters.len(), 3, "{listed}");
    assert!(
        letters
            .iter()
            .all(|l| l["source"] == queue.as_str() && l["attempts"] == 1)
    );
    assert!(
        letters.iter().all(|l| l["age_seconds"].as_u64().is_some()),
        "{listed}"
    );
    // The listing gave them back, in their order.
    let again = rabbitmq(&["list"]);
    let ids: Vec<&str> = again["dead_letters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["message_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["p-1", "p-2", "d-1"]);
    let dry = rabbitmq(&["redrive", "--reason", "poison", "--dry-run"]);
    assert_eq!(dry["redriven"].as_array().unwrap().len(), 2, "{dry}");
    let moved = rabbitmq(&["redrive", "--reason", "poison"]);
    assert_eq!(moved["redriven"].as_array().unwrap().len(), 2, "{moved}");
    let handled = run_rabbitmq(&queue, true, 2).await;
    assert_eq!(handled, [("p-1".into(), 1), ("p-2".into(), 1)]);
    let left = rabbitmq(&["list"]);
    assert_eq!(left["dead_letters"].as_array().unwrap().len(), 1, "{left}");
    assert_eq!(left["dead_letters"][0]["message_id"], "d-1");
    assert_eq!(left["dead_letters"][0]["reason"], "card declined");
}

fn nats_url() -> String {
    std::env::var("IDEMPOTENT_NATS_URL").expect(
        "IDEMPOTENT_NATS_URL is not set: run the tests with scripts/test, which starts NATS",
    )
}

/// Runs the NATS runner on the durable consumer `shop` of `stream` with [`handler`] until
/// `expected` messages are settled, dead-lettering to `dead`.
async fn run_nats(
    jetstream: &idempotent::broker::nats::async_nats::jetstream::Context,
    stream: &str,
    dead: &str,
    cured: bool,
    expected: usize,
) -> Vec<(String, u32)> {
    let consumer = jetstream
        .get_consumer_from_stream("shop", stream)
        .await
        .unwrap();
    let seen = Seen::default();
    let shutdown = Shutdown::new();
    let runner = idempotent::broker::nats::Runner::new(jetstream.clone(), consumer, dead)
        .shutdown_on(shutdown.clone());
    let stats = runner.stats();
    let worker = handler(&seen, cured);
    let mut workers = Some(worker);
    let running = tokio::spawn(runner.run(move || workers.take().expect("one worker")));
    until_settled(running, stats, shutdown, seen, expected).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_dead_letters_are_kept_within_the_duplicate_window_and_put_back_after_it() {
    use idempotent::broker::nats::async_nats::jetstream::{self, consumer, stream};
    use idempotent::broker::nats::async_nats::{self, HeaderMap};

    let jetstream = jetstream::new(async_nats::connect(nats_url()).await.unwrap());
    let id = uuid::Uuid::new_v4().simple().to_string();
    let (source, dead) = (format!("{id}.orders"), format!("{id}.dead"));
    let mut config = stream::Config {
        name: format!("S_{id}"),
        subjects: vec![source.clone()],
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    };
    let orders = jetstream.create_stream(config.clone()).await.unwrap();
    jetstream
        .create_stream(stream::Config {
            name: format!("D_{id}"),
            subjects: vec![dead.clone()],
            ..Default::default()
        })
        .await
        .unwrap();
    orders
        .create_consumer(consumer::pull::Config {
            durable_name: Some("shop".into()),
            ack_policy: consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await
        .unwrap();
    for (message_id, body) in [
        ("p-1", "poison one"),
        ("p-2", "poison two"),
        ("d-1", "declined"),
    ] {
        let mut headers = HeaderMap::new();
        headers.insert(async_nats::header::NATS_MESSAGE_ID, message_id);
        headers.insert("Tenant", "acme");
        jetstream
            .publish_with_headers(source.clone(), headers, body.as_bytes().to_vec().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    run_nats(&jetstream, &config.name, &dead, false, 3).await;
    let url = nats_url();
    let on_nats = ["--nats", dead.as_str(), "--nats-url", url.as_str()];
    let nats = |args: &[&str]| json(&[&on_nats[..], args].concat());
    let listed = nats(&["list"]);
    let letters = listed["dead_letters"].as_array().unwrap();
    let ids: Vec<&str> = letters
        .iter()
        .map(|l| l["message_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["p-1", "p-2", "d-1"], "{listed}");
    assert!(
        letters.iter().all(|l| l["source"] == source.as_str()
            && l["attempts"] == 1
            && l["age_seconds"].as_u64().is_some()),
        "{listed}"
    );
    let shown = nats(&["show", "--message-id", "p-1"]);
    assert!(shown.to_string().contains("Tenant"), "{shown}");
    assert!(shown.to_string().contains("poison one"), "{shown}");

    // Within the window JetStream would drop the copy: the redrive says so and keeps them all.
    let refused = dlq(&[&on_nats[..], &["redrive", "--reason", "poison"]].concat());
    assert_eq!(refused.status.code(), Some(1));
    let sentence = String::from_utf8_lossy(&refused.stderr);
    assert!(sentence.contains("duplicate window"), "{sentence}");
    assert_eq!(nats(&["list"])["dead_letters"].as_array().unwrap().len(), 3);

    // After it, they go back with their ids and start again at attempt 1.
    config.duplicate_window = Duration::from_secs(1);
    jetstream.update_stream(config.clone()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let dry = nats(&["redrive", "--reason", "poison", "--dry-run"]);
    assert_eq!(dry["redriven"].as_array().unwrap().len(), 2, "{dry}");
    assert_eq!(nats(&["list"])["dead_letters"].as_array().unwrap().len(), 3);
    let moved = nats(&["redrive", "--reason", "poison"]);
    assert_eq!(moved["redriven"].as_array().unwrap().len(), 2, "{moved}");
    let handled = run_nats(&jetstream, &config.name, &dead, true, 2).await;
    assert_eq!(handled, [("p-1".into(), 1), ("p-2".into(), 1)]);
    let left = nats(&["list"]);
    assert_eq!(left["dead_letters"].as_array().unwrap().len(), 1, "{left}");
    assert_eq!(left["dead_letters"][0]["message_id"], "d-1");
    assert_eq!(left["dead_letters"][0]["reason"], "card declined");

    // A source subject that no stream captures any more: refused, the dead letter kept.
    jetstream.delete_stream(&config.name).await.unwrap();
    let orphaned = dlq(&[&on_nats[..], &["redrive"]].concat());
    assert_eq!(orphaned.status.code(), Some(1));
    let sentence = String::from_utf8_lossy(&orphaned.stderr);
    assert!(sentence.contains("no stream captures"), "{sentence}");
    assert_eq!(nats(&["list"])["dead_letters"].as_array().unwrap().len(), 1);
    // A dead-letter subject that no stream captures: a sentence, not an empty listing.
    let nowhere = format!("{id}.nowhere");
    let missing = dlq(&[
        "--nats",
        nowhere.as_str(),
        "--nats-url",
        url.as_str(),
        "list",
    ]);
    assert_eq!(missing.status.code(), Some(1));
    let sentence = String::from_utf8_lossy(&missing.stderr);
    assert!(sentence.contains("no stream captures"), "{sentence}");
}

/// Kafka for the Kafka case: librdkafka's mock cluster, in this process, which the command reaches
/// on loopback like any cluster.
#[cfg(feature = "kafka")]
mod kafka {
    use std::time::Duration;

    use idempotent::broker::kafka::rdkafka::consumer::{BaseConsumer, Consumer as _};
    use idempotent::broker::kafka::rdkafka::message::{Header, Headers as _, OwnedHeaders};
    use idempotent::broker::kafka::rdkafka::mocking::MockCluster;
    use idempotent::broker::kafka::rdkafka::producer::{
        DefaultProducerContext, FutureProducer, FutureRecord,
    };
    use idempotent::broker::kafka::rdkafka::{Message as _, Offset, TopicPartitionList};
    use idempotent::broker::kafka::{ClientConfig, Runner};
    use idempotent::broker::{RetryPolicy, Shutdown};

    use super::{Seen, handler, until_settled};

    pub fn client(servers: &str) -> ClientConfig {
        let mut client = ClientConfig::new();
        client
            .set("bootstrap.servers", servers)
            .set("topic.metadata.refresh.interval.ms", "1000")
            .set("auto.commit.interval.ms", "200")
            .set("session.timeout.ms", "6000")
            .set("heartbeat.interval.ms", "500")
            .set("log_level", "3");
        client
    }

    pub fn cluster() -> MockCluster<'static, DefaultProducerContext> {
        MockCluster::new(1).expect("a mock cluster")
    }

    /// Produces a record keyed `key` with `headers` to `topic`.
    pub async fn produce(
        servers: &str,
        topic: &str,
        key: &str,
        body: &str,
        headers: &[(&str, &str)],
    ) {
        let producer: FutureProducer = client(servers)
            .set("acks", "all")
            .set("enable.idempotence", "true")
            .create()
            .unwrap();
        let mut owned = OwnedHeaders::new();
        for (name, value) in headers {
            owned = owned.insert(Header {
                key: name,
                value: Some(value.as_bytes()),
            });
        }
        let record = FutureRecord::to(topic)
            .key(key)
            .payload(body)
            .headers(owned);
        producer
            .send(record, Duration::from_secs(10))
            .await
            .expect("produced");
    }

    /// The partition of each record of `topic`, by its message id. One partition at a time, each
    /// record once by its offset: librdkafka's mock cluster has been seen handing a reader one
    /// partition's first record again and again while the others waited.
    pub fn partitions_of(servers: &str, topic: &str) -> Vec<(String, i32)> {
        let consumer: BaseConsumer = client(servers).set("group.id", "reader").create().unwrap();
        let metadata = consumer
            .fetch_metadata(Some(topic), Duration::from_secs(10))
            .unwrap();
        let mut seen = Vec::new();
        for partition in metadata.topics()[0].partitions() {
            let (low, high) = consumer
                .fetch_watermarks(topic, partition.id(), Duration::from_secs(10))
                .unwrap();
            let mut assigned = TopicPartitionList::new();
            assigned
                .add_partition_offset(topic, partition.id(), Offset::Offset(low))
                .unwrap();
            consumer.assign(&assigned).unwrap();
            let mut offsets = std::collections::BTreeSet::new();
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            while (offsets.len() as i64) < high - low {
                assert!(
                    std::time::Instant::now() < deadline,
                    "partition {}: {} of {} records within 60 s",
                    partition.id(),
                    offsets.len(),
                    high - low
                );
                let Some(record) = consumer.poll(Duration::from_secs(1)) else {
                    continue;
                };
                let record = record.unwrap();
                if !offsets.insert(record.offset()) {
                    continue;
                }
                let id = record
                    .headers()
                    .and_then(|h| h.iter().find(|h| h.key == "message-id"))
                    .and_then(|h| h.value)
                    .map(|v| String::from_utf8_lossy(v).into_owned())
                    .unwrap_or_default();
                seen.push((id, record.partition()));
            }
        }
        seen.sort();
        seen
    }

    /// Runs the Kafka runner of group `shop` on `topic` with [`handler`] until `expected` records are
    /// settled, dead-lettering to `<topic>.dead`.
    pub async fn run(
        servers: &str,
        topic: &str,
        cured: bool,
        expected: usize,
    ) -> Vec<(String, u32)> {
        let seen = Seen::default();
        let shutdown = Shutdown::new();
        let runner = Runner::new(client(servers), "shop", &[topic], format!("{topic}.dead"))
            .retry(RetryPolicy::new(1, Duration::from_millis(100)))
            .shutdown_on(shutdown.clone());
        let stats = runner.stats();
        let worker = handler(&seen, cured);
        let mut workers = Some(worker);
        let running = tokio::spawn(runner.run(move || workers.take().expect("one worker")));
        until_settled(running, stats, shutdown, seen, expected).await
    }
}

#[cfg(feature = "kafka")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_dead_letters_are_put_back_to_their_partition_once_and_noted() {
    let cluster = kafka::cluster();
    let servers = cluster.bootstrap_servers();
    cluster.create_topic("orders", 3, 1).unwrap();
    for (message_id, key, body) in [
        ("p-1", "customer-1", "poison one"),
        ("p-2", "customer-2", "poison two"),
        ("d-1", "customer-3", "declined"),
    ] {
        let headers = [("message-id", message_id), ("tenant", "acme")];
        kafka::produce(&servers, "orders", key, body, &headers).await;
    }
    let first = kafka::run(&servers, "orders", false, 3).await;
    assert_eq!(first.len(), 3, "{first:?}");
    let on_kafka = [
        "--kafka",
        "orders.dead",
        "--kafka-brokers",
        servers.as_str(),
    ];
    let kafka = |args: &[&str]| json(&[&on_kafka[..], args].concat());
    let listed = kafka(&["list"]);
    let letters = listed["dead_letters"].as_array().unwrap();
    let mut ids: Vec<&str> = letters
        .iter()
        .map(|l| l["message_id"].as_str().unwrap())
        .collect();
    ids.sort();
    assert_eq!(ids, ["d-1", "p-1", "p-2"], "{listed}");
    assert!(
        letters.iter().all(|l| l["source"] == "orders"
            && l["attempts"] == 1
            && l["age_seconds"].as_u64().is_some()),
        "{listed}"
    );
    let shown = kafka(&["show", "--message-id", "p-1"]);
    assert!(shown.to_string().contains("tenant"), "{shown}");
    assert!(shown.to_string().contains("poison one"), "{shown}");

    let dry = kafka(&["redrive", "--reason", "poison", "--dry-run"]);
    assert_eq!(dry["redriven"].as_array().unwrap().len(), 2, "{dry}");
    assert_eq!(
        kafka(&["list"])["dead_letters"].as_array().unwrap().len(),
        3
    );
    let moved = kafka(&["redrive", "--reason", "poison"]);
    assert_eq!(moved["redriven"].as_array().unwrap().len(), 2, "{moved}");
    // Noted as put back: listed no more, and a second redrive moves nothing.
    let left = kafka(&["list"]);
    assert_eq!(left["dead_letters"].as_array().unwrap().len(), 1, "{left}");
    assert_eq!(left["dead_letters"][0]["message_id"], "d-1");
    assert_eq!(left["dead_letters"][0]["reason"], "card declined");
    let again = kafka(&["redrive", "--reason", "poison"]);
    assert_eq!(again["redriven"].as_array().unwrap().len(), 0, "{again}");
    // Each copy is on its first record's partition, and starts again at attempt 1.
    let partitions = kafka::partitions_of(&servers, "orders");
    for id in ["p-1", "p-2"] {
        let of: Vec<i32> = partitions
            .iter()
            .filter(|(message_id, _)| message_id == id)
            .map(|(_, partition)| *partition)
            .collect();
        assert!(of.len() == 2 && of[0] == of[1], "{id}: {partitions:?}");
    }
    let handled = kafka::run(&servers, "orders", true, 2).await;
    assert_eq!(handled, [("p-1".into(), 1), ("p-2".into(), 1)]);

    // A dead letter from a topic the cluster no longer has: refused, kept, and no topic made.
    let headers = [
        ("message-id", "x-1"),
        ("idempotent-topic", "gone"),
        ("idempotent-reason", "poison: from a topic since deleted"),
        ("idempotent-attempts", "1"),
    ];
    kafka::produce(&servers, "orders.dead", "customer-9", "lost", &headers).await;
    for _ in 0..2 {
        let refused = dlq(&[&on_kafka[..], &["redrive", "--message-id", "x-1"]].concat());
        assert_eq!(refused.status.code(), Some(1));
        let sentence = String::from_utf8_lossy(&refused.stderr);
        assert!(
            sentence.contains("gone") && sentence.contains("no such topic"),
            "{sentence}"
        );
    }
    assert_eq!(
        kafka(&["list"])["dead_letters"].as_array().unwrap().len(),
        2
    );

    // A copy the broker refuses: nothing noted, the dead letter kept.
    use idempotent::broker::kafka::rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
    let too_large = RDKafkaRespErr::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE;
    cluster.request_errors(RDKafkaApiKey::Produce, &[too_large]);
    let redrive_d1 = [&on_kafka[..], &["redrive", "--message-id", "d-1"]].concat();
    let refused = dlq(&redrive_d1);
    assert_eq!(refused.status.code(), Some(1));
    let sentence = String::from_utf8_lossy(&refused.stderr);
    assert!(sentence.contains("refused the copy"), "{sentence}");
    let copies = |id: &str| {
        kafka::partitions_of(&servers, "orders")
            .iter()
            .filter(|(message_id, _)| message_id == id)
            .count()
    };
    assert_eq!(copies("d-1"), 1, "no copy of a refused redrive");
    assert_eq!(
        kafka(&["list"])["dead_letters"].as_array().unwrap().len(),
        2
    );
    // A note the broker refuses after its copy: the dead letter stays listed beside its copy, and
    // the next redrive puts it back again (the inbox drops that second copy).
    let no_error = RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR;
    cluster.request_errors(RDKafkaApiKey::Produce, &[no_error, too_large]);
    let unnoted = dlq(&redrive_d1);
    assert_eq!(unnoted.status.code(), Some(1));
    let sentence = String::from_utf8_lossy(&unnoted.stderr);
    assert!(sentence.contains("refused the note"), "{sentence}");
    assert_eq!(copies("d-1"), 2);
    assert_eq!(
        kafka(&["list"])["dead_letters"].as_array().unwrap().len(),
        2
    );
    let moved = kafka(&["redrive", "--message-id", "d-1"]);
    assert_eq!(moved["redriven"].as_array().unwrap().len(), 1, "{moved}");
    assert_eq!(copies("d-1"), 3);
    let left = kafka(&["list"]);
    assert_eq!(left["dead_letters"].as_array().unwrap().len(), 1, "{left}");
    assert_eq!(left["dead_letters"][0]["message_id"], "x-1");

    // A dead-letter topic the cluster does not have: a sentence, not an empty listing.
    let missing = dlq(&[
        "--kafka",
        "nowhere",
        "--kafka-brokers",
        servers.as_str(),
        "list",
    ]);
    assert_eq!(missing.status.code(), Some(1));
    let sentence = String::from_utf8_lossy(&missing.stderr);
    assert!(
        sentence.contains("nowhere") && sentence.contains("no such topic"),
        "{sentence}"
    );
}

/// Runs `idempotent kafka` with `args`.
#[cfg(feature = "kafka")]
fn kafka_command(args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("kafka")
        .args(args)
        .output()
        .expect("run the idempotent binary")
}

#[cfg(feature = "kafka")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_held_partitions_are_listed_retried_and_skipped_from_the_command_line() {
    use idempotent::broker::RetryPolicy;
    use idempotent::broker::kafka::Runner;

    let cluster = kafka::cluster();
    let servers = cluster.bootstrap_servers();
    cluster.create_topic("orders", 1, 1).unwrap();
    for (id, body) in [
        ("ok-1", "fine"),
        ("p-1", "poison"),
        ("ok-2", "fine"),
        ("ok-3", "fine"),
    ] {
        kafka::produce(
            &servers,
            "orders",
            "customer-1",
            body,
            &[("message-id", id)],
        )
        .await;
    }
    let seen = Seen::default();
    let shutdown = Shutdown::new();
    let runner = Runner::new(kafka::client(&servers), "shop", &["orders"], "orders.dead")
        .retry(RetryPolicy::new(1, Duration::from_millis(100)))
        .hold_partition_on_failure()
        .shutdown_on(shutdown.clone());
    let stats = runner.stats();
    let mut workers = Some(handler(&seen, false));
    let running = tokio::spawn(runner.run(move || workers.take().expect("one worker")));
    let until = async |done: &dyn Fn(idempotent::broker::RunnerStats) -> bool| {
        for _ in 0..1200 {
            if done(stats()) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("not reached within 60 s: {:?}", stats());
    };
    until(&|now| now.held == 1 && now.processed == 1).await;

    let group = ["--group", "shop", "--kafka-brokers", servers.as_str()];
    let command = |args: &[&str]| {
        let args = [&group[..], args, &["--json"]].concat();
        let out = tokio::task::block_in_place(|| kafka_command(&args));
        assert!(
            out.status.success(),
            "idempotent kafka {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<Value>(&out.stdout).expect("--json prints JSON")
    };
    let held = command(&["held"]);
    let holds = held["held"].as_array().unwrap();
    assert_eq!(holds.len(), 1, "{held}");
    assert_eq!(
        (
            &holds[0]["topic"],
            &holds[0]["partition"],
            &holds[0]["offset"]
        ),
        (&Value::from("orders"), &Value::from(0), &Value::from(1)),
        "{held}"
    );
    assert_eq!(holds[0]["message_id"], "p-1");
    assert!(
        holds[0]["reason"].as_str().unwrap().contains("poison"),
        "{held}"
    );

    // Retried: its next attempt, which fails again, and it is held again.
    let asked = command(&["retry", "--topic", "orders", "--partition", "0"]);
    assert_eq!(asked["asked"], "retry", "{asked}");
    until(&|now| now.held == 2).await;
    let attempts: Vec<u32> = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|(id, _)| id == "p-1")
        .map(|(_, attempt)| *attempt)
        .collect();
    assert_eq!(attempts, [1, 2]);
    assert_eq!(stats().processed, 1, "nothing after the held record ran");

    // Skipped: dead-lettered with the operator's reason, and the partition goes on.
    let asked = command(&[
        "skip",
        "--topic",
        "orders",
        "--partition",
        "0",
        "--reason",
        "refunded by hand",
    ]);
    assert_eq!(asked["asked"], "skip: refunded by hand", "{asked}");
    until(&|now| now.processed == 3 && now.dead_lettered == 1).await;
    let letters = json(&[
        "--kafka",
        "orders.dead",
        "--kafka-brokers",
        &servers,
        "list",
    ]);
    let letters = letters["dead_letters"].as_array().unwrap();
    assert_eq!(letters.len(), 1);
    let reason = letters[0]["reason"].as_str().unwrap();
    assert!(
        reason.contains("skipped by an operator: refunded by hand") && reason.contains("poison"),
        "{reason}"
    );
    let mut listed = command(&["held"]);
    for _ in 0..100 {
        if listed["held"].as_array().unwrap().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        listed = command(&["held"]);
    }
    assert_eq!(listed["held"].as_array().unwrap().len(), 0, "{listed}");

    // What is not held: exit 2 and a sentence; a group with no holds: the same.
    let again = tokio::task::block_in_place(|| {
        kafka_command(
            &[
                &group[..],
                &[
                    "skip",
                    "--topic",
                    "orders",
                    "--partition",
                    "0",
                    "--reason",
                    "x",
                ],
            ]
            .concat(),
        )
    });
    assert_eq!(again.status.code(), Some(2));
    let sentence = String::from_utf8_lossy(&again.stderr);
    assert!(
        sentence.contains("partition 0 of orders is not held"),
        "{sentence}"
    );
    let none = tokio::task::block_in_place(|| {
        kafka_command(&["--group", "nobody", "--kafka-brokers", &servers, "held"])
    });
    assert_eq!(none.status.code(), Some(2));
    let sentence = String::from_utf8_lossy(&none.stderr);
    assert!(sentence.contains("no runner of group nobody"), "{sentence}");

    shutdown.cancel();
    let stats = running.await.unwrap().unwrap();
    assert_eq!(
        (stats.processed, stats.dead_lettered, stats.held),
        (3, 1, 2)
    );
}
