//! Message keys: which types may be keys, and how a key becomes the bytes stored in the inbox.
//!
//! # Encoding
//! A key is one or more components (a composite business key has several). Each component is
//! written as a one-byte type tag followed by its value, and variable-length values carry their
//! length first (LEB128), so the encoding of a sequence of components is prefix-free: two different
//! keys never encode to the same bytes, whatever their values contain (empty strings, NUL bytes,
//! non-UTF-8 bytes).
//!
//! | component | tag | value |
//! |---|---|---|
//! | string (`str`, `String`) | `0x01` | length, UTF-8 bytes |
//! | byte string (`[u8]`, `Vec<u8>`) | `0x02` | length, bytes |
//! | integer ≥ 0 (any width, signed or not) | `0x03` | 16 bytes, big-endian `u128` |
//! | integer < 0 | `0x04` | 16 bytes, big-endian `i128` |
//! | UUID | `0x05` | 16 bytes |
//!
//! Integers are widened, so `5u32` and `5i64` are the same key: changing a field's integer type
//! does not make old messages look new.
//!
//! # Hashing long keys
//! An encoding of at most [`MAX_INLINE_KEY_LEN`] bytes is stored as it is. A longer one is stored as
//! the byte `0xFF` followed by the 32-byte SHA-256 digest of the encoding. No encoding starts with
//! `0xFF` (it starts with a tag), so a hashed key can never equal an inline one; two long keys
//! collide only if SHA-256 does.

use std::fmt;

use sha2::{Digest, Sha256};

/// Encodings longer than this many bytes are stored as their SHA-256 digest (see the module docs).
pub const MAX_INLINE_KEY_LEN: usize = 64;

const TAG_STR: u8 = 0x01;
const TAG_BYTES: u8 = 0x02;
const TAG_UINT: u8 = 0x03;
const TAG_NEG_INT: u8 = 0x04;
const TAG_UUID: u8 = 0x05;
const TAG_HASHED: u8 = 0xFF;

/// A type whose values identify a message stably: the same message carries the same value on every
/// delivery, and different messages carry different values.
///
/// Implemented for UUIDs, strings, integers, byte strings, references to them and tuples of them.
/// A newtype of your own opts in by delegating to its inner value:
///
/// ```
/// # use idempotent_runtime as idempotent;
/// use idempotent::{KeyBuilder, StableKey};
///
/// struct PaymentId(String);
///
/// impl StableKey for PaymentId {
///     fn write_key(&self, key: &mut KeyBuilder) {
///         self.0.write_key(key)
///     }
/// }
/// ```
///
/// Floats (rounding), `Option` (`None` would make every key-less message one duplicate),
/// timestamps (a receive time differs between deliveries) and the broker's own per-delivery values
/// ([`CorrelationId`](crate::CorrelationId), [`DeliveryTag`](crate::DeliveryTag)) are deliberately
/// not keys.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be a message key",
    label = "`{Self}` is not a stable key",
    note = "a key must be a stable id the producer assigns (a message id) or a business key: a UUID, a string, an integer, a byte string, or a tuple of these",
    note = "floats, `Option`s, timestamps, correlation ids and delivery tags change between deliveries or are shared by many messages, so keying on them loses or repeats effects",
    note = "a newtype of your own becomes a key by implementing `StableKey`"
)]
pub trait StableKey {
    /// Writes this value's components into `key`.
    fn write_key(&self, key: &mut KeyBuilder);
}

/// Collects the components of one message key; see [`StableKey`].
#[derive(Debug, Default)]
pub struct KeyBuilder {
    encoded: Vec<u8>,
    components: usize,
    empty_component: Option<usize>,
}

impl KeyBuilder {
    /// Creates a builder with no components yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds every component of `value`.
    pub fn push<K: StableKey + ?Sized>(&mut self, value: &K) -> &mut Self {
        value.write_key(self);
        self
    }

    /// Adds a string component. An empty string makes the key invalid.
    pub fn str(&mut self, value: &str) {
        self.variable(TAG_STR, value.as_bytes());
    }

