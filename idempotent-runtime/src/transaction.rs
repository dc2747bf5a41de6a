//! The handler's transaction, from its `BEGIN` to its end; the one place that decides what happens
//! to a transaction and its connection.
//!
//! sqlx's `Transaction` can only be made by sending its own `BEGIN`, and the inbox sends its
//! own: one that claims the key in the same message (PostgreSQL's pipelined claim), or one that
//! lets the commit tell later whether the transaction is still the one the inbox began (every
//! backend; see [`Store::BEGIN`](crate::store::Store)). So the inbox drives sqlx's transaction
//! manager itself, with the same rules as `Transaction`: sqlx tracks the depth, so that a
//! `begin()` in a handler's body opens a savepoint.
//!
//! The rules:
//! - A commit commits only the transaction the inbox began, with nothing failed in it. A body that
//!   carried on after a failed statement (PostgreSQL aborts the transaction, and its `COMMIT` would
//!   quietly roll back), or that ended the transaction itself (or had it rolled back under it by a
//!   deadlock on MySQL), gets an [`Ending`] other than `Committed`, never a success.
//! - A transaction dropped before it ended (a cancelled future, a panic) is rolled back by closing
//!   its connection, except where the driver recovers the connection itself (SQLite); a step whose
//!   outcome is unknown (a failed commit, a failed rollback) closes it everywhere. See
//!   [`session`](crate::session).

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::{AssertSqlSafe, Database, SqlSafeStr};
use sqlx_core::transaction::TransactionManager;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::Fault;
use crate::session::{Session, Source};
use crate::store::{Backend, Ending, InboxStatements, RolledBack, Statements, fault_of};

/// How long a transaction waits in the writers' queue before it goes on to the database's lock.
const WRITERS_QUEUE_PATIENCE: Duration = Duration::from_secs(5);

/// What a transaction needs besides the statements: where its connection comes from, and the
/// queue of an inbox's writers on a database with one writer at a time.
#[derive(Clone, Copy)]
pub(crate) struct Resources<'a, DB: Backend> {
    pub(crate) source: Source<'a, DB>,
    pub(crate) writers: Option<&'a Arc<Semaphore>>,
    /// What the inbox's `BEGIN`s end with ([`Statements::begin_suffix`]).
    pub(crate) begin_suffix: &'a str,
}

/// An open transaction, at depth one, that the inbox began. Dropped without
/// [`commit`](Self::commit) or [`rollback`](Self::rollback), it rolls back.
pub(crate) struct InboxTransaction<DB: Backend> {
    session: Session<DB>,
    state: DB::TransactionState,
    /// This transaction's turn in the writers' queue, released when it ends.
    _turn: Option<OwnedSemaphorePermit>,
    /// A statement of the inbox's proved it the one the inbox began, with nothing failed in it,
    /// and no statement of the body's ran since: the commit needs no check of its own.
    proven: bool,
    /// The statements that begin it, again after a claim that had to start over.
    begin: String,
}

/// What a claim found.
pub(crate) enum ClaimOutcome<DB: Backend> {
    /// The key is ours, in this open transaction.
    Claimed(InboxTransaction<DB>),
    /// The key was committed before; nothing is open on this session, which is free for reads.
    Duplicate(Session<DB>),
}

/// Why a transaction could not begin: no connection from the pool, or the statements that begin
/// it (and claim the key) failed.
pub(crate) enum BeginError {
    Acquire(sqlx::Error),
    Begin(sqlx::Error),
}

/// How a commit went; the session is clean and free for reads, except after `Err`.
pub(crate) type Committed<DB> = Result<(Ending, Session<DB>), sqlx::Error>;

impl<DB: Backend> InboxTransaction<DB> {
    /// Takes a connection, begins a transaction and claims `key` for `consumer` in it; with how
    /// long that took once the connection was taken (the writers' queue, the `BEGIN`, and the
    /// claim, which waits for an uncommitted claim of the same key).
    pub(crate) async fn begin_claim(
        with: Resources<'_, DB>,
        statements: &Statements,
        settings: &DB::Settings,
        consumer: &str,
        key: &[u8],
        fingerprint: Option<&[u8]>,
    ) -> Result<(ClaimOutcome<DB>, Duration), BeginError> {
        let session = Session::take(with.source)
            .await
            .map_err(BeginError::Acquire)?;
        let started = Instant::now();
        let claimed = Self::claim_on(
            session,
            with,
            statements,
            settings,
            consumer,
            key,
            fingerprint,
        )
        .await?;
        Ok((claimed, started.elapsed()))
    }

