//! The handler's transaction: a pooled connection in a transaction the inbox began.
//!
//! sqlx's `Transaction` can only be made by sending its own `BEGIN`, and a PostgreSQL claim
//! travels in the same message as its `BEGIN` (see [`postgres`](crate::store::postgres)). So the
//! inbox keeps the connection itself and drives sqlx's transaction manager with the same rules as
//! `Transaction`: sqlx tracks the depth (a `begin()` in a handler's body opens a savepoint), and
//! dropping an open transaction queues its rollback. One rule more: a connection dropped while a
//! step was still in flight (a cancelled future, a panic), when nothing says whether a transaction
//! is open on the server, is closed instead of going back to the pool, which ends that transaction.
//!
//! An inbox made for one worker ([`Inbox::for_worker`](crate::Inbox::for_worker)) keeps the
//! connection of a transaction that ended cleanly and takes it for the next one, instead of
//! handing it back to the pool and taking one again (sqlx checks a connection with a round trip
//! at each of those).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, Database, Pool, SqlSafeStr};
use sqlx_core::transaction::TransactionManager;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::store::{Backend, Statements};

/// Where a worker's inbox keeps its connection between transactions.
pub(crate) type Kept<DB> = Arc<Mutex<Option<PoolConnection<DB>>>>;

/// What a transaction needs besides the pool: the connection its worker keeps, and the queue of an
/// inbox's writers on a database with one writer at a time.
pub(crate) struct Resources<'a, DB: Database> {
    pub(crate) pool: &'a Pool<DB>,
    pub(crate) kept: Option<&'a Kept<DB>>,
    pub(crate) writers: Option<&'a Arc<Semaphore>>,
}

// Not derived: that would ask for `DB: Copy`.
impl<DB: Database> Clone for Resources<'_, DB> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<DB: Database> Copy for Resources<'_, DB> {}

/// How long a transaction waits in the writers' queue before it goes on to the database's lock.
const WRITERS_QUEUE_PATIENCE: Duration = Duration::from_secs(5);

/// An open transaction, at depth one, on a connection taken from the pool (or kept). Dropped
/// without [`commit`](Self::commit) or [`rollback`](Self::rollback), it rolls back.
pub(crate) struct InboxTransaction<DB: Backend> {
    /// `Some` until the connection goes back where it is kept.
    conn: Option<PoolConnection<DB>>,
    home: Option<Kept<DB>>,
    /// This transaction's turn in the writers' queue, released when it ends.
    _turn: Option<OwnedSemaphorePermit>,
}

impl<DB: Backend> InboxTransaction<DB> {
    /// Takes a connection, begins a transaction and claims `key` for `consumer` in it: `Some` with
    /// the transaction when this call inserted the key, `None` when it was there (nothing is left
    /// open).
    pub(crate) async fn claim(
        with: Resources<'_, DB>,
        statements: &Statements,
        consumer: &str,
        key: &[u8],
        fingerprint: Option<&[u8]>,
    ) -> Result<Option<Self>, BeginError> {
        let turn = take_turn(with.writers).await;
        let mut conn = InFlight::acquire(with).await.map_err(BeginError::Acquire)?;
        let claimed = DB::begin_claim(conn.get(), statements, consumer, key, fingerprint).await;
        let tx = Self {
            conn: Some(conn.landed()),
            home: with.kept.cloned(),
            _turn: turn,
        };
        if claimed.map_err(BeginError::Claim)? {
            return Ok(Some(tx));
        }
        tx.go_home();
        Ok(None)
    }

    /// Takes a connection and begins a transaction that will write.
    pub(crate) async fn begin(with: Resources<'_, DB>) -> Result<Self, sqlx::Error> {
        let turn = take_turn(with.writers).await;
        let mut conn = InFlight::acquire(with).await?;
        let begun = begin::<DB>(conn.get()).await;
        let conn = conn.landed();
        begun.map(|()| Self {
            conn: Some(conn),
            home: with.kept.cloned(),
            _turn: turn,
        })
    }

