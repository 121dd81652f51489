//! The default request fingerprint: method, path and query, and a canonical body.

use std::borrow::Cow;
use std::ops::Range;

use axum::http::header::CONTENT_TYPE;
use axum::http::request::Parts;

/// `METHOD path?query`, a newline, and the body: for a JSON content type whose body
/// parses, its canonical form (below), so `{"b":1, "a":2}` and `{"a":2,"b":1}` are one
/// request; for anything else, [`RAW_BODY`] then the raw bytes. The store hashes the
/// result (XXH3-128).
///
/// The canonical form is written here, independent of any JSON library's features:
/// object members sorted by their (unescaped) names, recursively; strings re-escaped
/// minimally (`"\u0061"` and `"a"` are one string); numbers kept as their source text, so
/// no two numbers that differ in any digit can match (`1e400`, `12345678901234567890.5`
/// stay distinct; `1` and `1.0` are two requests); no insignificant whitespace. A body
/// that is not one JSON value, or nests deeper than 128 levels, is compared by its bytes.
pub fn canonical_request(parts: &Parts, body: &[u8]) -> Vec<u8> {
    let mut out = request_line(parts, body.len());
    let json = parts
        .headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| {
            let essence = ct.split(';').next().unwrap_or("").trim();
            essence.eq_ignore_ascii_case("application/json") || essence.ends_with("+json")
        });
    if !(json && canonical_json_into(body, &mut out)) {
        out.push(RAW_BODY);
        out.extend_from_slice(body);
    }
    out
}

/// The byte before a body compared by its bytes. No canonical JSON text and no line of
/// [`fields_request`] starts with it, so a body that is not read as JSON (a text body, or
/// a JSON content type that does not parse) never has the fingerprint of one that is,
/// whatever its bytes: reusing a key across the two is 422, not a replay.
pub const RAW_BODY: u8 = 0;

/// `METHOD path?query` and a newline, in a buffer with room for `more` bytes after it.
fn request_line(parts: &Parts, more: usize) -> Vec<u8> {
    let target = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path(), |pq| pq.as_str());
    let method = parts.method.as_str();
    let mut out = Vec::with_capacity(method.len() + 2 + target.len() + more);
    out.extend_from_slice(method.as_bytes());
    out.push(b' ');
    out.extend_from_slice(target.as_bytes());
    out.push(b'\n');
    out
}

/// The fingerprint of a request by chosen fields of its JSON body: `METHOD path?query`,
/// a newline, then for each JSON Pointer (RFC 6901) of `pointers`, in order, the
/// pointer, `=`, and the canonical form (as [`canonical_request`]) of the value it
/// names, or `-` where it names none, each followed by a newline. Fields outside the
/// pointers (a timestamp a client adds on each retry) do not change it. A body that is
/// not one JSON value is compared by its bytes, as by [`canonical_request`].
pub fn fields_request(parts: &Parts, body: &[u8], pointers: &[String]) -> Vec<u8> {
    let Some(canonical) = canonical_json(body) else {
        return canonical_request(parts, body);
    };
    let mut out = request_line(parts, 0);
    for pointer in pointers {
        out.extend_from_slice(pointer.as_bytes());
        out.push(b'=');
        match resolve(canonical.clone(), pointer) {
            Some(value) => out.extend_from_slice(&value),
            None => out.push(b'-'),
        }
        out.push(b'\n');
    }
    out
}

/// The string or number the JSON Pointer `pointer` names in the JSON body `body`, as
/// text (a string unescaped, a number as written); `None` if the body is not JSON or
/// the pointer names nothing, or names another kind of value.
pub(crate) fn pointer_text(body: &[u8], pointer: &str) -> Option<String> {
    let value = resolve(canonical_json(body)?, pointer)?;
    match value.first()? {
        b'"' => Reader {
            text: &value,
            at: 0,
        }
        .string()
        .map(Cow::into_owned),
        b'-' | b'0'..=b'9' => String::from_utf8(value).ok(),
        _ => None,
    }
}

/// Whether `pointer` is a JSON Pointer: empty, or `/`-separated tokens whose `~` is
/// followed by `0` or `1`.
pub(crate) fn is_pointer(pointer: &str) -> bool {
    pointer.is_empty()
        || pointer.starts_with('/')
            && pointer
                .split('~')
                .skip(1)
                .all(|after| after.starts_with('0') || after.starts_with('1'))
}

