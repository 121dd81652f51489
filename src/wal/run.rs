//! Sealed runs: the dedup keys (a key run) or the settled idempotency records (a record
//! run) memory held when a memory budget was reached, written once as an immutable file
//! and found again through one filter per shard section. Both kinds share the container
//! (sections, fences, filters, footer) and differ in their entries. `docs/format.md`
//! ("Sealed runs") gives the bytes.
//!
//! A run is written under a temporary name, fsynced, renamed into place and the directory
//! fsynced before the memory it replaces is released; it is never rewritten, only
//! removed (or archived) whole once its newest bucket leaves the window. Opening a run
//! reads its footer, section table, fences and filters (checked against their checksums),
//! never its data pages: a lookup reads one page, checked against the checksum its fence
//! holds.

use std::path::{Path, PathBuf};

use xorf::{BinaryFuse8, BinaryFuse8Ref, DmaSerializable, Filter, FilterRef};
use xxhash_rust::xxh3::xxh3_64;

use super::format::{get_u32, get_u64};
use crate::base::{Error, Fingerprint, LogSpan, RecordStatus, Result, SettledRecord, Window};
use crate::io::{ReadAtFile, Storage};

/// Bytes of one key entry: the key's 64-bit tag and its bucket, relative to the run's
/// oldest.
const KEY_ENTRY_LEN: usize = 12;
/// Bytes of one record entry (`encode_record`).
const RECORD_ENTRY_LEN: usize = 108;
/// The most bytes a data page holds: a page is read whole on a lookup.
const MAX_PAGE_LEN: usize = 4096;
/// A fence per page: the page's first tag and the XXH3-64 of its bytes.
const FENCE_LEN: usize = 16;
/// The binary fuse descriptor: seed u64, segment length, mask, segment count length.
const DESCRIPTOR_LEN: usize = 20;
/// A section table row: data offset, entries, meta offset, meta length, meta checksum.
const SECTION_ROW_LEN: usize = 40;
/// The footer of version 2, which every run is written with.
pub(crate) const FOOTER_LEN: usize = 112;
/// The footer of version 1 (no level, no merged range), still read.
const FOOTER_V1_LEN: usize = 96;
const MAGIC: [u8; 8] = *b"oncerun\x02";
const MAGIC_V1: [u8; 8] = *b"oncerun\x01";
const VERSION: u32 = 2;
/// Most shard sections a run may have (as many as the store has shards).
const MAX_SECTIONS: u64 = 1 << 16;
/// The footer flag of a record run (a key run has none).
const RECORDS_FLAG: u32 = 1;

/// What a run holds: its entries' layout, its file name's extension and its footer flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RunKind {
    /// Dedup keys: 12-byte entries, each tag once.
    Keys,
    /// Settled idempotency records: 108-byte entries, each fingerprint once.
    Records,
}

impl RunKind {
    const fn entry_len(self) -> usize {
        match self {
            RunKind::Keys => KEY_ENTRY_LEN,
            RunKind::Records => RECORD_ENTRY_LEN,
        }
    }

    /// Entries per data page: as many as fit in [`MAX_PAGE_LEN`] bytes.
    const fn page_entries(self) -> usize {
        MAX_PAGE_LEN / self.entry_len()
    }

    const fn page_len(self) -> usize {
        self.page_entries() * self.entry_len()
    }

    fn extension(self) -> &'static str {
        match self {
            RunKind::Keys => "keys",
            RunKind::Records => "records",
        }
    }
}

/// A position in a store's log: a segment (its bucket and sequence number, as in its file
/// name) and a byte offset in it. Positions order as the log does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct LogPosition {
    /// The segment's bucket.
    pub bucket: u64,
    /// The segment's sequence number within its bucket.
    pub seq: u32,
    /// The byte offset in the segment.
    pub offset: u32,
}

/// What a run's footer says of the whole run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RunSummary {
    pub(crate) database_id: u64,
    pub(crate) run_id: u64,
    pub(crate) shard_bits: u32,
    /// What the run holds.
    pub(crate) kind: RunKind,
    /// Its entries: keys or records.
    pub(crate) entries: u64,
    pub(crate) oldest_bucket: u64,
    pub(crate) newest_bucket: u64,
    /// Every dedup key logged before this position is in this run (or expired): replay
    /// skips the keys entries before it.
    pub(crate) covers: LogPosition,
    /// 0 for a run sealed from memory; one more than its inputs' for a merged run.
    pub(crate) level: u32,
    /// The lowest run id whose keys this run holds: a merged run replaces every run with
    /// an id in `replaces_from..run_id` (for a sealed run, `replaces_from == run_id`).
    pub(crate) replaces_from: u64,
}

impl RunSummary {
    /// Whether this run holds the entries of run `other`, merged into it (runs of one
    /// kind only: key runs and record runs take ids from one sequence).
    pub(crate) fn replaces(&self, other: &RunSummary) -> bool {
        self.kind == other.kind && (self.replaces_from..self.run_id).contains(&other.run_id)
    }
}

/// One shard's keys in a run, as memory keeps them.
#[derive(Debug)]
struct Section {
    data_offset: u64,
    entries: u64,
    /// (first tag, page checksum) per page.
    fences: Box<[(u64, u64)]>,
    descriptor: [u8; DESCRIPTOR_LEN],
    fingerprints: Box<[u8]>,
}

impl Section {
    fn filter(&self) -> BinaryFuse8Ref<'_> {
        BinaryFuse8Ref::from_dma(&self.descriptor, &self.fingerprints)
    }

    fn heap_bytes(&self) -> usize {
        self.fences.len() * FENCE_LEN + self.fingerprints.len()
    }
}

/// An open run: its summary, and per shard its fences and filter.
#[derive(Debug)]
pub(crate) struct Run {
    path: PathBuf,
    summary: RunSummary,
    sections: Box<[Section]>,
    pages: PageReader,
}

/// Where a run's pages are read from: its file kept open since the run was opened or
/// written (one open for every read), or, where the storage has no such handle, its path
/// at each read.
struct PageReader(Option<Box<dyn ReadAtFile>>);

impl std::fmt::Debug for PageReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "open" } else { "by path" })
    }
}

/// The name of run `run_id` of `kind` in a store's directory. Key runs and record runs
/// take their ids from one sequence: an id names one run.
pub(crate) fn run_path(dir: &Path, run_id: u64, kind: RunKind) -> PathBuf {
    dir.join(format!("run-{run_id:020}.{}", kind.extension()))
}

