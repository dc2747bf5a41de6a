//! One bad destination stays its own trouble: a row to an exchange that does not exist, to a
//! subject no stream captures, to a full queue or stream that refuses it, or too large for the
//! broker, is parked after its attempts with the broker's reason, while every other row goes out.

use std::time::Duration;

use idempotent::outbox::{Destination, Outbox, OutgoingMessage};

use crate::forging::{Method, forging_acknowledgements};
use crate::{
    Two, amqp_url, each_at_least_once, options, rabbitmq_ids, rabbitmq_queue, rabbitmqctl,
};

/// Asserts that the outbox has one parked message, `id`, after `attempts` attempts, its reason
/// containing each of `reason`; returns its row.
async fn the_one_parked(two: &Two, id: &str, attempts: u32, reason: &[&str]) -> i64 {
    let parked = two.producer.parked_messages(None, 10).await.unwrap();
    assert_eq!(parked.len(), 1, "{parked:?}");
    assert_eq!(
        (parked[0].message_id.as_str(), parked[0].attempts),
        (id, attempts)
    );
    let last = parked[0].last_error.clone().unwrap();
    assert!(reason.iter().all(|part| last.contains(part)), "{last}");
    parked[0].row
}

/// A relay of `two`'s producer, in batches of 50, to RabbitMQ at `url` through a publisher with a
/// connection of its own.
async fn relay_to_rabbitmq(two: &Two, url: &str) -> idempotent::outbox::Relay {
    let publisher = idempotent::broker::rabbitmq::OutboxPublisher::connect(url)
        .await
        .unwrap();
    two.producer
        .spawn_relay(publisher, options().batch_size(50))
}

/// One row addressed to an exchange that does not exist, the oldest, among 200 good rows: the
/// broker closes a channel that publishes to a missing exchange (404), which must not take the
/// others down with it. Every good row is published, and the bad one is parked with the broker's
/// reason after its attempts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_a_missing_exchange_is_parked_and_holds_up_none_of_200_other_rows() {
    let _no_alarm = crate::ALARM.read().await;
    let (channel, queue) = rabbitmq_queue(lapin::types::FieldTable::default()).await;
    let two = Two::new().await;
    let missing = Destination::exchange(format!("missing-{queue}"), "paid");
    let lost = two.orders("missing", 1, &missing).await;
    let ids = two
        .orders("paid", 200, &Destination::queue(queue.clone()))
        .await;
    let relay = relay_to_rabbitmq(&two, &amqp_url()).await;
    two.until_published(200, 1).await;
    relay.shutdown().await;
    the_one_parked(&two, &lost[0], 2, &["NOT_FOUND"]).await;
    each_at_least_once(&rabbitmq_ids(&channel, &queue).await, &ids);
}

