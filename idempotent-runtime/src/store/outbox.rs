//! The outbox's SQL: the rows a handler's transaction writes to `<table>_outbox`, the statements
//! relays take them with and mark them by, and what operators read. Built once from the dialect,
//! as the inbox's own statements are, and run by one generic implementation ([`OutboxQueries`]).
//!
//! A row is `pending` (state 0) until a relay saw the broker confirm it, then `sent` (1), or
//! `parked` (2) after the broker refused it too often; an operator makes a parked row pending
//! again, or gives it up: `skipped` (3), done as a sent row is, never published. A message with
//! an ordering key also gets the key's next number (`ordering_seq`) from `<table>_outbox_keys`,
//! whose row for the key the writing transaction holds locked until it ends: two transactions
//! writing messages of one key take turns, so the numbers follow their commits.

use std::future::Future;
use std::sync::Arc;

use sqlx::{AssertSqlSafe, Database, Decode, Encode, Executor, Row, Type};

use super::dialect::{Dialect, Heads, OutboxDialect, Params};
use super::purge::{Bind, PurgeSql};
use super::query::{QueryBuilder, RowsAffected, in_own_transaction};
use crate::table::TableName;

/// A row a relay took, times in milliseconds of the database's clock.
#[derive(Debug, sqlx::FromRow)]
pub struct TakenRow {
    pub(crate) id: i64,
    pub(crate) message_id: String,
    pub(crate) exchange: String,
    pub(crate) routing_key: String,
    pub(crate) payload: Vec<u8>,
    pub(crate) headers: Option<Vec<u8>>,
    pub(crate) attempts: i64,
    pub(crate) created_at: i64,
    pub(crate) ordering_key: Option<String>,
    /// Its number within its ordering key.
    pub(crate) ordering_seq: Option<i64>,
    /// The database's clock as the row was taken.
    pub(crate) now_ms: i64,
}

/// A row as operators see it, times in milliseconds of the database's clock.
#[derive(Debug, sqlx::FromRow)]
pub struct ShownRow {
    pub(crate) id: i64,
    pub(crate) message_id: String,
    pub(crate) exchange: String,
    pub(crate) routing_key: String,
    pub(crate) origin: String,
    pub(crate) ordering_key: Option<String>,
    pub(crate) state: i64,
    pub(crate) attempts: i64,
    pub(crate) created_at: i64,
    pub(crate) sent_at: Option<i64>,
    pub(crate) last_error: Option<String>,
    /// The payload's length in bytes.
    pub(crate) payload_len: i64,
}

/// A parked row that holds its ordering key (the key's first row not yet done with), and what
/// waits behind it.
#[derive(Debug, sqlx::FromRow)]
pub struct HeldRow {
    #[sqlx(flatten)]
    pub(crate) parked: ShownRow,
    /// The key's rows after it not yet done with.
    pub(crate) waiting: i64,
    /// When the oldest of them was written.
    pub(crate) oldest_waiting: Option<i64>,
}

/// Per state: `(state, rows, oldest created_at)`.
pub(crate) type StateCount = (i64, i64, Option<i64>);

/// One outgoing message as a handler's transaction writes it.
#[derive(Debug, Clone, Copy)]
pub struct NewRow<'a> {
    pub(crate) message_id: &'a str,
    pub(crate) exchange: &'a str,
    pub(crate) routing_key: &'a str,
    pub(crate) payload: &'a [u8],
    pub(crate) headers: Option<&'a [u8]>,
    pub(crate) origin: &'a str,
    pub(crate) ordering_key: Option<&'a str>,
}

/// A row's states, as stored.
pub(crate) const PENDING: i64 = 0;
pub(crate) const SENT: i64 = 1;
pub(crate) const PARKED: i64 = 2;
pub(crate) const SKIPPED: i64 = 3;

/// The condition on a row's `state` (the column as `column` names it) that it is not done with:
/// pending or parked, neither sent nor skipped. Written as two inequalities so that SQLite's
/// partial index on the keys' rows (`WHERE state <> 1 AND ordering_key IS NOT NULL`) serves it.
fn unsent(column: &str) -> String {
    format!("{column} <> {SENT} AND {column} <> {SKIPPED}")
}

/// What a parked row does to the later rows of its ordering key, in the relays' eyes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParkedRows {
    /// The key moves on: its next pending row is its head.
    LetTheKeyGo,
    /// The parked row stays the key's head, so the key is not taken until an operator retries or
    /// skips it.
    HoldTheKey,
}

/// Which ordering keys a relay's worker takes: those whose hash falls to it, so that the workers
/// of one relay each drain keys of their own at once, rather than all but one find every key's
/// head held by the first. Only a choice of keys: the row locks keep a key's rows in order
/// whichever worker (or relay) takes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyShare {
    worker: usize,
    workers: usize,
}

impl KeyShare {
    /// Every key: the share of a relay's only worker.
    pub(crate) const ALL: Self = Self {
        worker: 0,
        workers: 1,
    };

    /// The share of worker `worker` of `workers`.
    pub(crate) fn of(worker: usize, workers: usize) -> Self {
        let workers = workers.max(1);
        Self {
            worker: worker % workers,
            workers,
        }
    }

    /// Whether `key` is in this share (FNV-1a of its bytes, modulo the workers).
    fn holds(&self, key: &str) -> bool {
        if self.workers == 1 {
            return true;
        }
        let hash = key.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
        });
        hash % self.workers as u64 == self.worker as u64
    }
}

