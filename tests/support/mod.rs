//! What the behaviour tests share: a test message, the handlers under test (written once, for each
//! connection type), and a harness per backend that owns a fresh database.
#![allow(dead_code, unreachable_pub)]

use std::future::Future;
use std::sync::Arc;

use idempotent::{Backend, Claimed, Error, Handled, Inbox};
use tokio::sync::Notify;

#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "sqlite")]
pub mod sqlite;

/// A message as a broker would deliver it, with what its handler should do this time.
#[derive(Clone)]
pub struct Delivery {
    /// The key of the `orders` and `billing` handlers.
    pub message_id: String,
    /// The key of the `orders_by_raw_id` handler.
    pub raw_id: Vec<u8>,
    /// What the handler writes to the `effects` table, to count effects by.
    pub label: String,
    pub behaviour: Behaviour,
    /// The key of the `events` handler: a UUID (a version 7 one says when it was sent).
    pub uuid: uuid::Uuid,
    /// When the message says it was sent: the `stamped` handler's `sent_at` field.
    pub sent_at: Option<std::time::SystemTime>,
    /// What the `notifier` handler queues in its outbox.
    pub outgoing: Outgoing,
}

/// The outgoing messages the `notifier` handler queues: `count` messages to the queue
/// `destination` (payload `<label>#<i>`, header `label`), each with `ordering_key` if set; the ids
/// the outbox gave them are pushed to `ids`.
#[derive(Clone)]
pub struct Outgoing {
    pub count: usize,
    pub destination: String,
    pub ordering_key: Option<String>,
    pub ids: Arc<std::sync::Mutex<Vec<String>>>,
}

impl Default for Outgoing {
    fn default() -> Self {
        Self {
            count: 1,
            destination: "notifications".into(),
            ordering_key: None,
            ids: Arc::default(),
        }
    }
}

/// An outbox row as [`Harness::outbox_rows`] reads it: `(message_id, routing_key, ordering_key,
/// ordering_seq, state, origin)`.
pub type OutboxRow = (String, String, Option<String>, Option<i64>, i64, String);

#[derive(Clone)]
pub enum Behaviour {
    Succeed,
    Fail,
    Panic,
    /// Writes its effect, signals, then never finishes (to be cancelled).
    Hang(Arc<Notify>),
    /// Runs these steps instead of writing its effect, ignoring every error, and returns `Ok`:
    /// a body that swallows failures or ends the transaction itself.
    Script(Vec<Step>),
}

