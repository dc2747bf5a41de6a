//! What is stored of a response, in which format, and the replay made from it.
//!
//! A stored response goes into the inbox row's `response` column, as bytes:
//!
//! ```text
//! 00 'h' 't' 't' 'p'      magic: no JSON (the `store_response` format) starts with a NUL
//! 01                      format version
//! status                  u16, big-endian
//! flags                   u8: bit 0 set when the body was not stored
//! header count            u16, big-endian; then per header:
//!   name length, name     u16, bytes (lowercase, as `http` spells names)
//!   value length, value   u32, bytes
//! body length, body       u64, bytes (0 when not stored)
//! ```

use axum_core::body::Body;
use axum_core::response::Response;
use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{StatusCode, response};

/// The response header that marks a replay: `Idempotent-Replayed: true` (Stripe's name).
pub const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The response header that marks a replay whose body was not stored (it was longer than the
/// route stores): `Idempotent-Body-Omitted: true`, with an empty body.
pub const BODY_OMITTED: HeaderName = HeaderName::from_static("idempotent-body-omitted");

/// The response header that says until when the key of a stored response is kept:
/// `Idempotency-Key-Expires: <HTTP-date>`, the time the request came in plus the layer's
/// [`retention`](super::IdempotencyLayer::retention), by the server's clock. On every response
/// whose answer is stored, and on its replays (stored with it, so the same date each time); until
/// then a retry with the key gets the replay, after it the key may be forgotten (by the purge) and
/// a request with it runs again. Not on the layer's refusals (`409`, `422`, …) and not on
/// responses that are not stored.
pub const KEY_EXPIRES: HeaderName = HeaderName::from_static("idempotency-key-expires");

/// The response headers stored and replayed unless configured otherwise: those that describe the
/// body or point to what the request made. Not stored: `Set-Cookie` (a session belongs to the
/// first exchange, not to its replays), `Date`, `Server`, the hop-by-hop and length headers, and
/// everything else not listed.
pub const DEFAULT_STORED_HEADERS: [HeaderName; 12] = [
    header::CONTENT_TYPE,
    header::CONTENT_ENCODING,
    header::CONTENT_LANGUAGE,
    header::CONTENT_DISPOSITION,
    header::CONTENT_LOCATION,
    header::LOCATION,
    header::ETAG,
    header::LAST_MODIFIED,
    header::LINK,
    header::CACHE_CONTROL,
    header::EXPIRES,
    header::VARY,
];

/// Returns whether a response with this status is stored (and replayed) unless configured
/// otherwise. This crate's policy: successes, redirects and client errors are stored, so that a
/// retry of a request that the handler refused (a validation failure, a `404`) gets the same
/// answer. Not stored, so that a retry runs the handler again: server errors (`5xx`: the server may
/// do better next time, and on a transactional route nothing of the failed attempt was committed),
/// `408 Request Timeout`, `429 Too Many Requests` (they say nothing about the request itself) and
/// informational statuses. (Other APIs choose otherwise: Stripe, for one, stores whatever the first
/// request got, `500`s included.) The layer's own refusals (`400`, `409`, `422`, …) are never
/// stored: the handler did not run.
pub fn stored_by_default(status: StatusCode) -> bool {
    !(status.is_server_error()
        || status.is_informational()
        || status == StatusCode::REQUEST_TIMEOUT
        || status == StatusCode::TOO_MANY_REQUESTS)
}

/// Why a stored response could not be read back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StoredError {
    /// The inbox row of the key has no response: it was not written by the HTTP layer (another
    /// consumer uses the layer's consumer name).
    #[error("the key's inbox row holds no stored response")]
    Missing,
    /// The row's response is not in the HTTP layer's format.
    #[error("the key's stored response is not in the HTTP layer's format")]
    NotHttp,
    /// The response was stored by a newer version of this crate.
    #[error("the key's stored response has format version {0}, which this version cannot read")]
    Version(u8),
    /// The stored bytes end early, run on after the body, or hold an invalid status or header.
    #[error("the key's stored response is damaged")]
    Damaged,
}

