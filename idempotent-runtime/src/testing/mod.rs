//! A kit for testing your own handlers the way production will run them (feature `testing`).
//!
//! - [`Check`] delivers a `#[idempotent]` handler's message under the schedules a broker makes:
//!   twice in a row, several copies at once, crashed between its body and its commit, its
//!   database connection lost during the body (PostgreSQL, MySQL), and dropped at each of its
//!   await points, each time delivered again. After each it compares a state you read (your
//!   tables, your fakes of outside services) with the state after one clean delivery, and reports
//!   the first schedule whose state differs as a [`Divergence`], in words.
//! - [`RecordingPublisher`] is a [`Publisher`](crate::outbox::Publisher) that keeps what it is
//!   given and fails on demand, to run a relay in a unit test without a broker.
//!
//! The guide, with runnable examples, is *Testing your handlers* in the `idempotent-inbox` crate's
//! documentation (`idempotent::guide::testing_handlers`).

mod check;
mod divergence;
mod publisher;

pub use check::{Check, Checked};
pub use divergence::{Divergence, Schedule};
pub use publisher::RecordingPublisher;