    async fn claim_on(
        session: Session<DB>,
        with: Resources<'_, DB>,
        statements: &Statements,
        settings: &DB::Settings,
        consumer: &str,
        key: &[u8],
        fingerprint: Option<&[u8]>,
    ) -> Result<ClaimOutcome<DB>, BeginError> {
        let turn = take_turn(with.writers).await;
        let mut tx = Self::begin_on(session, turn, DB::BEGIN, with.begin_suffix).await?;
        let pipelined = DB::pipelined_claim(
            settings,
            &statements.inbox,
            &tx.begin,
            consumer,
            key,
            fingerprint,
        );
        let claimed = match pipelined {
            Some(message) => tx.pipelined_claim(&message, statements, settings).await,
            None => Err(Pipeline::NotSent),
        };
        let claimed = match claimed {
            Ok(claimed) => Ok(claimed),
            Err(Pipeline::Failed(error)) => return Err(BeginError::Begin(error)),
            Err(Pipeline::NotSent) => {
                tx.separate_claim(statements, consumer, key, fingerprint)
                    .await
            }
        };
        match claimed {
            Ok(true) => Ok(ClaimOutcome::Claimed(tx)),
            Ok(false) => tx
                .rollback()
                .await
                .map(ClaimOutcome::Duplicate)
                .map_err(BeginError::Begin),
            Err(error) => {
                if fault_of(&error) == Fault::Broken {
                    // The connection cannot serve the next claim either (a standby's read-only
                    // session, statements it lost): closed, as after a body's such error.
                    tx.rollback_and_close().await;
                } else {
                    // A lock timeout, a deadlock: end what is open, keep the connection if that
                    // works.
                    let _ = tx.rollback().await;
                }
                Err(BeginError::Begin(error))
            }
        }
    }

    /// Takes a connection and begins a transaction that will write.
    pub(crate) async fn begin(with: Resources<'_, DB>) -> Result<Self, BeginError> {
        Self::begin_as(with, DB::BEGIN).await
    }

    /// Takes a connection and begins a transaction that will write with `begin`: the backend's
    /// `BEGIN` or one of its variants ([`Store::BEGIN_RELAY`]).
    ///
    /// [`Store::BEGIN_RELAY`]: crate::store::Store::BEGIN_RELAY
    pub(crate) async fn begin_as(
        with: Resources<'_, DB>,
        begin: &'static str,
    ) -> Result<Self, BeginError> {
        Self::begin_then(with, begin, None).await
    }

    /// [`begin_as`](Self::begin_as), with `then` sent in the same message after the `BEGIN`.
    async fn begin_then(
        with: Resources<'_, DB>,
        begin: &'static str,
        then: Option<&str>,
    ) -> Result<Self, BeginError> {
        let session = Session::take(with.source)
            .await
            .map_err(BeginError::Acquire)?;
        let turn = take_turn(with.writers).await;
        let mut tx = Self::begin_on(session, turn, begin, with.begin_suffix).await?;
        if let Some(then) = then {
            tx.begin.push_str(then);
        }
        tx.open().await.map_err(BeginError::Begin)?;
        Ok(tx)
    }

    /// Readies the session for a transaction (nothing is open yet) that `begin` and `suffix`
    /// will begin.
    async fn begin_on(
        mut session: Session<DB>,
        turn: Option<OwnedSemaphorePermit>,
        begin: &str,
        suffix: &str,
    ) -> Result<Self, BeginError> {
        let state = session
            .try_step(DB::ready_transaction)
            .await
            .map_err(BeginError::Begin)?;
        Ok(Self {
            session,
            state,
            _turn: turn,
            proven: false,
            begin: format!("{begin}{suffix}"),
        })
    }

    /// Sends the statements that begin it.
    async fn open(&mut self) -> Result<(), sqlx::Error> {
        self.begin_with(self.begin.clone()).await
    }

    /// Begins the transaction with `statement`, through sqlx's transaction manager.
    async fn begin_with(&mut self, statement: String) -> Result<(), sqlx::Error> {
        let statement = AssertSqlSafe(statement).into_sql_str();
        self.session
            .try_step(|conn| <DB as Database>::TransactionManager::begin(conn, Some(statement)))
            .await
    }

