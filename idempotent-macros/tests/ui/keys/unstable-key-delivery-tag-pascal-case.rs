use idempotent::idempotent;

struct Msg {
    #[allow(non_snake_case)]
    DeliveryTag: u64,
}

#[idempotent(key = "DeliveryTag", consumer = "orders")]
async fn handle(tx: &mut sqlx::SqliteConnection, msg: &Msg) -> Result<(), sqlx::Error> {
    let _ = (tx, msg);
    Ok(())
}

fn main() {}
