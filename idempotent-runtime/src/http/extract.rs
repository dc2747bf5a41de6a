//! What a handler behind the layer can take: the claimed transaction, and the request's key.

use std::fmt;
use std::sync::{Arc, Mutex};

use axum_core::extract::{FromRequestParts, OptionalFromRequestParts};
use http::request::Parts;

use super::problem::Rejection;
use crate::inbox::Claimed;
use crate::key::{IdempotencyKey, MessageKey};
use crate::store::try_claim::HttpBackend;

/// Where the layer leaves the claimed transaction for the handler, and finds it again after the
/// handler answered.
pub(crate) struct ClaimedForHandler<DB: HttpBackend>(Arc<Mutex<Option<Claimed<DB>>>>);

impl<DB: HttpBackend> Clone for ClaimedForHandler<DB> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<DB: HttpBackend> ClaimedForHandler<DB> {
    pub(crate) fn new(claimed: Claimed<DB>) -> Self {
        Self(Arc::new(Mutex::new(Some(claimed))))
    }

    /// The claimed transaction, unless a handler holds it.
    pub(crate) fn take(&self) -> Option<Claimed<DB>> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take()
    }

    fn put_back(&self, claimed: Claimed<DB>) {
        *self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(claimed);
    }
}

/// The claimed transaction of an idempotent request, for a handler that writes to the inbox's
/// database: its statements on [`connection`](Self::connection) commit together with the key and
/// the stored response, after the handler answered, or not at all. Only on routes whose layer
/// was made with [`IdempotencyLayer::transactional`](super::IdempotencyLayer::transactional).
///
/// ```no_run
/// # use idempotent_runtime as idempotent;
/// # use idempotent::http::IdempotentTx;
/// # use axum_core::response::IntoResponse;
/// async fn create_payment(mut tx: IdempotentTx<sqlx::Postgres>) -> impl IntoResponse {
///     sqlx::query("INSERT INTO payments (amount) VALUES (100)")
///         .execute(tx.connection())
///         .await
///         .map(|_| http::StatusCode::CREATED)
///         .map_err(|_| http::StatusCode::INTERNAL_SERVER_ERROR)
/// }
/// ```
///
/// Do not commit or roll back on it yourself (nested transactions, `tx.connection().begin()`,
/// are fine), and do not keep it after the handler answered: the layer commits when the response
/// is one it stores, and rolls back otherwise (a `5xx` by default), so that a retry runs again.
/// A handler that ends the transaction itself (a raw `COMMIT` or `ROLLBACK`, after which its
/// writes commit on their own) gets a stored `500` (`transaction_ended`) instead of its response:
/// its retries get that answer again and never run it a second time.
pub struct IdempotentTx<DB: HttpBackend> {
    /// `Some` until dropped, when it goes back to the slot.
    claimed: Option<Claimed<DB>>,
    slot: ClaimedForHandler<DB>,
}

impl<DB: HttpBackend> IdempotentTx<DB> {
    /// Returns the transaction's connection, for the handler's statements.
    pub fn connection(&mut self) -> &mut DB::Connection {
        self.claimed_mut().connection()
    }

    /// Returns the claimed transaction.
    pub fn claimed_mut(&mut self) -> &mut Claimed<DB> {
        self.claimed
            .as_mut()
            .expect("an IdempotentTx holds its claim until dropped")
    }
}

impl<DB: HttpBackend> Drop for IdempotentTx<DB> {
    fn drop(&mut self) {
        if let Some(claimed) = self.claimed.take() {
            self.slot.put_back(claimed);
        }
    }
}

impl<DB: HttpBackend> fmt::Debug for IdempotentTx<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotentTx")
            .field("claimed", &self.claimed)
            .finish()
    }
}

impl<S: Send + Sync, DB: HttpBackend> FromRequestParts<S> for IdempotentTx<DB> {
    type Rejection = Rejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Rejection> {
        let slot = parts
            .extensions
            .get::<ClaimedForHandler<DB>>()
            .cloned()
            .ok_or(Rejection::NoTransaction(
                "the route has no transactional idempotency layer for this database \
                 (IdempotencyLayer::transactional), or the request had no key",
            ))?;
        let claimed = slot
            .take()
            .ok_or(Rejection::NoTransaction("the handler asked for it twice"))?;
        Ok(Self {
            claimed: Some(claimed),
            slot,
        })
    }
}

/// The request's validated `Idempotency-Key`, the client it was scoped to, and a key to pass on
/// to outside services. Every route behind the layer can take it; on a route whose key is
/// optional take `Option<RequestKey>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestKey {
    pub(crate) key: String,
    pub(crate) scope: String,
    pub(crate) consumer: Arc<str>,
    pub(crate) stored: MessageKey,
}

impl RequestKey {
    /// Returns the key as the client sent it (unquoted).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Returns the client the key belongs to, as the route's scope function named it.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// Returns the inbox key: the scope and the key.
    pub fn message_key(&self) -> &MessageKey {
        &self.stored
    }

    /// Returns a key to send to an outside service as its idempotency key: the same for every retry
    /// of this request by this client, and different for every other client and key.
    pub fn idempotency_key(&self) -> IdempotencyKey {
        IdempotencyKey::new(&self.consumer, &self.stored)
    }
}

impl<S: Send + Sync> FromRequestParts<S> for RequestKey {
    type Rejection = Rejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Rejection> {
        parts
            .extensions
            .get::<RequestKey>()
            .cloned()
            .ok_or(Rejection::NoKey)
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for RequestKey {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, std::convert::Infallible> {
        Ok(parts.extensions.get::<RequestKey>().cloned())
    }
}
