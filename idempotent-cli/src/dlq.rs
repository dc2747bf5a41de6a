//! `idempotent dlq`: a broker's dead letters listed, shown and put back where they came from, on
//! SQS (feature `sqs`), RabbitMQ (feature `rabbitmq`) and NATS JetStream (feature `nats`), all on
//! by default, and Kafka (feature `kafka`, which builds librdkafka: a C compiler and `make`).

use std::time::{Duration, SystemTime};

use clap::{Args, Subcommand};
use idempotent::broker::{BrokerError, DeadLetter, DeadLetterFilter};

use idempotent::{Backend, Inbox};

use crate::output::Output;
use crate::{Failure, args, fail};

/// Which dead-letter queue: one of `--sqs`, `--sqs-dlq`, `--rabbitmq`, `--rabbitmq-dlq`, `--nats`,
/// `--kafka`.
#[derive(Args, Debug)]
pub(crate) struct Queue {
    /// The SQS queue whose dead letters to look at: its redrive policy names its dead-letter
    /// queue. Credentials and region come from the environment (AWS_ACCESS_KEY_ID,
    /// AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION).
    #[cfg(feature = "sqs")]
    #[arg(long, value_name = "QUEUE_URL")]
    sqs: Option<String>,
    /// The SQS dead-letter queue itself, instead of the queue whose redrive policy names it.
    #[cfg(feature = "sqs")]
    #[arg(long, value_name = "QUEUE_URL")]
    sqs_dlq: Option<String>,
    /// SQS's endpoint, for a local SQS (http:// works); by default AWS_ENDPOINT_URL_SQS or
    /// AWS_ENDPOINT_URL, else AWS's own for the region.
    #[cfg(feature = "sqs")]
    #[arg(long, value_name = "URL")]
    sqs_endpoint: Option<String>,
    /// The RabbitMQ queue whose dead letters to look at: the runner's `<queue>.dead`.
    #[cfg(feature = "rabbitmq")]
    #[arg(long, value_name = "QUEUE")]
    rabbitmq: Option<String>,
    /// The RabbitMQ dead-letter queue itself (the runner's `dead_letters` when you named one).
    #[cfg(feature = "rabbitmq")]
    #[arg(long, value_name = "QUEUE")]
    rabbitmq_dlq: Option<String>,
    /// The RabbitMQ broker.
    #[cfg(feature = "rabbitmq")]
    #[arg(
        long,
        env = "AMQP_URL",
        default_value = "amqp://127.0.0.1:5672/%2f",
        hide_env_values = true
    )]
    amqp_url: String,
    /// The JetStream subject the runner dead-letters to (its `dead_letters`), read from the stream
    /// that captures it.
    #[cfg(feature = "nats")]
    #[arg(long, value_name = "SUBJECT")]
    nats: Option<String>,
    /// The NATS server.
    #[cfg(feature = "nats")]
    #[arg(
        long,
        env = "NATS_URL",
        default_value = "nats://127.0.0.1:4222",
        hide_env_values = true
    )]
    nats_url: String,
    /// The Kafka topic the runner dead-letters to (its `dead_letters`); what was put back is noted
    /// on `<TOPIC>.redriven`, since Kafka deletes no record.
    #[cfg(feature = "kafka")]
    #[arg(long, value_name = "TOPIC")]
    kafka: Option<String>,
    /// The Kafka cluster's bootstrap servers (host:port, comma-separated).
    #[cfg(feature = "kafka")]
    #[arg(long, env = "KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    kafka_brokers: String,
    /// The header the Kafka runner reads the message id from (its `message_id_header`).
    #[cfg(feature = "kafka")]
    #[arg(long, value_name = "HEADER", default_value = "message-id")]
    kafka_message_id_header: String,
    #[command(subcommand)]
    command: DlqCommand,
}

/// A dead-letter queue of one of the brokers.
enum DeadLetterQueue {
    #[cfg(feature = "sqs")]
    Sqs(idempotent::broker::sqs::DeadLetterQueue),
    #[cfg(feature = "rabbitmq")]
    RabbitMq(idempotent::broker::rabbitmq::DeadLetterQueue),
    #[cfg(feature = "nats")]
    Nats(Box<idempotent::broker::nats::DeadLetterQueue>),
    #[cfg(feature = "kafka")]
    Kafka(idempotent::broker::kafka::DeadLetterQueue),
}

