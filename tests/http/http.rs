//! The HTTP layer for real: an axum server on loopback, reqwest as the client, on PostgreSQL
//! (`IDEMPOTENT_PG_URL`, a fresh schema per test) and SQLite (a fresh file per test). Every test
//! counts the effects in the database, not only the status codes.
//!
//! Two routes, each behind its own layer on one inbox: `/payments` is transactional (the handler
//! writes its effect in the claimed transaction), `/emails` is leased (the handler writes its
//! effect on its own, as an outside service would). The request's JSON says what the handler
//! does: sleep, hang, answer with some status, a long or a streamed body.
#![cfg(all(feature = "http", feature = "postgres", feature = "sqlite"))]

mod http_app;
#[path = "../support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use axum::http::header;
use serde_json::json;

use http_app::{Api, Backend, Call, Lite, Pg, Reply, Setup};

const ROUTES: [(&str, &str); 2] = [("/payments", "payments"), ("/emails", "emails")];

/// A client that gives up mid-request (its timeout drops the connection) and retries: the first
/// request is finished and stored all the same, and the retry gets its replay. One effect.
async fn a_retry_after_the_client_gave_up_gets_one_effect<B: Backend>() {
    let api = Api::<B>::start(Setup::default()).await;
    for (route, effect) in ROUTES {
        let key = format!("k-gave-up-{effect}");
        let order = json!({ "label": "gave-up", "sleep_ms": 600 });
        let first = api
            .send(Call::new(route, &key, order.clone()).timeout(Duration::from_millis(150)))
            .await;
        assert!(first.unwrap_err().is_timeout(), "{route}");
        let retry = api
            .settle(
                || Call::new(route, &key, order.clone()),
                Duration::from_secs(5),
            )
            .await;
        assert_eq!(retry.status, 201, "{route}: {retry:?}");
        assert!(retry.replayed(), "{route}: the first request's response");
        assert_eq!(retry.run(), 1, "{route}");
        assert_eq!(api.db.effects(effect, "gave-up").await, 1, "{route}");
        api.seen.runs.lock().unwrap().clear();
    }
}

/// 50 requests with one key at the same moment, spread over two instances of the server (each
/// with its own layer): one runs, the others are refused at once (409, before the one that runs
/// has answered) or, once it finished, get its replay. (On SQLite a transactional twin on the other instance waits for the write lock,
/// then replays: see `a_transactional_twin_on_another_instance_waits_for_the_write_lock_then_replays`.)
/// One effect.
async fn fifty_concurrent_requests_with_one_key_have_one_effect<B: Backend>() {
    let api = Api::<B>::start(Setup::default()).await;
    let other = api.another_instance();
    for (route, effect) in ROUTES {
        let label = format!("fifty-{effect}");
        let order = json!({ "label": label, "sleep_ms": 800 });
        let key = format!("k-fifty-{effect}");
        let calls = (0..50).map(|i| {
            let server = if i % 2 == 0 { &api.server } else { &other };
            api.send_to(server, Call::new(route, &key, order.clone()))
        });
        let replies: Vec<Reply> = futures::future::join_all(calls)
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        let ran: Vec<_> = replies
            .iter()
            .filter(|r| r.status == 201 && !r.replayed())
            .collect();
        assert_eq!(ran.len(), 1, "{route}: {replies:?}");
        let ran = ran[0].finished;
        for reply in &replies {
            match reply.status {
                201 => assert_eq!(reply.run(), 1, "{route}"),
                409 => {
                    assert_eq!(reply.code(), "idempotency_key_in_use");
                    assert!(reply.retry_after().is_some());
                    // A claim that waited for the first request could only answer after its commit.
                    assert!(
                        reply.finished < ran,
                        "{route}: a 409 must not wait for the request that runs ({:?})",
                        reply.elapsed
                    );
                }
                other => panic!("{route}: unexpected {other}: {reply:?}"),
            }
        }
        assert_eq!(api.db.effects(effect, &label).await, 1, "{route}");
        assert_eq!(api.seen.runs(&label), 1, "{route}");
    }
}

/// With `wait_for_first`, 50 requests with one key at the same moment over two instances: one
/// runs, and the 49 others wait for it (on its instance woken as it ends, on the other following
/// its claim in the database) and get its replay: not one 409. One effect.
async fn fifty_twins_that_wait_get_one_run_and_forty_nine_replays<B: Backend>() {
    let api = Api::<B>::start(Setup {
        wait_for_first: Some(Duration::from_secs(30)),
        ..Setup::default()
    })
    .await;
    let other = api.another_instance();
    for (route, effect) in ROUTES {
        let label = format!("waiting-fifty-{effect}");
        let order = json!({ "label": label, "sleep_ms": 800 });
        let key = format!("k-waiting-fifty-{effect}");
        let calls = (0..50).map(|i| {
            let server = if i % 2 == 0 { &api.server } else { &other };
            api.send_to(server, Call::new(route, &key, order.clone()))
        });
        let replies: Vec<Reply> = futures::future::join_all(calls)
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        let statuses: Vec<_> = replies.iter().map(|r| r.status).collect();
        assert!(statuses.iter().all(|s| *s == 201), "{route}: {statuses:?}");
        let replayed = replies.iter().filter(|r| r.replayed()).count();
        assert_eq!(replayed, 49, "{route}: {replies:?}");
        assert!(replies.iter().all(|r| r.run() == 1), "{route}: {replies:?}");
        assert_eq!(api.db.effects(effect, &label).await, 1, "{route}");
        assert_eq!(api.seen.runs(&label), 1, "{route}");
    }
}

