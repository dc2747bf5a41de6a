//! Taking a connection for the inbox's work and giving it back: to the pool, to the spares its
//! workers keep, or closed when nothing says what state it is in.
//!
//! Workers ([`Inbox::for_worker`](crate::Inbox::for_worker)) keep the connections of transactions
//! that ended cleanly as spares, shared by every worker of one inbox, and take a spare before they
//! ask the pool: sqlx checks a connection with a round trip each time it goes back to the pool and
//! each time it is taken, and the spares skip both. A spare is only kept while no worker of the
//! inbox waits for a connection, so that more workers than connections take turns instead of
//! starving, and the spares go back to the pool when the last worker is dropped.
//!
//! A connection dropped while a step on it was still in flight (a cancelled future, a panic) is
//! in an unknown state: a `BEGIN` the server ran but the driver never counted, a protocol stream
//! out of step (sqlx's MySQL driver then hangs on its next use). It is closed, which ends whatever
//! the server had open, unless the backend's driver recovers such connections itself (SQLite).

use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};

use sqlx::pool::PoolConnection;
use sqlx::{Database, Pool};
use sqlx_core::transaction::TransactionManager;

use crate::store::Backend;

/// The connections an inbox's workers keep between transactions, and how many of its workers are
/// waiting for the pool.
pub(crate) struct Spares<DB: Database> {
    state: Mutex<SparesState<DB>>,
}

struct SparesState<DB: Database> {
    idle: Vec<PoolConnection<DB>>,
    /// Calls of this inbox waiting for a connection from the pool.
    waiting: usize,
    /// Worker inboxes alive; the spares go back to the pool when the last one is dropped.
    workers: usize,
}

impl<DB: Database> Default for Spares<DB> {
    fn default() -> Self {
        Self {
            state: Mutex::new(SparesState {
                idle: Vec::new(),
                waiting: 0,
                workers: 0,
            }),
        }
    }
}

impl<DB: Database> Spares<DB> {
    fn lock(&self) -> MutexGuard<'_, SparesState<DB>> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Held by every clone of one worker inbox: while any is alive, the inbox keeps spares.
pub(crate) struct Worker<DB: Database> {
    spares: Arc<Spares<DB>>,
}

impl<DB: Database> Worker<DB> {
    pub(crate) fn new(spares: &Arc<Spares<DB>>) -> Arc<Self> {
        spares.lock().workers += 1;
        Arc::new(Self {
            spares: spares.clone(),
        })
    }
}

impl<DB: Database> Drop for Worker<DB> {
    fn drop(&mut self) {
        let mut state = self.spares.lock();
        state.workers -= 1;
        if state.workers == 0 {
            let idle = std::mem::take(&mut state.idle);
            drop(state);
            drop(idle); // back to the pool
        }
    }
}

/// Where the inbox takes connections from, and whether it keeps them.
pub(crate) struct Source<'a, DB: Database> {
    pub(crate) pool: &'a Pool<DB>,
    pub(crate) spares: &'a Arc<Spares<DB>>,
    /// This is a worker's inbox: it keeps the connections of clean ends as spares.
    pub(crate) keeps: bool,
}

impl<DB: Database> Clone for Source<'_, DB> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<DB: Database> Copy for Source<'_, DB> {}

/// A connection the inbox took; see the module docs for where it goes when dropped.
pub(crate) struct Session<DB: Backend> {
    conn: Option<PoolConnection<DB>>,
    spares: Option<Arc<Spares<DB>>>,
    /// A step was started and has not finished: nothing says what state the connection is in.
    in_doubt: bool,
}

impl<DB: Backend> Session<DB> {
    /// A spare, if there is one; else a connection from the pool.
    pub(crate) async fn take(from: Source<'_, DB>) -> Result<Self, sqlx::Error> {
        let spare = {
            let mut state = from.spares.lock();
            let spare = state.idle.pop();
            if spare.is_none() {
                state.waiting += 1;
            }
            spare
        };
        let conn = match spare {
            Some(conn) => conn,
            None => {
                let waiting = Waiting(from.spares);
                let conn = from.pool.acquire().await;
                drop(waiting);
                conn?
            }
        };
        Ok(Self {
            conn: Some(conn),
            spares: from.keeps.then(|| from.spares.clone()),
            in_doubt: false,
        })
    }

    /// The connection.
    pub(crate) fn get(&mut self) -> &mut DB::Connection {
        self.conn
            .as_mut()
            .expect("a session has its connection until dropped")
    }

    /// Runs `step` on the connection, which is in doubt until the step returns `Ok`: a step that
    /// failed, or was dropped half-way, leaves the connection to be closed with the session.
    pub(crate) async fn try_step<'s, T, E, F>(
        &'s mut self,
        step: impl FnOnce(&'s mut DB::Connection) -> F,
    ) -> Result<T, E>
    where
        F: Future<Output = Result<T, E>>,
    {
        let (conn, in_doubt) = self.parts();
        *in_doubt = true;
        let done = step(conn).await;
        if done.is_ok() {
            *in_doubt = false;
        }
        done
    }

    /// Runs `step` on the connection, which is in doubt until the step returns, whatever it
    /// returns: a step dropped half-way leaves the connection to be closed with the session.
    pub(crate) async fn step<'s, T, F>(
        &'s mut self,
        step: impl FnOnce(&'s mut DB::Connection) -> F,
    ) -> T
    where
        F: Future<Output = T>,
    {
        let (conn, in_doubt) = self.parts();
        *in_doubt = true;
        let done = step(conn).await;
        *in_doubt = false;
        done
    }

    /// The connection and the mark of a step in doubt, borrowed apart.
    fn parts(&mut self) -> (&mut DB::Connection, &mut bool) {
        let conn = self
            .conn
            .as_mut()
            .expect("a session has its connection until dropped");
        (conn, &mut self.in_doubt)
    }

    /// Marks the connection to be closed when the session is dropped: its state is unknown.
    pub(crate) fn discard(&mut self) {
        self.in_doubt = true;
    }
}

impl<DB: Backend> Drop for Session<DB> {
    fn drop(&mut self) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        let depth = <DB as Database>::TransactionManager::get_transaction_depth(&conn);
        if self.in_doubt || depth > 0 {
            if !DB::CANCEL_SAFE {
                conn.close_on_drop();
            } else {
                // The driver queues the rollbacks behind what is in flight and runs them before
                // the connection's next use, which is the pool's check as it comes back. Sent
                // even when no transaction shows: a step in doubt may be a `BEGIN` the driver
                // has yet to count, or a `COMMIT` or `ROLLBACK` it ran but could not report,
                // after which it skips the next rollback sent this way (the one a dropped
                // `Transaction` sends): left unspent, that mark would swallow the rollback of
                // the next transaction dropped on this connection, which would then go back to
                // the pool open. At a depth of 0 a rollback does nothing.
                for _ in 0..depth.max(1) {
                    <DB as Database>::TransactionManager::start_rollback(&mut conn);
                }
            }
            return;
        }
        if let Some(spares) = &self.spares {
            let mut state = spares.lock();
            if state.waiting == 0 && state.workers > 0 {
                state.idle.push(conn);
            }
        }
    }
}

/// Counts a call waiting for the pool while it waits.
struct Waiting<'a, DB: Database>(&'a Arc<Spares<DB>>);

impl<DB: Database> Drop for Waiting<'_, DB> {
    fn drop(&mut self) {
        self.0.lock().waiting -= 1;
    }
}
