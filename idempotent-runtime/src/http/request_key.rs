//! The `Idempotency-Key` header: reading it, its limits, and the inbox key it becomes once scoped
//! to the client.

use http::HeaderMap;
use http::header::HeaderName;

use crate::key::{KeyBuilder, KeyError, MessageKey};

/// The request header that carries the key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The longest key accepted unless configured otherwise, in characters (Stripe's limit).
pub const DEFAULT_MAX_KEY_LEN: usize = 255;

/// Why an `Idempotency-Key` header was refused (a `400 Bad Request`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyRejection {
    /// The request has the header more than once.
    #[error("the request has more than one Idempotency-Key header")]
    Repeated,
    /// The key is empty (`Idempotency-Key: ""` or an empty value).
    #[error("the Idempotency-Key is empty")]
    Empty,
    /// The key is longer than the route accepts.
    #[error("the Idempotency-Key is {len} characters long; at most {max} are accepted")]
    TooLong {
        /// Its length.
        len: usize,
        /// The route's limit.
        max: usize,
    },
    /// The key holds a character other than visible ASCII (`!` to `~`): a space, a control
    /// character or a byte outside ASCII.
    #[error(
        "the Idempotency-Key holds a character other than visible ASCII at position {position}"
    )]
    Character {
        /// Where, counting from 0 (in the key, after unquoting).
        position: usize,
    },
    /// The key is not quoted and holds a comma: a list of keys, as a proxy makes of repeated
    /// headers by joining them (`Idempotency-Key: a, b`). In quotes, a comma is part of the key.
    #[error("the Idempotency-Key holds a comma outside quotes: it is a list of keys, not one")]
    List,
    /// The key starts with a quote (a structured-field string, as the IETF draft writes it) that
    /// is not closed, or holds an escape other than `\"` and `\\`.
    #[error("the Idempotency-Key is a quoted string that is not closed or has an invalid escape")]
    Quoting,
}

/// The key of a request: `None` without the header. A value in quotes (the IETF draft's
/// structured-field string, `Idempotency-Key: "8e03978e…"`) is unquoted; a bare one (Stripe's
/// style) is taken as it is, unless it holds a comma (two headers joined into one). Either way the
/// key is 1 to `max_len` visible ASCII characters.
pub(crate) fn read_key(
    headers: &HeaderMap,
    max_len: usize,
) -> Result<Option<String>, KeyRejection> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyRejection::Repeated);
    }
    let key = unquote(value.as_bytes())?;
    if key.is_empty() {
        return Err(KeyRejection::Empty);
    }
    if key.len() > max_len {
        return Err(KeyRejection::TooLong {
            len: key.len(),
            max: max_len,
        });
    }
    if let Some(position) = key.iter().position(|b| !(b'!'..=b'~').contains(b)) {
        return Err(KeyRejection::Character { position });
    }
    // Visible ASCII only, checked above.
    Ok(Some(key.into_iter().map(char::from).collect()))
}

/// The bytes of a structured-field string's content, or `raw` itself when it is not quoted.
fn unquote(raw: &[u8]) -> Result<Vec<u8>, KeyRejection> {
    let Some(quoted) = raw.strip_prefix(b"\"") else {
        if raw.contains(&b',') {
            return Err(KeyRejection::List);
        }
        return Ok(raw.to_vec());
    };
    let inner = quoted.strip_suffix(b"\"").ok_or(KeyRejection::Quoting)?;
    let mut key = Vec::with_capacity(inner.len());
    let mut bytes = inner.iter();
    while let Some(&byte) = bytes.next() {
        match byte {
            b'\\' => match bytes.next() {
                Some(&escaped @ (b'"' | b'\\')) => key.push(escaped),
                _ => return Err(KeyRejection::Quoting),
            },
            b'"' => return Err(KeyRejection::Quoting),
            _ => key.push(byte),
        }
    }
    Ok(key)
}

/// The inbox key of `key` sent by the client `scope`: the two strings as a composite key, so
/// that no two (scope, key) pairs share an encoding, and one client's key never names another's
/// record.
pub(crate) fn scoped_key(scope: &str, key: &str) -> Result<MessageKey, KeyError> {
    let mut builder = KeyBuilder::new();
    builder.str(scope);
    builder.str(key);
    builder.finish()
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn read(values: &[&[u8]]) -> Result<Option<String>, KeyRejection> {
        let mut headers = HeaderMap::new();
        for value in values {
            headers.append(IDEMPOTENCY_KEY, HeaderValue::from_bytes(value).unwrap());
        }
        read_key(&headers, 16)
    }

    #[test]
    fn bare_and_quoted_keys_are_read() {
        assert_eq!(read(&[]), Ok(None));
        assert_eq!(read(&[b"abc-123"]), Ok(Some("abc-123".into())));
        assert_eq!(read(&[b"\"abc-123\""]), Ok(Some("abc-123".into())));
        assert_eq!(read(&[br#""a\"b\\c""#]), Ok(Some(r#"a"b\c"#.into())));
        assert_eq!(read(&[b"\"a,b\""]), Ok(Some("a,b".into())));
    }

    #[test]
    fn bad_keys_are_refused_with_their_reason() {
        assert_eq!(read(&[b"a", b"b"]), Err(KeyRejection::Repeated));
        for list in [&b"a,b"[..], b"a, b", b"a,", b",", b"\"a\", \"b\""] {
            assert!(read(&[list]).is_err(), "{list:?}");
        }
        assert_eq!(read(&[b"a,b"]), Err(KeyRejection::List));
        assert_eq!(read(&[b""]), Err(KeyRejection::Empty));
        assert_eq!(read(&[b"\"\""]), Err(KeyRejection::Empty));
        assert_eq!(
            read(&[b"0123456789abcdefX"]),
            Err(KeyRejection::TooLong { len: 17, max: 16 })
        );
        assert_eq!(
            read(&[b"ab cd"]),
            Err(KeyRejection::Character { position: 2 })
        );
        assert_eq!(
            read(&[b"ab\xffcd"]),
            Err(KeyRejection::Character { position: 2 })
        );
        for quoted in [&b"\"abc"[..], b"\"a\\xb\"", b"\"a\"b\"", b"\"a\\\""] {
            assert_eq!(read(&[quoted]), Err(KeyRejection::Quoting), "{quoted:?}");
        }
    }

    #[test]
    fn scopes_keep_keys_apart() {
        let a = scoped_key("client-a", "k").unwrap();
        let b = scoped_key("client-b", "k").unwrap();
        assert_ne!(a, b);
        // No splitting of one string into scope and key gives another pair's key.
        assert_ne!(
            scoped_key("ab", "c").unwrap(),
            scoped_key("a", "bc").unwrap()
        );
        assert!(scoped_key("", "k").is_err());
    }
}
