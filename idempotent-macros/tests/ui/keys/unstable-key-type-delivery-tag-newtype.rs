use idempotent::idempotent;

struct Msg {
    handle: idempotent::DeliveryTag,
}

#[idempotent(key = "handle", consumer = "orders")]
async fn handle(tx: &mut sqlx::SqliteConnection, msg: &Msg) -> Result<(), sqlx::Error> {
    let _ = (tx, msg);
    Ok(())
}

fn main() {}
