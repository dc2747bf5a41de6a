//! The outbox parameter: filled in by the rewritten handler (not passed by callers), next to an
//! `IdempotencyKey`, in any position after the message, with `store_response`, on a method, and
//! under a renamed crate path.
use idempotent::outbox::{Destination, OutgoingMessage, Outbox};
use idempotent::{Handled, IdempotencyKey, Inbox, idempotent};

struct Paid {
    message_id: String,
    order: i64,
}

#[idempotent(key = "message_id", consumer = "orders")]
async fn announce(
    tx: &mut sqlx::SqliteConnection,
    msg: &Paid,
    outbox: &mut Outbox,
) -> Result<(), sqlx::Error> {
    let _ = tx;
    let id: String = outbox.send(OutgoingMessage::new(
        Destination::exchange("shop", "order.paid"),
        msg.order.to_string(),
    ));
    let _ = id;
    Ok(())
}

#[idempotent(key = "message_id", consumer = "receipts", store_response)]
async fn receipt(
    tx: &mut sqlx::PgConnection,
    msg: &Paid,
    outbox: &mut Outbox,
    key: IdempotencyKey,
    copies: usize,
) -> Result<String, sqlx::Error> {
    let _ = tx;
    for _ in 0..copies {
        outbox.send(
            OutgoingMessage::new(Destination::subject("RECEIPTS.sent"), key.to_string())
                .with_ordering_key(msg.message_id.clone()),
        );
    }
    Ok(key.to_string())
}

struct Service;

impl Service {
    #[idempotent(key = "message_id", consumer = "service")]
    async fn handle(
        &self,
        tx: &mut sqlx::MySqlConnection,
        msg: &Paid,
        out: &mut idempotent::outbox::Outbox,
    ) -> Result<(), sqlx::Error> {
        let _ = (tx, msg, out.len());
        Ok(())
    }
}

async fn call(
    sqlite: &Inbox<sqlx::Sqlite>,
    postgres: &Inbox<sqlx::Postgres>,
    mysql: &Inbox<sqlx::MySql>,
    msg: &Paid,
) -> Result<(), idempotent::Error<sqlx::Error>> {
    announce(sqlite, msg).await?.processed();
    match receipt(postgres, msg, 2).await? {
        Handled::Processed(key) | Handled::Duplicate { response: Some(key), .. } => {
            assert!(!key.is_empty())
        }
        Handled::Duplicate { .. } => {}
    }
    Service.handle(mysql, msg).await?.processed();
    Ok(())
}

fn main() {
    let _ = call;
}
