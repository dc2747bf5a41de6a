//! HTTP APIs that accept an `Idempotency-Key` header, as the IETF draft
//! `draft-ietf-httpapi-idempotency-key-header` describes (and as Stripe's API does): a [`tower::Layer`] and axum extractors,
//! on the inbox's tables.
//!
//! ```no_run
//! use axum::{Router, routing::post};
//! use idempotent_runtime::http::{IdempotencyLayer, IdempotentTx, RequestKey};
//!
//! # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let inbox = idempotent_runtime::Inbox::new(pool);
//! inbox.migrate().await?;
//! // Each client's keys are its own: here the client is an API key's id, which an
//! // authentication layer before this one put in the request's extensions.
//! let scope = |parts: &http::request::Parts| parts.extensions.get::<ApiKeyId>().map(|id| id.0.clone());
//! let payments = IdempotencyLayer::transactional(inbox.clone(), scope);
//! let _purger = payments.inbox().spawn_purger(Default::default()); // stored responses expire
//!
//! let app: Router = Router::new()
//!     .route("/payments", post(create_payment).layer(payments));
//! # Ok(()) }
//! # #[derive(Clone)] struct ApiKeyId(String);
//!
//! async fn create_payment(mut tx: IdempotentTx<sqlx::Postgres>, key: RequestKey) -> (http::StatusCode, String) {
//!     // Runs once per key and client: this insert, the key and the response commit together.
//!     sqlx::query("INSERT INTO payments (client, amount) VALUES ($1, 100)")
//!         .bind(key.scope())
//!         .execute(tx.connection())
//!         .await
//!         .expect("a real handler returns an error response");
//!     (http::StatusCode::CREATED, "paid".into())
//! }
//! ```
//! (The example uses `axum` itself; this crate depends only on its core, `axum-core`, and on
//! `tower`.)
//!
//! # Two kinds of route
//! - [`IdempotencyLayer::transactional`]: the handler writes to the inbox's database. The layer
//!   begins a transaction, claims the key in it, and hands it to the handler through the
//!   [`IdempotentTx`] extractor; after the handler answered, it stores the response in the key's
//!   inbox row and commits: the effect, the key and the response commit together, or nothing does.
//! - [`IdempotencyLayer::leased`]: the handler does not touch the inbox's database (it calls a
//!   payment provider). The layer records the key as a pending call with a lease
//!   ([`calls`](crate::calls)) in a transaction of its own, runs the handler, then stores the
//!   response in the key's inbox row and deletes the pending call in one transaction. A handler
//!   that died mid-way holds the key until its lease runs out; then a retry runs it again, so make
//!   the outside call idempotent too, with [`RequestKey::idempotency_key`].
//!
//! Routes of both kinds may share a consumer name (and so the keys of a client): one key never
//! runs two handlers, whichever kind of route each request reached and whichever instance handled
//! it (see [409 without waiting](#409-without-waiting)).
//!
//! # What a request gets
//!
//! | request | answer |
//! |---|---|
//! | first with its key (per client) | the handler's response, once it is stored (see below), with `Idempotency-Key-Expires` |
//! | retry after the first completed, same fingerprint | the stored response, with `Idempotent-Replayed: true`; the handler does not run |
//! | retry while the first is in flight, on either kind of route sharing the consumer | `409 Conflict` at once, with `Retry-After` (the rest of the lease, or 1 s on transactional routes); on SQLite see below |
//! | same key, different fingerprint (method, path, query, body by default: [`Fingerprint`]) | `422 Unprocessable Content` |
//! | no `Idempotency-Key`, on a route that requires one (the default) | `400`, `application/problem+json` |
//! | a key that is empty, longer than 255 characters, not visible ASCII, sent twice, or a list (an unquoted comma) | `400` |
//! | the scope function names no client | `400` |
//! | a body longer than the route reads (2 MiB) | `413` |
//! | transactional route, the handler ended the claimed transaction itself (a raw `COMMIT` or `ROLLBACK`) and wrote on | PostgreSQL: `500`, code `transaction_ended`, **stored**: retries get it replayed and the handler never runs again (also when the handler answered a `5xx` after its `ROLLBACK`; after its `COMMIT` and a `5xx` the key is committed without a response, and retries get `500` `idempotency_stored_response_unreadable`). SQLite refuses such writes (nothing commits): the handler's own error, and a retry runs again |
//! | leased route, the response cannot be stored within [`store_patience`](IdempotencyLayer::store_patience) (5 s) | `503` with `Retry-After`, code `idempotency_store_pending`; the layer goes on storing it, retries get `409` until then and the replay after |
//! | the database fails | `503` with `Retry-After` when retryable, else `500`; nothing committed |
//!
//! Every answer of the layer's own is a [`Rejection`], with an `application/problem+json` body
//! (RFC 9457) whose `code` member names it. The problems about the key (`400` for a missing or
//! unusable key, `409`, `422`) link to the route's documentation when the layer was given one
//! ([`documentation`](IdempotencyLayer::documentation)), as the IETF draft asks: as their `type`
//! and in a `Link: <uri>; rel="describedby"` header (else their `type` is `about:blank`). A key
//! may be bare (`Idempotency-Key: 8e03978e-40d5`) or a structured-field string as the IETF draft
//! writes it (`Idempotency-Key: "8e03978e-40d5"`). A bare key with a comma is refused: a proxy
//! that merges repeated headers sends two keys as `a, b`, and two headers are refused too. In
//! quotes, a comma is part of the key.
//!
//! A success is answered only for a response that is stored. On a leased route the handler's
//! effect happened before the response is stored; when the database refuses the store for now (a
//! lock held elsewhere, a lost connection), the layer tries again, extending the call's lease
//! before each try, for a minute or one lease, whichever is longer. The client gets the handler's response if that works
//! within [`store_patience`](IdempotencyLayer::store_patience), and `503` otherwise; its retries
//! find the key in flight (`409`) while the layer is still trying, and get the replay once it
//! succeeded. If it never does, the key stays pending until the lease
//! runs out, as after a crash.
//!
//! # What is stored, and for how long
//! This crate's policy, by default ([`stored_by_default`], configurable with
//! [`store_when`](IdempotencyLayer::store_when)): successes, redirects and client errors are
//! stored, so that a retry of a request that the handler refused (a validation failure) gets the
//! same `4xx`; server errors are not, so that a retry runs the handler again (on a transactional
//! route nothing of the failed attempt was committed). `408` and `429` are not stored either: they
//! say nothing about the request. The layer's own refusals (`400`, `409`, `422`, …) are never
//! stored: the handler did not run. (Other APIs decide otherwise; Stripe, for one, stores the
//! first response whatever it is, `500`s included.) A response that is not stored leaves nothing
//! behind: on a transactional route its transaction rolls back, effect included; on a leased route
//! the pending call is released. The one `5xx` that is stored is the layer's `transaction_ended`:
//! the handler committed what it wrote outside the layer's hands, so running it again would repeat
//! that.
//!
//! Stored: the status, the headers in [`DEFAULT_STORED_HEADERS`] (those that describe the body or
//! point to what the request made, such as `Content-Type` and `Location`; not `Set-Cookie`; add
//! others with [`store_header`](IdempotencyLayer::store_header)), and the body up to 256 KiB
//! ([`max_stored_body`](IdempotencyLayer::max_stored_body)). A longer body, or a streamed one
//! that runs past the limit, goes to the client as it comes, and the response is stored without
//! it: its replays have the stored status and headers, an empty body and
//! `Idempotent-Body-Omitted: true`. Trailers are not stored. Stored responses are kept 24 hours
//! ([`retention`](IdempotencyLayer::retention)) and deleted by the inbox's purge: spawn the
//! purger from [`IdempotencyLayer::inbox`], which carries that retention. Every stored response,
//! and each of its replays, says until when in [`KEY_EXPIRES`] (`Idempotency-Key-Expires:
//! <HTTP-date>`, the time the first request came in plus the retention, by the server's clock):
//! until then a retry gets the replay; after it a request with the key may run again.
//!
//! Keys are scoped per client: the layer's scope function names the client of each request
//! (an authenticated principal, an API key's id), and the inbox key is the pair (client, key), so
//! one client can never receive another's stored response by sending the same key. The rows live
//! in the inbox table under the consumer name `"http"` ([`consumer`](IdempotencyLayer::consumer)),
//! with the request's fingerprint in the `fingerprint` column and the response in `response` (in
//! the format [`stored`] describes). The query string counts in the fingerprint as its non-empty
//! `&`-separated pairs, in order (`?a=1&` is `?a=1`; `?b=2&a=1` is another request): see
//! [`Fingerprint`].
//!
//! # 409 without waiting
//! A message consumer's claim waits for a concurrent claim of the same key to end; an HTTP client
//! must not hang on a database lock, so the layer's claims never wait for a twin:
//! - Twins handled by the same process (by any layer made from the same inbox, or its clones) are
//!   refused before any database work: the inbox keeps the keys its layers are handling in memory.
//! - **PostgreSQL**, twins on other instances: the claim takes a transaction-level advisory lock
//!   on the key with `pg_try_advisory_xact_lock`, which never waits, and inserts the key only when
//!   it got the lock, in one statement; a claim that does not get the lock answers `409`. It then
//!   looks, in a statement of its own, for a leased route's pending call of the key with a live
//!   lease, and answers `409` (rolling its claim back) if there is one. A leased route reads the
//!   key's pending call first (a live one is a `409`), then records its own in a transaction that
//!   takes the same advisory lock without waiting (`409` if a transactional claim holds it), so
//!   neither kind runs while the other is in flight.
//! - **SQLite** allows one writer at a time: any transaction waits for the one before it, twin or
//!   not. A transactional claim holds the write lock until it commits, and looks for a pending
//!   call like PostgreSQL's. A twin in another process waits like any writer (up to the busy
//!   timeout), then finds the first request's stored response and replays it, or runs if the first
//!   rolled back, or gets `422` if the first was for another request (a leased twin of a
//!   transactional request, for one); a leased route's pending call is found by a read, which does
//!   not wait. Replays are read before a transaction begins, so they do not wait for writers.
//! - MySQL and MariaDB are not supported by the layer yet.
//!
//! # When the client goes away
//! The handler runs in a task of its own: a client that times out or drops its connection does not
//! cut the handler off. The request is finished and its response stored, and the client's retry
//! gets `409` until then and the replay after. If the task itself dies (a panic, the runtime
//! shutting down, the process killed), a transactional route's transaction rolls back, so the
//! retry runs the handler once; a leased route's key stays pending until its lease runs out, and
//! then the retry runs the handler once.
//!
//! # Observability
//! Each keyed request runs in a `tracing` span named `idempotent_http` with the fields `consumer`,
//! `key` (a digest, never the key) and `outcome` (`processed`, `replayed`, `not stored`,
//! `refused`); the layer's answers for the server's failures are logged at `warn`, a handler that
//! ended its transaction itself and a response that could not be stored in time at `error`. In
//! the inbox's [`metrics`](crate::Inbox::metrics) (shared with the inbox the layer was made from),
//! a committed response counts in `processed`, a replay in `duplicates`, a reused key in
//! `fingerprint_mismatches`, a `409` on a leased route in `calls_in_progress`.

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

pub use crate::store::no_wait::HttpBackend;
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
