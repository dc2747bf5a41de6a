use idempotent::idempotent;

struct Msg {
    received_at: String,
}

#[idempotent(key = "received_at", consumer = "orders")]
async fn handle(tx: &mut sqlx::SqliteConnection, msg: &Msg) -> Result<(), sqlx::Error> {
    let _ = (tx, msg);
    Ok(())
}

fn main() {}
