//! Key streams shared by `oncedb bench` and the criterion benches: deterministic, so every
//! system measured in one run sees the same keys in the same order.

#![expect(
    clippy::cast_possible_truncation,
    reason = "benchmark tool: sizes and rates fit their types on any machine it runs on"
)]
#![expect(
    clippy::indexing_slicing,
    reason = "benchmark tool: indices come from the workload it generates"
)]

use oncedb::io::SplitMix64;

/// `ops` 16-byte ids of which a fraction `dup_rate` repeats an earlier id (chosen
/// uniformly among those before it), like redeliveries in a message stream.
pub fn id_stream(ops: usize, dup_rate: f64, seed: u64) -> Vec<[u8; 16]> {
    let mut rng = SplitMix64::new(seed);
    let threshold = (dup_rate.clamp(0.0, 1.0) * u64::MAX as f64) as u64;
    let mut keys: Vec<[u8; 16]> = Vec::with_capacity(ops);
    for i in 0..ops {
        if i > 0 && rng.next_u64() < threshold {
            let earlier = keys[rng.below(i as u64) as usize];
            keys.push(earlier);
        } else {
            let mut key = [0u8; 16];
            key[..8].copy_from_slice(&rng.next_u64().to_le_bytes());
            key[8..].copy_from_slice(&rng.next_u64().to_le_bytes());
            keys.push(key);
        }
    }
    keys
}

/// Realistic idempotency keys: `org_<N>:create_payment:<uuid>` (about 60 bytes), with
/// `dup_rate` of them retries of an earlier key.
pub fn idempotency_keys(ops: usize, dup_rate: f64, seed: u64) -> Vec<String> {
    let ids = id_stream(ops, dup_rate, seed);
    ids.iter()
        .map(|id| {
            let org = u16::from_le_bytes([id[0], id[1]]) % 1000;
            let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
            format!(
                "org_{org}:create_payment:{}-{}-{}-{}-{}",
                &hex[0..8],
                &hex[8..12],
                &hex[12..16],
                &hex[16..20],
                &hex[20..32]
            )
        })
        .collect()
}

/// A 256-byte response body to store for replay.
pub fn response_body(seed: u64) -> Vec<u8> {
    let mut rng = SplitMix64::new(seed);
    let mut body = br#"{"id":"pay_"#.to_vec();
    while body.len() < 254 {
        body.push(b'a' + (rng.next_u64() % 26) as u8);
    }
    body.extend_from_slice(b"\"}");
    body
}

/// Resident set size of this process in bytes (Linux; 0 elsewhere).
pub fn rss_bytes() -> u64 {
    let Ok(statm) = std::fs::read_to_string("/proc/self/statm") else {
        return 0;
    };
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|field| field.parse().ok())
        .unwrap_or(0);
    pages * 4096
}
