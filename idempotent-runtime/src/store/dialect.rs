//! How a database spells what the inbox's statements need, and the numbering of placeholders: what
//! every table's statements are built from.

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
    /// Has the server end the connection that sends it (the testing kit's lost connection);
    /// `None` where there is no server (SQLite).
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    pub(crate) end_own_connection: Option<&'static str>,
    /// A condition true only inside the transaction the inbox began (PostgreSQL: the mark its
    /// `BEGIN` sets); `None` where the commit proves it otherwise. The response's `UPDATE` carries
    /// it, so that the row it changed proves the transaction, and the commit that follows needs no
    /// read of its own (one round trip fewer).
    pub(crate) own_transaction: Option<&'static str>,
    /// Reclaims the space of a table's deleted rows for its next inserts, after a purge; `{t}` is
    /// the quoted table. `None` where the database does it by itself (InnoDB's purge thread,
    /// SQLite's free list).
    pub(crate) vacuum: Option<&'static str>,
    /// What a claimed transaction's `BEGIN` ends with for an inbox in a schema of its own, the
    /// schema at `{s}`: the body's statements then name tables of that schema (PostgreSQL).
    pub(crate) set_schema: Option<&'static str>,
    /// What the outbox's statements need besides (see [`OutboxDialect`]).
    pub(crate) outbox: OutboxDialect,
}

impl Dialect {
    /// `column` read as text (see [`text_of`](Self::text_of)).
    pub(crate) fn text(&self, column: &str) -> String {
        self.text_of.replace("{}", column)
    }
}

/// What the outbox's statements need that the inbox's do not.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OutboxDialect {
    /// What ends a relay's read of the rows it takes, so that other relays skip them: `FOR
    /// UPDATE SKIP LOCKED` (PostgreSQL, MySQL 8, MariaDB 10.6+), or nothing (SQLite, where the
    /// relay's transaction holds the database's one write lock).
    pub(crate) skip_locked: &'static str,
    /// What ends `INSERT INTO <keys> (ordering_key, last_seq, updated_at) VALUES (…)` so that a
    /// key already there counts one up instead; `{k}` is the quoted keys table, `{now}` the clock.
    pub(crate) next_seq: &'static str,
    /// The statement that wakes the relays listening on channel `{c}` when the transaction
    /// commits (PostgreSQL's `NOTIFY`), if the database has one.
    pub(crate) notify: Option<&'static str>,
    /// A relay takes its rows with `UPDATE … RETURNING`, marking them sent in the statement that
    /// locks them (PostgreSQL, SQLite: one write per row); failures are set back before the
    /// commit. Otherwise (MySQL, MariaDB: no `UPDATE … RETURNING`) it locks them with a `SELECT`
    /// and marks the confirmed ones afterwards.
    pub(crate) mark_on_take: bool,
    /// How the relay finds each ordering key's head.
    pub(crate) heads: Heads,
    /// The relay takes its keys' runs of rows by joining the list of them to the
    /// `(ordering_key, ordering_seq)` index, the partial index's condition written out (SQLite,
    /// which read every pending row for the `OR` of the runs: 120 ms a batch off 200,000 pending
    /// rows, 1.5 ms joined), rather than by that `OR`.
    pub(crate) runs_joined: bool,
    /// The relay's reads of pending rows by state and key (the rows without a key, whether any
    /// waits, the keys' runs) name the `(state, ordering_key, ordering_seq, id)` index (`FORCE
    /// INDEX`: MySQL, MariaDB), and a row without a key is read as one without a number too, so
    /// that the index gives those in id order. MariaDB 10.11 otherwise read the rows without a
    /// key by the primary key from the table's start, through every sent row the retention
    /// keeps, and the keys' runs by the `(state, sent_at)` index, through every pending row: a
    /// batch of 100 read 5,205 index entries after 5,000 sent rows, and 5,608 of 5,000 pending
    /// keyed ones on statistics of the empty table (205 and 857 with the index named:
    /// `tests/mysql`, `relay_reads`).
    pub(crate) pending_index_named: bool,
}

/// How a relay finds each ordering key's head (its lowest number among the candidate rows).
/// (Each backend's feature builds its own.)
#[cfg_attr(
    not(all(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code)
)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Heads {
    /// From key to key through the `(ordering_key, ordering_seq)` index, one probe a key
    /// (PostgreSQL's `LATERAL`).
    SkipScan,
    /// From key to key through the same index, a correlated subquery a step, each spelling out
    /// the partial index's `state <> 1`, without which SQLite does not read that index, and the
    /// heads joined to their rows by `CROSS JOIN`, which keeps SQLite from reading every pending
    /// row to look each up among the heads (1 ms for 50 keys of 200,000 pending rows, where
    /// grouping by key read all of them, 180 ms, and the same skip scan without `CROSS JOIN`
    /// 190 ms on SQLite 3.51).
    SkipScanBySubqueries,
    /// Grouped by state and key, which the `(state, ordering_key, ordering_seq, id)` index reads
    /// one entry a group (MariaDB's and MySQL's loose index scan: 1.5 ms for 50 keys of 200,000
    /// rows, where grouping by key alone read all of them, 34–65 ms), then by key. Planned at
    /// each batch (see [`Heads::planned_each_batch`]).
    GroupedByStateAndKey,
}

impl Heads {
    /// Whether the heads' statement is sent as text with its limit written in, so that the
    /// database plans it at each batch, rather than prepared once per connection. MariaDB 10.11
    /// kept the prepared statement of [`GroupedByStateAndKey`](Heads::GroupedByStateAndKey) off
    /// its loose index scan once its table had been emptied by `TRUNCATE` (`tests/mysql`,
    /// `relay_reads`: 10,708 index entries read for a batch of 100 of 5,000 pending rows, 857
    /// planned anew), and in the benchmark after `DELETE` and `OPTIMIZE` too, for as long as the
    /// connection lived: every pending row read at each batch, 110–170 ms off 200,000 rows
    /// against 1 ms. Prepared anew at each batch instead, it cost the keyed drain a third.
    pub(crate) fn planned_each_batch(self) -> bool {
        self == Heads::GroupedByStateAndKey
    }
}

/// Numbers placeholders as the dialect wants them.
pub(crate) struct Params {
    question_marks: bool,
    next: usize,
}

impl Params {
    /// Starts numbering at the first placeholder.
    pub(crate) fn new(dialect: &Dialect) -> Self {
        Self {
            question_marks: dialect.question_marks,
            next: 0,
        }
    }

    /// Returns the next placeholder.
    pub(crate) fn next(&mut self) -> String {
        self.next += 1;
        if self.question_marks {
            "?".to_owned()
        } else {
            format!("${}", self.next)
        }
    }

    /// Returns `consumer = ? AND message_key = ?`, which picks one row of a key.
    pub(crate) fn key(&mut self) -> String {
        format!(
            "consumer = {} AND message_key = {}",
            self.next(),
            self.next()
        )
    }
}