/// One step of a scripted body.
#[derive(Clone)]
pub enum Step {
    /// Runs this SQL as it is.
    Sql(&'static str),
    /// Writes an effect for this consumer name and the message's label.
    Effect(&'static str),
    /// Returns the handler's own error here (the steps after it do not run).
    Fail,
    /// Panics here.
    Panic,
}

impl Delivery {
    pub fn new(label: &str) -> Self {
        Self {
            message_id: label.to_owned(),
            raw_id: label.as_bytes().to_vec(),
            label: label.to_owned(),
            behaviour: Behaviour::Succeed,
            uuid: uuid::Uuid::now_v7(),
            sent_at: None,
            outgoing: Outgoing::default(),
        }
    }

    /// This message sent at `time`: its `uuid` a version 7 UUID of that time, its `sent_at` field
    /// that time.
    pub fn sent(mut self, time: std::time::SystemTime) -> Self {
        let since = time.duration_since(std::time::UNIX_EPOCH).unwrap();
        let stamp =
            uuid::Timestamp::from_unix(uuid::NoContext, since.as_secs(), since.subsec_nanos());
        self.uuid = uuid::Uuid::new_v7(stamp);
        self.sent_at = Some(time);
        self
    }

    pub fn with_uuid(mut self, uuid: uuid::Uuid) -> Self {
        self.uuid = uuid;
        self
    }

    pub fn with_sent_at(mut self, sent_at: Option<std::time::SystemTime>) -> Self {
        self.sent_at = sent_at;
        self
    }

    pub fn with_id(mut self, message_id: impl Into<String>) -> Self {
        self.message_id = message_id.into();
        self
    }

    pub fn with_raw_id(mut self, raw_id: Vec<u8>) -> Self {
        self.raw_id = raw_id;
        self
    }

    /// This message with the `notifier` handler queueing `outgoing`.
    pub fn sending(mut self, outgoing: Outgoing) -> Self {
        self.outgoing = outgoing;
        self
    }

    pub fn behaving(mut self, behaviour: Behaviour) -> Self {
        self.behaviour = behaviour;
        self
    }
}

/// The handler's own error.
#[derive(Debug, thiserror::Error)]
pub enum TestError {
    #[error("the handler failed on purpose")]
    Failed,
    #[error("database error in the handler")]
    Db(#[from] sqlx::Error),
}

/// Which handler to deliver to.
#[derive(Clone, Copy, Debug)]
pub enum Consumer {
    /// `consumer = "orders"`, keyed on `message_id`.
    Orders,
    /// `consumer = "billing"`, keyed on `message_id`.
    Billing,
    /// `consumer = "orders"`, keyed on `raw_id` (bytes).
    OrdersByRawId,
    /// `consumer = "savepoints"`: nests transactions in its body (several statements).
    Savepoints,
    /// `consumer = "events"`, keyed on `uuid` (a UUIDv7 key says when the message was sent).
    Events,
    /// `consumer = "stamped"`, keyed on `message_id`, with `sent_at = "sent_at"`.
    Stamped,
}

pub type Outcome = Result<Handled<()>, Error<TestError>>;
pub type Quote = Result<Handled<String>, Error<TestError>>;

/// One backend with a fresh database: the inbox, the handlers, and ways to look at the effects.
pub trait Harness {
    type Db: Backend;

    /// The inbox the handlers run on (already migrated).
    fn inbox(&self) -> &Inbox<Self::Db>;

    /// Calls the handler of `consumer` with `msg`.
    fn deliver(&self, consumer: Consumer, msg: &Delivery) -> impl Future<Output = Outcome>;

    /// Calls the handler of `consumer` with `msg` on `inbox` (one made from this harness's).
    fn deliver_on(
        &self,
        inbox: &Inbox<Self::Db>,
        consumer: Consumer,
        msg: &Delivery,
    ) -> impl Future<Output = Outcome>;

    /// Runs `sql` in a claimed transaction; whether it succeeded.
    fn run_in(&self, claimed: &mut Claimed<Self::Db>, sql: &str) -> impl Future<Output = bool>;

    /// How many times any handler's effect for `label` was committed.
    fn effects(&self, label: &str) -> impl Future<Output = i64>;

    /// How many times `consumer`'s effect for `label` was committed.
    fn effects_of(&self, consumer: &str, label: &str) -> impl Future<Output = i64>;

    /// How many rows the inbox table holds.
    fn inbox_rows(&self) -> impl Future<Output = i64>;

    /// A new inbox on the same database whose pool has `connections` connections (and gives up
    /// waiting for one after a few seconds). The in-memory SQLite inbox has one, whatever is asked.
    fn inbox_with_pool(&self, connections: u32) -> Inbox<Self::Db>;

    /// [`inbox_with_pool`](Harness::inbox_with_pool) with one connection.
    fn inbox_of_one(&self) -> Inbox<Self::Db> {
        self.inbox_with_pool(1)
    }

    /// How many times `consumer`'s effect was committed, per label.
    fn effect_counts(
        &self,
        consumer: &str,
    ) -> impl Future<Output = std::collections::HashMap<String, i64>>;

    /// Calls the `quotes` handler on `inbox`.
    fn deliver_quote_on(
        &self,
        inbox: &Inbox<Self::Db>,
        msg: &Delivery,
    ) -> impl Future<Output = Quote>;

    /// Calls the `payments` handler on `inbox`.
    fn deliver_payment_on(
        &self,
        inbox: &Inbox<Self::Db>,
        msg: &Delivery,
    ) -> impl Future<Output = Outcome>;

    /// Calls the `orders` handler through a second inbox on the same database whose connections
    /// give up waiting for a lock after about a second or less.
    fn deliver_impatiently(&self, msg: &Delivery) -> impl Future<Output = Outcome>;

    /// Calls the `quotes` handler (`store_response`, returns a `String`).
    fn deliver_quote(&self, msg: &Delivery) -> impl Future<Output = Quote>;

    /// Calls the `payments` handler (`fingerprint = "label"`).
    fn deliver_payment(&self, msg: &Delivery) -> impl Future<Output = Outcome>;

    /// Calls the `savepoints` handler, which nests transactions in its body.
    fn deliver_savepoints(&self, msg: &Delivery) -> impl Future<Output = Outcome>;

    /// Calls the `keyed` handler, which records the idempotency key it is handed as its label.
    fn deliver_keyed(&self, msg: &Delivery) -> impl Future<Output = Outcome>;

    /// Calls the `notifier` handler on `inbox`: its effect, and the outgoing messages
    /// `msg.outgoing` says, through an `outbox: &mut Outbox` parameter.
    fn deliver_notifier_on(
        &self,
        inbox: &Inbox<Self::Db>,
        msg: &Delivery,
    ) -> impl Future<Output = Outcome>;

    /// Calls the `notifier` handler.
    fn deliver_notifier(&self, msg: &Delivery) -> impl Future<Output = Outcome> {
        self.deliver_notifier_on(self.inbox(), msg)
    }

    /// The outbox's rows, in the order they were written.
    fn outbox_rows(&self) -> impl Future<Output = Vec<OutboxRow>>;

    /// The database lets one transaction write at a time (SQLite): relays on two pools take turns
    /// through its lock, whose waiters poll, so one of them may do all the work.
    fn one_writer(&self) -> bool {
        false
    }

    /// Handles `msgs` as one batch for the consumer `batch`.
    fn deliver_batch(
        &self,
        msgs: &[Delivery],
    ) -> impl Future<Output = Result<Vec<Handled<()>>, Error<TestError>>>;

    /// Handles `msgs` as one batch with an outcome per message (`handle_batch_each`) for the
    /// consumer `batch`.
    fn deliver_batch_each(
        &self,
        msgs: &[Delivery],
    ) -> impl Future<Output = Result<Vec<Outcome>, idempotent::InboxError>>;

    /// Inserts `rows` inbox rows for `consumer` directly, processed now.
    fn bulk_rows(&self, consumer: &str, rows: usize) -> impl Future<Output = ()>;

    /// Moves the processed time of `consumer`'s rows `by` into the past.
    fn backdate(&self, consumer: &str, by: std::time::Duration) -> impl Future<Output = ()>;

    /// Runs `sql` (no parameters) on the harness's pool; the rows it changed. Returns once every
    /// connection of the harness can see the change ([`Harness::writes_applied`]).
    fn execute(&self, sql: &str) -> impl Future<Output = u64>;

    /// Returns once what the harness's own pool committed is visible to the inbox's connections:
    /// at once on one server; on a Galera cluster, once every node has applied it (the harness
    /// writes on node 3, the inbox reads on node 1).
    fn writes_applied(&self) -> impl Future<Output = ()> {
        async {}
    }

    /// Creates the tables of schema version 1 (this library's first release, copied from it) for
    /// the inbox table `table`, and fills them: one row per consumer `old-orders` (a key
    /// `legacy-1` with the response `"kept"` and a fingerprint of `[7; 32]`), `legacy-2` (plain),
    /// and two call records of `legacy-1`: `charge` completed with the result `"ch_1"`, `refund`
    /// pending with a lease far in the future.
    fn create_legacy_tables(&self, table: &str) -> impl Future<Output = ()>;

    /// Returns once another connection's claim is waiting on a lock (where the database shows it;
    /// otherwise after a pause long enough for a claim that does not wait to have finished).
    fn wait_until_a_claim_blocks(&self) -> impl Future<Output = ()>;
}

/// The effect every handler commits, and what it then does; `$insert` inserts `(consumer, label)`
/// into `effects` in the backend's placeholder style.
macro_rules! effect_handlers {
    ($conn:ty, $insert:literal) => {
        use idempotent::idempotent;

        use crate::support::{Behaviour, Delivery, TestError};

        async fn effect(tx: &mut $conn, consumer: &str, msg: &Delivery) -> Result<(), TestError> {
            if let Behaviour::Script(steps) = &msg.behaviour {
                for step in steps {
                    let _ = match step {
                        crate::support::Step::Sql(sql) => {
                            sqlx::query(sqlx::AssertSqlSafe(*sql))
                                .execute(&mut *tx)
                                .await
                        }
                        crate::support::Step::Effect(consumer) => {
                            sqlx::query($insert)
                                .bind(consumer)
                                .bind(&msg.label)
                                .execute(&mut *tx)
                                .await
                        }
                        crate::support::Step::Fail => return Err(TestError::Failed),
                        crate::support::Step::Panic => panic!("the handler panicked on purpose"),
                    };
                }
                return Ok(());
            }
            sqlx::query($insert)
                .bind(consumer)
                .bind(&msg.label)
                .execute(&mut *tx)
                .await?;
            match &msg.behaviour {
                Behaviour::Script(_) => unreachable!("handled above"),
                Behaviour::Succeed => Ok(()),
                Behaviour::Fail => Err(TestError::Failed),
                Behaviour::Panic => panic!("the handler panicked on purpose"),
                Behaviour::Hang(started) => {
                    started.notify_one();
                    std::future::pending().await
                }
            }
        }

        #[idempotent(key = "message_id", consumer = "orders")]
        pub async fn orders(tx: &mut $conn, msg: &Delivery) -> Result<(), TestError> {
            effect(tx, "orders", msg).await
        }

        #[idempotent(key = "message_id", consumer = "billing")]
        pub async fn billing(tx: &mut $conn, msg: &Delivery) -> Result<(), TestError> {
            effect(tx, "billing", msg).await
        }

        #[idempotent(key = "message_id", consumer = "quotes", store_response)]
        pub async fn quotes(tx: &mut $conn, msg: &Delivery) -> Result<String, TestError> {
            effect(tx, "quotes", msg).await?;
            Ok(format!("quote for {}", msg.label))
        }

        #[idempotent(key = "message_id", consumer = "payments", fingerprint = "label")]
        pub async fn payments(tx: &mut $conn, msg: &Delivery) -> Result<(), TestError> {
            effect(tx, "payments", msg).await
        }

        #[idempotent(key = "message_id", consumer = "keyed")]
        pub async fn keyed(
            tx: &mut $conn,
            msg: &Delivery,
            key: idempotent::IdempotencyKey,
        ) -> Result<(), TestError> {
            let mut msg = msg.clone();
            msg.label = key.to_string();
            effect(tx, "keyed", &msg).await
        }

        /// Writes an effect in a nested transaction (a savepoint) that it rolls back, one in a
        /// nested transaction that it commits, then the effect of the message's behaviour.
        #[idempotent(key = "message_id", consumer = "savepoints")]
        pub async fn savepoints(tx: &mut $conn, msg: &Delivery) -> Result<(), TestError> {
            use sqlx::Connection;
            for (consumer, keep) in [("savepoint-undone", false), ("savepoint-kept", true)] {
                let mut nested = tx.begin().await?;
                sqlx::query($insert)
                    .bind(consumer)
                    .bind(&msg.label)
                    .execute(&mut *nested)
                    .await?;
                if keep {
                    nested.commit().await?;
                } else {
                    nested.rollback().await?;
                }
            }
            effect(tx, "savepoints", msg).await
        }

        /// Queues the outgoing messages `msg.outgoing` says, then writes its effect and behaves as
        /// `msg` says.
        #[idempotent(key = "message_id", consumer = "notifier")]
        pub async fn notifier(
            tx: &mut $conn,
            msg: &Delivery,
            outbox: &mut idempotent::outbox::Outbox,
        ) -> Result<(), TestError> {
            use idempotent::outbox::{Destination, OutgoingMessage};
            let outgoing = &msg.outgoing;
            for i in 0..outgoing.count {
                let payload = format!("{}#{i}", msg.label).into_bytes();
                let mut message =
                    OutgoingMessage::new(Destination::queue(outgoing.destination.clone()), payload)
                        .with_header("label", msg.label.clone());
                if let Some(key) = &outgoing.ordering_key {
                    message = message.with_ordering_key(key.clone());
                }
                let id = outbox.send(message);
                outgoing.ids.lock().unwrap().push(id);
            }
            effect(tx, "notifier", msg).await
        }

        #[idempotent(key = "uuid", consumer = "events")]
        pub async fn events(tx: &mut $conn, msg: &Delivery) -> Result<(), TestError> {
            effect(tx, "events", msg).await
        }

        #[idempotent(key = "message_id", consumer = "stamped", sent_at = "sent_at")]
        pub async fn stamped(tx: &mut $conn, msg: &Delivery) -> Result<(), TestError> {
            effect(tx, "stamped", msg).await
        }

        #[idempotent(key = "raw_id", consumer = "orders")]
        pub async fn orders_by_raw_id(tx: &mut $conn, msg: &Delivery) -> Result<(), TestError> {
            effect(tx, "orders", msg).await
        }

        pub(crate) async fn deliver_batch(
            inbox: &idempotent::InboxFor<$conn>,
            msgs: &[Delivery],
        ) -> Result<Vec<idempotent::Handled<()>>, idempotent::Error<TestError>> {
            inbox
                .handle_batch(
                    "batch",
                    msgs,
                    |msg| &msg.message_id,
                    async |tx: &mut $conn, msg: &Delivery| effect(tx, "batch", msg).await,
                )
                .await
        }

        pub(crate) async fn deliver_batch_each(
            inbox: &idempotent::InboxFor<$conn>,
            msgs: &[Delivery],
        ) -> Result<Vec<crate::support::Outcome>, idempotent::InboxError> {
            inbox
                .handle_batch_each(
                    "batch",
                    msgs,
                    |msg| &msg.message_id,
                    async |tx: &mut $conn, msg: &Delivery| effect(tx, "batch", msg).await,
                )
                .await
        }

        pub(crate) async fn deliver(
            inbox: &idempotent::InboxFor<$conn>,
            consumer: crate::support::Consumer,
            msg: &Delivery,
        ) -> crate::support::Outcome {
            match consumer {
                crate::support::Consumer::Orders => orders(inbox, msg).await,
                crate::support::Consumer::Billing => billing(inbox, msg).await,
                crate::support::Consumer::OrdersByRawId => orders_by_raw_id(inbox, msg).await,
                crate::support::Consumer::Savepoints => savepoints(inbox, msg).await,
                crate::support::Consumer::Events => events(inbox, msg).await,
                crate::support::Consumer::Stamped => stamped(inbox, msg).await,
            }
        }
    };
}
pub(crate) use effect_handlers;

/// The methods of [`Harness`] whose code is the same for every backend, given its placeholders;
/// expanded where the backend's `handlers` module, pool and inbox are.
macro_rules! harness_methods {
    ($p1:literal, $p2:literal) => {
        fn inbox(&self) -> &idempotent::Inbox<Self::Db> {
            &self.inbox
        }

        async fn deliver(&self, consumer: Consumer, msg: &Delivery) -> Outcome {
            handlers::deliver(&self.inbox, consumer, msg).await
        }

        async fn deliver_on(
            &self,
            inbox: &idempotent::Inbox<Self::Db>,
            consumer: Consumer,
            msg: &Delivery,
        ) -> Outcome {
            handlers::deliver(inbox, consumer, msg).await
        }

        async fn run_in(&self, claimed: &mut idempotent::Claimed<Self::Db>, sql: &str) -> bool {
            sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
                .execute(claimed.connection())
                .await
                .is_ok()
        }

        async fn deliver_impatiently(&self, msg: &Delivery) -> Outcome {
            handlers::deliver(&self.impatient, Consumer::Orders, msg).await
        }

        async fn deliver_batch(
            &self,
            msgs: &[Delivery],
        ) -> Result<Vec<idempotent::Handled<()>>, idempotent::Error<crate::support::TestError>> {
            handlers::deliver_batch(&self.inbox, msgs).await
        }

        async fn deliver_batch_each(
            &self,
            msgs: &[Delivery],
        ) -> Result<Vec<crate::support::Outcome>, idempotent::InboxError> {
            handlers::deliver_batch_each(&self.inbox, msgs).await
        }

        async fn deliver_quote(&self, msg: &Delivery) -> Quote {
            handlers::quotes(&self.inbox, msg).await
        }

        async fn deliver_quote_on(
            &self,
            inbox: &idempotent::Inbox<Self::Db>,
            msg: &Delivery,
        ) -> Quote {
            handlers::quotes(inbox, msg).await
        }

        async fn deliver_payment_on(
            &self,
            inbox: &idempotent::Inbox<Self::Db>,
            msg: &Delivery,
        ) -> Outcome {
            handlers::payments(inbox, msg).await
        }

        async fn deliver_payment(&self, msg: &Delivery) -> Outcome {
            handlers::payments(&self.inbox, msg).await
        }

        async fn deliver_keyed(&self, msg: &Delivery) -> Outcome {
            handlers::keyed(&self.inbox, msg).await
        }

        async fn deliver_notifier_on(
            &self,
            inbox: &idempotent::Inbox<Self::Db>,
            msg: &Delivery,
        ) -> Outcome {
            handlers::notifier(inbox, msg).await
        }

        async fn outbox_rows(&self) -> Vec<crate::support::OutboxRow> {
            sqlx::query_as(
                "SELECT message_id, routing_key, ordering_key, ordering_seq, state, origin \
                 FROM idempotent_inbox_outbox ORDER BY id",
            )
            .fetch_all(&self.pool)
            .await
            .unwrap()
        }

        async fn deliver_savepoints(&self, msg: &Delivery) -> Outcome {
            handlers::savepoints(&self.inbox, msg).await
        }

        async fn effects(&self, label: &str) -> i64 {
            sqlx::query_scalar(concat!("SELECT COUNT(*) FROM effects WHERE label = ", $p1))
                .bind(label)
                .fetch_one(&self.pool)
                .await
                .unwrap()
        }

        async fn effects_of(&self, consumer: &str, label: &str) -> i64 {
            sqlx::query_scalar(concat!(
                "SELECT COUNT(*) FROM effects WHERE consumer = ",
                $p1,
                " AND label = ",
                $p2
            ))
            .bind(consumer)
            .bind(label)
            .fetch_one(&self.pool)
            .await
            .unwrap()
        }

        async fn effect_counts(&self, consumer: &str) -> std::collections::HashMap<String, i64> {
            sqlx::query_as::<_, (String, i64)>(concat!(
                "SELECT label, COUNT(*) FROM effects WHERE consumer = ",
                $p1,
                " GROUP BY label"
            ))
            .bind(consumer)
            .fetch_all(&self.pool)
            .await
            .unwrap()
            .into_iter()
            .collect()
        }

        async fn execute(&self, sql: &str) -> u64 {
            let changed = sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
                .execute(&self.pool)
                .await
                .unwrap()
                .rows_affected();
            self.writes_applied().await;
            changed
        }

        async fn inbox_rows(&self) -> i64 {
            sqlx::query_scalar("SELECT COUNT(*) FROM idempotent_inbox")
                .fetch_one(&self.pool)
                .await
                .unwrap()
        }
    };
}
pub(crate) use harness_methods;

/// An inbox row of the first release's tables: `(key, response, fingerprint)`.
pub type LegacyRow = (Vec<u8>, Option<Vec<u8>>, Option<Vec<u8>>);
/// A call record of the first release's tables: `(key, call, completed, result)`.
pub type LegacyCall = (Vec<u8>, &'static str, bool, Option<Vec<u8>>);

/// The rows [`Harness::create_legacy_tables`] fills version 1 tables with.
pub fn legacy_rows() -> (Vec<LegacyRow>, Vec<LegacyCall>) {
    let key = |k: &str| idempotent::message_key(k).unwrap().as_bytes().to_vec();
    (
        vec![
            (
                key("legacy-1"),
                Some(b"\"kept\"".to_vec()),
                Some(vec![7; 32]),
            ),
            (key("legacy-2"), None, None),
        ],
        vec![
            (key("legacy-1"), "charge", true, Some(b"\"ch_1\"".to_vec())),
            (key("legacy-1"), "refund", false, None),
        ],
    )
}

/// A lease far in the future, in milliseconds (the year 2100).
pub const FAR_LEASE_MS: i64 = 4_102_444_800_000;

/// The effects table, the same on every backend.
pub const CREATE_EFFECTS: &str =
    "CREATE TABLE effects (consumer TEXT NOT NULL, label TEXT NOT NULL)";

/// A table with a unique key, whose row 1 is there: inserting it again is a unique violation.
pub const CREATE_UNIQUES: [&str; 2] = [
    "CREATE TABLE uniques (id INTEGER PRIMARY KEY)",
    "INSERT INTO uniques (id) VALUES (1)",
];
