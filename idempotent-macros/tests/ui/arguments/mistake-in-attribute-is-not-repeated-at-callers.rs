use idempotent::{Handled, IdempotencyKey, Inbox, idempotent};

struct Msg {
    correlation_id: String,
}

// The key is refused, but callers still see the rewritten signature: the attribute's error is the
// only one, not a second wave at every call that passes the inbox.
#[idempotent(key = "correlation_id", consumer = "orders")]
async fn handle(
    tx: &mut sqlx::SqliteConnection,
    msg: &Msg,
    key: IdempotencyKey,
) -> Result<u32, sqlx::Error> {
    let _ = (tx, msg, key);
    Ok(1)
}

async fn deliver(inbox: &Inbox<sqlx::Sqlite>, msg: &Msg) -> Result<u32, idempotent::Error<sqlx::Error>> {
    match handle(inbox, msg).await? {
        Handled::Processed(n) => Ok(n),
        Handled::Duplicate { .. } => Ok(0),
    }
}

fn main() {
    let _ = deliver;
}