/// With `wait_for_first`, a twin whose first request is still running when its patience is over
/// gets the 409 with `Retry-After`, on the first's instance and on another, before the first
/// ends; its retry afterwards gets the replay. (On SQLite, a transactional twin on another
/// instance waits for the write lock whatever the layer says: see
/// `a_transactional_twin_on_another_instance_waits_for_the_write_lock_then_replays`.)
async fn a_twin_that_waited_its_patience_gets_409<B: Backend>() {
    let patience = Duration::from_millis(300);
    let api = Api::<B>::start(Setup {
        wait_for_first: Some(patience),
        ..Setup::default()
    })
    .await;
    let other = api.another_instance();
    for (route, effect) in ROUTES {
        let label = format!("impatient-{effect}");
        let order = json!({ "label": label, "sleep_ms": 2000 });
        let call = || Call::new(route, &label, order.clone());
        let on_other = !(B::ONE_WRITER && route == "/payments");
        let (first, twins) = tokio::join!(api.send(call()), async {
            api.until_runs(&label, 1).await;
            let here = api.send(call());
            let there = async {
                if on_other {
                    Some(api.send_to(&other, call()).await)
                } else {
                    None
                }
            };
            tokio::join!(here, there)
        });
        let first = first.unwrap();
        assert_eq!((first.status, first.replayed()), (201, false), "{route}");
        let (here, there) = twins;
        for twin in std::iter::once(here).chain(there) {
            let twin = twin.unwrap();
            assert_eq!(twin.status, 409, "{route}: {twin:?}");
            assert_eq!(twin.code(), "idempotency_key_in_use");
            assert!(twin.retry_after().is_some(), "{route}: {twin:?}");
            assert!(
                twin.elapsed >= patience,
                "{route}: it did not wait: {twin:?}"
            );
            assert!(
                twin.finished < first.finished,
                "{route}: it waited for the first: {twin:?}"
            );
        }
        let retry = api.send_to(&other, call()).await.unwrap();
        assert_eq!(
            (retry.status, retry.replayed(), retry.run()),
            (201, true, 1)
        );
        assert_eq!(api.db.effects(effect, &label).await, 1, "{route}");
    }
}

/// With `wait_for_first`, twins of a first request whose response is not stored (a 500) do not
/// replay it: once it ends, one of them runs the handler, as a retry would, and the other gets
/// that run's replay. Two runs, one effect.
async fn twins_of_a_failed_first_request_run_it_again<B: Backend>() {
    let api = Api::<B>::start(Setup {
        wait_for_first: Some(Duration::from_secs(30)),
        ..Setup::default()
    })
    .await;
    let other = api.another_instance();
    for (route, effect) in ROUTES {
        let label = format!("failed-first-{effect}");
        let order = json!({ "label": label, "sleep_ms": 500, "fail_first": true });
        let call = || Call::new(route, &label, order.clone());
        let (first, here, there) = tokio::join!(
            api.send(call()),
            async {
                api.until_runs(&label, 1).await;
                api.send(call()).await
            },
            async {
                api.until_runs(&label, 1).await;
                api.send_to(&other, call()).await
            }
        );
        let first = first.unwrap();
        assert_eq!((first.status, first.run()), (500, 1), "{route}: {first:?}");
        let mut twins = [here.unwrap(), there.unwrap()];
        twins.sort_by_key(Reply::replayed);
        let [ran, replayed] = twins;
        assert_eq!(
            (ran.status, ran.replayed(), ran.run()),
            (201, false, 2),
            "{route}: {ran:?}"
        );
        assert_eq!(
            (replayed.status, replayed.replayed(), replayed.run()),
            (201, true, 2),
            "{route}: {replayed:?}"
        );
        assert_eq!(api.seen.runs(&label), 2, "{route}");
        assert_eq!(api.db.effects(effect, &label).await, 1, "{route}");
    }
}

/// A key reused for another request is a 422, on the same route and on another: the handler does
/// not run and nothing is replayed.
async fn a_key_reused_for_another_request_is_422<B: Backend>() {
    let api = Api::<B>::start(Setup::default()).await;
    let first = api
        .send(Call::new(
            "/payments",
            "k-reused",
            json!({ "label": "reused-a" }),
        ))
        .await
        .unwrap();
    assert_eq!(first.status, 201);
    for (route, label) in [("/payments", "reused-b"), ("/emails", "reused-a")] {
        let reply = api
            .send(Call::new(route, "k-reused", json!({ "label": label })))
            .await
            .unwrap();
        assert_eq!(reply.status, 422, "{route}: {reply:?}");
        assert_eq!(reply.code(), "idempotency_key_reused");
        assert_eq!(
            reply.headers[header::CONTENT_TYPE],
            "application/problem+json"
        );
    }
    assert_eq!(api.db.effects("payments", "reused-a").await, 1);
    assert_eq!(api.db.effects("payments", "reused-b").await, 0);
    assert_eq!(api.db.effects("emails", "reused-a").await, 0);
    assert_eq!(api.seen.runs("reused-b"), 0);
}

