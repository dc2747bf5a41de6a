//! The SQL an inbox runs, built once from its validated table name and the database's dialect.

use std::sync::Arc;

use super::outbox::{OutboxDialect, OutboxStatements};
use crate::table::TableName;

/// A row of the calls table: `(fence, lease_until, completed, result, now)`, times in milliseconds
/// of the database's clock.
pub(crate) type CallRow = (i64, i64, bool, Option<Vec<u8>>, i64);

/// What a duplicate's inbox row holds: `(response, fingerprint)`.
pub(crate) type StoredRow = (Option<Vec<u8>>, Option<Vec<u8>>);

/// An inbox row as [`Statements::inspect`] reads it: `(processed_ms, response, fingerprint)`.
pub(crate) type InspectRow = (i64, Option<Vec<u8>>, Option<Vec<u8>>);

/// An inbox row as [`Statements::list`] reads it: `(key, processed_ms, fingerprint,
/// response_len)`.
pub(crate) type ListRow = (Vec<u8>, i64, Option<Vec<u8>>, Option<i64>);

/// A pending call as [`Statements::stuck_calls`] reads it: `(consumer, key, name, fence,
/// lease_until, now)`.
pub(crate) type StuckRow = (String, Vec<u8>, String, i64, i64, i64);

/// An audit row: `(consumer, key_digest, reason, processed_ms, forgotten_ms)`.
pub(crate) type AuditRow = (String, String, String, Option<i64>, i64);

/// Identifies one call to an outside service: the message's consumer and key, and the call's name.
#[derive(Debug, Clone, Copy)]
pub struct CallId<'a> {
    pub(crate) consumer: &'a str,
    pub(crate) key: &'a [u8],
    pub(crate) name: &'a str,
}

/// How a database spells what the inbox's statements need.
#[derive(Debug, Clone, Copy)]
pub struct Dialect {
    /// Quotes identifiers.
    pub(crate) quote: char,
    /// Placeholders are `?` (MySQL) rather than `$1`, `$2`, ….
    pub(crate) question_marks: bool,
    /// How "insert unless the primary key exists" begins, and what ends it.
    pub(crate) insert_ignore: &'static str,
    pub(crate) on_conflict: &'static str,
    /// The value of `processed_at` for a new row.
    pub(crate) processed_now: &'static str,
    /// The database's clock, in milliseconds since the Unix epoch.
    pub(crate) now_ms: &'static str,
    /// The `processed_at` value of a time in milliseconds since the Unix epoch; `{}` is the
    /// placeholder of the milliseconds.
    pub(crate) time_of_ms: &'static str,
    /// `processed_at` in milliseconds since the Unix epoch.
    pub(crate) processed_ms: &'static str,
    /// A name column read as text (MySQL stores names binary); `{}` is the column.
    pub(crate) text_of: &'static str,
    /// The type of a 64-bit integer in a `CAST`.
    pub(crate) int: &'static str,
    /// What ends `INSERT INTO <horizons> … VALUES …` so that a consumer's horizon only moves
    /// forward; `{h}` is the quoted table.
    pub(crate) upsert_horizon: &'static str,
    /// `DELETE … ORDER BY … LIMIT` is allowed (MySQL), rather than a subquery on the key.
    pub(crate) delete_limit: bool,
    /// What the outbox's statements need besides (see [`OutboxDialect`]).
    pub(crate) outbox: OutboxDialect,
}

