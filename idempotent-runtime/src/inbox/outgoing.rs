//! Outgoing messages: what a handler's body queues in its [`Outbox`], their ids, and the rows they
//! become in the handler's transaction. Part of the inbox (which writes a claim's outbox at its
//! commit), so that [`outbox`](crate::outbox), which re-exports these types, stands wholly above it.

use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::error::{InboxError, Stage};
use crate::key::MessageKey;
use crate::store::{Backend, NewRow, OutboxStatements, database_error};

/// The longest message id, exchange, routing key (or subject), ordering key and header name, in
/// bytes: AMQP's short strings.
pub const MAX_TEXT_LEN: usize = 255;

/// Where an outgoing message goes: a RabbitMQ exchange and routing key, or a NATS subject.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Destination {
    /// The AMQP exchange; empty for the default exchange, and for NATS, Kafka and SQS.
    pub exchange: String,
    /// The AMQP routing key (with the default exchange: the queue's name), the NATS subject, the
    /// Kafka topic, or the SQS queue's URL or name.
    pub routing_key: String,
}

impl Destination {
    /// Creates a destination: a RabbitMQ exchange, with the routing key its bindings route by.
    pub fn exchange(exchange: impl Into<String>, routing_key: impl Into<String>) -> Self {
        Self {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
        }
    }

    /// Creates a destination: a RabbitMQ queue, through the default exchange; or an SQS queue, by
    /// its URL or its name.
    pub fn queue(queue: impl Into<String>) -> Self {
        Self::exchange("", queue)
    }

    /// Creates a destination: a NATS subject (which a JetStream stream captures).
    pub fn subject(subject: impl Into<String>) -> Self {
        Self::exchange("", subject)
    }

    /// Creates a destination: a Kafka topic (the message's ordering key is the record's key).
    pub fn topic(topic: impl Into<String>) -> Self {
        Self::exchange("", topic)
    }
}

/// A message for the [`Outbox`] to send: its destination, payload and headers, and optionally its
/// own id and an ordering key.
///
/// ```
/// # use idempotent_runtime as idempotent;
/// use idempotent::outbox::{Destination, OutgoingMessage};
///
/// let paid = OutgoingMessage::new(Destination::exchange("shop", "order.paid"), br#"{"order":7}"#)
///     .with_header("content-type", "application/json")
///     .with_ordering_key("order-7");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutgoingMessage {
    destination: Destination,
    payload: Vec<u8>,
    headers: Vec<(String, String)>,
    id: Option<String>,
    ordering_key: Option<String>,
}

impl OutgoingMessage {
    /// Creates a message of `payload` for `destination`, with an id the outbox derives (see
    /// [`Outbox`]).
    pub fn new(destination: Destination, payload: impl Into<Vec<u8>>) -> Self {
        Self {
            destination,
            payload: payload.into(),
            headers: Vec::new(),
            id: None,
            ordering_key: None,
        }
    }

    /// Returns the same message with the header `name: value` (AMQP headers, NATS headers).
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Returns the same message with its own id instead of the derived one: an id that is the same
    /// each time this message is queued again (a business key such as `order-7-paid`), never a
    /// random one, or the downstream consumer cannot tell a second publication from a new message.
    pub fn with_id(mut self, id: impl Into<String>) -> Self {
        self.id = Some(id.into());
        self
    }

    /// Returns the same message with an ordering key: the messages of one key are published in the
    /// order their transactions committed, one at a time (see [the module docs](crate::outbox)).
    pub fn with_ordering_key(mut self, key: impl Into<String>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }

    /// Returns where it goes.
    pub fn destination(&self) -> &Destination {
        &self.destination
    }

    /// Returns its payload.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// Returns its headers, in order.
    pub fn headers(&self) -> &[(String, String)] {
        &self.headers
    }

    /// Returns the id it was given with [`with_id`](Self::with_id), if any.
    pub fn id(&self) -> Option<&str> {
        self.id.as_deref()
    }

    /// Returns its ordering key, if any.
    pub fn ordering_key(&self) -> Option<&str> {
        self.ordering_key.as_deref()
    }
}

/// The outgoing messages of one transaction: the body of an `#[idempotent]` handler queues them
/// through a parameter `outbox: &mut Outbox`, and they are written to the outbox table in the
/// handler's transaction just before it commits, so that they commit with its effect or not at all.
/// A relay publishes them afterwards (see [the module docs](crate::outbox)).
///
/// Each message's id is derived from the outbox's origin (the handler's consumer), the key of the
/// message being handled, and the message's position among this outbox's messages
/// ([`Outbox::derived_id`]), unless it was given one ([`OutgoingMessage::with_id`]). A rerun of
/// the body after a rollback queues the same messages in the same order and so gives them the
/// same ids: a downstream consumer keyed on the message id treats a second publication as a
/// duplicate.
///
/// Outside a handler, make one with [`Outbox::new`] for a key of your own (an order id, an HTTP
/// request's idempotency key) and write it in your transaction with
/// [`Inbox::enqueue`](crate::Inbox::enqueue).
#[derive(Debug, Clone)]
pub struct Outbox {
    origin: String,
    key: MessageKey,
    /// The tenant whose inbox claimed the key, if it is one of [`Tenants`](crate::Tenants)'.
    tenant: Option<Arc<str>>,
    queued: Vec<(String, OutgoingMessage)>,
}