    /// The claim in one message with its `BEGIN`: `true` when it inserted the key, `false` when
    /// a committed duplicate made it fail with a unique violation (nothing is left open).
    async fn pipelined_claim(
        &mut self,
        message: &str,
        statements: &Statements,
        settings: &DB::Settings,
    ) -> Result<bool, Pipeline> {
        match self.begin_pipelined(message).await {
            Err(Pipeline::Failed(error)) if DB::lost_statement(&error) => {}
            outcome => return outcome,
        }
        // This session has not prepared the claim: a new connection, another inbox's (a tenant's)
        // first claim on it, or a `DEALLOCATE`. A body's `DEALLOCATE ALL` took the driver's
        // statements too: forget them, or every later body statement sqlx had cached fails on
        // this connection (the claim no longer tells). While the session holds them all, they
        // are kept.
        let lost = self
            .session
            .try_step(DB::lost_driver_statements)
            .await
            .map_err(Pipeline::Failed)?;
        if lost {
            self.session
                .try_step(DB::forget_statements)
                .await
                .map_err(Pipeline::Failed)?;
        }
        let prepared = self
            .session
            .try_step(|conn| async {
                match DB::prepare_pipelined_claim(conn, settings, &statements.inbox).await {
                    Ok(()) => Ok(true),
                    // The session that prepares it has it already, though the one that claimed
                    // had not: a pooler in transaction mode runs each transaction on another
                    // session.
                    Err(error) if DB::statement_exists(&error) => Ok(false),
                    Err(error) => Err(error),
                }
            })
            .await
            .map_err(Pipeline::Failed)?;
        if !prepared {
            return Err(Pipeline::NotSent);
        }
        match self.begin_pipelined(message).await {
            // Still missing: a pooler in transaction mode moved us to another session.
            Err(Pipeline::Failed(error)) if DB::lost_statement(&error) => Err(Pipeline::NotSent),
            outcome => outcome,
        }
    }

    async fn begin_pipelined(&mut self, message: &str) -> Result<bool, Pipeline> {
        let Err(error) = self.begin_with(message.to_owned()).await else {
            return Ok(true);
        };
        // The claim failed in the transaction its message began, which is now aborted (or the
        // `BEGIN` failed and there is none); sqlx counts none. End it before anything else.
        self.session
            .try_step(|conn| DB::run(conn, "ROLLBACK"))
            .await
            .map_err(Pipeline::Failed)?;
        // A unique violation says another transaction committed the key, whatever became of ours.
        match error.as_database_error() {
            Some(database) if database.is_unique_violation() => Ok(false),
            _ => Err(Pipeline::Failed(error)),
        }
    }

    /// The backend's `BEGIN`, then the claim in a statement of its own: `true` when it inserted
    /// the key (the transaction stays open), `false` when the key was there.
    async fn separate_claim(
        &mut self,
        statements: &Statements,
        consumer: &str,
        key: &[u8],
        fingerprint: Option<&[u8]>,
    ) -> Result<bool, sqlx::Error> {
        self.open().await?;
        let insert = InsertKey {
            statements: &statements.inbox,
            consumer,
            key,
            fingerprint,
        };
        self.claim_in(&insert).await
    }

    /// Takes a connection, begins a transaction that will write, and makes `claim` in it: the
    /// open transaction, with what the claim found (after an `Err`, roll the transaction back).
    #[cfg(feature = "http")]
    pub(crate) async fn begin_claiming<C: ClaimStatement<DB>>(
        with: Resources<'_, DB>,
        claim: &C,
    ) -> Result<(Self, Result<C::Found, sqlx::Error>), BeginError> {
        let mut tx = Self::begin_then(with, DB::BEGIN, claim.with_begin().as_deref()).await?;
        let found = tx.claim_in(claim).await;
        Ok((tx, found))
    }

    /// Makes `claim` in the open transaction. The one rule for a claim whose session lost the
    /// statement sqlx had prepared for it (a body's `DEALLOCATE ALL`): the transaction is rolled
    /// back, the driver's statements are forgotten, and the claim is made once more, in a new
    /// transaction on the same connection.
    async fn claim_in<C: ClaimStatement<DB>>(
        &mut self,
        claim: &C,
    ) -> Result<C::Found, sqlx::Error> {
        match self.session.step(|conn| claim.run(conn)).await {
            Err(error) if DB::lost_statement(&error) => {
                self.end_in_rollback().await?;
                self.session.try_step(DB::forget_statements).await?;
                self.open().await?;
                self.session.step(|conn| claim.run(conn)).await
            }
            found => found,
        }
    }

