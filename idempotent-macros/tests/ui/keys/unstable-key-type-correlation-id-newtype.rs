use idempotent::idempotent;

struct Msg {
    conversation: idempotent::CorrelationId,
}

#[idempotent(key = "conversation", consumer = "orders")]
async fn handle(tx: &mut sqlx::SqliteConnection, msg: &Msg) -> Result<(), sqlx::Error> {
    let _ = (tx, msg);
    Ok(())
}

fn main() {}
