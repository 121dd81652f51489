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
    response_body_of(256, seed)
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

/// The 16-byte id of a stream's new key number `n`: distinct for every `n` of one seed,
/// since the first half is SplitMix64's output for its own state, a bijection.
fn nth_id(seed: u64, n: u64) -> [u8; 16] {
    let mut rng = SplitMix64::new(seed.wrapping_add(n.wrapping_mul(0x9e37_79b9_7f4a_7c15)));
    let mut id = [0u8; 16];
    id[..8].copy_from_slice(&rng.next_u64().to_le_bytes());
    id[8..].copy_from_slice(&rng.next_u64().to_le_bytes());
    id
}

/// An idempotency key (`org_<N>:create_payment:<uuid>`) written over `out`.
fn write_idempotency_key(id: &[u8; 16], out: &mut String) {
    use std::fmt::Write;
    out.clear();
    let org = u16::from_le_bytes([id[0], id[1]]) % 1000;
    let _ = write!(out, "org_{org}:create_payment:");
    for (i, byte) in id.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            out.push('-');
        }
        let _ = write!(out, "{byte:02x}");
    }
}

/// A key stream generated as it is read, so that its memory is one batch whatever its
/// length: new keys are numbered and derived from their number, and a repeat (a fraction
/// `dup_rate` of the operations) re-derives a number drawn uniformly among the new keys
/// so far. Streams of one seed with different `lane`s (one per writer thread) share no
/// key.
pub struct KeyStream {
    rng: SplitMix64,
    seed: u64,
    threshold: u64,
    /// The first key number of this lane; numbers of other lanes are 2^40 apart.
    base: u64,
    issued: u64,
}

impl KeyStream {
    /// The stream of lane `lane` (at most 2^24 lanes of 2^40 keys each).
    pub fn new(dup_rate: f64, seed: u64, lane: u64) -> KeyStream {
        KeyStream {
            rng: SplitMix64::new(seed ^ lane.wrapping_mul(0xd1b5_4a32_d192_ed03)),
            seed,
            threshold: (dup_rate.clamp(0.0, 1.0) * u64::MAX as f64) as u64,
            base: lane << 40,
            issued: 0,
        }
    }

    /// The next operation's key.
    pub fn next_id(&mut self) -> [u8; 16] {
        self.next_marked().0
    }

    /// The next operation's key, and whether it repeats an earlier one.
    pub fn next_marked(&mut self) -> ([u8; 16], bool) {
        let repeat = self.issued > 0 && self.rng.next_u64() < self.threshold;
        let n = if repeat {
            self.rng.below(self.issued)
        } else {
            self.issued += 1;
            self.issued - 1
        };
        (nth_id(self.seed, self.base + n), repeat)
    }

    /// The next `n` operations' ids, in `out` (cleared first).
    pub fn fill_ids(&mut self, n: usize, out: &mut Vec<[u8; 16]>) {
        out.clear();
        out.extend((0..n).map(|_| self.next_id()));
    }

    /// The next `n` operations' idempotency keys, in `out`, reusing its strings.
    pub fn fill_idempotency_keys(&mut self, n: usize, out: &mut Vec<String>) {
        out.resize_with(n, String::new);
        for key in out.iter_mut() {
            write_idempotency_key(&self.next_id(), key);
        }
    }

    /// [`KeyStream::fill_idempotency_keys`], and in `repeats` whether each key repeats
    /// an earlier one.
    pub fn fill_idempotency_keys_marked(
        &mut self,
        n: usize,
        out: &mut Vec<String>,
        repeats: &mut Vec<bool>,
    ) {
        out.resize_with(n, String::new);
        repeats.clear();
        for key in out.iter_mut() {
            let (id, repeat) = self.next_marked();
            write_idempotency_key(&id, key);
            repeats.push(repeat);
        }
    }

    /// How many distinct keys the stream has produced so far.
    pub fn distinct(&self) -> u64 {
        self.issued
    }
}

/// A response body of `len` bytes to store for replay: a JSON object padded with
/// letters (at least its 12 bytes of braces and field name).
pub fn response_body_of(len: usize, seed: u64) -> Vec<u8> {
    let mut rng = SplitMix64::new(seed);
    let mut body = br#"{"id":"pay_"#.to_vec();
    while body.len() + 2 < len {
        body.push(b'a' + (rng.next_u64() % 26) as u8);
    }
    body.extend_from_slice(b"\"}");
    body
}

/// The peak resident set size of this process in bytes (Linux `VmHWM`; 0 elsewhere).
pub fn peak_rss_bytes() -> u64 {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return 0;
    };
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|kib| kib.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::KeyStream;
    use std::collections::HashSet;

    #[test]
    fn a_stream_counts_its_distinct_keys_and_lanes_share_none() {
        let mut seen = HashSet::new();
        let mut distinct = 0;
        for lane in 0..3 {
            let mut stream = KeyStream::new(0.3, 7, lane);
            let mut lane_keys = HashSet::new();
            for _ in 0..20_000 {
                let id = stream.next_id();
                lane_keys.insert(id);
                seen.insert(id);
            }
            assert_eq!(lane_keys.len() as u64, stream.distinct());
            assert!(
                (13_000..15_000).contains(&stream.distinct()),
                "{}",
                stream.distinct()
            );
            distinct += stream.distinct();
        }
        assert_eq!(seen.len() as u64, distinct, "lanes share no key");
    }
}
