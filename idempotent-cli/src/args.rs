//! What the command line's values mean: keys, times, durations.

use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idempotent::{KeyBuilder, MessageKey};

/// One component of a message key, as typed: `TEXT`, `str:TEXT`, `uuid:UUID`, `int:N`,
/// `bytes:HEX`, or the whole stored key `stored:HEX`.
#[derive(Debug, Clone)]
pub(crate) enum KeyPart {
    Str(String),
    Uuid(uuid::Uuid),
    Int(i128),
    Bytes(Vec<u8>),
    Stored(Vec<u8>),
}

impl FromStr for KeyPart {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let Some((kind, value)) = text.split_once(':') else {
            return Ok(KeyPart::Str(text.to_owned()));
        };
        match kind {
            "str" => Ok(KeyPart::Str(value.to_owned())),
            "uuid" => uuid::Uuid::parse_str(value)
                .map(KeyPart::Uuid)
                .map_err(|e| format!("{value:?} is not a UUID: {e}")),
            "int" => value
                .parse()
                .map(KeyPart::Int)
                .map_err(|e| format!("{value:?} is not an integer: {e}")),
            "bytes" => hex(value).map(KeyPart::Bytes),
            "stored" => hex(value).map(KeyPart::Stored),
            // A string key that holds a colon.
            _ => Ok(KeyPart::Str(text.to_owned())),
        }
    }
}

fn hex(text: &str) -> Result<Vec<u8>, String> {
    let bad = || format!("{text:?} is not hex digits");
    if !text.len().is_multiple_of(2) {
        return Err(bad());
    }
    (0..text.len())
        .step_by(2)
        .map(|i| {
            text.get(i..i + 2)
                .and_then(|pair| u8::from_str_radix(pair, 16).ok())
                .ok_or_else(bad)
        })
        .collect()
}

/// The key of `parts`, or `None` without any.
pub(crate) fn message_key(parts: &[KeyPart]) -> Result<Option<MessageKey>, String> {
    if let [KeyPart::Stored(bytes)] = parts {
        return MessageKey::from_stored(bytes.clone())
            .map(Some)
            .map_err(|e| e.to_string());
    }
    if parts.is_empty() {
        return Ok(None);
    }
    let mut key = KeyBuilder::new();
    for part in parts {
        match part {
            KeyPart::Str(text) => key.str(text),
            KeyPart::Uuid(uuid) => key.uuid(uuid),
            KeyPart::Int(n) => key.int(*n),
            KeyPart::Bytes(bytes) => key.bytes(bytes),
            KeyPart::Stored(_) => {
                return Err("a stored:HEX key stands alone: it is the whole key".to_owned());
            }
        }
    }
    key.finish().map(Some).map_err(|e| e.to_string())
}

/// A duration: a number and a unit, `ms`, `s`, `m`, `h` or `d` (`14d`, `36h`, `90m`).
pub(crate) fn duration(text: &str) -> Result<Duration, String> {
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("{text:?} has no unit: write 14d, 36h, 90m, 30s or 500ms"))?;
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} does not start with a number"))?;
    let seconds = match unit {
        "ms" => return Ok(Duration::from_millis(number)),
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(format!("unknown unit {unit:?}: use ms, s, m, h or d")),
    };
    Ok(Duration::from_secs(number.saturating_mul(seconds)))
}

/// The shortest retention `purge` accepts without `--yes-delete-recent`: shorter ones delete the
/// record of messages whose redeliveries may still come, which would then run again.
pub(crate) const MIN_RETENTION: Duration = Duration::from_secs(60);

/// A number of rows to print: at least 1.
pub(crate) fn limit(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("0 rows: a limit is at least 1".to_owned()),
        Ok(limit) => Ok(limit),
        Err(_) => Err(format!("{text:?} is not a number of rows")),
    }
}

/// `NAME=DURATION`: a consumer's own retention.
#[derive(Debug, Clone)]
pub(crate) struct ConsumerRetention(pub(crate) String, pub(crate) Duration);

impl FromStr for ConsumerRetention {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let (name, retention) = text
            .split_once('=')
            .ok_or_else(|| format!("{text:?}: write CONSUMER=DURATION, such as billing=30d"))?;
        if name.trim().is_empty() {
            return Err(format!(
                "{text:?} names no consumer: write CONSUMER=DURATION, such as billing=30d"
            ));
        }
        Ok(Self(name.to_owned(), duration(retention)?))
    }
}

/// A point in time: RFC 3339 in UTC (`2026-05-01T12:00:00Z`), or a duration ago (`2d`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Time(pub(crate) SystemTime);

