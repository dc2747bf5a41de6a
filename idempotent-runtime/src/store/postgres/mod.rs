//! The inbox on PostgreSQL.
//!
//! The handler's `READ COMMITTED` transaction begins with `BEGIN` and marks itself with a
//! transaction-local setting (`SET LOCAL idempotent.claim = 'on'`, in the same message). The claim
//! is then `INSERT … ON CONFLICT DO NOTHING` on the primary key, a statement each session prepares
//! once: no error for a duplicate, nothing in the server's log. When another transaction has
//! inserted the same key and not yet ended, the insert waits for it on the index entry: after that
//! transaction rolls back the insert goes ahead (ours to process), after it commits the insert does
//! nothing (a duplicate). There is no read before the write.
//!
//! Before it commits, the inbox reads the mark back: the read fails when a statement of the body
//! failed and the body carried on (PostgreSQL has aborted the transaction, and a `COMMIT` would
//! quietly roll it back), and it finds no mark when the body ended the transaction itself
//! (`COMMIT`, `ROLLBACK`) and perhaps began another. Either way the inbox rolls back what is open
//! and reports it; it never reports such a message as processed. (An aborted transaction cannot
//! say whose it was: after its rollback, the key found committed says that the body had committed
//! the inbox's transaction itself and failed in one it began, `TransactionEnded`; otherwise it was
//! the inbox's, `TransactionAborted`, nothing committed.) That read is one round trip,
//! saved where the inbox's own last statement proved the mark: the stored response's `UPDATE`
//! changes the row only while the mark is set, each outgoing row's `INSERT` returns the mark
//! (`RETURNING current_setting(…)`; a row written after the body ended the transaction is written
//! as before, and proves nothing), and nothing runs between the last of them and the commit but
//! the inbox's own statements.
//!
//! [`Inbox::with_pipelined_claim`](crate::Inbox::with_pipelined_claim) sends the claim in the same
//! message as the `BEGIN` instead, `BEGIN; SET LOCAL …; EXECUTE idempotent_claim_…(…)`, which saves
//! a round trip: a committed duplicate then makes that insert fail with a unique violation, which
//! is how the inbox learns it. The price: the server writes each such unique violation to its log
//! (at `ERROR`, with the statement, and so the key's hex), leaves a dead row version for `VACUUM`,
//! and logs one `prepared statement does not exist` per new session (per session and tenant, for
//! tenants in schemas) before it prepares the claim. A body's `DEALLOCATE ALL` takes the claims
//! and sqlx's own statements: the claim that finds its statement missing forgets sqlx's statement
//! cache before it prepares again when the session holds fewer of sqlx's statements than the
//! cache has (a session that only never prepared this tenant's claim keeps it).
//! Behind a pooler in transaction mode (PgBouncer), which does not keep a session's prepared
//! statements, it falls back to the quiet claim message by message, and an inbox made
//! [`with_transaction_pooling`](crate::Inbox::with_transaction_pooling) sends the quiet claim
//! straight away. Its values travel as hex
//! digits that the statement decodes (`decode('…', 'hex')`), so no byte of a key or a consumer name
//! is ever spliced into SQL.
//!
//! ```sql
//! CREATE TABLE "idempotent_inbox" (
//!     consumer     TEXT        NOT NULL,
//!     message_key  BYTEA       NOT NULL,
//!     processed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
//!     response     BYTEA,      -- the body's value, with store_response
//!     fingerprint  BYTEA,      -- SHA-256 of the fingerprinted fields
//!     PRIMARY KEY (consumer, message_key)
//! );
//! CREATE INDEX "idempotent_inbox_processed_at" ON "idempotent_inbox" (processed_at);
//! CREATE TABLE "idempotent_inbox_calls" (
//!     consumer     TEXT    NOT NULL,
//!     message_key  BYTEA   NOT NULL,
//!     call_name    TEXT    NOT NULL,
//!     fence        BIGINT  NOT NULL,
//!     lease_until  BIGINT  NOT NULL,  -- the database's clock, Unix milliseconds
//!     completed    BOOLEAN NOT NULL,
//!     result       BYTEA,
//!     updated_at   BIGINT  NOT NULL DEFAULT 0,  -- last change, Unix milliseconds (version 2)
//!     PRIMARY KEY (consumer, message_key, call_name)
//! );
//! -- version 2: "idempotent_inbox_horizons" (consumer, purged_until), "idempotent_inbox_audit"
//! -- (id, consumer, key_digest, reason, processed_at, forgotten_at), "idempotent_inbox_schema"
//! -- (version, migrated_at); `idempotent ddl` prints them all
//! ```
//!
//! Only one instance purges a table at a time: the purger holds a session advisory lock on the
//! table's OID while it runs (closing its session if the purge is dropped half-way). Behind a
//! pooler in transaction mode ([`Inbox::with_transaction_pooling`](crate::Inbox::with_transaction_pooling)),
//! where a session's lock would be released by the pooler's reset or stay with a server session
//! out of the unlock's reach, it holds a transaction's advisory lock instead, with that
//! transaction left open, idle, for the purge's length.

