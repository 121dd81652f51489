//! A response as the layer stores it in a record, and reads it back for a replay.
//!
//! Layout (little-endian), inside the record's response bytes (which the store's own
//! format checksums):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 1 | version, 2 |
//! | 1 | 2 | status code |
//! | 3 | 1 | header count `n` (at most [`MAX_HEADERS`]) |
//! | 4 | ... | `n` headers: name length (1 byte), name (ASCII, lowercase), value length (2 bytes, at most [`MAX_HEADER_VALUE_BYTES`]), value |
//! | ... | 4 | body length `b` |
//! | ... | `b` | body; nothing may follow it |
//!
//! Every field's length is known before it is read, so a cut anywhere (header section
//! or body) and trailing bytes are refused. Version 1, which had no body length and took
//! the rest as the body, is still read, so records stored by it replay.

use axum::body::Body;
use axum::http::header::{HeaderName, HeaderValue};
use axum::http::response::Parts;
use axum::http::{Response, StatusCode};

const VERSION: u8 = 2;
/// The layout without a body length: read, never written.
const VERSION_UNSIZED_BODY: u8 = 1;
/// Most headers stored with one response.
pub const MAX_HEADERS: usize = 32;
/// Longest header value stored.
pub const MAX_HEADER_VALUE_BYTES: usize = 8192;

/// A response to replay: status, allow-listed headers, body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// The status code.
    pub status: StatusCode,
    /// The stored headers, in order.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The body, byte for byte.
    pub body: Vec<u8>,
}

impl StoredResponse {
    /// The parts of `response` whose names are in `allow`, with `body`. Headers beyond
    /// the limits are left out (and so not replayed).
    pub fn capture(parts: &Parts, body: &[u8], allow: &[HeaderName]) -> StoredResponse {
        let headers = parts
            .headers
            .iter()
            .filter(|(name, value)| {
                allow.contains(name)
                    && name.as_str().len() <= usize::from(u8::MAX)
                    && value.len() <= MAX_HEADER_VALUE_BYTES
            })
            .take(MAX_HEADERS)
            .map(|(name, value)| (name.clone(), value.clone()))
            .collect();
        StoredResponse {
            status: parts.status,
            headers,
            body: body.to_vec(),
        }
    }

    /// The stored form.
    pub fn encode(&self) -> Vec<u8> {
        let headers = || {
            self.headers
                .iter()
                .filter(|(name, value)| {
                    name.as_str().len() <= usize::from(u8::MAX)
                        && value.len() <= MAX_HEADER_VALUE_BYTES
                })
                .take(MAX_HEADERS)
        };
        // Sized once: version, status, count, each header's lengths and bytes, the body's.
        let header_bytes: usize = headers()
            .map(|(name, value)| 3 + name.as_str().len() + value.len())
            .sum();
        let mut out = Vec::with_capacity(8 + header_bytes + self.body.len());
        out.push(VERSION);
        out.extend_from_slice(&self.status.as_u16().to_le_bytes());
        out.push(u8::try_from(headers().count()).unwrap_or(0));
        for (name, value) in headers() {
            let name = name.as_str().as_bytes();
            out.push(u8::try_from(name.len()).unwrap_or(0));
            out.extend_from_slice(name);
            out.extend_from_slice(&u16::try_from(value.len()).unwrap_or(0).to_le_bytes());
            out.extend_from_slice(value.as_bytes());
        }
        // A body over 4 GiB cannot be stored: any store refuses far smaller responses.
        out.extend_from_slice(
            &u32::try_from(self.body.len())
                .unwrap_or(u32::MAX)
                .to_le_bytes(),
        );
        out.extend_from_slice(&self.body);
        out
    }