impl DeadLetterQueue {
    /// The queue the command line names (exactly one).
    async fn of(queue: &Queue) -> Result<Self, Failure> {
        let named = [
            #[cfg(feature = "sqs")]
            queue.sqs.is_some(),
            #[cfg(feature = "sqs")]
            queue.sqs_dlq.is_some(),
            #[cfg(feature = "rabbitmq")]
            queue.rabbitmq.is_some(),
            #[cfg(feature = "rabbitmq")]
            queue.rabbitmq_dlq.is_some(),
            #[cfg(feature = "nats")]
            queue.nats.is_some(),
            #[cfg(feature = "kafka")]
            queue.kafka.is_some(),
        ];
        match named.iter().filter(|named| **named).count() {
            1 => {}
            0 => {
                return Err(fail(format!(
                    "name the dead-letter queue: {}",
                    queue_options()
                )));
            }
            _ => {
                return Err(fail(format!(
                    "one dead-letter queue at a time: {}",
                    queue_options()
                )));
            }
        }
        #[cfg(feature = "sqs")]
        if let Some(dlq) = &queue.sqs_dlq {
            let client = sqs_client(queue.sqs_endpoint.as_deref())?;
            return Ok(Self::Sqs(idempotent::broker::sqs::DeadLetterQueue::new(
                client, dlq,
            )));
        }
        #[cfg(feature = "sqs")]
        if let Some(source) = &queue.sqs {
            let client = sqs_client(queue.sqs_endpoint.as_deref())?;
            let found = idempotent::broker::sqs::DeadLetterQueue::of_queue(client, source);
            return Ok(Self::Sqs(answer_within(found, source).await??));
        }
        #[cfg(feature = "nats")]
        if let Some(subject) = &queue.nats {
            let connected =
                idempotent::broker::nats::DeadLetterQueue::connect(&queue.nats_url, subject);
            return Ok(Self::Nats(Box::new(
                answer_within(connected, "NATS").await??,
            )));
        }
        #[cfg(feature = "rabbitmq")]
        if let Some(name) = match (&queue.rabbitmq, &queue.rabbitmq_dlq) {
            (_, Some(dlq)) => Some(dlq.clone()),
            (Some(source), None) => Some(format!("{source}.dead")),
            (None, None) => None,
        } {
            let connected =
                idempotent::broker::rabbitmq::DeadLetterQueue::connect(&queue.amqp_url, name);
            return Ok(Self::RabbitMq(answer_within(connected, "RabbitMQ").await??));
        }
        #[cfg(feature = "kafka")]
        if let Some(topic) = &queue.kafka {
            let mut client = idempotent::broker::kafka::ClientConfig::new();
            client.set("bootstrap.servers", &queue.kafka_brokers);
            return Ok(Self::Kafka(
                idempotent::broker::kafka::DeadLetterQueue::new(client, topic)
                    .message_id_header(&queue.kafka_message_id_header),
            ));
        }
        unreachable!("one queue is named")
    }

    fn name(&self) -> &str {
        match self {
            #[cfg(feature = "sqs")]
            Self::Sqs(queue) => queue.url(),
            #[cfg(feature = "rabbitmq")]
            Self::RabbitMq(queue) => queue.queue(),
            #[cfg(feature = "nats")]
            Self::Nats(queue) => queue.subject(),
            #[cfg(feature = "kafka")]
            Self::Kafka(queue) => queue.topic(),
        }
    }

    async fn list(&self, filter: &DeadLetterFilter) -> Result<Vec<DeadLetter>, BrokerError> {
        match self {
            #[cfg(feature = "sqs")]
            Self::Sqs(queue) => queue.list(filter).await,
            #[cfg(feature = "rabbitmq")]
            Self::RabbitMq(queue) => queue.list(filter).await,
            #[cfg(feature = "nats")]
            Self::Nats(queue) => queue.list(filter).await,
            #[cfg(feature = "kafka")]
            Self::Kafka(queue) => queue.list(filter).await,
        }
    }

    async fn redrive(
        &self,
        filter: &DeadLetterFilter,
        dry_run: bool,
    ) -> Result<Vec<DeadLetter>, BrokerError> {
        match self {
            #[cfg(feature = "sqs")]
            Self::Sqs(queue) => queue.redrive(filter, dry_run).await,
            #[cfg(feature = "rabbitmq")]
            Self::RabbitMq(queue) => queue.redrive(filter, dry_run).await,
            #[cfg(feature = "nats")]
            Self::Nats(queue) => queue.redrive(filter, dry_run).await,
            #[cfg(feature = "kafka")]
            Self::Kafka(queue) => queue.redrive(filter, dry_run).await,
        }
    }
}

