//! The schedules a broker makes, run against a user's handler, each on a fresh database, each
//! compared with one clean delivery.

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::pin;
use std::task::Poll;
use std::time::Duration;

use super::divergence::{
    CLEAN_FAILED, Divergence, ERROR_PATH_EFFECT, LOST_CONNECTION_IGNORED,
    LOST_CONNECTION_NOT_RETRYABLE, OUTSIDE_THE_TRANSACTION, Schedule, UNSTABLE_KEY,
};
use crate::error::Error;
use crate::inbox::{Handled, Inbox, Injected};
use crate::store::Backend;

/// How many times a delivery whose error is retryable is delivered again, as a broker would.
const RETRIES: usize = 20;
/// The await points a sweep of drops covers at most: a handler with more is stopped there.
const MOST_AWAIT_POINTS: usize = 10_000;

/// Runs a `#[idempotent]` handler the way production will: its message delivered twice, several
/// copies at once, crashed between its body and its commit, its database connection lost during
/// the body (PostgreSQL, MySQL), and dropped at each of its await points, each time delivered
/// again, each schedule on a fresh database. After each, it compares a state you read with the state after
/// one clean delivery, and reports the first schedule whose state differs.
///
/// It is given three async closures:
/// - `fresh`: a new, empty inbox with the handler's tables (and your fakes of outside services
///   reset), for each schedule: [`Inbox::in_memory`] and your `CREATE TABLE`s, or a fresh
///   database of your PostgreSQL or MySQL;
/// - `deliver`: one delivery of the message, as the broker hands it over: build the message
///   inside (deserialize it, fill what your consumer fills on receipt), then call the handler;
/// - `state`: what the delivery must have done, read from the inbox's pool and your fakes:
///   rows, counts, sums, calls made — not times or generated ids, which differ between runs.
///
/// A delivery whose error is retryable ([`Error::is_retryable`]) is delivered again, as a broker
/// would; any other error is reported.
///
/// ```
/// # use idempotent_runtime as idempotent;
/// # use idempotent::{Handled, Inbox, Error};
/// # struct Payment { message_id: String, order: i64 }
/// # async fn on_payment(inbox: &Inbox<sqlx::Sqlite>, msg: &Payment) -> Result<Handled<()>, Error<sqlx::Error>> {
/// #     let Some(mut claimed) = inbox.claim("orders", &msg.message_id).await? else {
/// #         let key = idempotent::key::message_key(&msg.message_id[..]).unwrap();
/// #         return Ok(Handled::Duplicate { consumer: "orders".into(), key, response: None });
/// #     };
/// #     sqlx::query("UPDATE orders SET paid = paid + 1 WHERE id = $1").bind(msg.order)
/// #         .execute(claimed.connection()).await.map_err(Error::Handler)?;
/// #     claimed.commit().await?;
/// #     Ok(Handled::Processed(()))
/// # }
/// use idempotent::testing::Check;
/// use sqlx::Sqlite;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let checked = Check::new(
///     async || {
///         let inbox = Inbox::<Sqlite>::in_memory().await?;
///         sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY, paid INTEGER NOT NULL)")
///             .execute(inbox.pool()).await?;
///         sqlx::query("INSERT INTO orders VALUES (7, 0)").execute(inbox.pool()).await?;
///         Ok::<_, Box<dyn std::error::Error>>(inbox)
///     },
///     async |inbox: &Inbox<Sqlite>| {
///         let payment = Payment { message_id: "p-1".into(), order: 7 };
///         on_payment(inbox, &payment).await
///     },
///     async |inbox: &Inbox<Sqlite>| {
///         sqlx::query_scalar::<_, i64>("SELECT paid FROM orders WHERE id = 7")
///             .fetch_one(inbox.pool()).await.unwrap()
///     },
/// )
/// .run()
/// .await
/// .unwrap_or_else(|divergence| panic!("{divergence}"));
/// println!("dropped at {} await points", checked.await_points);
/// # }
/// ```
pub struct Check<DB, Fresh, Deliver, State> {
    fresh: Fresh,
    deliver: Deliver,
    state: State,
    copies: usize,
    db: PhantomData<fn() -> DB>,
}

/// What a [`Check`] ran, when every schedule matched one clean delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Checked {
    /// The copies delivered at once.
    pub copies: usize,
    /// The await points at which a delivery was dropped, each in a schedule of its own.
    pub await_points: usize,
    /// Whether the connection was lost during the body ([`Schedule::ConnectionLost`]): on
    /// PostgreSQL and MySQL, not on SQLite.
    pub connection_lost: bool,
}

