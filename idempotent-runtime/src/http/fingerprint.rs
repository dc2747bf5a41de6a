//! Request fingerprints: what makes a retry the same request.

use http::header::HeaderName;
use http::request::Parts;
use sha2::{Digest, Sha256};

/// What of a request its fingerprint covers. A request whose key was used before with another
/// fingerprint is refused with `422 Unprocessable Content`: a client that reuses a key for a
/// different request gets an error, never the other request's response.
///
/// The method and the path are always covered; by default also the query string and the body.
/// The query string counts as its `&`-separated pairs, in order, without the empty ones:
/// `?a=1&b=2`, `?a=1&b=2&` and `?&a=1&&b=2` are the same request, `?b=2&a=1` is another (the order
/// of a repeated name's values can matter), and so is `?a=%31` (pairs are compared as sent, not
/// decoded). No query string and an empty one (`?`) are the same. The path and the body are
/// compared byte for byte.
/// Leave out what a retry may change without changing its meaning, and add headers that do change
/// it (a `Content-Type` that decides how the body is read):
///
/// ```
/// # use idempotent_runtime as idempotent;
/// # use idempotent::http::Fingerprint;
/// let fingerprint = Fingerprint::default()
///     .without_query()
///     .with_header(http::header::CONTENT_TYPE);
/// ```
///
/// The fingerprint is a SHA-256 of the parts, each length-prefixed, and of which parts were
/// covered: changing this configuration makes requests stored before it count as different.
#[derive(Debug, Clone)]
pub struct Fingerprint {
    query: bool,
    body: bool,
    headers: Vec<HeaderName>,
}

impl Default for Fingerprint {
    fn default() -> Self {
        Self {
            query: true,
            body: true,
            headers: Vec::new(),
        }
    }
}

impl Fingerprint {
    /// Does not cover the query string.
    pub fn without_query(self) -> Self {
        Self {
            query: false,
            ..self
        }
    }

    /// Does not cover the body (only the method, the path and what else is configured).
    pub fn without_body(self) -> Self {
        Self {
            body: false,
            ..self
        }
    }

    /// Also covers the values of the header `name` (all of them, in order; none is a value too).
    pub fn with_header(mut self, name: HeaderName) -> Self {
        if !self.headers.contains(&name) {
            self.headers.push(name);
        }
        self
    }

    /// The fingerprint of a request.
    pub(crate) fn of(&self, parts: &Parts, body: &[u8]) -> [u8; 32] {
        let mut digest = Sha256::new();
        let mut field = |bytes: &[u8]| {
            digest.update((bytes.len() as u64).to_be_bytes());
            digest.update(bytes);
        };
        field(b"idempotent-http-fingerprint-v1");
        field(parts.method.as_str().as_bytes());
        field(parts.uri.path().as_bytes());
        field(&[u8::from(self.query), u8::from(self.body)]);
        if self.query {
            field(canonical_query(parts.uri.query().unwrap_or("")).as_bytes());
        }
        for name in &self.headers {
            field(name.as_str().as_bytes());
            let values = parts.headers.get_all(name);
            field(&(values.iter().count() as u64).to_be_bytes());
            for value in values {
                field(value.as_bytes());
            }
        }
        if self.body {
            field(body);
        }
        digest.finalize().into()
    }
}

/// The query string's non-empty pairs, in order, joined by `&`: a query string without empty
/// pairs is itself (so fingerprints stored before this rule still match).
fn canonical_query(query: &str) -> std::borrow::Cow<'_, str> {
    if !query.split('&').any(str::is_empty) || query.is_empty() {
        return query.into();
    }
    let pairs: Vec<&str> = query.split('&').filter(|pair| !pair.is_empty()).collect();
    pairs.join("&").into()
}

#[cfg(test)]
mod tests {
    use http::Request;

    use super::*;

    fn parts(method: &str, uri: &str, content_type: Option<&str>) -> Parts {
        let mut request = Request::builder().method(method).uri(uri);
        if let Some(content_type) = content_type {
            request = request.header("content-type", content_type);
        }
        request.body(()).unwrap().into_parts().0
    }

    #[test]
    fn method_path_query_and_body_count_by_default() {
        let f = Fingerprint::default();
        let base = f.of(&parts("POST", "/pay?x=1", None), b"{}");
        assert_eq!(base, f.of(&parts("POST", "/pay?x=1", None), b"{}"));
        assert_ne!(base, f.of(&parts("PUT", "/pay?x=1", None), b"{}"));
        assert_ne!(base, f.of(&parts("POST", "/pay2?x=1", None), b"{}"));
        assert_ne!(base, f.of(&parts("POST", "/pay?x=2", None), b"{}"));
        for same in ["/pay?x=1&", "/pay?&x=1", "/pay?x=1&&"] {
            assert_eq!(base, f.of(&parts("POST", same, None), b"{}"), "{same}");
        }
        let two = f.of(&parts("POST", "/pay?x=1&y=2", None), b"{}");
        assert_eq!(two, f.of(&parts("POST", "/pay?x=1&&y=2&", None), b"{}"));
        assert_ne!(two, f.of(&parts("POST", "/pay?y=2&x=1", None), b"{}"));
        assert_eq!(
            f.of(&parts("POST", "/pay?", None), b"{}"),
            f.of(&parts("POST", "/pay", None), b"{}")
        );
        assert_ne!(base, f.of(&parts("POST", "/pay?x=1", None), b"{ }"));
        // The path and the body are length-prefixed: moving bytes between them changes it.
        assert_ne!(
            f.of(&parts("POST", "/ab", None), b"c"),
            f.of(&parts("POST", "/a", None), b"bc")
        );
    }

    #[test]
    fn what_is_left_out_does_not_count_and_added_headers_do() {
        let f = Fingerprint::default().without_query().without_body();
        assert_eq!(
            f.of(&parts("POST", "/pay?x=1", None), b"a"),
            f.of(&parts("POST", "/pay?x=2", None), b"b")
        );
        let f = Fingerprint::default().with_header(http::header::CONTENT_TYPE);
        assert_ne!(
            f.of(&parts("POST", "/pay", Some("text/plain")), b"a"),
            f.of(&parts("POST", "/pay", Some("application/json")), b"a")
        );
        assert_ne!(
            f.of(&parts("POST", "/pay", None), b"a"),
            Fingerprint::default().of(&parts("POST", "/pay", None), b"a")
        );
    }
}
