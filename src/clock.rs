//! Wall-clock time as the wires want it: milliseconds since the epoch (session headers)
//! and calendar fields in UTC (HTTP `Date`, ACP `updatedAt`). No time zones, no parsing.

use std::time::{SystemTime, UNIX_EPOCH};

pub fn now_ms() -> u64 {
    millis_since_epoch(SystemTime::now())
}

/// Times before 1970 count as 0; absurdly far futures saturate.
pub fn millis_since_epoch(time: SystemTime) -> u64 {
    let since = time.duration_since(UNIX_EPOCH).unwrap_or_default();
    u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
}

/// A UTC calendar time, to the second.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Utc {
    pub year: u64,
    /// 1–12.
    pub month: u64,
    /// 1–31.
    pub day: u64,
    pub hour: u64,
    pub minute: u64,
    pub second: u64,
    /// 0 = Thursday (1970-01-01 was one), as days since the epoch modulo 7.
    pub weekday_from_thursday: u64,
}

impl Utc {
    pub fn from_unix_secs(secs: u64) -> Utc {
        let days = secs / 86_400;
        let of_day = secs % 86_400;
        // Howard Hinnant's civil_from_days, on unsigned values since we start at 1970.
        let z = days + 719_468;
        let era = z / 146_097;
        let doe = z % 146_097;
        let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = doy - (153 * mp + 2) / 5 + 1;
        let month = if mp < 10 { mp + 3 } else { mp - 9 };
        Utc {
            year: yoe + era * 400 + u64::from(month <= 2),
            month,
            day,
            hour: of_day / 3_600,
            minute: of_day % 3_600 / 60,
            second: of_day % 60,
            weekday_from_thursday: days % 7,
        }
    }

    /// ISO 8601 / RFC 3339 in UTC: `2026-08-01T12:00:00Z`.
    pub fn iso8601(&self) -> String {
        format!(
            "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
            self.year, self.month, self.day, self.hour, self.minute, self.second
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calendar_fields() {
        assert_eq!(Utc::from_unix_secs(0).iso8601(), "1970-01-01T00:00:00Z");
        assert_eq!(
            Utc::from_unix_secs(951_782_400).iso8601(),
            "2000-02-29T00:00:00Z"
        );
        assert_eq!(
            Utc::from_unix_secs(1_785_585_600).iso8601(),
            "2026-08-01T12:00:00Z"
        );
        // 1994-11-06 was a Sunday: three days after a Thursday.
        assert_eq!(Utc::from_unix_secs(784_111_777).weekday_from_thursday, 3);
    }
}