/// An exchange the publisher has published to (and so knows) is deleted while the relay runs:
/// the next row to it closes the publisher's channel (404), failing the rows in flight beside it.
/// That row is refused (an attempt), the exchange is checked again before its next attempt, which
/// parks it, and the channel is opened again for the others: all 100 rows published after the
/// deletion go out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_an_exchange_deleted_under_the_relay_is_parked_and_the_channel_reopened() {
    let _no_alarm = crate::ALARM.read().await;
    use lapin::options::{ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions};
    use lapin::types::FieldTable;
    let (channel, queue) = rabbitmq_queue(FieldTable::default()).await;
    let exchange = format!("doomed-{queue}");
    channel
        .exchange_declare(
            exchange.as_str().into(),
            lapin::ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    channel
        .queue_bind(
            queue.as_str().into(),
            exchange.as_str().into(),
            "paid".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let two = Two::new().await;
    let doomed = Destination::exchange(exchange.clone(), "paid");
    let mut ids = two.orders("before", 5, &doomed).await;
    let relay = relay_to_rabbitmq(&two, &amqp_url()).await;
    two.until_published(5, 0).await;

    channel
        .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
        .await
        .unwrap();
    let lost = two.orders("doomed", 1, &doomed).await;
    ids.extend(
        two.orders("after", 100, &Destination::queue(queue.clone()))
            .await,
    );
    two.until_published(105, 1).await;
    relay.shutdown().await;
    the_one_parked(&two, &lost[0], 2, &["NOT_FOUND"]).await;
    each_at_least_once(&rabbitmq_ids(&channel, &queue).await, &ids);
}

/// A user of the test broker, with every permission but writing only where `write` (a regular
/// expression, quoted for the shell) matches; deleted when dropped.
struct User(String);

impl User {
    fn add(name: &str, write: &str) -> Self {
        rabbitmqctl(&format!("add_user {name} secret"));
        let user = Self(name.to_owned());
        rabbitmqctl(&format!("set_permissions -p / {name} '.*' {write} '.*'"));
        user
    }
}

impl Drop for User {
    fn drop(&mut self) {
        if let Err(error) = crate::try_rabbitmqctl(&format!("delete_user {}", self.0)) {
            eprintln!("{error}");
        }
    }
}

/// A publisher whose user may not publish to one exchange (RabbitMQ answers 403 and closes the
/// channel, as for a missing exchange): that exchange's row is parked after its attempts with the
/// broker's reason, and the 100 rows after it go out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_an_exchange_the_user_may_not_publish_to_is_parked_and_holds_up_no_other_row() {
    use lapin::options::ExchangeDeclareOptions;
    use lapin::types::FieldTable;
    let _no_alarm = crate::ALARM.read().await;
    let (channel, queue) = rabbitmq_queue(FieldTable::default()).await;
    let forbidden = format!("forbidden-{queue}");
    channel
        .exchange_declare(
            forbidden.as_str().into(),
            lapin::ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let user = User::add(&format!("limited-{queue}"), "'^(?!forbidden-).*'");
    let user = &user.0;
    let url = amqp_url().replacen("guest:guest@", &format!("{user}:secret@"), 1);
    assert_ne!(url, amqp_url(), "IDEMPOTENT_AMQP_URL is not guest's");

    let two = Two::new().await;
    let lost = two
        .orders("forbidden", 1, &Destination::exchange(forbidden, "paid"))
        .await;
    let ids = two
        .orders("paid", 100, &Destination::queue(queue.clone()))
        .await;
    let relay = relay_to_rabbitmq(&two, &url).await;
    two.until_published(100, 1).await;
    relay.shutdown().await;
    the_one_parked(&two, &lost[0], 2, &["ACCESS_REFUSED"]).await;
    each_at_least_once(&rabbitmq_ids(&channel, &queue).await, &ids);
}

/// The broker's `max_message_size`, lowered for one case and put back as it was when dropped.
/// Only messages larger than it are refused (no other test sends one over 1 MiB to RabbitMQ), and
/// only on channels opened while it is lowered: RabbitMQ reads it when a channel opens.
struct MaxMessageSize {
    was: u64,
}

impl MaxMessageSize {
    const LOWERED: usize = 1024 * 1024;

    fn lower() -> Self {
        let was = rabbitmqctl("eval 'application:get_env(rabbit, max_message_size).'");
        let was = was
            .trim()
            .strip_prefix("{ok,")
            .and_then(|rest| rest.strip_suffix('}'))
            .and_then(|bytes| bytes.parse().ok())
            .unwrap_or_else(|| panic!("max_message_size: {was}"));
        rabbitmqctl(&Self::set(Self::LOWERED as u64));
        Self { was }
    }

    fn set(bytes: u64) -> String {
        format!("eval 'application:set_env(rabbit, max_message_size, {bytes}).'")
    }
}

impl Drop for MaxMessageSize {
    fn drop(&mut self) {
        if let Err(error) = crate::try_rabbitmqctl(&Self::set(self.was)) {
            eprintln!("{error}");
        }
    }
}

/// One row larger than the broker's `max_message_size`, the oldest, ahead of 100 good rows:
/// RabbitMQ answers 406 and closes the channel, naming no exchange. It is parked after its
/// attempts with the broker's reason, and the 100 rows go out. (It was left pending with no
/// attempt counted, sent again at every batch for ever.) Then the limit is raised again and the
/// row retried: it goes out, on a channel opened under the raised limit (the publisher's channels
/// opened under the lowered one were closed at the refusal).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_a_message_over_the_brokers_size_limit_is_parked_and_holds_up_no_other_row() {
    // The limit is the broker's: no other case of this binary runs meanwhile.
    let _alone = crate::ALARM.write().await;
    let (channel, queue) = rabbitmq_queue(lapin::types::FieldTable::default()).await;
    let limit = MaxMessageSize::lower();
    let two = Two::new().await;
    let mut outbox = Outbox::new("huge", "huge-0").unwrap();
    outbox.send(OutgoingMessage::new(
        Destination::queue(queue.clone()),
        vec![b'x'; 2 * MaxMessageSize::LOWERED],
    ));
    let huge = Outbox::derived_id("huge", &idempotent::message_key("huge-0").unwrap(), 0);
    let mut tx = two.producer.pool().begin().await.unwrap();
    two.producer.enqueue(&mut tx, outbox).await.unwrap();
    tx.commit().await.unwrap();
    let mut ids = two
        .orders("paid", 100, &Destination::queue(queue.clone()))
        .await;
    let relay = relay_to_rabbitmq(&two, &amqp_url()).await;
    two.until_published(100, 1).await;
    let row = the_one_parked(&two, &huge, 2, &["406", "max size"]).await;
    drop(limit);
    assert!(two.producer.retry_parked(row).await.unwrap());
    two.until_published(101, 0).await;
    relay.shutdown().await;
    ids.push(huge);
    each_at_least_once(&rabbitmq_ids(&channel, &queue).await, &ids);
}

