use idempotent::idempotent;

struct Transfer {
    delivery_tag: u64,
}

type HandlerResult<T> = Result<T, std::io::Error>;

#[idempotent(
    key = "delivery_tag",
    consumer = "ledger",
    allow_unstable_key = "the ledger assigns delivery_tag once per transfer, not the broker"
)]
async fn on_transfer(tx: &mut sqlx::SqliteConnection, msg: &Transfer) -> HandlerResult<u64> {
    let _ = tx;
    if msg.delivery_tag == 0 {
        return Err(std::io::Error::other("zero"));
    }
    Ok(msg.delivery_tag)
}

fn main() {
    let _ = on_transfer;
}