/// The canonical form of the value `pointer` names in the canonical JSON `canonical`.
fn resolve(mut canonical: Vec<u8>, pointer: &str) -> Option<Vec<u8>> {
    if !is_pointer(pointer) {
        return None;
    }
    for token in pointer.split('/').skip(1) {
        let token = token.replace("~1", "/").replace("~0", "~");
        canonical = match canonical.first()? {
            b'{' => {
                Reader {
                    text: &canonical,
                    at: 0,
                }
                .members()?
                .into_iter()
                .find(|(name, _)| *name == token)?
                .1
            }
            b'[' => {
                let index = array_index(&token)?;
                Reader {
                    text: &canonical,
                    at: 0,
                }
                .elements()?
                .into_iter()
                .nth(index)?
            }
            _ => return None,
        };
    }
    Some(canonical)
}

/// An array index token: `0`, or digits without a leading zero.
fn array_index(token: &str) -> Option<usize> {
    let digits = !token.is_empty() && token.bytes().all(|b| b.is_ascii_digit());
    (digits && (token == "0" || !token.starts_with('0')))
        .then(|| token.parse().ok())
        .flatten()
}

/// Deepest nesting the canonical form follows.
const MAX_DEPTH: usize = 128;

/// The canonical form of the JSON value `text` (see [`canonical_request`]), or `None` if
/// it is not exactly one JSON value.
fn canonical_json(text: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(text.len());
    canonical_json_into(text, &mut out).then_some(out)
}

/// Appends the canonical form of the JSON value `text` to `out` and returns true, or
/// leaves `out` as it was and returns false if `text` is not exactly one JSON value.
fn canonical_json_into(text: &[u8], out: &mut Vec<u8>) -> bool {
    let start = out.len();
    let mut reader = Reader { text, at: 0 };
    let whole = reader.value(out, 0).is_some() && {
        reader.space();
        reader.at == text.len()
    };
    if !whole {
        out.truncate(start);
    }
    whole
}

