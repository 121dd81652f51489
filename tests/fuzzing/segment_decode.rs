//! Fuzz harness: the input damages one file of a small real database on a simulated disk
//! (a segment, the manifest, or a new segment file), then the database is opened. Opening
//! must return `Ok` or an `Err`, never panic or hang. A database that opens must answer
//! reads, take writes, and open again with those writes in it.
//!
//! Raw damage (replace, append, overwrite, truncate, flip, delete) mostly exercises the
//! header and frame checks. The frame edit mode rewrites a segment frame by frame with
//! valid checksums (layout as in `docs/format.md`), so that well-framed entries with odd
//! contents reach the entry decoder and the replay logic.
//!
//! Shared by the fuzz target `fuzz/fuzz_targets/segment_decode.rs` and the corpus replay
//! test `tests/durability/fuzz_corpus.rs`.

#![expect(
    clippy::cast_possible_truncation,
    reason = "test code: values are small and chosen by the test"
)]
#![expect(clippy::expect_used, reason = "test code: a panic is the test failing")]
#![expect(
    clippy::indexing_slicing,
    reason = "test code: a panic is the test failing"
)]
#![expect(clippy::unwrap_used, reason = "test code: a panic is the test failing")]

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, UNIX_EPOCH};

use oncedb::io::{MemStorage, Storage};
use oncedb::{Db, Durability, Error, ManualClock, Options, RecordStatus, Reservation, Scope};
use xxhash_rust::xxh3::{Xxh3, xxh3_64, xxh3_64_with_seed};

const DIR: &str = "/db";
const BUCKET_MS: u64 = 1_000;
const SPAN: u64 = 4;
/// First bucket of the baseline database.
const FIRST_BUCKET: u64 = 1_700_000_000;
/// The baseline's fixed secret, so that its files are the same bytes in every run.
const SECRET: u64 = 0x0dd5_eed5_0f0c_ce00;
const HEADER_LEN: usize = 48;
const FRAME_HEADER_LEN: usize = 20;
/// Keys and records the baseline holds, for reads after a successful open.
const BASE_KEYS: u32 = 170;
const BASE_RECORDS: u8 = 6;

fn clock_at(bucket: u64) -> ManualClock {
    ManualClock::new(UNIX_EPOCH + Duration::from_millis(bucket * BUCKET_MS + 250))
}

fn options(disk: &MemStorage, clock: &ManualClock) -> Options {
    Options::new(DIR)
        .window(Duration::from_millis(SPAN * BUCKET_MS))
        .bucket_width(Duration::from_millis(BUCKET_MS))
        .durability(Durability::Sync)
        .shards(2)
        .segment_max_bytes(4096)
        .clock(clock.clone())
        .storage(Arc::new(disk.clone()))
}

fn scope() -> Scope {
    Scope::new("tenant", "refund")
}

fn record_key(n: u8) -> [u8; 2] {
    [b'r', n]
}

fn request_of(n: u8) -> [u8; 3] {
    [b'q', n, n ^ 0x55]
}

/// The manifest as the database writes it (48 bytes, checksum last).
fn manifest(
    secret: u64,
    window_ms: u64,
    bucket_width_ms: u64,
    version: u32,
    flags: u32,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(48);
    out.extend_from_slice(b"ONCEMAN\0");
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&flags.to_le_bytes());
    out.extend_from_slice(&secret.to_le_bytes());
    out.extend_from_slice(&window_ms.to_le_bytes());
    out.extend_from_slice(&bucket_width_ms.to_le_bytes());
    let checksum = xxh3_64(&out);
    out.extend_from_slice(&checksum.to_le_bytes());
    out
}

fn segment_name(bucket: u64, seq: u32) -> PathBuf {
    Path::new(DIR).join(format!("seg-{bucket:020}-{seq:010}.log"))
}

