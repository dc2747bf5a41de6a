//! `idempotent`: look at and steer an idempotent-inbox from the shell, on PostgreSQL, SQLite or
//! MySQL/MariaDB, by URL.
//!
//! ```text
//! idempotent --url postgres://… migrate                  create or upgrade the tables
//! idempotent --url postgres://… --schema acme,globex migrate   each tenant's schema's tables
//! idempotent --url mysql://…/acme --url mysql://…/globex migrate   each tenant's database's
//! idempotent --url postgres://… --schema acme stats     any command (ddl too), on one tenant's schema
//! idempotent --url postgres://… ddl [--from 1]           print the SQL instead (no connection)
//! idempotent --url … stats                               rows, oldest row, horizon, calls per consumer
//! idempotent --url … inspect --consumer orders --key order-7
//! idempotent --url … inspect --consumer orders --since 2d --limit 50 [--after CURSOR]
//! idempotent --url … stuck [--consumer orders]           pending calls whose lease ran out
//! idempotent --url … forget --consumer orders --key order-7 --reason "…"
//! idempotent --url … audit [--consumer orders]           messages forgotten on purpose
//! idempotent --url … purge --retention 14d [--consumer-retention billing=30d] [--dry-run]
//! idempotent --url … outbox stats                        outgoing messages pending, sent, parked, skipped
//! idempotent --url … outbox parked [--limit 100] [--after ROW]
//! idempotent --url … outbox held [--limit 100] [--after ROW]   keys held by a parked message
//! idempotent --url … outbox show --row 42 | --message-id ID
//! idempotent --url … outbox retry --row 42               publish a parked message again
//! idempotent --url … outbox skip --row 42                give a parked message up: never published
//! idempotent dlq --sqs QUEUE_URL list [--reason poison] [--older-than 1h] [--limit 50]
//! idempotent dlq --sqs QUEUE_URL show --message-id ID    a dead letter's headers and payload
//! idempotent dlq --sqs QUEUE_URL redrive [--reason …] [--older-than …] [--dry-run] [--consumer C --url …]
//! idempotent dlq --rabbitmq payments [--amqp-url amqp://…] list | show | redrive   (payments.dead)
//! idempotent dlq --nats PAYMENTS.dead [--nats-url nats://…] list | show | redrive
//! idempotent dlq --kafka payments.dead [--kafka-brokers host:9092] list | show | redrive   (feature kafka)
//! idempotent kafka --group ledger [--kafka-brokers host:9092] held      partitions held at a failed record
//! idempotent kafka --group ledger retry --topic payments --partition 3  run its record again now
//! idempotent kafka --group ledger skip --topic payments --partition 3 --reason "…"   dead-letter it, go on
//! ```
//!
//! Tables for people by default, `--json` for scripts. Exit status: 0, 1 on an error (a wrong
//! command line too), 2 when the message to inspect or forget is not in the inbox (or the outgoing
//! message to show, retry or skip is not in the outbox, or not parked, or the dead letter to show is
//! not in the dead-letter queue, or the Kafka partition to retry or skip is not held).
//!
//! `dlq` needs no database: it reads the dead-letter queue that an SQS queue's redrive policy names
//! (`--sqs`, or the dead-letter queue itself with `--sqs-dlq`), with the credentials and region of
//! the environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`;
//! `--sqs-endpoint` or `AWS_ENDPOINT_URL_SQS` for a local SQS). `redrive` sends each dead letter
//! taken back to its queue with its body and attributes (its message id among them, so the
//! consumer's inbox drops those already processed) and deletes it from the dead-letter queue: it
//! starts again at attempt 1. Reading an SQS queue is receiving from it: while `list` or `redrive`
//! runs, the dead letters are hidden from other readers, and visible again when it ends. On
//! RabbitMQ (`--rabbitmq QUEUE`: the runner's `QUEUE.dead`; `--amqp-url` or `AMQP_URL`) the same,
//! with `basic.get` on a channel of its own whose close gives back what it did not move. On NATS
//! JetStream (`--nats SUBJECT`: the runner's dead-letter subject; `--nats-url` or `NATS_URL`) it
//! reads the subject from the stream that captures it with a consumer of its own that acknowledges
//! nothing, and deletes a dead letter from that stream once JetStream stored it again on its
//! subject. Within the source stream's duplicate window JetStream drops a message published again
//! with the same `Nats-Msg-Id`: the redrive stops there, says so, and keeps that dead letter. On
//! Kafka (`--kafka TOPIC`: the runner's dead-letter topic; `--kafka-brokers` or `KAFKA_BROKERS`;
//! the CLI's feature `kafka`, off by default since it builds librdkafka) it reads every partition
//! of the topic without joining a group, and since Kafka deletes no record it notes each dead
//! letter it put back on `TOPIC.redriven`, which later listings leave out; the copy goes to its
//! topic with its key (so to the same partition) before the note.
//!
//! - The tool connects once before anything else and reports why it could not (`Connection
//!   refused`), each cause of an error once. On SQLite only `migrate` creates the database file:
//!   other commands on a path with no database fail with "no database at …".
//! - `purge` refuses a retention under a minute unless `--yes-delete-recent` is given (`--dry-run`
//!   counts without it): it would delete the record of messages whose redeliveries may still come.
//! - `forget` forgets only a committed record and never waits for a handler: a key claimed by a
//!   transaction still open has no committed record yet, which it says at once (exit 2), on every
//!   database.
//! - Bad values are refused with a sentence: a time too far back, a `--consumer-retention` without
//!   a consumer, a `--limit` of 0, a `ddl --from` version that does not exist.
#![warn(missing_docs, unreachable_pub)]

