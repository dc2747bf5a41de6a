use idempotent::{Handled, IdempotencyKey, Inbox, idempotent};
use serde::{Deserialize, Serialize};

#[derive(Serialize)]
struct Payment {
    message_id: String,
    amount_cents: i64,
    currency: String,
}

#[derive(Serialize, Deserialize)]
struct Receipt {
    charge_id: String,
}

#[idempotent(key = "message_id", consumer = "payments", fingerprint, store_response)]
async fn whole_message(
    tx: &mut sqlx::SqliteConnection,
    msg: &Payment,
    key: IdempotencyKey,
) -> Result<Receipt, sqlx::Error> {
    let _ = (tx, msg);
    Ok(Receipt {
        charge_id: key.to_string(),
    })
}

#[idempotent(
    key = "message_id",
    consumer = "ledger",
    fingerprint = ("amount_cents", "currency")
)]
async fn some_fields(tx: &mut sqlx::SqliteConnection, msg: &Payment) -> Result<(), sqlx::Error> {
    let _ = (tx, msg);
    Ok(())
}

async fn call(inbox: &Inbox<sqlx::Sqlite>, msg: &Payment) -> Result<(), idempotent::Error<sqlx::Error>> {
    match whole_message(inbox, msg).await? {
        Handled::Processed(receipt) => assert!(!receipt.charge_id.is_empty()),
        Handled::Duplicate { response, .. } => assert!(response.is_some()),
    }
    some_fields(inbox, msg).await?.processed();
    Ok(())
}

fn main() {
    let _ = call;
}