/// The files of the baseline database, built once: a hand-written manifest with a fixed
/// secret and a manual clock make them identical in every run. Five files: the manifest
/// and segments in buckets 0, 1 (two, the first rolled over at 4 KiB) and 3, holding
/// single and batched keys and records completed, failed, in flight and released.
fn baseline() -> &'static [(PathBuf, Vec<u8>)] {
    static FILES: OnceLock<Vec<(PathBuf, Vec<u8>)>> = OnceLock::new();
    FILES.get_or_init(|| {
        let disk = MemStorage::new();
        disk.create_dir_all(Path::new(DIR)).unwrap();
        disk.set_contents(
            &Path::new(DIR).join("MANIFEST"),
            manifest(SECRET, SPAN * BUCKET_MS, BUCKET_MS, 1, 0),
        );
        let clock = clock_at(FIRST_BUCKET);
        let db = Db::open(options(&disk, &clock)).unwrap();
        let lease = |n: u8| match db
            .reserve(&scope(), &record_key(n), &request_of(n))
            .unwrap()
        {
            Reservation::Acquired(lease) => lease,
            other => panic!("baseline record {n}: {other:?}"),
        };
        for i in 0..20u32 {
            assert!(db.insert_if_absent(&i.to_le_bytes()).unwrap());
        }
        let batch: Vec<[u8; 4]> = (20..40u32).map(u32::to_le_bytes).collect();
        db.insert_many(&batch).unwrap();
        lease(0).complete(b"paid").unwrap();
        lease(1).fail(b"card declined").unwrap();
        drop(lease(2)); // stays in flight
        lease(3).release().unwrap();
        clock.forward(Duration::from_millis(BUCKET_MS));
        for i in 40..160u32 {
            assert!(db.insert_if_absent(&i.to_le_bytes()).unwrap());
        }
        lease(4).complete(b"").unwrap();
        clock.forward(Duration::from_millis(2 * BUCKET_MS));
        for i in 160..BASE_KEYS {
            assert!(db.insert_if_absent(&i.to_le_bytes()).unwrap());
        }
        lease(5).complete(&[0xab; 100]).unwrap();
        drop(db);
        let mut files: Vec<(PathBuf, Vec<u8>)> = disk
            .list(Path::new(DIR))
            .unwrap()
            .into_iter()
            .map(|path| {
                let bytes = disk.contents(&path).unwrap();
                (path, bytes)
            })
            .collect();
        files.sort();
        assert_eq!(
            files.len(),
            7,
            "{:?}",
            files.iter().map(|f| &f.0).collect::<Vec<_>>()
        );
        files
    })
}

/// Reads the input front to back; reads past the end give zeros / nothing.
struct Input<'a>(&'a [u8]);

impl<'a> Input<'a> {
    fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&first, rest)) => {
                self.0 = rest;
                first
            }
            None => 0,
        }
    }

    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.byte(), self.byte()])
    }

    fn u64(&mut self) -> u64 {
        let mut word = [0u8; 8];
        for byte in &mut word {
            *byte = self.byte();
        }
        u64::from_le_bytes(word)
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn take(&mut self, len: usize) -> &'a [u8] {
        let (head, rest) = self.0.split_at(len.min(self.0.len()));
        self.0 = rest;
        head
    }

    fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.0)
    }
}

/// What the second input byte does to the chosen file.
mod mode {
    pub const REPLACE: u8 = 0;
    pub const APPEND: u8 = 1;
    pub const OVERWRITE: u8 = 2;
    pub const TRUNCATE_APPEND: u8 = 3;
    pub const FRAMES: u8 = 4;
    pub const FLIP: u8 = 5;
    pub const DELETE: u8 = 6;
    pub const COUNT: u8 = 7;
}

/// A segment split into its header fields and frames; the bytes after the last whole
/// frame are kept as they are.
#[derive(Debug, Clone)]
struct Segment {
    magic: [u8; 8],
    version: u32,
    flags: u32,
    bucket: u64,
    seq: u32,
    reserved: u32,
    database_id: u64,
    frames: Vec<(u8, u8, Vec<u8>)>,
    tail: Vec<u8>,
}

fn get_u32(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap())
}

fn get_u64(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap())
}