/// Two clients that happen to send the same key make two effects, and each one's retry gets its
/// own response, never the other's.
async fn two_clients_with_one_key_get_two_effects<B: Backend>() {
    let api = Api::<B>::start(Setup::default()).await;
    for (route, effect) in ROUTES {
        let label = format!("shared-{effect}");
        let order = json!({ "label": label });
        let key = format!("k-shared-{effect}");
        let mut runs = Vec::new();
        for client in ["client-a", "client-b"] {
            let reply = api
                .send(Call::new(route, &key, order.clone()).client(Some(client)))
                .await
                .unwrap();
            assert_eq!(reply.status, 201, "{route} {client}");
            assert!(
                !reply.replayed(),
                "{route} {client}: no cross-client replay"
            );
            runs.push(reply.run());
        }
        assert_eq!(runs, [1, 2], "{route}");
        for (client, run) in [("client-a", 1), ("client-b", 2)] {
            let retry = api
                .send(Call::new(route, &key, order.clone()).client(Some(client)))
                .await
                .unwrap();
            assert!(retry.replayed(), "{route} {client}");
            assert_eq!(retry.run(), run, "{route} {client}: its own response");
        }
        assert_eq!(api.db.effects(effect, &label).await, 2, "{route}");
    }
}

/// Requests without a usable key, or without a client, are 400 problems; a quoted key is the same
/// key as the bare one.
async fn requests_without_a_usable_key_are_400<B: Backend>() {
    let api = Api::<B>::start(Setup::default()).await;
    let order = || json!({ "label": "bad-key" });
    let long = "k".repeat(256);
    let cases = [
        (
            Call::new("/payments", "", order()).keys(&[]),
            "idempotency_key_missing",
        ),
        (
            Call::new("/payments", &long, order()),
            "idempotency_key_invalid",
        ),
        (
            Call::new("/payments", "two words", order()),
            "idempotency_key_invalid",
        ),
        (
            Call::new("/payments", "", order()).keys(&[b"a", b"b"]),
            "idempotency_key_invalid",
        ),
        (
            Call::new("/payments", "\"unclosed", order()),
            "idempotency_key_invalid",
        ),
        // Two keys, as a proxy that merges repeated headers would send them.
        (
            Call::new("/payments", "a,b", order()),
            "idempotency_key_invalid",
        ),
        (
            Call::new("/emails", "k-anonymous", order()).client(None),
            "idempotency_scope_missing",
        ),
    ];
    for (call, code) in cases {
        let reply = api.send(call).await.unwrap();
        assert_eq!(reply.status, 400, "{code}: {reply:?}");
        assert_eq!(reply.code(), code);
        assert_eq!(
            reply.headers[header::CONTENT_TYPE],
            "application/problem+json"
        );
    }
    assert_eq!(api.db.effects("payments", "bad-key").await, 0);
    assert_eq!(api.seen.runs("bad-key"), 0);

    let bare = api
        .send(Call::new(
            "/payments",
            "k-quoted",
            json!({ "label": "quoted" }),
        ))
        .await
        .unwrap();
    let quoted = api
        .send(Call::new(
            "/payments",
            "\"k-quoted\"",
            json!({ "label": "quoted" }),
        ))
        .await
        .unwrap();
    assert_eq!((bare.status, quoted.status), (201, 201));
    assert!(quoted.replayed());
    assert_eq!(api.db.effects("payments", "quoted").await, 1);
    // In quotes, a comma is part of the key.
    let comma = api
        .send(Call::new(
            "/payments",
            "\"k,comma\"",
            json!({ "label": "comma" }),
        ))
        .await
        .unwrap();
    assert_eq!(comma.status, 201, "{comma:?}");
}

/// A 5xx is not stored, so the retry runs again (on `/payments` the failed run's effect rolled
/// back with it); a 4xx is stored and replayed, with the headers that matter and not the others.
async fn server_errors_run_again_and_client_errors_are_replayed<B: Backend>() {
    let api = Api::<B>::start(Setup::default()).await;
    for (route, effect) in ROUTES {
        let label = format!("fails-once-{effect}");
        let order = json!({ "label": label, "fail_first": true });
        let first = api
            .send(Call::new(route, &label, order.clone()))
            .await
            .unwrap();
        assert_eq!(first.status, 500, "{route}");
        assert_eq!(api.db.effects(effect, &label).await, 0, "{route}");
        // At once: nothing in flight, nothing stored.
        let retry = api
            .send(Call::new(route, &label, order.clone()))
            .await
            .unwrap();
        assert_eq!(
            (retry.status, retry.replayed(), retry.run()),
            (201, false, 2),
            "{route}"
        );
        assert_eq!(api.db.effects(effect, &label).await, 1, "{route}");

        let label = format!("invalid-{effect}");
        let order = json!({ "label": label, "status": 400 });
        let first = api
            .send(Call::new(route, &label, order.clone()))
            .await
            .unwrap();
        let retry = api
            .send(Call::new(route, &label, order.clone()))
            .await
            .unwrap();
        assert_eq!((first.status, first.replayed()), (400, false), "{route}");
        assert_eq!((retry.status, retry.replayed()), (400, true), "{route}");
        assert_eq!(retry.body, first.body, "{route}");
        assert_eq!(
            retry.headers[header::LOCATION],
            format!("/payments/{label}")
        );
        assert_eq!(retry.headers[header::CONTENT_TYPE], "application/json");
        assert!(first.headers.contains_key(header::SET_COOKIE));
        assert!(!retry.headers.contains_key(header::SET_COOKIE), "{route}");
        assert_eq!(api.seen.runs(&label), 1, "{route}");
    }
    // `/payments` wrote its effect before answering 400, and the 400 was stored: it committed.
    assert_eq!(api.db.effects("payments", "invalid-payments").await, 1);
}

