//! What the layer does with one request, in order: read and check the key, fingerprint the
//! request, keep twins out (or let them wait for the first), then either replay, refuse, or run the
//! handler and store its response.
//!
//! The handler runs in a task of its own, so that a client that goes away (its timeout, a dropped
//! connection) does not cut the handler off half-way: the request is finished and its response
//! stored, and the client's retry gets the replay. What the task holds (the key in flight, the
//! claimed transaction, the call's lease) ends with it, whatever ends it. The task answers the
//! client through a channel, so that it can answer (a `503` for a response it has yet to store)
//! and go on working.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use axum_core::body::Body;
use axum_core::extract::Request;
use axum_core::response::{IntoResponse, Response};
use http::header::HeaderValue;
use http::response;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tokio::sync::oneshot;
use tracing::Instrument;

use super::body::{Buffered, buffer};
use super::config::{Config, LayerState, Mode};
use super::extract::{ClaimedForHandler, RequestKey};
use super::problem::Rejection;
use super::request_key::{read_key, scoped_key};
use super::stored::{KEY_EXPIRES, StoredResponse};
use crate::calls::{CallLease, CallStart, Gated};
use crate::error::InboxError;
use crate::in_flight::Entered;
use crate::inbox::{Claim, ClaimOptions, Claimed, Inbox, KeyCommitted, TryClaimed};
use crate::key::MessageKey;
use crate::store::try_claim::HttpBackend;

/// How long a leased route tries to store a response at least (longer if its lease is), keeping
/// the call's lease alive meanwhile.
const STORE_TRIES: Duration = Duration::from_secs(60);

/// The first and the longest pause of a twin that waits for a request in flight on another
/// instance, between two looks at its claim.
const FIRST_PAUSE: Duration = Duration::from_millis(5);
const LONGEST_PAUSE: Duration = Duration::from_millis(50);

/// The longest a twin waits, whatever the patience: a century.
const FOR_EVER: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);

/// The name of the pending call a leased route records per request.
const CALL_NAME: &str = "http";

/// One request through the layer.
pub(crate) async fn handle<S, DB>(
    shared: Arc<LayerState<DB>>,
    mut inner: S,
    request: Request,
) -> Result<Response, Infallible>
where
    S: tower::Service<Request, Error = Infallible> + Send + 'static,
    S::Response: IntoResponse,
    S::Future: Send + 'static,
    DB: HttpBackend,
{
    let arrived = SystemTime::now();
    let (mut parts, body) = request.into_parts();
    let config = &shared.config;
    let reject = |rejection| reject(config, rejection);
    let key = match read_key(&parts.headers, config.max_key_len) {
        Ok(Some(key)) => key,
        Ok(None) if !config.require_key => {
            let response = inner.call(Request::from_parts(parts, body)).await?;
            return Ok(response.into_response());
        }
        Ok(None) => return Ok(reject(Rejection::MissingKey)),
        Err(error) => return Ok(reject(Rejection::InvalidKey(error))),
    };
    let Some(scope) = (config.scope)(&parts).filter(|scope| !scope.is_empty()) else {
        return Ok(reject(Rejection::NoScope));
    };
    // Neither is empty: the key was checked, the scope too.
    let Ok(stored_key) = scoped_key(&scope, &key) else {
        return Ok(reject(Rejection::NoScope));
    };
    let span = tracing::info_span!(
        "idempotent_http",
        consumer = %config.consumer,
        key = %stored_key.digest(),
        outcome = tracing::field::Empty,
    );
    // A child of the client's span, if the request carries its trace context.
    crate::trace_context::continue_from(&span, |name| {
        parts
            .headers
            .get(name)
            .and_then(|value| value.to_str().ok())
    });
    let inbox = match shared.inbox_for(&parts) {
        Ok(inbox) => inbox.clone(),
        Err(rejection) => return Ok(reject(rejection)),
    };
    let waits_until = config.wait_for_first.map(|patience| {
        // A patience past what an instant holds (`Duration::MAX`): as good as for ever.
        let now = Instant::now();
        now.checked_add(patience).unwrap_or(now + FOR_EVER)
    });
    let (table, consumer) = (inbox.table().as_str(), &*config.consumer);
    let entered = match waits_until {
        None => inbox
            .in_flight
            .enter(table, consumer, stored_key.as_bytes()),
        Some(until) => {
            let entering =
                inbox
                    .in_flight
                    .enter_waiting(table, consumer, stored_key.as_bytes(), until.into());
            entering.instrument(span.clone()).await
        }
    };
    let Some(entered) = entered else {
        span.in_scope(|| tracing::debug!("a request with this key is in flight here"));
        return Ok(reject(Rejection::InFlight {
            retry_after: config.retry_after,
        }));
    };
    // Read whole, to fingerprint it; the handler gets it as it was.
    let body = match Limited::new(body, config.max_request_body).collect().await {
        Ok(body) => body.to_bytes(),
        Err(error) if error.is::<LengthLimitError>() => {
            return Ok(reject(Rejection::RequestTooLarge {
                limit: config.max_request_body,
            }));
        }
        Err(error) => return Ok(reject(Rejection::RequestBody(axum_core::Error::new(error)))),
    };
    let fingerprint = config.fingerprint.of(&parts, &body);
    parts.extensions.insert(RequestKey {
        key,
        scope,
        consumer: config.consumer.clone(),
        stored: stored_key.clone(),
    });
    let request = Request::from_parts(parts, Body::from(body));
    let expires = arrived.checked_add(config.retention).and_then(http_date);
    let (answer, answered) = oneshot::channel();
    let run = Run {
        shared: shared.clone(),
        inbox,
        key: stored_key,
        fingerprint,
        expires,
        answer: Some(answer),
        waits_until,
        pause: FIRST_PAUSE,
        _entered: entered,
    };
    tokio::spawn(run.run(inner, request).instrument(span));
    match answered.await {
        Ok(response) => Ok(response),
        // The task ended without an answer: it panicked, or the runtime is shutting down.
        Err(_) => Ok(reject(Rejection::HandlerLost)),
    }
}

