use idempotent::idempotent;

struct Msg {
    message_id: String,
}

#[idempotent(key = "message_id", consumer = "orders")]
async fn handle(msg: &Msg) -> Result<(), sqlx::Error> {
    let _ = msg;
    Ok(())
}

fn main() {}
