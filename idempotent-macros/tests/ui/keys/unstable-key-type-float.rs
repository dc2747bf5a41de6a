use idempotent::idempotent;

struct Msg {
    amount: f64,
}

#[idempotent(key = "amount", consumer = "orders")]
async fn handle(tx: &mut sqlx::SqliteConnection, msg: &Msg) -> Result<(), sqlx::Error> {
    let _ = (tx, msg);
    Ok(())
}

fn main() {}
