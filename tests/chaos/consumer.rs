//! A consumer process: reads deliveries from stdin, runs the `#[idempotent]` handlers, writes
//! acknowledgements to stdout. At a delivery's crash point it says so and waits to be killed.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use idempotent::{Error, Handled};
use sqlx::mysql::MySqlConnectOptions;
use sqlx::postgres::PgConnectOptions;
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::failover::{self, Failover};
use crate::protocol::{CrashPoint, Delivery, Reply, Target};

/// The handler's own error.
#[derive(Debug, thiserror::Error)]
pub enum ChaosError {
    #[error("the handler failed on purpose")]
    Failed,
    #[error("database error in the handler")]
    Db(#[from] sqlx::Error),
}

/// Writes one reply line and flushes it, so the broker sees it before anything else happens.
pub fn reply(reply: Reply) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{reply}");
    let _ = out.flush();
}

/// Stops here if this is the delivery's crash point: tells the broker, which kills the process.
pub async fn crash_point(delivery: &Delivery, point: CrashPoint) {
    if delivery.crash_at == Some(point) {
        reply(Reply::Paused {
            tag: delivery.tag,
            point,
        });
        std::future::pending::<()>().await;
    }
}

/// The handlers, for one connection type and its placeholders.
macro_rules! chaos_handlers {
    ($conn:ty, $ledger:literal, $emails:literal) => {
        use idempotent::idempotent;

        use crate::consumer::{ChaosError, crash_point};
        use crate::protocol::{Behaviour, CrashPoint, Delivery};

        /// The part of both handlers' bodies that the crash points cut into: records the
        /// delivery in `insert`'s table, then fails if the message is meant to.
        async fn record(tx: &mut $conn, insert: &str, msg: &Delivery) -> Result<(), ChaosError> {
            crash_point(msg, CrashPoint::AfterClaim).await;
            sqlx::query(sqlx::AssertSqlSafe(insert))
                .bind(msg.message_id.to_string())
                .bind(msg.tag as i64)
                .execute(&mut *tx)
                .await?;
            crash_point(msg, CrashPoint::InBody).await;
            let fails = msg.behaviour == Behaviour::Poison
                || (msg.behaviour == Behaviour::FailOnce && msg.attempt == 1);
            if fails {
                Err(ChaosError::Failed)
            } else {
                Ok(())
            }
        }

        #[idempotent(key = "message_id", consumer = "ledger")]
        pub async fn ledger(tx: &mut $conn, msg: &Delivery) -> Result<(), ChaosError> {
            record(tx, $ledger, msg).await?;
            sqlx::query("UPDATE chaos_counter SET value = value + 1 WHERE name = 'ledger'")
                .execute(&mut *tx)
                .await?;
            Ok(())
        }

        #[idempotent(key = "message_id", consumer = "mailer")]
        pub async fn mailer(tx: &mut $conn, msg: &Delivery) -> Result<(), ChaosError> {
            record(tx, $emails, msg).await
        }
    };
}

mod on_postgres {
    chaos_handlers!(
        sqlx::PgConnection,
        "INSERT INTO chaos_ledger (message_id, tag) VALUES ($1, $2)",
        "INSERT INTO chaos_emails (message_id, tag) VALUES ($1, $2)"
    );
}

mod on_sqlite {
    chaos_handlers!(
        sqlx::SqliteConnection,
        "INSERT INTO chaos_ledger (message_id, tag) VALUES ($1, $2)",
        "INSERT INTO chaos_emails (message_id, tag) VALUES ($1, $2)"
    );
}

mod on_mysql {
    chaos_handlers!(
        sqlx::MySqlConnection,
        "INSERT INTO chaos_ledger (message_id, tag) VALUES (?, ?)",
        "INSERT INTO chaos_emails (message_id, tag) VALUES (?, ?)"
    );
}

type Outcome = Result<Handled<()>, Error<ChaosError>>;

/// The inbox of the database the run uses, and the consumer's reconnect rule where its servers
/// change roles.
#[derive(Clone)]
enum Shop {
    Postgres(
        idempotent::Inbox<sqlx::Postgres>,
        Option<Arc<Failover<PgConnectOptions>>>,
    ),
    Sqlite(idempotent::Inbox<sqlx::Sqlite>),
    MySql(
        idempotent::Inbox<sqlx::MySql>,
        Option<Arc<Failover<MySqlConnectOptions>>>,
    ),
}

impl Shop {
    async fn handle(&self, delivery: &Delivery) -> Outcome {
        match (self, delivery.target) {
            (Shop::Postgres(inbox, _), Target::Ledger) => {
                on_postgres::ledger(inbox, delivery).await
            }
            (Shop::Postgres(inbox, _), Target::Mailer) => {
                on_postgres::mailer(inbox, delivery).await
            }
            (Shop::Sqlite(inbox), Target::Ledger) => on_sqlite::ledger(inbox, delivery).await,
            (Shop::Sqlite(inbox), Target::Mailer) => on_sqlite::mailer(inbox, delivery).await,
            (Shop::MySql(inbox, _), Target::Ledger) => on_mysql::ledger(inbox, delivery).await,
            (Shop::MySql(inbox, _), Target::Mailer) => on_mysql::mailer(inbox, delivery).await,
        }
    }

