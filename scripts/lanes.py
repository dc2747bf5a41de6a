#!/usr/bin/env python3
"""Sorts the test binaries of a `cargo test --no-run --message-format=json` build into the lanes
scripts/test runs side by side: one line per binary, `LANE NAME KIND DIR EXECUTABLE`.

- brokers: the tests that use RabbitMQ, NATS, Kafka's mock cluster and SQS (and restart RabbitMQ
  and NATS, or raise RabbitMQ's memory alarm), each with SQLite files of its own;
- databases: every other test, on PostgreSQL, MariaDB, Galera, the PostgreSQL pair, PgBouncer and
  SQLite (chaos restarts the PostgreSQL the others use, so they stay in one lane, in order), and
  the Kafka held partitions' tests (kafka_holds, hostile_kafka_holds: the mock cluster in their
  own process and SQLite files, no server), which balance the two lanes;
- last: the tests that need both (chaos_outbox restarts PostgreSQL under a relay to RabbitMQ;
  otel_trace goes from PostgreSQL through RabbitMQ and NATS), run once the other two lanes have
  ended;
- ui: the trybuild cases, which scripts/test runs beside everything else.

Usage: scripts/lanes.py BUILD_JSON
"""
import json
import sys

BROKERS = {
    "runner_rabbitmq", "runner_nats", "runner_kafka", "runner_sqs", "sqs_hostile", "runner_kill",
    "rabbitmq_delivery_tags", "outbox_publishers", "runner_weather", "dlq",
}
LAST = {"chaos_outbox", "otel_trace"}
UI = {"ui"}


def lane(name):
    if name in UI:
        return "ui"
    if name in LAST:
        return "last"
    if name in BROKERS:
        return "brokers"
    return "databases"


def main(path):
    seen = set()
    with open(path) as build:
        for line in build:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if message.get("reason") != "compiler-artifact" or not message.get("executable"):
                continue
            if not message["profile"]["test"]:
                continue
            target = message["target"]
            name, kind = target["name"], target["kind"][0]
            if (name, kind) in seen:
                continue
            seen.add((name, kind))
            directory = message["manifest_path"].rsplit("/", 1)[0]
            print(lane(name), name, kind, directory, message["executable"])


if __name__ == "__main__":
    main(sys.argv[1])