impl Segment {
    fn parse(bytes: &[u8]) -> Option<Segment> {
        if bytes.len() < HEADER_LEN {
            return None;
        }
        let mut segment = Segment {
            magic: bytes[..8].try_into().unwrap(),
            version: get_u32(bytes, 8),
            flags: get_u32(bytes, 12),
            bucket: get_u64(bytes, 16),
            seq: get_u32(bytes, 24),
            reserved: get_u32(bytes, 28),
            database_id: get_u64(bytes, 32),
            frames: Vec::new(),
            tail: Vec::new(),
        };
        let mut at = HEADER_LEN;
        while bytes.len() - at >= FRAME_HEADER_LEN {
            let len = get_u32(bytes, at) as usize;
            if bytes.len() - at - FRAME_HEADER_LEN < len {
                break;
            }
            let payload = bytes[at + FRAME_HEADER_LEN..at + FRAME_HEADER_LEN + len].to_vec();
            segment.frames.push((bytes[at + 4], bytes[at + 5], payload));
            at += FRAME_HEADER_LEN + len;
        }
        segment.tail = bytes[at..].to_vec();
        Some(segment)
    }

    fn empty(bucket: u64, seq: u32) -> Segment {
        Segment {
            magic: *b"ONCESEG\0",
            version: 2,
            flags: 0,
            bucket,
            seq,
            reserved: 0,
            database_id: xxh3_64(&SECRET.to_le_bytes()),
            frames: Vec::new(),
            tail: Vec::new(),
        }
    }

    /// The bytes, with every checksum computed afresh.
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&self.magic);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&self.flags.to_le_bytes());
        out.extend_from_slice(&self.bucket.to_le_bytes());
        out.extend_from_slice(&self.seq.to_le_bytes());
        out.extend_from_slice(&self.reserved.to_le_bytes());
        out.extend_from_slice(&self.database_id.to_le_bytes());
        let checksum = xxh3_64(&out);
        out.extend_from_slice(&checksum.to_le_bytes());
        let seed = xxh3_64_with_seed(b"oncedb frame checksum", SECRET);
        for (kind, reserved, payload) in &self.frames {
            let position = out.len() as u32;
            let mut head = Vec::with_capacity(6);
            head.extend_from_slice(&(payload.len() as u32).to_le_bytes());
            head.push(*kind);
            head.push(*reserved);
            let mut check = Xxh3::with_seed(seed);
            check.update(&head);
            check.update(&position.to_le_bytes());
            let header_check = check.digest() as u16;
            head.extend_from_slice(&header_check.to_le_bytes());
            head.extend_from_slice(&position.to_le_bytes());
            let mut hasher = Xxh3::with_seed(seed);
            hasher.update(&head);
            hasher.update(payload);
            out.extend_from_slice(&head);
            out.extend_from_slice(&hasher.digest().to_le_bytes());
            out.extend_from_slice(payload);
        }
        out.extend_from_slice(&self.tail);
        out
    }
}

/// Values that tend to find edges in lengths, ids and times.
fn interesting_u64(input: &mut Input<'_>) -> u64 {
    match input.byte() % 12 {
        0 => 0,
        1 => 1,
        2 => u64::MAX,
        3 => u64::MAX - 1,
        4 => 1 << 63,
        5 => u64::from(u32::MAX),
        6 => u64::from(u32::MAX) + 1,
        7 => FIRST_BUCKET * BUCKET_MS,
        8 => (FIRST_BUCKET + 1_000_000) * BUCKET_MS,
        9 => u64::from(input.byte()),
        10 => FIRST_BUCKET + u64::from(input.byte() % 16),
        _ => input.u64(),
    }
}