impl<DB, Fresh, Deliver, State> Check<DB, Fresh, Deliver, State>
where
    DB: Backend,
{
    /// Creates a check of the handler that `deliver` calls; see the [type's docs](Check).
    pub fn new<T, E, S, FE>(fresh: Fresh, deliver: Deliver, state: State) -> Self
    where
        Fresh: AsyncFn() -> Result<Inbox<DB>, FE>,
        FE: fmt::Display,
        Deliver: AsyncFn(&Inbox<DB>) -> Result<Handled<T>, Error<E>>,
        E: std::error::Error + 'static,
        State: AsyncFn(&Inbox<DB>) -> S,
        S: PartialEq + fmt::Debug,
    {
        Self {
            fresh,
            deliver,
            state,
            copies: 4,
            db: PhantomData,
        }
    }

    /// Delivers `copies` copies at once in the concurrent schedule (default 4).
    pub fn copies(mut self, copies: usize) -> Self {
        self.copies = copies.max(2);
        self
    }

    /// Runs every schedule; the first that differs from one clean delivery is the error.
    pub async fn run<T, E, S, FE>(self) -> Result<Checked, Divergence>
    where
        Fresh: AsyncFn() -> Result<Inbox<DB>, FE>,
        FE: fmt::Display,
        Deliver: AsyncFn(&Inbox<DB>) -> Result<Handled<T>, Error<E>>,
        E: std::error::Error + 'static,
        State: AsyncFn(&Inbox<DB>) -> S,
        S: PartialEq + fmt::Debug,
    {
        // One clean delivery: the state every schedule must end in.
        let inbox = self.fresh(Schedule::Clean).await?;
        let clean = self.to_the_end(&inbox, Schedule::Clean).await?;
        if !clean.is_processed() {
            return Err(divergence(
                Schedule::Clean,
                "a delivery on a fresh database was a duplicate",
                "`fresh` must give a new, empty inbox each time: one of its own database",
            ));
        }
        let expected = (self.state)(&inbox).await;
        drop(inbox);

        // Twice in a row: the second is a duplicate, and changes nothing.
        let inbox = self.fresh(Schedule::Twice).await?;
        let _first = self.to_the_end(&inbox, Schedule::Twice).await?;
        let second = self.to_the_end(&inbox, Schedule::Twice).await?;
        let found = (self.state)(&inbox).await;
        if second.is_processed() {
            return Err(compared(
                Schedule::Twice,
                "the second delivery ran the body again",
                &expected,
                &found,
                UNSTABLE_KEY,
            ));
        }
        self.same(Schedule::Twice, &expected, found, UNSTABLE_KEY)?;
        drop(inbox);

        // Copies at once: one runs the body, the others are duplicates.
        let schedule = Schedule::AtOnce(self.copies);
        let inbox = self.fresh(schedule.clone()).await?;
        let copies = (0..self.copies).map(|_| self.to_the_end(&inbox, schedule.clone()));
        let mut processed = 0;
        for outcome in futures_util::future::join_all(copies).await {
            processed += usize::from(outcome?.is_processed());
        }
        let found = (self.state)(&inbox).await;
        if processed != 1 {
            return Err(compared(
                schedule,
                &format!("{processed} of the copies ran the body"),
                &expected,
                &found,
                UNSTABLE_KEY,
            ));
        }
        self.same(schedule, &expected, found, OUTSIDE_THE_TRANSACTION)?;
        drop(inbox);

        // A crash between the body and the commit: the body ran, nothing of its transaction
        // committed; the redelivery runs it again, and only its transaction's effects are undone.
        let schedule = Schedule::CrashedBeforeCommit;
        let inbox = self.fresh(schedule.clone()).await?;
        let crashing = inbox.clone().injecting(Injected::CrashBeforeCommit);
        if let Ok(handled) = (self.deliver)(&crashing).await {
            let what = if handled.is_processed() {
                "the delivery was processed without the inbox's commit"
            } else {
                "a delivery on a fresh database was a duplicate"
            };
            return Err(divergence(
                schedule,
                what,
                "`deliver` must call the `#[idempotent]` handler with the inbox it is given",
            ));
        }
        let _again = self.to_the_end(&inbox, schedule.clone()).await?;
        let found = (self.state)(&inbox).await;
        self.same(schedule, &expected, found, OUTSIDE_THE_TRANSACTION)?;
        drop((crashing, inbox));

        // The connection lost during the body: its statements fail, nothing commits, and the
        // error must leave the message to be delivered again.
        let connection_lost = DB::DIALECT.end_own_connection.is_some();
        if connection_lost {
            let schedule = Schedule::ConnectionLost;
            let inbox = self.fresh(schedule.clone()).await?;
            let losing = inbox.clone().injecting(Injected::ConnectionLostAfterClaim);
            match (self.deliver)(&losing).await {
                Ok(handled) if handled.is_processed() => {
                    let found = (self.state)(&inbox).await;
                    return Err(compared(
                        schedule,
                        "the delivery succeeded though its connection was lost",
                        &expected,
                        &found,
                        LOST_CONNECTION_IGNORED,
                    ));
                }
                Ok(_) => {
                    return Err(divergence(
                        schedule,
                        "a delivery on a fresh database was a duplicate",
                        "`fresh` must give a new, empty inbox each time: one of its own database",
                    ));
                }
                Err(error) if !error.is_retryable() => {
                    let said = failed(schedule.clone(), &error).what;
                    return Err(divergence(
                        schedule,
                        &format!("{said}, which is not retryable"),
                        LOST_CONNECTION_NOT_RETRYABLE,
                    ));
                }
                Err(_) => {}
            }
            let _again = self.to_the_end(&inbox, schedule.clone()).await?;
            let found = (self.state)(&inbox).await;
            self.same(schedule, &expected, found, ERROR_PATH_EFFECT)?;
            drop((losing, inbox));
        }

        // Dropped at each await point in turn, then delivered again. How many await points a
        // delivery shows depends on the machine (a poll runs past every answer that has arrived),
        // so this covers what the schedule above cannot: a drop inside the claim or the body.
        for point in 1..=MOST_AWAIT_POINTS {
            let schedule = Schedule::DroppedAt(point);
            let inbox = self.fresh(schedule.clone()).await?;
            let finished = until_pending((self.deliver)(&inbox), point).await;
            if let Some(outcome) = finished {
                // It ran to its end before its `point`th wait: every await point is covered.
                let _clean = outcome.map_err(|error| failed(schedule, &error))?;
                return Ok(Checked {
                    copies: self.copies,
                    await_points: point - 1,
                    connection_lost,
                });
            }
            let _again = self.to_the_end(&inbox, schedule.clone()).await?;
            let found = (self.state)(&inbox).await;
            self.same(schedule, &expected, found, OUTSIDE_THE_TRANSACTION)?;
        }
        Ok(Checked {
            copies: self.copies,
            await_points: MOST_AWAIT_POINTS,
            connection_lost,
        })
    }

    async fn fresh<FE>(&self, schedule: Schedule) -> Result<Inbox<DB>, Divergence>
    where
        Fresh: AsyncFn() -> Result<Inbox<DB>, FE>,
        FE: fmt::Display,
    {
        (self.fresh)().await.map_err(|error| Divergence {
            schedule,
            what: format!("`fresh` failed: {error}"),
            expected: None,
            found: None,
            hint: "`fresh` must give a new, empty inbox with the handler's tables",
        })
    }

    /// Delivers the message until an outcome that is not a retryable error.
    async fn to_the_end<T, E>(
        &self,
        inbox: &Inbox<DB>,
        schedule: Schedule,
    ) -> Result<Handled<T>, Divergence>
    where
        Deliver: AsyncFn(&Inbox<DB>) -> Result<Handled<T>, Error<E>>,
        E: std::error::Error + 'static,
    {
        let mut tries = 0;
        loop {
            match (self.deliver)(inbox).await {
                Ok(handled) => return Ok(handled),
                Err(error) if error.is_retryable() && tries < RETRIES => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(error) => return Err(failed(schedule, &error)),
            }
        }
    }

    fn same<S: PartialEq + fmt::Debug>(
        &self,
        schedule: Schedule,
        expected: &S,
        found: S,
        hint: &'static str,
    ) -> Result<(), Divergence> {
        if *expected == found {
            return Ok(());
        }
        Err(compared(
            schedule,
            "the state differs from one clean delivery's",
            expected,
            &found,
            hint,
        ))
    }
}