    /// At start and after a retryable error: where the servers change roles, finds the one that
    /// takes writes.
    async fn find_server(&self) {
        match self {
            Shop::Postgres(inbox, Some(failover)) => failover.reselect(inbox.pool()).await,
            Shop::MySql(inbox, Some(failover)) => failover.reselect(inbox.pool()).await,
            _ => {}
        }
    }

    /// Every two seconds: back to the consumer's own server, if it moved away.
    async fn prefer_own(&self) {
        match self {
            Shop::Postgres(inbox, Some(failover)) => failover.prefer_own(inbox.pool()).await,
            Shop::MySql(inbox, Some(failover)) => failover.prefer_own(inbox.pool()).await,
            _ => {}
        }
    }
}

/// The inbox for `kind` of server at `urls` (comma-separated; the consumer's own first):
/// `postgres`, `pgbouncer` (PostgreSQL through PgBouncer in transaction mode), `postgres-ha` (a
/// primary and its standby), `sqlite`, `mysql`, `galera` (the cluster's nodes).
fn shop(kind: &str, urls: &str) -> Shop {
    let urls: Vec<&str> = urls.split(',').collect();
    let connections = 4;
    match kind {
        "postgres" => {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(connections)
                .acquire_timeout(Duration::from_secs(3))
                .connect_lazy(urls[0])
                .expect("PostgreSQL URL");
            Shop::Postgres(idempotent::Inbox::new(pool), None)
        }
        "pgbouncer" => {
            // As the README says for PgBouncer 1.18 in transaction mode: no statement cache (its
            // `server_reset_query_always` makes the handlers' statements work inside their
            // transaction), and the inbox told about the pooler.
            let options: PgConnectOptions = urls[0].parse().expect("PgBouncer URL");
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(connections)
                .acquire_timeout(Duration::from_secs(3))
                .connect_lazy_with(options.statement_cache_capacity(0));
            Shop::Postgres(
                idempotent::Inbox::new(pool).with_transaction_pooling(),
                None,
            )
        }
        "postgres-ha" => {
            let servers = urls.iter().map(|url| url.parse().expect("PostgreSQL URL"));
            let failover = Arc::new(Failover::new(servers.collect()));
            let pool = failover::pg_pool(&failover, connections);
            Shop::Postgres(idempotent::Inbox::new(pool), Some(failover))
        }
        "mysql" => {
            let pool = sqlx::mysql::MySqlPoolOptions::new()
                .max_connections(connections)
                .acquire_timeout(Duration::from_secs(3))
                .connect_lazy(urls[0])
                .expect("MySQL URL");
            Shop::MySql(idempotent::Inbox::new(pool), None)
        }
        "galera" => {
            let servers = urls.iter().map(|url| url.parse().expect("MySQL URL"));
            let failover = Arc::new(Failover::new(servers.collect()));
            let pool = failover::mysql_pool(&failover, connections);
            Shop::MySql(idempotent::Inbox::new(pool), Some(failover))
        }
        "sqlite" => {
            let options = idempotent::sqlite::connect_options(urls[0])
                .expect("SQLite URL")
                .busy_timeout(Duration::from_secs(10));
            let pool = sqlx::sqlite::SqlitePoolOptions::new()
                .max_connections(connections)
                .connect_lazy_with(options);
            Shop::Sqlite(idempotent::Inbox::new(pool))
        }
        other => panic!("unknown kind of server {other}"),
    }
}

/// The consumer process's main loop, for `kind` of server at `urls` (see [`shop`]).
pub async fn run(kind: &str, urls: &str) {
    let shop = Arc::new(shop(kind, urls));
    // A consumer started after a failover would otherwise spend its first connections' acquire
    // timeout on the old primary.
    shop.find_server().await;
    let home = shop.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(2)).await;
            home.prefer_own().await;
        }
    });
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let delivery: Delivery = line.parse().expect("a delivery from the broker");
        let shop = shop.clone();
        tokio::spawn(async move {
            crash_point(&delivery, CrashPoint::BeforeClaim).await;
            let outcome = shop.handle(&delivery).await;
            match outcome {
                Ok(handled) => {
                    crash_point(&delivery, CrashPoint::AfterCommit).await;
                    reply(Reply::Ack {
                        tag: delivery.tag,
                        duplicate: handled.is_duplicate(),
                    });
                }
                Err(error) => {
                    // The outcome's own classification, whatever the handler's error type: a
                    // database failure under the body is `Error::Transient`.
                    let retryable = error.is_retryable();
                    if !retryable && !matches!(error, Error::Handler(ChaosError::Failed)) {
                        eprintln!("consumer: delivery {} failed: {error:?}", delivery.tag);
                    }
                    reply(Reply::Nack {
                        tag: delivery.tag,
                        retryable,
                    });
                    if retryable {
                        shop.find_server().await;
                    }
                }
            }
        });
    }
    // The broker closed our stdin: no more deliveries. In-flight ones are the broker's to requeue.
}
