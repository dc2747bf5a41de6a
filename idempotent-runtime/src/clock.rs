//! Times: a message's send time, and the database's milliseconds since the Unix epoch.
//!
//! The inbox compares a message's send time (the producer's clock) with its consumer's purge
//! horizon (the database's clock); see [`Retention::skew_margin`](crate::Retention::skew_margin)
//! for the margin between the two.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A value that says when a message was sent: the type of the field named in
/// `#[idempotent(sent_at = "...")]`.
///
/// Implemented for [`SystemTime`], for [`uuid::Uuid`] (a version 7 UUID carries the time it was
/// made in milliseconds; other versions carry no time), for `Option`s of these (`None`: this
/// message carries no send time) and for references. A type of your own (a `chrono` or `time`
/// timestamp in a newtype) implements it by converting to a `SystemTime`.
#[diagnostic::on_unimplemented(
    message = "`{Self}` does not say when the message was sent",
    label = "not a send time",
    note = "`sent_at` names a field of type `std::time::SystemTime`, `uuid::Uuid` (version 7), an `Option` of these, or a type of your own that implements `idempotent::SentAt`"
)]
pub trait SentAt {
    /// When the message was sent, if it says.
    fn sent_at(&self) -> Option<SystemTime>;
}

impl SentAt for SystemTime {
    fn sent_at(&self) -> Option<SystemTime> {
        Some(*self)
    }
}

impl SentAt for uuid::Uuid {
    fn sent_at(&self) -> Option<SystemTime> {
        uuid_v7_time(self)
    }
}

impl<T: SentAt> SentAt for Option<T> {
    fn sent_at(&self) -> Option<SystemTime> {
        self.as_ref().and_then(SentAt::sent_at)
    }
}

impl<T: SentAt + ?Sized> SentAt for &T {
    fn sent_at(&self) -> Option<SystemTime> {
        (**self).sent_at()
    }
}

/// The time in a version 7 UUID (of RFC 9562's variant): its first 48 bits, milliseconds since
/// the Unix epoch. Random bytes made into a `Uuid` without setting its version (`from_u128` of a
/// random number) look like one now and then: make random UUIDs with `Uuid::new_v4`.
pub(crate) fn uuid_v7_time(uuid: &uuid::Uuid) -> Option<SystemTime> {
    if uuid.get_version_num() != 7 || uuid.get_variant() != uuid::Variant::RFC4122 {
        return None;
    }
    let bytes = uuid.as_bytes();
    let mut ms = [0u8; 8];
    ms[2..].copy_from_slice(&bytes[..6]);
    Some(UNIX_EPOCH + Duration::from_millis(u64::from_be_bytes(ms)))
}

/// The last millisecond every database's time type holds (9999-12-31 23:59:59.999 UTC; MySQL's
/// `DATETIME` ends there): times handed to a statement are kept between the epoch and this.
pub(crate) const LAST_MS: i64 = 253_402_300_799_999;

/// `time` in milliseconds since the epoch, kept between the epoch and [`LAST_MS`].
pub(crate) fn to_db_ms(time: SystemTime) -> i64 {
    to_ms(time).clamp(0, LAST_MS)
}

/// `time` in milliseconds since the Unix epoch (negative before it), saturated.
pub(crate) fn to_ms(time: SystemTime) -> i64 {
    match time.duration_since(UNIX_EPOCH) {
        Ok(after) => i64::try_from(after.as_millis()).unwrap_or(i64::MAX),
        Err(before) => i64::try_from(before.duration().as_millis()).map_or(i64::MIN, |ms| -ms),
    }
}

/// The time `ms` milliseconds after the Unix epoch.
pub(crate) fn from_ms(ms: i64) -> SystemTime {
    if ms >= 0 {
        UNIX_EPOCH + Duration::from_millis(ms as u64)
    } else {
        UNIX_EPOCH - Duration::from_millis(ms.unsigned_abs())
    }
}

/// `duration` in whole milliseconds, saturated at `i64::MAX`.
pub(crate) fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_uuid_v7_carries_its_time_and_others_none() {
        let at = UNIX_EPOCH + Duration::from_millis(1_700_000_000_123);
        let ts = uuid::Timestamp::from_unix(uuid::NoContext, 1_700_000_000, 123_000_000);
        let v7 = uuid::Uuid::new_v7(ts);
        assert_eq!(v7.sent_at(), Some(at));
        assert_eq!(uuid::Uuid::new_v4().sent_at(), None);
        // Version 7's nibble, but not RFC 9562's variant: random bytes, no time.
        let bytes = *v7.as_bytes();
        let mut other_variant = bytes;
        other_variant[8] &= 0x3F;
        assert_eq!(uuid::Uuid::from_bytes(other_variant).sent_at(), None);
        assert_eq!(Some(v7).sent_at(), Some(at));
        assert_eq!(None::<SystemTime>.sent_at(), None);
    }

    #[test]
    fn milliseconds_round_trip() {
        for ms in [0, 1, 1_700_000_000_123, -5] {
            assert_eq!(to_ms(from_ms(ms)), ms);
        }
    }
}
