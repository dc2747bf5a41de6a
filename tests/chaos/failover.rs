//! The consumer's reconnect rule, for servers that can change roles: a PostgreSQL primary and its
//! standby, the nodes of a Galera cluster.
//!
//! sqlx 0.9 connects to one host: `PgConnectOptions` takes no list of hosts and no
//! `target_session_attrs` (the URL parameter is ignored, with a warning). So the consumer keeps the
//! list itself:
//! - its pool refuses, in `after_connect`, a session on a server that cannot take its writes (a
//!   PostgreSQL standby, a Galera node that is not `Synced`); sqlx's pool then retries, as it does
//!   when a connection is refused, until its acquire timeout;
//! - when it starts, and after a retryable error, it looks for a server that takes writes, its own
//!   first, and points the pool's connect options at it (`Pool::set_connect_options`), at most
//!   every 250 ms;
//! - every two seconds, away from its own server, it goes back there once that takes writes again.
//!
//! The connections the pool already has to a server that died fail on their next use; that
//! delivery's error is retryable and its redelivery uses a new connection.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use sqlx::mysql::{MySqlConnectOptions, MySqlConnection, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPoolOptions};
use sqlx::{ConnectOptions, Database, Pool};

/// How long a probe of one server may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// A server of the list, and how to tell that it takes writes.
pub trait Server:
    ConnectOptions<Connection = <Self::Db as Database>::Connection> + Clone + Send + Sync + 'static
{
    type Db: Database<Connection: sqlx::Connection<Options = Self>>;

    /// Whether a session on this connection can take the consumer's writes.
    fn takes_writes(
        conn: &mut <Self::Db as Database>::Connection,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;
}

impl Server for PgConnectOptions {
    type Db = sqlx::Postgres;

    async fn takes_writes(conn: &mut PgConnection) -> Result<bool, sqlx::Error> {
        let standby: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
            .fetch_one(conn)
            .await?;
        Ok(!standby)
    }
}

impl Server for MySqlConnectOptions {
    type Db = sqlx::MySql;

    async fn takes_writes(conn: &mut MySqlConnection) -> Result<bool, sqlx::Error> {
        let state: Option<String> = sqlx::query_scalar(
            "SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS
             WHERE VARIABLE_NAME = 'WSREP_LOCAL_STATE_COMMENT'",
        )
        .fetch_optional(conn)
        .await?;
        Ok(state.as_deref() == Some("Synced"))
    }
}

/// The consumer's servers, its own first, and which one its pool connects to.
pub struct Failover<S: Server> {
    servers: Vec<S>,
    current: AtomicUsize,
    probed: Mutex<Option<Instant>>,
}

impl<S: Server> Failover<S> {
    pub fn new(servers: Vec<S>) -> Self {
        assert!(!servers.is_empty());
        Self {
            servers,
            current: AtomicUsize::new(0),
            probed: Mutex::new(None),
        }
    }

    /// The server the pool starts with: the consumer's own.
    pub fn first(&self) -> S {
        self.servers[0].clone()
    }

    /// Whether `server` answers and takes writes.
    async fn usable(server: &S) -> bool {
        let probe = async {
            let mut conn = server.connect().await?;
            let usable = S::takes_writes(&mut conn).await;
            let _ = sqlx::Connection::close(conn).await;
            usable
        };
        matches!(
            tokio::time::timeout(PROBE_TIMEOUT, probe).await,
            Ok(Ok(true))
        )
    }

    /// At start and after a retryable error: points `pool` at the first server that takes writes,
    /// the consumer's own first; does nothing if it looked less than 250 ms ago.
    pub async fn reselect(&self, pool: &Pool<S::Db>) {
        {
            let mut probed = self.probed.lock().unwrap();
            if probed.is_some_and(|at| at.elapsed() < Duration::from_millis(250)) {
                return;
            }
            *probed = Some(Instant::now());
        }
        for (index, server) in self.servers.iter().enumerate() {
            if Self::usable(server).await {
                if self.current.swap(index, Ordering::SeqCst) != index {
                    pool.set_connect_options(server.clone());
                }
                return;
            }
        }
    }

    /// Goes back to the consumer's own server once it takes writes again; called every 2 s.
    pub async fn prefer_own(&self, pool: &Pool<S::Db>) {
        if self.current.load(Ordering::SeqCst) != 0 && Self::usable(&self.servers[0]).await {
            self.current.store(0, Ordering::SeqCst);
            pool.set_connect_options(self.servers[0].clone());
        }
    }
}

/// The error `after_connect` refuses a session with.
fn refused() -> sqlx::Error {
    sqlx::Error::Protocol(
        "the server does not take writes (a standby, or a node not synced)".into(),
    )
}

/// A pool of `connections` that refuses sessions on a PostgreSQL standby.
pub fn pg_pool(failover: &Failover<PgConnectOptions>, connections: u32) -> sqlx::PgPool {
    PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(Duration::from_secs(3))
        .after_connect(|conn, _| {
            Box::pin(async move {
                if PgConnectOptions::takes_writes(conn).await? {
                    Ok(())
                } else {
                    Err(refused())
                }
            })
        })
        .connect_lazy_with(failover.first())
}

/// A pool of `connections` that refuses sessions on a Galera node that is not `Synced`.
pub fn mysql_pool(failover: &Failover<MySqlConnectOptions>, connections: u32) -> sqlx::MySqlPool {
    MySqlPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(Duration::from_secs(3))
        .after_connect(|conn, _| {
            Box::pin(async move {
                if MySqlConnectOptions::takes_writes(conn).await? {
                    Ok(())
                } else {
                    Err(refused())
                }
            })
        })
        .connect_lazy_with(failover.first())
}
