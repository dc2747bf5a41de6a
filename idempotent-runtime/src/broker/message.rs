//! A delivery as a handler sees it: the producer's id (the key) and the broker's per-delivery
//! facts, in types that are not keys.

use std::fmt;

use crate::key::{KeyBuilder, StableKey};
use crate::markers::DeliveryTag;

/// The id the producer gave a message (AMQP `message_id`, NATS `Nats-Msg-Id`): the same on every
/// delivery of it, so the key to use.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MessageId(pub String);

impl StableKey for MessageId {
    fn write_key(&self, key: &mut KeyBuilder) {
        self.0.write_key(key)
    }
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A stream's sequence number of a message (JetStream): it changes when a message is published
/// again, so it is not a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamSequence(pub u64);

/// How many times the broker has delivered this message: not a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeliveryCount(pub u64);

/// Whether the broker delivered this message before: not a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Redelivered(pub bool);

/// A delivery as a handler sees it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Message {
    /// The producer's id of the message: key on it.
    pub message_id: MessageId,
    /// The payload.
    pub payload: Vec<u8>,
    /// The headers whose values are text.
    pub headers: Vec<(String, String)>,
    /// This delivery's attempt, counting from 1: the retries the runner scheduled, plus one.
    pub attempt: u32,
    /// The broker's handle of this delivery (AMQP delivery tag; the stream sequence of the
    /// delivery on JetStream): new on every delivery.
    pub delivery_tag: DeliveryTag,
    /// Whether the broker delivered it before (a crash before an acknowledgement).
    pub redelivered: Redelivered,
    /// The stream's sequence number, on JetStream.
    pub stream_sequence: Option<StreamSequence>,
}

impl Message {
    /// Returns the value of header `name`, if it is there and text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }
}