/// The SQL an inbox runs, built once from its validated table name.
#[derive(Debug, Clone)]
pub struct Statements {
    dialect: Dialect,
    table: String,
    calls: String,
    audit: String,
    schema: String,
    pub(crate) claim: Arc<str>,
    pub(crate) stored: Arc<str>,
    pub(crate) set_response: Arc<str>,
    pub(crate) forget_claim: Arc<str>,
    pub(crate) call_insert: Arc<str>,
    pub(crate) call_read: Arc<str>,
    pub(crate) call_take_over: Arc<str>,
    pub(crate) call_complete: Arc<str>,
    /// The database's clock, in milliseconds.
    pub(crate) now: Arc<str>,
    /// A consumer's purge horizon (milliseconds of the database's clock), if it has one.
    pub(crate) horizon: Arc<str>,
    /// Moves a consumer's horizon forward to a bound time, never back.
    pub(crate) record_horizon: Arc<str>,
    /// One inbox row: [`InspectRow`].
    pub(crate) inspect: Arc<str>,
    /// A page of a consumer's rows in a time range, after a cursor: [`ListRow`]s.
    pub(crate) list: Arc<str>,
    /// Pending calls whose lease expired, of one consumer or every one: [`StuckRow`]s.
    pub(crate) stuck_calls: Arc<str>,
    /// Deletes one inbox row.
    pub(crate) forget: Arc<str>,
    /// Records a forgotten row in the audit table.
    pub(crate) audit_insert: Arc<str>,
    /// A consumer's (or every consumer's) audit rows, newest first: [`AuditRow`]s.
    pub(crate) audit_read: Arc<str>,
    /// Rows and the oldest row per consumer.
    pub(crate) stats_rows: Arc<str>,
    /// Pending and stuck calls per consumer.
    pub(crate) stats_calls: Arc<str>,
    /// Every consumer's horizon.
    pub(crate) stats_horizons: Arc<str>,
    /// The newest schema version recorded.
    pub(crate) schema_version: Arc<str>,
    pub(crate) call_release: Arc<str>,
    /// Moves a pending call's lease end to now plus a lease, if its fence is still the one given.
    pub(crate) call_extend: Arc<str>,
    /// The rest of a pending call's live lease, in milliseconds; no row when it has none (the
    /// HTTP layer's claim, which must not run while a leased route holds the key).
    pub(crate) call_pending: Arc<str>,
    /// Replaces the response of an inbox row that has none, or has the one given (the HTTP
    /// layer's answer for a request whose handler committed the key itself).
    pub(crate) fill_response: Arc<str>,
    /// A pooler in transaction mode (PgBouncer's `pool_mode = transaction`) sits between the inbox
    /// and the database, and hands each transaction whichever server session is free. So the
    /// inbox's statements are not prepared (a prepared statement lives in one server session, and
    /// sqlx names them alike on every connection), and those it runs outside a handler's
    /// transaction run in a transaction of their own: outside a transaction the pooler may send a
    /// statement's parse and its execution to two different sessions.
    pub(crate) pooled: bool,
    /// The outbox's statements (`<table>_outbox`).
    pub(crate) outbox: OutboxStatements,
}

/// Numbers placeholders as the dialect wants them.
pub(super) struct Params {
    question_marks: bool,
    next: usize,
}

impl Params {
    pub(super) fn new(dialect: &Dialect) -> Self {
        Self {
            question_marks: dialect.question_marks,
            next: 0,
        }
    }

    pub(super) fn next(&mut self) -> String {
        self.next += 1;
        if self.question_marks {
            "?".to_owned()
        } else {
            format!("${}", self.next)
        }
    }
}

/// What a purge statement binds, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bind {
    /// The cutoff, in milliseconds of the database's clock.
    Cutoff,
    /// The scope's consumer names (none, one, or every overridden one).
    Consumers,
    /// The batch size.
    Limit,
}

/// A statement of the purge and what it binds.
#[derive(Debug, Clone)]
pub struct PurgeSql {
    pub(crate) sql: String,
    pub(crate) binds: Vec<Bind>,
}

/// Whose rows one pass of the purge deletes.
#[derive(Debug, Clone, Copy)]
pub(crate) enum PurgeScope {
    /// One consumer with a retention of its own.
    Consumer,
    /// Every consumer but this many overridden ones.
    AllBut(usize),
}

/// The statements of one pass of the purge: the horizon it records before it deletes, then the
/// batches of each table, and the counts of a dry run.
#[derive(Debug, Clone)]
pub(crate) struct PurgeStatements {
    /// The consumers with expired rows, whose horizons the pass moves up to the cutoff: a read,
    /// which takes no lock a claim would wait for.
    pub(crate) expiring: PurgeSql,
    /// Deletes a batch of expired inbox rows, oldest first.
    pub(crate) rows: PurgeSql,
    /// Deletes a batch of expired call records: completed, or pending with a lease that ran out,
    /// and untouched since the cutoff.
    pub(crate) calls: PurgeSql,
    /// Deletes a batch of expired audit rows.
    pub(crate) audit: PurgeSql,
    /// `(consumer, count)` of what `rows`, `calls` and `audit` would delete.
    pub(crate) count: [PurgeSql; 3],
}