use sha2::{Digest, Sha256};
use sqlx::postgres::{PgConnection, PgDatabaseError, PgTransactionManager};
use sqlx::{AssertSqlSafe, Executor, PgPool, Postgres, Row, SqlSafeStr};
use sqlx_core::transaction::TransactionManager;

use super::inbox::InboxStatements;
use super::{
    Backend, Dialect, Ending, HandlerConnection, Heads, OutboxDialect, QueryBuilder, RolledBack,
    Store,
};
use crate::error::Fault;
use crate::key::hex;
use crate::table::TableName;

/// Serializes concurrent `migrate()` calls, whose `CREATE … IF NOT EXISTS` can otherwise race.
const MIGRATE_LOCK: i64 = 0x1de4_7e47_0001;

/// The purger's advisory lock, given the quoted table name: the pair (a constant, the table's
/// OID), so that tables of the same name in different schemas purge independently.
const PURGE_LOCK_KEY: &str = "1768453, coalesce(to_regclass($1)::oid::int, 0)";

impl HandlerConnection for PgConnection {
    type Backend = Postgres;
}

mod settings {
    /// How a PostgreSQL inbox claims; see the [module docs](super).
    #[derive(Debug, Clone, Default)]
    pub struct PgSettings {
        pub pipelined: bool,
    }
}
use settings::PgSettings;

mod listen;

/// The settings of an inbox that sends its claim with its `BEGIN`.
pub(crate) fn pipelined() -> PgSettings {
    PgSettings { pipelined: true }
}

impl Backend for Postgres {}

impl Store for Postgres {
    const DIALECT: Dialect = Dialect {
        quote: '"',
        question_marks: false,
        insert_ignore: "INSERT INTO",
        on_conflict: " ON CONFLICT DO NOTHING",
        processed_now: "now()",
        now_ms: "(extract(epoch FROM clock_timestamp()) * 1000)::bigint",
        time_of_ms: "(to_timestamp(0) + {} * interval '1 millisecond')",
        processed_ms: "CAST(floor(extract(epoch FROM processed_at) * 1000) AS BIGINT)",
        text_of: "{}",
        int: "BIGINT",
        upsert_horizon: " ON CONFLICT (consumer) DO UPDATE \
            SET purged_until = GREATEST({h}.purged_until, EXCLUDED.purged_until)",
        delete_limit: false,
        end_own_connection: Some("SELECT pg_terminate_backend(pg_backend_pid())"),
        own_transaction: Some("current_setting('idempotent.claim', true) = 'on'"),
        vacuum: Some("VACUUM {t}"),
        set_schema: Some("; SET LOCAL search_path TO {s}"),
        outbox: OutboxDialect {
            skip_locked: " FOR UPDATE SKIP LOCKED",
            next_seq: " ON CONFLICT (ordering_key) DO UPDATE \
                SET last_seq = {k}.last_seq + 1, updated_at = {now}",
            notify: Some("SELECT pg_notify('{c}', '')"),
            mark_on_take: true,
            heads: Heads::SkipScan,
            runs_joined: false,
            pending_index_named: false,
        },
    };

