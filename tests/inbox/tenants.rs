//! Tenants side by side on one server: by schema on PostgreSQL (each tenant's pool has a
//! `search_path` of its own schema, then a shared one that has the tables already, as `public`
//! often does), by database on MySQL/MariaDB. `migrate()` creates each tenant's tables where its
//! connections create tables, and every statement then uses those: the same keys are processed
//! once in each tenant, each tenant's effects and rows in its own tables, none in the shared ones.
#![cfg(all(feature = "postgres", feature = "mysql"))]

#[path = "../support/mod.rs"]
mod support;

use idempotent::outbox::{Destination, OutgoingMessage};
use idempotent::{Backend, Inbox};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, ConnectOptions};

use support::CREATE_EFFECTS;

/// Messages per tenant, with the same keys in each.
const MESSAGES: usize = 60;

/// Every table the inbox has at the current version, by its suffix.
const TABLES: [&str; 7] = [
    "",
    "_calls",
    "_horizons",
    "_audit",
    "_schema",
    "_outbox",
    "_outbox_keys",
];

/// Processes `MESSAGES` keys on `inbox`, each writing its effect (and one outgoing message) in
/// the claim's transaction, then delivers each again: every key processed once, every copy a
/// duplicate.
async fn process_all<DB: Backend>(tenant: &str, inbox: &Inbox<DB>)
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    for round in ["first", "again"] {
        for n in 0..MESSAGES {
            let key = format!("order-{n}");
            let claimed = inbox.claim("orders", &key).await.unwrap();
            match (round, claimed) {
                ("first", Some(mut claimed)) => {
                    sqlx::raw_sql(AssertSqlSafe(format!(
                        "INSERT INTO effects (consumer, label) VALUES ('orders', '{key}')"
                    )))
                    .execute(claimed.connection())
                    .await
                    .unwrap();
                    claimed.outbox().send(OutgoingMessage::new(
                        Destination::exchange("shop", "order.placed"),
                        key.clone().into_bytes(),
                    ));
                    claimed.commit().await.unwrap();
                }
                ("first", None) => {
                    panic!("{tenant}: {key} was a duplicate on its first delivery")
                }
                (_, Some(claimed)) => {
                    claimed.rollback().await;
                    panic!("{tenant}: {key} was processed again")
                }
                (_, None) => {}
            }
        }
    }
    let forgotten = inbox
        .forget("orders", "order-0", "a tenant's own audit row")
        .await
        .unwrap();
    assert!(forgotten, "{tenant}: order-0 has its record");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_by_schema_on_postgres_each_have_their_own_tables() {
    let options: PgConnectOptions = support::postgres::url().parse().expect("IDEMPOTENT_PG_URL");
    let id = uuid::Uuid::new_v4().simple().to_string();
    let shared = format!("shared_{id}");
    let tenants = [format!("tenant_a_{id}"), format!("tenant_b_{id}")];
    let admin = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options.clone())
        .await
        .unwrap();
    for schema in tenants.iter().chain([&shared]) {
        sqlx::query(AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
            .execute(&admin)
            .await
            .unwrap();
    }
    let pool = |search_path: String| {
        PgPoolOptions::new()
            .max_connections(4)
            .connect_lazy_with(options.clone().options([("search_path", search_path)]))
    };
    // The schema at the end of every tenant's search_path has the tables already.
    let migrated = Inbox::new(pool(shared.clone())).migrate().await.unwrap();
    assert_eq!(migrated.from, 0);

    let mut migrations = Vec::new();
    for tenant in &tenants {
        let pool = pool(format!("{tenant}, {shared}"));
        sqlx::query(CREATE_EFFECTS).execute(&pool).await.unwrap();
        let inbox = Inbox::new(pool);
        migrations.push(inbox.migrate().await.unwrap());
        process_all(tenant, &inbox).await;
    }
    for (tenant, migrated) in tenants.iter().zip(migrations) {
        assert_eq!(
            migrated.from, 0,
            "{tenant}: migrate() found the shared schema's tables instead of creating its own"
        );
    }

    let count = async |table: String| -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!("SELECT COUNT(*) FROM {table}")))
            .fetch_one(&admin)
            .await
            .unwrap()
    };
    for tenant in &tenants {
        for suffix in TABLES {
            let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
                .bind(format!("{tenant}.\"idempotent_inbox{suffix}\""))
                .fetch_one(&admin)
                .await
                .unwrap();
            assert!(exists, "{tenant} has no idempotent_inbox{suffix}");
        }
        let t = format!("{tenant}.idempotent_inbox");
        assert_eq!(count(format!("{tenant}.effects")).await, MESSAGES as i64);
        assert_eq!(count(t.clone()).await, MESSAGES as i64 - 1, "{tenant}");
        assert_eq!(count(format!("{t}_audit")).await, 1, "{tenant}");
        assert_eq!(count(format!("{t}_outbox")).await, MESSAGES as i64);
    }
    let s = format!("{shared}.idempotent_inbox");
    for table in [s.clone(), format!("{s}_audit"), format!("{s}_outbox")] {
        assert_eq!(
            count(table.clone()).await,
            0,
            "{table}: a tenant wrote here"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_by_database_on_mysql_each_have_their_own_tables() {
    let options: MySqlConnectOptions = support::mysql::url().parse().expect("IDEMPOTENT_MYSQL_URL");
    let id = uuid::Uuid::new_v4().simple().to_string();
    let shared = format!("shared_{id}");
    let tenants = [format!("tenant_a_{id}"), format!("tenant_b_{id}")];
    let mut admin = options.connect().await.unwrap();
    for database in tenants.iter().chain([&shared]) {
        sqlx::query(AssertSqlSafe(format!("CREATE DATABASE {database}")))
            .execute(&mut admin)
            .await
            .unwrap();
    }
    let pool = |database: &str| {
        MySqlPoolOptions::new()
            .max_connections(4)
            .connect_lazy_with(options.clone().database(database))
    };
    // Another database on the server, the one the account's connections default to, say, has
    // the tables already.
    let migrated = Inbox::new(pool(&shared)).migrate().await.unwrap();
    assert_eq!(migrated.from, 0);

    let mut migrations = Vec::new();
    for tenant in &tenants {
        let pool = pool(tenant);
        sqlx::query(CREATE_EFFECTS).execute(&pool).await.unwrap();
        let inbox = Inbox::new(pool);
        migrations.push(inbox.migrate().await.unwrap());
        process_all(tenant, &inbox).await;
    }
    for (tenant, migrated) in tenants.iter().zip(migrations) {
        assert_eq!(
            migrated.from, 0,
            "{tenant}: migrate() found another's tables"
        );
    }

    let mut count = async |table: String| -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!("SELECT COUNT(*) FROM {table}")))
            .fetch_one(&mut admin)
            .await
            .unwrap()
    };
    for tenant in &tenants {
        for suffix in TABLES {
            count(format!("{tenant}.idempotent_inbox{suffix}")).await;
        }
        let t = format!("{tenant}.idempotent_inbox");
        assert_eq!(count(format!("{tenant}.effects")).await, MESSAGES as i64);
        assert_eq!(count(t.clone()).await, MESSAGES as i64 - 1, "{tenant}");
        assert_eq!(count(format!("{t}_audit")).await, 1, "{tenant}");
        assert_eq!(count(format!("{t}_outbox")).await, MESSAGES as i64);
    }
    let s = format!("{shared}.idempotent_inbox");
    for table in [s.clone(), format!("{s}_audit"), format!("{s}_outbox")] {
        assert_eq!(
            count(table.clone()).await,
            0,
            "{table}: a tenant wrote here"
        );
    }
}