/// The name a run is written under before its rename.
fn temp_path(dir: &Path, run_id: u64) -> PathBuf {
    dir.join(format!("run-{run_id:020}.tmp"))
}

/// The id and kind of a run file's name, or `None` for any other name.
pub(crate) fn parse_run_name(path: &Path) -> Option<(u64, RunKind)> {
    let name = path.file_name()?.to_str()?.strip_prefix("run-")?;
    let (digits, kind) = [RunKind::Keys, RunKind::Records]
        .into_iter()
        .find_map(|kind| {
            Some((
                name.strip_suffix(kind.extension())?.strip_suffix('.')?,
                kind,
            ))
        })?;
    (digits.len() == 20 && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| Some((digits.parse().ok()?, kind)))
        .flatten()
}

/// Whether `path` is a run left half-written by a crash (removed at open).
pub(crate) fn is_temp_run_name(path: &Path) -> bool {
    path.file_name()
        .and_then(|name| name.to_str())
        .is_some_and(|name| name.starts_with("run-") && name.ends_with(".tmp"))
}

impl Run {
    pub(crate) fn summary(&self) -> &RunSummary {
        &self.summary
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes of memory the run's fences and filters take.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.sections.iter().map(Section::heap_bytes).sum()
    }

    /// Reads every data page and checks it against its fence: its checksum, its first
    /// tag, and tags strictly increasing through the section. For `verify`.
    pub(crate) fn check_pages(&self, storage: &dyn Storage) -> Result<()> {
        for index in 0..self.sections.len() {
            match self.summary.kind {
                RunKind::Keys => drop(self.read_section(storage, index)?),
                RunKind::Records => drop(self.read_records(storage, index)?),
            }
        }
        Ok(())
    }

    /// The shards this run has a section for.
    pub(crate) fn section_count(&self) -> usize {
        self.sections.len()
    }

    /// The entries of section `index` (0 past the last one).
    pub(crate) fn section_entries(&self, index: usize) -> u64 {
        self.sections
            .get(index)
            .map_or(0, |section| section.entries)
    }

    /// Reads section `index` with one read and hands each data page to `each`, with its
    /// file offset and its fence's first key, after checking it against its checksum.
    fn read_pages(
        &self,
        storage: &dyn Storage,
        index: usize,
        mut each: impl FnMut(&[u8], u64, u64) -> Result<()>,
    ) -> Result<()> {
        let Some(section) = self.sections.get(index) else {
            return Ok(());
        };
        let kind = self.summary.kind;
        let mut bytes = vec![0; size(section.entries)? * kind.entry_len()];
        self.read_at(storage, section.data_offset, &mut bytes)?;
        let mut offset = section.data_offset;
        for (page, &(first, checksum)) in bytes.chunks(kind.page_len()).zip(section.fences.iter()) {
            if xxh3_64(page) != checksum {
                return Err(corrupted(
                    &self.path,
                    offset,
                    "a data page's checksum does not match",
                ));
            }
            each(page, offset, first)?;
            offset += page.len() as u64;
        }
        Ok(())
    }

    /// Key section `index`'s entries as (tag, absolute bucket), read with one read and
    /// each page checked against its fence (checksum, first tag, tags strictly increasing
    /// through the section).
    pub(crate) fn read_section(
        &self,
        storage: &dyn Storage,
        index: usize,
    ) -> Result<Vec<(u64, u64)>> {
        debug_assert_eq!(self.summary.kind, RunKind::Keys);
        let mut entries: Vec<(u64, u64)> = Vec::new();
        self.read_pages(storage, index, |page, offset, first| {
            for (at, entry) in page.chunks_exact(KEY_ENTRY_LEN).enumerate() {
                let tag = get_u64(entry, 0).unwrap_or(0);
                let relative = get_u32(entry, 8).unwrap_or(0);
                let previous = entries.last().map(|&(previous, _)| previous);
                if (at == 0 && tag != first) || previous.is_some_and(|p| p >= tag) {
                    return Err(corrupted(
                        &self.path,
                        offset,
                        "a data page's tags are out of order",
                    ));
                }
                entries.push((tag, self.summary.oldest_bucket + u64::from(relative)));
            }
            Ok(())
        })?;
        Ok(entries)
    }

    /// Record section `index`'s records with their fingerprints, read with one read and
    /// each page checked against its fence (checksum, first fingerprint's high half,
    /// fingerprints strictly increasing through the section, every entry well formed).
    pub(crate) fn read_records(
        &self,
        storage: &dyn Storage,
        index: usize,
    ) -> Result<Vec<(u128, SettledRecord)>> {
        debug_assert_eq!(self.summary.kind, RunKind::Records);
        let mut records: Vec<(u128, SettledRecord)> = Vec::new();
        self.read_pages(storage, index, |page, offset, first| {
            for (at, entry) in page.chunks_exact(RECORD_ENTRY_LEN).enumerate() {
                let bad = |reason| corrupted(&self.path, offset, reason);
                let decoded = decode_record(entry)
                    .filter(|(_, record)| self.holds_bucket(record.bucket))
                    .ok_or_else(|| bad("a record entry is malformed"))?;
                let previous = records.last().map(|&(previous, _)| previous);
                if (at == 0 && high_half(decoded.0) != first)
                    || previous.is_some_and(|p| p >= decoded.0)
                {
                    return Err(bad("a data page's fingerprints are out of order"));
                }
                records.push(decoded);
            }
            Ok(())
        })?;
        Ok(records)
    }

    /// Whether the run holds `fingerprint` stamped with a bucket live at `current`. A
    /// filter miss costs no read; a hit or a false positive costs one page read.
    pub(crate) fn contains(
        &self,
        storage: &dyn Storage,
        fingerprint: Fingerprint,
        window: Window,
        current: u64,
    ) -> Result<bool> {
        if !window.is_live(self.summary.newest_bucket, current) {
            return Ok(false);
        }
        let Some(page) = self.candidate_page(
            fingerprint.shard(self.summary.shard_bits),
            fingerprint.tag(),
        ) else {
            return Ok(false);
        };
        let mut buffer = [0; MAX_PAGE_LEN];
        let bytes = self.read_page(storage, page, &mut buffer)?;
        Ok(self.page_holds(bytes, fingerprint.tag(), window, current))
    }

