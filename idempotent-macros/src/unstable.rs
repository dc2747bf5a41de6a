//! Field names that say their value is not a stable message key.
//!
//! A name is split into lowercase words whatever its spelling (`correlation_id`, `correlationId`,
//! `CorrelationID` and `JMSCorrelationID` all give `… correlation id`), and it is unstable when the
//! words of one of the patterns below occur in it, in order and next to each other.

/// Why a kind of name is refused, and what to key on instead.
pub(crate) struct Unstable {
    /// What the name says the value is, for the error message.
    pub(crate) what: &'static str,
    /// Why that is no key, and what to use instead.
    pub(crate) help: &'static str,
}

const SHARED: &str = "many different messages share it, so keying on it would drop all but the first as duplicates; key on the message id the producer assigns, or on a business key";
const PER_DELIVERY: &str = "the broker gives every delivery its own, so a redelivery of the same message would run the handler again; key on the message id the producer assigns";
const POSITION: &str = "the broker assigns it per delivery or per partition, so a message republished by its producer or resubmitted from a dead-letter queue gets a new one; key on the message id the producer assigns";
const RECEIVED: &str = "each delivery is received at its own time, so a redelivery would run the handler again; key on the message id the producer assigns";

const PATTERNS: &[(&[&str], Unstable)] = &[
    (
        &["correlation"],
        Unstable {
            what: "a correlation id",
            help: SHARED,
        },
    ),
    (
        &["causation"],
        Unstable {
            what: "a causation id",
            help: SHARED,
        },
    ),
    (
        &["conversation", "id"],
        Unstable {
            what: "a conversation id",
            help: SHARED,
        },
    ),
    (
        &["delivery", "tag"],
        Unstable {
            what: "a delivery tag",
            help: PER_DELIVERY,
        },
    ),
    (
        &["delivery", "count"],
        Unstable {
            what: "a delivery count",
            help: PER_DELIVERY,
        },
    ),
    (
        &["delivery", "attempt"],
        Unstable {
            what: "a delivery attempt",
            help: PER_DELIVERY,
        },
    ),
    (
        &["redelivered"],
        Unstable {
            what: "a redelivered flag",
            help: PER_DELIVERY,
        },
    ),
    (
        &["redelivery"],
        Unstable {
            what: "a redelivery count",
            help: PER_DELIVERY,
        },
    ),
    (
        &["receive", "count"],
        Unstable {
            what: "a receive count",
            help: PER_DELIVERY,
        },
    ),
    (
        &["dequeue", "count"],
        Unstable {
            what: "a dequeue count",
            help: PER_DELIVERY,
        },
    ),
    (
        &["lock", "token"],
        Unstable {
            what: "a lock token",
            help: PER_DELIVERY,
        },
    ),
    (
        &["receipt", "handle"],
        Unstable {
            what: "a receipt handle",
            help: PER_DELIVERY,
        },
    ),
    (
        &["offset"],
        Unstable {
            what: "a broker offset",
            help: POSITION,
        },
    ),
    (
        &["sequence"],
        Unstable {
            what: "a sequence number",
            help: POSITION,
        },
    ),
    (
        &["seq"],
        Unstable {
            what: "a sequence number",
            help: POSITION,
        },
    ),
    (
        &["received"],
        Unstable {
            what: "a receive timestamp",
            help: RECEIVED,
        },
    ),
    (
        &["receive", "time"],
        Unstable {
            what: "a receive timestamp",
            help: RECEIVED,
        },
    ),
    (
        &["receive", "timestamp"],
        Unstable {
            what: "a receive timestamp",
            help: RECEIVED,
        },
    ),
    (
        &["enqueued"],
        Unstable {
            what: "an enqueue timestamp",
            help: RECEIVED,
        },
    ),
    (
        &["delivered", "at"],
        Unstable {
            what: "a delivery timestamp",
            help: RECEIVED,
        },
    ),
    (
        &["delivery", "time"],
        Unstable {
            what: "a delivery timestamp",
            help: RECEIVED,
        },
    ),
];

/// What is wrong with keying on a field called `name`, if anything.
pub(crate) fn check(name: &str) -> Option<&'static Unstable> {
    let words = words(name);
    PATTERNS.iter().find_map(|(pattern, unstable)| {
        words
            .windows(pattern.len())
            .any(|window| window.iter().zip(pattern.iter()).all(|(w, p)| w == p))
            .then_some(unstable)
    })
}

/// Splits snake_case, camelCase, PascalCase and acronyms (`JMSCorrelationID`) into lowercase words.
fn words(name: &str) -> Vec<String> {
    let chars: Vec<char> = name.chars().collect();
    let mut words = Vec::new();
    let mut word = String::new();
    for (i, &c) in chars.iter().enumerate() {
        if c == '_' || c == '-' {
            if !word.is_empty() {
                words.push(std::mem::take(&mut word));
            }
            continue;
        }
        let prev = i.checked_sub(1).map(|p| chars[p]);
        let next = chars.get(i + 1);
        let starts_word = c.is_uppercase()
            && (prev.is_some_and(|p| p.is_lowercase() || p.is_ascii_digit())
                || (prev.is_some_and(char::is_uppercase)
                    && next.is_some_and(|n| n.is_lowercase())));
        if starts_word && !word.is_empty() {
            words.push(std::mem::take(&mut word));
        }
        word.extend(c.to_lowercase());
    }
    if !word.is_empty() {
        words.push(word);
    }
    words
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_split_into_words_in_every_spelling() {
        assert_eq!(words("correlation_id"), ["correlation", "id"]);
        assert_eq!(words("correlationId"), ["correlation", "id"]);
        assert_eq!(words("CorrelationID"), ["correlation", "id"]);
        assert_eq!(words("JMSCorrelationID"), ["jms", "correlation", "id"]);
        assert_eq!(words("x-delivery-count"), ["x", "delivery", "count"]);
    }

    #[test]
    fn unstable_names_are_found_and_stable_ones_pass() {
        for name in [
            "correlation_id",
            "causationId",
            "DeliveryTag",
            "delivery_count",
            "redelivered",
            "lockToken",
            "ReceiptHandle",
            "kafka_offset",
            "SequenceNumber",
            "stream_seq",
            "received_at",
            "enqueuedTimeUtc",
            "ApproximateReceiveCount",
        ] {
            assert!(check(name).is_some(), "{name} passed");
        }
        for name in [
            "message_id",
            "MessageId",
            "order_id",
            "payment_id",
            "idempotency_key",
            "tag",
        ] {
            assert!(check(name).is_none(), "{name} was refused");
        }
    }
}
