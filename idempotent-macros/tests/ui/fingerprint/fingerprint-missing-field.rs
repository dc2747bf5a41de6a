use idempotent::idempotent;

struct Msg {
    message_id: String,
    amount: i64,
    currency: String,
}

#[idempotent(key = "message_id", consumer = "payments", fingerprint = ("amount", "currenci"))]
async fn handle(tx: &mut sqlx::SqliteConnection, msg: &Msg) -> Result<(), sqlx::Error> {
    let _ = (tx, msg);
    Ok(())
}

fn main() {}