/// The outbox's statements, built once from the dialect and the inbox's table name.
#[derive(Debug, Clone)]
pub struct OutboxStatements {
    dialect: Dialect,
    table: String,
    /// [`table`](Self::table) as the relay's reads of pending rows name it (see
    /// [`OutboxDialect::pending_index_named`]).
    pending: String,
    /// The relays' columns of a row, with the clock last.
    taken: String,
    /// Inserts a row; where the dialect has a condition that proves the inbox's transaction
    /// ([`Dialect::own_transaction`]), returns its value.
    insert: Arc<str>,
    next_seq: Arc<str>,
    /// [`insert`](Self::insert), of a row with an ordering key.
    insert_keyed: Arc<str>,
    notify: Option<Arc<str>>,
    /// Writers send [`notify`](Self::notify) (unless turned off: relays that only poll).
    notifies: bool,
    take_unkeyed: Arc<str>,
    /// `1` if a row without an ordering key is pending and due, else `0`.
    unkeyed_waiting: Arc<str>,
    /// Each key's head: the statement, or where the dialect's heads are
    /// [planned at each batch](Heads::planned_each_batch), the statement up to its limit's value.
    heads: Arc<str>,
    /// [`heads`](Self::heads) with parked rows holding their keys.
    heads_held: Arc<str>,
    mark_failed: Arc<str>,
    backlog: Arc<str>,
    counts: Arc<str>,
    parked: Arc<str>,
    row: Arc<str>,
    by_message_id: Arc<str>,
    retry: Arc<str>,
    skip: Arc<str>,
    held: Arc<str>,
    /// Deletes a batch of sent rows older than the cutoff.
    pub(crate) purge_sent: PurgeSql,
    /// Deletes a batch of skipped rows given up before the cutoff.
    pub(crate) purge_skipped: PurgeSql,
    /// Deletes a batch of ordering keys untouched since the cutoff that have no unsent row.
    pub(crate) purge_keys: PurgeSql,
    /// The `LISTEN` channel of this table's outbox: `<table>_outbox`.
    pub(crate) channel: String,
    /// Sent as behind a pooler in transaction mode: see [`Statements::pooled`].
    ///
    /// [`Statements::pooled`]: super::Statements::pooled
    pub(crate) pooled: bool,
}

