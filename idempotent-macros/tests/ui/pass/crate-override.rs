// The dependency renamed, as `my_inbox = { package = "idempotent-inbox" }` would make it.
extern crate idempotent as my_inbox;

use my_inbox::idempotent;

struct Msg {
    message_id: String,
}

#[idempotent(key = "message_id", consumer = "orders", crate = "my_inbox")]
async fn handle(tx: &mut sqlx::SqliteConnection, msg: &Msg) -> Result<(), sqlx::Error> {
    let _ = (tx, msg);
    Ok(())
}

fn main() {
    let _ = handle;
}
