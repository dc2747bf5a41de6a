//! A type of your own named `Outbox` is taken for the outbox parameter, and the type error says so
//! on your type.
use idempotent::idempotent;

struct Outbox;

struct Msg {
    message_id: String,
}

#[idempotent(key = "message_id", consumer = "orders")]
async fn handle(tx: &mut sqlx::PgConnection, msg: &Msg, outbox: &mut Outbox) -> Result<(), sqlx::Error> {
    let _ = (tx, msg, outbox);
    Ok(())
}

fn main() {}