mod args;
#[cfg(any(
    feature = "sqs",
    feature = "rabbitmq",
    feature = "nats",
    feature = "kafka"
))]
mod dlq;
#[cfg(feature = "kafka")]
mod kafka;
mod output;

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use idempotent::sqlx::{self, MySql, Postgres, Sqlite};
use idempotent::{Backend, Inbox, Listing, MessageKey, TableName};

use crate::args::{ConsumerRetention, KeyPart, Time};
use crate::output::Output;

/// Look at and steer an idempotent inbox.
#[derive(Parser, Debug)]
#[command(name = "idempotent", version, about)]
struct Cli {
    /// The database: postgres://…, sqlite://path or sqlite::memory:, mysql://… (or mariadb://…).
    /// `migrate` takes several (`--url A --url B`: a tenant's database each).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, global = true)]
    url: Vec<String>,
    /// The inbox table, as configured with `Inbox::with_table`.
    #[arg(long, default_value = TableName::DEFAULT, global = true)]
    table: String,
    /// PostgreSQL: the schema the inbox's tables are in, as configured with
    /// `Inbox::with_schema` (a tenant's). `migrate` takes several (`--schema a,b` or
    /// `--schema a --schema b`), and migrates each in every `--url`.
    #[arg(long, value_delimiter = ',', global = true)]
    schema: Vec<String>,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Create the inbox's tables, or upgrade tables made by an older version.
    Migrate,
    /// Print the SQL that creates (or upgrades) the tables, for your own migrations; only the
    /// URL's scheme is read, nothing connects.
    Ddl {
        /// The schema version the tables have now (0: none yet, up to the latest); nothing to
        /// print when they have the latest.
        #[arg(long, default_value_t = 0)]
        from: u32,
    },
    /// Rows, oldest row, purge horizon, pending and stuck calls, per consumer.
    Stats,
    /// One message's record (`--key`), or a consumer's records, oldest first, page by page.
    Inspect {
        /// The consumer.
        #[arg(long)]
        consumer: String,
        #[command(flatten)]
        key: KeyArgs,
        /// Only records processed at or after this time (RFC 3339, or a duration ago: 2d, 36h).
        #[arg(long)]
        since: Option<Time>,
        /// Only records processed before this time.
        #[arg(long)]
        until: Option<Time>,
        /// The cursor the previous page printed.
        #[arg(long)]
        after: Option<idempotent::Cursor>,
        /// Records per page (at least 1).
        #[arg(long, default_value_t = 100, value_parser = args::limit)]
        limit: usize,
    },
    /// Calls to outside services still pending after their lease ran out.
    Stuck {
        /// Only this consumer's.
        #[arg(long)]
        consumer: Option<String>,
        /// At most this many (at least 1).
        #[arg(long, default_value_t = 100, value_parser = args::limit)]
        limit: usize,
    },
    /// Forget a message on purpose, so that its next delivery is processed again; writes an
    /// audit row. Only a committed record is forgotten, without waiting: a key a handler holds
    /// (claimed, not committed) has none yet, which exits with 2.
    Forget {
        /// The consumer.
        #[arg(long)]
        consumer: String,
        #[command(flatten)]
        key: KeyArgs,
        /// Why: kept in the audit row.
        #[arg(long)]
        reason: String,
    },
    /// The messages forgotten on purpose, newest first.
    Audit {
        /// Only this consumer's.
        #[arg(long)]
        consumer: Option<String>,
        /// At most this many (at least 1).
        #[arg(long, default_value_t = 100, value_parser = args::limit)]
        limit: usize,
    },
    /// Delete expired rows, call records and audit rows (or, with --dry-run, count them).
    /// Retentions under 1m are refused unless --yes-delete-recent is given.
    Purge {
        /// The retention your services run with (14d unless they configure another).
        #[arg(long, value_parser = args::duration)]
        retention: Duration,
        /// A consumer's own retention: NAME=DURATION; repeat for several.
        #[arg(long)]
        consumer_retention: Vec<ConsumerRetention>,
        /// Rows per transaction.
        #[arg(long, default_value_t = 1000)]
        batch_size: usize,
        /// How long sent outgoing messages are kept (24h unless your services configure another).
        #[arg(long, value_parser = args::duration)]
        outbox_retention: Option<Duration>,
        /// Count what would be deleted, delete nothing.
        #[arg(long)]
        dry_run: bool,
        /// Delete with a retention under 1m (--retention, --consumer-retention or
        /// --outbox-retention): the records of messages processed that recently go, and a
        /// redelivery of one of them runs again.
        #[arg(long)]
        yes_delete_recent: bool,
    },
    /// A broker's dead letters: list them, show one, put them back where they came from (no
    /// database needed).
    #[cfg(any(
        feature = "sqs",
        feature = "rabbitmq",
        feature = "nats",
        feature = "kafka"
    ))]
    Dlq(Box<dlq::Queue>),
    /// The partitions a Kafka consumer group's runners hold at a record that failed (runners with
    /// `hold_partition_on_failure`): list them, retry or skip each (no database needed).
    #[cfg(feature = "kafka")]
    Kafka(Box<kafka::Group>),
    /// The transactional outbox: its outgoing messages, the parked ones and the ordering keys they
    /// hold, and retrying or skipping them.
    Outbox {
        #[command(subcommand)]
        command: OutboxCommand,
    },
}

