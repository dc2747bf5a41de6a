//! What operators do with an inbox: look at what it holds (one message, a consumer's messages in a
//! time range, page by page, calls stuck in `pending`, counts per consumer), and forget a message on
//! purpose, with an audit row, so that it can be processed again.
//!
//! Reads are single statements outside any handler's transaction. `forget` deletes the row and
//! writes the audit row in one transaction of its own; the audit is kept for the consumer's
//! retention, as its rows are. The message's call records are kept: a call that completed returns
//! its stored result when the message runs again, so that an outside effect (a charge) is not made
//! twice.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::{Duration, SystemTime};

use crate::clock::{LAST_MS, from_ms, to_db_ms, to_ms};
use crate::error::{InboxError, Stage};
use crate::inbox::{Inbox, check_consumer, commit};
use crate::key::{AsMessageKey, MessageKey};
use crate::session::Session;
use crate::store::{
    AuditRow, Backend, InspectRow, ListRow, StuckRow, database_error, in_own_transaction,
};
use crate::transaction::{BeginError, InboxTransaction};

/// The longest reason [`Inbox::forget`] accepts, in bytes.
pub const MAX_REASON_LEN: usize = 1000;

/// One processed message as the inbox holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Record {
    /// The stored key.
    pub key: MessageKey,
    /// When its claim committed (the database's clock, to the millisecond).
    pub processed_at: SystemTime,
    /// Its payload fingerprint, for handlers with `fingerprint`.
    pub fingerprint: Option<Vec<u8>>,
    /// The size in bytes of its stored response, for handlers with `store_response`.
    pub response_len: Option<u64>,
}

/// Where a page of [`Inbox::list`] ends: pass it to the next call's [`Listing::after`]. Its text
/// form (`<milliseconds>:<stored key in hex>`) is what the CLI prints and reads back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    processed_ms: i64,
    key: MessageKey,
}

impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.processed_ms, self.key)
    }
}

impl FromStr for Cursor {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let bad = || format!("{text:?} is not a cursor: expected <milliseconds>:<key in hex>");
        let (ms, key) = text.split_once(':').ok_or_else(bad)?;
        let processed_ms = ms.parse().map_err(|_| bad())?;
        let key = from_hex(key).ok_or_else(bad)?;
        let key = MessageKey::from_stored(key).map_err(|_| bad())?;
        Ok(Self { processed_ms, key })
    }
}

/// Bytes from lowercase or uppercase hex digits.
pub(crate) fn from_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Which of a consumer's messages [`Inbox::list`] returns: those processed in a time range, after
/// a cursor, at most a page of them.
#[derive(Debug, Clone)]
pub struct Listing {
    since: Option<SystemTime>,
    until: Option<SystemTime>,
    after: Option<Cursor>,
    limit: usize,
}

impl Default for Listing {
    fn default() -> Self {
        Self::new()
    }
}

impl Listing {
    /// Creates a listing of every message, 100 per page.
    pub fn new() -> Self {
        Self {
            since: None,
            until: None,
            after: None,
            limit: 100,
        }
    }

    /// Returns the listing narrowed to messages processed at or after `time`.
    pub fn since(self, time: SystemTime) -> Self {
        Self {
            since: Some(time),
            ..self
        }
    }

    /// Returns the listing narrowed to messages processed before `time`.
    pub fn until(self, time: SystemTime) -> Self {
        Self {
            until: Some(time),
            ..self
        }
    }

    /// Returns the listing narrowed to the page after the one `cursor` ended.
    pub fn after(self, cursor: Cursor) -> Self {
        Self {
            after: Some(cursor),
            ..self
        }
    }

    /// Returns the listing with at most `limit` messages per page (at least 1).
    pub fn limit(self, limit: usize) -> Self {
        Self {
            limit: limit.max(1),
            ..self
        }
    }
}

/// One page of [`Inbox::list`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Page {
    /// The messages, oldest first (by processing time, then stored key).
    pub records: Vec<Record>,
    /// Where the next page starts, when this one was full.
    pub next: Option<Cursor>,
}

