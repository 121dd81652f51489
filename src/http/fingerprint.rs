//! The default request fingerprint: method, path and query, and a canonical body.

use axum::http::header::CONTENT_TYPE;
use axum::http::request::Parts;

/// `METHOD path?query`, a newline, and the body: for a JSON content type whose body
/// parses, its canonical form (below), so `{"b":1, "a":2}` and `{"a":2,"b":1}` are one
/// request; for anything else, the raw bytes. The store hashes the result (XXH3-128).
///
/// The canonical form is written here, independent of any JSON library's features:
/// object members sorted by their (unescaped) names, recursively; strings re-escaped
/// minimally (`"\u0061"` and `"a"` are one string); numbers kept as their source text, so
/// no two numbers that differ in any digit can match (`1e400`, `12345678901234567890.5`
/// stay distinct; `1` and `1.0` are two requests); no insignificant whitespace. A body
/// that is not one JSON value, or nests deeper than 128 levels, is compared by its bytes.
pub fn canonical_request(parts: &Parts, body: &[u8]) -> Vec<u8> {
    let target = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path(), |pq| pq.as_str());
    let mut out = format!("{} {target}\n", parts.method).into_bytes();
    let json = parts
        .headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| {
            let essence = ct.split(';').next().unwrap_or("").trim();
            essence.eq_ignore_ascii_case("application/json") || essence.ends_with("+json")
        });
    match json.then(|| canonical_json(body)).flatten() {
        Some(canonical) => out.extend_from_slice(&canonical),
        None => out.extend_from_slice(body),
    }
    out
}

/// Deepest nesting the canonical form follows.
const MAX_DEPTH: usize = 128;

/// The canonical form of the JSON value `text` (see [`canonical_request`]), or `None` if
/// it is not exactly one JSON value.
fn canonical_json(text: &[u8]) -> Option<Vec<u8>> {
    let mut reader = Reader { text, at: 0 };
    let mut out = Vec::with_capacity(text.len());
    reader.value(&mut out, 0)?;
    reader.space();
    (reader.at == text.len()).then_some(out)
}

struct Reader<'a> {
    text: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn peek(&self) -> Option<u8> {
        self.text.get(self.at).copied()
    }

    fn space(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    fn eat(&mut self, byte: u8) -> Option<()> {
        self.space();
        (self.peek() == Some(byte)).then(|| self.at += 1)
    }

    fn literal(&mut self, word: &[u8], out: &mut Vec<u8>) -> Option<()> {
        let end = self.at.checked_add(word.len())?;
        (self.text.get(self.at..end) == Some(word)).then(|| {
            self.at = end;
            out.extend_from_slice(word);
        })
    }

    fn value(&mut self, out: &mut Vec<u8>, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.space();
        match self.peek()? {
            b'{' => self.object(out, depth),
            b'[' => self.array(out, depth),
            b'"' => {
                let text = self.string()?;
                write_string(&text, out);
                Some(())
            }
            b't' => self.literal(b"true", out),
            b'f' => self.literal(b"false", out),
            b'n' => self.literal(b"null", out),
            _ => self.number(out),
        }
    }

    fn object(&mut self, out: &mut Vec<u8>, depth: usize) -> Option<()> {
        self.at += 1;
        let mut members: Vec<(String, Vec<u8>)> = Vec::new();
        if self.eat(b'}').is_none() {
            loop {
                self.space();
                let name = self.string()?;
                self.eat(b':')?;
                let mut value = Vec::new();
                self.value(&mut value, depth + 1)?;
                members.push((name, value));
                if self.eat(b',').is_none() {
                    self.eat(b'}')?;
                    break;
                }
            }
        }
        // A name given twice keeps its last value, as most JSON readers do.
        members.sort_by(|a, b| a.0.cmp(&b.0));
        members.dedup_by(|later, earlier| {
            let same = later.0 == earlier.0;
            if same {
                std::mem::swap(later, earlier);
            }
            same
        });
        out.push(b'{');
        for (index, (name, value)) in members.iter().enumerate() {
            if index > 0 {
                out.push(b',');
            }
            write_string(name, out);
            out.push(b':');
            out.extend_from_slice(value);
        }
        out.push(b'}');
        Some(())
    }

    fn array(&mut self, out: &mut Vec<u8>, depth: usize) -> Option<()> {
        self.at += 1;
        out.push(b'[');
        if self.eat(b']').is_none() {
            loop {
                self.value(out, depth + 1)?;
                if self.eat(b',').is_none() {
                    self.eat(b']')?;
                    break;
                }
                out.push(b',');
            }
        }
        out.push(b']');
        Some(())
    }

    /// A number's source text, checked against JSON's grammar.
    fn number(&mut self, out: &mut Vec<u8>) -> Option<()> {
        let start = self.at;
        let digits = |reader: &mut Self| {
            let from = reader.at;
            while reader.peek().is_some_and(|b| b.is_ascii_digit()) {
                reader.at += 1;
            }
            (reader.at > from).then_some(())
        };
        if self.peek() == Some(b'-') {
            self.at += 1;
        }
        if self.peek() == Some(b'0') {
            self.at += 1;
        } else {
            digits(self)?;
        }
        if self.peek() == Some(b'.') {
            self.at += 1;
            digits(self)?;
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.at += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.at += 1;
            }
            digits(self)?;
        }
        out.extend_from_slice(self.text.get(start..self.at)?);
        Some(())
    }

    /// A string at the cursor, unescaped.
    fn string(&mut self) -> Option<String> {
        if self.peek() != Some(b'"') {
            return None;
        }
        self.at += 1;
        let mut bytes = Vec::new();
        loop {
            let byte = self.peek()?;
            self.at += 1;
            match byte {
                b'"' => return String::from_utf8(bytes).ok(),
                b'\\' => {
                    let escaped = self.peek()?;
                    self.at += 1;
                    let plain = match escaped {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => self.unicode()?,
                        _ => return None,
                    };
                    let mut buffer = [0u8; 4];
                    bytes.extend_from_slice(plain.encode_utf8(&mut buffer).as_bytes());
                }
                0..=0x1f => return None,
                other => bytes.push(other),
            }
        }
    }

    /// The character of a `\uXXXX` escape (a surrogate pair takes two).
    fn unicode(&mut self) -> Option<char> {
        let high = self.hex4()?;
        if !(0xd800..0xdc00).contains(&high) {
            return char::from_u32(high);
        }
        let end = self.at.checked_add(2)?;
        if self.text.get(self.at..end) != Some(b"\\u") {
            return None;
        }
        self.at = end;
        let low = self.hex4()?;
        if !(0xdc00..0xe000).contains(&low) {
            return None;
        }
        char::from_u32(0x10000 + ((high - 0xd800) << 10) + (low - 0xdc00))
    }

    fn hex4(&mut self) -> Option<u32> {
        let end = self.at.checked_add(4)?;
        let digits = std::str::from_utf8(self.text.get(self.at..end)?).ok()?;
        self.at = end;
        u32::from_str_radix(digits, 16).ok()
    }
}