impl OutboxStatements {
    pub(crate) fn new(dialect: &Dialect, table: &TableName) -> Self {
        let q = dialect.quote;
        let o = table.quoted_suffixed("outbox", q);
        let k = table.quoted_suffixed("outbox_keys", q);
        let now = dialect.now_ms;
        let OutboxDialect {
            next_seq, notify, ..
        } = dialect.outbox;
        let p = || Params::new(dialect);
        let columns = "message_id, exchange, routing_key, payload, headers, origin, \
                       state, attempts, created_at, due_at";
        let values = |p: &mut Params| {
            let binds: Vec<String> = (0..6).map(|_| p.next()).collect();
            format!("{}, {PENDING}, 0, {now}, {now}", binds.join(", "))
        };
        // Where a condition proves the inbox's transaction, each insert returns it: the row that
        // was written last before the commit then proves the transaction.
        let proof = dialect
            .own_transaction
            .map_or_else(String::new, |own| format!(" RETURNING {own}"));
        let insert = {
            let mut p = p();
            format!(
                "INSERT INTO {o} ({columns}) VALUES ({}){proof}",
                values(&mut p)
            )
        };
        let next_seq = {
            let mut p = p();
            let key = p.next();
            format!(
                "INSERT INTO {k} (ordering_key, last_seq, updated_at) VALUES ({key}, 1, {now}){}",
                next_seq.replace("{k}", &k).replace("{now}", now)
            )
        };
        let insert_keyed = {
            let mut p = p();
            let values = values(&mut p);
            let key = p.next();
            format!(
                "INSERT INTO {o} ({columns}, ordering_key, ordering_seq) \
                 SELECT {values}, ordering_key, last_seq FROM {k} WHERE ordering_key = {key}{proof}"
            )
        };
        // Without the schema: the tenants' inboxes in schemas of one database share their
        // relays' channel, and a relay of them all listens once.
        let channel = format!("{}_outbox", table.as_str());
        let notify = notify.map(|sql| sql.replace("{c}", &channel).into());
        let taken = format!(
            "id, message_id, exchange, routing_key, payload, headers, attempts, created_at, \
             ordering_key, ordering_seq, {now} AS now_ms"
        );
        // Where the relay names the `(state, ordering_key, ordering_seq, id)` index, a row without
        // a key is also one without a number (the two inserts above write both or neither), so
        // that the index gives them in id order. Only the `SELECT` of a take names it.
        debug_assert!(!(dialect.outbox.pending_index_named && dialect.outbox.mark_on_take));
        let (pending, unkeyed) = if dialect.outbox.pending_index_named {
            (
                format!("{o} FORCE INDEX ({})", table.index("outbox_pending", q)),
                "ordering_key IS NULL AND ordering_seq IS NULL",
            )
        } else {
            (o.clone(), "ordering_key IS NULL")
        };
        let take_unkeyed = Self::take(
            dialect,
            &pending,
            &taken,
            &format!(
                "state = {PENDING} AND {unkeyed} AND due_at <= {now} ORDER BY id LIMIT {}",
                p().next()
            ),
        );
        let unkeyed_waiting = format!(
            "SELECT COUNT(*) FROM (SELECT 1 AS w FROM {pending} WHERE state = {PENDING} \
             AND {unkeyed} AND due_at <= {now} LIMIT 1) w"
        );
        // Each key's head (its row with the lowest number among the `candidates`), of the keys
        // whose head is pending and due: a key in back-off takes no slot from one that is ready,
        // and a key whose head is parked (when parked rows are candidates) none at all.
        // Keys are taken oldest head first: a head is its key's first row among the candidates,
        // by number and by id alike (a key's rows are numbered in the order they are written).
        let heads = |candidates: &str| {
            // Written in at each batch where the heads are planned at each batch.
            let limit = if dialect.outbox.heads.planned_each_batch() {
                String::new()
            } else {
                p().next()
            };
            let keyed = format!("{candidates} AND ordering_key IS NOT NULL");
            // Each key and its head's number, `m`.
            let m = match dialect.outbox.heads {
                // Each step reads its head's row whole, so no join to the rows follows (on
                // statistics of a table that was once large, PostgreSQL joined the heads to a scan
                // of the whole table, 4.7 ms a batch at 20,000 rows and growing with them).
                Heads::SkipScan => {
                    let first = |after: &str| {
                        format!(
                            "SELECT ordering_key, ordering_seq, id, state, due_at FROM {o} \
                             WHERE {keyed}{after} ORDER BY ordering_key, ordering_seq LIMIT 1"
                        )
                    };
                    return format!(
                        "WITH RECURSIVE m AS (({}) UNION ALL SELECT n.ordering_key, n.ordering_seq, \
                         n.id, n.state, n.due_at FROM m, LATERAL ({}) n) \
                         SELECT ordering_key, ordering_seq FROM m \
                         WHERE state = {PENDING} AND due_at <= {now} ORDER BY id LIMIT {limit}",
                        first(""),
                        first(" AND ordering_key > m.ordering_key"),
                    );
                }
                Heads::SkipScanBySubqueries => {
                    let keyed = format!("state <> {SENT} AND {keyed}");
                    let first = |column: &str, after: &str| {
                        format!(
                            "(SELECT {column} FROM {o} WHERE {keyed}{after} \
                             ORDER BY {column} LIMIT 1)"
                        )
                    };
                    return format!(
                        "WITH RECURSIVE k(ordering_key) AS (SELECT {} UNION ALL SELECT {} \
                         FROM k WHERE k.ordering_key IS NOT NULL), \
                         m(ordering_key, seq) AS (SELECT ordering_key, {} FROM k \
                         WHERE ordering_key IS NOT NULL) \
                         SELECT h.ordering_key, h.ordering_seq FROM m CROSS JOIN {o} h \
                         ON h.ordering_key = m.ordering_key AND h.ordering_seq = m.seq \
                         WHERE h.state <> {SENT} AND h.state = {PENDING} AND h.due_at <= {now} \
                         ORDER BY h.id LIMIT {limit}",
                        first("ordering_key", ""),
                        first("ordering_key", " AND ordering_key > k.ordering_key"),
                        first("ordering_seq", " AND ordering_key = k.ordering_key"),
                    );
                }
                Heads::GroupedByStateAndKey => format!(
                    "SELECT ordering_key, MIN(seq) AS seq FROM \
                     (SELECT state, ordering_key, MIN(ordering_seq) AS seq FROM {o} \
                     WHERE {keyed} GROUP BY state, ordering_key) s GROUP BY ordering_key"
                ),
            };
            format!(
                "SELECT h.ordering_key, h.ordering_seq FROM {o} h JOIN ({m}) m \
                 ON h.ordering_key = m.ordering_key AND h.ordering_seq = m.seq \
                 WHERE h.state = {PENDING} AND h.due_at <= {now} ORDER BY h.id LIMIT {limit}"
            )
        };
        let heads_held = heads(&unsent("state"));
        let heads = heads(&format!("state = {PENDING}"));
        let mark_failed = {
            let mut p = p();
            let (state, attempts, delay, error, id) =
                (p.next(), p.next(), p.next(), p.next(), p.next());
            format!(
                "UPDATE {o} SET state = {state}, attempts = {attempts}, due_at = {now} + {delay}, \
                 last_error = {error} WHERE id = {id}"
            )
        };
        // The oldest pending row by id (its time, nearly the oldest time): one index entry.
        let backlog = format!(
            "SELECT COUNT(*), (SELECT created_at FROM {o} WHERE state = {PENDING} ORDER BY id LIMIT 1), \
             {now} FROM {o} WHERE state = {PENDING}"
        );
        let counts = format!("SELECT state, COUNT(*), MIN(created_at) FROM {o} GROUP BY state");
        let columns = |t: &str| {
            format!(
                "{t}id, {t}message_id, {t}exchange, {t}routing_key, {t}origin, {t}ordering_key, \
                 {t}state, {t}attempts, {t}created_at, {t}sent_at, {t}last_error, \
                 CAST(LENGTH({t}payload) AS {}) AS payload_len",
                dialect.int
            )
        };
        let shown = format!("SELECT {} FROM {o}", columns(""));
        let parked = {
            let mut p = p();
            let (after, limit) = (p.next(), p.next());
            format!("{shown} WHERE state = {PARKED} AND id > {after} ORDER BY id LIMIT {limit}")
        };
        let row = format!("{shown} WHERE id = {}", p().next());
        let by_message_id = format!("{shown} WHERE message_id = {} ORDER BY id", p().next());
        let retry = format!(
            "UPDATE {o} SET state = {PENDING}, attempts = 0, due_at = {now}, last_error = NULL \
             WHERE id = {} AND state = {PARKED}",
            p().next()
        );
        // A skipped row is done at the time it was given up: `sent_at`, which the purge counts from.
        let skip = format!(
            "UPDATE {o} SET state = {SKIPPED}, sent_at = {now} WHERE id = {} AND state = {PARKED}",
            p().next()
        );
        // The parked rows that are their key's first row not yet done with, each with the rows
        // of its key behind it that are not done with either.
        let held = {
            let mut p = p();
            let (after, limit) = (p.next(), p.next());
            let behind = |what: &str| {
                format!(
                    "(SELECT {what} FROM {o} w WHERE w.ordering_key = p.ordering_key \
                     AND w.ordering_seq > p.ordering_seq AND {})",
                    unsent("w.state")
                )
            };
            format!(
                "SELECT {}, {} AS waiting, {} AS oldest_waiting FROM {o} p \
                 WHERE p.state = {PARKED} AND p.ordering_key IS NOT NULL AND p.id > {after} \
                 AND NOT EXISTS (SELECT 1 FROM {o} e WHERE e.ordering_key = p.ordering_key \
                 AND e.ordering_seq < p.ordering_seq AND {}) ORDER BY p.id LIMIT {limit}",
                columns("p."),
                behind("COUNT(*)"),
                behind("MIN(w.created_at)"),
                unsent("e.state"),
            )
        };
        // Deletes a batch of rows done with in `state` (sent or skipped) before the cutoff: one
        // statement per state, each served by an index of its own (`<table>_outbox_sent`,
        // `<table>_outbox_skipped`; MySQL: `(state, sent_at)`).
        let purge_done = |state: i64| {
            let mut p = p();
            let (cutoff, limit) = (p.next(), p.next());
            let which = format!("state = {state} AND sent_at < {cutoff}");
            PurgeSql {
                sql: if dialect.delete_limit {
                    format!("DELETE FROM {o} WHERE {which} ORDER BY sent_at LIMIT {limit}")
                } else {
                    format!(
                        "DELETE FROM {o} WHERE id IN \
                         (SELECT id FROM {o} WHERE {which} ORDER BY sent_at LIMIT {limit})"
                    )
                },
                binds: vec![Bind::Cutoff, Bind::Limit],
            }
        };
        let purge_sent = purge_done(SENT);
        let purge_skipped = purge_done(SKIPPED);
        let purge_keys = {
            // The cutoff is checked on the deleted row itself, so that a key a writer touched
            // meanwhile (its transaction held the row) is rechecked against its new time and kept.
            let unsent = format!(
                "NOT EXISTS (SELECT 1 FROM {o} WHERE {o}.ordering_key = {k}.ordering_key \
                 AND {})",
                unsent(&format!("{o}.state"))
            );
            let mut p = p();
            let first = p.next();
            PurgeSql {
                sql: if dialect.delete_limit {
                    let limit = p.next();
                    format!(
                        "DELETE FROM {k} WHERE updated_at < {first} AND {unsent} \
                         ORDER BY updated_at LIMIT {limit}"
                    )
                } else {
                    let (second, limit) = (p.next(), p.next());
                    format!(
                        "DELETE FROM {k} WHERE updated_at < {first} AND ordering_key IN \
                         (SELECT ordering_key FROM {k} WHERE updated_at < {second} AND {unsent} \
                         ORDER BY updated_at LIMIT {limit})"
                    )
                },
                binds: if dialect.delete_limit {
                    vec![Bind::Cutoff, Bind::Limit]
                } else {
                    vec![Bind::Cutoff, Bind::Cutoff, Bind::Limit]
                },
            }
        };
        Self {
            dialect: *dialect,
            table: o,
            pending,
            taken,
            insert: insert.into(),
            next_seq: next_seq.into(),
            insert_keyed: insert_keyed.into(),
            notify,
            notifies: true,
            take_unkeyed: take_unkeyed.into(),
            unkeyed_waiting: unkeyed_waiting.into(),
            heads: heads.into(),
            heads_held: heads_held.into(),
            mark_failed: mark_failed.into(),
            backlog: backlog.into(),
            counts: counts.into(),
            parked: parked.into(),
            row: row.into(),
            by_message_id: by_message_id.into(),
            retry: retry.into(),
            skip: skip.into(),
            held: held.into(),
            purge_sent,
            purge_skipped,
            purge_keys,
            channel,
            pooled: false,
        }
    }

