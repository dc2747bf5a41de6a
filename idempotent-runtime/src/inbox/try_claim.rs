//! The HTTP layer's claim: the inbox's claim, except that it never waits for a concurrent claim
//! of the same key (see [`try_claim`](crate::store::try_claim) for how each database does it), and
//! what it found.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::claim::{duplicate_response, read_duplicate};
use super::{Claimed, Config, Inbox, commit};
use crate::error::{InboxError, Stage};
use crate::key::MessageKey;
use crate::metrics::Metrics;
use crate::session::Session;
use crate::store::try_claim::{Attempt, HttpBackend};
use crate::store::{Statements, StoredRow, database_error};
use crate::transaction::{BeginError, ClaimStatement, InboxTransaction};

/// What a claim that does not wait found.
pub(crate) enum TryClaimed<DB: HttpBackend> {
    /// The key is ours, in this open transaction.
    New(Claimed<DB>),
    /// The key was committed before.
    Committed(KeyCommitted<DB>),
    /// Another transaction is claiming the key and has not ended.
    InFlight,
    /// A leased route's request holds the key: its pending call has this much of its lease left.
    CallPending(Duration),
}

/// The transaction of a claim that found its key committed, still open (on PostgreSQL it holds
/// the key's lock).
pub(crate) struct KeyCommitted<DB: HttpBackend> {
    tx: InboxTransaction<DB>,
    config: Arc<Config<DB>>,
    metrics: Arc<Metrics>,
    consumer: Box<str>,
    key: MessageKey,
    /// The key's row, when the claim read it.
    row: Option<StoredRow>,
}

impl<DB: HttpBackend> KeyCommitted<DB> {
    /// Rolls the transaction back and checks the key's row against `fingerprint` (see
    /// [`Inbox::stored_response`]): the row the claim read, or else the row read now on the
    /// transaction's connection.
    pub(crate) async fn stored_response(
        self,
        fingerprint: &[u8],
    ) -> Result<Option<Option<Vec<u8>>>, InboxError> {
        let mut session = self
            .tx
            .rollback()
            .await
            .map_err(database_error(Stage::Claim))?;
        if let Some(row) = self.row {
            let (metrics, consumer) = (&self.metrics, &self.consumer);
            return duplicate_response(row, metrics, consumer, &self.key, Some(fingerprint))
                .map(Some);
        }
        read_duplicate(
            &mut session,
            &self.config.statements,
            &self.metrics,
            &self.consumer,
            &self.key,
            Some(fingerprint),
        )
        .await
    }

    /// Stores `response` on the key's row if it has none, or has `tried`, and commits; `true`
    /// when it did.
    pub(crate) async fn fill_response(
        mut self,
        response: &[u8],
        tried: &[u8],
    ) -> Result<bool, InboxError> {
        let filled = DB::fill_response(
            self.tx.connection(),
            &self.config.statements.inbox,
            &self.consumer,
            self.key.as_bytes(),
            response,
            tried,
        )
        .await;
        let filled = match filled {
            Ok(filled) => filled,
            Err(error) => {
                let _ = self.tx.rollback().await;
                return Err(database_error(Stage::StoreResponse)(error));
            }
        };
        commit(self.tx, None).await?;
        Ok(filled)
    }
}

/// The HTTP layer's claim, made in the open transaction.
struct TryInsertKey<'a> {
    statements: &'a Statements,
    consumer: &'a str,
    key: &'a [u8],
    fingerprint: &'a [u8],
    call: &'a str,
}

impl<DB: HttpBackend> ClaimStatement<DB> for TryInsertKey<'_> {
    type Found = Attempt;

    fn with_begin(&self) -> Option<String> {
        DB::begin_claim(self.statements, self.consumer, self.key)
    }

    fn run<'c>(
        &'c self,
        conn: &'c mut DB::Connection,
    ) -> impl Future<Output = Result<Attempt, sqlx::Error>> + Send + 'c {
        DB::try_insert_key(
            conn,
            self.statements,
            self.consumer,
            self.key,
            self.fingerprint,
            self.call,
        )
    }
}

impl<DB: HttpBackend> Inbox<DB> {
    /// Begins a transaction and claims `key` for `consumer` in it, storing `fingerprint` with it,
    /// without waiting for a concurrent claim of the key: a claim in flight, or a pending call
    /// named `call` with a live lease (a leased route's request), is reported instead.
    pub(crate) async fn try_claim(
        &self,
        consumer: &str,
        key: &MessageKey,
        fingerprint: &[u8],
        call: &str,
    ) -> Result<TryClaimed<DB>, InboxError> {
        let claim = TryInsertKey {
            statements: &self.config.statements,
            consumer,
            key: key.as_bytes(),
            fingerprint,
            call,
        };
        let (tx, attempt) = InboxTransaction::begin_claiming(self.resources(), &claim)
            .await
            .map_err(|error| match error {
                BeginError::Acquire(error) | BeginError::Begin(error) => {
                    database_error(Stage::Begin)(error)
                }
            })?;
        Ok(match attempt {
            Ok(Attempt::Claimed) => TryClaimed::New(Claimed::new(tx, consumer, key.clone(), self)),
            Ok(Attempt::Committed(row)) => TryClaimed::Committed(KeyCommitted {
                tx,
                config: self.config.clone(),
                metrics: self.metrics.clone(),
                consumer: consumer.into(),
                key: key.clone(),
                row,
            }),
            Ok(Attempt::InFlight) => {
                let _ = tx.rollback().await;
                TryClaimed::InFlight
            }
            Ok(Attempt::CallPending(left)) => {
                // The key inserted here rolls back.
                let _ = tx.rollback().await;
                TryClaimed::CallPending(left)
            }
            Err(error) => {
                let _ = tx.rollback().await;
                return Err(database_error(Stage::Claim)(error));
            }
        })
    }

    /// Reads the committed row of `key`, checking it against `fingerprint`: `None` when there is
    /// none; else the response stored with it, if any; [`InboxError::FingerprintMismatch`] when
    /// it was stored with another fingerprint.
    pub(crate) async fn stored_response(
        &self,
        consumer: &str,
        key: &MessageKey,
        fingerprint: &[u8],
    ) -> Result<Option<Option<Vec<u8>>>, InboxError> {
        let mut session = Session::take(self.source())
            .await
            .map_err(database_error(Stage::Inspect))?;
        read_duplicate(
            &mut session,
            &self.config.statements,
            &self.metrics,
            consumer,
            key,
            Some(fingerprint),
        )
        .await
    }
}