    /// The record of `fingerprint` the run holds, if its bucket is live at `current`. A
    /// filter miss costs no read; a hit costs one page read (two in the rare case of
    /// fingerprints sharing their high half across a page boundary).
    pub(crate) fn find_record(
        &self,
        storage: &dyn Storage,
        fingerprint: Fingerprint,
        window: Window,
        current: u64,
    ) -> Result<Option<SettledRecord>> {
        if !window.is_live(self.summary.newest_bucket, current) {
            return Ok(None);
        }
        let high = high_half(fingerprint.0);
        let Some(mut at) = self.candidate_page(fingerprint.shard(self.summary.shard_bits), high)
        else {
            return Ok(None);
        };
        let mut buffer = [0; MAX_PAGE_LEN];
        loop {
            let bytes = self.read_page(storage, at, &mut buffer)?;
            if let Some(record) = self.page_record(bytes, fingerprint.0)? {
                return Ok(window.is_live(record.bucket, current).then_some(record));
            }
            // Records sharing the high half may begin on an earlier page.
            let first = self
                .sections
                .get(at.section as usize)
                .and_then(|section| section.fences.get(at.page as usize).map(|fence| fence.0));
            match at.page.checked_sub(1) {
                Some(page) if first == Some(high) => at.page = page,
                _ => return Ok(None),
            }
        }
    }

    /// Of the keys `fingerprints[i]` for `i` in `pending`, removes those the run holds
    /// stamped with a bucket live at `current`. One pass probes every key's filter; then
    /// each data page some key may be in is read once, in file order, however many of
    /// the keys point into it.
    pub(crate) fn retain_absent(
        &self,
        storage: &dyn Storage,
        (fingerprints, pending): (&[Fingerprint], &mut Vec<u32>),
        window: Window,
        current: u64,
    ) -> Result<()> {
        if !window.is_live(self.summary.newest_bucket, current) {
            return Ok(());
        }
        let shard_bits = self.summary.shard_bits;
        let fingerprint = |index: u32| fingerprints.get(index as usize).copied();
        let mut candidates: Vec<(PageAt, u32)> = pending
            .iter()
            .filter_map(|&index| {
                let fingerprint = fingerprint(index)?;
                let page = self.candidate_page(fingerprint.shard(shard_bits), fingerprint.tag())?;
                Some((page, index))
            })
            .collect();
        if candidates.is_empty() {
            return Ok(());
        }
        candidates.sort_unstable();
        let mut held = Vec::new();
        let mut buffer = [0; MAX_PAGE_LEN];
        for same_page in candidates.chunk_by(|a, b| a.0 == b.0) {
            let Some(&(page, _)) = same_page.first() else {
                continue;
            };
            let bytes = self.read_page(storage, page, &mut buffer)?;
            held.extend(same_page.iter().filter_map(|&(_, index)| {
                let tag = fingerprint(index)?.tag();
                self.page_holds(bytes, tag, window, current)
                    .then_some(index)
            }));
        }
        if !held.is_empty() {
            held.sort_unstable();
            pending.retain(|index| held.binary_search(index).is_err());
        }
        Ok(())
    }

    /// The last data page of section `index` whose first key is at most `key` (a key's
    /// tag, a record's high half), if the section's filter lets `key` through (no read
    /// yet).
    fn candidate_page(&self, index: usize, key: u64) -> Option<PageAt> {
        let section = self.sections.get(index)?;
        if section.entries == 0 || !section.filter().contains(&key) {
            return None;
        }
        let page = section
            .fences
            .partition_point(|&(first, _)| first <= key)
            .checked_sub(1)?;
        Some(PageAt {
            section: u32::try_from(index).ok()?,
            page: u32::try_from(page).ok()?,
        })
    }

    /// Reads data page `at` into `buffer` with one read and checks it against its fence.
    fn read_page<'b>(
        &self,
        storage: &dyn Storage,
        at: PageAt,
        buffer: &'b mut [u8; MAX_PAGE_LEN],
    ) -> Result<&'b [u8]> {
        let kind = self.summary.kind;
        let missing = || corrupted(&self.path, 0, "a page lies outside its section");
        let section = self.sections.get(at.section as usize).ok_or_else(missing)?;
        let page = at.page as usize;
        let &(_, checksum) = section.fences.get(page).ok_or_else(missing)?;
        let first_entry = (page * kind.page_entries()) as u64;
        let in_page = (section.entries - first_entry).min(kind.page_entries() as u64);
        let len = usize::try_from(in_page).unwrap_or(kind.page_entries()) * kind.entry_len();
        let offset = section.data_offset + first_entry * kind.entry_len() as u64;
        let bytes = buffer.get_mut(..len).unwrap_or_default();
        self.read_at(storage, offset, bytes)?;
        if xxh3_64(bytes) != checksum {
            return Err(corrupted(
                &self.path,
                offset,
                "a data page's checksum does not match",
            ));
        }
        Ok(bytes)
    }

    /// Fills `buf` from `offset` of the run's file: one positioned read.
    fn read_at(&self, storage: &dyn Storage, offset: u64, buf: &mut [u8]) -> Result<()> {
        match &self.pages.0 {
            Some(file) => file.read_at(offset, buf)?,
            None => storage.read_at(&self.path, offset, buf)?,
        }
        Ok(())
    }

    /// Whether the checked key page `bytes` holds `tag` stamped with a bucket live at
    /// `current` (a binary search over its entries, read in place).
    fn page_holds(&self, bytes: &[u8], tag: u64, window: Window, current: u64) -> bool {
        let count = bytes.len() / KEY_ENTRY_LEN;
        let tag_at = |i: usize| get_u64(bytes, i * KEY_ENTRY_LEN).unwrap_or(0);
        let low = partition(count, |i| tag_at(i) < tag);
        low < count
            && tag_at(low) == tag
            && get_u32(bytes, low * KEY_ENTRY_LEN + 8).is_some_and(|relative| {
                window.is_live(self.summary.oldest_bucket + u64::from(relative), current)
            })
    }

    /// The record of `fingerprint` in the checked record page `bytes` (a binary search
    /// over its entries, read in place); a malformed entry found is `Corrupted`.
    fn page_record(&self, bytes: &[u8], fingerprint: u128) -> Result<Option<SettledRecord>> {
        let count = bytes.len() / RECORD_ENTRY_LEN;
        let entry = |i: usize| bytes.get(i * RECORD_ENTRY_LEN..(i + 1) * RECORD_ENTRY_LEN);
        let fingerprint_at = |i: usize| entry(i).map_or(0, entry_fingerprint);
        let at = partition(count, |i| fingerprint_at(i) < fingerprint);
        if at >= count || fingerprint_at(at) != fingerprint {
            return Ok(None);
        }
        let (_, record) = entry(at)
            .and_then(decode_record)
            .filter(|(_, record)| self.holds_bucket(record.bucket))
            .ok_or_else(|| corrupted(&self.path, 0, "a record entry is malformed"))?;
        Ok(Some(record))
    }

    /// Whether `bucket` lies in the run's bucket range, as every entry's must.
    fn holds_bucket(&self, bucket: u64) -> bool {
        (self.summary.oldest_bucket..=self.summary.newest_bucket).contains(&bucket)
    }
}