    /// The statement that takes the rows `which` selects (a condition, its order and its limit),
    /// skipping rows another relay holds: marking them sent as it locks them, where the dialect
    /// can (see [`OutboxDialect::mark_on_take`]), and returning their `taken` columns.
    fn take(dialect: &Dialect, table: &str, taken: &str, which: &str) -> String {
        let OutboxDialect {
            skip_locked,
            mark_on_take,
            ..
        } = dialect.outbox;
        if mark_on_take {
            format!(
                "UPDATE {table} SET state = {SENT}, sent_at = {now} WHERE id IN \
                 (SELECT id FROM {table} WHERE {which}{skip_locked}) RETURNING {taken}",
                now = dialect.now_ms
            )
        } else {
            format!("SELECT {taken} FROM {table} WHERE {which}{skip_locked}")
        }
    }

    /// Takes the pending, due rows of these `keys` whose numbers lie in each key's range (`(key,
    /// first, last)` triples), skipping rows another relay holds.
    fn take_runs(&self, keys: usize) -> String {
        let mut p = Params::new(&self.dialect);
        let now = self.dialect.now_ms;
        if self.dialect.outbox.runs_joined {
            let runs: Vec<String> = (0..keys)
                .map(|_| format!("({}, {}, {})", p.next(), p.next(), p.next()))
                .collect();
            let which = format!(
                "id IN (SELECT o.id FROM (VALUES {}) r CROSS JOIN {t} o \
                 ON o.ordering_key = r.column1 AND o.ordering_seq >= r.column2 \
                 AND o.ordering_seq <= r.column3 WHERE o.state <> {SENT} \
                 AND o.ordering_key IS NOT NULL AND o.state = {PENDING} AND o.due_at <= {now}) \
                 ORDER BY id",
                runs.join(", "),
                t = self.table
            );
            return Self::take(&self.dialect, &self.table, &self.taken, &which);
        }
        let runs: Vec<String> = (0..keys)
            .map(|_| {
                let (key, first, last) = (p.next(), p.next(), p.next());
                format!(
                    "(ordering_key = {key} AND ordering_seq >= {first} AND ordering_seq <= {last})"
                )
            })
            .collect();
        let which = format!(
            "state = {PENDING} AND due_at <= {now} AND ({}) ORDER BY id",
            runs.join(" OR ")
        );
        Self::take(&self.dialect, &self.pending, &self.taken, &which)
    }

    /// These statements with writers sending the relays' wake-up (where the database has one), or
    /// not.
    /// The statement that wakes the relays, where the database has one and writers send it: its
    /// text names the channel.
    pub(crate) fn wake_up(&self) -> Option<&Arc<str>> {
        self.notify.as_ref().filter(|_| self.notifies)
    }

