//! The kit on PostgreSQL and MariaDB: a fresh schema (a fresh database) per schedule, and the
//! schedule only a server has, the connection lost during the body. A handler without mistakes
//! passes every schedule; a write on the pool is caught (on a server it does not wait for the
//! handler's transaction: the crash schedule shows it); so are the two mistakes only a failing
//! database shows: an effect in the body's error path (a fallback write on the pool), and a
//! handler written by hand that calls a lost connection its own, permanent error (a runner would
//! dead-letter the message).

use std::time::Duration;

use idempotent::Inbox;

use super::Psp;

/// A pool of at most 8 connections (4 copies at once each hold one, and a write on the pool
/// needs another) on `options`.
macro_rules! pool {
    ($pool_options:ty, $options:expr) => {
        <$pool_options>::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with($options)
    };
}

/// The handlers and the kit's tests on `$db`, whose `fresh` is in scope; `$pay` records a
/// payment, binding the amount, then the order.
macro_rules! kit_on_a_server {
    ($db:ty, $connection:ty, $pool:ty, $pay:literal) => {
        use idempotent::testing::{Check, Checked, Divergence, Schedule};
        use idempotent::{Error, Handled, idempotent};

        use crate::{Payment, ShopError};

        async fn state(inbox: &Inbox<$db>) -> i64 {
            sqlx::query_scalar("SELECT paid FROM orders WHERE id = 7")
                .fetch_one(inbox.pool())
                .await
                .unwrap()
        }

        async fn check(
            psp: &Psp,
            deliver: impl AsyncFn(&Inbox<$db>) -> Result<Handled<()>, Error<ShopError>>,
        ) -> Result<Checked, Divergence> {
            Check::new(
                async || fresh(psp).await,
                deliver,
                async |inbox: &Inbox<$db>| state(inbox).await,
            )
            .run()
            .await
        }

        async fn record(tx: &mut $connection, order: i64, amount: i64) -> Result<(), sqlx::Error> {
            sqlx::query($pay)
                .bind(amount)
                .bind(order)
                .execute(&mut *tx)
                .await?;
            Ok(())
        }

        #[idempotent(key = "message_id", consumer = "orders")]
        async fn pay(tx: &mut $connection, msg: &Payment) -> Result<(), ShopError> {
            record(tx, msg.order, msg.amount).await?;
            Ok(())
        }

        #[tokio::test]
        async fn a_handler_without_mistakes_passes_every_schedule_with_its_connection_lost_too() {
            let psp = Psp::default();
            let checked = check(&psp, async |inbox: &Inbox<$db>| {
                pay(inbox, &Payment::delivered()).await
            })
            .await
            .unwrap_or_else(|divergence| panic!("{divergence}"));
            assert!(checked.connection_lost, "{checked:?}");
            assert!(checked.await_points > 0, "{checked:?}");
        }

        /// Writes the effect with the pool instead of the handler's connection.
        #[idempotent(key = "message_id", consumer = "orders")]
        async fn pay_on_the_pool(
            tx: &mut $connection,
            msg: &Payment,
            pool: &$pool,
        ) -> Result<(), ShopError> {
            sqlx::query("SELECT 1").execute(&mut *tx).await?;
            sqlx::query($pay)
                .bind(msg.amount)
                .bind(msg.order)
                .execute(pool)
                .await?;
            Ok(())
        }

        #[tokio::test]
        async fn an_effect_written_on_another_connection_is_caught() {
            let psp = Psp::default();
            let divergence = check(&psp, async |inbox: &Inbox<$db>| {
                pay_on_the_pool(inbox, &Payment::delivered(), inbox.pool()).await
            })
            .await
            .expect_err("the write on the pool is caught");
            eprintln!("{divergence}");
            assert_eq!(
                divergence.schedule,
                Schedule::CrashedBeforeCommit,
                "{divergence}"
            );
            assert_eq!(divergence.expected.as_deref(), Some("250"));
            assert_eq!(divergence.found.as_deref(), Some("500"));
            assert!(
                divergence.to_string().contains("another connection"),
                "{divergence}"
            );
        }

        /// Records the payment; when the database fails under it, records it on the pool instead, so as
        /// "never to lose a payment", and fails.
        #[idempotent(key = "message_id", consumer = "orders")]
        async fn pay_with_a_fallback(
            tx: &mut $connection,
            msg: &Payment,
            pool: &$pool,
        ) -> Result<(), ShopError> {
            if let Err(error) = record(tx, msg.order, msg.amount).await {
                sqlx::query($pay)
                    .bind(msg.amount)
                    .bind(msg.order)
                    .execute(pool)
                    .await?;
                return Err(error.into());
            }
            Ok(())
        }

        #[tokio::test]
        async fn an_effect_in_the_error_path_is_caught_when_the_connection_is_lost() {
            let psp = Psp::default();
            let divergence = check(&psp, async |inbox: &Inbox<$db>| {
                pay_with_a_fallback(inbox, &Payment::delivered(), inbox.pool()).await
            })
            .await
            .expect_err("the fallback's write is caught");
            eprintln!("{divergence}");
            assert_eq!(
                divergence.schedule,
                Schedule::ConnectionLost,
                "{divergence}"
            );
            assert_eq!(divergence.expected.as_deref(), Some("250"));
            assert_eq!(divergence.found.as_deref(), Some("500"));
            assert!(
                divergence.to_string().contains("error path"),
                "{divergence}"
            );
        }

        /// A payment handled by hand (without the attribute), which calls every failure of its
        /// statements its own, permanent error.
        async fn pay_by_hand(inbox: &Inbox<$db>) -> Result<Handled<()>, Error<ShopError>> {
            let payment = Payment::delivered();
            let Some(mut claimed) = inbox.claim("orders", &payment.message_id).await? else {
                let key = idempotent::message_key(&payment.message_id[..]).unwrap();
                let consumer = "orders".into();
                return Ok(Handled::Duplicate {
                    consumer,
                    key,
                    response: None,
                });
            };
            let recorded = sqlx::query($pay)
                .bind(payment.amount)
                .bind(payment.order)
                .execute(claimed.connection())
                .await;
            if let Err(error) = recorded {
                claimed.rollback().await;
                return Err(Error::Handler(ShopError(error)));
            }
            claimed.commit().await?;
            Ok(Handled::Processed(()))
        }

        #[tokio::test]
        async fn a_lost_connection_called_a_permanent_error_is_caught() {
            let psp = Psp::default();
            let divergence = check(&psp, async |inbox: &Inbox<$db>| pay_by_hand(inbox).await)
                .await
                .expect_err("the permanent error is caught");
            eprintln!("{divergence}");
            assert_eq!(
                divergence.schedule,
                Schedule::ConnectionLost,
                "{divergence}"
            );
            let said = divergence.to_string();
            assert!(said.contains("not retryable"), "{said}");
            assert!(said.contains("dead-letter"), "{said}");
        }
    };
}

