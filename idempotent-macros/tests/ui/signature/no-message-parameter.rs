use idempotent::idempotent;

#[idempotent(key = "message_id", consumer = "orders")]
async fn handle(tx: &mut sqlx::SqliteConnection) -> Result<(), sqlx::Error> {
    let _ = tx;
    Ok(())
}

fn main() {}