#[derive(Subcommand, Debug)]
enum OutboxCommand {
    /// Outgoing messages pending (and the oldest), sent (kept for the retention), parked.
    Stats,
    /// The parked messages (the broker refused them on every attempt), in the order written.
    Parked {
        /// Only those after this row.
        #[arg(long)]
        after: Option<i64>,
        /// At most this many (at least 1).
        #[arg(long, default_value_t = 100, value_parser = args::limit)]
        limit: usize,
    },
    /// One outgoing message by its row, or every row of a message id.
    Show {
        /// The row, as `parked` prints it.
        #[arg(
            long,
            conflicts_with = "message_id",
            required_unless_present = "message_id"
        )]
        row: Option<i64>,
        /// The message id (the broker's message id).
        #[arg(long)]
        message_id: Option<String>,
    },
    /// The ordering keys whose first message not yet sent is parked, with that message and how
    /// many wait behind it (relays with `parked_holds_key` publish none of them until the parked
    /// message is retried or skipped).
    Held {
        /// Only keys whose parked message's row is after this row.
        #[arg(long)]
        after: Option<i64>,
        /// At most this many (at least 1).
        #[arg(long, default_value_t = 100, value_parser = args::limit)]
        limit: usize,
    },
    /// Make a parked message pending again, so that the relays publish it (once the cause is
    /// fixed: a queue bound, a stream created).
    Retry {
        /// The row, as `parked` prints it.
        #[arg(long)]
        row: i64,
    },
    /// Give a parked message up: it is never published, is kept as skipped for the outbox's
    /// retention, and its ordering key goes on with its next message.
    Skip {
        /// The row, as `parked` prints it.
        #[arg(long)]
        row: i64,
    },
}

/// The message key, as its components.
#[derive(clap::Args, Debug)]
struct KeyArgs {
    /// A key component: TEXT (a string), str:TEXT, uuid:UUID, int:N, bytes:HEX, or stored:HEX
    /// (the stored key as `inspect` prints it). Repeat for a composite key, in order.
    #[arg(long = "key")]
    parts: Vec<KeyPart>,
}

impl KeyArgs {
    fn key(&self) -> Result<Option<MessageKey>, String> {
        args::message_key(&self.parts)
    }
}

/// What went wrong, for the exit status.
enum Failure {
    /// The message is not in the inbox.
    NotFound(String),
    /// Anything else.
    Error(Box<dyn std::error::Error>),
}