    pub(crate) fn notifying(self, notifies: bool) -> Self {
        Self { notifies, ..self }
    }

    /// Whether writers send the wake-up.
    pub(crate) fn notifies(&self) -> bool {
        self.notifies
    }

    /// These statements, sent as behind a pooler in transaction mode or not.
    pub(crate) fn with_pooling(self, pooled: bool) -> Self {
        Self { pooled, ..self }
    }

    /// Whether the rows a relay takes are marked sent already (see
    /// [`OutboxDialect::mark_on_take`]).
    pub(crate) fn marks_on_take(&self) -> bool {
        self.dialect.outbox.mark_on_take
    }

    /// Sets these `rows` to `state` (sent, or back to pending).
    fn set_state(&self, rows: usize, state: i64) -> String {
        let mut p = Params::new(&self.dialect);
        let ids: Vec<String> = (0..rows).map(|_| p.next()).collect();
        let sent_at = if state == SENT {
            self.dialect.now_ms
        } else {
            "NULL"
        };
        format!(
            "UPDATE {} SET state = {state}, sent_at = {sent_at} WHERE id IN ({})",
            self.table,
            ids.join(", ")
        )
    }
}

impl QueryBuilder for OutboxStatements {
    fn pooled(&self) -> bool {
        self.pooled
    }
}

/// How a failed publication leaves its row: its new state, attempts, delay before the next
/// attempt, and the error.
#[derive(Debug, Clone, Copy)]
pub struct Failure<'a> {
    pub(crate) id: i64,
    pub(crate) state: i64,
    pub(crate) attempts: i64,
    pub(crate) delay_ms: i64,
    pub(crate) error: &'a str,
}

/// The outbox's statements, run; implemented once for every backend.
pub trait OutboxQueries: Database {
    /// Writes `row` in the open transaction, with its ordering key's next number if it has one;
    /// `true` when its statement proved the transaction the one the inbox began, with nothing
    /// failed in it (see [`Store::commit_proven`](crate::store::Store::commit_proven)).
    fn outbox_insert<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a OutboxStatements,
        row: NewRow<'a>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// Wakes the relays: at once on a connection outside a transaction, at the commit in one.
    /// Nothing where the database cannot, or writers do not.
    fn outbox_notify<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a OutboxStatements,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// Takes, in the open transaction, at most `limit` due rows that no other relay holds: rows
    /// with an ordering key first (at most half of `limit` while rows without one are waiting),
    /// then rows without one, in order.
    ///
    /// The keys are those of `share` whose oldest pending row is oldest first; of each, the rows
    /// from its head (its first row not yet sent, when `parked` holds keys; its first pending row
    /// otherwise) on, in the key's order, as many as the keys share evenly, up to the first that
    /// is not pending and due (in back-off, parked, sent or skipped) or that another relay holds.
    /// A key whose head is not due, or that another relay holds, is left out. A key's rows are
    /// returned consecutive, in its order, so that a relay can publish them one after another.
    fn outbox_take<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a OutboxStatements,
        limit: usize,
        parked: ParkedRows,
        share: KeyShare,
    ) -> impl Future<Output = Result<Vec<TakenRow>, sqlx::Error>> + Send + 'a;

    /// Marks the rows `ids` sent, or (`sent` false) pending again: what a relay took and the
    /// broker did not confirm.
    fn outbox_set_sent<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a OutboxStatements,
        ids: &'a [i64],
        sent: bool,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a;

    /// Records a failed publication of a row.
    fn outbox_mark_failed<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a OutboxStatements,
        failure: Failure<'a>,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// `(pending rows, oldest pending created_at, now)`.
    fn outbox_backlog<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a OutboxStatements,
    ) -> impl Future<Output = Result<(i64, Option<i64>, i64), sqlx::Error>> + Send + 'a;

    /// Rows per state.
    fn outbox_counts<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a OutboxStatements,
    ) -> impl Future<Output = Result<Vec<StateCount>, sqlx::Error>> + Send + 'a;

    /// Parked rows after row `after`, in order.
    fn outbox_parked<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a OutboxStatements,
        after: i64,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<ShownRow>, sqlx::Error>> + Send + 'a;

    /// The row `id`.
    fn outbox_row<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a OutboxStatements,
        id: i64,
    ) -> impl Future<Output = Result<Option<ShownRow>, sqlx::Error>> + Send + 'a;

    /// The rows of the message `message_id`, in order.
    fn outbox_rows_of<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a OutboxStatements,
        message_id: &'a str,
    ) -> impl Future<Output = Result<Vec<ShownRow>, sqlx::Error>> + Send + 'a;

    /// Makes the parked row `id` pending again, due now, with no attempts; whether it was parked.
    fn outbox_retry<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a OutboxStatements,
        id: i64,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// Gives the parked row `id` up: skipped, done as of now; whether it was parked.
    fn outbox_skip<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a OutboxStatements,
        id: i64,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// The parked rows after row `after` that are their key's first row not yet done with, in
    /// order, each with what waits behind it.
    fn outbox_held<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a OutboxStatements,
        after: i64,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<HeldRow>, sqlx::Error>> + Send + 'a;
}

