use idempotent::idempotent;

struct Msg {
    message_id: String,
}

#[derive(serde::Serialize)]
struct Quote {
    cents: i64,
}

#[idempotent(key = "message_id", consumer = "quotes", store_response)]
async fn handle(tx: &mut sqlx::SqliteConnection, msg: &Msg) -> Result<Quote, sqlx::Error> {
    let _ = (tx, msg);
    Ok(Quote { cents: 1 })
}

fn main() {}