impl<E: std::error::Error + 'static> From<E> for Failure {
    fn from(error: E) -> Self {
        Failure::Error(Box::new(error))
    }
}

fn fail(message: impl Into<String>) -> Failure {
    Failure::Error(message.into().into())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // --help and --version: printed, exit 0.
        Err(error) if !error.use_stderr() => error.exit(),
        // A command line that is wrong is an error like any other (clap would exit with 2, which
        // here means "not found").
        Err(error) => {
            let _ = error.print();
            return ExitCode::FAILURE;
        }
    };
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::NotFound(message)) => {
            eprintln!("{message}");
            ExitCode::from(2)
        }
        Err(Failure::Error(error)) => {
            eprintln!("error: {}", chain(error.as_ref()));
            ExitCode::FAILURE
        }
    }
}

/// `error` and its causes, each said once: many errors repeat their source's message in their
/// own (sqlx's "error communicating with database: Connection refused"), which is then left out.
fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut message = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let said = cause.to_string();
        if !said.is_empty() && !message.contains(&said) {
            message.push_str(": ");
            message.push_str(&said);
        }
        source = cause.source();
    }
    message
}

/// The databases by URL scheme.
enum Scheme {
    Postgres,
    Sqlite,
    MySql,
}

fn scheme(url: &str) -> Result<Scheme, Failure> {
    let scheme = url.split(':').next().unwrap_or_default();
    match scheme {
        "postgres" | "postgresql" => Ok(Scheme::Postgres),
        "sqlite" => Ok(Scheme::Sqlite),
        "mysql" | "mariadb" => Ok(Scheme::MySql),
        _ => Err(fail(format!(
            "unknown database in --url: {scheme:?}; use postgres://, sqlite:// or mysql://"
        ))),
    }
}

/// Said to a command given several `--url` or `--schema` that takes one.
const ONE_EACH: &str =
    "only migrate takes several --url or --schema: give one of each to the other commands";

/// Said to a `--schema` on another database.
const SCHEMA_IS_POSTGRES: &str = "--schema is PostgreSQL's: on MySQL and SQLite a tenant has a \
     database of its own, give its --url";

async fn run(cli: Cli) -> Result<(), Failure> {
    #[cfg(feature = "kafka")]
    if let Command::Kafka(group) = cli.command {
        return kafka::run(
            *group,
            Output {
                json: cli.json,
                database: None,
            },
        )
        .await;
    }
    #[cfg(any(
        feature = "sqs",
        feature = "rabbitmq",
        feature = "nats",
        feature = "kafka"
    ))]
    if let Command::Dlq(queue) = &cli.command
        && !dlq::needs_inbox(queue)
    {
        let Command::Dlq(queue) = cli.command else {
            unreachable!("matched above")
        };
        return dlq::run::<Sqlite>(
            queue,
            Output {
                json: cli.json,
                database: None,
            },
            None,
        )
        .await;
    }
    let table = TableName::new(&cli.table)?;
    let out = Output {
        json: cli.json,
        database: None,
    };
    let migrates = matches!(cli.command, Command::Migrate);
    let Some(url) = cli.url.first().cloned() else {
        return Err(fail("no database: pass --url or set DATABASE_URL"));
    };
    if !migrates && (cli.url.len() > 1 || cli.schema.len() > 1) {
        return Err(fail(ONE_EACH));
    }
    if migrates {
        for (n, url) in cli.url.iter().enumerate() {
            let out = Output {
                database: (cli.url.len() > 1).then_some(n + 1),
                ..out
            };
            let schemas: Vec<Option<&str>> = match cli.schema.as_slice() {
                [] => vec![None],
                schemas => schemas.iter().map(|schema| Some(schema.as_str())).collect(),
            };
            for schema in schemas {
                on_inbox(url, &cli.table, schema, Command::Migrate, out).await?;
            }
        }
        return Ok(());
    }
    if let Command::Ddl { from } = cli.command {
        let table = match cli.schema.first() {
            None => table,
            Some(schema) if matches!(scheme(&url)?, Scheme::Postgres) => table.in_schema(schema)?,
            Some(_) => return Err(fail(SCHEMA_IS_POSTGRES)),
        };
        let latest = idempotent::schema::CURRENT_VERSION;
        if from > latest {
            return Err(fail(format!(
                "--from {from}: there is no schema version {from}; versions go from 0 (no tables) to {latest}"
            )));
        }
        if from == latest && !cli.json {
            eprintln!("-- the tables of version {latest} are the latest: nothing to run");
        }
        let statements = match scheme(&url)? {
            Scheme::Postgres => idempotent::schema::ddl::<Postgres>(&table, from),
            Scheme::Sqlite => idempotent::schema::ddl::<Sqlite>(&table, from),
            Scheme::MySql => idempotent::schema::ddl::<MySql>(&table, from),
        };
        out.ddl(&statements);
        return Ok(());
    }
    let schema = cli.schema.first().map(String::as_str);
    on_inbox(&url, &cli.table, schema, cli.command, out).await
}