/// The first of `0..count` for which `below` is false (`below` true on a prefix).
fn partition(count: usize, below: impl Fn(usize) -> bool) -> usize {
    let (mut low, mut high) = (0, count);
    while low < high {
        let middle = low + (high - low) / 2;
        if below(middle) {
            low = middle + 1;
        } else {
            high = middle;
        }
    }
    low
}

/// A fingerprint's high 64 bits: a record run's fence and filter key.
fn high_half(fingerprint: u128) -> u64 {
    (fingerprint >> 64) as u64
}

/// A record entry's fingerprint: its high half, then its low half.
fn entry_fingerprint(entry: &[u8]) -> u128 {
    let half = |at| u128::from(get_u64(entry, at).unwrap_or(0));
    (half(0) << 64) | half(8)
}

fn put_span(out: &mut Vec<u8>, span: LogSpan) {
    out.extend_from_slice(&span.bucket.to_le_bytes());
    out.extend_from_slice(&span.seq.to_le_bytes());
    out.extend_from_slice(&span.start.to_le_bytes());
    out.extend_from_slice(&span.len.to_le_bytes());
}

fn get_span(entry: &[u8], at: usize) -> Option<LogSpan> {
    Some(LogSpan {
        bucket: get_u64(entry, at)?,
        seq: get_u32(entry, at + 8)?,
        start: get_u32(entry, at + 12)?,
        len: get_u32(entry, at + 16)?,
    })
}

/// Appends the 108-byte entry of `record` of `fingerprint` (`docs/format.md`).
#[expect(
    clippy::cast_possible_truncation,
    reason = "the request hash's halves are taken on purpose"
)]
fn encode_record(fingerprint: u128, record: &SettledRecord, out: &mut Vec<u8>) {
    out.extend_from_slice(&high_half(fingerprint).to_le_bytes());
    out.extend_from_slice(&(fingerprint as u64).to_le_bytes());
    out.extend_from_slice(&record.request_hash.to_le_bytes());
    for value in [
        record.created_ms,
        record.finished_ms,
        record.lease_id,
        record.bucket,
    ] {
        out.extend_from_slice(&value.to_le_bytes());
    }
    put_span(out, record.key);
    put_span(out, record.response);
    let status: u32 = match record.status {
        RecordStatus::Failed => 2,
        RecordStatus::Completed | RecordStatus::InFlight => 1,
    };
    out.extend_from_slice(&status.to_le_bytes());
}

/// A record entry, or `None` if its status is neither completed (1) nor failed (2).
fn decode_record(entry: &[u8]) -> Option<(u128, SettledRecord)> {
    let status = match get_u32(entry, 104)? {
        1 => RecordStatus::Completed,
        2 => RecordStatus::Failed,
        _ => return None,
    };
    let request_hash = u128::from(get_u64(entry, 16)?) | (u128::from(get_u64(entry, 24)?) << 64);
    let record = SettledRecord {
        request_hash,
        created_ms: get_u64(entry, 32)?,
        finished_ms: get_u64(entry, 40)?,
        lease_id: get_u64(entry, 48)?,
        bucket: get_u64(entry, 56)?,
        key: get_span(entry, 64)?,
        response: get_span(entry, 84)?,
        status,
    };
    Some((entry_fingerprint(entry), record))
}

/// One data page of a run: its section and its index there. Orders as the file does
/// (sections are written in index order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct PageAt {
    section: u32,
    page: u32,
}

/// A length read from a run, as a buffer size (within the file, so it fits).
fn size(len: u64) -> Result<usize> {
    usize::try_from(len).map_err(|_| Error::Io(std::io::ErrorKind::OutOfMemory.into()))
}

fn corrupted(path: &Path, offset: u64, reason: &str) -> Error {
    Error::Corrupted {
        path: path.to_path_buf(),
        offset,
        reason: reason.to_owned(),
    }
}

/// Writes a run, one section at a time, under its temporary name.
pub(crate) struct RunWriter<'a> {
    storage: &'a dyn Storage,
    dir: PathBuf,
    summary: RunSummary,
    file: Box<dyn crate::io::StorageFile>,
    written: u64,
    buffer: Vec<u8>,
    sections: Vec<Section>,
}

/// Appends are gathered up to this many bytes.
const WRITE_CHUNK: usize = 1 << 20;