struct Reader<'a> {
    text: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
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
        // Each member's canonical value goes to one buffer, named by its range there:
        // an object costs two allocations whatever its members.
        let mut values = Vec::new();
        let mut members: Vec<(Cow<'a, str>, Range<usize>)> = Vec::new();
        if self.eat(b'}').is_none() {
            loop {
                self.space();
                let name = self.string()?;
                self.eat(b':')?;
                let start = values.len();
                self.value(&mut values, depth + 1)?;
                members.push((name, start..values.len()));
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
        for (index, (name, range)) in members.into_iter().enumerate() {
            if index > 0 {
                out.push(b',');
            }
            write_string(&name, out);
            out.push(b':');
            out.extend_from_slice(values.get(range)?);
        }
        out.push(b'}');
        Some(())
    }

    /// The members of the object at the cursor: names and canonical values.
    fn members(&mut self) -> Option<Vec<(String, Vec<u8>)>> {
        self.eat(b'{')?;
        let mut members = Vec::new();
        if self.eat(b'}').is_none() {
            loop {
                self.space();
                let name = self.string()?.into_owned();
                self.eat(b':')?;
                let mut value = Vec::new();
                self.value(&mut value, 1)?;
                members.push((name, value));
                if self.eat(b',').is_none() {
                    self.eat(b'}')?;
                    break;
                }
            }
        }
        Some(members)
    }

    /// The elements of the array at the cursor, canonical.
    fn elements(&mut self) -> Option<Vec<Vec<u8>>> {
        self.eat(b'[')?;
        let mut elements = Vec::new();
        if self.eat(b']').is_none() {
            loop {
                let mut value = Vec::new();
                self.value(&mut value, 1)?;
                elements.push(value);
                if self.eat(b',').is_none() {
                    self.eat(b']')?;
                    break;
                }
            }
        }
        Some(elements)
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

    /// A string at the cursor, unescaped: borrowed from the text if it holds no escape.
    fn string(&mut self) -> Option<Cow<'a, str>> {
        if self.peek() != Some(b'"') {
            return None;
        }
        self.at += 1;
        let start = self.at;
        loop {
            match self.peek()? {
                b'"' => {
                    let text = std::str::from_utf8(self.text.get(start..self.at)?).ok()?;
                    self.at += 1;
                    return Some(Cow::Borrowed(text));
                }
                b'\\' => break,
                0..=0x1f => return None,
                _ => self.at += 1,
            }
        }
        let mut bytes = self.text.get(start..self.at)?.to_vec();
        loop {
            let byte = self.peek()?;
            self.at += 1;
            match byte {
                b'"' => return String::from_utf8(bytes).ok().map(Cow::Owned),
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
    out.reserve(text.len() + 2);
    out.push(b'"');
    // Runs of bytes that need no escape are copied whole (every byte of a multi-byte
    // UTF-8 character is at least 0x80, so it is never mistaken for one that does).
    let bytes = text.as_bytes();
    let mut run = 0;
    for (at, &byte) in bytes.iter().enumerate() {
        let escaped: &[u8] = match byte {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            0..=0x1f => &[],
            _ => continue,
        };
        out.extend_from_slice(bytes.get(run..at).unwrap_or_default());
        if escaped.is_empty() {
            // A control character: `\u00XX`, lower-case hex (the high digit is 0 or 1).
            let low = byte & 0xf;
            out.extend_from_slice(b"\\u00");
            out.push(b'0' + (byte >> 4));
            out.push(if low < 10 {
                b'0' + low
            } else {
                b'a' + low - 10
            });
        } else {
            out.extend_from_slice(escaped);
        }
        run = at + 1;
    }
    out.extend_from_slice(bytes.get(run..).unwrap_or_default());
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    use axum::http::Request;

    use super::canonical_request;

    /// The head of a request, with a content type if given.
    fn parts(method: &str, uri: &str, content_type: Option<&str>) -> axum::http::request::Parts {
        let mut request = Request::builder().method(method).uri(uri);
        if let Some(content_type) = content_type {
            request = request.header("content-type", content_type);
        }
        request.body(()).unwrap().into_parts().0
    }

    fn fingerprint(method: &str, uri: &str, content_type: &str, body: &[u8]) -> Vec<u8> {
        canonical_request(&parts(method, uri, Some(content_type)), body)
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
        // Written back with the fewest escapes: quotes, backslashes and control
        // characters only, the last as lower-case `\u00XX`.
        assert_eq!(
            canonical(br#""a\n\u001F\"\\\u00e9/""#).unwrap(),
            "\"a\\u000a\\u001f\\\"\\\\\u{e9}/\"".as_bytes()
        );
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
        // Names decode before they sort, escaped or not.
        assert_eq!(
            canonical(br#"{"\u0062":1,"a":"\u00e9","\u0061b":[]}"#).unwrap(),
            "{\"a\":\"\u{e9}\",\"ab\":[],\"b\":1}".as_bytes()
        );
        // Not one JSON value, or too deep: no canonical form.
        for bad in [&b"{x"[..], b"1 2", b"01", b"[1,]", b"\"\\x\"", b"-", b"1."] {
            assert_eq!(canonical(bad), None, "{}", String::from_utf8_lossy(bad));
        }
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        assert_eq!(canonical(deep.as_bytes()), None);
    }

    #[test]
    fn pointers_name_values_as_rfc_6901_says() {
        let body = br#"{"id":"evt_1","data":{"a/b":[10,{"m~n":"x"}]},"n":-2.50,"t":true}"#;
        let text = |pointer: &str| super::pointer_text(body, pointer);
        assert_eq!(text("/id").as_deref(), Some("evt_1"));
        assert_eq!(text("/n").as_deref(), Some("-2.50"));
        assert_eq!(text("/data/a~1b/0").as_deref(), Some("10"));
        assert_eq!(text("/data/a~1b/1/m~0n").as_deref(), Some("x"));
        // Not a string or number, missing, a bad index, or not a pointer: nothing.
        for none in [
            "/t",
            "/data",
            "/nope",
            "/data/a~1b/01",
            "/data/a~1b/2",
            "id",
            "/x~2",
        ] {
            assert_eq!(text(none), None, "{none}");
        }
        assert_eq!(super::pointer_text(b"not json", "/id"), None);
    }

    #[test]
    fn fields_fingerprint_only_the_named_fields() {
        let parts = parts("POST", "/hooks", None);
        let pointers = vec!["/amount".to_owned(), "/to".to_owned()];
        let of = |body: &[u8]| super::fields_request(&parts, body, &pointers);
        let first = of(br#"{"amount":5,"to":"a","sent_at":1}"#);
        assert_eq!(first, b"POST /hooks\n/amount=5\n/to=\"a\"\n");
        assert_eq!(first, of(br#"{"sent_at":2,"to":"a","amount":5}"#));
        assert_ne!(first, of(br#"{"amount":6,"to":"a","sent_at":1}"#));
        assert_eq!(of(br#"{"amount":5}"#), b"POST /hooks\n/amount=5\n/to=-\n");
        assert_eq!(of(b"raw"), b"POST /hooks\n\0raw");
    }

    #[test]
    fn a_body_read_by_its_bytes_never_matches_a_json_request() {
        // A text body whose bytes are a JSON request's fields form, or its canonical
        // form: another request (422 on reuse), not a replay.
        let parts = parts("POST", "/hooks", None);
        let pointers = vec!["/amount".to_owned()];
        let json = super::fields_request(&parts, br#"{"amount":5}"#, &pointers);
        let text = super::fields_request(&parts, b"/amount=5\n", &pointers);
        assert_ne!(json, text);
        assert_ne!(
            fingerprint("POST", "/u", "application/json", br#"{"a":1}"#),
            fingerprint("POST", "/u", "text/plain", br#"{"a":1}"#)
        );
    }

    #[test]
    fn other_bodies_compare_by_bytes() {
        let a = fingerprint("POST", "/u", "text/plain", b"a b");
        assert_eq!(a, b"POST /u\n\0a b");
        assert_ne!(a, fingerprint("POST", "/u", "text/plain", b"a  b"));
        // Broken JSON falls back to the bytes, also where it breaks after a part of its
        // canonical form was written.
        assert_eq!(
            fingerprint("POST", "/u", "application/json", b"{x"),
            b"POST /u\n\0{x"
        );
        assert_eq!(
            fingerprint("POST", "/u", "application/json", b"[1, {\"a\": 2},"),
            b"POST /u\n\0[1, {\"a\": 2},"
        );
    }

    use proptest::prelude::*;
    use serde_json::Value;

    /// JSON values: literals, integers, strings with any characters (control ones and
    /// those beyond the basic plane included), arrays and objects, a few levels deep.
    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            "(\\PC|[\u{0}-\u{1f}\"\\\\/\u{10000}-\u{10ffff}]){0,6}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
                prop::collection::btree_map("[a-zé\"\\\\\u{1}]{0,3}", inner, 0..5)
                    .prop_map(|members| Value::Object(members.into_iter().collect())),
            ]
        })
    }

    /// `value` as JSON text: members in reverse order or not, every character escaped
    /// as `\uXXXX` (surrogate pairs beyond the basic plane) or the fewest, with spaces
    /// between tokens or not.
    fn write(value: &Value, other_way: bool, out: &mut String) {
        let gap = if other_way { " \n " } else { "" };
        match value {
            Value::String(text) => write_text(text, other_way, out),
            Value::Array(elements) => {
                out.push('[');
                for (index, element) in elements.iter().enumerate() {
                    if index > 0 {
                        out.push_str(gap);
                        out.push(',');
                    }
                    write(element, other_way, out);
                }
                out.push(']');
            }
            Value::Object(members) => {
                let mut members: Vec<_> = members.iter().collect();
                if other_way {
                    members.reverse();
                }
                out.push('{');
                for (index, (name, member)) in members.into_iter().enumerate() {
                    if index > 0 {
                        out.push(',');
                    }
                    out.push_str(gap);
                    write_text(name, other_way, out);
                    out.push_str(gap);
                    out.push(':');
                    write(member, other_way, out);
                }
                out.push('}');
            }
            literal => out.push_str(&literal.to_string()),
        }
    }

    fn write_text(text: &str, escape_all: bool, out: &mut String) {
        out.push('"');
        for c in text.chars() {
            if escape_all {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04X}"));
                }
            } else if c == '"' || c == '\\' {
                out.push('\\');
                out.push(c);
            } else if u32::from(c) < 0x20 {
                out.push_str(&format!("\\u{:04x}", u32::from(c)));
            } else {
                out.push(c);
            }
        }
        out.push('"');
    }

    proptest! {
        /// One value written two ways has one canonical form, and that form is JSON
        /// that reads back as the value.
        #[test]
        fn one_value_written_two_ways_has_one_canonical_form(value in json_value()) {
            let (mut plain, mut other) = (String::new(), String::new());
            write(&value, false, &mut plain);
            write(&value, true, &mut other);
            let canonical = super::canonical_json(plain.as_bytes()).unwrap();
            prop_assert_eq!(&canonical, &super::canonical_json(other.as_bytes()).unwrap());
            let read: Value = serde_json::from_slice(&canonical).unwrap();
            prop_assert_eq!(read, value);
        }
    }
}
