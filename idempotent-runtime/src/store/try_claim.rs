//! The HTTP layer's claim: the inbox's claim, except that it never waits for a concurrent claim
//! of the same key. A message consumer waits for the first delivery's transaction to end, which is
//! right for a broker; an HTTP client must get `409 Conflict` at once instead.
//!
//! - **PostgreSQL**: the claim takes a transaction-level advisory lock on a 64-bit digest of
//!   (table, consumer, key) with `pg_try_advisory_xact_lock`, which never waits, in the message of
//!   its `BEGIN` (no round trip of its own), and keeps whether it got it in a setting of the
//!   transaction. Its one statement then reads the key's committed row and inserts the key only
//!   when it got the lock and found no row. Every HTTP claim of a key takes its lock before it
//!   inserts and holds it until its transaction ends, so a claim that gets the lock cannot meet an
//!   uncommitted insert of the same key (from the HTTP layer), and one that does not get it knows a
//!   claim is in flight. Nothing fails and nothing is logged on the server, unlike a short
//!   `lock_timeout`, which would abort the statement with an `ERROR` (the statement and its key in
//!   the server's log), and whose length would be a guess. Two different keys share a lock only if
//!   64 bits of SHA-256 collide; the only cost would be a needless `409`. A retry's claim finds
//!   the stored response in the same statement: a replay reads nothing more.
//! - **SQLite**: the transaction already holds the database's write lock (`BEGIN IMMEDIATE`), so no
//!   other claim can be in flight and the inbox's `INSERT OR IGNORE` cannot wait. What waits is the
//!   `BEGIN IMMEDIATE`, for whichever writer holds the lock; the HTTP layer keeps twins of its own
//!   process from getting there (see [`http`](crate::http)).
//!
//! A transactional route and a leased route may share a consumer, and so a key: each kind must see
//! the other's claim in flight. The claim above looks for a pending call of the key with a live
//! lease (a leased route's request in flight), in a snapshot taken after the lock was (on
//! PostgreSQL the claim's statement, which follows the lock's; on SQLite a statement after the
//! insert), and answers in flight when it finds one.
//! A leased route records its call ([`call_gate`](sealed::ClaimWithoutWaiting::call_gate)) in a
//! transaction that first takes the same advisory lock on PostgreSQL, without waiting: a call is
//! never recorded while a transactional claim of its key is uncommitted, and a transactional
//! claim that takes the lock after a call was recorded sees the call. On SQLite both are writes,
//! which the database runs one at a time.
//!
//! MySQL has no claim here yet (InnoDB waits at least a second on a row lock, and `GET_LOCK` is
//! held by the session, not the transaction).

use std::future::Future;

use super::{Backend, CallGate, Statements, StoredRow};

/// What a claim that does not wait found.
#[derive(Debug)]
pub enum Attempt {
    /// The key is ours, in the open transaction.
    Claimed,
    /// The key was committed before: its row, when the claim's statement read it.
    Committed(Option<StoredRow>),
    /// Another transaction is claiming the key and has not ended.
    InFlight,
    /// The key was free, but a leased route's request holds it: its pending call has this much
    /// of its lease left. (The open transaction may have inserted the key: roll it back.)
    CallPending(std::time::Duration),
}

/// The pending call's lease left, or `Claimed` if it has none.
fn unless_pending(pending: Option<i64>) -> Attempt {
    match pending {
        Some(left) => Attempt::CallPending(std::time::Duration::from_millis(
            u64::try_from(left).unwrap_or(0),
        )),
        None => Attempt::Claimed,
    }
}

pub(crate) mod sealed {
    use super::*;

    /// What a backend answers for to serve the HTTP layer.
    pub trait ClaimWithoutWaiting: Backend {
        /// Look for a committed row before beginning the transaction: where beginning one waits
        /// for every other writer (SQLite), a replay should not.
        const READ_FIRST: bool;