/// A request whose key is in flight in this process, from its claim to its stored response.
struct Run<DB: HttpBackend> {
    shared: Arc<LayerState<DB>>,
    /// The inbox the request is served on (its tenant's, if the layer serves tenants).
    inbox: Inbox<DB>,
    key: MessageKey,
    fingerprint: [u8; 32],
    /// The `Idempotency-Key-Expires` of the responses it stores.
    expires: Option<HeaderValue>,
    /// Where the client's answer goes, until it is sent.
    answer: Option<oneshot::Sender<Response>>,
    /// Until when it waits for a twin in flight elsewhere (`wait_for_first`), if it does.
    waits_until: Option<Instant>,
    /// How long it waits before it checks the twin's claim again.
    pause: Duration,
    /// The key stays in flight until the run ends.
    _entered: Entered,
}

/// What a request found at its key: a handler to run, holding the key (its claimed transaction,
/// its pending call), or the stored response to replay. (A twin in flight is a
/// [`Rejection::InFlight`].)
enum Found<T> {
    Run(T),
    Replay(Response),
}

/// How a run ended, besides its response: for the span.
enum Outcome {
    Processed,
    Replayed,
    NotStored,
    Refused,
}

impl<DB: HttpBackend> Run<DB> {
    async fn run<S>(mut self, inner: S, request: Request)
    where
        S: tower::Service<Request, Error = Infallible> + Send + 'static,
        S::Response: IntoResponse,
        S::Future: Send + 'static,
    {
        let ended = match self.shared.config.mode {
            Mode::Transaction => self.in_transaction(inner, request).await,
            Mode::Lease(lease) => self.under_lease(inner, request, lease).await,
        };
        let (outcome, response) = match ended {
            Ok(ended) => ended,
            Err(rejection) => (Outcome::Refused, reject(&self.shared.config, rejection)),
        };
        let outcome = match outcome {
            Outcome::Processed => "processed",
            Outcome::Replayed => "replayed",
            Outcome::NotStored => "not stored",
            Outcome::Refused => "refused",
        };
        tracing::Span::current().record("outcome", outcome);
        tracing::debug!(status = %response.status(), outcome, "ended");
        self.answer(response);
    }

