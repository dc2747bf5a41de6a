use idempotent::idempotent;

struct Msg {
    correlation_id: String,
}

#[idempotent(key = "correlation_id", retries = 3, crate = 5)]
async fn handle(tx: &mut sqlx::SqliteConnection, msg: &Msg) -> Result<(), sqlx::Error> {
    let _ = (tx, msg);
    Ok(())
}

fn main() {}