/// The options that name a dead-letter queue, for the sentence that asks for one.
fn queue_options() -> String {
    let options: &[&str] = &[
        #[cfg(feature = "sqs")]
        "--sqs QUEUE_URL or --sqs-dlq QUEUE_URL (SQS)",
        #[cfg(feature = "rabbitmq")]
        "--rabbitmq QUEUE or --rabbitmq-dlq QUEUE (RabbitMQ)",
        #[cfg(feature = "nats")]
        "--nats SUBJECT (NATS JetStream)",
        #[cfg(feature = "kafka")]
        "--kafka TOPIC (Kafka)",
    ];
    options.join(", ")
}

/// The audit line of a dead letter put back from `queue` that was dead-lettered for `reason`: at
/// most the 1000 bytes an audit reason holds.
fn audit_reason(queue: &str, reason: &str) -> String {
    let mut line = format!("put back from {queue}; it was dead-lettered: {reason}");
    if line.len() > 1000 {
        let mut end = 997;
        while !line.is_char_boundary(end) {
            end -= 1;
        }
        line.truncate(end);
        line.push('…');
    }
    line
}

/// How long the tool waits for a broker to answer at first.
#[cfg(any(feature = "sqs", feature = "rabbitmq", feature = "nats"))]
const ANSWER_WITHIN: Duration = Duration::from_secs(30);

/// `future`'s output, or a sentence when `broker` did not answer in time.
#[cfg(any(feature = "sqs", feature = "rabbitmq", feature = "nats"))]
async fn answer_within<T>(future: impl Future<Output = T>, broker: &str) -> Result<T, Failure> {
    tokio::time::timeout(ANSWER_WITHIN, future)
        .await
        .map_err(|_| {
            fail(format!(
                "{broker} did not answer within {} s",
                ANSWER_WITHIN.as_secs()
            ))
        })
}

#[derive(Subcommand, Debug)]
enum DlqCommand {
    /// The dead letters, oldest first, with their reason, attempts, age and source.
    List {
        #[command(flatten)]
        filter: FilterArgs,
    },
    /// The dead letters of one message id, with their headers and payload.
    Show {
        /// The message id (SQS: the `message-id` attribute; RabbitMQ: the `message_id` property;
        /// NATS: the `Nats-Msg-Id` header; Kafka: the `message-id` header).
        #[arg(long)]
        message_id: String,
    },
    /// Put dead letters back on the queues they came from, with their message id kept (so that
    /// the consumer's inbox drops those already processed) and their attempts starting again;
    /// prints a line per message.
    Redrive {
        #[command(flatten)]
        filter: FilterArgs,
        /// Only say which it would put back.
        #[arg(long)]
        dry_run: bool,
        /// The consumer of the queue: a line per message put back goes into its inbox's audit
        /// (`idempotent audit`), saying whether the inbox had processed it; needs --url.
        #[arg(long)]
        consumer: Option<String>,
    },
}

/// Which dead letters.
#[derive(Args, Debug)]
struct FilterArgs {
    /// Only those whose reason contains this text (ignoring case).
    #[arg(long)]
    reason: Option<String>,
    /// Only those dead-lettered at least this long ago (2d, 36h, 90m).
    #[arg(long, value_parser = args::duration)]
    older_than: Option<Duration>,
    /// Only those dead-lettered less than this long ago.
    #[arg(long, value_parser = args::duration)]
    newer_than: Option<Duration>,
    /// Only those of this message id.
    #[arg(long)]
    message_id: Option<String>,
    /// At most this many (at least 1).
    #[arg(long, value_parser = args::limit)]
    limit: Option<usize>,
}

impl FilterArgs {
    fn filter(&self) -> DeadLetterFilter {
        let mut filter = DeadLetterFilter::new();
        if let Some(reason) = &self.reason {
            filter = filter.reason_contains(reason);
        }
        if let Some(age) = self.older_than {
            filter = filter.older_than(age);
        }
        if let Some(age) = self.newer_than {
            filter = filter.newer_than(age);
        }
        if let Some(id) = &self.message_id {
            filter = filter.message_id(id);
        }
        if let Some(limit) = self.limit {
            filter = filter.limit(limit);
        }
        filter
    }
}

/// Whether the command writes to an inbox's audit, and so needs the database.
pub(crate) fn needs_inbox(queue: &Queue) -> bool {
    matches!(
        &queue.command,
        DlqCommand::Redrive {
            consumer: Some(_),
            dry_run: false,
            ..
        }
    )
}

