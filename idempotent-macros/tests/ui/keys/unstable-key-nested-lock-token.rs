use idempotent::idempotent;

struct Msg {
    meta: Meta,
}

struct Meta {
    lock_token: String,
}

#[idempotent(key = "meta.lock_token", consumer = "orders")]
async fn handle(tx: &mut sqlx::SqliteConnection, msg: &Msg) -> Result<(), sqlx::Error> {
    let _ = (tx, msg);
    Ok(())
}

fn main() {}
