// A purger dropped at once never runs: keep it, or detach it.
#![deny(unused_must_use)]

async fn start(inbox: idempotent::Inbox<sqlx::Sqlite>) {
    inbox.spawn_purger(idempotent::PurgerOptions::default());
}

fn main() {}
