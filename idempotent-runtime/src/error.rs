//! Errors, and which of them a consumer should retry.

use std::fmt;

use crate::key::KeyError;

/// What the inbox was doing when the database failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Stage {
    /// Taking a connection from the pool and beginning the handler's transaction.
    Begin,
    /// Inserting the message key into the inbox.
    Claim,
    /// Storing the body's response with the inbox row, in the handler's transaction.
    StoreResponse,
    /// Committing the handler's transaction (the effect and the inbox row together). When this
    /// fails the commit may or may not have happened: a redelivery finds out which.
    Commit,
    /// Creating the inbox table.
    Migrate,
    /// Reading the inbox outside a handler.
    Inspect,
    /// Deleting expired rows.
    Purge,
    /// Recording a call to an outside service.
    Call,
    /// Forgetting a message on purpose, with its audit row.
    Forget,
    /// Writing outgoing messages to the outbox, in the handler's transaction.
    Outbox,
    /// Taking outgoing messages from the outbox and marking what the broker confirmed (a relay).
    Relay,
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Stage::Begin => "beginning the handler's transaction",
            Stage::Claim => "claiming the message key",
            Stage::StoreResponse => "storing the response",
            Stage::Commit => "committing the handler's transaction",
            Stage::Migrate => "creating the inbox table",
            Stage::Inspect => "reading the inbox",
            Stage::Purge => "purging expired rows",
            Stage::Call => "recording a call to an outside service",
            Stage::Forget => "forgetting a message",
            Stage::Outbox => "writing outgoing messages to the outbox",
            Stage::Relay => "relaying outgoing messages from the outbox",
        })
    }
}

