//! What the broker runners' tests share: a shop whose `#[idempotent]` handler records an effect per
//! message in SQLite, and messages that say how their handler should behave.
#![allow(dead_code)]

#[cfg(feature = "rabbitmq")]
pub mod amqp;
#[cfg(feature = "rabbitmq")]
pub mod forging;
#[cfg(feature = "nats")]
pub mod jetstream;
#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "sqs")]
pub mod sqs;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotent::broker::{Message, MessageId};
use idempotent::{Error, Handled, Inbox, Retryable, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::{Sqlite, SqlitePool};

/// How a message's handler behaves.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub enum Kind {
    /// Commits its effect.
    Ok,
    /// Fails with its own error, every time: dead-lettered at once.
    Poison,
    /// Fails with a retryable error on its first `n` attempts, then commits.
    Flaky(u32),
    /// Fails with a retryable error every time: dead-lettered after the last attempt.
    AlwaysTransient,
    /// Commits after this many milliseconds.
    Slow(u64),
    /// Its body fails on its first `n` attempts as a downstream service answers 503: the
    /// handler's own error, marked [`Retryable`].
    Unavailable(u32),
    /// Its handler panics, every time.
    Panic,
}

/// A message's payload.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Order {
    pub kind: Kind,
}

impl Order {
    pub fn payload(kind: Kind) -> Vec<u8> {
        serde_json::to_vec(&Order { kind }).unwrap()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ShopError {
    #[error("poison: this order can never be handled")]
    Poison,
    #[error("the payment service is briefly unavailable")]
    Unavailable,
    #[error("not an order: {0}")]
    Decode(#[from] serde_json::Error),
    #[error("database error")]
    Db(#[from] sqlx::Error),
    #[error("the shipping service is unavailable")]
    Downstream(#[from] Retryable),
}

/// What a downstream service answers on `attempt` of a message of `kind`.
pub fn downstream(kind: Kind, attempt: u32) -> Result<(), ShopError> {
    match kind {
        Kind::Unavailable(n) if attempt <= n => {
            Err(Retryable::new("503 Service Unavailable"))?;
            Ok(())
        }
        _ => Ok(()),
    }
}

/// The message as the handler takes it.
pub struct Incoming {
    pub message_id: MessageId,
    pub order: Order,
    /// The delivery's attempt.
    pub attempt: u32,
}

#[idempotent(key = "message_id", consumer = "shop")]
pub async fn on_order(tx: &mut sqlx::SqliteConnection, msg: &Incoming) -> Result<(), ShopError> {
    if let Kind::Slow(ms) = msg.order.kind {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    sqlx::query("INSERT INTO effects (message_id) VALUES ($1)")
        .bind(&msg.message_id.0)
        .execute(&mut *tx)
        .await?;
    downstream(msg.order.kind, msg.attempt)?;
    match msg.order.kind {
        Kind::Poison => Err(ShopError::Poison),
        _ => Ok(()),
    }
}

/// One attempt as a handler saw it.
#[derive(Debug, Clone)]
pub struct Attempt {
    pub message_id: String,
    pub attempt: u32,
    pub at: Instant,
}

/// A database with an inbox and the effects table, and the attempts the handlers saw.
pub struct Shop {
    pub inbox: Inbox<Sqlite>,
    pub pool: SqlitePool,
    pub attempts: Arc<Mutex<Vec<Attempt>>>,
    _dir: tempfile::TempDir,
}

pub type Outcome = Result<Handled<()>, Error<ShopError>>;

impl Shop {
    pub async fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("shop.db").display());
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(16)
            .connect_with(idempotent::sqlite::connect_options(&url).unwrap())
            .await
            .unwrap();
        sqlx::query("CREATE TABLE effects (message_id TEXT NOT NULL)")
            .execute(&pool)
            .await
            .unwrap();
        let inbox = Inbox::new(pool.clone());
        inbox.migrate().await.unwrap();
        Self {
            inbox,
            pool,
            attempts: Arc::default(),
            _dir: dir,
        }
    }

    /// A worker's handler: decodes the message and calls the `#[idempotent]` handler with a
    /// worker's inbox, failing retryably first where the message says so.
    pub fn worker(
        &self,
    ) -> impl FnMut(Message) -> futures::future::BoxFuture<'static, Outcome> + Send + 'static {
        let inbox = self.inbox.for_worker();
        let attempts = self.attempts.clone();
        move |message: Message| {
            let inbox = inbox.clone();
            let attempts = attempts.clone();
            Box::pin(async move {
                attempts.lock().unwrap().push(Attempt {
                    message_id: message.message_id.0.clone(),
                    attempt: message.attempt,
                    at: Instant::now(),
                });
                let order: Order = serde_json::from_slice(&message.payload)
                    .map_err(|error| Error::Handler(ShopError::from(error)))?;
                match order.kind {
                    Kind::Flaky(n) if message.attempt <= n => {
                        return Err(Error::Transient(ShopError::Unavailable));
                    }
                    Kind::AlwaysTransient => return Err(Error::Transient(ShopError::Unavailable)),
                    Kind::Panic => panic!("the order book is corrupt"),
                    _ => {}
                }
                let incoming = Incoming {
                    message_id: message.message_id,
                    order,
                    attempt: message.attempt,
                };
                on_order(&inbox, &incoming).await
            })
        }
    }

    /// Asserts that the handlers saw `message_id` on attempts 1, 2, … one more than `delays`, each
    /// at least its delay (in milliseconds) after the one before: retried after the back-off, not
    /// at once.
    pub fn assert_retried_after(&self, message_id: &str, delays: &[u64]) {
        let attempts = self.attempts_of(message_id);
        let numbers: Vec<u32> = attempts.iter().map(|a| a.attempt).collect();
        let expected: Vec<u32> = (1..=delays.len() as u32 + 1).collect();
        assert_eq!(numbers, expected);
        for (pair, delay) in attempts.windows(2).zip(delays) {
            let waited = pair[1].at - pair[0].at;
            assert!(
                waited >= Duration::from_millis(*delay),
                "attempt {} came {waited:?} after the one before, not after the back-off of {delay} ms",
                pair[1].attempt
            );
        }
    }

    /// The attempts the handlers saw of `message_id`: their numbers, in order.
    pub fn attempt_numbers(&self, message_id: &str) -> Vec<u32> {
        self.attempts_of(message_id)
            .iter()
            .map(|a| a.attempt)
            .collect()
    }

    /// How many times each message's effect was committed.
    pub async fn effects(&self) -> HashMap<String, i64> {
        sqlx::query_as::<_, (String, i64)>(
            "SELECT message_id, COUNT(*) FROM effects GROUP BY message_id",
        )
        .fetch_all(&self.pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
    }

    /// The message ids whose effects were committed, in commit order.
    pub async fn committed_in_order(&self) -> Vec<String> {
        sqlx::query_scalar("SELECT message_id FROM effects ORDER BY rowid")
            .fetch_all(&self.pool)
            .await
            .unwrap()
    }

    /// The attempts the handlers saw of `message_id`, in order.
    pub fn attempts_of(&self, message_id: &str) -> Vec<Attempt> {
        self.attempts
            .lock()
            .unwrap()
            .iter()
            .filter(|a| a.message_id == message_id)
            .cloned()
            .collect()
    }
}

/// An example's program, as `cargo build --examples` builds it (`scripts/test` does, first).
pub fn example(name: &str) -> PathBuf {
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

/// Runs `command` of the script that started the broker (`$<variable>`, as `scripts/rabbitmq
/// start` and `scripts/nats start` print it: `restart`, `alarm on`), and waits for it to finish.
pub async fn broker_ctl(variable: &str, command: &str) {
    broker_ctl_with(variable, "", command).await
}

/// [`broker_ctl`] with `environment` (`NAME=value …`) set for the script.
pub async fn broker_ctl_with(variable: &str, environment: &str, command: &str) {
    let ctl = std::env::var(variable).unwrap_or_else(|_| {
        panic!("{variable} is not set: run the tests with scripts/test, which starts the broker")
    });
    let status = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(format!("{environment} {ctl} {command}"))
        .status()
        .await
        .unwrap();
    assert!(status.success(), "{ctl} {command} failed: {status}");
}

/// Waits until `done` holds, for at most `limit`.
pub async fn eventually(limit: Duration, mut done: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !done().await {
        assert!(start.elapsed() < limit, "not done after {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// [`eventually`] while a runner's task runs: fails at once, with how the runner ended, if it ends
/// before `done` holds.
pub async fn eventually_while_running<T: std::fmt::Debug>(
    limit: Duration,
    running: &mut tokio::task::JoinHandle<T>,
    mut done: impl AsyncFnMut() -> bool,
) {
    eventually(limit, async || running.is_finished() || done().await).await;
    assert!(
        !running.is_finished(),
        "the runner ended: {:?}",
        running.await
    );
}

/// The shop's body for a runner in batch mode: the same effect, on the batch's connection.
#[derive(Clone)]
pub struct ShopBody {
    attempts: Arc<Mutex<Vec<Attempt>>>,
}

impl Shop {
    pub fn batch_body(&self) -> ShopBody {
        ShopBody {
            attempts: self.attempts.clone(),
        }
    }
}

impl idempotent::broker::BatchBody<Sqlite, (), ShopError> for ShopBody {
    fn run<'a>(
        &'a mut self,
        tx: &'a mut sqlx::SqliteConnection,
        message: &'a Message,
    ) -> futures::future::BoxFuture<'a, Result<(), ShopError>> {
        Box::pin(async move {
            self.attempts.lock().unwrap().push(Attempt {
                message_id: message.message_id.0.clone(),
                attempt: message.attempt,
                at: Instant::now(),
            });
            let order: Order = serde_json::from_slice(&message.payload)?;
            match order.kind {
                // A lost race for a connection: transient, whatever the error type says.
                Kind::Flaky(n) if message.attempt <= n => {
                    return Err(sqlx::Error::PoolTimedOut.into());
                }
                Kind::AlwaysTransient => return Err(sqlx::Error::PoolTimedOut.into()),
                Kind::Slow(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
                Kind::Panic => panic!("the order book is corrupt"),
                _ => {}
            }
            sqlx::query("INSERT INTO effects (message_id) VALUES ($1)")
                .bind(&message.message_id.0)
                .execute(&mut *tx)
                .await?;
            downstream(order.kind, message.attempt)?;
            match order.kind {
                Kind::Poison => Err(ShopError::Poison),
                _ => Ok(()),
            }
        })
    }
}