    /// Sends the client its answer, unless it was sent before.
    fn answer(&mut self, response: Response) {
        if let Some(answer) = self.answer.take() {
            // A client that went away takes no answer.
            let _ = answer.send(response);
        }
    }

    fn inbox(&self) -> &Inbox<DB> {
        &self.inbox
    }

    fn consumer(&self) -> &str {
        &self.shared.config.consumer
    }

    /// Waits before `found` is looked for again, if it is a twin in flight and the layer lets
    /// twins wait (`wait_for_first`) and the time to wait is not over; otherwise returns it.
    async fn unless_waiting<T>(
        &mut self,
        found: Result<Found<T>, Rejection>,
    ) -> Option<Result<Found<T>, Rejection>> {
        let Err(Rejection::InFlight { retry_after }) = found else {
            return Some(found);
        };
        let left = self
            .waits_until
            .map(|until| until.saturating_duration_since(Instant::now()))
            .filter(|left| !left.is_zero());
        let client_gone = self.answer.as_ref().is_none_or(|answer| answer.is_closed());
        let Some(left) = left.filter(|_| !client_gone) else {
            if matches!(self.shared.config.mode, Mode::Lease(_)) {
                let metrics = &self.inbox().metrics;
                metrics.call(self.consumer(), crate::metrics::CallOutcome::InProgress);
            }
            return Some(Err(Rejection::InFlight { retry_after }));
        };
        // Not past the first's lease (it may run out sooner), nor below the first pause.
        let pause = self.pause.min(retry_after.max(FIRST_PAUSE)).min(left);
        tokio::time::sleep(pause).await;
        self.pause = (self.pause * 2).min(LONGEST_PAUSE);
        None
    }

    /// A transactional route: claim without waiting, run the handler on the claimed transaction,
    /// and commit its effect with the stored response.
    async fn in_transaction<S>(
        &mut self,
        mut inner: S,
        request: Request,
    ) -> Result<(Outcome, Response), Rejection>
    where
        S: tower::Service<Request, Error = Infallible>,
        S::Response: IntoResponse,
    {
        let claimed = loop {
            let found = self.claim_in_transaction().await;
            if let Some(found) = self.unless_waiting(found).await {
                break found?;
            }
        };
        let claimed = match claimed {
            Found::Run(claimed) => claimed,
            Found::Replay(replay) => return Ok((Outcome::Replayed, replay)),
        };
        tracing::debug!("claimed");
        let slot = ClaimedForHandler::new(claimed);
        let (mut parts, body) = request.into_parts();
        parts.extensions.insert(slot.clone());
        let response = match inner.call(Request::from_parts(parts, body)).await {
            Ok(response) => response.into_response(),
            Err(never) => match never {},
        };
        let Some(mut claimed) = slot.take() else {
            // Rolled back when the handler's task drops it.
            return Err(Rejection::TransactionKept);
        };
        let (mut head, body) = response.into_parts();
        if !(self.shared.config.store_when)(head.status) {
            if self.claim_rolled_back(&mut claimed).await {
                // What the handler wrote after its `ROLLBACK` committed on its own: running it
                // again would write it again.
                claimed.rollback().await;
                return Ok(self.transaction_ended(false, &[]).await);
            }
            claimed.rollback().await;
            return Ok((Outcome::NotStored, Response::from_parts(head, body)));
        }
        let (stored, body) = match self.read_body(&mut head, body).await {
            Ok(read) => read,
            Err(rejection) => {
                claimed.rollback().await;
                return Err(rejection);
            }
        };
        let stored = stored.encode();
        if let Err(error) = claimed.store_response(&stored).await {
            // Behind a pooler in transaction mode, a handler's `ROLLBACK` or `COMMIT` makes the
            // store fail rather than change nothing: found out as the commit finds it out. What
            // the handler wrote after may have committed on its own, unless the database refused
            // it (SQLite: then a retry may run it again).
            return match claimed.rollback_after(error).await {
                InboxError::TransactionEnded {
                    key_committed,
                    later_writes_refused: false,
                } => Ok(self.transaction_ended(key_committed, &stored).await),
                error => Err(Rejection::Inbox(error)),
            };
        }
        match claimed.commit().await {
            Ok(()) => Ok((Outcome::Processed, Response::from_parts(head, body))),
            Err(InboxError::TransactionEnded { key_committed, .. }) => {
                Ok(self.transaction_ended(key_committed, &stored).await)
            }
            Err(error) => Err(Rejection::Inbox(error)),
        }
    }