/// A call to an outside service left `pending` after its lease ran out: its attempt died (or is
/// very slow), and no later attempt took it over yet.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StuckCall {
    /// The message's consumer.
    pub consumer: String,
    /// The message's key.
    pub key: MessageKey,
    /// The call's name.
    pub name: String,
    /// The fencing token of the last attempt.
    pub fence: i64,
    /// When the last attempt's lease ran out.
    pub lease_expired_at: SystemTime,
    /// How long ago that was (the database's clock).
    pub expired_for: Duration,
}

/// A message an operator acted on (forgot on purpose, or put back from a dead-letter queue), as its
/// audit row records it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AuditEntry {
    /// The consumer.
    pub consumer: String,
    /// The SHA-256 of the stored key in hex ([`MessageKey::full_digest`]); its first 12 digits are
    /// the `key` of the handler's `tracing` span.
    pub key_digest: String,
    /// Why it was forgotten, or where it was put back from (`put back from …`).
    pub reason: String,
    /// When the inbox had processed it (a forgotten row always had been).
    pub processed_at: Option<SystemTime>,
    /// When the operator acted.
    pub forgotten_at: SystemTime,
}

/// What the inbox holds for one consumer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerStats {
    /// The consumer.
    pub consumer: String,
    /// Processed messages recorded.
    pub rows: u64,
    /// When the oldest of them was processed.
    pub oldest: Option<SystemTime>,
    /// Its purge horizon: rows processed before it may have been purged.
    pub horizon: Option<SystemTime>,
    /// Calls to outside services pending (not completed).
    pub pending_calls: u64,
    /// Of those, the ones whose lease ran out: see [`Inbox::stuck_calls`].
    pub stuck_calls: u64,
}

/// Checks a reason for forgetting a message before any database work.
fn check_reason(reason: &str) -> Result<(), InboxError> {
    let reason = if reason.trim().is_empty() {
        "it is empty: say why the message must be processed again"
    } else if reason.len() > MAX_REASON_LEN {
        "it is longer than 1000 bytes"
    } else if reason.contains('\0') {
        "it holds a NUL byte"
    } else {
        return Ok(());
    };
    Err(InboxError::Reason { reason })
}

impl<DB: Backend> Inbox<DB> {
    /// A connection for a read outside any handler.
    async fn read_session(&self) -> Result<Session<DB>, InboxError> {
        Session::take(self.source())
            .await
            .map_err(database_error(Stage::Inspect))
    }

    /// Returns the inbox's record of `consumer`'s message `key`, if it was processed (and not
    /// purged or forgotten since).
    pub async fn inspect<K: AsMessageKey + ?Sized>(
        &self,
        consumer: &str,
        key: &K,
    ) -> Result<Option<Record>, InboxError> {
        check_consumer(consumer)?;
        let key = key.as_message_key()?;
        let mut session = self.read_session().await?;
        let statements = &self.config.statements;
        let key_bytes = key.as_bytes();
        // `inspect` also runs in `forget`'s transaction: in a transaction of its own only here.
        let row = session
            .try_step(|conn| async move {
                in_own_transaction!(
                    conn,
                    &statements.inbox,
                    DB::inspect(&mut *conn, &statements.inbox, consumer, key_bytes)
                )
            })
            .await
            .map_err(database_error(Stage::Inspect))?;
        Ok(row.map(|row| Record {
            key: key.into_owned(),
            processed_at: from_ms(row.processed_ms),
            fingerprint: row.fingerprint,
            response_len: row.response.map(|response| response.len() as u64),
        }))
    }

