use idempotent::idempotent;

struct Msg {
    order_id: i64,
    kafka_offset: i64,
}

#[idempotent(key = ("order_id", "kafka_offset"), consumer = "orders")]
async fn handle(tx: &mut sqlx::SqliteConnection, msg: &Msg) -> Result<(), sqlx::Error> {
    let _ = (tx, msg);
    Ok(())
}

fn main() {}
