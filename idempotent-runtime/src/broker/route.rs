//! Where a delivery goes given its handler's outcome ([`Route`]), and its failure as one line.

use std::fmt;
use std::time::Duration;

use super::retry::RetryPolicy;
use crate::error::Error;
use crate::inbox::Handled;

/// What a runner does with a delivery, given its handler's outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// Acknowledge: the effect is committed, by this delivery or an earlier one.
    Ack,
    /// Deliver it again after `after`, as attempt number `attempt`.
    Retry {
        /// The number of the next attempt, counting from 1.
        attempt: u32,
        /// How long the broker holds it back.
        after: Duration,
    },
    /// Dead-letter it.
    DeadLetter {
        /// Why, for a person to read.
        reason: String,
        /// How many attempts were made.
        attempts: u32,
    },
}

impl Route {
    /// Returns the route of a delivery on its `attempt`-th attempt (counting from 1) whose handler
    /// returned `outcome`.
    pub fn of<T, E: fmt::Display>(
        outcome: &Result<Handled<T>, Error<E>>,
        attempt: u32,
        policy: &RetryPolicy,
    ) -> Self {
        match outcome {
            Ok(_) => Route::Ack,
            Err(error) => Self::failure(
                error.is_retryable(),
                &failure_reason(error),
                attempt,
                policy,
            ),
        }
    }

    /// The route of a delivery on its `attempt`-th attempt that failed, retryably or not, for
    /// `reason`.
    pub(crate) fn failure(
        retryable: bool,
        reason: &str,
        attempt: u32,
        policy: &RetryPolicy,
    ) -> Self {
        if retryable && attempt < policy.max_attempts {
            Route::Retry {
                attempt: attempt + 1,
                after: policy.delay_after(attempt),
            }
        } else if retryable {
            Route::DeadLetter {
                reason: format!("still failing after {attempt} attempts: {reason}"),
                attempts: attempt,
            }
        } else {
            Route::DeadLetter {
                reason: reason.to_owned(),
                attempts: attempt,
            }
        }
    }
}

/// A handler's error as one line: the error, and the causes of an inbox error.
fn failure_reason<E: fmt::Display>(error: &Error<E>) -> String {
    match error {
        Error::Handler(e) | Error::Transient(e) => truncate_for_header(e.to_string()),
        Error::Inbox(e) => inbox_failure_reason(e),
    }
}

/// An inbox error and its causes as one line.
pub(super) fn inbox_failure_reason(error: &crate::error::InboxError) -> String {
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    truncate_for_header(text)
}

/// At most a thousand bytes of `text`.
pub(super) fn truncate_for_header(mut text: String) -> String {
    // Headers are no place for a novel.
    if text.len() > 1000 {
        let mut end = 1000;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push('…');
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::InboxError;

    #[derive(Debug)]
    struct Oops;

    impl fmt::Display for Oops {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("oops")
        }
    }

    #[test]
    fn outcomes_route_as_the_table_says() {
        let policy = RetryPolicy::new(3, Duration::from_millis(100));
        let processed: Result<Handled<()>, Error<Oops>> = Ok(Handled::Processed(()));
        assert_eq!(Route::of(&processed, 1, &policy), Route::Ack);
        let transient: Result<Handled<()>, Error<Oops>> = Err(Error::Transient(Oops));
        assert_eq!(
            Route::of(&transient, 1, &policy),
            Route::Retry {
                attempt: 2,
                after: Duration::from_millis(100)
            }
        );
        assert_eq!(
            Route::of(&transient, 2, &policy),
            Route::Retry {
                attempt: 3,
                after: Duration::from_millis(200)
            }
        );
        assert!(matches!(
            Route::of(&transient, 3, &policy),
            Route::DeadLetter { attempts: 3, ref reason } if reason.contains("3 attempts") && reason.contains("oops")
        ));
        let failed: Result<Handled<()>, Error<Oops>> = Err(Error::Handler(Oops));
        assert_eq!(
            Route::of(&failed, 1, &policy),
            Route::DeadLetter {
                reason: "oops".into(),
                attempts: 1
            }
        );
        let ended: Result<Handled<()>, Error<Oops>> =
            Err(Error::Inbox(InboxError::TransactionAborted));
        assert!(matches!(Route::of(&ended, 1, &policy), Route::Retry { .. }));
    }

    fn duration() -> impl proptest::strategy::Strategy<Value = Duration> {
        use proptest::prelude::*;
        prop_oneof![
            (any::<u64>(), 0..1_000_000_000u32).prop_map(|(s, n)| Duration::new(s, n)),
            (0..100_000u64).prop_map(Duration::from_millis),
            Just(Duration::ZERO),
            Just(Duration::MAX),
        ]
    }

    fn multiplier() -> impl proptest::strategy::Strategy<Value = f64> {
        use proptest::prelude::*;
        prop_oneof![
            any::<f64>(),
            0.0..10.0f64,
            Just(f64::NAN),
            Just(f64::INFINITY),
            Just(f64::NEG_INFINITY),
        ]
    }

    proptest::proptest! {
        /// Issue 21: `RetryPolicy::new(66, 1 s).max_delay(m)` panicked (the delay overflowed
        /// before it was capped). No input panics; delays never shrink and never pass the longest.
        #[test]
        fn no_policy_panics_and_its_delays_never_shrink_nor_pass_the_longest(
            attempts in proptest::prelude::any::<u32>(),
            first in duration(),
            longest in duration(),
            multiplier in multiplier(),
            attempt in proptest::prelude::any::<u32>(),
        ) {
            let policy = RetryPolicy::new(attempts, first).multiplier(multiplier).max_delay(longest);
            let delay = policy.delay_after(attempt);
            proptest::prop_assert!(delay <= longest);
            if let Some(next) = attempt.checked_add(1) {
                proptest::prop_assert!(delay <= policy.delay_after(next));
            }
            if multiplier >= 1.0 && multiplier.is_finite() && attempt <= 1 {
                proptest::prop_assert_eq!(delay, first.min(longest));
            }
            let route = Route::failure(true, "oops", attempt, &policy);
            let retried = matches!(route, Route::Retry { .. });
            proptest::prop_assert_eq!(retried, attempt < policy.max_attempts);
        }
    }
}
