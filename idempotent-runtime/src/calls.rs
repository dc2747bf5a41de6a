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
//! ```
//!
//! Every step is one statement in its own transaction; the lease and the clock are the
//! database's, so instances with skewed clocks agree.

use std::future::Future;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{Error, InboxError, Stage};
use crate::inbox::{Inbox, check_consumer, decode_response};
use crate::key::{IdempotencyKey, MessageKey};
use crate::store::{Backend, CallId};

/// This attempt's hold on a call: run the call, then [`complete_call`](Inbox::complete_call).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallLease {
    consumer: String,
    key: MessageKey,
    name: String,
    fence: i64,
}

impl CallLease {
    /// The fencing token: 1 for the first attempt, one more for each takeover.
    pub fn fence(&self) -> i64 {
        self.fence
    }

    /// The idempotency key to send with the call, so that the other side can deduplicate too; the
    /// same for every attempt of this call.
    pub fn idempotency_key(&self) -> IdempotencyKey {
        IdempotencyKey::new(&format!("{}/{}", self.consumer, self.name), &self.key)
    }

    fn id(&self) -> CallId<'_> {
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

fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
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
        check_consumer(consumer)?;
        check_consumer(name).map_err(|_| InboxError::ConsumerName {
            name: name.to_owned(),
            reason: "a call name must be 1 to 200 bytes long",
        })?;
        let error = InboxError::database(Stage::Call);
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
        if DB::call_insert(&self.pool, &self.statements, id, lease_ms)
            .await
            .map_err(error)?
        {
            tracing::debug!(consumer, call = name, key = %key.digest(), "call pending");
            return Ok(run(1));
        }
        let Some((fence, lease_until, completed, result, now)) =
            DB::call_read(&self.pool, &self.statements, id)
                .await
                .map_err(InboxError::database(Stage::Call))?
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
            self.metrics.call_in_progress(1);
            let retry_after = Duration::from_millis((lease_until - now) as u64);
            tracing::debug!(
                consumer,
                call = name,
                ?retry_after,
                "call in progress elsewhere"
            );
            return Err(InboxError::CallInProgress { retry_after });
        }
        if DB::call_take_over(&self.pool, &self.statements, id, fence, lease_ms)
            .await
            .map_err(InboxError::database(Stage::Call))?
        {
            tracing::info!(
                consumer,
                call = name,
                fence = fence + 1,
                "took over an expired call"
            );
            return Ok(run(fence + 1));
        }
        // Another attempt took it over first.
        self.metrics.call_in_progress(1);
        Err(InboxError::CallInProgress { retry_after: lease })
    }

    /// Marks the call completed with `result`, if `lease` still holds it; [`InboxError::Fenced`]
    /// when a later attempt took it over (its result stands).
    pub async fn complete_call<R: Serialize>(
        &self,
        lease: CallLease,
        result: &R,
    ) -> Result<(), InboxError> {
        let bytes = serde_json::to_vec(result).map_err(|error| InboxError::Response {
            source: error.into(),
        })?;
        let completed = DB::call_complete(
            &self.pool,
            &self.statements,
            lease.id(),
            lease.fence,
            &bytes,
        )
        .await
        .map_err(InboxError::database(Stage::Call))?;
        if completed {
            tracing::debug!(
                consumer = lease.consumer,
                call = lease.name,
                "call completed"
            );
            Ok(())
        } else {
            self.metrics.call_fenced(1);
            tracing::warn!(
                consumer = lease.consumer,
                call = lease.name,
                fence = lease.fence,
                "late attempt fenced off"
            );
            Err(InboxError::Fenced { fence: lease.fence })
        }
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