impl<'a> RunWriter<'a> {
    /// Starts run `summary.run_id` in `dir`; `summary.entries` and the bucket range are
    /// filled in as sections are added.
    pub(crate) fn create(
        storage: &'a dyn Storage,
        dir: &Path,
        summary: RunSummary,
    ) -> Result<RunWriter<'a>> {
        let file = storage.open_append(&temp_path(dir, summary.run_id), true)?;
        Ok(RunWriter {
            storage,
            dir: dir.to_path_buf(),
            summary,
            file,
            written: 0,
            buffer: Vec::with_capacity(WRITE_CHUNK),
            sections: Vec::new(),
        })
    }

    fn put(&mut self, bytes: &[u8]) -> Result<()> {
        self.buffer.extend_from_slice(bytes);
        self.written += bytes.len() as u64;
        if self.buffer.len() >= WRITE_CHUNK {
            self.file.append(&self.buffer)?;
            self.buffer.clear();
        }
        Ok(())
    }

    /// Adds the next shard's section of a key run: `entries` as (tag, bucket), sorted by
    /// tag, each tag once, every bucket within the summary's range.
    pub(crate) fn add_section(&mut self, entries: &[(u64, u64)]) -> Result<()> {
        debug_assert_eq!(self.summary.kind, RunKind::Keys);
        let oldest = self.summary.oldest_bucket;
        self.add_entries(
            entries,
            |&(tag, _)| tag,
            |&(tag, bucket), page| {
                let relative = bucket.saturating_sub(oldest);
                page.extend_from_slice(&tag.to_le_bytes());
                page.extend_from_slice(&u32::try_from(relative).unwrap_or(u32::MAX).to_le_bytes());
            },
        )
    }

    /// Adds the next shard's section of a record run: `records` with their fingerprints,
    /// sorted by fingerprint, each once, every bucket within the summary's range.
    pub(crate) fn add_records(&mut self, records: &[(u128, SettledRecord)]) -> Result<()> {
        debug_assert_eq!(self.summary.kind, RunKind::Records);
        self.add_entries(
            records,
            |&(fingerprint, _)| high_half(fingerprint),
            |(fingerprint, record), page| encode_record(*fingerprint, record, page),
        )
    }

    /// Writes `entries` as the next section: pages of the kind's size, a fence per page
    /// (its first entry's `key` and its checksum), and a filter of the keys.
    fn add_entries<E>(
        &mut self,
        entries: &[E],
        key: impl Fn(&E) -> u64,
        encode: impl Fn(&E, &mut Vec<u8>),
    ) -> Result<()> {
        let kind = self.summary.kind;
        let data_offset = self.written;
        let mut fences = Vec::with_capacity(entries.len().div_ceil(kind.page_entries()));
        let mut page = Vec::with_capacity(kind.page_len());
        for chunk in entries.chunks(kind.page_entries()) {
            page.clear();
            for entry in chunk {
                encode(entry, &mut page);
            }
            fences.push((chunk.first().map_or(0, &key), xxh3_64(&page)));
            self.put(&page)?;
        }
        let (descriptor, fingerprints) = if entries.is_empty() {
            ([0; DESCRIPTOR_LEN], Box::default())
        } else {
            let mut keys: Vec<u64> = entries.iter().map(&key).collect();
            // Records may share a high half: the filter takes each key once.
            keys.dedup();
            let filter = BinaryFuse8::try_from_iterator(keys.into_iter())
                .map_err(|reason| corrupted(&self.dir, 0, reason))?;
            let mut descriptor = [0; DESCRIPTOR_LEN];
            filter.dma_copy_descriptor_to(&mut descriptor);
            (descriptor, filter.fingerprints)
        };
        self.summary.entries += entries.len() as u64;
        self.sections.push(Section {
            data_offset,
            entries: entries.len() as u64,
            fences: fences.into_boxed_slice(),
            descriptor,
            fingerprints,
        });
        Ok(())
    }

    /// Sets the bucket range and the cover of a run whose entries are absolute (a record
    /// run), once its sections are written.
    pub(crate) fn set_range(
        &mut self,
        oldest_bucket: u64,
        newest_bucket: u64,
        covers: LogPosition,
    ) {
        debug_assert_eq!(self.summary.kind, RunKind::Records);
        self.summary.oldest_bucket = oldest_bucket;
        self.summary.newest_bucket = newest_bucket;
        self.summary.covers = covers;
    }

    /// Gives the run up: its temporary file is removed (a crash before leaves it to the
    /// next open, which removes every temporary run).
    pub(crate) fn abandon(self) -> Result<()> {
        drop(self.file);
        self.storage
            .remove(&temp_path(&self.dir, self.summary.run_id))?;
        Ok(())
    }

    /// Writes the metas, the section table and the footer, fsyncs, renames the run into
    /// place and fsyncs the directory: only then may memory let go of its keys.
    pub(crate) fn finish(mut self) -> Result<Run> {
        let mut rows = Vec::with_capacity(self.sections.len() * SECTION_ROW_LEN + 8);
        let sections = std::mem::take(&mut self.sections);
        for section in &sections {
            let meta = section_meta(section);
            rows.extend_from_slice(&section.data_offset.to_le_bytes());
            rows.extend_from_slice(&section.entries.to_le_bytes());
            rows.extend_from_slice(&self.written.to_le_bytes());
            rows.extend_from_slice(&(meta.len() as u64).to_le_bytes());
            rows.extend_from_slice(&xxh3_64(&meta).to_le_bytes());
            self.put(&meta)?;
        }
        let table_offset = self.written;
        rows.extend_from_slice(&xxh3_64(&rows).to_le_bytes());
        self.put(&rows)?;
        let footer = encode_footer(&self.summary, table_offset, sections.len() as u64);
        self.put(&footer)?;
        self.file.append(&self.buffer)?;
        self.file.sync()?;
        let path = run_path(&self.dir, self.summary.run_id, self.summary.kind);
        self.storage
            .rename(&temp_path(&self.dir, self.summary.run_id), &path)?;
        self.storage.sync_dir(&self.dir)?;
        Ok(Run {
            pages: PageReader(self.storage.open_read(&path)?),
            path,
            summary: self.summary,
            sections: sections.into_boxed_slice(),
        })
    }
}

/// A section's fences, filter descriptor and fingerprints, as stored.
fn section_meta(section: &Section) -> Vec<u8> {
    let mut meta = Vec::with_capacity(section.heap_bytes() + DESCRIPTOR_LEN);
    for &(first, checksum) in &section.fences {
        meta.extend_from_slice(&first.to_le_bytes());
        meta.extend_from_slice(&checksum.to_le_bytes());
    }
    if section.entries > 0 {
        meta.extend_from_slice(&section.descriptor);
        meta.extend_from_slice(&section.fingerprints);
    }
    meta
}

fn encode_footer(summary: &RunSummary, table_offset: u64, sections: u64) -> Vec<u8> {
    let mut footer = Vec::with_capacity(FOOTER_LEN);
    footer.extend_from_slice(&MAGIC);
    footer.extend_from_slice(&VERSION.to_le_bytes());
    footer.extend_from_slice(&summary.shard_bits.to_le_bytes());
    for value in [
        summary.database_id,
        summary.run_id,
        summary.entries,
        summary.oldest_bucket,
        summary.newest_bucket,
        summary.covers.bucket,
    ] {
        footer.extend_from_slice(&value.to_le_bytes());
    }
    footer.extend_from_slice(&summary.covers.seq.to_le_bytes());
    footer.extend_from_slice(&summary.covers.offset.to_le_bytes());
    footer.extend_from_slice(&table_offset.to_le_bytes());
    footer.extend_from_slice(&sections.to_le_bytes());
    footer.extend_from_slice(&summary.level.to_le_bytes());
    let flags = match summary.kind {
        RunKind::Keys => 0,
        RunKind::Records => RECORDS_FLAG,
    };
    footer.extend_from_slice(&flags.to_le_bytes());
    footer.extend_from_slice(&summary.replaces_from.to_le_bytes());
    let checksum = xxh3_64(&footer);
    footer.extend_from_slice(&checksum.to_le_bytes());
    debug_assert_eq!(footer.len(), FOOTER_LEN);
    footer
}