/// lapin fails a connection whose broker acknowledges a publication never sent, and every
/// publication in flight on every one of its channels with that error, which carries a channel's
/// code (406). That is no publication's refusal: no row counts an attempt for it, none is parked,
/// and all 400 go out on the connections made again (four of them were failed that way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_a_connection_failed_by_a_forged_acknowledgement_parks_no_row() {
    let _no_alarm = crate::ALARM.read().await;
    let (channel, queue) = rabbitmq_queue(lapin::types::FieldTable::default()).await;
    let two = Two::new().await;
    let ids = two
        .orders("paid", 400, &Destination::queue(queue.clone()))
        .await;
    let url = forging_acknowledgements(&amqp_url(), Method::BASIC_ACK, 5, 4).await;
    let relay = relay_to_rabbitmq(&two, &url).await;
    two.until_published(400, 0).await;
    relay.shutdown().await;
    each_at_least_once(&rabbitmq_ids(&channel, &queue).await, &ids);
}

/// The same on JetStream: one row to a subject that no stream captures, the oldest, among 200 good
/// rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_a_subject_without_a_stream_is_parked_and_holds_up_none_of_200_other_rows() {
    use idempotent::broker::nats::async_nats::{self, jetstream};
    let url = std::env::var("IDEMPOTENT_NATS_URL")
        .expect("IDEMPOTENT_NATS_URL is not set: run the tests with scripts/test");
    let context = jetstream::new(async_nats::connect(&url).await.unwrap());
    let prefix = uuid::Uuid::new_v4().simple().to_string();
    context
        .create_stream(jetstream::stream::Config {
            name: format!("O_{prefix}"),
            subjects: vec![format!("{prefix}.>")],
            ..Default::default()
        })
        .await
        .unwrap();
    let two = Two::new().await;
    let nowhere = Destination::subject(format!("nostream-{prefix}.paid"));
    let lost = two.orders("nowhere", 1, &nowhere).await;
    two.orders("paid", 200, &Destination::subject(format!("{prefix}.paid")))
        .await;
    let publisher = idempotent::broker::nats::OutboxPublisher::new(context.clone());
    let relay = two
        .producer
        .spawn_relay(publisher, options().batch_size(50));
    two.until_published(200, 1).await;
    relay.shutdown().await;
    the_one_parked(&two, &lost[0], 2, &[]).await;
    let mut info = context.get_stream(format!("O_{prefix}")).await.unwrap();
    assert_eq!(info.info().await.unwrap().state.messages, 200);
}