impl FromStr for Time {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        if let Ok(ago) = duration(text) {
            // Nothing in the inbox is older than 1970, and the clock cannot count much further.
            return SystemTime::now()
                .checked_sub(ago)
                .filter(|time| *time >= UNIX_EPOCH)
                .map(Time)
                .ok_or_else(|| {
                    format!(
                        "{text} ago is before 1970-01-01, where the inbox's times begin: write \
                         a shorter duration, or leave the option out"
                    )
                });
        }
        parse_rfc3339(text).map(Time).ok_or_else(|| {
            format!(
                "{text:?} is not a time: write 2026-05-01T12:00:00Z, or a duration ago such as 2d"
            )
        })
    }
}

/// `YYYY-MM-DDTHH:MM:SS[.fff]Z` (UTC only).
fn parse_rfc3339(text: &str) -> Option<SystemTime> {
    let text = text
        .strip_suffix('Z')
        .or_else(|| text.strip_suffix("+00:00"))?;
    let (date, time) = text.split_once(['T', ' '])?;
    let mut date = date.split('-');
    let (y, m, d): (i64, u32, u32) = (
        date.next()?.parse().ok()?,
        date.next()?.parse().ok()?,
        date.next()?.parse().ok()?,
    );
    let (time, fraction) = time.split_once('.').unwrap_or((time, "0"));
    let mut time = time.split(':');
    let (hh, mm, ss): (u64, u64, u64) = (
        time.next()?.parse().ok()?,
        time.next()?.parse().ok()?,
        time.next()?.parse().ok()?,
    );
    if !(0..=9999).contains(&y)
        || !(1..=12).contains(&m)
        || !(1..=31).contains(&d)
        || hh > 23
        || mm > 59
        || ss > 60
    {
        return None;
    }
    let millis: u64 = format!("{fraction:0<3}").get(..3)?.parse().ok()?;
    let days = u64::try_from(days_from_civil(y, m, d)).ok()?;
    let seconds = days * 86_400 + hh * 3600 + mm * 60 + ss;
    Some(UNIX_EPOCH + Duration::from_secs(seconds) + Duration::from_millis(millis))
}

/// Days since 1970-01-01 of a date in the proleptic Gregorian calendar (Howard Hinnant's).
pub(crate) fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date of a day since 1970-01-01.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// `time` in RFC 3339, UTC, to the millisecond.
pub(crate) fn rfc3339(time: SystemTime) -> String {
    let (since, sign) = match time.duration_since(UNIX_EPOCH) {
        Ok(since) => (since, 1),
        Err(before) => (before.duration(), -1),
    };
    let ms = sign * i64::try_from(since.as_millis()).unwrap_or(i64::MAX);
    let (days, in_day) = (ms.div_euclid(86_400_000), ms.rem_euclid(86_400_000));
    let (y, m, d) = civil_from_days(days);
    let (h, min, s, milli) = (
        in_day / 3_600_000,
        in_day / 60_000 % 60,
        in_day / 1000 % 60,
        in_day % 1000,
    );
    format!("{y:04}-{m:02}-{d:02}T{h:02}:{min:02}:{s:02}.{milli:03}Z")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_round_trip_through_rfc3339() {
        let text = "2026-05-01T12:34:56.789Z";
        let time = parse_rfc3339(text).unwrap();
        assert_eq!(rfc3339(time), text);
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            rfc3339(parse_rfc3339("2000-02-29T00:00:00Z").unwrap()),
            "2000-02-29T00:00:00.000Z"
        );
    }

    #[test]
    fn durations_keys_and_retentions_parse() {
        assert_eq!(duration("14d").unwrap(), Duration::from_secs(14 * 86_400));
        assert_eq!(duration("500ms").unwrap(), Duration::from_millis(500));
        assert!(duration("14").is_err() && duration("d").is_err() && duration("3w").is_err());
        let key = message_key(&["order-7".parse().unwrap(), "int:5".parse().unwrap()])
            .unwrap()
            .unwrap();
        assert_eq!(key, idempotent::message_key(&("order-7", 5u8)).unwrap());
        let stored = format!("stored:{key}");
        assert_eq!(message_key(&[stored.parse().unwrap()]).unwrap(), Some(key));
        assert!(matches!("a:b".parse::<KeyPart>().unwrap(), KeyPart::Str(s) if s == "a:b"));
        let ConsumerRetention(name, retention) = "billing=30d".parse().unwrap();
        assert_eq!(
            (name.as_str(), retention),
            ("billing", Duration::from_secs(30 * 86_400))
        );
        assert!("=1d".parse::<ConsumerRetention>().is_err());
        assert_eq!(limit("1"), Ok(1));
        assert!(limit("0").is_err() && limit("-1").is_err());
        assert!("999999999999d".parse::<Time>().is_err());
        assert!(parse_rfc3339("99999999999999-01-01T00:00:00Z").is_none());
    }
}
