//! A RabbitMQ memory alarm (raised and cleared with `rabbitmqctl` through `IDEMPOTENT_AMQP_CTL`)
//! while a relay publishes: no row lost, none sent twice while the broker may still confirm it,
//! no hang, and publishing goes on when the alarm clears.

use std::time::{Duration, Instant};

use idempotent::outbox::{Destination, RelayOptions};

use crate::{
    Two, amqp_url, each_at_least_once, options, rabbitmq_ids, rabbitmq_queue, rabbitmqctl,
};

/// A memory alarm on the test broker for as long as it lives: RabbitMQ blocks every connection
/// that publishes.
struct MemoryAlarm;

impl MemoryAlarm {
    fn raise() -> Self {
        rabbitmqctl("eval 'rabbit_alarm:set_alarm({{resource_limit, memory, node()}, []}).'");
        Self
    }
}

impl Drop for MemoryAlarm {
    fn drop(&mut self) {
        let clear = "eval 'rabbit_alarm:clear_alarm({resource_limit, memory, node()}).'";
        if let Err(error) = crate::try_rabbitmqctl(clear) {
            eprintln!("the memory alarm may still be on: {error}");
        }
    }
}

/// A memory alarm while a relay publishes 1,000 rows: the broker blocks the publisher's
/// connection, so no publication is confirmed until the alarm clears. The relay waits out each
/// publication at most its `publish_timeout`, several times over; it neither hangs (its shutdown
/// returns) nor loses a row, goes on once the alarm clears, and publishes a row again only if the
/// broker may not have it: at most one batch's rows arrive twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_memory_alarm_holds_the_relay_until_it_clears_without_losing_or_doubling_rows() {
    let _alone = crate::ALARM.write().await;
    let (channel, queue) = rabbitmq_queue(lapin::types::FieldTable::default()).await;
    let two = Two::new().await;
    let ids = two
        .orders("paid", 1000, &Destination::queue(queue.clone()))
        .await;
    let publisher = idempotent::broker::rabbitmq::OutboxPublisher::connect(&amqp_url())
        .await
        .unwrap();
    const BATCH: usize = 100;
    let options = options()
        .batch_size(BATCH)
        .publish_timeout(Duration::from_millis(500));
    let alarm = MemoryAlarm::raise();
    let relay = two.producer.spawn_relay(publisher, options);
    // The relay tried and found no confirmation, again and again.
    let start = Instant::now();
    while relay.stats().retried < 4 * BATCH as u64 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the relay met no alarm: {:?}",
            relay.stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(alarm);
    two.until_published(1000, 0).await;
    let stats = tokio::time::timeout(Duration::from_secs(30), relay.shutdown())
        .await
        .expect("the relay's shutdown hung");
    let got = rabbitmq_ids(&channel, &queue).await;
    let doubled = each_at_least_once(&got, &ids);
    eprintln!(
        "memory alarm: {} publications of 1,000 rows, {doubled} duplicates; relay {stats:?}",
        got.len()
    );
    assert!(
        doubled <= BATCH,
        "{doubled} duplicate publications for 1,000 rows"
    );
}

/// The README's figure: a memory alarm of 15 s over a relay with 1,000 rows to publish, with the
/// default `publish_timeout` (10 s) and with 2 s; prints the duplicates the queue got and how
/// long after the alarm cleared the last row was sent. A measurement, run by hand:
/// `cargo test --all-features --test outbox_publishers -- --ignored --nocapture alarm_of_15_s`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement of about 40 s, for the README"]
async fn rabbitmq_memory_alarm_of_15_s_duplicates_measured() {
    let _alone = crate::ALARM.write().await;
    for timeout in [10, 2] {
        let (channel, queue) = rabbitmq_queue(lapin::types::FieldTable::default()).await;
        let two = Two::new().await;
        let ids = two
            .orders("paid", 1000, &Destination::queue(queue.clone()))
            .await;
        let publisher = idempotent::broker::rabbitmq::OutboxPublisher::connect(&amqp_url())
            .await
            .unwrap();
        let alarm = MemoryAlarm::raise();
        let options = RelayOptions::default().publish_timeout(Duration::from_secs(timeout));
        let relay = two.producer.spawn_relay(publisher, options);
        // The alarm's length is what is measured, not a wait for something.
        tokio::time::sleep(Duration::from_secs(15)).await;
        drop(alarm);
        let cleared = Instant::now();
        two.until_published(1000, 0).await;
        let resumed = cleared.elapsed();
        relay.shutdown().await;
        let got = rabbitmq_ids(&channel, &queue).await;
        let doubled = each_at_least_once(&got, &ids);
        eprintln!(
            "publish_timeout {timeout} s: {doubled} duplicates of 1,000 rows; all sent {resumed:?} \
             after the alarm cleared"
        );
    }
}