/// Applies the frame edit script in `input` to `segment`.
fn edit_frames(segment: &mut Segment, input: &mut Input<'_>) {
    let files = baseline();
    // Each edit is at least one byte; a long script is cut short.
    for _ in 0..64 {
        if input.is_empty() {
            return;
        }
        let op = input.byte();
        let count = segment.frames.len();
        let pick = |input: &mut Input<'_>| usize::from(input.byte()) % count.max(1);
        match op % 12 {
            0 if count > 0 => {
                let frame = pick(input);
                let at = usize::from(input.u16());
                let value = input.byte();
                let payload = &mut segment.frames[frame].2;
                if !payload.is_empty() {
                    let at = at % payload.len();
                    payload[at] ^= value;
                }
            }
            1 if count > 0 => {
                let frame = pick(input);
                let at = usize::from(input.byte());
                let value = interesting_u64(input);
                let payload = &mut segment.frames[frame].2;
                if payload.len() >= 8 {
                    let at = at % (payload.len() - 7);
                    payload[at..at + 8].copy_from_slice(&value.to_le_bytes());
                }
            }
            2 if count > 0 => {
                let frame = pick(input);
                let at = usize::from(input.byte());
                let value = interesting_u64(input) as u32;
                let payload = &mut segment.frames[frame].2;
                if payload.len() >= 4 {
                    let at = at % (payload.len() - 3);
                    payload[at..at + 4].copy_from_slice(&value.to_le_bytes());
                }
            }
            3 if count > 0 => {
                let frame = pick(input);
                segment.frames.remove(frame);
            }
            4 if count > 0 => {
                let frame = pick(input);
                let to = usize::from(input.byte()) % (count + 1);
                let copy = segment.frames[frame].clone();
                segment.frames.insert(to, copy);
            }
            5 if count > 1 => {
                let (a, b) = (pick(input), pick(input));
                segment.frames.swap(a, b);
            }
            6 if count > 0 => {
                let frame = pick(input);
                let (kind, reserved) = (input.byte(), input.byte());
                segment.frames[frame].0 = kind % 8;
                segment.frames[frame].1 = if reserved < 0xf0 { 0 } else { reserved };
            }
            7 if count > 0 => {
                let frame = pick(input);
                let len = usize::from(input.u16());
                let extra = input.take(len.saturating_sub(segment.frames[frame].2.len()));
                let payload = &mut segment.frames[frame].2;
                payload.truncate(len);
                payload.extend_from_slice(extra);
            }
            8 => {
                let kind = input.byte() % 8;
                let len = usize::from(input.byte());
                let payload = input.take(len).to_vec();
                let at = usize::from(input.byte()) % (count + 1);
                segment.frames.insert(at, (kind, 0, payload));
            }
            9 => {
                // A frame of another file of the baseline.
                let (_, bytes) = &files[usize::from(input.byte()) % files.len()];
                if let Some(other) = Segment::parse(bytes).filter(|s| !s.frames.is_empty()) {
                    let frame =
                        other.frames[usize::from(input.byte()) % other.frames.len()].clone();
                    let at = usize::from(input.byte()) % (count + 1);
                    segment.frames.insert(at, frame);
                }
            }
            10 => match input.byte() % 7 {
                0 => segment.bucket = interesting_u64(input),
                1 => segment.seq = interesting_u64(input) as u32,
                2 => segment.database_id = interesting_u64(input),
                3 => segment.version = interesting_u64(input) as u32,
                4 => segment.flags = interesting_u64(input) as u32,
                5 => segment.reserved = interesting_u64(input) as u32,
                _ => segment.magic[usize::from(input.byte() % 8)] ^= input.byte(),
            },
            11 => {
                let len = usize::from(input.byte() % 64);
                segment.tail = input.take(len).to_vec();
            }
            _ => {}
        }
    }
}

/// The damaged disk an input describes.
struct Damaged {
    disk: MemStorage,
    /// The clock bucket to open at.
    open_bucket: u64,
    /// A segment with the last sequence number was added: a store that must start a new
    /// segment in its bucket refuses writes (it is poisoned rather than reuse a name).
    sequence_exhausted: bool,
}