    /// Returns a page of `consumer`'s processed messages, oldest first, as `listing` selects them.
    pub async fn list(&self, consumer: &str, listing: Listing) -> Result<Page, InboxError> {
        check_consumer(consumer)?;
        let range = (
            listing.since.map_or(0, to_db_ms),
            listing.until.map_or(LAST_MS, to_db_ms),
        );
        let (at, key) = match &listing.after {
            Some(cursor) => (cursor.processed_ms, cursor.key.as_bytes()),
            None => (i64::MIN, &[][..]),
        };
        let limit = i64::try_from(listing.limit).unwrap_or(i64::MAX);
        let mut session = self.read_session().await?;
        let rows = session
            .try_step(|conn| {
                DB::list(
                    conn,
                    &self.config.statements.inbox,
                    consumer,
                    range,
                    (at, key),
                    limit,
                )
            })
            .await
            .map_err(database_error(Stage::Inspect))?;
        let full = rows.len() == listing.limit;
        let mut records = Vec::with_capacity(rows.len());
        let mut next = None;
        for ListRow {
            message_key,
            processed_ms,
            fingerprint,
            response_len,
        } in rows
        {
            let key = MessageKey::from_stored(message_key).map_err(InboxError::Key)?;
            next = full.then(|| Cursor {
                processed_ms,
                key: key.clone(),
            });
            records.push(Record {
                key,
                processed_at: from_ms(processed_ms),
                fingerprint,
                response_len: response_len.map(|len| len.max(0) as u64),
            });
        }
        Ok(Page { records, next })
    }

    /// Calls to outside services still `pending` after their lease ran out, longest expired
    /// first, of `consumer` or (with `None`) of every consumer; at most `limit`.
    pub async fn stuck_calls(
        &self,
        consumer: Option<&str>,
        limit: usize,
    ) -> Result<Vec<StuckCall>, InboxError> {
        if let Some(consumer) = consumer {
            check_consumer(consumer)?;
        }
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let mut session = self.read_session().await?;
        let rows = session
            .try_step(|conn| DB::stuck_calls(conn, &self.config.statements.calls, consumer, limit))
            .await
            .map_err(database_error(Stage::Inspect))?;
        rows.into_iter()
            .map(|row| {
                let StuckRow {
                    consumer,
                    message_key,
                    call_name: name,
                    fence,
                    lease_until,
                    now_ms: now,
                } = row;
                Ok(StuckCall {
                    consumer,
                    key: MessageKey::from_stored(message_key)?,
                    name,
                    fence,
                    lease_expired_at: from_ms(lease_until),
                    expired_for: Duration::from_millis(
                        now.saturating_sub(lease_until).max(0) as u64
                    ),
                })
            })
            .collect::<Result<_, crate::key::KeyError>>()
            .map_err(InboxError::Key)
    }

    /// Forgets `consumer`'s message `key` on purpose, so that its next delivery is processed again
    /// (a fix was deployed for a bug in the body): deletes its inbox row and writes an audit row
    /// (when, `reason`, the key's digest, when it had been processed) in the same transaction.
    /// `true` when there was a row to forget; nothing is written otherwise. `reason` is required.
    /// The message's call records are kept (see the [module docs](crate::operations)).
    ///
    /// Only a committed record is forgotten, and `forget` never waits for a handler that holds
    /// the key: a key claimed by a transaction still open (a handler in flight) has no record
    /// yet, and `forget` returns `false` at once, on every backend. (It looks for the record
    /// before it begins its transaction, which on SQLite waits for the database's one writer.)
    pub async fn forget<K: AsMessageKey + ?Sized>(
        &self,
        consumer: &str,
        key: &K,
        reason: &str,
    ) -> Result<bool, InboxError> {
        check_consumer(consumer)?;
        check_reason(reason)?;
        let key = key.as_message_key()?;
        let failed = || database_error(Stage::Forget);
        // A committed record first, read without waiting; it is looked for again below, in the
        // transaction that deletes it.
        if self.inspect(consumer, &*key).await?.is_none() {
            return Ok(false);
        }
        let mut tx =
            InboxTransaction::begin(self.resources())
                .await
                .map_err(|error| match error {
                    BeginError::Acquire(error) | BeginError::Begin(error) => failed()(error),
                })?;
        let statements = &self.config.statements;
        let row = DB::inspect(tx.connection(), &statements.inbox, consumer, key.as_bytes())
            .await
            .map_err(failed())?;
        let Some(InspectRow { processed_ms, .. }) = row else {
            let _ = tx.rollback().await;
            return Ok(false);
        };
        let deleted = DB::forget(tx.connection(), &statements.inbox, consumer, key.as_bytes())
            .await
            .map_err(failed())?;
        if !deleted {
            let _ = tx.rollback().await;
            return Ok(false);
        }
        let digest = key.full_digest();
        DB::audit_insert(
            tx.connection(),
            &statements.audit,
            consumer,
            &digest,
            reason,
            Some(processed_ms),
        )
        .await
        .map_err(failed())?;
        commit(tx, None).await?;
        self.metrics.forgotten(consumer);
        tracing::warn!(consumer, key = %key.digest(), reason, "message forgotten on purpose");
        Ok(true)
    }