/// Runs `idempotent dlq …`, writing a redrive's audit lines to `inbox`.
pub(crate) async fn run<DB: Backend>(
    queue: Box<Queue>,
    out: Output,
    inbox: Option<&Inbox<DB>>,
) -> Result<(), Failure> {
    let dead_letters = DeadLetterQueue::of(&queue).await?;
    let now = SystemTime::now();
    match queue.command {
        DlqCommand::List { filter } => {
            out.dead_letters(&dead_letters.list(&filter.filter()).await?, now)
        }
        DlqCommand::Show { message_id } => {
            let filter = DeadLetterFilter::new().message_id(&message_id);
            let letters = dead_letters.list(&filter).await?;
            if letters.is_empty() {
                return Err(Failure::NotFound(format!(
                    "no dead letter of message id {message_id:?} in {}",
                    dead_letters.name()
                )));
            }
            out.dead_letters_in_full(&letters, now)
        }
        DlqCommand::Redrive {
            filter,
            dry_run,
            consumer,
        } => {
            let moved = dead_letters.redrive(&filter.filter(), dry_run).await?;
            let mut processed = Vec::with_capacity(moved.len());
            if let (Some(inbox), Some(consumer), false) = (inbox, &consumer, dry_run) {
                for letter in &moved {
                    let Some(message_id) = &letter.message_id else {
                        processed.push(None);
                        continue;
                    };
                    let said = letter.reason.as_deref().unwrap_or("moved by the broker");
                    let reason = audit_reason(dead_letters.name(), said);
                    processed.push(
                        inbox
                            .audit_redrive(consumer, message_id.as_str(), &reason)
                            .await?,
                    );
                }
            }
            out.redriven(&moved, dry_run, &processed)
        }
    }
    Ok(())
}

/// An SQS client: the endpoint given or the environment's, the environment's credentials and
/// region, HTTPS (or plain HTTP to a local SQS) through rustls.
#[cfg(feature = "sqs")]
fn sqs_client(
    endpoint: Option<&str>,
) -> Result<idempotent::broker::sqs::aws_sdk_sqs::Client, Failure> {
    use aws_smithy_http_client::tls::{Provider, rustls_provider::CryptoMode};
    use idempotent::broker::sqs::aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
    use idempotent::broker::sqs::aws_sdk_sqs::{self, Client};
    let env = |name: &str| std::env::var(name).ok().filter(|value| !value.is_empty());
    let region = env("AWS_REGION")
        .or_else(|| env("AWS_DEFAULT_REGION"))
        .unwrap_or_else(|| "us-east-1".into());
    let (Some(key), Some(secret)) = (env("AWS_ACCESS_KEY_ID"), env("AWS_SECRET_ACCESS_KEY")) else {
        return Err(fail(
            "no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and \
             AWS_SESSION_TOKEN for temporary ones)",
        ));
    };
    let credentials = Credentials::new(key, secret, env("AWS_SESSION_TOKEN"), None, "environment");
    let http = aws_smithy_http_client::Builder::new()
        .tls_provider(Provider::Rustls(CryptoMode::Ring))
        .build_https();
    let mut config = aws_sdk_sqs::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new(region))
        .credentials_provider(credentials)
        .http_client(http);
    let endpoint = endpoint
        .map(str::to_owned)
        .or_else(|| env("AWS_ENDPOINT_URL_SQS"))
        .or_else(|| env("AWS_ENDPOINT_URL"));
    if let Some(endpoint) = endpoint {
        config = config.endpoint_url(endpoint);
    }
    Ok(Client::from_conf(config.build()))
}

/// What `list` prints of a dead letter's age.
pub(crate) fn age(letter: &DeadLetter, now: SystemTime) -> String {
    match letter.age(now) {
        None => "?".into(),
        Some(age) if age < Duration::from_secs(120) => format!("{}s", age.as_secs()),
        Some(age) if age < Duration::from_secs(2 * 3600) => format!("{}m", age.as_secs() / 60),
        Some(age) if age < Duration::from_secs(2 * 86400) => format!("{}h", age.as_secs() / 3600),
        Some(age) => format!("{}d", age.as_secs() / 86400),
    }
}

impl Output {
    fn letter_json(letter: &DeadLetter, now: SystemTime, in_full: bool) -> serde_json::Value {
        let mut value = serde_json::json!({
            "id": letter.id,
            "message_id": letter.message_id,
            "reason": letter.reason,
            "attempts": letter.attempts,
            "source": letter.source,
            "dead_lettered_at": crate::output::time(letter.dead_lettered_at),
            "age_seconds": letter.age(now).map(|age| age.as_secs()),
            "payload_bytes": letter.payload.len(),
        });
        if in_full {
            value["headers"] = letter
                .headers
                .iter()
                .map(|(name, value)| (name.clone(), serde_json::Value::from(value.as_str())))
                .collect::<serde_json::Map<_, _>>()
                .into();
            value["payload"] = String::from_utf8_lossy(&letter.payload).into();
        }
        value
    }