impl Statements {
    pub(crate) fn new(dialect: Dialect, table: &TableName) -> Self {
        let q = dialect.quote;
        let t = table.quoted(q);
        let c = table.quoted_suffixed("calls", q);
        let h = table.quoted_suffixed("horizons", q);
        let a = table.quoted_suffixed("audit", q);
        let v = table.quoted_suffixed("schema", q);
        let Dialect {
            insert_ignore,
            on_conflict,
            processed_now,
            now_ms,
            processed_ms,
            text_of,
            int,
            time_of_ms,
            ..
        } = dialect;
        let consumer_text = text_of.replace("{}", "consumer");
        let p = || Params::new(&dialect);
        let key =
            |p: &mut Params| format!("consumer = {} AND message_key = {}", p.next(), p.next());
        let call = |p: &mut Params| {
            format!(
                "consumer = {} AND message_key = {} AND call_name = {}",
                p.next(),
                p.next(),
                p.next()
            )
        };
        let claim = {
            let mut p = p();
            let (a, b, f) = (p.next(), p.next(), p.next());
            format!(
                "{insert_ignore} {t} (consumer, message_key, fingerprint, processed_at) \
                 VALUES ({a}, {b}, {f}, {processed_now}){on_conflict}"
            )
        };
        let stored = format!(
            "SELECT response, fingerprint FROM {t} WHERE {}",
            key(&mut p())
        );
        let forget_claim = format!("DELETE FROM {t} WHERE {}", key(&mut p()));
        let set_response = {
            let mut p = p();
            let r = p.next();
            format!("UPDATE {t} SET response = {r} WHERE {}", key(&mut p))
        };
        let call_insert = {
            let mut p = p();
            let (a, b, n, l) = (p.next(), p.next(), p.next(), p.next());
            format!(
                "{insert_ignore} {c} (consumer, message_key, call_name, fence, lease_until, completed, updated_at) \
                 VALUES ({a}, {b}, {n}, 1, {now_ms} + {l}, FALSE, {now_ms}){on_conflict}"
            )
        };
        let call_read = format!(
            "SELECT fence, lease_until, completed, result, {now_ms} FROM {c} WHERE {}",
            call(&mut p())
        );
        let call_take_over = {
            let mut p = p();
            let l = p.next();
            let which = call(&mut p);
            let f = p.next();
            format!(
                "UPDATE {c} SET fence = fence + 1, lease_until = {now_ms} + {l}, updated_at = {now_ms} \
                 WHERE {which} AND fence = {f} AND completed = FALSE AND lease_until <= {now_ms}"
            )
        };
        let call_complete = {
            let mut p = p();
            let r = p.next();
            let which = call(&mut p);
            let f = p.next();
            format!(
                "UPDATE {c} SET completed = TRUE, result = {r}, updated_at = {now_ms} \
                 WHERE {which} AND fence = {f} AND completed = FALSE"
            )
        };
        let horizon = format!(
            "SELECT purged_until FROM {h} WHERE consumer = {}",
            p().next()
        );
        let record_horizon = {
            let mut p = p();
            let (consumer, until) = (p.next(), p.next());
            format!(
                "INSERT INTO {h} (consumer, purged_until) VALUES ({consumer}, {until}){}",
                dialect.upsert_horizon.replace("{h}", &h)
            )
        };
        let inspect = format!(
            "SELECT {processed_ms}, response, fingerprint FROM {t} WHERE {}",
            key(&mut p())
        );
        let list = {
            let mut p = p();
            let (consumer, from, until) = (p.next(), p.next(), p.next());
            let (at, at_again, after, limit) = (p.next(), p.next(), p.next(), p.next());
            let from = time_of_ms.replace("{}", &from);
            let until = time_of_ms.replace("{}", &until);
            format!(
                "SELECT message_key, {processed_ms}, fingerprint, CAST(LENGTH(response) AS {int}) \
                 FROM {t} WHERE consumer = {consumer} \
                 AND processed_at >= {from} AND processed_at < {until} \
                 AND ({processed_ms} > {at} OR ({processed_ms} = {at_again} AND message_key > {after})) \
                 ORDER BY {processed_ms}, message_key LIMIT {limit}"
            )
        };
        let stuck_calls = {
            let mut p = p();
            let (any, consumer, limit) = (p.next(), p.next(), p.next());
            format!(
                "SELECT {consumer_text}, message_key, {}, fence, lease_until, {now_ms} FROM {c} \
                 WHERE completed = FALSE AND lease_until < {now_ms} \
                 AND ({any} = 1 OR consumer = {consumer}) \
                 ORDER BY lease_until, consumer, message_key, call_name LIMIT {limit}",
                text_of.replace("{}", "call_name")
            )
        };
        let forget = format!("DELETE FROM {t} WHERE {}", key(&mut p()));
        let audit_insert = {
            let mut p = p();
            let (consumer, digest, reason, processed) = (p.next(), p.next(), p.next(), p.next());
            format!(
                "INSERT INTO {a} (consumer, key_digest, reason, processed_at, forgotten_at) \
                 VALUES ({consumer}, {digest}, {reason}, {processed}, {now_ms})"
            )
        };
        let audit_read = {
            let mut p = p();
            let (any, consumer, limit) = (p.next(), p.next(), p.next());
            format!(
                "SELECT {consumer_text}, key_digest, reason, processed_at, forgotten_at FROM {a} \
                 WHERE ({any} = 1 OR consumer = {consumer}) ORDER BY id DESC LIMIT {limit}"
            )
        };
        let stats_rows = format!(
            "SELECT {consumer_text}, COUNT(*), MIN({processed_ms}) FROM {t} GROUP BY consumer"
        );
        let stats_calls = format!(
            "SELECT {consumer_text}, COUNT(*), \
             COUNT(CASE WHEN lease_until < {now_ms} THEN 1 END) \
             FROM {c} WHERE completed = FALSE GROUP BY consumer"
        );
        let stats_horizons = format!("SELECT {consumer_text}, purged_until FROM {h}");
        let schema_version = format!("SELECT CAST(MAX(version) AS {int}) FROM {v}");
        let call_release = {
            let mut p = p();
            let which = call(&mut p);
            let f = p.next();
            format!("DELETE FROM {c} WHERE {which} AND fence = {f} AND completed = FALSE")
        };
        let call_extend = {
            let mut p = p();
            let l = p.next();
            let which = call(&mut p);
            let f = p.next();
            format!(
                "UPDATE {c} SET lease_until = {now_ms} + {l}, updated_at = {now_ms} \
                 WHERE {which} AND fence = {f} AND completed = FALSE"
            )
        };
        let call_pending = format!(
            "SELECT lease_until - {now_ms} FROM {c} \
             WHERE {} AND completed = FALSE AND lease_until > {now_ms}",
            call(&mut p())
        );
        let fill_response = {
            let mut p = p();
            let r = p.next();
            let which = key(&mut p);
            let tried = p.next();
            format!(
                "UPDATE {t} SET response = {r} WHERE {which} \
                 AND (response IS NULL OR response = {tried})"
            )
        };
        Statements {
            dialect,
            table: t,
            calls: c,
            audit: a,
            schema: v,
            claim: claim.into(),
            stored: stored.into(),
            set_response: set_response.into(),
            forget_claim: forget_claim.into(),
            call_insert: call_insert.into(),
            call_read: call_read.into(),
            call_take_over: call_take_over.into(),
            call_complete: call_complete.into(),
            now: format!("SELECT {now_ms}").into(),
            horizon: horizon.into(),
            record_horizon: record_horizon.into(),
            inspect: inspect.into(),
            list: list.into(),
            stuck_calls: stuck_calls.into(),
            forget: forget.into(),
            audit_insert: audit_insert.into(),
            audit_read: audit_read.into(),
            stats_rows: stats_rows.into(),
            stats_calls: stats_calls.into(),
            stats_horizons: stats_horizons.into(),
            schema_version: schema_version.into(),
            call_release: call_release.into(),
            call_extend: call_extend.into(),
            call_pending: call_pending.into(),
            fill_response: fill_response.into(),
            pooled: false,
            outbox: OutboxStatements::new(&dialect, table),
        }
    }

