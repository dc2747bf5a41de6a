//! The handler's transaction: a pooled connection in a transaction the inbox began.
//!
//! sqlx's `Transaction` can only be made by sending its own `BEGIN`, and a PostgreSQL claim
//! travels in the same message as its `BEGIN` (see [`postgres`](crate::store::postgres)). So the
//! inbox keeps the connection itself and drives sqlx's transaction manager with the same rules as
//! `Transaction`: sqlx tracks the depth (a `begin()` in a handler's body opens a savepoint), and
//! dropping an open transaction queues its rollback. One rule more: a connection dropped while a
//! step was still in flight (a cancelled future, a panic), when nothing says whether a transaction
//! is open on the server, is closed instead of going back to the pool, which ends that transaction.

use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, Database, Pool, SqlSafeStr};
use sqlx_core::transaction::TransactionManager;

use crate::store::{Backend, Statements};

/// An open transaction, at depth one, on a connection taken from the pool. Dropped without
/// [`commit`](Self::commit) or [`rollback`](Self::rollback), it rolls back.
pub(crate) struct InboxTransaction<DB: Backend> {
    conn: PoolConnection<DB>,
}

impl<DB: Backend> InboxTransaction<DB> {
    /// Takes a connection, begins a transaction and claims `key` for `consumer` in it: `Some` with
    /// the transaction when this call inserted the key, `None` when it was there (nothing is left
    /// open).
    pub(crate) async fn claim(
        pool: &Pool<DB>,
        statements: &Statements,
        consumer: &str,
        key: &[u8],
        fingerprint: Option<&[u8]>,
    ) -> Result<Option<Self>, BeginError> {
        let mut conn = InFlight::acquire(pool).await?;
        let claimed = DB::begin_claim(conn.get(), statements, consumer, key, fingerprint).await;
        let conn = conn.landed();
        Ok(claimed.map_err(BeginError::Claim)?.then_some(Self { conn }))
    }

    /// Takes a connection and begins a transaction that will write.
    pub(crate) async fn begin(pool: &Pool<DB>) -> Result<Self, sqlx::Error> {
        let mut conn = InFlight::acquire(pool).await.map_err(BeginError::into_inner)?;
        let begun = begin::<DB>(conn.get()).await;
        let conn = conn.landed();
        begun.map(|()| Self { conn })
    }

    /// The transaction's connection.
    pub(crate) fn connection(&mut self) -> &mut DB::Connection {
        &mut self.conn
    }

    /// Commits. On an error the transaction is dropped, which rolls back what is left of it.
    pub(crate) async fn commit(mut self) -> Result<(), sqlx::Error> {
        <DB as Database>::TransactionManager::commit(&mut self.conn).await
    }

    /// Rolls back. When that fails the connection is broken: it is closed instead of going back
    /// to the pool, and the server rolls back as the session ends.
    pub(crate) async fn rollback(mut self) {
        if let Err(error) = <DB as Database>::TransactionManager::rollback(&mut self.conn).await {
            tracing::warn!(%error, "rollback failed; the connection is closed");
            self.conn.close_on_drop();
        }
    }
}

impl<DB: Backend> Drop for InboxTransaction<DB> {
    fn drop(&mut self) {
        if <DB as Database>::TransactionManager::get_transaction_depth(&self.conn) > 0 {
            // Sent before the connection's next use, which is the pool's check when it comes back.
            <DB as Database>::TransactionManager::start_rollback(&mut self.conn);
        }
    }
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

impl BeginError {
    fn into_inner(self) -> sqlx::Error {
        match self {
            BeginError::Acquire(error) | BeginError::Claim(error) => error,
        }
    }
}

/// A connection taking a step whose outcome on the server is unknown until it completes: closed if
/// dropped before [`landed`](Self::landed).
struct InFlight<DB: Database>(Option<PoolConnection<DB>>);

impl<DB: Database> InFlight<DB> {
    async fn acquire(pool: &Pool<DB>) -> Result<Self, BeginError> {
        Ok(Self(Some(pool.acquire().await.map_err(BeginError::Acquire)?)))
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