const MAGIC: &[u8] = b"\0http";
const VERSION: u8 = 1;
const BODY_OMITTED_FLAG: u8 = 1;

/// A response as stored: the status, the stored headers and the body, unless it was too long.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoredResponse {
    pub(crate) status: StatusCode,
    pub(crate) headers: Vec<(HeaderName, HeaderValue)>,
    /// `None` when the body was not stored.
    pub(crate) body: Option<Bytes>,
}

impl StoredResponse {
    /// What is stored of a response with `head` and `body`: the headers named in `stored`.
    pub(crate) fn new(head: &response::Parts, stored: &[HeaderName], body: Option<Bytes>) -> Self {
        let headers = head
            .headers
            .iter()
            .filter(|(name, _)| stored.contains(name))
            .map(|(name, value)| (name.clone(), value.clone()))
            .collect();
        Self {
            status: head.status,
            headers,
            body,
        }
    }

    pub(crate) fn encode(&self) -> Vec<u8> {
        let body = self.body.as_deref().unwrap_or_default();
        let mut out = Vec::with_capacity(64 + body.len());
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        out.extend_from_slice(&self.status.as_u16().to_be_bytes());
        out.push(if self.body.is_none() {
            BODY_OMITTED_FLAG
        } else {
            0
        });
        // Header names are shorter than 64 KiB and values than 4 GiB (hyper refuses far less);
        // the counts saturate rather than wrap, and a header that would not fit is left out.
        let headers: Vec<_> = self
            .headers
            .iter()
            .filter(|(name, value)| {
                u16::try_from(name.as_str().len()).is_ok() && u32::try_from(value.len()).is_ok()
            })
            .take(usize::from(u16::MAX))
            .collect();
        out.extend_from_slice(&(headers.len() as u16).to_be_bytes());
        for (name, value) in headers {
            out.extend_from_slice(&(name.as_str().len() as u16).to_be_bytes());
            out.extend_from_slice(name.as_str().as_bytes());
            out.extend_from_slice(&(value.len() as u32).to_be_bytes());
            out.extend_from_slice(value.as_bytes());
        }
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
        out.extend_from_slice(body);
        out
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<Self, StoredError> {
        let mut input = Reader(bytes);
        if input.take(MAGIC.len()) != Ok(MAGIC) {
            return Err(StoredError::NotHttp);
        }
        let version = input.u8()?;
        if version != VERSION {
            return Err(StoredError::Version(version));
        }
        let status = StatusCode::from_u16(input.u16()?).map_err(|_| StoredError::Damaged)?;
        let flags = input.u8()?;
        let count = input.u16()?;
        let mut headers = Vec::with_capacity(usize::from(count).min(64));
        for _ in 0..count {
            let len = usize::from(input.u16()?);
            let name =
                HeaderName::from_bytes(input.take(len)?).map_err(|_| StoredError::Damaged)?;
            let len = usize::try_from(input.u32()?).map_err(|_| StoredError::Damaged)?;
            let value =
                HeaderValue::from_bytes(input.take(len)?).map_err(|_| StoredError::Damaged)?;
            headers.push((name, value));
        }
        let len = usize::try_from(input.u64()?).map_err(|_| StoredError::Damaged)?;
        let body = Bytes::copy_from_slice(input.take(len)?);
        if !input.0.is_empty() {
            return Err(StoredError::Damaged);
        }
        Ok(Self {
            status,
            headers,
            body: (flags & BODY_OMITTED_FLAG == 0).then_some(body),
        })
    }

    /// The replay: the stored status, headers and body, marked as a replay.
    pub(crate) fn into_replay(self) -> Response {
        let omitted = self.body.is_none();
        let mut response = Response::new(Body::from(self.body.unwrap_or_default()));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        for (name, value) in self.headers {
            headers.append(name, value);
        }
        headers.insert(REPLAYED, HeaderValue::from_static("true"));
        if omitted {
            headers.insert(BODY_OMITTED, HeaderValue::from_static("true"));
        }
        response
    }
}

/// Reads the stored format, refusing to read past its end.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, len: usize) -> Result<&'a [u8], StoredError> {
        if self.0.len() < len {
            return Err(StoredError::Damaged);
        }
        let (taken, rest) = self.0.split_at(len);
        self.0 = rest;
        Ok(taken)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], StoredError> {
        let mut array = [0; N];
        array.copy_from_slice(self.take(N)?);
        Ok(array)
    }

    fn u8(&mut self) -> Result<u8, StoredError> {
        Ok(self.array::<1>()?[0])
    }

    fn u16(&mut self) -> Result<u16, StoredError> {
        self.array().map(u16::from_be_bytes)
    }

    fn u32(&mut self) -> Result<u32, StoredError> {
        self.array().map(u32::from_be_bytes)
    }

    fn u64(&mut self) -> Result<u64, StoredError> {
        self.array().map(u64::from_be_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(body: Option<&'static [u8]>) -> StoredResponse {
        StoredResponse {
            status: StatusCode::CREATED,
            headers: vec![
                (header::LOCATION, HeaderValue::from_static("/payments/7")),
                (header::LINK, HeaderValue::from_static("</a>; rel=a")),
                (header::LINK, HeaderValue::from_static("</b>; rel=b")),
            ],
            body: body.map(Bytes::from_static),
        }
    }

    #[test]
    fn stored_responses_read_back_as_they_were() {
        for stored in [sample(Some(b"{\"id\":7}")), sample(Some(b"")), sample(None)] {
            assert_eq!(StoredResponse::decode(&stored.encode()), Ok(stored));
        }
    }

    #[test]
    fn damaged_or_foreign_bytes_are_errors_not_panics() {
        let encoded = sample(Some(b"body")).encode();
        for len in 0..encoded.len() {
            assert!(StoredResponse::decode(&encoded[..len]).is_err(), "{len}");
        }
        let mut longer = encoded.clone();
        longer.push(0);
        assert_eq!(StoredResponse::decode(&longer), Err(StoredError::Damaged));
        assert_eq!(
            StoredResponse::decode(b"\"json\""),
            Err(StoredError::NotHttp)
        );
        let mut newer = encoded.clone();
        newer[MAGIC.len()] = 9;
        assert_eq!(StoredResponse::decode(&newer), Err(StoredError::Version(9)));
        let mut bad_status = encoded;
        bad_status[MAGIC.len() + 1..MAGIC.len() + 3].copy_from_slice(&1000u16.to_be_bytes());
        assert_eq!(
            StoredResponse::decode(&bad_status),
            Err(StoredError::Damaged)
        );
        // A huge length is refused before anything is allocated for it.
        let mut huge = sample(None).encode();
        let at = huge.len() - 8;
        huge[at..].copy_from_slice(&u64::MAX.to_be_bytes());
        assert_eq!(StoredResponse::decode(&huge), Err(StoredError::Damaged));
    }

    #[test]
    fn replays_are_marked_and_say_when_the_body_was_not_stored() {
        let replay = sample(Some(b"x")).into_replay();
        assert_eq!(replay.status(), StatusCode::CREATED);
        assert_eq!(replay.headers()[REPLAYED], "true");
        assert_eq!(replay.headers().get_all(header::LINK).iter().count(), 2);
        assert!(replay.headers().get(BODY_OMITTED).is_none());
        let replay = sample(None).into_replay();
        assert_eq!(replay.headers()[BODY_OMITTED], "true");
    }

    #[test]
    fn server_errors_and_throttling_are_not_stored_by_default() {
        for status in [200, 201, 204, 303, 400, 404, 409, 422] {
            assert!(
                stored_by_default(StatusCode::from_u16(status).unwrap()),
                "{status}"
            );
        }
        for status in [100, 408, 429, 500, 502, 503] {
            assert!(
                !stored_by_default(StatusCode::from_u16(status).unwrap()),
                "{status}"
            );
        }
    }
}