    /// Claims the key in a transaction of its own, without waiting.
    async fn try_claim(&self) -> Result<TryClaimed<DB>, Rejection> {
        self.inbox()
            .try_claim(self.consumer(), &self.key, &self.fingerprint, CALL_NAME)
            .await
            .map_err(Rejection::Inbox)
    }

    /// A transactional route's claim of its key, without waiting.
    async fn claim_in_transaction(&mut self) -> Result<Found<Claimed<DB>>, Rejection> {
        if DB::READ_FIRST
            && let Some(replay) = self.replay(None).await?
        {
            return Ok(Found::Replay(replay));
        }
        match self.try_claim().await? {
            TryClaimed::New(claimed) => Ok(Found::Run(claimed)),
            TryClaimed::InFlight => Err(Rejection::InFlight {
                retry_after: self.shared.config.retry_after,
            }),
            TryClaimed::CallPending(left) => {
                // A leased route's request holds the key: the key inserted here rolled back.
                tracing::debug!(retry_after = ?left, "a leased request holds the key");
                Err(Rejection::InFlight { retry_after: left })
            }
            TryClaimed::Committed(committed) => match self.replay(Some(committed)).await? {
                Some(replay) => Ok(Found::Replay(replay)),
                // Purged between the claim and the read: as good as in flight.
                None => Err(Rejection::InFlight {
                    retry_after: self.shared.config.retry_after,
                }),
            },
        }
    }

    /// Whether the handler rolled back the claimed transaction itself (a raw `ROLLBACK`), on a
    /// database where its later writes then commit on their own (PostgreSQL): the claimed key is
    /// gone from what the connection sees. (A read that fails says nothing: a statement failed in
    /// the transaction, which is still the claim's.)
    async fn claim_rolled_back(&self, claimed: &mut Claimed<DB>) -> bool {
        !DB::REFUSES_LATER_WRITES && claimed.claim_gone().await
    }

    /// The answer to a request whose handler ended the claimed transaction itself: a `500`
    /// problem, stored for the key (on a new row, or on the row the handler committed, unless
    /// another request stored its response there), so that no retry runs the handler again.
    /// `tried` is the response this request tried to store (which may have been written, outside
    /// the transaction, on the row the handler committed).
    async fn transaction_ended(
        &mut self,
        key_committed: bool,
        tried: &[u8],
    ) -> (Outcome, Response) {
        tracing::error!(
            key_committed,
            "the handler ended the claimed transaction itself; its answer is stored as a 500"
        );
        let (mut head, body) =
            reject(&self.shared.config, Rejection::TransactionEnded).into_parts();
        let (stored, body) = match self.read_body(&mut head, body).await {
            Ok(read) => read,
            Err(rejection) => return (Outcome::Refused, reject(&self.shared.config, rejection)),
        };
        match self.store_ended(&stored.encode(), tried).await {
            Ok(true) => (Outcome::Processed, Response::from_parts(head, body)),
            Ok(false) => {
                tracing::warn!("another request's response is stored for the key: not replaced");
                head.headers.remove(KEY_EXPIRES);
                (Outcome::NotStored, Response::from_parts(head, body))
            }
            Err(rejection) => {
                tracing::warn!(error = %rejection, "the answer could not be stored");
                head.headers.remove(KEY_EXPIRES);
                (Outcome::NotStored, Response::from_parts(head, body))
            }
        }
    }