    /// Reads the stored form; `None` if it is not one.
    pub fn decode(bytes: &[u8]) -> Option<StoredResponse> {
        let (&version, rest) = bytes.split_first()?;
        if version != VERSION && version != VERSION_UNSIZED_BODY {
            return None;
        }
        let (status, rest) = rest.split_at_checked(2)?;
        let status = StatusCode::from_u16(u16::from_le_bytes(status.try_into().ok()?)).ok()?;
        let (&count, mut rest) = rest.split_first()?;
        if usize::from(count) > MAX_HEADERS {
            return None;
        }
        let mut headers = Vec::with_capacity(usize::from(count));
        for _ in 0..count {
            let (&name_len, after) = rest.split_first()?;
            let (name, after) = after.split_at_checked(usize::from(name_len))?;
            let (value_len, after) = after.split_at_checked(2)?;
            let value_len = usize::from(u16::from_le_bytes(value_len.try_into().ok()?));
            if value_len > MAX_HEADER_VALUE_BYTES {
                return None;
            }
            let (value, after) = after.split_at_checked(value_len)?;
            headers.push((
                HeaderName::from_bytes(name).ok()?,
                HeaderValue::from_bytes(value).ok()?,
            ));
            rest = after;
        }
        let body = if version == VERSION_UNSIZED_BODY {
            rest
        } else {
            let (len, body) = rest.split_at_checked(4)?;
            let len = usize::try_from(u32::from_le_bytes(len.try_into().ok()?)).ok()?;
            (body.len() == len).then_some(body)?
        };
        Some(StoredResponse {
            status,
            headers,
            body: body.to_vec(),
        })
    }

    /// The response to send.
    pub fn into_response(self) -> Response<Body> {
        let mut response = Response::new(Body::from(self.body));
        *response.status_mut() = self.status;
        for (name, value) in self.headers {
            response.headers_mut().append(name, value);
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use axum::http::{HeaderName, HeaderValue, StatusCode};

    use super::StoredResponse;

    /// The bytes of one stored answer, also asserted by the Python middleware's tests
    /// (`python/tests/test_bad_days.py`): both sides write and read one layout.
    const SHARED_WITH_PYTHON: &str =
        "02c900010c636f6e74656e742d7479706510006170706c69636174696f6e2f6a736f6e020000007b7d";

    #[test]
    fn the_layout_is_the_one_python_writes() {
        let stored = StoredResponse {
            status: StatusCode::CREATED,
            headers: vec![(
                HeaderName::from_static("content-type"),
                HeaderValue::from_static("application/json"),
            )],
            body: b"{}".to_vec(),
        };
        let hex: String = stored.encode().iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, SHARED_WITH_PYTHON);
        let bytes: Vec<u8> = (0..SHARED_WITH_PYTHON.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&SHARED_WITH_PYTHON[i..i + 2], 16).unwrap())
            .collect();
        assert_eq!(StoredResponse::decode(&bytes), Some(stored));
    }

    #[test]
    fn round_trips_and_refuses_damage() {
        let stored = StoredResponse {
            status: StatusCode::CREATED,
            headers: vec![
                (
                    HeaderName::from_static("content-type"),
                    HeaderValue::from_static("application/json"),
                ),
                (
                    HeaderName::from_static("location"),
                    HeaderValue::from_static("/v1/payments/pay_1"),
                ),
            ],
            body: (0..=255u8).collect(),
        };
        let bytes = stored.encode();
        assert_eq!(StoredResponse::decode(&bytes).unwrap(), stored);
        // Every cut, in the header section or the body, trailing bytes and a bad version
        // are refused.
        for cut in 0..bytes.len() {
            assert!(
                StoredResponse::decode(&bytes[..cut]).is_none(),
                "cut at {cut} of {}",
                bytes.len()
            );
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(StoredResponse::decode(&longer).is_none());
        let mut bad = bytes.clone();
        bad[0] = 3;
        assert!(StoredResponse::decode(&bad).is_none());
    }

    #[test]
    fn records_of_the_first_layout_still_replay() {
        // Version 1: status 201, one header, and the rest as the body.
        let mut bytes = vec![1, 201, 0, 1, 8];
        bytes.extend_from_slice(b"location");
        bytes.extend_from_slice(&2u16.to_le_bytes());
        bytes.extend_from_slice(b"/x");
        bytes.extend_from_slice(b"{}");
        let stored = StoredResponse::decode(&bytes).unwrap();
        assert_eq!(stored.status, StatusCode::CREATED);
        assert_eq!(stored.headers.len(), 1);
        assert_eq!(stored.body, b"{}");
    }
}