impl<DB> OutboxQueries for DB
where
    DB: Database + sqlx::database::HasStatementCache,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> &'q [u8]: Encode<'q, DB> + Type<DB>,
    for<'q> Option<&'q [u8]>: Encode<'q, DB>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
    for<'r> Option<i64>: Decode<'r, DB>,
    for<'r> i64: Decode<'r, DB>,
    for<'r> Option<bool>: Decode<'r, DB> + Type<DB>,
    for<'r> String: Decode<'r, DB> + Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
    for<'r> TakenRow: sqlx::FromRow<'r, DB::Row>,
    for<'r> ShownRow: sqlx::FromRow<'r, DB::Row>,
    for<'r> HeldRow: sqlx::FromRow<'r, DB::Row>,
    DB::QueryResult: RowsAffected,
{
    async fn outbox_insert(
        conn: &mut DB::Connection,
        statements: &OutboxStatements,
        row: NewRow<'_>,
    ) -> Result<bool, sqlx::Error> {
        let sql = match row.ordering_key {
            Some(key) => {
                statements
                    .query(AssertSqlSafe(statements.next_seq.clone()))
                    .bind(key)
                    .execute(&mut *conn)
                    .await?;
                statements.insert_keyed.clone()
            }
            None => statements.insert.clone(),
        };
        let mut query = statements
            .query(AssertSqlSafe(sql))
            .bind(row.message_id)
            .bind(row.exchange)
            .bind(row.routing_key)
            .bind(row.payload)
            .bind(row.headers)
            .bind(row.origin);
        if let Some(key) = row.ordering_key {
            query = query.bind(key);
        }
        if statements.dialect.own_transaction.is_none() {
            query.execute(conn).await?;
            return Ok(false);
        }
        let proof = query.fetch_optional(conn).await?;
        Ok(match proof {
            Some(row) => sqlx::Row::try_get::<Option<bool>, _>(&row, 0)?.unwrap_or(false),
            None => false,
        })
    }

    async fn outbox_notify(
        conn: &mut DB::Connection,
        statements: &OutboxStatements,
    ) -> Result<(), sqlx::Error> {
        if let Some(notify) = statements.wake_up() {
            statements
                .query(AssertSqlSafe(notify.clone()))
                .execute(conn)
                .await?;
        }
        Ok(())
    }

    async fn outbox_take(
        conn: &mut DB::Connection,
        statements: &OutboxStatements,
        limit: usize,
        parked: ParkedRows,
        share: KeyShare,
    ) -> Result<Vec<TakenRow>, sqlx::Error> {
        let limit = limit.max(1);
        let keys = limit.div_ceil(2);
        let heads = match parked {
            ParkedRows::LetTheKeyGo => &statements.heads,
            ParkedRows::HoldTheKey => &statements.heads_held,
        };
        // As many heads of every key as this share wants of its own.
        let wanted = keys.saturating_mul(share.workers);
        let wanted = i64::try_from(wanted).unwrap_or(i64::MAX);
        let heads: Vec<(String, i64)> = if statements.dialect.outbox.heads.planned_each_batch() {
            let sql = format!("{heads}{wanted}");
            let rows = sqlx::raw_sql(AssertSqlSafe(sql))
                .fetch_all(&mut *conn)
                .await?;
            rows.iter()
                .map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
                .collect::<Result<_, sqlx::Error>>()?
        } else {
            statements
                .query_as(AssertSqlSafe(heads.clone()))
                .bind(wanted)
                .fetch_all(&mut *conn)
                .await?
        };
        let heads: Vec<(String, i64)> = heads
            .into_iter()
            .filter(|(key, _)| share.holds(key))
            .take(keys)
            .collect();
        let mut rows: Vec<TakenRow> = Vec::with_capacity(limit);
        let mut unkeyed_waiting = true;
        if !heads.is_empty() {
            // The keys take half the batch while rows without a key wait, or all of it.
            let (waiting,): (i64,) = statements
                .query_as(AssertSqlSafe(statements.unkeyed_waiting.clone()))
                .fetch_one(&mut *conn)
                .await?;
            unkeyed_waiting = waiting > 0;
            let keyed = if unkeyed_waiting { keys } else { limit };
            let depth = i64::try_from(keyed / heads.len()).unwrap_or(1).max(1);
            let mut query = statements.query_as(AssertSqlSafe(statements.take_runs(heads.len())));
            for (key, seq) in &heads {
                query = query
                    .bind(key.as_str())
                    .bind(*seq)
                    .bind(seq.saturating_add(depth - 1));
            }
            let taken: Vec<TakenRow> = query.fetch_all(&mut *conn).await?;
            let (runs, broken) = consecutive_runs(&heads, taken);
            // Rows past a key's first gap: another relay holds the row before them, or it is not
            // pending and due. Not this batch's: taken marked sent, they are set back.
            if !broken.is_empty() && statements.marks_on_take() {
                let ids: Vec<i64> = broken.iter().map(|row| row.id).collect();
                Self::outbox_set_sent(&mut *conn, statements, &ids, false).await?;
            }
            rows = runs;
        }
        let rest = limit.saturating_sub(rows.len());
        if rest > 0 && unkeyed_waiting {
            let unkeyed: Vec<TakenRow> = statements
                .query_as(AssertSqlSafe(statements.take_unkeyed.clone()))
                .bind(i64::try_from(rest).unwrap_or(i64::MAX))
                .fetch_all(conn)
                .await?;
            rows.extend(unkeyed);
        }
        rows.sort_by_key(|row| row.id);
        Ok(rows)
    }

    async fn outbox_set_sent(
        conn: &mut DB::Connection,
        statements: &OutboxStatements,
        ids: &[i64],
        sent: bool,
    ) -> Result<u64, sqlx::Error> {
        let state = if sent { SENT } else { PENDING };
        let mut done = 0;
        // Bounded statements, well under every database's limit on parameters.
        for chunk in ids.chunks(500) {
            let sql = statements.set_state(chunk.len(), state);
            let mut query = statements.query(AssertSqlSafe(sql));
            for id in chunk {
                query = query.bind(*id);
            }
            done += query.execute(&mut *conn).await?.rows();
        }
        Ok(done)
    }

    async fn outbox_mark_failed(
        conn: &mut DB::Connection,
        statements: &OutboxStatements,
        failure: Failure<'_>,
    ) -> Result<(), sqlx::Error> {
        statements
            .query(AssertSqlSafe(statements.mark_failed.clone()))
            .bind(failure.state)
            .bind(failure.attempts)
            .bind(failure.delay_ms)
            .bind(failure.error)
            .bind(failure.id)
            .execute(conn)
            .await?;
        Ok(())
    }

    async fn outbox_backlog(
        conn: &mut DB::Connection,
        statements: &OutboxStatements,
    ) -> Result<(i64, Option<i64>, i64), sqlx::Error> {
        in_own_transaction!(
            conn,
            statements,
            statements
                .query_as(AssertSqlSafe(statements.backlog.clone()))
                .fetch_one(&mut *conn)
        )
    }

    async fn outbox_counts(
        conn: &mut DB::Connection,
        statements: &OutboxStatements,
    ) -> Result<Vec<StateCount>, sqlx::Error> {
        in_own_transaction!(
            conn,
            statements,
            statements
                .query_as(AssertSqlSafe(statements.counts.clone()))
                .fetch_all(&mut *conn)
        )
    }

    async fn outbox_parked(
        conn: &mut DB::Connection,
        statements: &OutboxStatements,
        after: i64,
        limit: i64,
    ) -> Result<Vec<ShownRow>, sqlx::Error> {
        in_own_transaction!(
            conn,
            statements,
            statements
                .query_as(AssertSqlSafe(statements.parked.clone()))
                .bind(after)
                .bind(limit)
                .fetch_all(&mut *conn)
        )
    }

    async fn outbox_row(
        conn: &mut DB::Connection,
        statements: &OutboxStatements,
        id: i64,
    ) -> Result<Option<ShownRow>, sqlx::Error> {
        in_own_transaction!(
            conn,
            statements,
            statements
                .query_as(AssertSqlSafe(statements.row.clone()))
                .bind(id)
                .fetch_optional(&mut *conn)
        )
    }

    async fn outbox_rows_of(
        conn: &mut DB::Connection,
        statements: &OutboxStatements,
        message_id: &str,
    ) -> Result<Vec<ShownRow>, sqlx::Error> {
        in_own_transaction!(
            conn,
            statements,
            statements
                .query_as(AssertSqlSafe(statements.by_message_id.clone()))
                .bind(message_id)
                .fetch_all(&mut *conn)
        )
    }

    async fn outbox_retry(
        conn: &mut DB::Connection,
        statements: &OutboxStatements,
        id: i64,
    ) -> Result<bool, sqlx::Error> {
        unpark::<DB>(conn, statements, &statements.retry, id).await
    }

    async fn outbox_skip(
        conn: &mut DB::Connection,
        statements: &OutboxStatements,
        id: i64,
    ) -> Result<bool, sqlx::Error> {
        unpark::<DB>(conn, statements, &statements.skip, id).await
    }

    async fn outbox_held(
        conn: &mut DB::Connection,
        statements: &OutboxStatements,
        after: i64,
        limit: i64,
    ) -> Result<Vec<HeldRow>, sqlx::Error> {
        in_own_transaction!(
            conn,
            statements,
            statements
                .query_as(AssertSqlSafe(statements.held.clone()))
                .bind(after)
                .bind(limit)
                .fetch_all(&mut *conn)
        )
    }
}

