use idempotent::idempotent;

struct Meta {
    sent: std::time::SystemTime,
}

struct Msg {
    message_id: String,
    meta: Meta,
}

#[idempotent(key = "message_id", consumer = "orders", sent_at = "meta.sent_at")]
async fn handle(tx: &mut sqlx::SqliteConnection, msg: &Msg) -> Result<(), sqlx::Error> {
    let _ = (tx, msg);
    Ok(())
}

fn main() {}
