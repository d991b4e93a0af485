//! Text-format column values (as pgoutput and the simple query protocol send them) turned into
//! bytes and numbers. Each function says what it accepts; the caller names the column on error.

/// Decodes `bytea` in the `hex` output format (`\x0a1b…`), the server default since 9.0.
pub fn bytea(text: &[u8]) -> Result<Vec<u8>, &'static str> {
    let hex = text.strip_prefix(b"\\x").ok_or("bytea is not in hex format (set bytea_output = 'hex')")?;
    if hex.len() % 2 != 0 {
        return Err("bytea hex has an odd number of digits");
    }
    hex.chunks_exact(2).map(|pair| Ok(nibble(pair[0])? << 4 | nibble(pair[1])?)).collect()
}

fn nibble(c: u8) -> Result<u8, &'static str> {
    match c {
        b'0'..=b'9' => Ok(c - b'0'),
        b'a'..=b'f' => Ok(c - b'a' + 10),
        b'A'..=b'F' => Ok(c - b'A' + 10),
        _ => Err("bytea hex has a non-hex digit"),
    }
}

/// Parses a text integer.
pub fn int(text: &[u8]) -> Result<i64, &'static str> {
    std::str::from_utf8(text).ok().and_then(|s| s.parse().ok()).ok_or("not an integer")
}

/// Parses `timestamptz` text in the ISO DateStyle (`2026-12-02 16:48:00.123456+00`, the
/// offset with optional minutes and seconds) into microseconds since the Unix epoch.
pub fn timestamptz_micros(text: &[u8]) -> Result<i64, &'static str> {
    const BAD: &str = "timestamptz is not in ISO format (set DateStyle = 'ISO')";
    let s = std::str::from_utf8(text).map_err(|_| BAD)?;
    let (date, rest) = s.split_once(' ').ok_or(BAD)?;
    let mut d = date.splitn(3, '-');
    let year: i64 = d.next().and_then(|v| v.parse().ok()).ok_or(BAD)?;
    let month: i64 = d.next().and_then(|v| v.parse().ok()).ok_or(BAD)?;
    let day: i64 = d.next().and_then(|v| v.parse().ok()).ok_or(BAD)?;
    let offset_at = rest.rfind(['+', '-']).ok_or(BAD)?;
    let (time, offset) = rest.split_at(offset_at);
    let mut t = time.splitn(3, ':');
    let hour: i64 = t.next().and_then(|v| v.parse().ok()).ok_or(BAD)?;
    let minute: i64 = t.next().and_then(|v| v.parse().ok()).ok_or(BAD)?;
    let seconds = t.next().ok_or(BAD)?;
    let (whole, fraction) = seconds.split_once('.').unwrap_or((seconds, ""));
    let second: i64 = whole.parse().map_err(|_| BAD)?;
    let micros: i64 = if fraction.is_empty() {
        0
    } else {
        let digits: String = fraction.chars().chain(std::iter::repeat('0')).take(6).collect();
        digits.parse().map_err(|_| BAD)?
    };
    let sign = if offset.starts_with('-') { -1 } else { 1 };
    let mut o = offset[1..].splitn(3, ':');
    let off_h: i64 = o.next().and_then(|v| v.parse().ok()).ok_or(BAD)?;
    let off_m: i64 = o.next().map(|v| v.parse().map_err(|_| BAD)).transpose()?.unwrap_or(0);
    let off_s: i64 = o.next().map(|v| v.parse().map_err(|_| BAD)).transpose()?.unwrap_or(0);
    let offset_s = sign * (off_h * 3600 + off_m * 60 + off_s);
    let days = days_from_civil(year, month, day);
    let secs = days * 86_400 + hour * 3600 + minute * 60 + second - offset_s;
    Ok(secs * 1_000_000 + micros)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytea_hex() {
        assert_eq!(bytea(b"\\x00ff10Ab").unwrap(), vec![0, 255, 16, 171]);
        assert_eq!(bytea(b"\\x").unwrap(), Vec::<u8>::new());
        assert!(bytea(b"abc").is_err());
        assert!(bytea(b"\\x0").is_err());
        assert!(bytea(b"\\xzz").is_err());
    }

    #[test]
    fn timestamptz() {
        assert_eq!(timestamptz_micros(b"1970-01-01 00:00:00+00").unwrap(), 0);
        assert_eq!(timestamptz_micros(b"1970-01-01 01:00:00.5+01").unwrap(), 500_000);
        assert_eq!(timestamptz_micros(b"2000-01-01 00:00:00-05:30").unwrap(), 946_704_600_000_000);
        assert_eq!(timestamptz_micros(b"2026-12-02 16:48:00.123456+00").unwrap(), 1_796_230_080_123_456);
        assert!(timestamptz_micros(b"Wed Dec 02 16:48:00 2026 UTC").is_err());
    }
}
