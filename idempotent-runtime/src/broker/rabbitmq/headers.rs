//! The headers the RabbitMQ runner writes on retries and dead letters.

/// The header that carries a retried delivery's attempt number, for people to read (the runner
/// counts attempts from RabbitMQ's own `x-death` entries; see the [module docs](super)).
pub const ATTEMPT_HEADER: &str = "x-idempotent-attempt";
/// The header that carries a dead letter's reason.
pub const REASON_HEADER: &str = "x-idempotent-reason";
/// The header that carries the number of attempts a dead letter had.
pub const ATTEMPTS_HEADER: &str = "x-idempotent-attempts";
/// The header that names the queue a dead letter came from.
pub const QUEUE_HEADER: &str = "x-idempotent-queue";
/// The header that says when a message was dead-lettered, in milliseconds since the Unix epoch.
pub const DEAD_LETTERED_AT_HEADER: &str = "x-idempotent-dead-lettered-at";
