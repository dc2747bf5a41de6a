//! HTTP APIs that accept an `Idempotency-Key` header, as the IETF draft
//! `draft-ietf-httpapi-idempotency-key-header` describes (and as Stripe's API does): a
//! [`tower::Layer`], [`IdempotencyLayer`], and axum extractors, [`IdempotentTx`] and
//! [`RequestKey`], on the inbox's tables.
//!
//! - [`IdempotencyLayer::transactional`]: the handler writes to the inbox's database; the key, the
//!   handler's effect and the stored response commit in one transaction.
//! - [`IdempotencyLayer::leased`]: the handler calls something else; the key is a pending call
//!   with a lease ([`calls`](crate::calls)) until the response is stored.
//!
//! A retry gets the stored response (with [`REPLAYED`]), a twin in flight `409` at once (or, with
//! [`IdempotencyLayer::wait_for_first`], the first's answer once it ends), the key reused for
//! another request `422`; the layer's own answers are [`Rejection`]s
//! (`application/problem+json`). What is stored is [`stored_by_default`], in the format
//! [`stored`] describes.
//!
//! The guide "HTTP APIs" has an example, every answer the layer gives and when, what is stored and
//! for how long, how twins are refused without waiting on each database, and what is tested:
//! `idempotent::guide::http` in the `idempotent-inbox` crate
//! (<https://docs.rs/idempotent-inbox/latest/idempotent/guide/http/index.html>).

mod body;
mod config;
mod extract;
mod fingerprint;
mod flow;
mod layer;
mod problem;
mod request_key;
mod service;
pub mod stored;

pub use crate::store::try_claim::HttpBackend;
pub use config::{
    DEFAULT_CONSUMER, DEFAULT_MAX_REQUEST_BODY, DEFAULT_MAX_STORED_BODY, DEFAULT_RETENTION,
    DEFAULT_STORE_PATIENCE,
};
pub use extract::{IdempotentTx, RequestKey};
pub use fingerprint::Fingerprint;
pub use layer::IdempotencyLayer;
pub use problem::Rejection;
pub use request_key::{DEFAULT_MAX_KEY_LEN, IDEMPOTENCY_KEY, KeyRejection};
pub use service::Idempotent;
pub use stored::{
    BODY_OMITTED, DEFAULT_STORED_HEADERS, KEY_EXPIRES, REPLAYED, StoredError, stored_by_default,
};