    /// Writes an audit row for `consumer`'s message `key` that an operator put back on its queue
    /// from a dead-letter queue (`idempotent dlq redrive`), with `reason`; returns when the inbox
    /// had processed it, if it had (its redelivery is then a duplicate, and the inbox drops it).
    /// The inbox row is left as it is.
    pub async fn audit_redrive<K: AsMessageKey + ?Sized>(
        &self,
        consumer: &str,
        key: &K,
        reason: &str,
    ) -> Result<Option<SystemTime>, InboxError> {
        check_consumer(consumer)?;
        check_reason(reason)?;
        let key = key.as_message_key()?;
        let failed = || database_error(Stage::Forget);
        let processed = self
            .inspect(consumer, &*key)
            .await?
            .map(|record| record.processed_at);
        let processed_ms = processed.map(to_ms);
        let mut tx =
            InboxTransaction::begin(self.resources())
                .await
                .map_err(|error| match error {
                    BeginError::Acquire(error) | BeginError::Begin(error) => failed()(error),
                })?;
        DB::audit_insert(
            tx.connection(),
            &self.config.statements.audit,
            consumer,
            &key.full_digest(),
            reason,
            processed_ms,
        )
        .await
        .map_err(failed())?;
        commit(tx, None).await?;
        tracing::info!(consumer, key = %key.digest(), reason, "message put back from a dead-letter queue");
        Ok(processed)
    }

    /// Returns the newest audit rows (messages forgotten on purpose, or put back from a
    /// dead-letter queue), of `consumer` or (with `None`) of every consumer; at most `limit`.
    pub async fn audit(
        &self,
        consumer: Option<&str>,
        limit: usize,
    ) -> Result<Vec<AuditEntry>, InboxError> {
        if let Some(consumer) = consumer {
            check_consumer(consumer)?;
        }
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let mut session = self.read_session().await?;
        let rows = session
            .try_step(|conn| DB::audit_read(conn, &self.config.statements.audit, consumer, limit))
            .await
            .map_err(database_error(Stage::Inspect))?;
        Ok(rows
            .into_iter()
            .map(
                |AuditRow {
                     consumer,
                     key_digest,
                     reason,
                     processed_ms: processed,
                     forgotten_ms: forgotten,
                 }| AuditEntry {
                    consumer,
                    key_digest,
                    reason,
                    processed_at: processed.map(from_ms),
                    forgotten_at: from_ms(forgotten),
                },
            )
            .collect())
    }

    /// Returns what the inbox holds, per consumer (ordered by name): rows, the oldest row, the
    /// purge horizon, pending and stuck calls.
    pub async fn stats(&self) -> Result<Vec<ConsumerStats>, InboxError> {
        let mut session = self.read_session().await?;
        let (rows, calls, horizons) = session
            .try_step(|conn| DB::stats(conn, &self.config.statements.stats))
            .await
            .map_err(database_error(Stage::Inspect))?;
        let mut stats = BTreeMap::<String, ConsumerStats>::new();
        for (consumer, count, oldest) in rows {
            let stats = entry(&mut stats, consumer);
            stats.rows = count.max(0) as u64;
            stats.oldest = oldest.map(from_ms);
        }
        for (consumer, pending, stuck) in calls {
            let stats = entry(&mut stats, consumer);
            stats.pending_calls = pending.max(0) as u64;
            stats.stuck_calls = stuck.max(0) as u64;
        }
        for (consumer, horizon) in horizons {
            entry(&mut stats, consumer).horizon = Some(from_ms(horizon));
        }
        Ok(stats.into_values().collect())
    }
}

/// `consumer`'s entry of `stats`, made if missing.
fn entry(stats: &mut BTreeMap<String, ConsumerStats>, consumer: String) -> &mut ConsumerStats {
    stats
        .entry(consumer.clone())
        .or_insert_with(|| ConsumerStats {
            consumer,
            ..ConsumerStats::default()
        })
}