/// `text` as a JSON string with the fewest escapes: `"`, `\\` and control characters.
fn write_string(text: &str, out: &mut Vec<u8>) {
    out.push(b'"');
    for c in text.chars() {
        match c {
            '"' => out.extend_from_slice(b"\\\""),
            '\\' => out.extend_from_slice(b"\\\\"),
            c if u32::from(c) < 0x20 => {
                out.extend_from_slice(format!("\\u{:04x}", u32::from(c)).as_bytes());
            }
            c => {
                let mut buffer = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buffer).as_bytes());
            }
        }
    }
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    use axum::http::Request;

    use super::canonical_request;

    fn fingerprint(method: &str, uri: &str, content_type: &str, body: &[u8]) -> Vec<u8> {
        let (parts, ()) = Request::builder()
            .method(method)
            .uri(uri)
            .header("content-type", content_type)
            .body(())
            .unwrap()
            .into_parts();
        canonical_request(&parts, body)
    }

    #[test]
    fn json_bodies_compare_by_value() {
        let a = fingerprint(
            "POST",
            "/v1/p",
            "application/json",
            br#"{"b":1, "a":{"y":2,"x":[1, 2]}}"#,
        );
        let b = fingerprint(
            "POST",
            "/v1/p",
            "application/json; charset=utf-8",
            br#"{"a":{"x":[1,2],"y":2},"b":1}"#,
        );
        assert_eq!(a, b);
        assert_eq!(a, b"POST /v1/p\n{\"a\":{\"x\":[1,2],\"y\":2},\"b\":1}");
        // Another value, path or method is another request.
        assert_ne!(
            a,
            fingerprint(
                "POST",
                "/v1/p",
                "application/json",
                br#"{"a":{"x":[1,2],"y":3},"b":1}"#
            )
        );
        assert_ne!(
            a,
            fingerprint(
                "POST",
                "/v1/q",
                "application/json",
                br#"{"b":1,"a":{"y":2,"x":[1,2]}}"#
            )
        );
        assert_ne!(
            a,
            fingerprint(
                "PATCH",
                "/v1/p",
                "application/json",
                br#"{"b":1,"a":{"y":2,"x":[1,2]}}"#
            )
        );
    }

    #[test]
    fn the_canonical_form_is_the_codes_own() {
        let canonical = |text: &[u8]| super::canonical_json(text);
        // Escapes decode: one string, however it is written.
        assert_eq!(canonical(br#""\u0061\n""#), canonical(b"\"a\\n\""));
        assert_eq!(
            canonical(br#""\ud83d\ude00""#).unwrap(),
            "\"\u{1f600}\"".as_bytes()
        );
        // Numbers keep their source text: big or precise numbers never collapse.
        assert_ne!(
            canonical(b"12345678901234567890123"),
            canonical(b"12345678901234567890124")
        );
        assert_ne!(canonical(b"0.10000000000000000001"), canonical(b"0.1"));
        assert_eq!(canonical(b"1e400").unwrap(), b"1e400");
        // Members sort by name at every depth; a repeated name keeps its last value.
        assert_eq!(
            canonical(br#"{"b":{"d":1,"c":2},"a":[{"z":1,"y":2}]}"#).unwrap(),
            br#"{"a":[{"y":2,"z":1}],"b":{"c":2,"d":1}}"#
        );
        assert_eq!(canonical(br#"{"a":1,"a":2}"#).unwrap(), br#"{"a":2}"#);
        // Not one JSON value, or too deep: no canonical form.
        for bad in [&b"{x"[..], b"1 2", b"01", b"[1,]", b"\"\\x\"", b"-", b"1."] {
            assert_eq!(canonical(bad), None, "{}", String::from_utf8_lossy(bad));
        }
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        assert_eq!(canonical(deep.as_bytes()), None);
    }

    #[test]
    fn other_bodies_compare_by_bytes() {
        let a = fingerprint("POST", "/u", "text/plain", b"a b");
        assert_eq!(a, b"POST /u\na b");
        assert_ne!(a, fingerprint("POST", "/u", "text/plain", b"a  b"));
        // Broken JSON falls back to the bytes.
        assert_eq!(
            fingerprint("POST", "/u", "application/json", b"{x"),
            b"POST /u\n{x"
        );
    }
}