    /// These statements, sent as behind a pooler in transaction mode or not (see
    /// [`pooled`](Self::pooled)).
    pub(crate) fn with_pooling(self, pooled: bool) -> Self {
        Self {
            pooled,
            outbox: self.outbox.clone().with_pooling(pooled),
            ..self
        }
    }

    /// `template` with `{t}` replaced by the quoted table name.
    #[cfg(any(feature = "postgres", feature = "sqlite"))]
    pub(crate) fn table_sql(&self, template: &str) -> String {
        template.replace("{t}", &self.table)
    }

    /// Records `version` as the tables' schema version (no bound values: it is part of the DDL).
    pub(crate) fn record_version(&self, version: u32) -> String {
        let Dialect {
            insert_ignore,
            on_conflict,
            now_ms,
            ..
        } = self.dialect;
        format!(
            "{insert_ignore} {} (version, migrated_at) VALUES ({version}, {now_ms}){on_conflict}",
            self.schema
        )
    }

    /// The statements of one pass of the purge over `scope`; see [`PurgeStatements`].
    pub(crate) fn purge(&self, scope: PurgeScope) -> PurgeStatements {
        let Dialect {
            time_of_ms,
            text_of,
            delete_limit,
            ..
        } = self.dialect;
        let (t, c, a) = (&self.table, &self.calls, &self.audit);
        let consumer_text = text_of.replace("{}", "consumer");
        // `WHERE` of the expired rows of a table, given the condition on the cutoff, and its binds.
        let expired = |condition: &str, cutoffs: usize, p: &mut Params| {
            let mut binds = vec![Bind::Cutoff; cutoffs];
            let mut sql = condition.to_owned();
            for _ in 0..cutoffs {
                sql = sql.replacen("{}", &p.next(), 1);
            }
            match scope {
                PurgeScope::Consumer => {
                    sql.push_str(&format!(" AND consumer = {}", p.next()));
                    binds.push(Bind::Consumers);
                }
                PurgeScope::AllBut(0) => {}
                PurgeScope::AllBut(others) => {
                    let names: Vec<String> = (0..others).map(|_| p.next()).collect();
                    sql.push_str(&format!(" AND consumer NOT IN ({})", names.join(", ")));
                    binds.push(Bind::Consumers);
                }
            }
            (sql, binds)
        };
        let rows_expired = format!("processed_at < {time_of_ms}");
        let calls_expired = "updated_at < {} AND (completed = TRUE OR lease_until < {})";
        let audit_expired = "forgotten_at < {}";
        // Deletes a batch, oldest first: by `ORDER BY … LIMIT` or through the primary key.
        let delete = |table: &str, condition: &str, cutoffs: usize, order: &str, key: &str| {
            let mut p = Params::new(&self.dialect);
            let (which, mut binds) = expired(condition, cutoffs, &mut p);
            let limit = p.next();
            binds.push(Bind::Limit);
            let sql = if delete_limit {
                format!("DELETE FROM {table} WHERE {which} ORDER BY {order} LIMIT {limit}")
            } else {
                format!(
                    "DELETE FROM {table} WHERE ({key}) IN \
                     (SELECT {key} FROM {table} WHERE {which} ORDER BY {order} LIMIT {limit})"
                )
            };
            PurgeSql { sql, binds }
        };
        let count = |table: &str, condition: &str, cutoffs: usize| {
            let mut p = Params::new(&self.dialect);
            let (which, binds) = expired(condition, cutoffs, &mut p);
            PurgeSql {
                sql: format!(
                    "SELECT {consumer_text}, COUNT(*) FROM {table} WHERE {which} GROUP BY consumer"
                ),
                binds,
            }
        };
        let expiring = {
            let mut p = Params::new(&self.dialect);
            let (which, binds) = expired(&rows_expired, 1, &mut p);
            PurgeSql {
                sql: format!("SELECT DISTINCT {consumer_text} FROM {t} WHERE {which}"),
                binds,
            }
        };
        PurgeStatements {
            expiring,
            rows: delete(t, &rows_expired, 1, "processed_at", "consumer, message_key"),
            calls: delete(
                c,
                calls_expired,
                2,
                "updated_at",
                "consumer, message_key, call_name",
            ),
            audit: delete(a, audit_expired, 1, "forgotten_at", "id"),
            count: [
                count(t, &rows_expired, 1),
                count(c, calls_expired, 2),
                count(a, audit_expired, 1),
            ],
        }
    }
}
