//! What operators do with an outbox: count what it holds, look at parked messages (and any
//! message by its id) and the ordering keys they hold, and send a parked message again once the
//! cause is fixed, or give it up. Each is one statement outside any handler's transaction; the
//! CLI's `outbox` commands call these.

use std::time::SystemTime;

use crate::clock::from_ms;
use crate::error::{InboxError, Stage};
use crate::inbox::Inbox;
use crate::inbox::outgoing::Destination;
use crate::session::Session;
use crate::store::{Backend, HeldRow, PARKED, PENDING, SENT, SKIPPED, ShownRow, database_error};

/// Where an outgoing message stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OutboxState {
    /// Committed, not yet confirmed by the broker: a relay will publish it.
    Pending,
    /// Published, and confirmed by the broker; kept for the outbox's retention, then purged.
    Sent,
    /// Refused by the broker on every attempt: left for a person, who can
    /// [retry](Inbox::retry_parked) or [skip](Inbox::skip_parked) it. Not purged.
    Parked,
    /// Parked, then given up by a person ([`Inbox::skip_parked`]): never published, done as a
    /// sent message is (its ordering key's later messages go on); kept for the outbox's retention
    /// after it was skipped, then purged.
    Skipped,
}

impl OutboxState {
    fn of(stored: i64) -> Self {
        match stored {
            PENDING => OutboxState::Pending,
            SENT => OutboxState::Sent,
            SKIPPED => OutboxState::Skipped,
            _ => OutboxState::Parked,
        }
    }

    /// Returns the state's name: `pending`, `sent`, `parked` or `skipped`.
    pub fn as_str(self) -> &'static str {
        match self {
            OutboxState::Pending => "pending",
            OutboxState::Sent => "sent",
            OutboxState::Parked => "parked",
            OutboxState::Skipped => "skipped",
        }
    }
}

/// An outgoing message as the outbox holds it (without its payload).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxRecord {
    /// Its row's number: what [`Inbox::retry_parked`], [`Inbox::skip_parked`] and the CLI take.
    pub row: i64,
    /// Its message id.
    pub message_id: String,
    /// Where it goes.
    pub destination: Destination,
    /// The consumer whose handler queued it, or the origin given to
    /// [`Outbox::new`](super::Outbox::new).
    pub origin: String,
    /// Its ordering key, if any.
    pub ordering_key: Option<String>,
    /// Where it stands.
    pub state: OutboxState,
    /// How many times the broker refused it.
    pub attempts: u32,
    /// When it was written (the database's clock).
    pub created_at: SystemTime,
    /// When a relay marked it sent (or a person skipped it).
    pub sent_at: Option<SystemTime>,
    /// Why the broker refused it last.
    pub last_error: Option<String>,
    /// The size of its payload, in bytes.
    pub payload_len: u64,
}

impl OutboxRecord {
    fn of(shown: ShownRow) -> Self {
        Self {
            row: shown.id,
            message_id: shown.message_id,
            destination: Destination::exchange(shown.exchange, shown.routing_key),
            origin: shown.origin,
            ordering_key: shown.ordering_key,
            state: OutboxState::of(shown.state),
            attempts: u32::try_from(shown.attempts).unwrap_or(u32::MAX),
            created_at: from_ms(shown.created_at),
            sent_at: shown.sent_at.map(from_ms),
            last_error: shown.last_error,
            payload_len: shown.payload_len.max(0) as u64,
        }
    }
}

/// An ordering key held by its parked message: see [`Inbox::held_keys`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct HeldKey {
    /// The ordering key.
    pub ordering_key: String,
    /// Its parked message, the key's first message not yet sent: what to
    /// [retry](Inbox::retry_parked) or [skip](Inbox::skip_parked).
    pub parked: OutboxRecord,
    /// How many of the key's messages wait behind it (pending, or parked too).
    pub waiting: u64,
    /// When the oldest of them was written.
    pub oldest_waiting: Option<SystemTime>,
}

impl HeldKey {
    fn of(held: HeldRow) -> Self {
        let parked = OutboxRecord::of(held.parked);
        Self {
            ordering_key: parked.ordering_key.clone().unwrap_or_default(),
            parked,
            waiting: held.waiting.max(0) as u64,
            oldest_waiting: held.oldest_waiting.map(from_ms),
        }
    }
}

/// What an outbox holds: see [`Inbox::outbox_stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxStats {
    /// Messages committed and not yet sent.
    pub pending: u64,
    /// When the oldest of them was written.
    pub oldest_pending: Option<SystemTime>,
    /// Messages sent and still kept (for the outbox's retention).
    pub sent: u64,
    /// Messages parked.
    pub parked: u64,
    /// Messages parked, then skipped, and still kept (for the outbox's retention).
    pub skipped: u64,
}

impl<DB: Backend> Inbox<DB> {
    /// Counts the outbox's messages by state (reads the whole table: an operator's command).
    pub async fn outbox_stats(&self) -> Result<OutboxStats, InboxError> {
        let mut session = self.inspecting().await?;
        let counts = session
            .try_step(|conn| DB::outbox_counts(conn, &self.config.statements.outbox))
            .await
            .map_err(database_error(Stage::Inspect))?;
        let mut stats = OutboxStats::default();
        for (state, rows, oldest) in counts {
            let rows = rows.max(0) as u64;
            match state {
                PENDING => {
                    stats.pending = rows;
                    stats.oldest_pending = oldest.map(from_ms);
                }
                SENT => stats.sent = rows,
                PARKED => stats.parked = rows,
                SKIPPED => stats.skipped = rows,
                _ => {}
            }
        }
        Ok(stats)
    }

