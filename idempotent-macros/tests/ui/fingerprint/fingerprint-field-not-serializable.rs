use idempotent::idempotent;

struct Msg {
    message_id: String,
    amount: Amount,
}

struct Amount {
    cents: i64,
}

#[idempotent(key = "message_id", consumer = "payments", fingerprint = "amount")]
async fn handle(tx: &mut sqlx::SqliteConnection, msg: &Msg) -> Result<(), sqlx::Error> {
    let _ = (tx, msg);
    Ok(())
}

fn main() {}