    const BEGIN: &'static str = "BEGIN; SET LOCAL idempotent.claim = 'on'";

    /// Without JIT compilation: the planner's estimate of the keys' heads (a recursive skip scan)
    /// passes `jit_above_cost` whatever the rows, and compiling it took 20–90 ms of every batch,
    /// the key index empty or not (a relay drained 2,985 rows/s off a backlog of 200,000 rows
    /// without a key, 57,478 without JIT).
    const BEGIN_RELAY: &'static str =
        "BEGIN; SET LOCAL idempotent.claim = 'on'; SET LOCAL jit = off";

    type Settings = PgSettings;
    type TransactionState = ();

    async fn ready_transaction(_conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        Ok(())
    }

    fn pipelined_claim(
        settings: &PgSettings,
        statements: &InboxStatements,
        begin: &str,
        consumer: &str,
        key: &[u8],
        fingerprint: Option<&[u8]>,
    ) -> Option<String> {
        // Behind a pooler in transaction mode the session that prepared the claim is gone by the
        // next transaction: the quiet claim, always.
        (settings.pipelined && !statements.pooled).then(|| {
            let fingerprint = fingerprint.map_or_else(
                || "NULL".to_owned(),
                |fingerprint| format!("decode('{}', 'hex')", hex(fingerprint)),
            );
            format!(
                "{begin}; EXECUTE {}(convert_from(decode('{}', 'hex'), 'UTF8'), decode('{}', 'hex'), {fingerprint})",
                PreparedClaim::new(statements).name,
                hex(consumer.as_bytes()),
                hex(key),
            )
        })
    }

    async fn prepare_pipelined_claim(
        conn: &mut PgConnection,
        _settings: &PgSettings,
        statements: &InboxStatements,
    ) -> Result<(), sqlx::Error> {
        let prepare = PreparedClaim::new(statements).prepare;
        conn.execute(AssertSqlSafe(prepare)).await?;
        Ok(())
    }

    async fn lost_driver_statements(conn: &mut PgConnection) -> Result<bool, sqlx::Error> {
        let cached = sqlx::Connection::cached_statements_size(&*conn);
        if cached == 0 {
            return Ok(false);
        }
        // Unprepared: after a `DEALLOCATE ALL` the driver's cached statements are stale. sqlx
        // names its statements `sqlx_s_<n>`; the session holds every one the cache has unless
        // some were taken.
        let row = sqlx::raw_sql(
            "SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'sqlx\\_s\\_%'",
        )
        .fetch_one(&mut *conn)
        .await?;
        let held = row.try_get::<i64, _>(0)?;
        Ok(usize::try_from(held).map_or(true, |held| held < cached))
    }

    async fn commit(conn: &mut PgConnection, _state: &()) -> Result<Ending, sqlx::Error> {
        let ending = match mark(conn).await? {
            Mark::Set => {
                PgTransactionManager::commit(conn).await?;
                return Ok(Ending::Committed);
            }
            Mark::Gone => Ending::Replaced {
                later_writes_refused: false,
            },
            Mark::Aborted => Ending::Aborted,
        };
        // Ends what is open: the aborted transaction, one the body began, or (if nothing is open)
        // only sqlx's count of it.
        PgTransactionManager::rollback(conn).await?;
        Ok(ending)
    }

    async fn commit_proven(conn: &mut PgConnection, _state: &()) -> Result<Ending, sqlx::Error> {
        PgTransactionManager::commit(conn).await?;
        Ok(Ending::Committed)
    }

    async fn rollback(conn: &mut PgConnection, _state: &()) -> Result<(), sqlx::Error> {
        PgTransactionManager::rollback(conn).await
    }

