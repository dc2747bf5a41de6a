//! What a [`Check`](super::Check) reports when a schedule's state differs from one clean
//! delivery's.

use std::fmt;

/// A way of delivering the message, as a broker would.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Schedule {
    /// Delivered once, to the end: the state every other schedule is compared with.
    Clean,
    /// Delivered twice, one delivery after the other (a redelivery after a lost acknowledgement,
    /// a producer's retry).
    Twice,
    /// This many copies delivered at once (two instances given the same message).
    AtOnce(usize),
    /// Delivered, the process crashed after the body and before the commit, then delivered again.
    CrashedBeforeCommit,
    /// Delivered, the database connection lost right after the claim (the server ended it, as a
    /// restart or a cut connection does), so that the body's statements failed; then delivered
    /// again. On PostgreSQL and MySQL; not on SQLite, which has no connection to lose.
    ConnectionLost,
    /// Delivered, the delivery dropped at this await point (numbered from 1: a crash, a timeout,
    /// a cancelled task), then delivered again to the end.
    DroppedAt(usize),
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Schedule::Clean => f.write_str("one clean delivery"),
            Schedule::Twice => f.write_str("delivered twice, one after the other"),
            Schedule::AtOnce(copies) => write!(f, "{copies} copies delivered at once"),
            Schedule::CrashedBeforeCommit => {
                f.write_str("crashed after the body, before the commit, then delivered again")
            }
            Schedule::ConnectionLost => {
                f.write_str("the database connection lost during the body, then delivered again")
            }
            Schedule::DroppedAt(point) => write!(
                f,
                "dropped at its await point {point}, then delivered again"
            ),
        }
    }
}

/// The first schedule under which the handler did not behave as one clean delivery: what was
/// expected, what was found, and what usually causes it.
#[derive(Debug, Clone)]
pub struct Divergence {
    /// The schedule.
    pub schedule: Schedule,
    /// What went wrong, in a sentence.
    pub what: String,
    /// The state after one clean delivery (`{:?}`), where states were compared.
    pub expected: Option<String>,
    /// The state after this schedule (`{:?}`), where states were compared.
    pub found: Option<String>,
    /// What usually causes it, and what to do instead.
    pub hint: &'static str,
}

impl fmt::Display for Divergence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.schedule, self.what)?;
        if let (Some(expected), Some(found)) = (&self.expected, &self.found) {
            write!(
                f,
                "\n  after one clean delivery: {expected}\n  after this schedule:      {found}"
            )?;
        }
        write!(f, "\n  help: {}", self.hint)
    }
}

impl std::error::Error for Divergence {}

/// Why a schedule's state differs from a clean delivery's when the handler ran once.
pub(super) const OUTSIDE_THE_TRANSACTION: &str = "the body had an effect outside its transaction: \
     a write on another connection or pool, or a call to an outside service made without the \
     message's `IdempotencyKey` (or the calls API). Write through the connection the handler is \
     given, and pass the key on to outside services";

/// Why a second delivery of the same message ran the body again.
pub(super) const UNSTABLE_KEY: &str = "the key differs between deliveries of the same message: \
     key on an id the producer sets once (a message id, a business key), not a field filled in \
     on receipt (a receive time, a delivery tag, a fresh UUID)";

/// Why a clean delivery failed.
pub(super) const CLEAN_FAILED: &str = "a delivery on a fresh database must succeed for the \
     schedules to mean anything. A statement that waited for a lock or a connection until it \
     failed usually ran on another connection than the handler's own, which waits for the \
     handler's transaction";

/// Why a delivery whose connection was lost, and then delivered again, left another state.
pub(super) const ERROR_PATH_EFFECT: &str = "the body's error path had an effect outside its \
     transaction: a fallback write on another connection or pool, a compensating call, a \
     notification. When the database fails under the body, return the error and let the message \
     be delivered again: its redelivery does the work";

/// Why a delivery whose connection was lost ended in an error that is not retryable.
pub(super) const LOST_CONNECTION_NOT_RETRYABLE: &str = "a lost database connection must leave \
     the message to be delivered again, but the handler's error says it cannot succeed \
     (`Error::Handler`), so a runner would dead-letter the message on a restart of the database. \
     Return `Error::Transient` for errors that `idempotent::is_retryable` says may pass (an \
     `#[idempotent]` handler does: a body's error from a failed database is retryable)";

/// Why a delivery whose connection was lost succeeded.
pub(super) const LOST_CONNECTION_IGNORED: &str = "the body's statements failed on the lost \
     connection, but the delivery succeeded: the handler swallowed the database's errors (or wrote \
     elsewhere). Return them, so that nothing commits and the message is delivered again";
