use idempotent::idempotent;
use idempotent::outbox::Outbox;

struct Msg {
    message_id: String,
}

#[idempotent(key = "message_id", consumer = "orders")]
async fn handle(
    tx: &mut sqlx::PgConnection,
    msg: &Msg,
    events: &mut Outbox,
    commands: &mut Outbox,
) -> Result<(), sqlx::Error> {
    let _ = (tx, msg, events, commands);
    Ok(())
}

fn main() {}