fn divergence(schedule: Schedule, what: &str, hint: &'static str) -> Divergence {
    Divergence {
        schedule,
        what: what.to_owned(),
        expected: None,
        found: None,
        hint,
    }
}

fn compared<S: fmt::Debug>(
    schedule: Schedule,
    what: &str,
    expected: &S,
    found: &S,
    hint: &'static str,
) -> Divergence {
    Divergence {
        schedule,
        what: what.to_owned(),
        expected: Some(format!("{expected:?}")),
        found: Some(format!("{found:?}")),
        hint,
    }
}

fn failed<E: std::error::Error + 'static>(schedule: Schedule, error: &Error<E>) -> Divergence {
    let hint = if schedule == Schedule::Clean {
        CLEAN_FAILED
    } else {
        "the same delivery succeeded on a fresh database; under this schedule it failed"
    };
    // The error and each of its causes: what failed is usually a cause, not the error itself.
    let mut said = format!("a delivery failed: {error}");
    let mut cause = std::error::Error::source(error);
    while let Some(error) = cause {
        said.push_str(&format!(": {error}"));
        cause = error.source();
    }
    divergence(schedule, &said, hint)
}

/// Polls `future` to its end, or drops it at its `n`th poll that returns `Pending`: its output, or
/// `None` when it was dropped. Between polls it yields, without sleeping: a sleep would let several
/// of the database's answers arrive, and the next poll run past several await points at once.
async fn until_pending<F: Future>(future: F, n: usize) -> Option<F::Output> {
    let mut future = pin!(future);
    let mut pending = 0;
    loop {
        let polled = std::future::poll_fn(|cx| Poll::Ready(future.as_mut().poll(cx))).await;
        match polled {
            Poll::Ready(output) => return Some(output),
            Poll::Pending => {
                pending += 1;
                if pending == n {
                    return None;
                }
                tokio::task::yield_now().await;
            }
        }
    }
}
