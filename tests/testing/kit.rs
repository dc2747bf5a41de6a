//! The test kit (`idempotent::testing`) on handlers with the three mistakes it is for, and on the
//! same handlers without them: an effect written on another connection, an outside call made
//! without the message's `IdempotencyKey`, and a key that is not stable across deliveries. Each
//! mistake is caught, by the schedule that shows it, with its hint; each mended handler passes.
//! On PostgreSQL and MariaDB too (`servers.rs`), with the schedule only a server has: the
//! connection lost during the body.
#![cfg(all(feature = "testing", feature = "sqlite"))]

#[cfg(any(feature = "postgres", feature = "mysql"))]
mod servers;

use std::sync::{Arc, Mutex};

use idempotent::testing::{Check, Checked, Divergence, Schedule};
use idempotent::{Error, Handled, IdempotencyKey, Inbox, idempotent};
use sqlx::{Sqlite, SqliteConnection, SqlitePool};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct ShopError(#[from] sqlx::Error);

struct Payment {
    message_id: String,
    order: i64,
    amount: i64,
}

impl Payment {
    /// The payment as the broker hands it over, each delivery deserialized anew.
    fn delivered() -> Self {
        Payment {
            message_id: "pay-1".into(),
            order: 7,
            amount: 250,
        }
    }
}

/// A payment service's fake: the charges it took, each with the idempotency key it was given.
/// A charge whose key it has seen is not taken again, as Stripe-style APIs do.
#[derive(Clone, Default)]
struct Psp {
    charges: Arc<Mutex<Vec<Charge>>>,
}

/// A charge: the idempotency key it came with, and its amount.
type Charge = (Option<String>, i64);

impl Psp {
    fn charge(&self, key: Option<&str>, amount: i64) {
        let mut charges = self.charges.lock().unwrap();
        if key.is_some_and(|key| charges.iter().any(|(k, _)| k.as_deref() == Some(key))) {
            return;
        }
        charges.push((key.map(str::to_owned), amount));
    }

    fn taken(&self) -> Vec<i64> {
        self.charges
            .lock()
            .unwrap()
            .iter()
            .map(|(_, a)| *a)
            .collect()
    }
}

const ORDERS: &str = "CREATE TABLE orders (id INTEGER PRIMARY KEY, paid INTEGER NOT NULL)";

/// A fresh in-memory inbox with the order to pay, and the payment service's fake emptied.
async fn fresh(psp: &Psp) -> Result<Inbox<Sqlite>, sqlx::Error> {
    psp.charges.lock().unwrap().clear();
    let inbox = Inbox::<Sqlite>::in_memory()
        .await
        .expect("an in-memory inbox");
    sqlx::query(ORDERS).execute(inbox.pool()).await?;
    sqlx::query("INSERT INTO orders VALUES (7, 0)")
        .execute(inbox.pool())
        .await?;
    Ok(inbox)
}

/// The order's paid amount and the charges taken: what a payment must do, once.
async fn state(inbox: &Inbox<Sqlite>, psp: &Psp) -> (i64, Vec<i64>) {
    let paid = sqlx::query_scalar("SELECT paid FROM orders WHERE id = 7")
        .fetch_one(inbox.pool())
        .await
        .unwrap();
    (paid, psp.taken())
}

/// The payment's effect: the order's paid amount grows.
async fn record(tx: &mut SqliteConnection, order: i64, amount: i64) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE orders SET paid = paid + $2 WHERE id = $1")
        .bind(order)
        .bind(amount)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// Checks the handler that `deliver` calls, on a fresh in-memory inbox per schedule, against the
/// order's paid amount and the charges taken.
async fn check(
    psp: &Psp,
    deliver: impl AsyncFn(&Inbox<Sqlite>) -> Result<Handled<()>, Error<ShopError>>,
) -> Result<Checked, Divergence> {
    Check::new(
        async || fresh(psp).await,
        deliver,
        async |inbox: &Inbox<Sqlite>| state(inbox, psp).await,
    )
    .run()
    .await
}

#[idempotent(key = "message_id", consumer = "orders")]
async fn pay(tx: &mut SqliteConnection, msg: &Payment) -> Result<(), ShopError> {
    record(tx, msg.order, msg.amount).await?;
    Ok(())
}

#[tokio::test]
async fn a_handler_without_mistakes_passes_every_schedule() {
    let psp = Psp::default();
    let checked = check(&psp, async |inbox: &Inbox<Sqlite>| {
        pay(inbox, &Payment::delivered()).await
    })
    .await
    .unwrap_or_else(|divergence| panic!("{divergence}"));
    assert_eq!(checked.copies, 4);
}

/// Writes the effect with the pool instead of the handler's connection.
#[idempotent(key = "message_id", consumer = "orders")]
async fn pay_on_the_pool(
    tx: &mut SqliteConnection,
    msg: &Payment,
    pool: &SqlitePool,
) -> Result<(), ShopError> {
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    sqlx::query("UPDATE orders SET paid = paid + $2 WHERE id = $1")
        .bind(msg.order)
        .bind(msg.amount)
        .execute(pool)
        .await?;
    Ok(())
}

#[tokio::test]
async fn an_effect_written_on_another_connection_is_caught() {
    let psp = Psp::default();
    let divergence: Divergence = check(&psp, async |inbox: &Inbox<Sqlite>| {
        pay_on_the_pool(inbox, &Payment::delivered(), inbox.pool()).await
    })
    .await
    .expect_err("the write on the pool is caught");
    eprintln!("{divergence}");
    // On SQLite the other connection waits for the handler's transaction until it fails: the
    // first, clean delivery already shows it.
    assert_eq!(divergence.schedule, Schedule::Clean, "{divergence}");
    let said = divergence.to_string();
    assert!(said.contains("a delivery failed"), "{said}");
    assert!(said.contains("another connection"), "{said}");
    // The cause, said: the pool's one connection is the handler's, so the write waited for it.
    assert!(said.contains("pool timed out"), "{said}");
}

/// Charges the payment service without the message's idempotency key, then records the payment.
#[idempotent(key = "message_id", consumer = "orders")]
async fn charge_without_key(
    tx: &mut SqliteConnection,
    msg: &Payment,
    psp: &Psp,
) -> Result<(), ShopError> {
    psp.charge(None, msg.amount);
    record(tx, msg.order, msg.amount).await?;
    Ok(())
}

/// The same, passing the message's idempotency key on to the payment service.
#[idempotent(key = "message_id", consumer = "orders")]
async fn charge_with_key(
    tx: &mut SqliteConnection,
    msg: &Payment,
    key: IdempotencyKey,
    psp: &Psp,
) -> Result<(), ShopError> {
    psp.charge(Some(key.as_str()), msg.amount);
    record(tx, msg.order, msg.amount).await?;
    Ok(())
}

#[tokio::test]
async fn an_outside_call_without_the_idempotency_key_is_caught() {
    let psp = Psp::default();
    let divergence = check(&psp, async |inbox: &Inbox<Sqlite>| {
        charge_without_key(inbox, &Payment::delivered(), &psp).await
    })
    .await
    .expect_err("the second charge is caught");
    eprintln!("{divergence}");
    assert_eq!(
        divergence.schedule,
        Schedule::CrashedBeforeCommit,
        "{divergence}"
    );
    assert_eq!(divergence.expected.as_deref(), Some("(250, [250])"));
    assert_eq!(divergence.found.as_deref(), Some("(250, [250, 250])"));
    assert!(
        divergence.to_string().contains("IdempotencyKey"),
        "{divergence}"
    );

    check(&psp, async |inbox: &Inbox<Sqlite>| {
        charge_with_key(inbox, &Payment::delivered(), &psp).await
    })
    .await
    .unwrap_or_else(|divergence| panic!("with the key: {divergence}"));
}

/// A message whose id the consumer fills in on receipt, as an adapter that makes an id when the
/// broker's message has none would: a well-named key the compiler cannot doubt, new for every
/// delivery.
struct Received {
    message_id: String,
    order: i64,
}

impl Received {
    fn delivered() -> Self {
        Received {
            message_id: uuid::Uuid::new_v4().to_string(),
            order: 7,
        }
    }
}

#[idempotent(key = "message_id", consumer = "orders")]
async fn pay_received(tx: &mut SqliteConnection, msg: &Received) -> Result<(), ShopError> {
    record(tx, msg.order, 250).await?;
    Ok(())
}

#[tokio::test]
async fn a_key_that_changes_between_deliveries_is_caught() {
    let psp = Psp::default();
    let divergence = check(&psp, async |inbox: &Inbox<Sqlite>| {
        pay_received(inbox, &Received::delivered()).await
    })
    .await
    .expect_err("the second delivery's effect is caught");
    eprintln!("{divergence}");
    assert_eq!(divergence.schedule, Schedule::Twice, "{divergence}");
    assert_eq!(divergence.found.as_deref(), Some("(500, [])"));
    assert!(
        divergence
            .to_string()
            .contains("key differs between deliveries"),
        "{divergence}"
    );
}