/// The order to pay in a fresh inbox's database, and the payment service's fake emptied.
async fn with_the_order<DB: idempotent::Backend>(
    psp: &Psp,
    inbox: Inbox<DB>,
    create: &str,
) -> Result<Inbox<DB>, sqlx::Error>
where
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
{
    psp.charges.lock().unwrap().clear();
    inbox.migrate().await.expect("the inbox's tables");
    sqlx::raw_sql(sqlx::AssertSqlSafe(create.to_owned()))
        .execute(inbox.pool())
        .await?;
    sqlx::raw_sql("INSERT INTO orders VALUES (7, 0)")
        .execute(inbox.pool())
        .await?;
    Ok(inbox)
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;
    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

    /// A fresh schema of `IDEMPOTENT_PG_URL`, the pool's `search_path` on it.
    async fn fresh(psp: &Psp) -> Result<Inbox<sqlx::Postgres>, sqlx::Error> {
        let url = std::env::var("IDEMPOTENT_PG_URL")
            .expect("IDEMPOTENT_PG_URL is not set: run the tests with scripts/test");
        let options: PgConnectOptions = url.parse()?;
        let schema = format!("kit_{}", uuid::Uuid::new_v4().simple());
        let admin = pool!(PgPoolOptions, options.clone()).await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
            .execute(&admin)
            .await?;
        admin.close().await;
        let pool = pool!(
            PgPoolOptions,
            options.options([("search_path", schema.as_str())])
        )
        .await?;
        let create = "CREATE TABLE orders (id BIGINT PRIMARY KEY, paid BIGINT NOT NULL)";
        with_the_order(psp, Inbox::new(pool), create).await
    }

    kit_on_a_server!(
        sqlx::Postgres,
        sqlx::PgConnection,
        sqlx::PgPool,
        "UPDATE orders SET paid = paid + $1 WHERE id = $2"
    );
}

#[cfg(feature = "mysql")]
mod mysql {
    use super::*;
    use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};

    /// A fresh database of `IDEMPOTENT_MYSQL_URL`.
    async fn fresh(psp: &Psp) -> Result<Inbox<sqlx::MySql>, sqlx::Error> {
        let url = std::env::var("IDEMPOTENT_MYSQL_URL")
            .expect("IDEMPOTENT_MYSQL_URL is not set: run the tests with scripts/test");
        let options: MySqlConnectOptions = url.parse()?;
        let database = format!("kit_{}", uuid::Uuid::new_v4().simple());
        let admin = pool!(MySqlPoolOptions, options.clone()).await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
            .execute(&admin)
            .await?;
        admin.close().await;
        let pool = pool!(MySqlPoolOptions, options.database(&database)).await?;
        let create = "CREATE TABLE orders (id BIGINT PRIMARY KEY, paid BIGINT NOT NULL)";
        with_the_order(psp, Inbox::new(pool), create).await
    }

    kit_on_a_server!(
        sqlx::MySql,
        sqlx::MySqlConnection,
        sqlx::MySqlPool,
        "UPDATE orders SET paid = paid + ? WHERE id = ?"
    );
}
