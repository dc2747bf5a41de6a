use idempotent::idempotent;

struct Msg {
    sent: std::time::SystemTime,
}

#[idempotent(key = "sent", consumer = "orders")]
async fn handle(tx: &mut sqlx::SqliteConnection, msg: &Msg) -> Result<(), sqlx::Error> {
    let _ = (tx, msg);
    Ok(())
}

fn main() {}