/// Runs `command` on the inbox in `table` (and `schema`, on PostgreSQL) of `url`'s database.
async fn on_inbox(
    url: &str,
    table: &str,
    schema: Option<&str>,
    command: Command,
    out: Output,
) -> Result<(), Failure> {
    if schema.is_some() && !matches!(scheme(url)?, Scheme::Postgres) {
        return Err(fail(SCHEMA_IS_POSTGRES));
    }
    match scheme(url)? {
        Scheme::Postgres => {
            let options: sqlx::postgres::PgConnectOptions = url.parse()?;
            let pool = connect::<Postgres>(options).await?;
            let inbox = Inbox::new(pool).with_table(table)?;
            let inbox = match schema {
                Some(schema) => inbox.with_schema(schema)?,
                None => inbox,
            };
            self::command(inbox, command, out).await
        }
        Scheme::Sqlite => {
            // Only `migrate` creates the database: another command on a mistyped path must not
            // leave an empty database there.
            let creates = matches!(command, Command::Migrate);
            let options = idempotent::sqlite::connect_options(url)?.create_if_missing(creates);
            let path = options.get_filename().display().to_string();
            let pool = connect::<Sqlite>(options)
                .await
                .map_err(|error| match &error {
                    Failure::Error(inner) if cant_open(inner.as_ref()) => fail(format!(
                        "no database at {path}: check --url (only `idempotent migrate` creates one)"
                    )),
                    _ => error,
                })?;
            self::command(Inbox::new(pool).with_table(table)?, command, out).await
        }
        Scheme::MySql => {
            let url = url.replacen("mariadb:", "mysql:", 1);
            let options: sqlx::mysql::MySqlConnectOptions = url.parse()?;
            let pool = connect::<MySql>(options).await?;
            self::command(Inbox::new(pool).with_table(table)?, command, out).await
        }
    }
}

/// How long the tool waits for the database to answer a connection, and for a connection of its
/// pool.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A pool of `options`' database, once one connection was made: a server that cannot be reached
/// fails at once with its cause ("Connection refused"), not after the pool's wait with "pool timed
/// out".
async fn connect<DB: sqlx::Database>(
    options: <DB::Connection as sqlx::Connection>::Options,
) -> Result<sqlx::Pool<DB>, Failure> {
    use sqlx::{ConnectOptions, Connection};
    let first = tokio::time::timeout(CONNECT_TIMEOUT, options.connect())
        .await
        .map_err(|_| {
            fail(format!(
                "the database did not answer within {} s",
                CONNECT_TIMEOUT.as_secs()
            ))
        })??;
    first.close().await?;
    Ok(sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(2)
        .acquire_timeout(CONNECT_TIMEOUT)
        .connect_lazy_with(options))
}