/// An error of the inbox itself, as opposed to one of the handler's own.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InboxError {
    /// The message's key cannot be used (it is empty); retrying the same message fails again.
    #[error("invalid message key")]
    Key(#[from] KeyError),
    /// The configured inbox table name is not a plain SQL identifier.
    #[error("invalid inbox table name {name:?}: {reason}")]
    TableName {
        /// The name as it was given.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The schema given for an inbox's tables is not a plain SQL identifier.
    #[error("invalid schema name {name:?}: {reason}")]
    SchemaName {
        /// The name as it was given.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A message names a tenant the [`Tenants`](crate::Tenants) it was looked up in does not
    /// have; not retryable (the same message names it again).
    #[error("no tenant {tenant:?}")]
    UnknownTenant {
        /// The tenant as the message named it.
        tenant: String,
    },
    /// The consumer name is empty, too long or holds a NUL byte.
    #[error("invalid consumer name {name:?}: {reason}")]
    ConsumerName {
        /// The name as it was given.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The name of a call to an outside service is empty, too long or holds a NUL byte.
    #[error("invalid call name {name:?}: {reason}")]
    CallName {
        /// The name as it was given.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The lease asked for a call to an outside service is zero or longer than
    /// [`MAX_CALL_LEASE`](crate::calls::MAX_CALL_LEASE).
    #[error("invalid call lease of {lease:?}: {reason}")]
    Lease {
        /// The lease as it was given.
        lease: std::time::Duration,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The message's key was processed before with a different payload fingerprint: the producer
    /// reused a message id for another message. Not retryable: the same message fails again.
    #[error("message key was processed before with a different payload")]
    FingerprintMismatch {
        /// The consumer.
        consumer: String,
        /// The reused key.
        key: crate::key::MessageKey,
    },
    /// A response could not be stored or read back (serialization).
    #[error("could not serialize or deserialize a stored response")]
    Response {
        /// What serde said.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The message (or its fingerprinted fields) could not be serialized for its fingerprint.
    #[error("could not serialize the message for its fingerprint")]
    Fingerprint {
        /// What serde said.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A statement of the body failed and the body carried on, as if it had not: the database
    /// (PostgreSQL) had aborted the transaction, and nothing was committed. Retryable: the message
    /// is untouched and a redelivery runs the body again (if the failure was not transient, it
    /// fails again, and the consumer's bounded attempts dead-letter it). Let a body's statement
    /// that may fail run in a nested transaction (`tx.begin()`, a savepoint) to carry on after it.
    #[error("a statement of the handler failed and the handler carried on; nothing was committed")]
    TransactionAborted,
    /// When the inbox came to end the handler's transaction, it was no longer the one it began:
    /// the body ended it (its own `COMMIT` or `ROLLBACK`; on MySQL any statement that commits
    /// implicitly, such as `BEGIN`, `CREATE TABLE`, `TRUNCATE` or `SET autocommit = 1`), or the
    /// database rolled it back under the body (a deadlock the body ignored). Whatever was open
    /// then was rolled back. Reported whether the body returned `Ok` or its own error (an error
    /// whose sources show that the database failed under the body, a deadlock or a lost
    /// connection, stays [`Error::Transient`]), so that a consumer never acknowledges or retries
    /// such a message blindly. Retryable only when nothing of the message can have been committed.
    #[error(
        "the handler's transaction ended before the inbox could commit it{}",
        if *key_committed { "; the key was committed with part of the work" } else { "" }
    )]
    TransactionEnded {
        /// The claim was committed with whatever the body had done before it ended the
        /// transaction: a redelivery is a duplicate, though the effect may be incomplete.
        key_committed: bool,
        /// Writes the body made after the end could not commit on their own, and were rolled
        /// back: on MySQL and MariaDB autocommit is off around the inbox's transaction (unless the
        /// body turned it on: `SET autocommit = 1` commits what is open, and each write after it),
        /// SQLite's commit hook refuses their commits. On PostgreSQL a write after the body's own
        /// `COMMIT` or `ROLLBACK` commits on its own: this is `false` there.
        later_writes_refused: bool,
    },
    /// Another attempt holds a live lease on this call to an outside service; try again after
    /// `retry_after`. Retryable.
    #[error("the call is in progress elsewhere; retry in {retry_after:?}")]
    CallInProgress {
        /// When the other attempt's lease runs out.
        retry_after: std::time::Duration,
    },
    /// This attempt's lease on a call expired and a later attempt took the call over; its result
    /// was not recorded. Not retryable for this attempt: the later one owns the call.
    #[error("the call was taken over by a later attempt (this attempt's fence was {fence})")]
    Fenced {
        /// This attempt's fencing token.
        fence: i64,
    },
    /// This attempt had completed the call already, with another result: the first result stands.
    #[error("the call was completed before by this attempt (fence {fence}), with another result")]
    CallCompleted {
        /// This attempt's fencing token.
        fence: i64,
    },
    /// The message is older than its consumer's purge horizon: rows of messages that old may have
    /// been purged, so the inbox cannot tell whether it was processed before, and refuses to run
    /// the body again. Its send time came from its UUIDv7 key or the field named in
    /// `#[idempotent(sent_at = "...")]`. Not retryable: dead-letter it for a person to decide
    /// (`inbox.forget` does not help here; replay it as a new message if it must run).
    #[error(
        "the message was sent before its consumer's purge horizon; it may have been processed already"
    )]
    OlderThanHorizon {
        /// The consumer.
        consumer: String,
        /// The message's key.
        key: crate::key::MessageKey,
        /// When the message says it was sent.
        sent_at: std::time::SystemTime,
        /// The consumer's purge horizon: rows processed before it may have been deleted. The
        /// message is refused when it was sent before this plus the clock-skew margin.
        horizon: std::time::SystemTime,
    },
    /// The inbox tables were made by a newer version of this library: this one will not touch
    /// them. Upgrade the library (every instance), or restore the older tables.
    #[error(
        "the inbox table {table} has schema version {found}, newer than the {supported} this library knows"
    )]
    SchemaTooNew {
        /// The inbox table.
        table: String,
        /// The version the tables record.
        found: u32,
        /// The newest version this library knows, [`CURRENT_VERSION`](crate::schema::CURRENT_VERSION).
        supported: u32,
    },
    /// The reason given to [`Inbox::forget`](crate::Inbox::forget) is empty, too long or holds a
    /// NUL byte.
    #[error("invalid reason for forgetting a message: {reason}")]
    Reason {
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A connection pooler in transaction mode (PgBouncer's `pool_mode = transaction`) sits
    /// between the inbox's pool and PostgreSQL: it hands each transaction whichever server
    /// session is free, so the statements sqlx prepares on one session are missing, or clash with
    /// another client's, in the next transaction. Open the inbox with
    /// [`Inbox::with_transaction_pooling`](crate::Inbox::with_transaction_pooling) (and the pool
    /// as the guide "Running at scale" says, in its section on PgBouncer:
    /// <https://docs.rs/idempotent-inbox/latest/idempotent/guide/scale/index.html#pgbouncer>), or
    /// connect directly or in session mode. Not
    /// retryable: found by [`Inbox::migrate`](crate::Inbox::migrate) at start-up.
    #[error(
        "a pooler in transaction mode sits between the inbox and the database; open the inbox with_transaction_pooling()"
    )]
    TransactionPooling,
    /// An outgoing message queued in the [outbox](crate::outbox) cannot be stored or published as
    /// it is (an empty destination, an empty id, a text too long or holding a NUL byte). Nothing
    /// was committed; not retryable: the handler queues the same message again.
    #[error("outgoing message {position} of the outbox cannot be sent: {reason}")]
    Outgoing {
        /// Its position among the outbox's messages, from 0.
        position: usize,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The database failed; see [`InboxError::is_retryable`].
    #[error("database error while {stage}")]
    Database {
        /// What the inbox was doing.
        stage: Stage,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
        /// What the error says about a retry, as the database's backend classified it.
        fault: Fault,
    },
}

impl InboxError {
    /// Returns whether delivering the same message again may succeed: a serialization failure, a
    /// deadlock, a busy, locked or full database, a lost connection or an exhausted pool, a call in
    /// progress elsewhere, a transaction that ended with nothing committed. A consumer should
    /// redeliver these after a back-off, and dead-letter the rest.
    pub fn is_retryable(&self) -> bool {
        match self {
            InboxError::Database { fault, .. } => *fault != Fault::None,
            InboxError::CallInProgress { .. } | InboxError::TransactionAborted => true,
            InboxError::TransactionEnded {
                key_committed,
                later_writes_refused,
            } => !key_committed && *later_writes_refused,
            _ => false,
        }
    }
}

/// What a driver error says about retrying the work that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// Nothing transient: the same work fails again.
    None,
    /// A retry may succeed: a deadlock, a serialization failure, a lock timeout, a busy or full
    /// database, a cluster conflict, an exhausted pool.
    Transient,
    /// The connection is lost or cannot be used any more: a retry on another connection may
    /// succeed.
    Broken,
}

/// The error of a function rewritten by `#[idempotent]`: the handler's own error, kept intact, or
/// an error of the inbox. Either way nothing was committed, except possibly when the inbox error
/// happened at [`Stage::Commit`], or is [`InboxError::TransactionEnded`] with the key committed.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error<E> {
    /// The handler's body returned this error; its transaction was rolled back and the key stays
    /// unclaimed, so a redelivery runs the body again. Whether to retry is the handler's call.
    Handler(E),
    /// The handler's body returned this error because the database failed under it: the
    /// connection was lost, or the database rolled the transaction back (a deadlock, a
    /// serialization failure, a lock timeout, a Galera conflict). Everything was rolled back;
    /// retryable. The inbox finds such a failure in the error's sources (a `sqlx::Error` or a
    /// driver's database error in them, whatever the handler's error type wraps them in), or
    /// because the rollback after the error found the connection dead. A body marks a transient
    /// failure of its own (a downstream 503) with [`Retryable`](crate::Retryable) among the
    /// error's sources: that is this too.
    Transient(E),
    /// The inbox failed before or after the body ran.
    Inbox(InboxError),
}

