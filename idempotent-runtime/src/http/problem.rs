//! Why the layer answered instead of the handler, and the `application/problem+json` (RFC 9457)
//! answers themselves.

use std::time::Duration;

use axum_core::body::Body;
use axum_core::response::{IntoResponse, Response};
use http::StatusCode;
use http::header::{self, HeaderValue};

use super::request_key::KeyRejection;
use super::stored::StoredError;
use crate::error::InboxError;

/// Why the HTTP layer (or its extractor) answered a request itself. Each becomes a response with an
/// `application/problem+json` body (`type`, `title`, `status`, `detail` and a `code` member naming
/// the variant); see [`status`](Rejection::status) for the status codes.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Rejection {
    /// The route requires an `Idempotency-Key` and the request has none: `400`.
    #[error("this route requires an Idempotency-Key header")]
    MissingKey,
    /// The `Idempotency-Key` header cannot be used: `400`.
    #[error("the Idempotency-Key header cannot be used")]
    InvalidKey(#[source] KeyRejection),
    /// The route's scope function found no client to scope the key to: `400`. (An authentication
    /// layer that should have run before this one did not, or the request is anonymous on a route
    /// whose scope function does not allow that.)
    #[error("the request does not identify the client its Idempotency-Key belongs to")]
    NoScope,
    /// The layer serves tenants ([`IdempotencyLayer::by_tenant`](super::IdempotencyLayer::by_tenant))
    /// and its function found no tenant for the request: `400`.
    #[error("the request does not say which tenant it belongs to")]
    NoTenant,
    /// The layer serves tenants and the request's tenant is not one of them: `400`.
    #[error("the request's tenant {tenant:?} is not served here")]
    UnknownTenant {
        /// The tenant the request named.
        tenant: String,
    },
    /// The request body is longer than the route reads to fingerprint it: `413`.
    #[error("the request body is longer than the {limit} bytes this route accepts")]
    RequestTooLarge {
        /// The route's limit, in bytes.
        limit: usize,
    },
    /// The request body could not be read (the client went away, a malformed chunk): `400`.
    #[error("the request body could not be read")]
    RequestBody(#[source] axum_core::Error),
    /// A request with the same key (and client) is being handled: `409`, with `Retry-After`.
    #[error("a request with this Idempotency-Key is still being handled")]
    InFlight {
        /// When to try again: the rest of the other request's lease, or the route's configured
        /// pause.
        retry_after: Duration,
    },
    /// The key was used before for a request with another fingerprint: `422`.
    #[error("this Idempotency-Key was used before for a different request")]
    KeyReused,
    /// The inbox failed (the database is down, the pool is exhausted, the commit failed): `503`
    /// with `Retry-After` when the error [is retryable](InboxError::is_retryable), else `500`.
    /// Nothing was committed, except possibly at [`Stage::Commit`](crate::Stage::Commit), where
    /// a retry finds out.
    #[error("the idempotency record could not be read or written")]
    Inbox(#[source] InboxError),
    /// The key's stored response could not be read back: `500`.
    #[error("the stored response of this Idempotency-Key cannot be replayed")]
    Stored(#[source] StoredError),
    /// The handler's response body failed before it could be stored; nothing was stored: `500`.
    #[error("the response failed before it could be stored")]
    ResponseBody(#[source] axum_core::Error),
    /// The handler ended the claimed transaction itself (a raw `COMMIT` or `ROLLBACK` on its
    /// connection), so that what it wrote afterwards committed on its own, outside the layer's
    /// hands: `500`. This answer is stored for the key like a response, so that a retry gets it
    /// again and never runs the handler a second time; a person must look at what was committed.
    #[error(
        "the handler ended its transaction itself; what it wrote may be committed in part, and \
         the request will not run again"
    )]
    TransactionEnded,
    /// The handler ran under a lease, but its response could not be stored in time (the database
    /// refuses writes for now): `503` with `Retry-After`. The layer goes on storing it; retries
    /// get `409` until then, and the stored response after. The handler does not run again.
    #[error("the request was handled, but its response is not stored yet; retry to get it")]
    StorePending {
        /// When to try again.
        retry_after: Duration,
    },
    /// A handler asked for the claimed transaction ([`IdempotentTx`](super::IdempotentTx)) where
    /// there is none: `500`, a mistake in the server's code.
    #[error("no claimed transaction for this handler: {0}")]
    NoTransaction(&'static str),
    /// A handler asked for the request's key ([`RequestKey`](super::RequestKey)) on a request
    /// that went through no idempotency layer, or had no key: `500`, a mistake in the server's
    /// code (take `Option<RequestKey>` on routes whose key is optional).
    #[error("the request went through no idempotency layer, or had no Idempotency-Key")]
    NoKey,
    /// The handler kept the claimed transaction after it answered (it moved it into a task of its
    /// own): nothing was committed: `500`.
    #[error("the handler kept the claimed transaction after it answered; nothing was committed")]
    TransactionKept,
    /// The handler's task ended without an answer: it panicked, or the runtime is shutting down.
    /// The transaction rolled back; under a lease the call stays pending until the lease runs out.
    /// `500`.
    #[error("the handler ended without an answer")]
    HandlerLost,
}

impl Rejection {
    /// Returns the response's status code.
    pub fn status(&self) -> StatusCode {
        match self {
            Rejection::MissingKey
            | Rejection::InvalidKey(_)
            | Rejection::NoScope
            | Rejection::NoTenant
            | Rejection::UnknownTenant { .. }
            | Rejection::RequestBody(_) => StatusCode::BAD_REQUEST,
            Rejection::RequestTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Rejection::InFlight { .. } => StatusCode::CONFLICT,
            Rejection::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            Rejection::Inbox(error) if error.is_retryable() => StatusCode::SERVICE_UNAVAILABLE,
            Rejection::StorePending { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Rejection::TransactionEnded
            | Rejection::Inbox(_)
            | Rejection::Stored(_)
            | Rejection::ResponseBody(_)
            | Rejection::NoTransaction(_)
            | Rejection::NoKey
            | Rejection::TransactionKept
            | Rejection::HandlerLost => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// Returns a stable name for the problem, the body's `code` member.
    pub fn code(&self) -> &'static str {
        match self {
            Rejection::MissingKey => "idempotency_key_missing",
            Rejection::InvalidKey(_) => "idempotency_key_invalid",
            Rejection::NoScope => "idempotency_scope_missing",
            Rejection::NoTenant => "tenant_missing",
            Rejection::UnknownTenant { .. } => "tenant_unknown",
            Rejection::RequestTooLarge { .. } => "request_too_large",
            Rejection::RequestBody(_) => "request_body_unreadable",
            Rejection::InFlight { .. } => "idempotency_key_in_use",
            Rejection::KeyReused => "idempotency_key_reused",
            Rejection::Inbox(_) => "idempotency_store_failed",
            Rejection::TransactionEnded => "transaction_ended",
            Rejection::StorePending { .. } => "idempotency_store_pending",
            Rejection::Stored(_) => "idempotency_stored_response_unreadable",
            Rejection::ResponseBody(_) => "response_body_failed",
            Rejection::NoTransaction(_) => "idempotency_transaction_unavailable",
            Rejection::NoKey => "idempotency_key_unavailable",
            Rejection::TransactionKept => "idempotency_transaction_kept",
            Rejection::HandlerLost => "handler_lost",
        }
    }

    /// How long to wait before a retry, for the answers that say one may succeed.
    fn retry_after(&self) -> Option<Duration> {
        match self {
            Rejection::InFlight { retry_after } | Rejection::StorePending { retry_after } => {
                Some(*retry_after)
            }
            Rejection::Inbox(_) if self.status() == StatusCode::SERVICE_UNAVAILABLE => {
                Some(Duration::from_secs(1))
            }
            _ => None,
        }
    }

    /// The body's `detail`: what went wrong, and for a client's mistake, why (the source). A
    /// server's failure does not show its causes (a database error's text) to the client.
    fn detail(&self) -> String {
        let mut detail = self.to_string();
        if self.status().is_client_error() {
            let mut source = std::error::Error::source(self);
            while let Some(cause) = source {
                detail.push_str(": ");
                detail.push_str(&cause.to_string());
                source = cause.source();
            }
        }
        detail
    }
}

/// A `Retry-After` value: whole seconds, rounded up, at least 1.
pub(crate) fn retry_after_seconds(after: Duration) -> HeaderValue {
    let seconds = after.as_secs() + u64::from(after.subsec_nanos() > 0);
    HeaderValue::from(seconds.max(1))
}

impl Rejection {
    /// Whether the problem is about the request's key, which the route's documentation explains:
    /// a missing or unusable key, a key in use, a reused key.
    fn about_the_key(&self) -> bool {
        matches!(
            self,
            Rejection::MissingKey
                | Rejection::InvalidKey(_)
                | Rejection::InFlight { .. }
                | Rejection::KeyReused
        )
    }

    /// The problem response, linking to `documentation` when it is about the key.
    pub(crate) fn into_problem(self, documentation: Option<&Documentation>) -> Response {
        let documentation = documentation.filter(|_| self.about_the_key());
        let status = self.status();
        let body = serde_json::json!({
            "type": documentation.map_or("about:blank", |docs| &*docs.uri),
            "title": status.canonical_reason().unwrap_or("Error"),
            "status": status.as_u16(),
            "detail": self.detail(),
            "code": self.code(),
        });
        let mut response = Response::new(Body::from(body.to_string()));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(after) = self.retry_after() {
            headers.insert(header::RETRY_AFTER, retry_after_seconds(after));
        }
        if let Some(docs) = documentation {
            headers.insert(header::LINK, docs.link.clone());
        }
        response
    }
}

impl IntoResponse for Rejection {
    fn into_response(self) -> Response {
        self.into_problem(None)
    }
}

/// Where the documentation of a route's keys is: the problems' `type`, and their `Link` header.
#[derive(Debug, Clone)]
pub(crate) struct Documentation {
    uri: std::sync::Arc<str>,
    link: HeaderValue,
}

impl Documentation {
    pub(crate) fn new(uri: &http::Uri) -> Self {
        let uri = uri.to_string();
        // A `Uri` is visible ASCII without angle brackets: a valid header value.
        let link = HeaderValue::try_from(format!("<{uri}>; rel=\"describedby\""))
            .unwrap_or_else(|_| HeaderValue::from_static(""));
        Self {
            uri: uri.into(),
            link,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ended_transaction_is_a_500_and_a_pending_store_a_503_to_retry() {
        let ended = Rejection::TransactionEnded.into_response();
        assert_eq!(ended.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert!(ended.headers().get(header::RETRY_AFTER).is_none());
        let pending = Rejection::StorePending {
            retry_after: Duration::from_secs(2),
        };
        assert_eq!(pending.code(), "idempotency_store_pending");
        let pending = pending.into_response();
        assert_eq!(pending.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(pending.headers()[header::RETRY_AFTER], "2");
    }

    #[test]
    fn only_problems_about_the_key_link_to_the_documentation() {
        let docs = Documentation::new(&"https://example.com/keys".parse().unwrap());
        let reused = Rejection::KeyReused.into_problem(Some(&docs));
        assert_eq!(
            reused.headers()[header::LINK],
            "<https://example.com/keys>; rel=\"describedby\""
        );
        let failed = Rejection::HandlerLost.into_problem(Some(&docs));
        assert!(failed.headers().get(header::LINK).is_none());
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        assert_eq!(retry_after_seconds(Duration::ZERO), "1");
        assert_eq!(retry_after_seconds(Duration::from_millis(1500)), "2");
        assert_eq!(retry_after_seconds(Duration::from_secs(30)), "30");
    }

    #[test]
    fn a_client_mistake_says_why_and_a_server_failure_does_not_say_its_cause() {
        let invalid = Rejection::InvalidKey(KeyRejection::Empty);
        assert_eq!(invalid.status(), StatusCode::BAD_REQUEST);
        assert_eq!(
            invalid.detail(),
            "the Idempotency-Key header cannot be used: the Idempotency-Key is empty"
        );
        let stored = Rejection::Stored(StoredError::Damaged);
        assert_eq!(stored.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(
            stored.detail(),
            "the stored response of this Idempotency-Key cannot be replayed"
        );
        let conflict = Rejection::InFlight {
            retry_after: Duration::from_secs(3),
        }
        .into_response();
        assert_eq!(conflict.status(), StatusCode::CONFLICT);
        assert_eq!(conflict.headers()[header::RETRY_AFTER], "3");
        assert_eq!(
            conflict.headers()[header::CONTENT_TYPE],
            "application/problem+json"
        );
    }
}