/// Whether SQLite could not open the database file (`SQLITE_CANTOPEN`): it is not there.
fn cant_open(error: &(dyn std::error::Error + 'static)) -> bool {
    match error.downcast_ref::<sqlx::Error>() {
        Some(sqlx::Error::Database(error)) => error.code().as_deref() == Some("14"),
        _ => false,
    }
}

async fn command<DB: Backend>(
    inbox: Inbox<DB>,
    command: Command,
    out: Output,
) -> Result<(), Failure> {
    match command {
        Command::Ddl { .. } => unreachable!("printed without a connection"),
        #[cfg(feature = "kafka")]
        Command::Kafka(_) => unreachable!("run without a connection"),
        #[cfg(any(
            feature = "sqs",
            feature = "rabbitmq",
            feature = "nats",
            feature = "kafka"
        ))]
        Command::Dlq(queue) => dlq::run(queue, out, Some(&inbox)).await?,
        Command::Migrate => out.migration(inbox.table(), inbox.migrate().await?),
        Command::Stats => out.stats(&inbox.stats().await?),
        Command::Inspect {
            consumer,
            key,
            since,
            until,
            after,
            limit,
        } => match key.key().map_err(fail)? {
            Some(key) => match inbox.inspect(&consumer, &key).await? {
                Some(record) => out.record(&consumer, &record),
                None => {
                    return Err(Failure::NotFound(format!(
                        "{consumer} has no record of the key {key}"
                    )));
                }
            },
            None => {
                let mut listing = Listing::new().limit(limit);
                if let Some(since) = since {
                    listing = listing.since(since.0);
                }
                if let Some(until) = until {
                    listing = listing.until(until.0);
                }
                if let Some(after) = after {
                    listing = listing.after(after);
                }
                out.page(&consumer, &inbox.list(&consumer, listing).await?);
            }
        },
        Command::Stuck { consumer, limit } => {
            out.stuck(&inbox.stuck_calls(consumer.as_deref(), limit).await?)
        }
        Command::Forget {
            consumer,
            key,
            reason,
        } => {
            let key = key
                .key()
                .map_err(fail)?
                .ok_or_else(|| fail("name the message with --key"))?;
            if !inbox.forget(&consumer, &key, &reason).await? {
                return Err(Failure::NotFound(format!(
                    "{consumer} has no committed record of the key {key} (a handler still \
                     processing it has none until it commits): nothing forgotten"
                )));
            }
            out.forgotten(&consumer, &key);
        }
        Command::Audit { consumer, limit } => {
            out.audit(&inbox.audit(consumer.as_deref(), limit).await?)
        }
        Command::Purge {
            retention,
            consumer_retention,
            batch_size,
            outbox_retention,
            dry_run,
            yes_delete_recent,
        } => {
            if !dry_run && !yes_delete_recent {
                let short = std::iter::once(("--retention", retention))
                    .chain(outbox_retention.map(|r| ("--outbox-retention", r)))
                    .chain(
                        consumer_retention
                            .iter()
                            .map(|c| ("--consumer-retention", c.1)),
                    )
                    .find(|(_, retention)| *retention < args::MIN_RETENTION);
                if let Some((option, retention)) = short {
                    let retention = match retention.as_millis() {
                        ms if ms % 1000 == 0 => format!("{}s", ms / 1000),
                        ms => format!("{ms}ms"),
                    };
                    return Err(fail(format!(
                        "{option} {retention} is under 1m, refused: it would delete the records \
                         of what was processed (or sent) that recently, and a redelivery of such a \
                         message would run again; count with --dry-run, or add --yes-delete-recent"
                    )));
                }
            }
            let mut inbox = inbox.with_retention(retention);
            if let Some(retention) = outbox_retention {
                inbox = inbox.with_outbox_retention(retention);
            }
            for ConsumerRetention(consumer, retention) in consumer_retention {
                inbox = inbox.with_consumer_retention(&consumer, retention);
            }
            if dry_run {
                out.preview(&inbox.purge_preview().await?);
            } else {
                out.purged(&inbox.purge_expired(batch_size).await?);
            }
        }
        Command::Outbox { command } => outbox(inbox, command, out).await?,
    }
    Ok(())
}

async fn outbox<DB: Backend>(
    inbox: Inbox<DB>,
    command: OutboxCommand,
    out: Output,
) -> Result<(), Failure> {
    match command {
        OutboxCommand::Stats => out.outbox_stats(&inbox.outbox_stats().await?),
        OutboxCommand::Parked { after, limit } => {
            out.outgoing(&inbox.parked_messages(after, limit).await?)
        }
        OutboxCommand::Show { row, message_id } => {
            let records = match (row, message_id) {
                (Some(row), _) => inbox.outbox_message(row).await?.into_iter().collect(),
                (None, Some(id)) => inbox.outbox_messages(&id).await?,
                (None, None) => unreachable!("clap requires one"),
            };
            if records.is_empty() {
                return Err(Failure::NotFound("no such outgoing message".into()));
            }
            out.outgoing(&records);
        }
        OutboxCommand::Retry { row } => {
            if !inbox.retry_parked(row).await? {
                return Err(Failure::NotFound(format!(
                    "row {row} is not a parked outgoing message: nothing retried"
                )));
            }
            out.retried(row);
        }
        OutboxCommand::Held { after, limit } => out.held(&inbox.held_keys(after, limit).await?),
        OutboxCommand::Skip { row } => {
            if !inbox.skip_parked(row).await? {
                return Err(Failure::NotFound(format!(
                    "row {row} is not a parked outgoing message: nothing skipped"
                )));
            }
            out.skipped(row);
        }
    }
    Ok(())
}
