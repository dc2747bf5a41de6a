//! Calls to outside services, which cannot join the handler's transaction: a `pending → completed`
//! record with a lease, so that a call happens at most once per message, and a fencing token, so
//! that an attempt whose lease ran out cannot overwrite the result of the one that took over.
//!
//! ```text
//! begin_call ── inserted ──────────────────────────────► Run(lease, fence 1)
//!      │ └─ found completed ───────────────────────────► Completed(stored result)
//!      │ └─ found pending, lease live ─────────────────► Err(CallInProgress { retry_after })
//!      └─── found pending, lease expired: fence += 1 ──► Run(lease, fence n+1)
//! complete_call(lease, result) ── fence still ours ────► completed, result stored
//!                              └─ taken over since ────► Err(Fenced)
//! release_call(lease) ────────── fence still ours ────► record deleted: the next attempt runs
//! ```
//!
//! Every step is one statement in its own transaction; the lease and the clock are the
//! database's, so instances with skewed clocks agree.

use std::future::Future;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::clock::millis;
use crate::error::{Error, InboxError, Stage};
use crate::inbox::{Inbox, check_consumer, check_name, decode_response};
use crate::key::{IdempotencyKey, MessageKey};
use crate::metrics::CallOutcome;
use crate::session::Session;
use crate::store::CallGate;
use crate::store::{Backend, CallId, CallRow, database_error, in_own_transaction};
use sqlx_core::transaction::TransactionManager;

/// The longest lease a call may ask for: a lease is how long other attempts wait for this one
/// before they take the call over, and one longer than this is a mistake (a `Duration::MAX` would
/// not fit the database's clock arithmetic).
pub const MAX_CALL_LEASE: Duration = Duration::from_secs(365 * 24 * 60 * 60);

/// The call's record, read on `session`.
async fn read_call<DB: Backend>(
    session: &mut Session<DB>,
    statements: &crate::store::Statements,
    id: CallId<'_>,
) -> Result<Option<CallRow>, InboxError> {
    let row = session
        .try_step(|conn| DB::call_read(conn, &statements.calls, id))
        .await
        .map_err(database_error(Stage::Call))?;
    Ok(row)
}

/// This attempt's hold on a call: run the call, then [`complete_call`](Inbox::complete_call).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallLease {
    consumer: String,
    key: MessageKey,
    name: String,
    fence: i64,
}

impl CallLease {
    /// Returns the fencing token: 1 for the first attempt, one more for each takeover.
    pub fn fence(&self) -> i64 {
        self.fence
    }

    /// Returns the idempotency key to send with the call, so that the other side can deduplicate
    /// too; the same for every attempt of this call.
    pub fn idempotency_key(&self) -> IdempotencyKey {
        IdempotencyKey::new(&format!("{}/{}", self.consumer, self.name), &self.key)
    }

    pub(crate) fn id(&self) -> CallId<'_> {
        CallId {
            consumer: &self.consumer,
            key: self.key.as_bytes(),
            name: &self.name,
        }
    }
}

/// How [`begin_call`](Inbox::begin_call) went.
#[derive(Debug)]
pub enum CallStart<R> {
    /// Make the call now; no other attempt holds it.
    Run(CallLease),
    /// The call was completed before; here is its result. Do not call again.
    Completed(R),
}

/// Whether a gated step passed its gate.
pub(crate) enum Gated<T> {
    /// It took the lock; here is what the step did.
    Passed(T),
    /// Another transaction holds the lock; nothing was done.
    Shut,
}

/// Checks a call's name and lease before any database work.
fn check_call(name: &str, lease: Duration) -> Result<(), InboxError> {
    check_name(name).map_err(|reason| InboxError::CallName {
        name: name.to_owned(),
        reason,
    })?;
    let reason = if lease.is_zero() {
        "it is zero"
    } else if lease > MAX_CALL_LEASE {
        "it is longer than a year (MAX_CALL_LEASE)"
    } else {
        return Ok(());
    };
    Err(InboxError::Lease { lease, reason })
}