/// Splits the rows taken of the keys whose `heads` (`(key, first number)`) were asked for into
/// each key's run, its rows from its head on with consecutive numbers, and the rest: all of a key
/// whose head is missing (another relay holds it, or it was sent meanwhile), and a key's rows past
/// a gap in its numbers (a row not pending or not due, or held by another relay).
fn consecutive_runs(
    heads: &[(String, i64)],
    taken: Vec<TakenRow>,
) -> (Vec<TakenRow>, Vec<TakenRow>) {
    let first: std::collections::HashMap<&str, i64> = heads
        .iter()
        .map(|(key, seq)| (key.as_str(), *seq))
        .collect();
    let mut taken = taken;
    taken.sort_by(|a, b| {
        (a.ordering_key.as_deref(), a.ordering_seq)
            .cmp(&(b.ordering_key.as_deref(), b.ordering_seq))
    });
    let (mut runs, mut broken) = (Vec::with_capacity(taken.len()), Vec::new());
    let mut next: Option<(String, i64)> = None;
    for row in taken {
        let (Some(key), Some(seq)) = (row.ordering_key.as_deref(), row.ordering_seq) else {
            broken.push(row);
            continue;
        };
        let expected = match &next {
            Some((run, after)) if run == key => Some(*after),
            _ => first.get(key).copied(),
        };
        if expected == Some(seq) {
            next = Some((key.to_owned(), seq.saturating_add(1)));
            runs.push(row);
        } else {
            // Past the gap, nothing more of this key: expect a number none has.
            next = Some((key.to_owned(), i64::MIN));
            broken.push(row);
        }
    }
    (runs, broken)
}

