use idempotent::idempotent;

struct Msg {
    message_id: String,
    // Text, not a time: the inbox cannot compare it with the purge horizon.
    sent_at: String,
}

#[idempotent(key = "message_id", consumer = "orders", sent_at = "sent_at")]
async fn handle(tx: &mut sqlx::SqliteConnection, msg: &Msg) -> Result<(), sqlx::Error> {
    let _ = (tx, msg);
    Ok(())
}

fn main() {}