/// The footer at the end of `tail` (the file's last [`FOOTER_LEN`] bytes, or all of a
/// shorter file), of either version, checked; also returns its length.
fn decode_footer(path: &Path, tail: &[u8]) -> Result<(RunSummary, u64, u64, usize)> {
    let bad = |reason| corrupted(path, 0, reason);
    let v1 = tail
        .len()
        .checked_sub(FOOTER_V1_LEN)
        .and_then(|at| tail.get(at..))
        .filter(|footer| footer.get(..8) == Some(&MAGIC_V1[..]));
    let (footer, version) = match v1 {
        Some(footer) => (footer, 1),
        None if tail.len() == FOOTER_LEN => (tail, VERSION),
        None => return Err(bad("the run is shorter than its footer")),
    };
    let len = footer.len();
    let body = footer.get(..len - 8).unwrap_or_default();
    if get_u64(footer, len - 8) != Some(xxh3_64(body)) {
        return Err(bad("the run's footer checksum does not match"));
    }
    if version == VERSION && footer.get(..8) != Some(&MAGIC[..]) {
        return Err(bad("not a run file (bad magic)"));
    }
    if get_u32(footer, 8) != Some(version) {
        return Err(bad("unknown run format version"));
    }
    let field = |at: usize| get_u64(footer, at).unwrap_or(0);
    let run_id = field(24);
    let (level, replaces_from, kind) = if version == 1 {
        (0, run_id, RunKind::Keys)
    } else {
        let kind = match get_u32(footer, 92) {
            Some(0) => RunKind::Keys,
            Some(RECORDS_FLAG) => RunKind::Records,
            _ => return Err(bad("the run's footer has unknown flags")),
        };
        (get_u32(footer, 88).unwrap_or(0), field(96), kind)
    };
    if replaces_from > run_id || (level == 0) != (replaces_from == run_id) {
        return Err(bad("the run's merged range does not match its level"));
    }
    let summary = RunSummary {
        shard_bits: get_u32(footer, 12).unwrap_or(0),
        database_id: field(16),
        run_id,
        kind,
        entries: field(32),
        oldest_bucket: field(40),
        newest_bucket: field(48),
        covers: LogPosition {
            bucket: field(56),
            seq: get_u32(footer, 64).unwrap_or(0),
            offset: get_u32(footer, 68).unwrap_or(0),
        },
        level,
        replaces_from,
    };
    Ok((summary, field(72), field(80), len))
}

/// The log position the run at `path` covers, read from its footer alone (checked).
#[cfg(feature = "replicate")]
pub(crate) fn read_cover(storage: &dyn Storage, path: &Path) -> Result<LogPosition> {
    let len = storage.file_len(path)?;
    let tail_at = len.saturating_sub(FOOTER_LEN as u64);
    let mut tail = vec![0; size(len - tail_at)?];
    storage.read_at(path, tail_at, &mut tail)?;
    decode_footer(path, &tail).map(|(summary, ..)| summary.covers)
}

/// Opens the run at `path` of the store `database_id`, reading its footer, section table,
/// fences and filters only.
pub(crate) fn open(storage: &dyn Storage, path: &Path, database_id: u64) -> Result<Run> {
    let bad = |offset, reason| corrupted(path, offset, reason);
    let len = storage.file_len(path)?;
    let tail_at = len.saturating_sub(FOOTER_LEN as u64);
    let mut tail = vec![0; size(len - tail_at)?];
    storage.read_at(path, tail_at, &mut tail)?;
    let (summary, table_offset, count, footer_len) = decode_footer(path, &tail)?;
    let footer_at = len - footer_len as u64;
    if summary.database_id != database_id {
        return Err(bad(footer_at, "the run belongs to another store"));
    }
    if parse_run_name(path).is_some_and(|(_, named)| named != summary.kind) {
        return Err(bad(footer_at, "the run's kind does not match its name"));
    }
    if summary.shard_bits > MAX_SECTIONS.trailing_zeros() || count != 1u64 << summary.shard_bits {
        return Err(bad(
            footer_at,
            "the run's section count does not match its shards",
        ));
    }
    if summary.oldest_bucket > summary.newest_bucket {
        return Err(bad(footer_at, "the run's bucket range is inverted"));
    }
    // An entry's bucket is `oldest_bucket` plus a 32-bit offset: it must not overflow.
    if summary.oldest_bucket > u64::MAX - u64::from(u32::MAX) {
        return Err(bad(footer_at, "the run's buckets are out of range"));
    }
    if summary.covers.bucket > summary.newest_bucket {
        return Err(bad(
            footer_at,
            "the run covers a log position past its newest bucket",
        ));
    }
    let table_len = count * SECTION_ROW_LEN as u64 + 8;
    if table_offset.checked_add(table_len) != Some(footer_at) {
        return Err(bad(footer_at, "the run's section table is misplaced"));
    }
    let mut table = vec![0; size(table_len)?];
    storage.read_at(path, table_offset, &mut table)?;
    let rows_len = table.len() - 8;
    if get_u64(&table, rows_len) != table.get(..rows_len).map(xxh3_64) {
        return Err(bad(
            table_offset,
            "the run's section table checksum does not match",
        ));
    }
    let mut sections = Vec::with_capacity(size(count)?);
    let mut entries = 0u64;
    for row in table
        .get(..rows_len)
        .unwrap_or_default()
        .chunks_exact(SECTION_ROW_LEN)
    {
        let section = open_section(storage, path, (row, summary.kind), table_offset)?;
        entries += section.entries;
        sections.push(section);
    }
    if entries != summary.entries {
        return Err(bad(
            footer_at,
            "the run's key count does not match its sections",
        ));
    }
    Ok(Run {
        pages: PageReader(storage.open_read(path)?),
        path: path.to_path_buf(),
        summary,
        sections: sections.into_boxed_slice(),
    })
}

