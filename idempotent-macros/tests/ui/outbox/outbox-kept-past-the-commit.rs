//! The outbox is borrowed for the body only: a message queued after the commit would never be
//! written, so keeping the outbox (here in a spawned task) does not compile.
use idempotent::idempotent;
use idempotent::outbox::{Destination, OutgoingMessage, Outbox};

struct Msg {
    message_id: String,
}

#[idempotent(key = "message_id", consumer = "orders")]
async fn handle(tx: &mut sqlx::PgConnection, msg: &Msg, outbox: &mut Outbox) -> Result<(), sqlx::Error> {
    let _ = (tx, msg);
    tokio::spawn(async move {
        outbox.send(OutgoingMessage::new(Destination::queue("late"), Vec::new()));
    });
    Ok(())
}

fn main() {}
