use idempotent::idempotent;

struct Msg {
    message_id: String,
}

#[idempotent(key = "message_id", consumer = "orders")]
async fn handle(log: &mut Vec<String>, msg: &Msg) -> Result<(), std::io::Error> {
    log.push(msg.message_id.clone());
    Ok(())
}

fn main() {}
