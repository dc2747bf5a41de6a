//! The SQL an inbox runs, built once from its validated table name and the database's dialect:
//! each table's statements, built by the table's module.

use super::audit::AuditStatements;
use super::calls::CallStatements;
use super::dialect::Dialect;
use super::inbox::InboxStatements;
use super::outbox::OutboxStatements;
use super::purge::HorizonStatements;
use super::stats::StatsStatements;
use crate::table::TableName;

/// The SQL an inbox runs, built once from its validated table name.
// Public (and sealed) because the HTTP layer's backend trait takes it; unreachable without it.
#[cfg_attr(not(feature = "http"), allow(unreachable_pub))]
#[derive(Debug, Clone)]
pub struct Statements {
    /// The inbox table's (`<table>`).
    pub(crate) inbox: InboxStatements,
    /// The calls table's (`<table>_calls`).
    pub(crate) calls: CallStatements,
    /// The horizons table's, and the purge's (`<table>_horizons`).
    pub(crate) horizons: HorizonStatements,
    /// The audit and schema tables' (`<table>_audit`, `<table>_schema`).
    pub(crate) audit: AuditStatements,
    /// The operators' summary of every table.
    pub(crate) stats: StatsStatements,
    /// The outbox's (`<table>_outbox`, `<table>_outbox_keys`).
    pub(crate) outbox: OutboxStatements,
    /// A pooler in transaction mode (PgBouncer's `pool_mode = transaction`) sits between the inbox
    /// and the database, and hands each transaction whichever server session is free. So the
    /// inbox's statements are not prepared (a prepared statement lives in one server session, and
    /// sqlx names them alike on every connection), and those it runs outside a handler's
    /// transaction run in a transaction of their own: outside a transaction the pooler may send a
    /// statement's parse and its execution to two different sessions.
    pub(crate) pooled: bool,
    /// What the inbox's `BEGIN`s end with: in an inbox made for a schema, the statement that makes
    /// the body's tables that schema's ([`Dialect::set_schema`]); empty otherwise.
    pub(crate) begin_suffix: String,
    /// The HTTP layer's claim on PostgreSQL, built on the layer's first request (see
    /// [`try_claim`](super::try_claim)).
    #[cfg(all(feature = "http", feature = "postgres"))]
    pub(crate) try_claim: std::sync::OnceLock<std::sync::Arc<str>>,
}

impl Statements {
    /// Builds every table's statements for `table` in `dialect`.
    pub(crate) fn new(dialect: Dialect, table: &TableName) -> Self {
        Self {
            inbox: InboxStatements::new(&dialect, table),
            calls: CallStatements::new(&dialect, table),
            horizons: HorizonStatements::new(&dialect, table),
            audit: AuditStatements::new(&dialect, table),
            stats: StatsStatements::new(&dialect, table),
            outbox: OutboxStatements::new(&dialect, table),
            pooled: false,
            begin_suffix: match (dialect.set_schema, table.schema()) {
                (Some(sql), Some(schema)) => {
                    sql.replace("{s}", &format!("{q}{schema}{q}", q = dialect.quote))
                }
                _ => String::new(),
            },
            #[cfg(all(feature = "http", feature = "postgres"))]
            try_claim: std::sync::OnceLock::new(),
        }
    }

    /// These statements, sent as behind a pooler in transaction mode or not (see
    /// [`pooled`](Self::pooled)).
    pub(crate) fn with_pooling(mut self, pooled: bool) -> Self {
        self.pooled = pooled;
        self.inbox.pooled = pooled;
        self.calls.pooled = pooled;
        self.horizons.pooled = pooled;
        self.audit.pooled = pooled;
        self.stats.pooled = pooled;
        self.outbox = self.outbox.with_pooling(pooled);
        self
    }
}
