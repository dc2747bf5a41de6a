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