/// A response body longer than the layer stores, whole or streamed, reaches the client in full;
/// its replay has the status and headers, no body, and says so. A streamed body within the limit
/// is stored whole.
async fn long_and_streamed_responses_are_passed_on_and_replayed_without_their_body<B: Backend>() {
    let setup = Setup {
        max_stored_body: 1024,
        ..Setup::default()
    };
    let api = Api::<B>::start(setup).await;
    for (route, effect) in ROUTES {
        for (label, order, length) in [
            ("long", json!({ "label": "long", "pad": 4000 }), None),
            (
                "streamed",
                json!({ "label": "streamed", "chunks": 8 }),
                Some(4096),
            ),
        ] {
            let key = format!("k-{label}-{effect}");
            let call = || Call::new(route, &key, order.clone());
            let first = api.send(call()).await.unwrap();
            assert_eq!(first.status, 201, "{route} {label}");
            assert!(
                first.body.len() > 1024,
                "{route} {label}: the client gets it all"
            );
            if let Some(length) = length {
                assert_eq!(first.body.len(), length);
            }
            let replay = api.send(call()).await.unwrap();
            assert_eq!(
                (replay.status, replay.replayed()),
                (201, true),
                "{route} {label}"
            );
            assert_eq!(replay.headers["idempotent-body-omitted"], "true");
            assert!(replay.body.is_empty(), "{route} {label}");
            assert_eq!(
                replay.headers[header::LOCATION],
                format!("/payments/{label}")
            );
            assert_eq!(api.db.effects(effect, label).await, 1, "{route} {label}");
        }
        let order = json!({ "label": "short-stream", "chunks": 1 });
        let key = format!("k-short-stream-{effect}");
        let first = api
            .send(Call::new(route, &key, order.clone()))
            .await
            .unwrap();
        let replay = api.send(Call::new(route, &key, order)).await.unwrap();
        assert!(replay.replayed(), "{route}");
        assert!(!replay.headers.contains_key("idempotent-body-omitted"));
        assert_eq!(replay.body, first.body, "{route}");
        assert_eq!(replay.body.len(), 512);
        api.seen.runs.lock().unwrap().clear();
    }
}

/// Stored responses expire through the inbox's purge (24 hours): after it, the key runs again.
async fn stored_responses_expire_through_the_purge<B: Backend>() {
    let api = Api::<B>::start(Setup::default()).await;
    let call = || Call::new("/payments", "k-expires", json!({ "label": "expires" }));
    assert_eq!(api.send(call()).await.unwrap().status, 201);
    assert!(api.send(call()).await.unwrap().replayed());
    assert_eq!(api.db.purge().await, 0, "kept for 24 hours");
    api.db
        .backdate_http(Duration::from_secs(25 * 60 * 60))
        .await;
    assert_eq!(api.db.purge().await, 1);
    let again = api.send(call()).await.unwrap();
    assert_eq!(
        (again.status, again.replayed(), again.run()),
        (201, false, 2)
    );
    assert_eq!(api.db.effects("payments", "expires").await, 2);
}

/// A server killed while a transactional request's handler runs (its effect written, not yet
/// committed): the transaction rolls back with the killed server's connections, and the retry on
/// a new server runs the handler once. One effect.
async fn a_killed_server_leaves_a_transactional_key_free<B: Backend>() {
    let mut api = Api::<B>::start(Setup::default()).await;
    let order = json!({ "label": "killed", "hang_first": true });
    let call = || Call::new("/payments", "k-killed", order.clone());
    api.until_hanging(call()).await;
    api.kill_and_restart();
    let retry = api.settle(call, Duration::from_secs(5)).await;
    assert_eq!(
        (retry.status, retry.replayed(), retry.run()),
        (201, false, 2),
        "{retry:?}"
    );
    assert_eq!(api.db.effects("payments", "killed").await, 1);
    let again = api.send(call()).await.unwrap();
    assert_eq!((again.replayed(), again.run()), (true, 2));
}

/// A server killed while a leased request's handler runs: the key stays pending (409, with the
/// rest of the lease) until the lease runs out; then the retry on a new server runs the handler
/// once. One effect.
async fn a_killed_server_leaves_a_leased_key_pending_until_its_lease_runs_out<B: Backend>() {
    let lease = Duration::from_secs(2);
    let mut api = Api::<B>::start(Setup {
        lease,
        ..Setup::default()
    })
    .await;
    let order = json!({ "label": "killed", "hang_first": true });
    let call = || Call::new("/emails", "k-killed", order.clone());
    api.until_hanging(call()).await;
    let killed_at = Instant::now();
    api.kill_and_restart();
    let pending = api.send(call()).await.unwrap();
    assert_eq!(pending.status, 409, "{pending:?}");
    assert!(matches!(pending.retry_after(), Some(1..=2)), "{pending:?}");
    let retry = api.settle(call, Duration::from_secs(10)).await;
    assert_eq!(
        (retry.status, retry.replayed(), retry.run()),
        (201, false, 2),
        "{retry:?}"
    );
    assert!(killed_at.elapsed() >= lease - Duration::from_millis(300));
    assert_eq!(api.db.effects("emails", "killed").await, 1);
    let again = api.send(call()).await.unwrap();
    assert_eq!((again.replayed(), again.run()), (true, 2));
}

