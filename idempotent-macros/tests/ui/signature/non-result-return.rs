use idempotent::idempotent;

struct Msg {
    message_id: String,
}

#[idempotent(key = "message_id", consumer = "orders")]
async fn handle(tx: &mut sqlx::SqliteConnection, msg: &Msg) {
    let _ = (tx, msg);
}

fn main() {}