    async fn rollback_checked(
        conn: &mut PgConnection,
        _state: &(),
    ) -> Result<RolledBack, sqlx::Error> {
        let rolled_back = match mark(conn).await? {
            Mark::Set => RolledBack::Own,
            // A body that ended the inbox's transaction, began another and failed in that one
            // cannot be told apart from the inbox's here; its claim, committed or not, tells.
            Mark::Aborted => RolledBack::Aborted,
            Mark::Gone => RolledBack::Replaced {
                later_writes_refused: false,
            },
        };
        PgTransactionManager::rollback(conn).await?;
        Ok(rolled_back)
    }

    fn fault(error: &dyn sqlx::error::DatabaseError) -> Option<Fault> {
        let error = error.try_downcast_ref::<PgDatabaseError>()?;
        Some(fault_of_code(error.code()))
    }

    fn lost_statement(error: &sqlx::Error) -> bool {
        sqlstate(error) == Some("26000")
    }

    fn statement_exists(error: &sqlx::Error) -> bool {
        sqlstate(error) == Some("42P05")
    }

    fn base_ddl(table: &TableName) -> Vec<String> {
        let t = table.quoted('"');
        let index = table.index("processed_at", '"');
        let calls = table.quoted_suffixed("calls", '"');
        vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {t} (
    consumer     TEXT        NOT NULL,
    message_key  BYTEA       NOT NULL,
    processed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    response     BYTEA,
    fingerprint  BYTEA,
    PRIMARY KEY (consumer, message_key)
)"
            ),
            format!("CREATE INDEX IF NOT EXISTS {index} ON {t} (processed_at)"),
            format!(
                "CREATE TABLE IF NOT EXISTS {calls} (
    consumer    TEXT    NOT NULL,
    message_key BYTEA   NOT NULL,
    call_name   TEXT    NOT NULL,
    fence       BIGINT  NOT NULL,
    lease_until BIGINT  NOT NULL,
    completed   BOOLEAN NOT NULL,
    result      BYTEA,
    PRIMARY KEY (consumer, message_key, call_name)
)"
            ),
        ]
    }

    fn upgrade_ddl(table: &TableName, to: u32) -> Vec<String> {
        let q = |suffix| table.quoted_suffixed(suffix, '"');
        let i = |suffix| table.index(suffix, '"');
        let (calls, horizons, audit, schema) = (q("calls"), q("horizons"), q("audit"), q("schema"));
        let now_ms = Self::DIALECT.now_ms;
        match to {
            2 => vec![
                format!(
                    "ALTER TABLE {calls} ADD COLUMN IF NOT EXISTS updated_at BIGINT NOT NULL DEFAULT 0"
                ),
                format!("UPDATE {calls} SET updated_at = {now_ms} WHERE updated_at = 0"),
                format!(
                    "CREATE INDEX IF NOT EXISTS {} ON {calls} (updated_at)",
                    i("calls_updated")
                ),
                format!(
                    "CREATE TABLE IF NOT EXISTS {horizons} (
    consumer     TEXT   NOT NULL PRIMARY KEY,
    purged_until BIGINT NOT NULL
)"
                ),
                format!(
                    "CREATE TABLE IF NOT EXISTS {audit} (
    id           BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer     TEXT   NOT NULL,
    key_digest   TEXT   NOT NULL,
    reason       TEXT   NOT NULL,
    processed_at BIGINT,
    forgotten_at BIGINT NOT NULL
)"
                ),
                format!(
                    "CREATE INDEX IF NOT EXISTS {} ON {audit} (forgotten_at)",
                    i("audit_at")
                ),
                format!(
                    "CREATE TABLE IF NOT EXISTS {schema} (
    version     INTEGER NOT NULL PRIMARY KEY,
    migrated_at BIGINT  NOT NULL
)"
                ),
            ],
            3 => {
                let (outbox, keys) = (q("outbox"), q("outbox_keys"));
                vec![
                    format!(
                        "CREATE TABLE IF NOT EXISTS {outbox} (
    id           BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id   TEXT   NOT NULL,
    exchange     TEXT   NOT NULL,
    routing_key  TEXT   NOT NULL,
    payload      BYTEA  NOT NULL,
    headers      BYTEA,
    origin       TEXT   NOT NULL,
    ordering_key TEXT,
    ordering_seq BIGINT,
    state        BIGINT NOT NULL,
    attempts     BIGINT NOT NULL,
    created_at   BIGINT NOT NULL,
    due_at       BIGINT NOT NULL,
    sent_at      BIGINT,
    last_error   TEXT
)"
                    ),
                    format!(
                        "CREATE INDEX IF NOT EXISTS {} ON {outbox} (id) WHERE state = 0",
                        i("outbox_pending")
                    ),
                    format!(
                        "CREATE INDEX IF NOT EXISTS {} ON {outbox} (ordering_key, ordering_seq) \
                         WHERE state <> 1 AND ordering_key IS NOT NULL",
                        i("outbox_key_seq")
                    ),
                    format!(
                        "CREATE INDEX IF NOT EXISTS {} ON {outbox} (sent_at) WHERE state = 1",
                        i("outbox_sent")
                    ),
                    format!(
                        "CREATE TABLE IF NOT EXISTS {keys} (
    ordering_key TEXT   NOT NULL PRIMARY KEY,
    last_seq     BIGINT NOT NULL,
    updated_at   BIGINT NOT NULL
)"
                    ),
                    format!(
                        "CREATE INDEX IF NOT EXISTS {} ON {keys} (updated_at)",
                        i("outbox_keys_at")
                    ),
                ]
            }
            // Skipped outgoing messages, purged by the time they were skipped.
            4 => vec![format!(
                "CREATE INDEX IF NOT EXISTS {} ON {} (sent_at) WHERE state = 3",
                i("outbox_skipped"),
                q("outbox")
            )],
            // The pending outgoing messages without an ordering key, which a relay looks for at
            // each batch: among the pending rows, past every keyed one of a backlog.
            5 => vec![format!(
                "CREATE INDEX IF NOT EXISTS {} ON {} (id) WHERE state = 0 AND ordering_key IS NULL",
                i("outbox_unkeyed"),
                q("outbox")
            )],
            _ => Vec::new(),
        }
    }

    async fn lock_migration(
        conn: &mut PgConnection,
        _table: &TableName,
    ) -> Result<(), sqlx::Error> {
        PgTransactionManager::begin(conn, None).await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .persistent(false)
            .bind(MIGRATE_LOCK)
            .execute(conn)
            .await?;
        Ok(())
    }

    async fn unlock_migration(
        conn: &mut PgConnection,
        _table: &TableName,
        commit: bool,
    ) -> Result<(), sqlx::Error> {
        if commit {
            PgTransactionManager::commit(conn).await
        } else {
            PgTransactionManager::rollback(conn).await
        }
    }

    /// Looks in the inbox's schema, or else in the schema tables are created in
    /// (`current_schema()`, the first schema of the `search_path` that exists), not along the
    /// whole `search_path`: a table of the same name in a later schema (`public`) belongs to
    /// someone else, and is not this connection's.
    async fn table_exists(
        conn: &mut PgConnection,
        schema: Option<&str>,
        name: &str,
    ) -> Result<bool, sqlx::Error> {
        sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_class c \
             JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = coalesce($2, current_schema()) AND c.relname = $1)",
        )
        .persistent(false)
        .bind(name)
        .bind(schema)
        .fetch_one(conn)
        .await
    }

    async fn claim_batch(
        conn: &mut PgConnection,
        statements: &InboxStatements,
        consumer: &str,
        keys: &[&[u8]],
    ) -> Result<Vec<Vec<u8>>, sqlx::Error> {
        let keys: Vec<Vec<u8>> = keys.iter().map(|k| k.to_vec()).collect();
        statements
            .query_scalar(AssertSqlSafe(statements.table_sql(
                "INSERT INTO {t} (consumer, message_key) \
             SELECT $1, k FROM unnest($2::bytea[]) AS u(k) ORDER BY k \
             ON CONFLICT DO NOTHING RETURNING message_key",
            )))
            .bind(consumer)
            .bind(keys)
            .fetch_all(conn)
            .await
    }

    async fn try_lock_purge(
        conn: &mut PgConnection,
        table: &TableName,
        pooled: bool,
    ) -> Result<bool, sqlx::Error> {
        if !pooled {
            return sqlx::query_scalar(AssertSqlSafe(format!(
                "SELECT pg_try_advisory_lock({PURGE_LOCK_KEY})"
            )))
            .bind(table.quoted('"'))
            .fetch_one(conn)
            .await;
        }
        // A session's lock would stay with whichever server session the pooler ran the statement
        // on, for as long as the pooler keeps it, out of reach of the unlock. A transaction's lock
        // ends with its transaction: the lock's transaction stays open for the purge's length
        // (it holds no snapshot, so it holds back no vacuum), and pins its server session.
        PgTransactionManager::begin(conn, None).await?;
        let locked: bool = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT pg_try_advisory_xact_lock({PURGE_LOCK_KEY})"
        )))
        .persistent(false)
        .bind(table.quoted('"'))
        .fetch_one(&mut *conn)
        .await?;
        if !locked {
            PgTransactionManager::rollback(conn).await?;
        }
        Ok(locked)
    }

    async fn unlock_purge(
        conn: &mut PgConnection,
        table: &TableName,
        pooled: bool,
    ) -> Result<(), sqlx::Error> {
        if pooled {
            return PgTransactionManager::commit(conn).await;
        }
        sqlx::query(AssertSqlSafe(format!(
            "SELECT pg_advisory_unlock({PURGE_LOCK_KEY})"
        )))
        .bind(table.quoted('"'))
        .execute(conn)
        .await?;
        Ok(())
    }

    async fn transaction_pooled(pool: &PgPool) -> Result<bool, sqlx::Error> {
        transaction_pooled(pool).await
    }

    fn listen_outbox(
        pool: &sqlx::Pool<Postgres>,
        channel: &str,
        wake: std::sync::Arc<dyn Fn() + Send + Sync>,
    ) -> Option<tokio::task::JoinHandle<()>> {
        Some(tokio::spawn(listen::listen(
            pool.clone(),
            channel.to_owned(),
            wake,
        )))
    }

    fn listen_scope(pool: &PgPool) -> String {
        let options = pool.connect_options();
        format!(
            "{}@{}:{}/{}",
            options.get_username(),
            options.get_host(),
            options.get_port(),
            options.get_database().unwrap_or_default()
        )
    }
}

