//! The default request fingerprint: method, path and query, and a canonical body.

use axum::http::header::CONTENT_TYPE;
use axum::http::request::Parts;

/// `METHOD path?query`, a newline, and the body: for a JSON content type whose body
/// parses, the JSON re-serialised with object keys sorted and no insignificant
/// whitespace (the same canonical form a client library would hash), so `{"b":1, "a":2}` and
/// `{"a":2,"b":1}` are one request; for anything else, the raw bytes. The store hashes
/// the result (XXH3-128).
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
    let canonical = json
        .then(|| serde_json::from_slice::<serde_json::Value>(body).ok())
        .flatten()
        .and_then(|value| serde_json::to_vec(&value).ok());
    match canonical {
        // serde_json's map is ordered by key, and `to_vec` writes no whitespace.
        Some(canonical) => out.extend_from_slice(&canonical),
        None => out.extend_from_slice(body),
    }
    out
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