/// A leased request in flight on another instance (its own layer, so only the database knows):
/// the twin is refused at once, on every backend (the pending call is committed on its own).
async fn a_leased_twin_on_another_instance_gets_409_at_once<B: Backend>() {
    let api = Api::<B>::start(Setup::default()).await;
    let other = api.another_instance();
    let order = json!({ "label": "twin", "sleep_ms": 1000 });
    let call = || Call::new("/emails", "k-twin", order.clone());
    let (first, twin) = tokio::join!(api.send(call()), async {
        api.until_runs("twin", 1).await;
        api.send_to(&other, call()).await
    });
    let (first, twin) = (first.unwrap(), twin.unwrap());
    assert_eq!((first.status, first.replayed()), (201, false));
    assert_eq!(twin.status, 409, "{twin:?}");
    assert!(
        twin.finished < first.finished,
        "the twin waited: {:?}",
        twin.elapsed
    );
    let replay = api.send_to(&other, call()).await.unwrap();
    assert!(replay.replayed());
    assert_eq!(api.db.effects("emails", "twin").await, 1);
}

/// One client sends one key to a transactional route (`/payments`) and to a leased route
/// (`/emails`) that share the layers' consumer: one handler runs, whichever came first, on one
/// instance or two, one after the other or at the very same moment; the other request is refused
/// (409), or, if it reached the key only once the other's answer was stored (on SQLite, where a
/// leased twin on another instance waits for the transactional request's write lock), gets what
/// its retry gets: 422, its key now belongs to another request.
/// Each client's retry then gets a consistent answer: the replay for the one that ran, 422 for
/// the other, which never ran.
async fn a_key_sent_to_a_transactional_and_a_leased_route_runs_one_handler<B: Backend>() {
    let api = Api::<B>::start(Setup::default()).await;
    let other = api.another_instance();
    let orders = [("/payments", "/emails"), ("/emails", "/payments")];
    for (first, second) in orders {
        for (instances, twin_server) in [("one", &api.server), ("two", &other)] {
            // One after the other, then at the very same moment, three times.
            for (round, at_once) in [(0, false), (1, true), (2, true), (3, true)] {
                let label = format!("mixed{first}{second}-{instances}-{round}").replace('/', "-");
                let order = json!({ "label": label, "sleep_ms": 800 });
                let key = format!("k-{label}");
                let (a, b) = tokio::join!(api.send(Call::new(first, &key, order.clone())), async {
                    if !at_once {
                        api.until_runs(&label, 1).await;
                    }
                    api.send_to(twin_server, Call::new(second, &key, order.clone()))
                        .await
                });
                let replies = [(first, a.unwrap()), (second, b.unwrap())];
                let case = format!("{label}: {replies:?}");
                let ran: Vec<_> = replies.iter().filter(|(_, r)| r.status == 201).collect();
                assert_eq!(ran.len(), 1, "exactly one success: {case}");
                assert_eq!(api.seen.runs(&label), 1, "one handler run: {case}");
                let effects = api.db.effects("payments", &label).await
                    + api.db.effects("emails", &label).await;
                assert_eq!(effects, 1, "one effect: {case}");
                let (winner, won) = ran[0];
                let (loser, refused) = replies.iter().find(|(_, r)| r.status != 201).unwrap();
                // A twin that reached the key only after the winner's answer was stored (on
                // SQLite across instances it waits for the write lock; elsewhere a machine slow
                // enough) is a later request, for which the key is taken: 422.
                let came_after = refused.finished > won.finished
                    || (B::ONE_WRITER && instances == "two" && *loser == "/emails");
                match refused.status {
                    409 => assert_eq!(refused.code(), "idempotency_key_in_use", "{case}"),
                    422 if came_after => {
                        assert_eq!(refused.code(), "idempotency_key_reused", "{case}")
                    }
                    _ => panic!("the twin must be refused: {case}"),
                }
                let winner_retry = api
                    .settle(
                        || Call::new(winner, &key, order.clone()),
                        Duration::from_secs(10),
                    )
                    .await;
                assert_eq!(
                    (
                        winner_retry.status,
                        winner_retry.replayed(),
                        winner_retry.run()
                    ),
                    (201, true, 1),
                    "{case}: {winner_retry:?}"
                );
                let loser_retry = api
                    .settle(
                        || Call::new(loser, &key, order.clone()),
                        Duration::from_secs(10),
                    )
                    .await;
                assert_eq!(loser_retry.status, 422, "{case}: {loser_retry:?}");
                assert_eq!(api.seen.runs(&label), 1, "{case}");
            }
        }
    }
}

