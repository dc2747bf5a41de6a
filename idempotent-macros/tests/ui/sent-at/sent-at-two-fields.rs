use idempotent::idempotent;

struct Msg {
    message_id: String,
    sent_at: std::time::SystemTime,
    published_at: std::time::SystemTime,
}

#[idempotent(key = "message_id", consumer = "orders", sent_at = ("sent_at", "published_at"))]
async fn handle(tx: &mut sqlx::SqliteConnection, msg: &Msg) -> Result<(), sqlx::Error> {
    let _ = (tx, msg);
    Ok(())
}

fn main() {}