/// One section from its table row: its data must end before the metas (at or before
/// `metas_end`), its meta must verify and describe exactly its pages and a sound filter.
fn open_section(
    storage: &dyn Storage,
    path: &Path,
    (row, kind): (&[u8], RunKind),
    metas_end: u64,
) -> Result<Section> {
    let field = |at: usize| get_u64(row, at).unwrap_or(0);
    let (data_offset, entries, meta_offset, meta_len, checksum) =
        (field(0), field(8), field(16), field(24), field(32));
    let bad = |reason| corrupted(path, meta_offset, reason);
    let data_end = entries
        .checked_mul(kind.entry_len() as u64)
        .and_then(|len| len.checked_add(data_offset));
    if data_end.is_none_or(|end| end > metas_end) {
        return Err(bad("a section's data runs past the run's data"));
    }
    if meta_offset
        .checked_add(meta_len)
        .is_none_or(|end| end > metas_end)
    {
        return Err(bad("a section's meta runs past the section table"));
    }
    let pages = size(entries.div_ceil(kind.page_entries() as u64))?;
    let fences_len = pages * FENCE_LEN;
    // A binary fuse filter takes at most about 1.3 bytes a key (far fewer for many
    // keys); anything longer is not a meta this build wrote.
    let most = fences_len as u64 + DESCRIPTOR_LEN as u64 + 4 * entries + 4096;
    if meta_len > most {
        return Err(bad("a section's meta is longer than its entries allow"));
    }
    let mut meta = vec![0; size(meta_len)?];
    storage.read_at(path, meta_offset, &mut meta)?;
    if xxh3_64(&meta) != checksum {
        return Err(bad("a section's fences or filter checksum does not match"));
    }
    if (entries == 0) != (meta_len == 0)
        || (entries > 0 && meta.len() < fences_len + DESCRIPTOR_LEN)
    {
        return Err(bad("a section's meta does not match its entries"));
    }
    let fences: Box<[(u64, u64)]> = meta
        .get(..fences_len)
        .unwrap_or_default()
        .chunks_exact(FENCE_LEN)
        .map(|fence| {
            (
                get_u64(fence, 0).unwrap_or(0),
                get_u64(fence, 8).unwrap_or(0),
            )
        })
        .collect();
    if fences.windows(2).any(|pair| {
        let (earlier, later) = (pair.first().map(|f| f.0), pair.get(1).map(|f| f.0));
        // Records sharing a high half may span pages: their fences may repeat it.
        earlier > later || (kind == RunKind::Keys && earlier == later)
    }) {
        return Err(bad("a section's fences are not in order"));
    }
    let mut descriptor = [0; DESCRIPTOR_LEN];
    let fingerprints: Box<[u8]> = if entries > 0 {
        descriptor.copy_from_slice(
            meta.get(fences_len..fences_len + DESCRIPTOR_LEN)
                .unwrap_or(&[0; DESCRIPTOR_LEN]),
        );
        meta.get(fences_len + DESCRIPTOR_LEN..)
            .unwrap_or_default()
            .into()
    } else {
        Box::default()
    };
    if entries > 0 && !sound_filter(&descriptor, fingerprints.len()) {
        return Err(bad("a section's filter does not fit its fingerprints"));
    }
    Ok(Section {
        data_offset,
        entries,
        fences,
        descriptor,
        fingerprints,
    })
}

