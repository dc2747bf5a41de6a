//! The claim that begins a handler's transaction, and what it found.

use std::time::SystemTime;

use super::{Claimed, Inbox, check_consumer};
use crate::error::{InboxError, Stage};
use crate::key::{AsMessageKey, MessageKey};
use crate::metrics::{Metrics, Outcome};
use crate::retention;
use crate::session::Session;
use crate::store::{Backend, Statements, StoredRow, database_error};
use crate::transaction::{BeginError, ClaimOutcome, InboxTransaction};

/// What a claim checks besides the key: see [`Inbox::claim_with`].
#[derive(Debug, Clone, Copy, Default)]
pub struct ClaimOptions<'a> {
    /// The message's payload fingerprint: stored with the claim; a duplicate whose stored
    /// fingerprint differs is an [`InboxError::FingerprintMismatch`].
    pub fingerprint: Option<&'a [u8]>,
    /// Read the stored response of a duplicate.
    pub read_response: bool,
    /// When the message was sent, if it says (a key that is a UUIDv7 says it without this): a new
    /// key of a message sent before its consumer's purge horizon is refused with
    /// [`InboxError::OlderThanHorizon`]. See [`Retention`](crate::Retention) for the horizon.
    pub sent_at: Option<SystemTime>,
}

/// What a claim found.
pub enum Claim<DB: Backend> {
    /// The key is ours: run the handler's work in this transaction.
    New(Claimed<DB>),
    /// The key was processed before.
    Duplicate {
        /// The response stored by the first call, when asked for and stored.
        response: Option<Vec<u8>>,
    },
}

impl<DB: Backend> Inbox<DB> {
    /// Begins a transaction and claims `key` for `consumer` in it: `Some` with the open transaction
    /// when this call claimed the key, `None` when the key was already processed (the transaction is
    /// rolled back). Waits while another transaction holds an uncommitted claim on the same key.
    /// `key` is a [`MessageKey`] or any [`StableKey`](crate::StableKey) value.
    ///
    /// This is what `#[idempotent]` calls; use it directly to make a handler idempotent by hand.
    /// Dropping the returned [`Claimed`] without committing rolls everything back.
    pub async fn claim<K: AsMessageKey + ?Sized>(
        &self,
        consumer: &str,
        key: &K,
    ) -> Result<Option<Claimed<DB>>, InboxError> {
        match self
            .claim_with(consumer, key, ClaimOptions::default())
            .await?
        {
            Claim::New(claimed) => Ok(Some(claimed)),
            Claim::Duplicate { .. } => Ok(None),
        }
    }

    /// [`claim`](Self::claim), checking a payload fingerprint and reading a stored response.
    pub async fn claim_with<K: AsMessageKey + ?Sized>(
        &self,
        consumer: &str,
        key: &K,
        options: ClaimOptions<'_>,
    ) -> Result<Claim<DB>, InboxError> {
        check_consumer(consumer)?;
        let key = key.as_message_key()?;
        let span = tracing::Span::current();
        if !span.is_disabled() {
            span.record("key", tracing::field::display(key.digest()));
        }
        let (claimed, waited) = InboxTransaction::begin_claim(
            self.resources(),
            &self.config.statements,
            &self.config.settings,
            consumer,
            key.as_bytes(),
            options.fingerprint,
        )
        .await
        .map_err(|error| match error {
            BeginError::Acquire(error) => database_error(Stage::Begin)(error),
            BeginError::Begin(error) => database_error(Stage::Claim)(error),
        })?;
        let claimed_new = matches!(claimed, ClaimOutcome::Claimed(_));
        self.metrics.claim_waited(consumer, claimed_new, waited);
        let mut session = match claimed {
            ClaimOutcome::Claimed(mut tx) => {
                if let Some(sent_at) = options.sent_at.or_else(|| key.sent_at()) {
                    let margin = self.config.retention.skew_margin;
                    let checked = retention::check_horizon::<DB>(
                        tx.connection(),
                        &self.config.statements,
                        consumer,
                        &key,
                        sent_at,
                        margin,
                    )
                    .await;
                    if let Err(error) = checked {
                        let _ = tx.rollback().await;
                        if matches!(error, InboxError::OlderThanHorizon { .. }) {
                            self.metrics.message(consumer, Outcome::OlderThanHorizon, 1);
                            tracing::warn!(consumer, key = %key.digest(), "message older than the purge horizon: refused");
                        }
                        return Err(error);
                    }
                }
                tracing::debug!(consumer, key = %key.digest(), "claimed message key");
                #[cfg(feature = "testing")]
                if self.config.injected == Some(super::config::Injected::ConnectionLostAfterClaim)
                    && let Some(end) = DB::DIALECT.end_own_connection
                {
                    // The server ends the connection: what the body sends on it fails.
                    let _ = DB::run(tx.connection(), end).await;
                }
                return Ok(Claim::New(Claimed::new(
                    tx,
                    consumer,
                    key.into_owned(),
                    self,
                )));
            }
            ClaimOutcome::Duplicate(session) => session,
        };
        self.metrics.message(consumer, Outcome::Duplicate, 1);
        tracing::Span::current().record("outcome", "duplicate");
        tracing::info!(consumer, key = %key.digest(), "duplicate message: already processed");
        if options.fingerprint.is_none() && !options.read_response {
            return Ok(Claim::Duplicate { response: None });
        }
        let response = read_duplicate(
            &mut session,
            &self.config.statements,
            &self.metrics,
            consumer,
            &key,
            options.fingerprint,
        )
        .await?
        .flatten();
        Ok(Claim::Duplicate { response })
    }
}

/// Reads the committed row of `key` on `session`, and checks it against `fingerprint`
/// ([`duplicate_response`]): `None` when there is no row.
pub(super) async fn read_duplicate<DB: Backend>(
    session: &mut Session<DB>,
    statements: &Statements,
    metrics: &Metrics,
    consumer: &str,
    key: &MessageKey,
    fingerprint: Option<&[u8]>,
) -> Result<Option<Option<Vec<u8>>>, InboxError> {
    let row = session
        .try_step(|conn| DB::stored(conn, &statements.inbox, consumer, key.as_bytes()))
        .await
        .map_err(database_error(Stage::Inspect))?;
    let Some(row) = row else {
        return Ok(None);
    };
    duplicate_response(row, metrics, consumer, key, fingerprint).map(Some)
}

/// The response stored with a duplicate's `row`, if any, checked against `fingerprint`: the one
/// place a duplicate's fingerprint is compared. A row stored with another fingerprint is counted
/// and logged, and is [`InboxError::FingerprintMismatch`].
pub(super) fn duplicate_response(
    row: StoredRow,
    metrics: &Metrics,
    consumer: &str,
    key: &MessageKey,
    fingerprint: Option<&[u8]>,
) -> Result<Option<Vec<u8>>, InboxError> {
    if let (Some(ours), Some(theirs)) = (fingerprint, row.fingerprint.as_deref())
        && ours != theirs
    {
        metrics.message(consumer, Outcome::FingerprintMismatch, 1);
        tracing::warn!(consumer, key = %key.digest(), "same message key, different payload");
        return Err(InboxError::FingerprintMismatch {
            consumer: consumer.to_owned(),
            key: key.clone(),
        });
    }
    Ok(row.response)
}