impl Outbox {
    /// The outbox of a claim (its consumer and key, and its inbox's tenant), or of
    /// [`Outbox::new`]'s origin and key.
    pub(crate) fn of(tenant: Option<Arc<str>>, origin: &str, key: MessageKey) -> Self {
        Self {
            origin: origin.to_owned(),
            key,
            tenant,
            queued: Vec::new(),
        }
    }

    /// Queues `message`; returns the id it will carry (its own, or the derived one).
    pub fn send(&mut self, mut message: OutgoingMessage) -> String {
        // With `otel`, the current span's trace context goes along, for the consumer's span.
        crate::trace_context::inject_current(&mut message.headers);
        let id = match (&message.id, &self.tenant) {
            (Some(id), _) => id.clone(),
            (None, None) => Self::derived_id(&self.origin, &self.key, self.queued.len()),
            // The same key in two tenants is two messages: ids of their own.
            (None, Some(tenant)) => derive(
                b"idempotent-outbox/tenant/1\0",
                &[tenant, &self.origin],
                &self.key,
                self.queued.len(),
            ),
        };
        self.queued.push((id.clone(), message));
        id
    }

    /// Returns the id of the message at `position` (from 0) of the outbox of `origin` and `key`: a
    /// UUID (version 8, RFC 9562) made of the SHA-256 of `idempotent-outbox/1`, the origin, the
    /// stored key and the position, each length-prefixed. The same inputs always give the same id.
    ///
    /// A [tenant](crate::Tenants)'s inbox derives the ids of its claims' messages with the
    /// tenant's name too (after `idempotent-outbox/tenant/1`), so that the same key in two
    /// tenants gives two messages two ids.
    pub fn derived_id(origin: &str, key: &MessageKey, position: usize) -> String {
        derive(b"idempotent-outbox/1\0", &[origin], key, position)
    }

    /// Returns where the derived ids come from: the consumer, or the origin given to
    /// [`Outbox::new`].
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The key the derived ids come from: the claimed key, or the one given to [`Outbox::new`].
    pub(crate) fn key(&self) -> &MessageKey {
        &self.key
    }

    /// Returns the queued messages with their ids, in order.
    pub fn messages(&self) -> impl Iterator<Item = (&str, &OutgoingMessage)> {
        self.queued
            .iter()
            .map(|(id, message)| (id.as_str(), message))
    }

    /// Returns how many messages are queued.
    pub fn len(&self) -> usize {
        self.queued.len()
    }

    /// Returns whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.queued.is_empty()
    }

    /// Checks every message before anything is written.
    fn check(&self) -> Result<(), InboxError> {
        for (position, (id, message)) in self.queued.iter().enumerate() {
            check_message(id, message)
                .map_err(|reason| InboxError::Outgoing { position, reason })?;
        }
        Ok(())
    }
}

/// What is wrong with a message, if anything.
fn check_message(id: &str, message: &OutgoingMessage) -> Result<(), &'static str> {
    let text = |value: &str, empty: &'static str, long: &'static str, nul: &'static str| {
        if value.is_empty() && !empty.is_empty() {
            Err(empty)
        } else if value.len() > MAX_TEXT_LEN {
            Err(long)
        } else if value.contains('\0') {
            Err(nul)
        } else {
            Ok(())
        }
    };
    text(
        id,
        "its id is empty",
        "its id is longer than 255 bytes",
        "its id holds a NUL byte",
    )?;
    let Destination {
        exchange,
        routing_key,
    } = &message.destination;
    text(
        exchange,
        "",
        "its exchange is longer than 255 bytes",
        "its exchange holds a NUL byte",
    )?;
    text(
        routing_key,
        "",
        "its routing key (or subject) is longer than 255 bytes",
        "its routing key (or subject) holds a NUL byte",
    )?;
    if exchange.is_empty() && routing_key.is_empty() {
        return Err("it has no destination: name an exchange, a queue or a subject");
    }
    if let Some(key) = &message.ordering_key {
        text(
            key,
            "its ordering key is empty",
            "its ordering key is longer than 255 bytes",
            "its ordering key holds a NUL byte",
        )?;
    }
    for (name, value) in &message.headers {
        text(
            name,
            "a header's name is empty",
            "a header's name is longer than 255 bytes",
            "a header's name holds a NUL byte",
        )?;
        let line_break = |s: &str| s.contains(['\r', '\n']);
        if value.contains('\0') || line_break(name) || line_break(value) {
            return Err("a header holds a NUL byte or a line break");
        }
    }
    Ok(())
}

/// The headers as stored: a JSON array of `[name, value]` pairs, or nothing.
pub(crate) fn encode_headers(headers: &[(String, String)]) -> Option<Vec<u8>> {
    (!headers.is_empty()).then(|| serde_json::to_vec(headers).expect("strings serialize"))
}