impl<DB: Backend> Inbox<DB> {
    /// Records the call `name` of `consumer`'s message `key` as pending with a lease of `lease`, in
    /// its own transaction. See the [module docs](crate::calls) for the outcomes.
    pub async fn begin_call<R: DeserializeOwned>(
        &self,
        consumer: &str,
        key: &MessageKey,
        name: &str,
        lease: Duration,
    ) -> Result<CallStart<R>, InboxError> {
        match self
            .begin_call_gated(consumer, key, name, lease, None)
            .await?
        {
            Gated::Passed(start) => Ok(start),
            // Without a gate there is nothing to be shut out by.
            Gated::Shut => Err(InboxError::CallInProgress {
                retry_after: Duration::ZERO,
            }),
        }
    }

    /// [`begin_call`](Self::begin_call), whose steps run in one transaction that first takes
    /// `gate`'s lock, when there is a gate: `Shut` when another transaction holds the lock (the HTTP
    /// layer's transactional claim of the same key, on PostgreSQL), and nothing was recorded.
    pub(crate) async fn begin_call_gated<R: DeserializeOwned>(
        &self,
        consumer: &str,
        key: &MessageKey,
        name: &str,
        lease: Duration,
        gate: Option<CallGate<'_, DB>>,
    ) -> Result<Gated<CallStart<R>>, InboxError> {
        check_consumer(consumer)?;
        check_call(name, lease)?;
        let mut session = self.call_session().await?;
        let Some(gate) = gate else {
            let start = session
                .try_step(|conn| self.record_call(conn, consumer, key, name, lease))
                .await?;
            return Ok(Gated::Passed(start));
        };
        let failed = database_error(Stage::Call);
        // On an error the step stays in doubt, and the connection is closed with the session.
        let outcome = session
            .try_step(|conn| async move {
                <DB as sqlx::Database>::TransactionManager::begin(conn, None)
                    .await
                    .map_err(database_error(Stage::Call))?;
                let outcome = match gate(conn).await {
                    Ok(true) => Some(self.record_call(conn, consumer, key, name, lease).await),
                    Ok(false) => None,
                    Err(error) => Some(Err(failed(error))),
                };
                let ended = match &outcome {
                    Some(Ok(_)) => <DB as sqlx::Database>::TransactionManager::commit(conn).await,
                    _ => <DB as sqlx::Database>::TransactionManager::rollback(conn).await,
                };
                ended.map_err(database_error(Stage::Call))?;
                Ok::<_, InboxError>(outcome)
            })
            .await?;
        Ok(match outcome {
            None => Gated::Shut,
            Some(outcome) => Gated::Passed(outcome?),
        })
    }

    /// The steps of [`begin_call`](Self::begin_call) on `conn`.
    async fn record_call<R: DeserializeOwned>(
        &self,
        conn: &mut DB::Connection,
        consumer: &str,
        key: &MessageKey,
        name: &str,
        lease: Duration,
    ) -> Result<CallStart<R>, InboxError> {
        let statements = &self.config.statements;
        let id = CallId {
            consumer,
            key: key.as_bytes(),
            name,
        };
        let lease_ms = millis(lease);
        let run = |fence| {
            CallStart::Run(CallLease {
                consumer: consumer.to_owned(),
                key: key.clone(),
                name: name.to_owned(),
                fence,
            })
        };
        let inserted = DB::call_insert(&mut *conn, &statements.calls, id, lease_ms)
            .await
            .map_err(database_error(Stage::Call))?;
        if inserted {
            tracing::debug!(consumer, call = name, key = %key.digest(), "call pending");
            return Ok(run(1));
        }
        let row = DB::call_read(&mut *conn, &statements.calls, id)
            .await
            .map_err(database_error(Stage::Call))?;
        let Some(CallRow {
            fence,
            lease_until,
            completed,
            result,
            now_ms: now,
        }) = row
        else {
            // Deleted between the two statements: as good as in progress; try again.
            return Err(InboxError::CallInProgress {
                retry_after: Duration::ZERO,
            });
        };
        if completed {
            let result = result.unwrap_or_default();
            return Ok(CallStart::Completed(decode_response(&result)?));
        }
        if lease_until > now {
            self.metrics.call(consumer, CallOutcome::InProgress);
            let retry_after = Duration::from_millis((lease_until - now) as u64);
            tracing::debug!(
                consumer,
                call = name,
                ?retry_after,
                "call in progress elsewhere"
            );
            return Err(InboxError::CallInProgress { retry_after });
        }
        let taken = DB::call_take_over(&mut *conn, &statements.calls, id, fence, lease_ms)
            .await
            .map_err(database_error(Stage::Call))?;
        if taken {
            tracing::info!(
                consumer,
                call = name,
                fence = fence + 1,
                "took over an expired call"
            );
            return Ok(run(fence + 1));
        }
        // Another attempt took it over first.
        self.metrics.call(consumer, CallOutcome::InProgress);
        Err(InboxError::CallInProgress { retry_after: lease })
    }