/// A queue that is full and refuses publishes (`x-max-length` 1, `x-overflow: reject-publish`)
/// gets the oldest row; 1,000 rows go to a healthy queue. The refusal is the row's own: it is
/// retried after its own back-off and parked after its attempts, while every healthy row goes
/// out (the whole relay backing off at each refusal would take minutes); once the queue has room,
/// the parked row retried by hand is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_a_full_queue_refusing_publishes_backs_off_alone_while_the_rest_flows() {
    let _no_alarm = crate::ALARM.read().await;
    use lapin::options::{BasicPublishOptions, QueuePurgeOptions};
    use lapin::types::{AMQPValue, FieldTable, ShortString};
    let mut limited = FieldTable::default();
    limited.insert(ShortString::from("x-max-length"), AMQPValue::LongLongInt(1));
    limited.insert(
        ShortString::from("x-overflow"),
        AMQPValue::LongString("reject-publish".into()),
    );
    let (channel, full) = rabbitmq_queue(limited).await;
    let confirmation = channel
        .basic_publish(
            "".into(),
            full.as_str().into(),
            BasicPublishOptions::default(),
            b"filler",
            lapin::BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(
        confirmation.is_ack(),
        "the queue did not take its one message"
    );
    let (_, healthy) = rabbitmq_queue(FieldTable::default()).await;

    let two = Two::new().await;
    let refused = two
        .orders("refused", 1, &Destination::queue(full.clone()))
        .await;
    let ids = two
        .orders("paid", 1000, &Destination::queue(healthy.clone()))
        .await;
    let publisher = idempotent::broker::rabbitmq::OutboxPublisher::connect(&amqp_url())
        .await
        .unwrap();
    let options = options()
        .batch_size(50)
        .attempts(3, Duration::from_millis(200));
    let relay = two.producer.spawn_relay(publisher, options);
    two.until_published(1000, 1).await;
    let row = the_one_parked(&two, &refused[0], 3, &["basic.nack"]).await;
    each_at_least_once(&rabbitmq_ids(&channel, &healthy).await, &ids);

    // Room is made: retried by hand, the row is delivered.
    channel
        .queue_purge(full.as_str().into(), QueuePurgeOptions::default())
        .await
        .unwrap();
    assert!(two.producer.retry_parked(row).await.unwrap());
    two.until_published(1001, 0).await;
    relay.shutdown().await;
    assert_eq!(rabbitmq_ids(&channel, &full).await, refused);
}

/// The same on JetStream: a stream that is full and refuses more (`max_messages` 1,
/// `DiscardPolicy::New`) gets the oldest row, 200 rows go to another stream. The refused row is
/// parked after its attempts while the 200 go out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_a_full_stream_refusing_messages_backs_off_alone_while_the_rest_flows() {
    use idempotent::broker::nats::async_nats::{self, jetstream};
    let url = std::env::var("IDEMPOTENT_NATS_URL")
        .expect("IDEMPOTENT_NATS_URL is not set: run the tests with scripts/test");
    let context = jetstream::new(async_nats::connect(&url).await.unwrap());
    let prefix = uuid::Uuid::new_v4().simple().to_string();
    for (name, max_messages) in [("FULL", 1), ("OPEN", -1)] {
        context
            .create_stream(jetstream::stream::Config {
                name: format!("{name}_{prefix}"),
                subjects: vec![format!("{prefix}.{name}")],
                max_messages,
                discard: jetstream::stream::DiscardPolicy::New,
                ..Default::default()
            })
            .await
            .unwrap();
    }
    context
        .publish(format!("{prefix}.FULL"), "filler".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let two = Two::new().await;
    let refused = two
        .orders(
            "refused",
            1,
            &Destination::subject(format!("{prefix}.FULL")),
        )
        .await;
    two.orders("paid", 200, &Destination::subject(format!("{prefix}.OPEN")))
        .await;
    let publisher = idempotent::broker::nats::OutboxPublisher::new(context.clone());
    let options = options()
        .batch_size(50)
        .attempts(3, Duration::from_millis(200));
    let relay = two.producer.spawn_relay(publisher, options);
    two.until_published(200, 1).await;
    relay.shutdown().await;
    the_one_parked(&two, &refused[0], 3, &["the stream refused"]).await;
    let mut info = context.get_stream(format!("OPEN_{prefix}")).await.unwrap();
    assert_eq!(info.info().await.unwrap().state.messages, 200);
}