    /// Stores `answer` for the key, in a transaction of its own that claims the key without
    /// waiting: as a new row, or on the row there if it has no response or has `tried`. `false`
    /// when another request holds the key or stored its response.
    async fn store_ended(&self, answer: &[u8], tried: &[u8]) -> Result<bool, Rejection> {
        match self.try_claim().await? {
            TryClaimed::New(mut claimed) => {
                claimed
                    .store_response(answer)
                    .await
                    .map_err(Rejection::Inbox)?;
                claimed.commit().await.map_err(Rejection::Inbox)?;
                Ok(true)
            }
            TryClaimed::Committed(committed) => committed
                .fill_response(answer, tried)
                .await
                .map_err(Rejection::Inbox),
            TryClaimed::InFlight | TryClaimed::CallPending(_) => Ok(false),
        }
    }

    /// A leased route: record the pending call, run the handler, store its response in the inbox
    /// and end the call, in one transaction.
    async fn under_lease<S>(
        &mut self,
        mut inner: S,
        request: Request,
        lease: Duration,
    ) -> Result<(Outcome, Response), Rejection>
    where
        S: tower::Service<Request, Error = Infallible>,
        S::Response: IntoResponse,
    {
        let held = loop {
            let found = self.start_call(lease).await;
            if let Some(found) = self.unless_waiting(found).await {
                break found?;
            }
        };
        let held = match held {
            Found::Run(held) => held,
            Found::Replay(replay) => return Ok((Outcome::Replayed, replay)),
        };
        let shared = self.shared.clone();
        tracing::debug!(fence = held.fence(), "call pending");
        let response = match inner.call(request).await {
            Ok(response) => response.into_response(),
            Err(never) => match never {},
        };
        let (mut head, body) = response.into_parts();
        if !(shared.config.store_when)(head.status) {
            self.release(held).await;
            return Ok((Outcome::NotStored, Response::from_parts(head, body)));
        }
        let (stored, body) = match self.read_body(&mut head, body).await {
            Ok(read) => read,
            Err(rejection) => {
                self.release(held).await;
                return Err(rejection);
            }
        };
        self.store_under_lease(&stored, held, lease, Response::from_parts(head, body))
            .await
    }

    /// A leased route's pending call of its key, recorded without waiting.
    async fn start_call(&mut self, lease: Duration) -> Result<Found<CallLease>, Rejection> {
        if let Some(replay) = self.replay(None).await? {
            return Ok(Found::Replay(replay));
        }
        let shared = self.shared.clone();
        let inbox = self.inbox.clone();
        // A request of another instance holds the key (or is storing its response): refused
        // with a read, without waiting for the database's writers.
        let left = inbox
            .call_lease_left(self.consumer(), &self.key, CALL_NAME)
            .await
            .map_err(Rejection::Inbox)?;
        if let Some(retry_after) = left {
            return Err(Rejection::InFlight { retry_after });
        }
        // On PostgreSQL the call is recorded under the key's advisory lock, which a transactional
        // route's claim of the key holds until it ends: neither runs while the other is in flight.
        let started = inbox
            .begin_call_gated_by_claims::<serde::de::IgnoredAny>(
                self.consumer(),
                &self.key,
                CALL_NAME,
                lease,
            )
            .await;
        let held = match started {
            Ok(Gated::Passed(CallStart::Run(held))) => held,
            Ok(Gated::Shut) => {
                tracing::debug!("a transactional request holds the key");
                return Err(Rejection::InFlight {
                    retry_after: shared.config.retry_after,
                });
            }
            // Completed records are this layer's inbox rows, not its calls: someone else's.
            Ok(Gated::Passed(CallStart::Completed(_))) => {
                return match self.replay(None).await? {
                    Some(replay) => Ok(Found::Replay(replay)),
                    None => Err(Rejection::InFlight { retry_after: lease }),
                };
            }
            Err(InboxError::CallInProgress { retry_after }) => {
                // Its response may have been stored since the first read.
                return match self.replay(None).await? {
                    Some(replay) => Ok(Found::Replay(replay)),
                    None => Err(Rejection::InFlight { retry_after }),
                };
            }
            Err(error) => return Err(Rejection::Inbox(error)),
        };
        // The first read found nothing, but the request it missed may have completed since: its
        // completion stores the response and deletes its pending call in one transaction, which
        // is how this call could be recorded anew. Read again before running the handler.
        match self.replay(None).await {
            Ok(None) => Ok(Found::Run(held)),
            Ok(Some(replay)) => {
                self.release(held).await;
                Ok(Found::Replay(replay))
            }
            Err(rejection) => {
                self.release(held).await;
                Err(rejection)
            }
        }
    }

