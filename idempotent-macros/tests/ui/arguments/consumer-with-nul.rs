use idempotent::idempotent;

struct Msg {
    message_id: String,
}

#[idempotent(key = "message_id", consumer = "orders\0v2")]
async fn handle(tx: &mut sqlx::SqliteConnection, msg: &Msg) -> Result<(), sqlx::Error> {
    let _ = (tx, msg);
    Ok(())
}

fn main() {}
