//! What RabbitMQ does with delivery tags (`IDEMPOTENT_AMQP_URL`, started by `scripts/test`). A
//! consumer SIGKILLed after its commit but before its acknowledgement is in `tests/brokers/runner_kill.rs`.
#![cfg(feature = "sqlite")]

use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions,
    QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};

fn amqp_url() -> String {
    std::env::var("IDEMPOTENT_AMQP_URL").expect(
        "IDEMPOTENT_AMQP_URL is not set: run the tests with scripts/test, which starts RabbitMQ",
    )
}

/// Why keying on the delivery tag is a compile error: the broker's redelivery of one message comes
/// with a new tag, and on another channel a different message gets a tag already seen.
#[tokio::test]
async fn delivery_tags_change_on_redelivery_and_repeat_across_channels() {
    let queue = format!("tags-{}", uuid::Uuid::new_v4().simple());
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap();
    let publisher = connection.create_channel().await.unwrap();
    publisher
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    for id in ["first-message", "second-message"] {
        publisher
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                b"{}",
                BasicProperties::default().with_message_id(id.into()),
            )
            .await
            .unwrap();
    }

    let consume = |channel: lapin::Channel| {
        let queue = queue.clone();
        async move {
            channel.basic_qos(1, Default::default()).await.unwrap();
            channel
                .basic_consume(
                    queue.as_str().into(),
                    "".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .unwrap()
        }
    };
    let id = |d: &lapin::message::Delivery| d.properties.message_id().as_ref().unwrap().to_string();

    let channel_a = connection.create_channel().await.unwrap();
    let mut a = consume(channel_a.clone()).await;
    let first = a.next().await.unwrap().unwrap();
    first
        .nack(BasicNackOptions {
            requeue: true,
            ..Default::default()
        })
        .await
        .unwrap();
    let again = a.next().await.unwrap().unwrap();
    assert_eq!(
        id(&again),
        id(&first),
        "the broker redelivered the same message"
    );
    assert!(!first.redelivered && again.redelivered);
    assert_ne!(
        again.delivery_tag, first.delivery_tag,
        "a redelivery gets a new tag"
    );
    again.ack(BasicAckOptions::default()).await.unwrap();
    channel_a.close(200, "done".into()).await.unwrap();

    let mut b = consume(connection.create_channel().await.unwrap()).await;
    let second = b.next().await.unwrap().unwrap();
    assert_ne!(id(&second), id(&first));
    assert_eq!(
        second.delivery_tag, first.delivery_tag,
        "another message on another channel reuses a tag"
    );
    second.ack(BasicAckOptions::default()).await.unwrap();
}