/// Builds the damaged disk described by `input`.
fn damaged_disk(input: &mut Input<'_>) -> Damaged {
    let files = baseline();
    let disk = MemStorage::new();
    disk.create_dir_all(Path::new(DIR)).unwrap();
    for (path, bytes) in files {
        disk.set_contents(path, bytes.clone());
    }
    // The target: a baseline file, a new segment, or a file of another name.
    let target = usize::from(input.byte()) % (files.len() + 2);
    let mode = input.byte() % mode::COUNT;
    // Open at the baseline's last bucket or up to 7 buckets later (expiring old segments).
    let open_bucket = FIRST_BUCKET + 3 + u64::from(input.byte() % 8);
    let mut sequence_exhausted = false;
    let (path, original) = match files.get(target) {
        Some((path, bytes)) => (path.clone(), bytes.clone()),
        None if target == files.len() => {
            // A new segment starting with a valid header, mostly near the baseline's
            // buckets, sometimes at an edge of the name's range.
            let bucket = match input.byte() {
                pick @ 0..200 => FIRST_BUCKET + u64::from(pick % 12),
                pick => [
                    0,
                    FIRST_BUCKET - 1,
                    FIRST_BUCKET + (1 << 31),
                    FIRST_BUCKET + (1 << 32),
                    u64::MAX - 1,
                    u64::MAX,
                ][usize::from(pick) % 6],
            };
            let seq = match input.byte() {
                pick @ 0..200 => u32::from(pick % 4),
                pick => {
                    [999_998, 999_999, 1_000_000, u32::MAX - 1, u32::MAX][usize::from(pick) % 5]
                }
            };
            sequence_exhausted = seq == u32::MAX;
            (
                segment_name(bucket, seq),
                Segment::empty(bucket, seq).encode(),
            )
        }
        None => {
            let names = [
                "MANIFEST.tmp",
                "LOCK",
                "seg-00000000001700000003-0000000000.log.tmp",
                "seg-00000000001700000003-000000.log",
                "seg-1700000003-0.log",
                "seg-99999999999999999999-0000000000.log",
            ];
            let name = names[usize::from(input.byte()) % names.len()];
            (Path::new(DIR).join(name), Vec::new())
        }
    };
    let is_manifest = path.ends_with("MANIFEST");
    let damaged = match mode {
        mode::REPLACE => input.rest().to_vec(),
        mode::APPEND => [&original[..], input.rest()].concat(),
        mode::OVERWRITE => {
            let at = usize::from(input.u16()) % (original.len() + 1);
            let patch = input.rest();
            let mut bytes = original;
            let end = (at + patch.len()).min(bytes.len());
            bytes[at..end].copy_from_slice(&patch[..end - at]);
            bytes.extend_from_slice(&patch[end - at..]);
            bytes
        }
        mode::TRUNCATE_APPEND => {
            let cut = usize::from(input.u16()) % (original.len() + 1);
            [&original[..cut], input.rest()].concat()
        }
        mode::FRAMES if is_manifest => {
            let secret = if input.byte().is_multiple_of(2) {
                SECRET
            } else {
                interesting_u64(input)
            };
            let window = if input.byte().is_multiple_of(2) {
                SPAN * BUCKET_MS
            } else {
                interesting_u64(input)
            };
            let width = if input.byte().is_multiple_of(2) {
                BUCKET_MS
            } else {
                interesting_u64(input)
            };
            let version = if input.byte().is_multiple_of(2) {
                1
            } else {
                interesting_u64(input) as u32
            };
            let flags = if input.byte().is_multiple_of(2) {
                0
            } else {
                interesting_u64(input) as u32
            };
            manifest(secret, window, width, version, flags)
        }
        mode::FRAMES => match Segment::parse(&original) {
            Some(mut segment) => {
                edit_frames(&mut segment, input);
                segment.encode()
            }
            None => original,
        },
        mode::FLIP => {
            let mut bytes = original;
            while !input.is_empty() && !bytes.is_empty() {
                let at = usize::from(input.u16()) % bytes.len();
                bytes[at] ^= input.byte().max(1);
            }
            bytes
        }
        _ => {
            if target < files.len() {
                disk.remove(&path).unwrap();
            }
            original
        }
    };
    if mode != mode::DELETE {
        disk.set_contents(&path, damaged);
    }
    Damaged {
        disk,
        open_bucket,
        sequence_exhausted,
    }
}

/// The value of a write, or `None` if it was refused with an I/O error (or as poisoned
/// by one) where `may_fail` allows that. Any other error is a failure.
fn write<T>(result: oncedb::Result<T>, may_fail: bool) -> Option<T> {
    match result {
        Ok(value) => Some(value),
        Err(Error::Io(_) | Error::Poisoned) if may_fail => None,
        Err(other) => panic!("write refused: {other}"),
    }
}