        /// What the claim adds to the message of its transaction's `BEGIN`, if anything (run
        /// before [`try_insert_key`](Self::try_insert_key)'s statement, in the transaction).
        fn begin_claim(statements: &Statements, consumer: &str, key: &[u8]) -> Option<String>;

        /// Inserts `(consumer, key, fingerprint)` in the open transaction unless the key is there
        /// or being claimed, without waiting for another transaction. A prepared statement, like
        /// the inbox's claim: an error that [`lost_statement`](crate::store::Store::lost_statement)
        /// recognizes (a body's `DEALLOCATE ALL` on this connection) is repaired by forgetting the
        /// driver's statements. Once inserted, a pending call of the key named `call` with a live
        /// lease makes it [`Attempt::CallPending`].
        fn try_insert_key<'a>(
            conn: &'a mut Self::Connection,
            statements: &'a Statements,
            consumer: &'a str,
            key: &'a [u8],
            fingerprint: &'a [u8],
            call: &'a str,
        ) -> impl Future<Output = Result<Attempt, sqlx::Error>> + Send + 'a;

        /// The lock a leased route's call record takes first, in its transaction (see the module
        /// docs); `None` where the database's single writer serializes the two already.
        fn call_gate<'g>(
            statements: &'g Statements,
            consumer: &'g str,
            key: &'g [u8],
        ) -> Option<CallGate<'g, Self>>;
    }
}

/// A database the HTTP layer runs on: PostgreSQL (`postgres` feature) and SQLite (`sqlite`).
/// Sealed.
pub trait HttpBackend: sealed::ClaimWithoutWaiting {}

#[cfg(feature = "postgres")]
mod postgres {
    use sha2::{Digest, Sha256};
    use sqlx::postgres::PgConnection;
    use sqlx::{AssertSqlSafe, Postgres};

    use super::{
        Attempt, CallGate, HttpBackend, Statements, StoredRow, sealed::ClaimWithoutWaiting,
        unless_pending,
    };
    use crate::store::QueryBuilder;

    /// What the claim adds to its transaction's `BEGIN` message: the key's advisory lock, taken
    /// without waiting, and whether it was taken, kept in a setting of the transaction. Taken in a
    /// statement before the claim's, so that the claim's snapshot sees whatever was committed
    /// under the lock before (a response stored for the key, a leased route's call recorded).
    const LOCK: &str = "; SELECT set_config('idempotent.http_lock', pg_try_advisory_xact_lock({lock})::text, true)";

    /// With the lock taken, in one statement: the key's committed row if there is one, a leased
    /// route's call of the key with a live lease ({pending}: `$1`, `$2`, `$3`), and the key
    /// inserted unless either is there. The row says which happened. (Every part reads the
    /// statement's snapshot: the inserted row is not in `stored`.)
    const TRY_CLAIM: &str = "WITH lock AS (SELECT current_setting('idempotent.http_lock', true) = 'true' AS taken), \
         stored AS (SELECT fingerprint, response FROM {t} WHERE consumer = $1 AND message_key = $2), \
         pending AS ({pending}), \
         claim AS (INSERT INTO {t} (consumer, message_key, fingerprint) \
                   SELECT $1, $2, $4 FROM lock \
                   WHERE taken AND NOT EXISTS (SELECT 1 FROM pending) \
                   ON CONFLICT DO NOTHING RETURNING 1) \
         SELECT (SELECT taken FROM lock), EXISTS (SELECT 1 FROM claim), (SELECT * FROM pending), \
                EXISTS (SELECT 1 FROM stored), (SELECT fingerprint FROM stored), \
                (SELECT response FROM stored)";

    /// The advisory lock of a key: 64 bits of the SHA-256 of the table, the consumer and the key,
    /// each length-prefixed.
    fn lock_of(statements: &Statements, consumer: &str, key: &[u8]) -> i64 {
        let mut digest = Sha256::new();
        digest.update(b"idempotent-http-claim");
        for part in [
            statements.inbox.quoted_table().as_bytes(),
            consumer.as_bytes(),
            key,
        ] {
            digest.update((part.len() as u64).to_be_bytes());
            digest.update(part);
        }
        let digest = digest.finalize();
        let mut first = [0; 8];
        first.copy_from_slice(&digest[..8]);
        i64::from_be_bytes(first)
    }