    /// Returns the parked messages after row `after` (`None`: from the first), at most `limit`, in
    /// the order they were written.
    pub async fn parked_messages(
        &self,
        after: Option<i64>,
        limit: usize,
    ) -> Result<Vec<OutboxRecord>, InboxError> {
        let mut session = self.inspecting().await?;
        let limit = i64::try_from(limit.max(1)).unwrap_or(i64::MAX);
        let rows = session
            .try_step(|conn| {
                DB::outbox_parked(
                    conn,
                    &self.config.statements.outbox,
                    after.unwrap_or(0),
                    limit,
                )
            })
            .await
            .map_err(database_error(Stage::Inspect))?;
        Ok(rows.into_iter().map(OutboxRecord::of).collect())
    }

    /// Returns the outbox's rows of the message `message_id` (usually one; a message queued again
    /// outside a handler with the same id has more), in the order they were written.
    pub async fn outbox_messages(&self, message_id: &str) -> Result<Vec<OutboxRecord>, InboxError> {
        let mut session = self.inspecting().await?;
        let rows = session
            .try_step(|conn| DB::outbox_rows_of(conn, &self.config.statements.outbox, message_id))
            .await
            .map_err(database_error(Stage::Inspect))?;
        Ok(rows.into_iter().map(OutboxRecord::of).collect())
    }

    /// Returns the outbox's row `row`, if it is there.
    pub async fn outbox_message(&self, row: i64) -> Result<Option<OutboxRecord>, InboxError> {
        let mut session = self.inspecting().await?;
        let found = session
            .try_step(|conn| DB::outbox_row(conn, &self.config.statements.outbox, row))
            .await
            .map_err(database_error(Stage::Inspect))?;
        Ok(found.map(OutboxRecord::of))
    }

    /// Makes the parked message of row `row` pending again, due now, with its attempts counted
    /// from zero: the next relay batch publishes it. `false` when no parked message has that row.
    /// A message with an ordering key is then published after later messages of its key that
    /// went out while it was parked, unless the relays hold parked messages' keys
    /// ([`RelayOptions::parked_holds_key`](super::RelayOptions::parked_holds_key)): then it goes
    /// out first, and the messages that waited behind it after it, in order.
    pub async fn retry_parked(&self, row: i64) -> Result<bool, InboxError> {
        let mut session = self.inspecting().await?;
        let retried = session
            .try_step(|conn| DB::outbox_retry(conn, &self.config.statements.outbox, row))
            .await
            .map_err(database_error(Stage::Inspect))?;
        if retried {
            tracing::info!(table = %self.table(), row, "a parked outgoing message is pending again");
        }
        Ok(retried)
    }

    /// Gives up the parked message of row `row`: it is never published, and is
    /// [skipped](OutboxState::Skipped), done as a sent message is (purged after the outbox's
    /// retention, counted from now). An ordering key it held
    /// ([`RelayOptions::parked_holds_key`](super::RelayOptions::parked_holds_key)) goes on with
    /// its next message. `false` when no parked message has that row.
    pub async fn skip_parked(&self, row: i64) -> Result<bool, InboxError> {
        let mut session = self.inspecting().await?;
        let skipped = session
            .try_step(|conn| DB::outbox_skip(conn, &self.config.statements.outbox, row))
            .await
            .map_err(database_error(Stage::Inspect))?;
        if skipped {
            tracing::warn!(table = %self.table(), row, "a parked outgoing message was skipped: it will not be published");
        }
        Ok(skipped)
    }

    /// Returns the ordering keys whose first message not yet sent is parked, with that message
    /// and what waits behind it, ordered by the parked message's row: those after row `after`
    /// (`None`: from the first), at most `limit`. These are the keys that relays with
    /// [`RelayOptions::parked_holds_key`](super::RelayOptions::parked_holds_key) hold until the
    /// message is [retried](Self::retry_parked) or [skipped](Self::skip_parked) (relays without
    /// it publish what waits behind). Page on with the last key's `parked.row`.
    pub async fn held_keys(
        &self,
        after: Option<i64>,
        limit: usize,
    ) -> Result<Vec<HeldKey>, InboxError> {
        let mut session = self.inspecting().await?;
        let limit = i64::try_from(limit.max(1)).unwrap_or(i64::MAX);
        let rows = session
            .try_step(|conn| {
                DB::outbox_held(
                    conn,
                    &self.config.statements.outbox,
                    after.unwrap_or(0),
                    limit,
                )
            })
            .await
            .map_err(database_error(Stage::Inspect))?;
        Ok(rows.into_iter().map(HeldKey::of).collect())
    }

    /// A connection for an operator's statement.
    async fn inspecting(&self) -> Result<Session<DB>, InboxError> {
        Session::take(self.source())
            .await
            .map_err(database_error(Stage::Inspect))
    }
}
