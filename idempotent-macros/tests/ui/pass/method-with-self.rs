use idempotent::{Handled, Inbox, idempotent};

struct Msg {
    message_id: uuid::Uuid,
}

struct Orders {
    table: &'static str,
}

impl Orders {
    #[idempotent(key = "message_id", consumer = "orders")]
    async fn on_message(&self, tx: &mut sqlx::SqliteConnection, msg: &Msg) -> Result<usize, sqlx::Error> {
        let _ = (tx, msg);
        Ok(self.table.len())
    }
}

async fn call(orders: &Orders, inbox: &Inbox<sqlx::Sqlite>, msg: &Msg) -> Result<(), idempotent::Error<sqlx::Error>> {
    match orders.on_message(inbox, msg).await? {
        Handled::Processed(n) => assert!(n > 0),
        Handled::Duplicate { .. } => {}
    }
    Ok(())
}

fn main() {
    let _ = call;
}