    /// Adds a byte-string component. An empty byte string makes the key invalid.
    pub fn bytes(&mut self, value: &[u8]) {
        self.variable(TAG_BYTES, value);
    }

    /// Adds an unsigned integer component.
    pub fn uint(&mut self, value: u128) {
        self.encoded.push(TAG_UINT);
        self.encoded.extend_from_slice(&value.to_be_bytes());
        self.components += 1;
    }

    /// Adds a signed integer component; a non-negative value is the same key as the unsigned one.
    pub fn int(&mut self, value: i128) {
        match u128::try_from(value) {
            Ok(unsigned) => self.uint(unsigned),
            Err(_) => {
                self.encoded.push(TAG_NEG_INT);
                self.encoded.extend_from_slice(&value.to_be_bytes());
                self.components += 1;
            }
        }
    }

    /// Adds a UUID component.
    pub fn uuid(&mut self, value: &uuid::Uuid) {
        self.encoded.push(TAG_UUID);
        self.encoded.extend_from_slice(value.as_bytes());
        self.components += 1;
    }

    fn variable(&mut self, tag: u8, value: &[u8]) {
        if value.is_empty() && self.empty_component.is_none() {
            self.empty_component = Some(self.components);
        }
        self.encoded.push(tag);
        let mut len = value.len();
        loop {
            let low = (len & 0x7F) as u8;
            len >>= 7;
            if len == 0 {
                self.encoded.push(low);
                break;
            }
            self.encoded.push(low | 0x80);
        }
        self.encoded.extend_from_slice(value);
        self.components += 1;
    }

    /// Finishes the key: checks it and turns it into the bytes stored in the inbox.
    pub fn finish(self) -> Result<MessageKey, KeyError> {
        if self.components == 0 {
            return Err(KeyError::NoComponents);
        }
        if let Some(component) = self.empty_component {
            return Err(KeyError::Empty { component });
        }
        let stored = if self.encoded.len() <= MAX_INLINE_KEY_LEN {
            self.encoded
        } else {
            let mut stored = Vec::with_capacity(33);
            stored.push(TAG_HASHED);
            stored.extend_from_slice(&Sha256::digest(&self.encoded));
            stored
        };
        Ok(MessageKey { stored })
    }
}

/// Computes the stored key of one value: `KeyBuilder::new().push(value).finish()`.
pub fn message_key<K: StableKey + ?Sized>(value: &K) -> Result<MessageKey, KeyError> {
    let mut builder = KeyBuilder::new();
    builder.push(value);
    builder.finish()
}

/// What the inbox's methods take as a message key: a [`MessageKey`] as it is, or any
/// [`StableKey`] value, encoded on the way.
pub trait AsMessageKey {
    /// The stored key.
    fn as_message_key(&self) -> Result<std::borrow::Cow<'_, MessageKey>, KeyError>;
}

impl AsMessageKey for MessageKey {
    fn as_message_key(&self) -> Result<std::borrow::Cow<'_, MessageKey>, KeyError> {
        Ok(std::borrow::Cow::Borrowed(self))
    }
}

impl<K: StableKey + ?Sized> AsMessageKey for K {
    fn as_message_key(&self) -> Result<std::borrow::Cow<'_, MessageKey>, KeyError> {
        message_key(self).map(std::borrow::Cow::Owned)
    }
}

/// Why a message key was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// A string or byte-string component is empty: a producer that forgot to set its message id
    /// would otherwise make every such message a duplicate of the first.
    #[error("the message key is empty (component {component} of the key)")]
    Empty {
        /// Position of the first empty component, counting from 0.
        component: usize,
    },
    /// The key has no components at all (an empty tuple).
    #[error("the message key has no components")]
    NoComponents,
}

/// A message key as stored in the inbox: the encoding of its components, or its SHA-256 digest when
/// that encoding is long (see the [module docs](self)).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MessageKey {
    stored: Vec<u8>,
}

impl MessageKey {
    /// Returns the bytes stored in the inbox's `key` column.
    pub fn as_bytes(&self) -> &[u8] {
        &self.stored
    }