    /// Stores a leased route's response, trying again while the database refuses it for now,
    /// and answers `response` only once it is stored. The client waits for the route's
    /// `store_patience`, then gets `503` while the tries go on, each after extending the call's
    /// lease, for a lease or [`STORE_TRIES`], whichever is longer: no retry runs the handler while
    /// its response is being
    /// stored (retries here find the key in flight, elsewhere its lease).
    async fn store_under_lease(
        &mut self,
        stored: &StoredResponse,
        held: CallLease,
        lease: Duration,
        response: Response,
    ) -> Result<(Outcome, Response), Rejection> {
        let patience = self.shared.config.store_patience;
        let began = Instant::now();
        let mut response = Some(response);
        let mut pause = Duration::from_millis(50);
        loop {
            let tried = tokio::time::timeout(patience, self.complete(stored, held.clone())).await;
            match tried {
                Ok(Ok(())) => {
                    // If the client was answered 503 before, its retry gets the replay.
                    let response = response.unwrap_or_else(|| Response::new(Body::empty()));
                    return Ok((Outcome::Processed, response));
                }
                Ok(Err(error)) if !error.is_retryable() => {
                    tracing::error!(
                        %error,
                        "the response cannot be stored; the key stays pending until its lease runs out"
                    );
                    return Err(Rejection::Inbox(error));
                }
                Ok(Err(error)) => tracing::warn!(%error, "the response could not be stored yet"),
                Err(_) => tracing::warn!(?patience, "storing the response took too long"),
            }
            if response.is_some() && began.elapsed() >= patience {
                // The handler's response goes nowhere: the client gets it from the replay.
                response = None;
                let pending = Rejection::StorePending {
                    retry_after: Duration::from_secs(1),
                };
                let pending = reject(&self.shared.config, pending);
                self.answer(pending);
            }
            if began.elapsed() >= lease.max(STORE_TRIES) {
                tracing::error!(
                    "the response could not be stored in time; the key stays pending until its \
                     lease runs out, and a retry after that runs the handler again"
                );
                return Err(Rejection::StorePending {
                    retry_after: Duration::from_secs(1),
                });
            }
            let extended = tokio::time::timeout(patience, self.inbox().extend_call(&held, lease));
            match extended.await {
                Ok(Ok(true)) => {}
                Ok(Ok(false)) => {
                    tracing::error!(
                        "the call's lease ran out and another attempt holds it; this response is \
                         not stored"
                    );
                    return Err(Rejection::StorePending {
                        retry_after: Duration::from_secs(1),
                    });
                }
                Ok(Err(error)) => tracing::warn!(%error, "the call's lease could not be extended"),
                Err(_) => tracing::warn!("extending the call's lease took too long"),
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(1));
        }
    }

    /// Stores a leased route's response with the key and deletes the pending call, in one
    /// transaction.
    async fn complete(&self, stored: &StoredResponse, lease: CallLease) -> Result<(), InboxError> {
        let options = ClaimOptions {
            fingerprint: Some(&self.fingerprint),
            ..ClaimOptions::default()
        };
        let claim = self
            .inbox()
            .claim_with(self.consumer(), &self.key, options)
            .await;
        let mut claimed = match claim {
            Ok(Claim::New(claimed)) => claimed,
            // A later attempt (after this one's lease ran out) stored its response first.
            Ok(Claim::Duplicate { .. }) | Err(InboxError::FingerprintMismatch { .. }) => {
                tracing::warn!("another attempt stored its response first");
                self.release(lease).await;
                return Ok(());
            }
            Err(error) => return Err(error),
        };
        claimed.store_response(&stored.encode()).await?;
        let released = self.inbox().release_call_in(&mut claimed, &lease).await?;
        claimed.commit().await?;
        if !released {
            tracing::warn!(
                fence = lease.fence(),
                "the lease had run out and was taken over; this attempt's response is stored"
            );
        }
        Ok(())
    }

