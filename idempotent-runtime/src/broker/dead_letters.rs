//! Dead letters as an operator sees them, whatever the broker: what a runner wrote on each
//! ([`DeadLetter`]), and the filter that picks some to list or to put back ([`DeadLetterFilter`]).
//! Each broker's module reads and moves its own (`sqs::DeadLetterQueue`, `rabbitmq::…`,
//! `nats::…`, `kafka::…`); the `idempotent dlq` command calls them.

use std::time::{Duration, SystemTime};

/// A dead letter, with what the runner that dead-lettered it wrote on it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetter {
    /// The broker's own id of the dead letter (SQS: its `MessageId` in the dead-letter queue).
    pub id: String,
    /// The producer's id of the message, the key its consumer's inbox has; `None` for a message
    /// that was dead-lettered because it had none.
    pub message_id: Option<String>,
    /// Why it was dead-lettered, as the runner wrote it; `None` for one the broker moved itself
    /// (SQS's redrive policy after `maxReceiveCount` receives: the consumer crashed each time).
    pub reason: Option<String>,
    /// The attempts it had, as the runner counted them.
    pub attempts: Option<u32>,
    /// Where it came from, and where a redrive puts it back.
    pub source: Option<String>,
    /// When it was dead-lettered.
    pub dead_lettered_at: Option<SystemTime>,
    /// Its headers (SQS: its text attributes), the runner's among them.
    pub headers: Vec<(String, String)>,
    /// Its payload.
    pub payload: Vec<u8>,
}

impl DeadLetter {
    /// Returns the value of header `name`, if it is there.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }

    /// Returns how long ago it was dead-lettered, by `now` (zero for a time in the future).
    pub fn age(&self, now: SystemTime) -> Option<Duration> {
        self.dead_lettered_at
            .map(|at| now.duration_since(at).unwrap_or_default())
    }
}

/// Which dead letters to list or put back: every one by default; with a reason that contains some
/// text, older or newer than an age, and at most so many.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeadLetterFilter {
    reason: Option<String>,
    older_than: Option<Duration>,
    newer_than: Option<Duration>,
    message_id: Option<String>,
    limit: Option<usize>,
}

impl DeadLetterFilter {
    /// Returns a filter that takes every dead letter.
    pub fn new() -> Self {
        Self::default()
    }

    /// Returns the same filter, taking only dead letters whose reason contains `text` (ignoring
    /// case).
    pub fn reason_contains(self, text: impl Into<String>) -> Self {
        Self {
            reason: Some(text.into().to_lowercase()),
            ..self
        }
    }

    /// Returns the same filter, taking only dead letters dead-lettered at least `age` ago.
    pub fn older_than(self, age: Duration) -> Self {
        Self {
            older_than: Some(age),
            ..self
        }
    }

    /// Returns the same filter, taking only dead letters dead-lettered less than `age` ago.
    pub fn newer_than(self, age: Duration) -> Self {
        Self {
            newer_than: Some(age),
            ..self
        }
    }

    /// Returns the same filter, taking only the dead letters of message id `id`.
    pub fn message_id(self, id: impl Into<String>) -> Self {
        Self {
            message_id: Some(id.into()),
            ..self
        }
    }

    /// Returns the same filter, taking at most `limit` dead letters.
    pub fn limit(self, limit: usize) -> Self {
        Self {
            limit: Some(limit),
            ..self
        }
    }

    /// Returns the entries of `read` whose dead letter it takes, by `now`, in their order and up to
    /// its limit (each broker's reader keeps its own handle of a dead letter beside it).
    #[cfg(any(
        feature = "sqs",
        feature = "rabbitmq",
        feature = "nats",
        feature = "kafka"
    ))]
    pub(crate) fn pick<'a, T>(
        &'a self,
        read: &'a [(T, DeadLetter)],
        now: SystemTime,
    ) -> impl Iterator<Item = &'a (T, DeadLetter)> {
        read.iter()
            .filter(move |(_, letter)| self.matches(letter, now))
            .take(self.limit.unwrap_or(usize::MAX))
    }

    /// Returns whether `letter` is one it takes, by `now` (its limit aside). A letter of unknown
    /// age passes no age bound; one without a reason passes no reason.
    pub fn matches(&self, letter: &DeadLetter, now: SystemTime) -> bool {
        let reason = match &self.reason {
            None => true,
            Some(text) => letter
                .reason
                .as_deref()
                .is_some_and(|reason| reason.to_lowercase().contains(text)),
        };
        let age = letter.age(now);
        let older = self
            .older_than
            .is_none_or(|bound| age.is_some_and(|age| age >= bound));
        let newer = self
            .newer_than
            .is_none_or(|bound| age.is_some_and(|age| age < bound));
        let id = self
            .message_id
            .as_ref()
            .is_none_or(|id| letter.message_id.as_ref() == Some(id));
        reason && older && newer && id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn letter(reason: Option<&str>, age: Option<u64>, now: SystemTime) -> DeadLetter {
        DeadLetter {
            id: "1".into(),
            message_id: Some("m".into()),
            reason: reason.map(str::to_owned),
            attempts: Some(1),
            source: None,
            dead_lettered_at: age.map(|s| now - Duration::from_secs(s)),
            headers: Vec::new(),
            payload: Vec::new(),
        }
    }

    #[test]
    fn filters_take_by_reason_age_and_id_and_an_unknown_passes_no_bound() {
        let now = SystemTime::now();
        let poison = letter(Some("Poison: never"), Some(7200), now);
        let fresh = letter(Some("still failing after 5 attempts"), Some(60), now);
        let moved = letter(None, None, now);
        let all = DeadLetterFilter::new();
        assert!(
            [&poison, &fresh, &moved]
                .iter()
                .all(|l| all.matches(l, now))
        );
        let by_reason = DeadLetterFilter::new().reason_contains("POISON");
        assert!(by_reason.matches(&poison, now));
        assert!(!by_reason.matches(&fresh, now) && !by_reason.matches(&moved, now));
        let old = DeadLetterFilter::new().older_than(Duration::from_secs(3600));
        assert!(old.matches(&poison, now));
        assert!(!old.matches(&fresh, now) && !old.matches(&moved, now));
        let new = DeadLetterFilter::new().newer_than(Duration::from_secs(3600));
        assert!(new.matches(&fresh, now));
        assert!(!new.matches(&poison, now) && !new.matches(&moved, now));
        assert!(
            !DeadLetterFilter::new()
                .message_id("other")
                .matches(&poison, now)
        );
        assert!(
            DeadLetterFilter::new()
                .message_id("m")
                .matches(&poison, now)
        );
    }
}
