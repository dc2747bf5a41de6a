use idempotent::idempotent;

struct Msg {
    delivery_tag: u64,
}

#[idempotent(key = "delivery_tag", consumer = "orders", allow_unstable_key = " ")]
async fn handle(tx: &mut sqlx::SqliteConnection, msg: &Msg) -> Result<(), sqlx::Error> {
    let _ = (tx, msg);
    Ok(())
}

fn main() {}
