//! How a claimed transaction ends: the error of every way a commit can end but committed.

use serde::de::DeserializeOwned;

use crate::error::{InboxError, Stage};
use crate::key::MessageKey;
use crate::session::Session;
use crate::store::{Backend, Ending, RolledBack, Statements, database_error};
use crate::transaction::InboxTransaction;

/// Commits `tx`, or says why it did not: the error of every way a commit can end but committed.
/// `claim` is the claim to look for when the body ended the transaction itself; without it, such a
/// transaction counts as having committed its claims.
pub(crate) async fn commit<DB: Backend>(
    tx: InboxTransaction<DB>,
    claim: Option<(&Statements, &str, &MessageKey)>,
) -> Result<(), InboxError> {
    Err(match tx.commit().await {
        Ok((Ending::Committed, _)) => return Ok(()),
        Ok((Ending::Aborted, session)) => ended_before_abort(session, claim)
            .await
            .unwrap_or(InboxError::TransactionAborted),
        Ok((
            Ending::Replaced {
                later_writes_refused,
            },
            session,
        )) => ended_by_body(session, claim, later_writes_refused).await,
        Ok((Ending::Refused(error), _)) | Err(error) => database_error(Stage::Commit)(error),
    })
}

/// Rolls `tx` back after `error`, one of the inbox's own statements failing before the commit (an
/// outgoing row, the stored response), and returns the error to report: the one a commit would
/// have reported ([`InboxError::TransactionEnded`], with whether `claim` committed) when the body
/// had ended the transaction itself, and the statement failed outside it (refused where later
/// writes are, lost behind a pooler in transaction mode); `error` otherwise, with nothing
/// committed.
pub(crate) async fn rollback_after<DB: Backend>(
    tx: InboxTransaction<DB>,
    claim: Option<(&Statements, &str, &MessageKey)>,
    error: InboxError,
) -> InboxError {
    match tx.rollback_checked().await {
        Ok((
            RolledBack::Replaced {
                later_writes_refused,
            },
            session,
        )) => ended_by_body(session, claim, later_writes_refused).await,
        Ok((RolledBack::Aborted, session)) => {
            ended_before_abort(session, claim).await.unwrap_or(error)
        }
        Ok((RolledBack::Own, _)) | Err(_) => error,
    }
}

/// What the rollback of an aborted transaction leaves to say, read on `session`: when `claim` is
/// committed now, the body had ended the inbox's transaction (its `COMMIT` took the claim) and a
/// statement then failed in a transaction of its own; the inbox's claim would have rolled back
/// with its transaction. `None` when it is not (nothing of the inbox's committed), cannot be read,
/// or there is no claim to look for. (A copy of the message that claimed the key as soon as the
/// rollback freed it, and committed before this read, makes it say so too: the key is then
/// committed, as it says, and a redelivery is a duplicate.)
pub(crate) async fn ended_before_abort<DB: Backend>(
    mut session: Session<DB>,
    claim: Option<(&Statements, &str, &MessageKey)>,
) -> Option<InboxError> {
    let (statements, consumer, key) = claim?;
    let row = session
        .step(|conn| DB::stored(conn, &statements.inbox, consumer, key.as_bytes()))
        .await;
    matches!(row, Ok(Some(_))).then_some(InboxError::TransactionEnded {
        key_committed: true,
        later_writes_refused: false,
    })
}

/// The error for a transaction the body ended (its own `COMMIT` or `ROLLBACK`, a statement that
/// commits implicitly) before the inbox could end it, read on `session`: whether it took `claim`
/// with it. Without a claim to look for, the transaction counts as having committed its claims.
pub(super) async fn ended_by_body<DB: Backend>(
    mut session: Session<DB>,
    claim: Option<(&Statements, &str, &MessageKey)>,
    later_writes_refused: bool,
) -> InboxError {
    let key_committed = match claim {
        Some((statements, consumer, key)) => {
            let row = session
                .step(|conn| DB::stored(conn, &statements.inbox, consumer, key.as_bytes()))
                .await;
            // Unknown counts as committed: a redelivery is then at worst a duplicate.
            row.map_or(true, |row| row.is_some())
        }
        None => true,
    };
    InboxError::TransactionEnded {
        key_committed,
        later_writes_refused,
    }
}

/// Decodes a stored response.
pub(crate) fn decode_response<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, InboxError> {
    serde_json::from_slice(bytes).map_err(|error| InboxError::Response {
        source: error.into(),
    })
}