    /// Gives the pending call up, so that a retry runs at once.
    async fn release(&self, lease: CallLease) {
        if let Err(error) = self.inbox().release_call(lease).await {
            tracing::warn!(%error, "the pending call could not be released; it runs out with its lease");
        }
    }

    /// Reads the body as far as the route stores it: what is stored, and the body to send. Marks
    /// the head (and what is stored of it) with the key's expiry.
    async fn read_body(
        &self,
        head: &mut response::Parts,
        body: Body,
    ) -> Result<(StoredResponse, Body), Rejection> {
        let config = &self.shared.config;
        let (stored_body, body) = match buffer(body, config.max_stored_body).await {
            Buffered::Whole(bytes) => (Some(bytes.clone()), Body::from(bytes)),
            Buffered::Longer(body) => {
                tracing::debug!(
                    limit = config.max_stored_body,
                    "the response body is too long to store; its replays have none"
                );
                (None, body)
            }
            Buffered::Failed(error) => return Err(Rejection::ResponseBody(error)),
        };
        let mut stored = StoredResponse::new(head, &config.stored_headers, stored_body);
        if let Some(expires) = &self.expires {
            head.headers.insert(KEY_EXPIRES, expires.clone());
            stored.headers.retain(|(name, _)| name != KEY_EXPIRES);
            stored.headers.push((KEY_EXPIRES, expires.clone()));
        }
        Ok((stored, body))
    }

    /// The replay of the key's stored response, if it has one: `KeyReused` when it was stored
    /// for a request with another fingerprint. Reads on the transaction that found the key
    /// committed, if given.
    async fn replay(
        &self,
        committed: Option<KeyCommitted<DB>>,
    ) -> Result<Option<Response>, Rejection> {
        let inbox = self.inbox();
        let read = match committed {
            Some(committed) => committed.stored_response(&self.fingerprint).await,
            None => {
                inbox
                    .stored_response(self.consumer(), &self.key, &self.fingerprint)
                    .await
            }
        };
        let response = match read {
            Ok(Some(response)) => response,
            Ok(None) => return Ok(None),
            Err(InboxError::FingerprintMismatch { .. }) => return Err(Rejection::KeyReused),
            Err(error) => return Err(Rejection::Inbox(error)),
        };
        let response = response.ok_or(Rejection::Stored(super::stored::StoredError::Missing))?;
        let stored = StoredResponse::decode(&response).map_err(Rejection::Stored)?;
        inbox
            .metrics
            .message(self.consumer(), crate::metrics::Outcome::Duplicate, 1);
        Ok(Some(stored.into_replay()))
    }
}

/// `at` as an HTTP-date header value; `None` outside what the format holds (before 1970, after
/// 9999: a retention of centuries).
fn http_date(at: SystemTime) -> Option<HeaderValue> {
    const YEAR_10000: Duration = Duration::from_secs(253_402_300_800);
    let since_epoch = at.duration_since(SystemTime::UNIX_EPOCH).ok()?;
    if since_epoch >= YEAR_10000 {
        return None;
    }
    HeaderValue::from_str(&httpdate::fmt_http_date(at)).ok()
}

/// The layer's own answer, logged when the server is at fault.
fn reject(config: &Config, rejection: Rejection) -> Response {
    if rejection.status().is_server_error() {
        let mut causes = String::new();
        let mut source = std::error::Error::source(&rejection);
        while let Some(cause) = source {
            causes.push_str(": ");
            causes.push_str(&cause.to_string());
            source = cause.source();
        }
        tracing::warn!(status = %rejection.status(), "{rejection}{causes}");
    }
    rejection.into_problem(config.documentation.as_ref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expiry_dates_out_of_the_format_are_left_out_not_a_panic() {
        let day = SystemTime::UNIX_EPOCH + Duration::from_secs(86_400);
        assert_eq!(http_date(day).unwrap(), "Fri, 02 Jan 1970 00:00:00 GMT");
        let far = SystemTime::UNIX_EPOCH + Duration::from_secs(253_402_300_800);
        assert!(http_date(far).is_none());
        let huge = SystemTime::now().checked_add(Duration::from_secs(u64::MAX / 4));
        assert!(huge.and_then(http_date).is_none());
    }
}
