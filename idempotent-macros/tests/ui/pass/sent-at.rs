use std::time::SystemTime;

use idempotent::{Inbox, SentAt, idempotent};

struct Headers {
    sent_at: SystemTime,
}

struct Order {
    message_id: String,
    headers: Headers,
}

#[idempotent(key = "message_id", consumer = "orders", sent_at = "headers.sent_at")]
async fn nested(tx: &mut sqlx::SqliteConnection, msg: &Order) -> Result<(), sqlx::Error> {
    let _ = (tx, msg);
    Ok(())
}

struct Optional {
    message_id: String,
    sent_at: Option<SystemTime>,
}

#[idempotent(key = "message_id", consumer = "optional", sent_at = "sent_at")]
async fn optional(tx: &mut sqlx::SqliteConnection, msg: &Optional) -> Result<(), sqlx::Error> {
    let _ = (tx, msg);
    Ok(())
}

/// A timestamp type of the user's own, in milliseconds since the epoch.
struct Millis(u64);

impl SentAt for Millis {
    fn sent_at(&self) -> Option<SystemTime> {
        Some(SystemTime::UNIX_EPOCH + std::time::Duration::from_millis(self.0))
    }
}

struct Stamped {
    id: uuid::Uuid,
    sent_at: Millis,
}

#[idempotent(key = "id", consumer = "stamped", sent_at = "sent_at")]
async fn own_type(tx: &mut sqlx::SqliteConnection, msg: Stamped) -> Result<(), sqlx::Error> {
    let _ = (tx, msg);
    Ok(())
}

async fn call(inbox: &Inbox<sqlx::Sqlite>) -> Result<(), idempotent::Error<sqlx::Error>> {
    let order = Order {
        message_id: "o-1".into(),
        headers: Headers {
            sent_at: SystemTime::now(),
        },
    };
    let _ = nested(inbox, &order).await?;
    let _ = optional(inbox, &Optional { message_id: "o-2".into(), sent_at: None }).await?;
    let stamped = Stamped { id: uuid::Uuid::nil(), sent_at: Millis(0) };
    let _ = own_type(inbox, stamped).await?;
    Ok(())
}

fn main() {
    let _ = call;
}