    /// Returns whether the key was long enough to be stored as its digest.
    pub fn is_hashed(&self) -> bool {
        self.stored.first() == Some(&TAG_HASHED)
    }

    /// Returns the key from the bytes the inbox stores (as [`Display`](fmt::Display) shows them in
    /// hex, and as listings return them): for operators' tools that find a stored row again.
    /// Refuses no bytes but the empty ones.
    pub fn from_stored(bytes: Vec<u8>) -> Result<Self, KeyError> {
        if bytes.is_empty() {
            return Err(KeyError::Empty { component: 0 });
        }
        Ok(Self { stored: bytes })
    }

    /// Returns when the message was sent, if its key says: a key that is one version 7 UUID carries
    /// the time it was made.
    pub fn sent_at(&self) -> Option<std::time::SystemTime> {
        match self.stored.split_first() {
            Some((&TAG_UUID, bytes)) => {
                let uuid = uuid::Uuid::from_slice(bytes).ok()?;
                crate::clock::uuid_v7_time(&uuid)
            }
            _ => None,
        }
    }

    /// Returns the SHA-256 of the stored bytes, in 64 hex digits; [`digest`](Self::digest) is its
    /// first 12. The audit of a forgotten message records it.
    pub fn full_digest(&self) -> String {
        hex(&Sha256::digest(&self.stored))
    }

    /// Returns a short, fixed-length name for the key in logs and traces: the first 12 hex digits
    /// of the SHA-256 of the stored bytes (keys themselves may be long or sensitive).
    pub fn digest(&self) -> String {
        hex(&Sha256::digest(&self.stored)[..6])
    }
}

/// Lowercase hex digits of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    bytes
        .iter()
        .flat_map(|b| [DIGITS[usize::from(b >> 4)], DIGITS[usize::from(b & 0x0f)]])
        .map(char::from)
        .collect()
}

/// A key to hand on to an outside service that deduplicates requests by an idempotency key (a
/// payment provider's `Idempotency-Key` header, say): 64 lowercase hex digits, the SHA-256 of the
/// consumer's name and the stored message key. The same on every delivery of a message to one
/// consumer, different between consumers and between messages.
///
/// A handler receives it by taking a parameter of this type after the message; or build it with
/// [`IdempotencyKey::new`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// Returns the idempotency key of `key` for `consumer`.
    pub fn new(consumer: &str, key: &MessageKey) -> Self {
        let mut hasher = Sha256::new();
        hasher.update((consumer.len() as u64).to_be_bytes());
        hasher.update(consumer.as_bytes());
        hasher.update(&key.stored);
        Self(hex(&hasher.finalize()))
    }

    /// Returns the key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Display for MessageKey {
    /// Lowercase hex of the stored bytes, as `encode(key, 'hex')` shows it in PostgreSQL.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex(&self.stored))
    }
}

impl fmt::Debug for MessageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MessageKey({self})")
    }
}

impl StableKey for str {
    fn write_key(&self, key: &mut KeyBuilder) {
        key.str(self)
    }
}

impl StableKey for String {
    fn write_key(&self, key: &mut KeyBuilder) {
        key.str(self)
    }
}

impl StableKey for [u8] {
    fn write_key(&self, key: &mut KeyBuilder) {
        key.bytes(self)
    }
}

impl StableKey for Vec<u8> {
    fn write_key(&self, key: &mut KeyBuilder) {
        key.bytes(self)
    }
}

impl<const N: usize> StableKey for [u8; N] {
    fn write_key(&self, key: &mut KeyBuilder) {
        key.bytes(self)
    }
}

impl StableKey for uuid::Uuid {
    fn write_key(&self, key: &mut KeyBuilder) {
        key.uuid(self)
    }
}

impl<K: StableKey + ?Sized> StableKey for &K {
    fn write_key(&self, key: &mut KeyBuilder) {
        (**self).write_key(key)
    }
}