/// Runs `sql`, which changes the parked row `id` (and no other), in a transaction of its own;
/// whether the row was parked.
async fn unpark<DB>(
    conn: &mut DB::Connection,
    statements: &OutboxStatements,
    sql: &Arc<str>,
    id: i64,
) -> Result<bool, sqlx::Error>
where
    DB: Database + sqlx::database::HasStatementCache,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
    DB::QueryResult: RowsAffected,
{
    let done = in_own_transaction!(
        conn,
        statements,
        statements
            .query(AssertSqlSafe(sql.clone()))
            .bind(id)
            .execute(&mut *conn)
    )?;
    Ok(done.rows() == 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::dialect::{Heads, OutboxDialect};

    fn dialect() -> Dialect {
        Dialect {
            quote: '"',
            question_marks: false,
            insert_ignore: "INSERT INTO",
            on_conflict: " ON CONFLICT DO NOTHING",
            processed_now: "now()",
            now_ms: "NOW_MS",
            time_of_ms: "{}",
            processed_ms: "processed_at",
            text_of: "{}",
            int: "BIGINT",
            upsert_horizon: "",
            delete_limit: false,
            end_own_connection: None,
            own_transaction: None,
            vacuum: None,
            set_schema: None,
            outbox: OutboxDialect {
                skip_locked: " FOR UPDATE SKIP LOCKED",
                next_seq: " ON CONFLICT (ordering_key) DO UPDATE SET last_seq = {k}.last_seq + 1, updated_at = {now}",
                notify: Some("SELECT pg_notify('{c}', '')"),
                mark_on_take: true,
                heads: Heads::SkipScan,
                runs_joined: false,
                pending_index_named: false,
            },
        }
    }

    #[test]
    fn statements_number_their_parameters_in_order() {
        let table = TableName::new("shop").unwrap();
        let s = OutboxStatements::new(&dialect(), &table);
        assert!(s.insert_keyed.ends_with(
            "SELECT $1, $2, $3, $4, $5, $6, 0, 0, NOW_MS, NOW_MS, ordering_key, last_seq \
             FROM \"shop_outbox_keys\" WHERE ordering_key = $7"
        ));
        assert_eq!(
            &*s.next_seq,
            "INSERT INTO \"shop_outbox_keys\" (ordering_key, last_seq, updated_at) VALUES ($1, 1, NOW_MS) \
             ON CONFLICT (ordering_key) DO UPDATE SET last_seq = \"shop_outbox_keys\".last_seq + 1, updated_at = NOW_MS"
        );
        assert!(
            s.take_unkeyed
                .starts_with("UPDATE \"shop_outbox\" SET state = 1, sent_at = NOW_MS WHERE id IN")
        );
        assert!(
            s.take_unkeyed
                .contains("ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED) RETURNING id,")
        );
        assert!(s.take_runs(2).contains(
            "AND ((ordering_key = $1 AND ordering_seq >= $2 AND ordering_seq <= $3) \
             OR (ordering_key = $4 AND ordering_seq >= $5 AND ordering_seq <= $6)) \
             ORDER BY id FOR UPDATE SKIP LOCKED)"
        ));
        assert!(
            s.set_state(3, PENDING)
                .ends_with("SET state = 0, sent_at = NULL WHERE id IN ($1, $2, $3)")
        );
        assert_eq!(
            s.notify.as_deref(),
            Some("SELECT pg_notify('shop_outbox', '')")
        );
        assert_eq!(s.purge_keys.binds.len(), 3);
    }

    fn taken(id: i64, key: &str, seq: i64) -> TakenRow {
        TakenRow {
            id,
            message_id: format!("m{id}"),
            exchange: String::new(),
            routing_key: String::new(),
            payload: Vec::new(),
            headers: None,
            attempts: 0,
            created_at: 0,
            ordering_key: Some(key.to_owned()),
            ordering_seq: Some(seq),
            now_ms: 0,
        }
    }

    #[test]
    fn a_keys_run_starts_at_its_head_and_ends_at_its_first_gap() {
        let heads = [
            ("a".to_owned(), 3),
            ("b".to_owned(), 1),
            ("c".to_owned(), 7),
        ];
        let taken = vec![
            // a: 3, 4, then 6 past the gap (5 is held by another relay, or not due)
            taken(14, "a", 6),
            taken(11, "a", 3),
            taken(12, "a", 4),
            // b: its head 1 is missing (another relay holds it): none of b
            taken(21, "b", 2),
            taken(22, "b", 3),
            // c: 7, 8, 9
            taken(31, "c", 7),
            taken(33, "c", 9),
            taken(32, "c", 8),
        ];
        let (runs, broken) = consecutive_runs(&heads, taken);
        let ids = |rows: &[TakenRow]| rows.iter().map(|row| row.id).collect::<Vec<_>>();
        assert_eq!(ids(&runs), [11, 12, 31, 32, 33]);
        assert_eq!(ids(&broken), [14, 21, 22]);
    }

    #[test]
    fn the_workers_of_a_relay_share_the_keys_between_them() {
        let keys: Vec<String> = (0..200).map(|i| format!("key-{i}")).collect();
        let shares: Vec<KeyShare> = (0..4).map(|worker| KeyShare::of(worker, 4)).collect();
        for key in &keys {
            let holders = shares.iter().filter(|share| share.holds(key)).count();
            assert_eq!(holders, 1, "{key}");
            assert!(KeyShare::ALL.holds(key));
        }
        for share in &shares {
            let held = keys.iter().filter(|key| share.holds(key)).count();
            assert!((25..=75).contains(&held), "{share:?} holds {held} of 200");
        }
    }

    #[test]
    fn parked_rows_hold_their_keys_only_in_the_heads_that_say_so() {
        let table = TableName::new("shop").unwrap();
        let s = OutboxStatements::new(&dialect(), &table);
        assert!(
            s.heads
                .contains("WHERE state = 0 AND ordering_key IS NOT NULL ORDER BY")
        );
        assert!(
            s.heads_held
                .contains("WHERE state <> 1 AND state <> 3 AND ordering_key IS NOT NULL ORDER BY")
        );
        // Either way only a pending head is taken.
        for heads in [&s.heads, &s.heads_held] {
            assert!(
                heads.contains("FROM m WHERE state = 0 AND due_at <= NOW_MS"),
                "{heads}"
            );
        }
        assert!(
            s.skip
                .ends_with("SET state = 3, sent_at = NOW_MS WHERE id = $1 AND state = 2")
        );
        assert!(
            s.purge_skipped
                .sql
                .contains("WHERE state = 3 AND sent_at < $1")
        );
        assert!(
            s.purge_keys
                .sql
                .contains("AND \"shop_outbox\".state <> 1 AND \"shop_outbox\".state <> 3)")
        );
        assert!(s.held.contains("p.id > $1") && s.held.ends_with("LIMIT $2"));
    }
}