/// A leased request whose response cannot be stored for a while (another session holds the
/// write lock on SQLite, or locks the inbox's tables on PostgreSQL): the client never gets a
/// success for an outcome that is not stored. After the layer's patience it gets 503 with
/// Retry-After; meanwhile and after, its retries (on this instance and on another) get 409, never
/// a second run; once the lock is gone, the layer stores the response and the retry gets its
/// replay. One effect.
async fn a_leased_response_that_cannot_be_stored_is_never_a_success<B: Backend>() {
    let api = Api::<B>::start(Setup {
        store_patience: Some(Duration::from_secs(1)),
        ..Setup::default()
    })
    .await;
    let other = api.another_instance();
    let order = json!({ "label": "unstored", "wait_after_effect": true });
    let call = || Call::new("/emails", "k-unstored", order.clone());
    let (first, blocked) = tokio::join!(api.send(call()), async {
        // The handler's effect is written: lock the layer out, then let the handler answer.
        api.seen.effect_written.notified().await;
        let blocked = api.db.block_writes().await;
        api.seen.go.notify_one();
        blocked
    });
    let first = first.unwrap();
    assert_eq!(first.status, 503, "not a success while unstored: {first:?}");
    assert!(first.retry_after().is_some(), "{first:?}");
    assert_eq!(first.code(), "idempotency_store_pending");
    for server in [&api.server, &other] {
        let retry = api.send_to(server, call()).await.unwrap();
        assert_eq!(retry.status, 409, "still being stored: {retry:?}");
    }
    blocked.release().await;
    let retry = api.settle(call, Duration::from_secs(30)).await;
    assert_eq!(
        (retry.status, retry.replayed(), retry.run()),
        (201, true, 1),
        "{retry:?}"
    );
    assert_eq!(api.seen.runs("unstored"), 1);
    assert_eq!(api.db.effects("emails", "unstored").await, 1);
}

/// A transactional handler that ends the claimed transaction itself (a raw `ROLLBACK` or
/// `COMMIT`, then its effect, which commits on its own): the request gets a 500 problem of its
/// own (`transaction_ended`), which is stored for the key, so that its retries get the same
/// answer, replayed, and never run the handler again. One effect. (PostgreSQL: SQLite refuses
/// the writes a handler makes after it ended the inbox's transaction, so nothing of it commits.)
async fn a_handler_that_ends_its_transaction_gets_one_stored_answer<B: Backend>() {
    let api = Api::<B>::start(Setup::default()).await;
    for statement in ["ROLLBACK", "COMMIT"] {
        let label = format!("ends-{statement}");
        let order = json!({ "label": label, "end_transaction": statement });
        let call = || Call::new("/payments", &label, order.clone());
        let replies = [
            api.send(call()).await.unwrap(),
            api.send(call()).await.unwrap(),
            api.send(call()).await.unwrap(),
        ];
        for (n, reply) in replies.iter().enumerate() {
            assert_eq!(reply.status, 500, "{statement} {n}: {reply:?}");
            assert_eq!(reply.code(), "transaction_ended", "{statement} {n}");
            assert_eq!(reply.replayed(), n > 0, "{statement} {n}: {reply:?}");
            assert_eq!(reply.body, replies[0].body, "{statement} {n}");
        }
        assert_eq!(api.seen.runs(&label), 1, "{statement}");
        assert_eq!(api.db.effects("payments", &label).await, 1, "{statement}");
    }
    // The same when the handler answers a 5xx, which is otherwise not stored: after its own
    // `ROLLBACK` its effect committed anyway.
    let order = json!({ "label": "ends-then-fails", "end_transaction": "ROLLBACK", "status": 503 });
    let call = || Call::new("/payments", "ends-then-fails", order.clone());
    for n in 0..3 {
        let reply = api.send(call()).await.unwrap();
        assert_eq!(
            (reply.status, reply.code().as_str(), reply.replayed()),
            (500, "transaction_ended", n > 0),
            "{n}: {reply:?}"
        );
    }
    assert_eq!(api.seen.runs("ends-then-fails"), 1);
    assert_eq!(api.db.effects("payments", "ends-then-fails").await, 1);
}

/// The query string's empty pairs do not make another request (`?a=1&` is `?a=1`); another
/// value, or the pairs in another order, does (422).
async fn query_strings_are_compared_without_empty_pairs<B: Backend>() {
    let api = Api::<B>::start(Setup::default()).await;
    let order = json!({ "label": "query" });
    let first = api
        .send(Call::new("/payments?a=1&b=2&", "k-query", order.clone()))
        .await
        .unwrap();
    assert_eq!(first.status, 201);
    for same in ["/payments?a=1&b=2", "/payments?&a=1&&b=2"] {
        let reply = api
            .send(Call::new(same, "k-query", order.clone()))
            .await
            .unwrap();
        assert_eq!(
            (reply.status, reply.replayed()),
            (201, true),
            "{same}: {reply:?}"
        );
    }
    for different in ["/payments?a=1&b=3", "/payments?b=2&a=1", "/payments"] {
        let reply = api
            .send(Call::new(different, "k-query", order.clone()))
            .await
            .unwrap();
        assert_eq!(reply.status, 422, "{different}: {reply:?}");
    }
    assert_eq!(api.seen.runs("query"), 1);
}

