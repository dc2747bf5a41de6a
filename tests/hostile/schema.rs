//! A fresh schema of `IDEMPOTENT_PG_URL` per test, shared by the hostile tests on PostgreSQL.

use sqlx::ConnectOptions;
use sqlx::postgres::PgConnectOptions;

/// Connect options on a new schema (`search_path`), named in `application_name` too.
pub async fn fresh_schema() -> PgConnectOptions {
    let url = std::env::var("IDEMPOTENT_PG_URL").expect("IDEMPOTENT_PG_URL");
    let options: PgConnectOptions = url.parse().unwrap();
    let schema = format!("hostile_{}", uuid::Uuid::new_v4().simple());
    let mut admin = options.connect().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&mut admin)
        .await
        .unwrap();
    options
        .options([("search_path", schema.as_str())])
        .application_name(&schema)
}