/// The stored headers, as [`encode_headers`] wrote them.
pub(crate) fn decode_headers(stored: Option<&[u8]>) -> Vec<(String, String)> {
    stored
        .and_then(|bytes| serde_json::from_slice(bytes).ok())
        .unwrap_or_default()
}

/// Writes `outbox`'s messages to the outbox table on `conn`, in the transaction open there: the
/// messages without an ordering key in their order, then those with one, by key (so that two
/// transactions take their keys' locks in the same order and never deadlock over them), each key's
/// in their order. Whoever commits the transaction wakes the relays. `true` when the last row's
/// statement proved the transaction the one the inbox began, with nothing failed in it (on
/// PostgreSQL; see [`Store::commit_proven`](crate::store::Store::commit_proven)).
pub(crate) async fn write<DB: Backend>(
    conn: &mut DB::Connection,
    statements: &OutboxStatements,
    outbox: &Outbox,
) -> Result<bool, InboxError> {
    if outbox.is_empty() {
        return Ok(false);
    }
    outbox.check()?;
    let mut order: Vec<&(String, OutgoingMessage)> = outbox.queued.iter().collect();
    order.sort_by(|a, b| a.1.ordering_key.cmp(&b.1.ordering_key)); // stable: `None` first
    let failed = || database_error(Stage::Outbox);
    let mut proved = false;
    for (id, message) in order {
        let headers = encode_headers(&message.headers);
        let row = NewRow {
            message_id: id,
            exchange: &message.destination.exchange,
            routing_key: &message.destination.routing_key,
            payload: &message.payload,
            headers: headers.as_deref(),
            origin: &outbox.origin,
            ordering_key: message.ordering_key.as_deref(),
        };
        proved = DB::outbox_insert(conn, statements, row)
            .await
            .map_err(failed())?;
    }
    Ok(proved)
}

/// A UUID (version 8, RFC 9562) made of the SHA-256 of `domain`, then `names`, `key` and
/// `position`, each length-prefixed.
fn derive(domain: &[u8], names: &[&str], key: &MessageKey, position: usize) -> String {
    let mut hasher = Sha256::new();
    hasher.update(domain);
    for name in names {
        hasher.update((name.len() as u64).to_be_bytes());
        hasher.update(name.as_bytes());
    }
    hasher.update((key.as_bytes().len() as u64).to_be_bytes());
    hasher.update(key.as_bytes());
    hasher.update((position as u64).to_be_bytes());
    let digest = hasher.finalize();
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    bytes[6] = (bytes[6] & 0x0F) | 0x80; // version 8
    bytes[8] = (bytes[8] & 0x3F) | 0x80; // RFC 9562's variant
    uuid::Uuid::from_bytes(bytes).hyphenated().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(destination: Destination) -> OutgoingMessage {
        OutgoingMessage::new(destination, b"{}".to_vec())
    }

    #[test]
    fn ids_derive_from_origin_key_and_position_and_nothing_else() {
        let key = crate::message_key("order-7").unwrap();
        let mut first = Outbox::new("billing", &key).unwrap();
        let mut again = Outbox::new("billing", "order-7").unwrap();
        let a = first.send(message(Destination::queue("a")));
        let b = first.send(message(Destination::subject("b")));
        assert_eq!(again.send(message(Destination::queue("other"))), a);
        assert_eq!(again.send(message(Destination::queue("other"))), b);
        assert_ne!(a, b);
        assert_eq!(Outbox::derived_id("billing", &key, 1), b);
        assert_ne!(Outbox::derived_id("shipping", &key, 0), a);
        let id: uuid::Uuid = a.parse().unwrap();
        assert_eq!(id.get_version_num(), 8);
        assert_eq!(id.get_variant(), uuid::Variant::RFC4122);
        let own = first.send(message(Destination::queue("c")).with_id("order-7-paid"));
        assert_eq!(own, "order-7-paid");
        assert_eq!(first.len(), 3);
    }

    #[test]
    fn bad_messages_are_refused_with_their_position() {
        let mut outbox = Outbox::new("billing", "k").unwrap();
        outbox.send(message(Destination::queue("fine")));
        outbox.send(message(Destination::exchange("", "")));
        assert!(matches!(
            outbox.check(),
            Err(InboxError::Outgoing { position: 1, .. })
        ));
        for bad in [
            message(Destination::queue("q")).with_id(""),
            message(Destination::queue("q")).with_ordering_key(""),
            message(Destination::queue("q".repeat(256))),
            message(Destination::queue("q\0")),
            message(Destination::queue("q")).with_header("a\nb", "c"),
        ] {
            let mut outbox = Outbox::new("billing", "k").unwrap();
            outbox.send(bad.clone());
            assert!(outbox.check().is_err(), "{bad:?}");
        }
        assert!(Outbox::new("", "k").is_err());
        assert!(Outbox::new("billing", "").is_err());
    }

    #[test]
    fn headers_round_trip() {
        let headers = vec![("a".to_owned(), "1".to_owned()), ("b".into(), "".into())];
        let stored = encode_headers(&headers);
        assert_eq!(decode_headers(stored.as_deref()), headers);
        assert_eq!(encode_headers(&[]), None);
        assert!(decode_headers(None).is_empty());
    }
}
