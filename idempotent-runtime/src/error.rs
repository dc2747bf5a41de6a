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
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Stage::Begin => "beginning the handler's transaction",
            Stage::Claim => "claiming the message key",
            Stage::Commit => "committing the handler's transaction",
            Stage::Migrate => "creating the inbox table",
            Stage::Inspect => "reading the inbox",
            Stage::Purge => "purging expired rows",
            Stage::Call => "recording a call to an outside service",
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
    /// The consumer name is empty or too long.
    #[error("invalid consumer name {name:?}: {reason}")]
    ConsumerName {
        /// The name as it was given.
        name: String,
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
    /// The database failed; see [`InboxError::is_retryable`].
    #[error("database error while {stage}")]
    Database {
        /// What the inbox was doing.
        stage: Stage,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
}

impl InboxError {
    pub(crate) fn database(stage: Stage) -> impl FnOnce(sqlx::Error) -> Self {
        move |source| InboxError::Database { stage, source }
    }

    /// Whether delivering the same message again may succeed: a serialization failure, a deadlock,
    /// a busy or locked database, a lost connection or an exhausted pool. A consumer loop should
    /// negatively acknowledge (requeue) on these, and dead-letter on the rest.
    pub fn is_retryable(&self) -> bool {
        match self {
            InboxError::Database { source, .. } => is_retryable(source),
            InboxError::CallInProgress { .. } => true,
            _ => false,
        }
    }
}

/// The error of a function rewritten by `#[idempotent]`: the handler's own error, kept intact, or
/// an error of the inbox. Either way nothing was committed, except possibly when the inbox error
/// happened at [`Stage::Commit`].
#[derive(Debug)]
pub enum Error<E> {
    /// The handler's body returned this error; its transaction was rolled back and the key stays
    /// unclaimed, so a redelivery runs the body again.
    Handler(E),
    /// The inbox failed before or after the body ran.
    Inbox(InboxError),
}

impl<E> Error<E> {
    /// The handler's own error, if that is what this is.
    pub fn handler_error(&self) -> Option<&E> {
        match self {
            Error::Handler(e) => Some(e),
            Error::Inbox(_) => None,
        }
    }

    /// The inbox's error, if that is what this is.
    pub fn inbox_error(&self) -> Option<&InboxError> {
        match self {
            Error::Handler(_) => None,
            Error::Inbox(e) => Some(e),
        }
    }

    /// Whether the inbox failed in a way a redelivery may not (see [`InboxError::is_retryable`]).
    /// A handler error is the handler's to classify, so it returns `false` here; for one that wraps
    /// a [`sqlx::Error`], [`is_retryable`] tells.
    pub fn is_retryable(&self) -> bool {
        self.inbox_error().is_some_and(InboxError::is_retryable)
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
            Error::Inbox(e) => fmt::Display::fmt(e, f),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for Error<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Handler(e) => Some(e),
            Error::Inbox(e) => e.source(),
        }
    }
}

/// Whether a driver error is transient, so that the same work may succeed when tried again:
/// serialization failures, deadlocks, lock timeouts, a busy or locked SQLite database, lost or
/// refused connections, an exhausted pool.
pub fn is_retryable(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => crate::store::is_retryable_database_error(db.as_ref()),
        _ => false,
    }
}