impl<E> Error<E> {
    /// Returns the handler's own error (of either kind), if that is what this is.
    pub fn handler_error(&self) -> Option<&E> {
        match self {
            Error::Handler(e) | Error::Transient(e) => Some(e),
            Error::Inbox(_) => None,
        }
    }

    /// Returns the inbox's error, if that is what this is.
    pub fn inbox_error(&self) -> Option<&InboxError> {
        match self {
            Error::Handler(_) | Error::Transient(_) => None,
            Error::Inbox(e) => Some(e),
        }
    }

    /// Returns whether a redelivery of the message may succeed: [`Error::Transient`], or an inbox
    /// error that [is retryable](InboxError::is_retryable). [`Error::Handler`] is the handler's to
    /// classify: `false` here.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Handler(_) => false,
            Error::Transient(_) => true,
            Error::Inbox(e) => e.is_retryable(),
        }
    }
}

impl<E: std::error::Error + 'static> Error<E> {
    /// A body's error: [`Error::Transient`] when a database failure is among its sources,
    /// [`Error::Handler`] otherwise.
    pub(crate) fn of_body(error: E, fault: impl FnOnce(&E) -> Fault) -> Self {
        match fault(&error) {
            Fault::None => Error::Handler(error),
            _ => Error::Transient(error),
        }
    }
}

impl<E> From<InboxError> for Error<E> {
    fn from(error: InboxError) -> Self {
        Error::Inbox(error)
    }
}

/// Says which side failed; the handler's own error is the [`source`](std::error::Error::source).
impl<E> fmt::Display for Error<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Handler(_) => f.write_str("the handler failed"),
            Error::Transient(_) => {
                f.write_str("the handler failed transiently (the database failed under it, or the error is marked Retryable)")
            }
            Error::Inbox(e) => fmt::Display::fmt(e, f),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for Error<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Handler(e) | Error::Transient(e) => Some(e),
            Error::Inbox(e) => e.source(),
        }
    }
}