    /// Prints dead letters, a line each.
    pub(crate) fn dead_letters(&self, letters: &[DeadLetter], now: SystemTime) {
        if self.json {
            let letters: Vec<_> = letters
                .iter()
                .map(|letter| Self::letter_json(letter, now, false))
                .collect();
            return crate::output::print_json(serde_json::json!({ "dead_letters": letters }));
        }
        let rows: Vec<Vec<String>> = letters
            .iter()
            .map(|letter| {
                vec![
                    letter.message_id.clone().unwrap_or_else(|| "-".into()),
                    age(letter, now),
                    letter
                        .attempts
                        .map_or_else(|| "-".into(), |n| n.to_string()),
                    letter.source.clone().unwrap_or_else(|| "-".into()),
                    one_line(
                        letter
                            .reason
                            .as_deref()
                            .unwrap_or("- (moved by the broker)"),
                    ),
                ]
            })
            .collect();
        crate::output::table(
            &["MESSAGE ID", "AGE", "ATTEMPTS", "SOURCE", "REASON"],
            &rows,
        );
        println!("{} dead letters", letters.len());
    }

    /// Prints dead letters with their headers and payloads.
    pub(crate) fn dead_letters_in_full(&self, letters: &[DeadLetter], now: SystemTime) {
        if self.json {
            let letters: Vec<_> = letters
                .iter()
                .map(|letter| Self::letter_json(letter, now, true))
                .collect();
            return crate::output::print_json(serde_json::json!({ "dead_letters": letters }));
        }
        for letter in letters {
            println!("dead letter {}", letter.id);
            println!(
                "  message id  {}",
                letter.message_id.as_deref().unwrap_or("-")
            );
            println!("  reason      {}", letter.reason.as_deref().unwrap_or("-"));
            println!(
                "  attempts    {}",
                letter
                    .attempts
                    .map_or_else(|| "-".into(), |n| n.to_string())
            );
            println!("  source      {}", letter.source.as_deref().unwrap_or("-"));
            println!("  age         {}", age(letter, now));
            for (name, value) in &letter.headers {
                println!("  header      {name}: {value}");
            }
            println!(
                "  payload     {}",
                one_line(&String::from_utf8_lossy(&letter.payload))
            );
        }
    }

    /// Prints the dead letters a redrive put back (or, with `dry_run`, would), a line each.
    /// `processed`, when the audit lines were written: when the inbox had processed each, if it
    /// had.
    pub(crate) fn redriven(
        &self,
        letters: &[DeadLetter],
        dry_run: bool,
        processed: &[Option<SystemTime>],
    ) {
        let processed_at = |n: usize| processed.get(n).copied().flatten();
        if self.json {
            let letters: Vec<_> = letters
                .iter()
                .enumerate()
                .map(|(n, letter)| {
                    serde_json::json!({
                        "id": letter.id,
                        "message_id": letter.message_id,
                        "to": letter.source,
                        "reason": letter.reason,
                        "audited": n < processed.len(),
                        "processed_at": crate::output::time(processed_at(n)),
                    })
                })
                .collect();
            return crate::output::print_json(
                serde_json::json!({ "dry_run": dry_run, "redriven": letters }),
            );
        }
        let verb = if dry_run {
            "would put back"
        } else {
            "put back"
        };
        for (n, letter) in letters.iter().enumerate() {
            let done = match processed_at(n) {
                Some(at) => format!(
                    "; processed at {}, so the inbox drops it",
                    crate::args::rfc3339(at)
                ),
                None => String::new(),
            };
            println!(
                "{verb} {} to {} (was: {}){done}",
                letter.message_id.as_deref().unwrap_or("-"),
                letter.source.as_deref().unwrap_or("-"),
                one_line(letter.reason.as_deref().unwrap_or("-"))
            );
        }
        println!("{} dead letters {verb}", letters.len());
    }
}

/// `text` on one line, at most 200 characters.
fn one_line(text: &str) -> String {
    let line: String = text.replace(['\n', '\r'], " ");
    match line.char_indices().nth(200) {
        Some((end, _)) => format!("{}…", &line[..end]),
        None => line,
    }
}