impl<K: StableKey + ?Sized> StableKey for Box<K> {
    fn write_key(&self, key: &mut KeyBuilder) {
        (**self).write_key(key)
    }
}

impl<K: StableKey + ?Sized> StableKey for std::sync::Arc<K> {
    fn write_key(&self, key: &mut KeyBuilder) {
        (**self).write_key(key)
    }
}

macro_rules! integer_keys {
    ($method:ident as $wide:ty: $($t:ty)*) => {$(
        impl StableKey for $t {
            fn write_key(&self, key: &mut KeyBuilder) {
                key.$method(<$wide>::from(*self))
            }
        }
    )*};
}
integer_keys!(uint as u128: u8 u16 u32 u64 u128);
integer_keys!(int as i128: i8 i16 i32 i64 i128);

impl StableKey for usize {
    fn write_key(&self, key: &mut KeyBuilder) {
        key.uint(*self as u128)
    }
}

impl StableKey for isize {
    fn write_key(&self, key: &mut KeyBuilder) {
        key.int(*self as i128)
    }
}

macro_rules! tuple_keys {
    ($(($($name:ident)+))*) => {$(
        impl<$($name: StableKey),+> StableKey for ($($name,)+) {
            #[allow(non_snake_case)]
            fn write_key(&self, key: &mut KeyBuilder) {
                let ($($name,)+) = self;
                $($name.write_key(key);)+
            }
        }
    )*};
}
tuple_keys! {
    (A) (A B) (A B C) (A B C D) (A B C D E) (A B C D E F) (A B C D E F G) (A B C D E F G H)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_keys_are_stored_inline_and_long_ones_hashed() {
        let short = message_key("order-1").unwrap();
        assert_eq!(short.as_bytes(), b"\x01\x07order-1");
        assert!(!short.is_hashed());

        let long = message_key(&"x".repeat(1 << 20)).unwrap();
        assert!(long.is_hashed());
        assert_eq!(long.as_bytes().len(), 33);
        assert_ne!(long, message_key(&"x".repeat((1 << 20) + 1)).unwrap());
    }

    #[test]
    fn empty_components_are_refused() {
        assert_eq!(message_key(""), Err(KeyError::Empty { component: 0 }));
        assert_eq!(
            message_key(&(7u64, Vec::<u8>::new())),
            Err(KeyError::Empty { component: 1 })
        );
    }

    #[test]
    fn component_boundaries_are_part_of_the_key() {
        let ab_c = message_key(&("ab", "c")).unwrap();
        let a_bc = message_key(&("a", "bc")).unwrap();
        assert_ne!(ab_c, a_bc);
        assert_ne!(
            message_key("a").unwrap(),
            message_key(b"a".as_slice()).unwrap()
        );
    }

    #[test]
    fn a_uuid_v7_key_says_when_it_was_sent() {
        let ts = uuid::Timestamp::from_unix(uuid::NoContext, 1_700_000_000, 0);
        let v7 = uuid::Uuid::new_v7(ts);
        let sent = message_key(&v7).unwrap().sent_at().unwrap();
        assert_eq!(crate::clock::to_ms(sent), 1_700_000_000_000);
        assert_eq!(message_key(&uuid::Uuid::new_v4()).unwrap().sent_at(), None);
        assert_eq!(message_key(&(v7, 1u8)).unwrap().sent_at(), None);
        assert_eq!(message_key("x").unwrap().sent_at(), None);
    }

    #[test]
    fn integers_are_widened() {
        assert_eq!(message_key(&5u8).unwrap(), message_key(&5i64).unwrap());
        assert_ne!(
            message_key(&-1i8).unwrap(),
            message_key(&u128::MAX).unwrap()
        );
    }

    #[test]
    fn lengths_use_several_bytes_when_needed() {
        let key = message_key(&"y".repeat(200)).unwrap();
        assert!(key.is_hashed());
        let mut builder = KeyBuilder::new();
        builder.str(&"y".repeat(200));
        assert_eq!(&builder.encoded[..3], &[TAG_STR, 0xC8, 0x01]);
    }
}
