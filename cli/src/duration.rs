//! Durations on the command line: a whole number and a unit, `500ms`, `90s`, `15m`,
//! `24h`, `7d`.

use std::time::Duration;

/// Parses `text` as a duration; the error says what is wrong in one line.
pub fn parse(text: &str) -> Result<Duration, String> {
    let digits = text.bytes().take_while(u8::is_ascii_digit).count();
    let (number, unit) = text.split_at(digits);
    if number.is_empty() {
        return Err(format!(
            "`{text}` is not a duration: use a whole number and a unit, like 90s, 15m, 24h or 7d"
        ));
    }
    let value: u64 = number
        .parse()
        .map_err(|_| format!("`{text}` is too large"))?;
    let unit_ms: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        "" => return Err(format!("`{text}` has no unit: add ms, s, m, h or d")),
        other => {
            return Err(format!(
                "`{other}` in `{text}` is not a unit: use ms, s, m, h or d"
            ));
        }
    };
    let ms = value
        .checked_mul(unit_ms)
        .ok_or_else(|| format!("`{text}` is too large"))?;
    if ms == 0 {
        return Err(format!("`{text}` is zero"));
    }
    Ok(Duration::from_millis(ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_and_errors() {
        assert_eq!(parse("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse("15m"), Ok(Duration::from_secs(900)));
        assert_eq!(parse("24h"), Ok(Duration::from_secs(86_400)));
        assert_eq!(parse("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert_eq!(parse("250ms"), Ok(Duration::from_millis(250)));
        for bad in [
            "",
            "h",
            "10",
            "10x",
            "1.5h",
            "-3s",
            "0s",
            "99999999999999999999d",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
