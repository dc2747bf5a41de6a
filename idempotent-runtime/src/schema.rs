//! The versions of the inbox's tables, and the upgrades between them.
//!
//! The tables record their version in `<table>_schema`, one row per version migrated to.
//! [`Inbox::migrate`](crate::Inbox::migrate) finds the version (no inbox table: none; an inbox
//! table without `<table>_schema`: 1, the tables of the first release), refuses tables newer than
//! [`CURRENT_VERSION`] with [`InboxError::SchemaTooNew`], and runs every upgrade from the version
//! found, under a lock that serializes concurrent migrations (PostgreSQL: an advisory lock, in the
//! one transaction the whole upgrade runs in; SQLite: `BEGIN IMMEDIATE`; MySQL, whose DDL commits
//! implicitly: `GET_LOCK`, with steps that can be run again if an upgrade was cut off half-way).
//!
//! | version | what it has |
//! |---|---|
//! | 1 | the inbox table and `<table>_calls` |
//! | 2 | `<table>_calls.updated_at` (the retention of call records; calls recorded before the upgrade count from the upgrade), `<table>_horizons` (each consumer's purge horizon), `<table>_audit` (messages forgotten on purpose), `<table>_schema` |
//! | 3 | `<table>_outbox` (the [outbox](crate::outbox)'s outgoing messages) and `<table>_outbox_keys` (the last number given to each ordering key) |
//! | 4 | `<table>_outbox_skipped`, the index the purge of skipped outgoing messages reads (PostgreSQL and SQLite; MySQL's `(state, sent_at)` index of version 3 serves it) |
//! | 5 | `<table>_outbox_unkeyed`, the index of the pending outgoing messages without an ordering key, which the relay reads to take them and to learn whether any wait, in a time that does not grow with a backlog of keyed ones (PostgreSQL and SQLite; MySQL's `(state, ordering_key, ordering_seq, id)` index of version 3 serves it) |
//!
//! ## Where the tables are
//!
//! The tables are those of the schema or database the connection creates tables in, and only
//! those: on PostgreSQL `current_schema()`, the first schema of the connection's `search_path`
//! that exists; on MySQL/MariaDB `DATABASE()`, the URL's database; on SQLite the `main` database.
//! `migrate()` looks for the tables (and their version) there alone, and creates them there when
//! they are missing, even when a schema later in the `search_path` (`public`) has tables of the
//! same name: tenants by schema (a pool per tenant whose `search_path` is `tenant_a, public`) or by
//! database each get tables of their own. The inbox's statements name the tables without a schema,
//! so the server finds them in the first schema of the `search_path` that has them, which, once
//! `migrate()` (or the [`ddl`], run on the same connection settings) has created them, is that
//! same schema. Migrate each tenant's pool (or run the DDL in each tenant's schema): a pool whose
//! own schema has no tables would use those of the next schema of its `search_path`.
//!
//! An inbox made for a tenant's schema ([`Inbox::with_schema`](crate::Inbox::with_schema),
//! PostgreSQL) looks for and creates its tables in that schema, and names them with it in every
//! statement, whatever the connection's `search_path`; [`ddl`] of a
//! [`TableName::in_schema`](crate::TableName::in_schema) gives its DDL.
//!
//! Teams that run their own migrations take the same statements from [`ddl`] (or the CLI's
//! `idempotent ddl`), including the row that records the version, so that a later `migrate()`
//! knows where the tables stand.

use crate::error::{InboxError, Stage};
use crate::session::{Session, Source};
use crate::store::{Backend, Statements, database_error};
use crate::table::TableName;

/// The schema version this library creates and upgrades to.
pub const CURRENT_VERSION: u32 = 5;

/// What a migration did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Migration {
    /// The version the tables had: 0 when there were none.
    pub from: u32,
    /// The version they have now, [`CURRENT_VERSION`].
    pub to: u32,
}

/// Returns the SQL that brings `table`'s tables from version `from` (0: no tables) to
/// [`CURRENT_VERSION`] on the database `DB`, ending with the row that records the version: for
/// teams that run their own migrations. Statements that create something create it only if it is
/// missing, except where the database has no such clause (SQLite and MySQL's `ADD COLUMN`, MySQL's
/// `CREATE INDEX`): run those once.
pub fn ddl<DB: Backend>(table: &TableName, from: u32) -> Vec<String> {
    let statements = Statements::new(DB::DIALECT, table);
    steps::<DB>(table, &statements, from)
}

fn steps<DB: Backend>(table: &TableName, statements: &Statements, from: u32) -> Vec<String> {
    let mut steps = Vec::new();
    if from >= CURRENT_VERSION {
        return steps;
    }
    if from == 0 {
        steps.extend(DB::base_ddl(table));
    }
    for to in from.max(1) + 1..=CURRENT_VERSION {
        steps.extend(DB::upgrade_ddl(table, to));
    }
    steps.push(statements.audit.record_version(CURRENT_VERSION));
    steps
}

/// Creates or upgrades the tables; see the module docs. Dropped half-way, it leaves nothing held:
/// its connection is closed (which rolls back and releases the lock), except on SQLite, whose
/// driver rolls back itself.
pub(crate) async fn migrate<DB: Backend>(
    source: Source<'_, DB>,
    statements: &Statements,
    table: &TableName,
) -> Result<Migration, InboxError> {
    let failed = database_error(Stage::Migrate);
    let mut session = Session::take(source).await.map_err(failed)?;
    // One step from the lock to its release: a migration dropped in between closes the session.
    let migrated = session
        .try_step(|conn| async move {
            DB::lock_migration(conn, table)
                .await
                .map_err(database_error(Stage::Migrate))?;
            let migrated = upgrade::<DB>(conn, statements, table).await;
            DB::unlock_migration(conn, table, migrated.is_ok())
                .await
                .map_err(database_error(Stage::Migrate))?;
            Ok::<_, InboxError>(migrated)
        })
        .await?;
    if let Ok(Migration { from, to }) = migrated
        && from != to
    {
        tracing::info!(%table, from, to, "migrated the inbox tables");
    }
    migrated
}

async fn upgrade<DB: Backend>(
    conn: &mut DB::Connection,
    statements: &Statements,
    table: &TableName,
) -> Result<Migration, InboxError> {
    let failed = || database_error(Stage::Migrate);
    let found = version::<DB>(conn, statements, table)
        .await
        .map_err(failed())?;
    if found > CURRENT_VERSION {
        return Err(InboxError::SchemaTooNew {
            table: table.to_string(),
            found,
            supported: CURRENT_VERSION,
        });
    }
    for step in steps::<DB>(table, statements, found) {
        match DB::run(conn, &step).await {
            Err(error) if !DB::applied_before(&error) => return Err(failed()(error)),
            _ => {}
        }
    }
    Ok(Migration {
        from: found,
        to: CURRENT_VERSION,
    })
}

/// The version of `table`'s tables; see the module docs.
async fn version<DB: Backend>(
    conn: &mut DB::Connection,
    statements: &Statements,
    table: &TableName,
) -> Result<u32, sqlx::Error> {
    let schema = format!("{}_schema", table.as_str());
    if DB::table_exists(conn, table.schema(), &schema).await?
        && let Some(version) = DB::schema_version(conn, &statements.audit).await?
    {
        return Ok(u32::try_from(version).unwrap_or(u32::MAX));
    }
    Ok(u32::from(
        DB::table_exists(conn, table.schema(), table.as_str()).await?,
    ))
}