/// Reads everything the baseline held and exercises every call on a database that opened
/// from damaged files: any answer is fine, a panic is not.
fn exercise(db: &Db, writes_may_fail: bool) {
    let _ = db.stats();
    for i in (0..BASE_KEYS).step_by(7) {
        db.contains(&i.to_le_bytes()).unwrap();
    }
    for n in 0..BASE_RECORDS {
        let record = match db.get(&scope(), &record_key(n)) {
            Ok(record) => record,
            Err(Error::FingerprintCollision) => None,
            Err(other) => panic!("get after open: {other}"),
        };
        if let Some(record) = record {
            let _ = (record.created_at(), record.finished_at(), record.response());
            if record.status() != RecordStatus::InFlight {
                assert!(record.response().is_some());
            }
        }
        // Damage may leave a record under another key's fingerprint: refused, not mixed.
        let reservation = match db.reserve(&scope(), &record_key(n), &request_of(n)) {
            Err(Error::FingerprintCollision) => continue,
            result => write(result, writes_may_fail),
        };
        match reservation {
            None => {}
            Some(Reservation::Acquired(lease)) => {
                write(
                    lease.complete(b"again").map_err(Error::from),
                    writes_may_fail,
                );
            }
            Some(Reservation::InFlight { since, .. }) => {
                let _ = since.duration_since(UNIX_EPOCH);
            }
            Some(Reservation::Completed(record) | Reservation::Failed(record)) => {
                let _ = (record.created_at(), record.finished_at());
                assert!(record.response().is_some());
            }
            Some(Reservation::Expired(_)) => panic!("no response retention: nothing ages out"),
            Some(Reservation::Mismatch) => {}
        }
    }
}

/// Runs one input.
pub fn run(data: &[u8]) {
    let mut input = Input(data);
    let Damaged {
        disk,
        open_bucket,
        sequence_exhausted: may_fail,
    } = damaged_disk(&mut input);
    let clock = clock_at(open_bucket);
    let Ok(db) = Db::open(options(&disk, &clock)) else {
        return;
    };
    exercise(&db, may_fail);
    // The database takes writes and keeps them across a clean reopen.
    let fresh = scope();
    let written = (|| {
        assert!(write(db.insert_if_absent(b"written after open"), may_fail)?);
        match write(db.reserve(&fresh, b"fresh record", b"request"), may_fail)? {
            Reservation::Acquired(lease) => {
                write(lease.complete(b"stored").map_err(Error::from), may_fail)?
            }
            other => panic!("a never used record key must be acquired, got {other:?}"),
        }
        write(db.flush(), may_fail)
    })()
    .is_some();
    drop(db);
    let db = Db::open(options(&disk, &clock))
        .unwrap_or_else(|err| panic!("a database that opened must open again: {err}"));
    if written {
        assert!(
            db.contains(b"written after open").unwrap(),
            "acknowledged key lost"
        );
        let record = db
            .get(&fresh, b"fresh record")
            .unwrap()
            .expect("acknowledged record lost");
        assert_eq!(record.response(), Some(&b"stored"[..]));
    }
    exercise(&db, may_fail);
}

