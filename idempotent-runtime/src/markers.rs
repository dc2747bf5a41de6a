//! Newtypes for the per-delivery values brokers attach to messages. They are deliberately not
//! [`StableKey`](crate::StableKey)s: holding them in these types makes keying on them a compile
//! error.

use std::fmt;

/// An id shared by every message of one conversation or workflow. Many different messages carry
/// the same correlation id, so keying on it would drop all but the first as duplicates.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CorrelationId(pub String);

/// The broker's handle for one delivery of a message (AMQP delivery tag, SQS receipt handle,
/// Service Bus lock token). A redelivery of the same message gets a new one, so keying on it would
/// run the handler again for every redelivery.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeliveryTag(pub u64);

impl fmt::Display for CorrelationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Display for DeliveryTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}
