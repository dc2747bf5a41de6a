use idempotent::idempotent;

struct Msg {
    message_id: String,
}

#[idempotent(key = "message_id", consumer = "quotes", store_response = true)]
async fn handle(tx: &mut sqlx::SqliteConnection, msg: &Msg) -> Result<(), sqlx::Error> {
    let _ = (tx, msg);
    Ok(())
}

fn main() {}