/// Inputs for the seed corpus: every target file and mode, with small edits.
#[allow(
    dead_code,
    reason = "used to write the seed corpus, not by the fuzz target"
)]
pub fn seeds() -> Vec<(String, Vec<u8>)> {
    let files = baseline().len() as u8;
    let names = ["manifest", "seg-b0", "seg-b1-0", "seg-b1-1", "seg-b3"];
    let mut seeds = Vec::new();
    for (target, name) in names.iter().enumerate() {
        let target = target as u8;
        seeds.push((format!("{name}-untouched"), vec![target, mode::APPEND, 0]));
        seeds.push((
            format!("{name}-replaced"),
            vec![target, mode::REPLACE, 0, b'x', b'y'],
        ));
        seeds.push((
            format!("{name}-garbage-appended"),
            vec![target, mode::APPEND, 0, 0xde, 0xad, 0xbe, 0xef],
        ));
        seeds.push((
            format!("{name}-truncated-mid"),
            vec![target, mode::TRUNCATE_APPEND, 0, 100, 0],
        ));
        seeds.push((
            format!("{name}-overwritten"),
            vec![target, mode::OVERWRITE, 1, 60, 0, 0xff, 0xff],
        ));
        seeds.push((
            format!("{name}-flipped"),
            vec![target, mode::FLIP, 2, 20, 0, 0x10, 70, 0, 0x01],
        ));
        seeds.push((format!("{name}-deleted"), vec![target, mode::DELETE, 0]));
    }
    // Frame edits with valid checksums.
    let frames = |name: &str, target: u8, open: u8, script: &[u8]| {
        let mut input = vec![target, mode::FRAMES, open];
        input.extend_from_slice(script);
        (format!("frames-{name}"), input)
    };
    // Frame numbers of the first segment: 0..20 single keys, 20 a batch, 21 reserve of
    // record 0, 22 its completion, 23/24 record 1 failed, 25 record 2 in flight, 26/27
    // record 3 released. A reserve payload holds the lease id at 16 and created_ms at 40.
    seeds.extend([
        frames("reframed-unchanged", 1, 0, &[]),
        // A logged lease id of u64::MAX once overflowed the id counter at open.
        frames("regression-lease-id-max", 1, 0, &[1, 21, 16, 2]),
        frames("lease-id-max-minus-one", 1, 0, &[1, 21, 16, 3]),
        frames("created-ms-max", 1, 0, &[1, 21, 40, 2]),
        frames("in-flight-created-ms-max", 1, 0, &[1, 25, 40, 2]),
        frames("finish-at-ms-max", 1, 0, &[1, 22, 24, 2]),
        frames("keys-count-large", 2, 0, &[2, 0, 0, 5]),
        frames("response-len-large", 1, 0, &[2, 22, 32, 5]),
        frames("drop-first-frame", 2, 0, &[3, 0]),
        frames("duplicate-reserve", 1, 0, &[4, 21, 0]),
        frames("finish-before-reserve", 1, 0, &[5, 21, 22]),
        frames("kind-changed", 1, 0, &[6, 0, 2, 0]),
        frames("payload-cut", 1, 0, &[7, 21, 10, 0]),
        frames("bad-entry-in-newest", 4, 0, &[8, 3, 4, 1, 2, 3, 4, 0]),
        frames("reserve-copied-later", 4, 0, &[9, 1, 21, 0]),
        frames("scoped-key-changed", 4, 0, &[9, 1, 21, 0, 0, 0, 60, 0, 1]),
        frames("header-bucket", 2, 0, &[10, 0, 10, 3]),
        frames("header-version", 2, 0, &[10, 3, 1]),
        frames("torn-tail", 4, 0, &[11, 5, 1, 2, 3, 4, 5]),
        frames("manifest-window", 0, 0, &[0, 1, 0, 0, 0, 0]),
        frames("manifest-secret", 0, 0, &[1, 0, 0, 0, 0, 0]),
        frames("manifest-version", 0, 0, &[0, 0, 0, 1, 1, 0]),
        frames("new-segment-future", files, 0, &[9, 0, 9, 1, 21, 0]),
        frames("new-segment-gap", files, 0, &[6, 1, 9, 1, 22, 0]),
        frames("open-late", 2, 7, &[]),
    ]);
    seeds.push((
        "new-segment-empty".into(),
        vec![files, mode::APPEND, 3, 11, 0],
    ));
    seeds.push((
        "new-segment-garbage".into(),
        vec![files, mode::APPEND, 0, 5, 1, 1, 2, 3],
    ));
    // Sequence numbers picked by 200 + n: 999_998, 999_999, 1_000_000, u32::MAX - 1,
    // u32::MAX. Six-digit names ended at 999_999: the next segment's name was not read
    // back, losing what was written into it.
    for (name, pick) in [
        ("regression-segment-seq-999999", 201),
        ("new-segment-seq-near-max", 203),
        ("new-segment-seq-exhausted", 204),
    ] {
        seeds.push((name.into(), vec![files, mode::APPEND, 0, 3, pick]));
    }
    seeds.push((
        "new-segment-bucket-max".into(),
        vec![files, mode::APPEND, 0, 205, 0],
    ));
    seeds.push((
        "new-segment-bucket-wrap".into(),
        vec![files, mode::APPEND, 0, 203, 0],
    ));
    seeds.push((
        "stale-manifest-temp".into(),
        vec![files + 1, mode::APPEND, 0, 0, 1, 2],
    ));
    seeds.push((
        "odd-file-name".into(),
        vec![files + 1, mode::APPEND, 0, 4, 1, 2],
    ));
    seeds
}