/// Whether a pooler in transaction mode sits between `pool` and PostgreSQL: a statement prepared
/// on one of its connections is then missing from that connection's next transaction, or shows up
/// in another client's. A session keeps its prepared statements to itself; a pooler hands the
/// server session a transaction ran on to the next client (PgBouncer: the one it freed last, so
/// another client's transaction, opened right after, sees the statement). Three rounds, so that a
/// busy pooler that happens to hand the session back to the same client is still found out.
async fn transaction_pooled(pool: &PgPool) -> Result<bool, sqlx::Error> {
    use sqlx::ConnectOptions;
    let mut ours = pool.acquire().await?;
    let mut other = pool.connect_options().connect().await?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_nanos());
    let mut pooled = false;
    for round in 0..3 {
        // Only digits and letters, spliced into the probe's statements.
        let name = format!("idempotent_probe_{}_{nanos}_{round}", std::process::id());
        let has = format!("SELECT count(*) FROM pg_prepared_statements WHERE name = '{name}'");
        let has = AssertSqlSafe(has).into_sql_str();
        ours.execute(AssertSqlSafe(format!("PREPARE {name} AS SELECT 1")))
            .await?;
        other.execute("BEGIN").await?;
        let elsewhere: i64 = sqlx::raw_sql(has.clone())
            .fetch_one(&mut other)
            .await?
            .try_get(0)?;
        let here: i64 = sqlx::raw_sql(has).fetch_one(&mut *ours).await?.try_get(0)?;
        other.execute("ROLLBACK").await?;
        if elsewhere > 0 || here == 0 {
            pooled = true;
            break;
        }
        ours.execute(AssertSqlSafe(format!("DEALLOCATE {name}")))
            .await?;
    }
    // The connection that prepared a probe still may hold it: it is closed, not handed back.
    if pooled {
        ours.close_on_drop();
    }
    let _ = sqlx::Connection::close(other).await;
    Ok(pooled)
}

