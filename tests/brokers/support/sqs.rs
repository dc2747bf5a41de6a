//! SQS for the tests: moto's server at `IDEMPOTENT_SQS_URL` (started by `scripts/test`), queues
//! with a redrive policy, messages sent as a producer sends them, what a queue holds, and a proxy
//! whose connection to SQS can be cut.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idempotent::broker::sqs::aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
use idempotent::broker::sqs::aws_sdk_sqs::types::{MessageAttributeValue, QueueAttributeName};
use idempotent::broker::sqs::aws_sdk_sqs::{self, Client};
use idempotent::broker::sqs::{ATTEMPTS_ATTRIBUTE, MESSAGE_ID_ATTRIBUTE, REASON_ATTRIBUTE};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use super::{Kind, Order};

pub fn sqs_url() -> String {
    std::env::var("IDEMPOTENT_SQS_URL").expect(
        "IDEMPOTENT_SQS_URL is not set: run the tests with scripts/test, which starts a local SQS",
    )
}

/// A client of the SQS at `endpoint`, over plain HTTP, with the test's credentials.
pub fn client_at(endpoint: &str) -> Client {
    let config = aws_sdk_sqs::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(endpoint)
        .credentials_provider(Credentials::new("test", "test", None, None, "tests"))
        .http_client(aws_smithy_http_client::Builder::new().build_http())
        .build();
    Client::from_conf(config)
}

pub fn client() -> Client {
    client_at(&sqs_url())
}

/// A fresh queue and its dead-letter queue: (queue URL, dead-letter queue URL).
pub async fn queues(
    client: &Client,
    visibility: Duration,
    max_receive_count: u32,
) -> (String, String) {
    let id = uuid::Uuid::new_v4().simple().to_string();
    let dead = create(client, &format!("{id}-dead"), HashMap::new()).await;
    let redrive = redrive_to(client, &dead, max_receive_count).await;
    let queue = create(
        client,
        &id,
        HashMap::from([
            (
                QueueAttributeName::VisibilityTimeout,
                visibility.as_secs().to_string(),
            ),
            (QueueAttributeName::RedrivePolicy, redrive),
        ]),
    )
    .await;
    (queue, dead)
}

/// The redrive policy that moves a message to the queue at `dead` after `max_receive_count`
/// receives.
pub async fn redrive_to(client: &Client, dead: &str, max_receive_count: u32) -> String {
    let arn = client
        .get_queue_attributes()
        .queue_url(dead)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await
        .unwrap()
        .attributes()
        .unwrap()[&QueueAttributeName::QueueArn]
        .clone();
    format!(r#"{{"deadLetterTargetArn":"{arn}","maxReceiveCount":"{max_receive_count}"}}"#)
}

pub async fn create(
    client: &Client,
    name: &str,
    attributes: HashMap<QueueAttributeName, String>,
) -> String {
    client
        .create_queue()
        .queue_name(name)
        .set_attributes(Some(attributes))
        .send()
        .await
        .unwrap()
        .queue_url()
        .unwrap()
        .to_owned()
}

fn text(value: &str) -> MessageAttributeValue {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()
        .unwrap()
}

/// Sends an order of `kind` with the message id `id` (none: a message without a key).
pub async fn send(client: &Client, queue: &str, id: Option<&str>, kind: Kind) {
    send_raw(
        client,
        queue,
        id,
        &String::from_utf8(Order::payload(kind)).unwrap(),
    )
    .await
}

/// Sends `body` with the message id `id`.
pub async fn send_raw(client: &Client, queue: &str, id: Option<&str>, body: &str) {
    let mut send = client.send_message().queue_url(queue).message_body(body);
    if let Some(id) = id {
        send = send.message_attributes(MESSAGE_ID_ATTRIBUTE, text(id));
    }
    send.send().await.unwrap();
}

/// How many messages the queue holds, visible or in flight.
pub async fn depth(client: &Client, queue: &str) -> u64 {
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
        QueueAttributeName::ApproximateNumberOfMessagesDelayed,
    ]
    .iter()
    .map(|name| attributes[name].parse::<u64>().unwrap())
    .sum()
}

/// A dead letter as the runner sent it.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    pub message_id: Option<String>,
    pub reason: String,
    pub attempts: String,
    pub body: String,
}

/// Takes every message of the dead-letter queue (deleting them).
pub async fn dead_letters(client: &Client, queue: &str) -> Vec<DeadLetter> {
    let mut letters = Vec::new();
    loop {
        let received = client
            .receive_message()
            .queue_url(queue)
            .max_number_of_messages(10)
            .wait_time_seconds(1)
            .message_attribute_names("All")
            .send()
            .await
            .unwrap();
        let messages = received.messages.unwrap_or_default();
        if messages.is_empty() {
            return letters;
        }
        for message in messages {
            let attributes = message.message_attributes().cloned().unwrap_or_default();
            let attribute = |name: &str| {
                attributes
                    .get(name)
                    .and_then(|value| value.string_value())
                    .map(str::to_owned)
            };
            letters.push(DeadLetter {
                message_id: attribute(MESSAGE_ID_ATTRIBUTE),
                reason: attribute(REASON_ATTRIBUTE).unwrap_or_default(),
                attempts: attribute(ATTEMPTS_ATTRIBUTE).unwrap_or_default(),
                body: message.body().unwrap_or_default().to_owned(),
            });
            client
                .delete_message()
                .queue_url(queue)
                .receipt_handle(message.receipt_handle().unwrap())
                .send()
                .await
                .unwrap();
        }
    }
}

/// A TCP proxy on loopback in front of SQS, whose connections can be cut: while it is cut, it
/// closes what it has and every connection it is offered.
pub struct Proxy {
    pub endpoint: String,
    cut: Arc<AtomicBool>,
    connections: Arc<tokio::sync::Mutex<JoinSet<()>>>,
}

impl Proxy {
    pub async fn start() -> Self {
        let upstream = sqs_url()
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_owned();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let cut = Arc::new(AtomicBool::new(false));
        let connections = Arc::new(tokio::sync::Mutex::new(JoinSet::new()));
        let (is_cut, held) = (cut.clone(), connections.clone());
        tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    return;
                };
                if is_cut.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                let upstream = upstream.clone();
                held.lock().await.spawn(async move {
                    if let Ok(mut server) = TcpStream::connect(upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
            }
        });
        Self {
            endpoint,
            cut,
            connections,
        }
    }

    /// Cuts every connection, and refuses new ones until [`mend`](Self::mend).
    pub async fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        self.connections.lock().await.abort_all();
    }

    pub fn mend(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

/// Waits `for_` with the proxy cut.
pub async fn cut_for(proxy: &Proxy, for_: Duration) {
    proxy.cut().await;
    tokio::time::sleep(for_).await;
    proxy.mend();
}
