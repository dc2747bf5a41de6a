use idempotent::idempotent;
use idempotent::outbox::Outbox;

struct Msg {
    message_id: String,
}

#[idempotent(key = "message_id", consumer = "orders")]
async fn handle(outbox: &mut Outbox, tx: &mut sqlx::PgConnection, msg: &Msg) -> Result<(), sqlx::Error> {
    let _ = (tx, msg, outbox);
    Ok(())
}

fn main() {}