/// The pipelined claim as a statement a session prepares: `PREPARE idempotent_claim_…` and its
/// name, the same for every session using one table (the name has a digest of the statement).
struct PreparedClaim {
    name: String,
    prepare: String,
}

impl PreparedClaim {
    fn new(statements: &InboxStatements) -> Self {
        let insert = statements
            .table_sql("INSERT INTO {t} (consumer, message_key, fingerprint) VALUES ($1, $2, $3)");
        let name = format!("idempotent_claim_{}", &hex(&Sha256::digest(&insert))[..16]);
        let prepare = format!("PREPARE {name} (text, bytea, bytea) AS {insert}");
        Self { name, prepare }
    }
}

/// The SQLSTATE of a database error.
fn sqlstate(error: &sqlx::Error) -> Option<&str> {
    error
        .as_database_error()
        .and_then(|error| error.try_downcast_ref::<PgDatabaseError>())
        .map(PgDatabaseError::code)
}

/// What a SQLSTATE says about a retry: serialization failure, deadlock, lock not available, a
/// statement timeout, too many connections, the server starting up and a transaction aborted by an
/// earlier failure (25P02, as [`InboxError::TransactionAborted`](crate::InboxError)) are
/// transient; the server
/// shutting down, every connection exception (class 08), a prepared statement the session lost or
/// unexpectedly has (26000, 42P05: sqlx's statement cache cannot recover from either; behind a
/// pooler in transaction mode that the inbox was not told about, the session changed under it) and
/// a write refused as read-only (25006: the session is on a standby, such as a failed primary
/// brought back as one, or a standby not yet promoted; another connection may reach the primary)
/// break the connection.
fn fault_of_code(code: &str) -> Fault {
    match code {
        "40001" | "40P01" | "55P03" | "57014" | "57P03" | "53300" | "25P02" => Fault::Transient,
        "57P01" | "57P02" | "26000" | "42P05" | "25006" => Fault::Broken,
        _ if code.starts_with("08") => Fault::Broken,
        _ => Fault::None,
    }
}