/// Whether a binary fuse descriptor only ever indexes within `len` fingerprints: the
/// segment length a power of two, its mask one less, and the three segments a key maps
/// to (the last starting below the segment count length) inside the array.
fn sound_filter(descriptor: &[u8; DESCRIPTOR_LEN], len: usize) -> bool {
    let segment_length = get_u32(descriptor, 8).unwrap_or(0);
    let mask = get_u32(descriptor, 12).unwrap_or(0);
    let count_length = u64::from(get_u32(descriptor, 16).unwrap_or(0));
    segment_length.is_power_of_two()
        && mask == segment_length - 1
        && count_length % u64::from(segment_length) == 0
        && count_length + 2 * u64::from(segment_length) <= len as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::MemStorage;

    fn summary() -> RunSummary {
        RunSummary {
            database_id: 7,
            run_id: 1,
            shard_bits: 1,
            kind: RunKind::Keys,
            entries: 0,
            oldest_bucket: 10,
            newest_bucket: 12,
            covers: LogPosition::default(),
            level: 0,
            replaces_from: 1,
        }
    }

    fn settled(bucket: u64, n: u64) -> SettledRecord {
        let span = |at: u32| LogSpan {
            bucket,
            seq: 1,
            start: at,
            len: 64,
        };
        SettledRecord {
            request_hash: u128::from(n) << 70 | 5,
            bucket,
            created_ms: bucket * 1_000 + n % 1_000,
            lease_id: n + 1,
            status: if n.is_multiple_of(3) {
                RecordStatus::Failed
            } else {
                RecordStatus::Completed
            },
            finished_ms: bucket * 1_000 + 999,
            response: span(u32::try_from(n).unwrap() * 200 + 100),
            key: span(u32::try_from(n).unwrap() * 200),
        }
    }

    /// A record run in shard 0 of two: 300 records whose fingerprints share their high
    /// half in runs of 50 (so that one high half spans page boundaries), in buckets 10
    /// to 12.
    fn record_run(disk: &MemStorage) -> (Run, Vec<(u128, SettledRecord)>) {
        disk.create_dir_all(Path::new("/db")).unwrap();
        let summary = RunSummary {
            kind: RunKind::Records,
            ..summary()
        };
        let mut writer = RunWriter::create(disk, Path::new("/db"), summary).unwrap();
        let records: Vec<(u128, SettledRecord)> = (0..300u64)
            .map(|n| {
                let fingerprint = (u128::from(n / 50 + 1) << 64) | u128::from(n % 50);
                (fingerprint, settled(10 + n % 3, n))
            })
            .collect();
        writer.add_records(&records).unwrap();
        writer.add_records(&[]).unwrap();
        let written = writer.finish().unwrap();
        assert_eq!(
            written.path(),
            Path::new("/db/run-00000000000000000001.records")
        );
        (open(disk, written.path(), 7).unwrap(), records)
    }

    #[test]
    fn a_record_run_finds_its_records_and_only_live_ones() {
        let disk = MemStorage::new();
        let (run, records) = record_run(&disk);
        assert_eq!(
            (run.summary().kind, run.summary().entries),
            (RunKind::Records, 300)
        );
        let window = Window::new(4, 1);
        for (fingerprint, record) in &records {
            let found = run
                .find_record(&disk, Fingerprint(*fingerprint), window, 12)
                .unwrap();
            assert_eq!(found.as_ref(), Some(record));
        }
        // The same low half with another high half, and a high half not in the run.
        for fingerprint in [(7u128 << 64) | 3, (2u128 << 64) | 50, 3] {
            assert_eq!(
                run.find_record(&disk, Fingerprint(fingerprint), window, 12)
                    .unwrap(),
                None
            );
        }
        // Bucket 10 leaves the window at 15.
        let (fingerprint, record) = records[0];
        assert_eq!(record.bucket, 10);
        assert_eq!(
            run.find_record(&disk, Fingerprint(fingerprint), window, 15)
                .unwrap(),
            None
        );
        assert_eq!(run.read_records(&disk, 0).unwrap(), records);
        run.check_pages(&disk).unwrap();
    }

    #[test]
    fn a_damaged_record_page_is_corruption_never_another_record() {
        let disk = MemStorage::new();
        let (run, records) = record_run(&disk);
        let mut bytes = disk.contents(run.path()).unwrap();
        // A byte of the fortieth entry: the second page.
        bytes[40 * RECORD_ENTRY_LEN + 20] ^= 1;
        disk.set_contents(run.path(), bytes);
        let window = Window::new(4, 1);
        let (fingerprint, _) = records[40];
        assert!(matches!(
            run.find_record(&disk, Fingerprint(fingerprint), window, 12),
            Err(Error::Corrupted { .. })
        ));
        assert!(matches!(
            run.check_pages(&disk),
            Err(Error::Corrupted { .. })
        ));
        // A record run renamed as a key run is refused.
        let renamed = Path::new("/db/run-00000000000000000001.keys");
        disk.set_contents(renamed, disk.contents(run.path()).unwrap());
        assert!(matches!(
            open(&disk, renamed, 7),
            Err(Error::Corrupted { .. })
        ));
    }

    fn fingerprint_in(shard: u64, tag: u64) -> Fingerprint {
        Fingerprint((u128::from(tag) << 64) | u128::from(shard << 63))
    }

    #[test]
    fn a_run_finds_its_keys_and_only_live_ones() {
        let disk = MemStorage::new();
        disk.create_dir_all(Path::new("/db")).unwrap();
        let mut writer = RunWriter::create(&disk, Path::new("/db"), summary()).unwrap();
        let first: Vec<(u64, u64)> = (1..=2000u64).map(|t| (t * 3, 10 + t % 3)).collect();
        writer.add_section(&first).unwrap();
        writer.add_section(&[]).unwrap();
        let written = writer.finish().unwrap();
        let run = open(&disk, written.path(), 7).unwrap();
        assert_eq!(run.summary().entries, 2000);
        let window = Window::new(4, 1);
        for &(tag, _) in &first {
            assert!(
                run.contains(&disk, fingerprint_in(0, tag), window, 12)
                    .unwrap()
            );
            assert!(
                !run.contains(&disk, fingerprint_in(1, tag), window, 12)
                    .unwrap()
            );
        }
        for tag in [1u64, 2, 4, 6_001, 7_000] {
            assert!(
                !run.contains(&disk, fingerprint_in(0, tag), window, 12)
                    .unwrap()
            );
        }
        // Bucket 10 leaves the window at 15: its keys are gone, bucket 11's are not.
        assert!(
            !run.contains(&disk, fingerprint_in(0, 9), window, 15)
                .unwrap()
        );
        assert!(
            run.contains(&disk, fingerprint_in(0, 3), window, 15)
                .unwrap()
        );
        assert!(
            open(&disk, written.path(), 8).is_err(),
            "another store's run"
        );
    }

    /// On a real file system a run reads its pages through the file it opened once, not
    /// by path (an open and a close for every page read): moved away after it was
    /// written and after it was opened, it still answers every lookup.
    #[test]
    fn a_run_reads_its_pages_through_the_file_it_opened() {
        let dir = tempfile::tempdir().unwrap();
        let storage = crate::io::StdStorage;
        let mut writer = RunWriter::create(&storage, dir.path(), summary()).unwrap();
        let keys: Vec<(u64, u64)> = (1..=2000u64).map(|t| (t * 3, 11)).collect();
        writer.add_section(&keys).unwrap();
        writer.add_section(&[]).unwrap();
        let written = writer.finish().unwrap();
        let opened = open(&storage, written.path(), 7).unwrap();
        std::fs::rename(written.path(), dir.path().join("moved")).unwrap();
        let window = Window::new(4, 1);
        for run in [&written, &opened] {
            for &(tag, _) in keys.iter().step_by(97) {
                assert!(
                    run.contains(&storage, fingerprint_in(0, tag), window, 12)
                        .unwrap()
                );
            }
            assert_eq!(run.read_section(&storage, 0).unwrap().len(), 2000);
        }
    }

    /// A run written with the version 1 footer (96 bytes: no level, no merged range)
    /// opens as a sealed run of level 0 and finds its keys.
    #[test]
    fn a_version_1_run_still_opens() {
        let disk = MemStorage::new();
        disk.create_dir_all(Path::new("/db")).unwrap();
        let mut writer = RunWriter::create(&disk, Path::new("/db"), summary()).unwrap();
        let entries: Vec<(u64, u64)> = (1..=500u64).map(|t| (t * 5, 11)).collect();
        writer.add_section(&entries).unwrap();
        writer.add_section(&[]).unwrap();
        let path = writer.finish().unwrap().path().to_path_buf();
        let mut bytes = disk.contents(&path).unwrap();
        let footer = bytes.split_off(bytes.len() - FOOTER_LEN);
        let mut v1 = MAGIC_V1.to_vec();
        v1.extend_from_slice(&1u32.to_le_bytes());
        v1.extend_from_slice(footer.get(12..88).unwrap());
        let checksum = xxh3_64(&v1);
        v1.extend_from_slice(&checksum.to_le_bytes());
        assert_eq!(v1.len(), FOOTER_V1_LEN);
        bytes.extend_from_slice(&v1);
        disk.set_contents(&path, bytes);
        let run = open(&disk, &path, 7).unwrap();
        assert_eq!((run.summary().level, run.summary().replaces_from), (0, 1));
        let window = Window::new(4, 1);
        assert!(
            run.contains(&disk, fingerprint_in(0, 2_500), window, 12)
                .unwrap()
        );
        assert!(
            !run.contains(&disk, fingerprint_in(0, 2_501), window, 12)
                .unwrap()
        );
    }
}