    impl HttpBackend for Postgres {}

    impl ClaimWithoutWaiting for Postgres {
        const READ_FIRST: bool = false;

        fn begin_claim(statements: &Statements, consumer: &str, key: &[u8]) -> Option<String> {
            let lock = lock_of(statements, consumer, key);
            Some(LOCK.replace("{lock}", &lock.to_string()))
        }

        async fn try_insert_key(
            conn: &mut PgConnection,
            statements: &Statements,
            consumer: &str,
            key: &[u8],
            fingerprint: &[u8],
            call: &str,
        ) -> Result<Attempt, sqlx::Error> {
            type Found = (
                bool,
                bool,
                Option<i64>,
                bool,
                Option<Vec<u8>>,
                Option<Vec<u8>>,
            );
            let sql = statements.try_claim.get_or_init(|| {
                let sql = statements.inbox.table_sql(TRY_CLAIM);
                sql.replace("{pending}", &statements.calls.pending).into()
            });
            let (taken, inserted, pending, found, stored_fingerprint, response): Found = statements
                .inbox
                .query_as(AssertSqlSafe(sql.clone()))
                .bind(consumer)
                .bind(key)
                .bind(call)
                .bind(fingerprint)
                .fetch_one(&mut *conn)
                .await?;
            Ok(match (taken, inserted) {
                (false, _) => Attempt::InFlight,
                (true, true) => Attempt::Claimed,
                // Committed under the lock before (or by a claim that waits, which this insert
                // waited for: then after this statement's snapshot, and read on its own).
                (true, false) if found => Attempt::Committed(Some(StoredRow {
                    response,
                    fingerprint: stored_fingerprint,
                })),
                (true, false) => match unless_pending(pending) {
                    Attempt::Claimed => Attempt::Committed(None),
                    pending => pending,
                },
            })
        }

        fn call_gate<'g>(
            statements: &'g Statements,
            consumer: &'g str,
            key: &'g [u8],
        ) -> Option<CallGate<'g, Self>> {
            let lock = lock_of(statements, consumer, key);
            let query = statements
                .calls
                .query_scalar("SELECT pg_try_advisory_xact_lock($1)")
                .bind(lock);
            Some(Box::new(move |conn: &mut PgConnection| {
                Box::pin(query.fetch_one(conn))
            }))
        }
    }
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use sqlx::Sqlite;
    use sqlx::sqlite::SqliteConnection;

    use super::{
        Attempt, CallGate, HttpBackend, Statements, sealed::ClaimWithoutWaiting, unless_pending,
    };
    use crate::store::{CallId, CallQueries, InboxQueries};

    impl HttpBackend for Sqlite {}

    impl ClaimWithoutWaiting for Sqlite {
        const READ_FIRST: bool = true;

        fn begin_claim(_statements: &Statements, _consumer: &str, _key: &[u8]) -> Option<String> {
            None
        }

        async fn try_insert_key(
            conn: &mut SqliteConnection,
            statements: &Statements,
            consumer: &str,
            key: &[u8],
            fingerprint: &[u8],
            call: &str,
        ) -> Result<Attempt, sqlx::Error> {
            // The transaction holds the write lock: nothing else can be claiming, or recording
            // a call.
            let inserted =
                Self::insert_key(conn, &statements.inbox, consumer, key, Some(fingerprint)).await?;
            if !inserted {
                return Ok(Attempt::Committed(None));
            }
            let id = CallId {
                consumer,
                key,
                name: call,
            };
            Ok(unless_pending(
                Self::call_pending(conn, &statements.calls, id).await?,
            ))
        }

        fn call_gate<'g>(
            _statements: &'g Statements,
            _consumer: &'g str,
            _key: &'g [u8],
        ) -> Option<CallGate<'g, Self>> {
            None
        }
    }
}