    /// The transaction's connection, for the inbox's own statements.
    pub(crate) fn connection(&mut self) -> &mut DB::Connection {
        self.session.get()
    }

    /// The transaction's connection, for the body's statements: what was proved of the
    /// transaction no longer holds.
    pub(crate) fn body_connection(&mut self) -> &mut DB::Connection {
        self.proven = false;
        self.session.get()
    }

    /// Notes that the inbox's last statement proved the transaction (see
    /// [`Store::commit_proven`](crate::store::Store::commit_proven)).
    pub(crate) fn proved(&mut self) {
        self.proven = true;
    }

    /// Commits, if the transaction is still the one the inbox began and nothing in it failed;
    /// otherwise rolls back what is open and says why. On `Err` the outcome is unknown and the
    /// connection is closed.
    pub(crate) async fn commit(mut self) -> Committed<DB> {
        let state = &self.state;
        let ending = if self.proven {
            self.session
                .try_step(|conn| DB::commit_proven(conn, state))
                .await?
        } else {
            self.session
                .try_step(|conn| DB::commit(conn, state))
                .await?
        };
        Ok((ending, self.release()))
    }

    /// Rolls back. When that fails, the connection is closed, and the server rolls back as the
    /// session ends.
    pub(crate) async fn rollback(mut self) -> Result<Session<DB>, sqlx::Error> {
        self.end_in_rollback().await?;
        Ok(self.release())
    }

    /// Rolls back after a body failed, and says whether what it rolled back was still the
    /// transaction the inbox began. When the rollback fails, the connection is closed.
    pub(crate) async fn rollback_checked(
        mut self,
    ) -> Result<(RolledBack, Session<DB>), sqlx::Error> {
        let state = &self.state;
        let rolled_back = self
            .session
            .try_step(|conn| DB::rollback_checked(conn, state))
            .await
            .inspect_err(
                |error| tracing::warn!(%error, "rollback failed; the connection is closed"),
            )?;
        Ok((rolled_back, self.release()))
    }

    /// Rolls back, and closes the connection whatever happens: a handler's error said the
    /// connection cannot be trusted.
    pub(crate) async fn rollback_and_close(mut self) {
        self.session.discard();
        let conn = self.session.get();
        let _ = DB::rollback(conn, &self.state).await;
    }

    async fn end_in_rollback(&mut self) -> Result<(), sqlx::Error> {
        let state = &self.state;
        self.session
            .try_step(|conn| DB::rollback(conn, state))
            .await
            .inspect_err(
                |error| tracing::warn!(%error, "rollback failed; the connection is closed"),
            )
    }

    /// The session, once the transaction has ended. (Dropped instead, the transaction leaves what
    /// is still open to the session's drop, after its state.)
    fn release(self) -> Session<DB> {
        self.session
    }
}

/// A claim's statement, made in the open transaction: the inbox's claim, which waits for a
/// concurrent claim of the same key, or the HTTP layer's, which does not.
pub(crate) trait ClaimStatement<DB: Backend>: Sync {
    /// What the claim found.
    type Found;

    /// What the claim sends in the message of its transaction's `BEGIN`, after it, if anything.
    #[cfg(feature = "http")]
    fn with_begin(&self) -> Option<String> {
        None
    }

    /// Runs the statement on `conn`.
    fn run<'c>(
        &'c self,
        conn: &'c mut DB::Connection,
    ) -> impl Future<Output = Result<Self::Found, sqlx::Error>> + Send + 'c;
}

/// The inbox's claim: inserts the key unless it is there, waiting for a concurrent claim of it;
/// finds whether it inserted it.
struct InsertKey<'a> {
    statements: &'a InboxStatements,
    consumer: &'a str,
    key: &'a [u8],
    fingerprint: Option<&'a [u8]>,
}

impl<DB: Backend> ClaimStatement<DB> for InsertKey<'_> {
    type Found = bool;

    fn run<'c>(
        &'c self,
        conn: &'c mut DB::Connection,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'c {
        DB::insert_key(
            conn,
            self.statements,
            self.consumer,
            self.key,
            self.fingerprint,
        )
    }
}

/// How a pipelined claim went wrong.
enum Pipeline {
    /// The backend does not send one, or the session cannot keep its prepared statement.
    NotSent,
    Failed(sqlx::Error),
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