    /// The rest of the lease of the call `name` of `consumer`'s message `key`, if it is pending
    /// with a live lease: a read, which waits for no writer.
    #[cfg(feature = "http")]
    pub(crate) async fn call_lease_left(
        &self,
        consumer: &str,
        key: &MessageKey,
        name: &str,
    ) -> Result<Option<Duration>, InboxError> {
        let mut session = self.call_session().await?;
        let id = CallId {
            consumer,
            key: key.as_bytes(),
            name,
        };
        let row = read_call(&mut session, &self.config.statements, id).await?;
        Ok(match row {
            Some(CallRow {
                lease_until,
                completed: false,
                now_ms,
                ..
            }) if lease_until > now_ms => {
                Some(Duration::from_millis((lease_until - now_ms) as u64))
            }
            _ => None,
        })
    }

    /// Moves the end of `lease`'s pending call to `lease` from now, if it still holds the call:
    /// `false` when it was taken over, completed or released since.
    #[cfg(feature = "http")]
    pub(crate) async fn extend_call(
        &self,
        held: &CallLease,
        lease: Duration,
    ) -> Result<bool, InboxError> {
        let mut session = self.call_session().await?;
        let extended = session
            .try_step(|conn| {
                DB::call_extend(
                    conn,
                    &self.config.statements.calls,
                    held.id(),
                    held.fence,
                    millis(lease),
                )
            })
            .await
            .map_err(database_error(Stage::Call))?;
        Ok(extended)
    }

    /// Marks the call completed with `result`, if `lease` still holds it; [`InboxError::Fenced`]
    /// when a later attempt took it over (its result stands). Completing again with the same lease
    /// and the same result is a success (a retry after a lost answer); with another result it is
    /// [`InboxError::CallCompleted`] (the first result stands).
    pub async fn complete_call<R: Serialize>(
        &self,
        lease: CallLease,
        result: &R,
    ) -> Result<(), InboxError> {
        let bytes = serde_json::to_vec(result).map_err(|error| InboxError::Response {
            source: error.into(),
        })?;
        let statements = &self.config.statements;
        let mut session = self.call_session().await?;
        let completed = session
            .try_step(|conn| {
                DB::call_complete(conn, &statements.calls, lease.id(), lease.fence, &bytes)
            })
            .await
            .map_err(database_error(Stage::Call))?;
        if completed {
            tracing::debug!(
                consumer = lease.consumer,
                call = lease.name,
                "call completed"
            );
            return Ok(());
        }
        if let Some(CallRow {
            fence,
            completed: true,
            result: stored,
            ..
        }) = read_call(&mut session, statements, lease.id()).await?
            && fence == lease.fence
        {
            if stored.as_deref() == Some(&bytes[..]) {
                return Ok(());
            }
            return Err(InboxError::CallCompleted { fence });
        }
        self.metrics.call(&lease.consumer, CallOutcome::Fenced);
        tracing::warn!(
            consumer = lease.consumer,
            call = lease.name,
            fence = lease.fence,
            "late attempt fenced off"
        );
        Err(InboxError::Fenced { fence: lease.fence })
    }