/// With a documentation URI configured, the 400 for a missing key and the 422 for a reused key
/// name it, as the problem's `type` and in a `Link: <…>; rel="describedby"` header. Every keyed
/// answer (the first and its replays, on both kinds of route) says until when the key is kept,
/// in `Idempotency-Key-Expires`: the retention (24 hours) after the first request, the same date
/// in every replay.
async fn keyed_answers_link_their_documentation_and_say_when_the_key_expires<B: Backend>() {
    const DOCS: &str = "https://example.com/docs/idempotency";
    let api = Api::<B>::start(Setup {
        documentation: Some(DOCS),
        ..Setup::default()
    })
    .await;
    let order = json!({ "label": "documented" });
    let missing = api
        .send(Call::new("/payments", "", order.clone()).keys(&[]))
        .await
        .unwrap();
    for (route, key) in [
        ("/payments", "k-documented"),
        ("/emails", "k-documented-email"),
    ] {
        let sent = std::time::SystemTime::now();
        let first = api
            .send(Call::new(route, key, order.clone()))
            .await
            .unwrap();
        let replay = api
            .send(Call::new(route, key, order.clone()))
            .await
            .unwrap();
        assert!(replay.replayed());
        let expires = first.headers["idempotency-key-expires"].to_str().unwrap();
        assert_eq!(
            replay.headers["idempotency-key-expires"], expires,
            "{route}"
        );
        let expires = httpdate::parse_http_date(expires).unwrap();
        let day = Duration::from_secs(24 * 60 * 60);
        assert!(
            expires + Duration::from_secs(2) >= sent + day
                && expires <= std::time::SystemTime::now() + day + Duration::from_secs(1),
            "{route}: {expires:?}"
        );
    }
    let reused = api
        .send(Call::new(
            "/payments",
            "k-documented",
            json!({ "label": "other" }),
        ))
        .await
        .unwrap();
    for (reply, status) in [(missing, 400), (reused, 422)] {
        assert_eq!(reply.status, status, "{reply:?}");
        assert_eq!(reply.json()["type"], DOCS, "{reply:?}");
        assert_eq!(
            reply.headers[header::LINK],
            format!("<{DOCS}>; rel=\"describedby\""),
            "{reply:?}"
        );
    }
}

macro_rules! http_tests {
    ($backend:ty: $($name:ident),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            super::$name::<$backend>().await
        }
    )*};
}

macro_rules! all_http_tests {
    ($backend:ty) => {
        http_tests!($backend:
            a_retry_after_the_client_gave_up_gets_one_effect,
            fifty_concurrent_requests_with_one_key_have_one_effect,
            fifty_twins_that_wait_get_one_run_and_forty_nine_replays,
            a_twin_that_waited_its_patience_gets_409,
            twins_of_a_failed_first_request_run_it_again,
            a_key_reused_for_another_request_is_422,
            two_clients_with_one_key_get_two_effects,
            requests_without_a_usable_key_are_400,
            server_errors_run_again_and_client_errors_are_replayed,
            long_and_streamed_responses_are_passed_on_and_replayed_without_their_body,
            stored_responses_expire_through_the_purge,
            a_killed_server_leaves_a_transactional_key_free,
            a_killed_server_leaves_a_leased_key_pending_until_its_lease_runs_out,
            a_leased_twin_on_another_instance_gets_409_at_once,
            a_key_sent_to_a_transactional_and_a_leased_route_runs_one_handler,
            a_leased_response_that_cannot_be_stored_is_never_a_success,
            query_strings_are_compared_without_empty_pairs,
            keyed_answers_link_their_documentation_and_say_when_the_key_expires,
        );
    };
}

mod postgres {
    use super::*;

    all_http_tests!(super::Pg);
    http_tests!(super::Pg: a_handler_that_ends_its_transaction_gets_one_stored_answer);