/// What [`mark`] found of the mark the inbox's `BEGIN` sets.
enum Mark {
    /// Set: the open transaction is the one the inbox began.
    Set,
    /// Gone: the body ended that transaction (and may have begun another).
    Gone,
    /// The transaction is aborted (a statement failed in it): the mark cannot be read.
    Aborted,
}

/// Reads the mark of the inbox's transaction (`SET LOCAL idempotent.claim`), which ends with it.
/// Unprepared: a body's `DEALLOCATE ALL` cannot leave it stale in sqlx's statement cache.
async fn mark(conn: &mut PgConnection) -> Result<Mark, sqlx::Error> {
    let mark = sqlx::raw_sql("SELECT current_setting('idempotent.claim', true)")
        .fetch_one(&mut *conn)
        .await
        .and_then(|row| row.try_get::<Option<String>, _>(0));
    match mark {
        Ok(Some(mark)) if mark == "on" => Ok(Mark::Set),
        Ok(_) => Ok(Mark::Gone),
        Err(error) if sqlstate(&error) == Some("25P02") => Ok(Mark::Aborted),
        Err(error) => Err(error),
    }
}

#[cfg(test)]
mod tests {
    use super::{Fault, fault_of_code};

    #[test]
    fn transient_sqlstates_are_retryable() {
        for code in ["40001", "40P01", "55P03", "57014", "53300", "25P02"] {
            assert_eq!(fault_of_code(code), Fault::Transient, "{code}");
        }
        for code in ["57P01", "08006", "08003", "26000", "42P05", "25006"] {
            assert_eq!(fault_of_code(code), Fault::Broken, "{code}");
        }
        for code in ["23505", "42P01", "22P02", "42501"] {
            assert_eq!(fault_of_code(code), Fault::None, "{code}");
        }
    }
}
