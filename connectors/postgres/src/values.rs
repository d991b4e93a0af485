//! Column values as pgoutput sends them — text format, or binary (each type's `send` format)
//! when the stream asks for `binary` — turned into bytes and numbers. Each function says what
//! it accepts; the caller names the column on error.

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

/// A big-endian binary integer of 2, 4 or 8 bytes (`int2send`, `int4send`, `int8send`).
pub fn binary_int(bytes: &[u8]) -> Result<i64, &'static str> {
    match bytes.len() {
        2 => Ok(i16::from_be_bytes([bytes[0], bytes[1]]).into()),
        4 => Ok(i32::from_be_bytes(bytes.try_into().map_err(|_| "not an integer")?).into()),
        8 => Ok(i64::from_be_bytes(bytes.try_into().map_err(|_| "not an integer")?)),
        _ => Err("a binary integer is not 2, 4 or 8 bytes long"),
    }
}

/// Microseconds from the Unix epoch to PostgreSQL's (2000-01-01 00:00:00 UTC).
const PG_EPOCH_UNIX_MICROS: i64 = 946_684_800_000_000;

/// Binary `timestamptz` (`timestamptz_send`: microseconds since 2000-01-01 UTC) in
/// microseconds since the Unix epoch.
pub fn binary_timestamptz_micros(bytes: &[u8]) -> Result<i64, &'static str> {
    let micros = i64::from_be_bytes(bytes.try_into().map_err(|_| "a binary timestamptz is not 8 bytes long")?);
    micros.checked_add(PG_EPOCH_UNIX_MICROS).ok_or("timestamptz out of range")
}

/// The JSON text of a binary `jsonb` value (`jsonb_send`: a version byte, 1, then the text).
pub fn binary_jsonb(bytes: &[u8]) -> Result<&[u8], &'static str> {
    match bytes.split_first() {
        Some((1, text)) => Ok(text),
        Some(_) => Err("unknown binary jsonb version"),
        None => Err("empty binary jsonb"),
    }
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
    fn binary_values() {
        assert_eq!(binary_int(&7i16.to_be_bytes()).unwrap(), 7);
        assert_eq!(binary_int(&(-3i32).to_be_bytes()).unwrap(), -3);
        assert_eq!(binary_int(&(1i64 << 40).to_be_bytes()).unwrap(), 1 << 40);
        assert!(binary_int(&[1, 2, 3]).is_err());
        assert_eq!(binary_timestamptz_micros(&0i64.to_be_bytes()).unwrap(), 946_684_800_000_000);
        assert_eq!(binary_timestamptz_micros(&(-946_684_800_000_000i64).to_be_bytes()).unwrap(), 0);
        assert!(binary_timestamptz_micros(&[0; 4]).is_err());
        assert_eq!(binary_jsonb(b"\x01{\"a\": 1}").unwrap(), b"{\"a\": 1}");
        assert!(binary_jsonb(b"\x02{}").is_err());
        assert!(binary_jsonb(b"").is_err());
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
