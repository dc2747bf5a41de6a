//! The SQL an inbox runs, built once from its validated table name and the database's dialect.

use std::sync::Arc;

use crate::table::TableName;

/// A row of the calls table: `(fence, lease_until, completed, result, now)`, times in milliseconds
/// of the database's clock.
pub(crate) type CallRow = (i64, i64, bool, Option<Vec<u8>>, i64);

/// What a duplicate's inbox row holds: `(response, fingerprint)`.
pub(crate) type StoredRow = (Option<Vec<u8>>, Option<Vec<u8>>);

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
    /// `processed_at` more than the bound number of milliseconds ago; `{}` is the placeholder.
    pub(crate) older_than: &'static str,
    /// `DELETE … ORDER BY … LIMIT` is allowed (MySQL), rather than a subquery on the key.
    pub(crate) delete_limit: bool,
}

/// The SQL an inbox runs, built once from its validated table name.
#[derive(Debug, Clone)]
pub struct Statements {
    dialect: Dialect,
    table: String,
    pub(crate) claim: Arc<str>,
    pub(crate) stored: Arc<str>,
    pub(crate) set_response: Arc<str>,
    pub(crate) call_insert: Arc<str>,
    pub(crate) call_read: Arc<str>,
    pub(crate) call_take_over: Arc<str>,
    pub(crate) call_complete: Arc<str>,
    /// A pooler in transaction mode (PgBouncer's `pool_mode = transaction`) sits between the inbox
    /// and the database, and hands each transaction whichever server session is free. So the
    /// inbox's statements are not prepared (a prepared statement lives in one server session, and
    /// sqlx names them alike on every connection), and those it runs outside a handler's
    /// transaction run in a transaction of their own: outside a transaction the pooler may send a
    /// statement's parse and its execution to two different sessions.
    pub(crate) pooled: bool,
}

/// Numbers placeholders as the dialect wants them.
struct Params {
    question_marks: bool,
    next: usize,
}

impl Params {
    fn next(&mut self) -> String {
        self.next += 1;
        if self.question_marks {
            "?".to_owned()
        } else {
            format!("${}", self.next)
        }
    }
}

impl Statements {
    pub(crate) fn new(dialect: Dialect, table: &TableName) -> Self {
        let t = table.quoted(dialect.quote);
        let c = table.quoted_suffixed("calls", dialect.quote);
        let Dialect {
            insert_ignore,
            on_conflict,
            processed_now,
            now_ms,
            ..
        } = dialect;
        let p = || Params {
            question_marks: dialect.question_marks,
            next: 0,
        };
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
        let set_response = {
            let mut p = p();
            let r = p.next();
            format!("UPDATE {t} SET response = {r} WHERE {}", key(&mut p))
        };
        let call_insert = {
            let mut p = p();
            let (a, b, n, l) = (p.next(), p.next(), p.next(), p.next());
            format!(
                "{insert_ignore} {c} (consumer, message_key, call_name, fence, lease_until, completed) \
                 VALUES ({a}, {b}, {n}, 1, {now_ms} + {l}, FALSE){on_conflict}"
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
                "UPDATE {c} SET fence = fence + 1, lease_until = {now_ms} + {l} \
                 WHERE {which} AND fence = {f} AND completed = FALSE AND lease_until <= {now_ms}"
            )
        };
        let call_complete = {
            let mut p = p();
            let r = p.next();
            let which = call(&mut p);
            let f = p.next();
            format!(
                "UPDATE {c} SET completed = TRUE, result = {r} \
                 WHERE {which} AND fence = {f} AND completed = FALSE"
            )
        };
        Statements {
            dialect,
            table: t,
            claim: claim.into(),
            stored: stored.into(),
            set_response: set_response.into(),
            call_insert: call_insert.into(),
            call_read: call_read.into(),
            call_take_over: call_take_over.into(),
            call_complete: call_complete.into(),
            pooled: false,
        }
    }

    /// These statements, sent as behind a pooler in transaction mode or not (see
    /// [`pooled`](Self::pooled)).
    pub(crate) fn with_pooling(self, pooled: bool) -> Self {
        Self { pooled, ..self }
    }

    /// `template` with `{t}` replaced by the quoted table name.
    #[cfg(any(feature = "postgres", feature = "sqlite"))]
    pub(crate) fn table_sql(&self, template: &str) -> String {
        template.replace("{t}", &self.table)
    }

    /// Deletes up to a bound number of rows processed more than a bound number of milliseconds
    /// ago, oldest first, of the consumer (`Some(1)`) or of every consumer but `others` ones
    /// (`None`). Binds: retention in milliseconds, the consumer names, the batch size.
    pub(crate) fn purge(&self, consumer: bool, others: usize) -> String {
        let t = &self.table;
        let mut p = Params {
            question_marks: self.dialect.question_marks,
            next: 0,
        };
        let older = self.dialect.older_than.replace("{}", &p.next());
        let scope = if consumer {
            format!(" AND consumer = {}", p.next())
        } else if others > 0 {
            let names: Vec<String> = (0..others).map(|_| p.next()).collect();
            format!(" AND consumer NOT IN ({})", names.join(", "))
        } else {
            String::new()
        };
        let limit = p.next();
        if self.dialect.delete_limit {
            format!("DELETE FROM {t} WHERE {older}{scope} ORDER BY processed_at LIMIT {limit}")
        } else {
            format!(
                "DELETE FROM {t} WHERE (consumer, message_key) IN \
                 (SELECT consumer, message_key FROM {t} WHERE {older}{scope} \
                 ORDER BY processed_at LIMIT {limit})"
            )
        }
    }
}