    /// The transaction's connection.
    pub(crate) fn connection(&mut self) -> &mut DB::Connection {
        self.conn
            .as_mut()
            .expect("a transaction has its connection until it ends")
    }

    /// Commits. On an error the transaction is dropped, which rolls back what is left of it.
    pub(crate) async fn commit(mut self) -> Result<(), sqlx::Error> {
        <DB as Database>::TransactionManager::commit(self.connection()).await?;
        self.go_home();
        Ok(())
    }

    /// Rolls back. When that fails the connection is broken: it is closed instead of going back
    /// to the pool, and the server rolls back as the session ends.
    pub(crate) async fn rollback(mut self) {
        match <DB as Database>::TransactionManager::rollback(self.connection()).await {
            Ok(()) => self.go_home(),
            Err(error) => {
                tracing::warn!(%error, "rollback failed; the connection is closed");
                if let Some(conn) = &mut self.conn {
                    conn.close_on_drop();
                }
            }
        }
    }

    /// Puts the connection, with no transaction open, where its worker keeps it; or lets it go
    /// back to the pool.
    fn go_home(mut self) {
        if let (Some(home), Some(conn)) = (&self.home, self.conn.take()) {
            let mut slot = home.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            // Another transaction of the same worker's inbox may have put its own there first.
            let spare = slot.replace(conn);
            drop(slot);
            drop(spare);
        }
    }
}

impl<DB: Backend> Drop for InboxTransaction<DB> {
    fn drop(&mut self) {
        if let Some(conn) = &mut self.conn
            && <DB as Database>::TransactionManager::get_transaction_depth(conn) > 0
        {
            // Sent before the connection's next use, which is the pool's check when it comes back.
            <DB as Database>::TransactionManager::start_rollback(conn);
        }
    }
}

/// Waits for a turn in the writers' queue, if there is one, for at most
/// [`WRITERS_QUEUE_PATIENCE`]; `None` after that, or without a queue.
async fn take_turn(writers: Option<&Arc<Semaphore>>) -> Option<OwnedSemaphorePermit> {
    let turn = writers?.clone().acquire_owned();
    tokio::time::timeout(WRITERS_QUEUE_PATIENCE, turn)
        .await
        .ok()?
        .ok()
}

/// Begins a transaction on `conn` with the backend's `BEGIN` and sqlx's depth tracking.
pub(crate) async fn begin<DB: Backend>(conn: &mut DB::Connection) -> Result<(), sqlx::Error> {
    let statement = AssertSqlSafe(DB::DIALECT.begin).into_sql_str();
    <DB as Database>::TransactionManager::begin(conn, Some(statement)).await
}

/// Why a claim's transaction could not begin: no connection from the pool, or the statements
/// that begin it and claim the key failed.
pub(crate) enum BeginError {
    Acquire(sqlx::Error),
    Claim(sqlx::Error),
}

/// A connection taking a step whose outcome on the server is unknown until it completes: closed if
/// dropped before [`landed`](Self::landed).
struct InFlight<DB: Database>(Option<PoolConnection<DB>>);

impl<DB: Database> InFlight<DB> {
    /// The connection its worker keeps, if any; else one from the pool.
    async fn acquire(with: Resources<'_, DB>) -> Result<Self, sqlx::Error> {
        let kept = with.kept.and_then(|home| {
            home.lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .take()
        });
        let conn = match kept {
            Some(conn) => conn,
            None => with.pool.acquire().await?,
        };
        Ok(Self(Some(conn)))
    }

    fn get(&mut self) -> &mut PoolConnection<DB> {
        self.0.as_mut().expect("taken only by landed")
    }

    fn landed(mut self) -> PoolConnection<DB> {
        self.0.take().expect("taken only by landed")
    }
}

impl<DB: Database> Drop for InFlight<DB> {
    fn drop(&mut self) {
        if let Some(conn) = &mut self.0 {
            conn.close_on_drop();
        }
    }
}
