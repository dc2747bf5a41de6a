use idempotent::{KeyBuilder, StableKey, idempotent};

struct PaymentId(String);

impl StableKey for PaymentId {
    fn write_key(&self, key: &mut KeyBuilder) {
        self.0.write_key(key)
    }
}

struct Headers {
    message_id: String,
}

struct Payment {
    headers: Headers,
    order_id: i64,
    payment_id: PaymentId,
    raw: Vec<u8>,
}

struct Tuple(u64, String);

#[idempotent(key = ("order_id", "payment_id"), consumer = "orders")]
async fn by_business_key(tx: &mut sqlx::SqliteConnection, msg: &Payment) -> Result<(), sqlx::Error> {
    let _ = (tx, msg);
    Ok(())
}

#[idempotent(key = "headers.message_id", consumer = "orders")]
async fn by_nested_id(tx: &mut sqlx::SqliteConnection, msg: Payment) -> Result<(), sqlx::Error> {
    let _ = (tx, msg.raw);
    Ok(())
}

#[idempotent(key = ("0", "1"), consumer = "orders")]
async fn by_tuple_fields(tx: &mut sqlx::SqliteConnection, msg: &Tuple) -> Result<(), sqlx::Error> {
    let _ = (tx, msg);
    Ok(())
}

fn main() {}