    /// A transactional request in flight on another instance: the twin's claim does not get the
    /// key's advisory lock, and it is refused at once, instead of waiting on the first request's
    /// uncommitted row as a message consumer's claim would. Then it gets the replay.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_transactional_twin_on_another_instance_gets_409_at_once() {
        let api = Api::<Pg>::start(Setup::default()).await;
        let other = api.another_instance();
        let order = json!({ "label": "twin", "sleep_ms": 1000 });
        let call = || Call::new("/payments", "k-twin", order.clone());
        let (first, twin) = tokio::join!(api.send(call()), async {
            api.until_runs("twin", 1).await;
            api.send_to(&other, call()).await
        });
        let (first, twin) = (first.unwrap(), twin.unwrap());
        assert_eq!((first.status, first.replayed()), (201, false));
        assert_eq!(twin.status, 409, "{twin:?}");
        assert_eq!(twin.code(), "idempotency_key_in_use");
        assert!(
            twin.finished < first.finished,
            "the twin waited: {:?}",
            twin.elapsed
        );
        let replay = api.send_to(&other, call()).await.unwrap();
        assert!(replay.replayed());
        assert_eq!(api.db.effects("payments", "twin").await, 1);
    }

    /// A leased response whose store is blocked for two leases (another session locks the inbox
    /// table; the calls table stays writable): the layer keeps the call's lease alive while it
    /// tries, so a retry on another instance gets 409 all along, never a second run; once the
    /// lock is gone the response is stored and replayed. One run, one effect.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_leased_response_being_stored_keeps_its_lease_alive() {
        let lease = Duration::from_secs(2);
        let api = Api::<Pg>::start(Setup {
            lease,
            store_patience: Some(Duration::from_millis(500)),
            ..Setup::default()
        })
        .await;
        let other = api.another_instance();
        let order = json!({ "label": "kept", "wait_after_effect": true });
        let call = || Call::new("/emails", "k-kept", order.clone());
        let (first, blocked) = tokio::join!(api.send(call()), async {
            api.seen.effect_written.notified().await;
            let blocked = http_app::WritesBlocked::take(
                &api.db.0.pool,
                &["BEGIN", "LOCK TABLE idempotent_inbox IN EXCLUSIVE MODE"],
            )
            .await;
            api.seen.go.notify_one();
            blocked
        });
        let first = first.unwrap();
        assert_eq!(first.status, 503, "{first:?}");
        // Two leases' worth of retries on another instance while the store is blocked.
        let blocked_until = Instant::now() + 2 * lease;
        while Instant::now() < blocked_until {
            let retry = api.send_to(&other, call()).await.unwrap();
            assert_eq!(retry.status, 409, "the lease must stay alive: {retry:?}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        blocked.release().await;
        let retry = api.settle(call, Duration::from_secs(30)).await;
        assert_eq!(
            (retry.status, retry.replayed(), retry.run()),
            (201, true, 1),
            "{retry:?}"
        );
        assert_eq!(api.seen.runs("kept"), 1);
        assert_eq!(api.db.effects("emails", "kept").await, 1);
    }

    /// A handler that runs `DEALLOCATE ALL` leaves its connection's prepared statements gone
    /// (and the driver's cache of them stale). Its own request fails as retryable (the response
    /// cannot be stored: 503, nothing committed); the next claim on the connection forgets the
    /// driver's statements and claims again, so the connection goes on serving. A pool of one
    /// connection, so every request uses it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_handler_that_deallocates_prepared_statements_does_not_break_its_connection() {
        let api = Api::<Pg>::start(Setup {
            connections: 1,
            ..Setup::default()
        })
        .await;
        let warm = api
            .send(Call::new("/payments", "k-warm", json!({ "label": "warm" })))
            .await
            .unwrap();
        assert_eq!(
            warm.status, 201,
            "every statement is prepared on the connection now"
        );
        let order = json!({ "label": "deallocating", "deallocate_first": true });
        let call = || Call::new("/payments", "k-deallocating", order.clone());
        let first = api.send(call()).await.unwrap();
        assert_eq!(first.status, 503, "{first:?}");
        assert_eq!(first.code(), "idempotency_store_failed");
        assert_eq!(api.db.effects("payments", "deallocating").await, 0);
        let retry = api.send(call()).await.unwrap();
        assert_eq!(
            (retry.status, retry.replayed(), retry.run()),
            (201, false, 2),
            "{retry:?}"
        );
        for n in 0..3 {
            let label = format!("after-{n}");
            let reply = api
                .send(Call::new("/payments", &label, json!({ "label": label })))
                .await
                .unwrap();
            assert_eq!(reply.status, 201, "{reply:?}");
        }
        assert_eq!(api.db.effects("payments", "deallocating").await, 1);
    }
}

mod sqlite {
    use super::*;

    all_http_tests!(super::Lite);

    /// SQLite has one writer at a time: a transactional twin on another instance (another pool,
    /// as another process would have) waits for the first request's write lock like any writer,
    /// then finds its stored response and replays it. (Twins on the same instance get 409 at once:
    /// see `fifty_concurrent_requests_with_one_key_have_one_effect`.)
    /// SQLite refuses every commit but the inbox's own while its transaction is open: a handler
    /// that sends its own `ROLLBACK` or `COMMIT` cannot commit anything after it (its write fails,
    /// and the test's handler answers 500), so nothing is stored and a retry runs again, with
    /// nothing committed either time.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_handler_that_ends_its_transaction_commits_nothing() {
        let api = Api::<Lite>::start(Setup::default()).await;
        for statement in ["ROLLBACK", "COMMIT"] {
            let label = format!("ends-{statement}");
            let order = json!({ "label": label, "end_transaction": statement });
            for run in 1..=2 {
                let reply = api
                    .send(Call::new("/payments", &label, order.clone()))
                    .await
                    .unwrap();
                assert_eq!(reply.status, 500, "{statement}: {reply:?}");
                assert!(!reply.replayed(), "{statement}: {reply:?}");
                assert_eq!(api.seen.runs(&label), run, "{statement}: {reply:?}");
            }
            assert_eq!(api.db.effects("payments", &label).await, 0, "{statement}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_transactional_twin_on_another_instance_waits_for_the_write_lock_then_replays() {
        let api = Api::<Lite>::start(Setup::default()).await;
        let other = api.another_instance();
        let order = json!({ "label": "twin", "sleep_ms": 1000 });
        let call = || Call::new("/payments", "k-twin", order.clone());
        let (first, twin) = tokio::join!(api.send(call()), async {
            api.until_runs("twin", 1).await;
            api.send_to(&other, call()).await
        });
        let (first, twin) = (first.unwrap(), twin.unwrap());
        assert_eq!((first.status, first.replayed()), (201, false));
        assert_eq!(
            (twin.status, twin.replayed(), twin.run()),
            (201, true, 1),
            "{twin:?}"
        );
        assert!(
            twin.elapsed > Duration::from_millis(500),
            "it did not wait for the write lock: {:?}",
            twin.elapsed
        );
        assert_eq!(api.db.effects("payments", "twin").await, 1);
    }
}