    /// [`begin_call`](Self::begin_call), gated by the HTTP layer's claim of the key: on PostgreSQL
    /// the call is recorded under the key's advisory lock, which a transactional route's claim of
    /// the key holds until it ends, so that neither runs while the other is in flight
    /// ([`Gated::Shut`] when the claim holds it).
    #[cfg(feature = "http")]
    pub(crate) async fn begin_call_gated_by_claims<R: DeserializeOwned>(
        &self,
        consumer: &str,
        key: &MessageKey,
        name: &str,
        lease: Duration,
    ) -> Result<Gated<CallStart<R>>, InboxError>
    where
        DB: crate::store::try_claim::HttpBackend,
    {
        let gate = DB::call_gate(&self.config.statements, consumer, key.as_bytes());
        self.begin_call_gated(consumer, key, name, lease, gate)
            .await
    }

    /// Deletes `lease`'s pending call in `claimed`'s transaction, if its fence is still the
    /// lease's: `true` when it did (the HTTP layer stores a leased route's response and ends its
    /// call in one transaction).
    #[cfg(feature = "http")]
    pub(crate) async fn release_call_in(
        &self,
        claimed: &mut crate::inbox::Claimed<DB>,
        lease: &CallLease,
    ) -> Result<bool, InboxError> {
        DB::call_release(
            claimed.connection(),
            &self.config.statements.calls,
            lease.id(),
            lease.fence,
        )
        .await
        .map_err(database_error(Stage::Call))
    }

    /// Gives up a pending call whose outcome this attempt does not want recorded (it failed before
    /// it called out, or its result is not worth keeping): deletes the record if `lease` still
    /// holds it, so that the next attempt runs at once instead of waiting for the lease to run
    /// out. `false` when a later attempt took the call over (its record stays) or it was completed.
    ///
    /// The next attempt starts a new record, whose fence is 1 again: an attempt that released its
    /// call must not complete it afterwards (with a clone of its lease), or it would complete the
    /// next attempt's record.
    pub async fn release_call(&self, lease: CallLease) -> Result<bool, InboxError> {
        let mut session = self.call_session().await?;
        let statements = &self.config.statements;
        let id = lease.id();
        // `call_release` also runs in a handler's transaction (the HTTP layer's): in a transaction
        // of its own only here.
        let released = session
            .try_step(|conn| async move {
                in_own_transaction!(
                    conn,
                    &statements.calls,
                    DB::call_release(&mut *conn, &statements.calls, id, lease.fence)
                )
            })
            .await
            .map_err(database_error(Stage::Call))?;
        tracing::debug!(
            consumer = lease.consumer,
            call = lease.name,
            released,
            "call released"
        );
        Ok(released)
    }

    /// A connection for the steps of a call, each in a transaction of its own.
    async fn call_session(&self) -> Result<Session<DB>, InboxError> {
        Session::take(self.source())
            .await
            .map_err(database_error(Stage::Call))
    }

    /// Makes `call` at most once for this message, and returns its result: the stored one when it
    /// was completed before. While another attempt holds the lease this is
    /// [`InboxError::CallInProgress`] (retryable); after a crash the call may be made again once
    /// the lease runs out, so make it idempotent on the other side with the lease's
    /// [`idempotency_key`](CallLease::idempotency_key). When `call` fails, the record stays pending
    /// until the lease runs out.
    pub async fn call_once<R, E, F, Fut>(
        &self,
        consumer: &str,
        key: &MessageKey,
        name: &str,
        lease: Duration,
        call: F,
    ) -> Result<R, Error<E>>
    where
        R: Serialize + DeserializeOwned,
        F: FnOnce(CallLease) -> Fut,
        Fut: Future<Output = Result<R, E>>,
    {
        match self.begin_call(consumer, key, name, lease).await? {
            CallStart::Completed(result) => Ok(result),
            CallStart::Run(lease) => {
                let result = call(lease.clone()).await.map_err(Error::Handler)?;
                self.complete_call(lease, &result).await?;
                Ok(result)
            }
        }
    }
}
