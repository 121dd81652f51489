//! Sealed key runs: the dedup keys memory held when a memory budget was reached, written
//! once as an immutable file and found again through one filter per shard section.
//! `docs/format.md` ("Sealed key runs") gives the bytes.
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
use crate::base::{Error, Fingerprint, Result, Window};
use crate::io::{ReadAtFile, Storage};

/// Bytes of one entry: the key's 64-bit tag and its bucket, relative to the run's oldest.
const ENTRY_LEN: usize = 12;
/// Entries per data page; a page is read whole on a lookup.
pub(crate) const PAGE_ENTRIES: usize = 341;
const PAGE_LEN: usize = PAGE_ENTRIES * ENTRY_LEN;
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
    pub(crate) keys: u64,
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
    /// Whether this run holds the keys of run `run_id`, merged into it.
    pub(crate) fn replaces(&self, run_id: u64) -> bool {
        (self.replaces_from..self.run_id).contains(&run_id)
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

/// The name of run `run_id` in a store's directory.
pub(crate) fn run_path(dir: &Path, run_id: u64) -> PathBuf {
    dir.join(format!("run-{run_id:020}.keys"))
}

/// The name a run is written under before its rename.
fn temp_path(dir: &Path, run_id: u64) -> PathBuf {
    dir.join(format!("run-{run_id:020}.tmp"))
}

/// The id of a run file's name, or `None` for any other name.
pub(crate) fn parse_run_name(path: &Path) -> Option<u64> {
    let digits = path
        .file_name()?
        .to_str()?
        .strip_prefix("run-")?
        .strip_suffix(".keys")?;
    (digits.len() == 20 && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
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
            drop(self.read_section(storage, index)?);
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

    /// Section `index`'s entries as (tag, absolute bucket), read with one read and each
    /// page checked against its fence (checksum, first tag, tags strictly increasing).
    pub(crate) fn read_section(
        &self,
        storage: &dyn Storage,
        index: usize,
    ) -> Result<Vec<(u64, u64)>> {
        let Some(section) = self.sections.get(index) else {
            return Ok(Vec::new());
        };
        let mut bytes = vec![0; size(section.entries)? * ENTRY_LEN];
        self.read_at(storage, section.data_offset, &mut bytes)?;
        let mut entries = Vec::with_capacity(bytes.len() / ENTRY_LEN);
        for (page, &(first, checksum)) in bytes.chunks(PAGE_LEN).zip(section.fences.iter()) {
            let offset = section.data_offset + (entries.len() * ENTRY_LEN) as u64;
            let bad = |reason| corrupted(&self.path, offset, reason);
            if xxh3_64(page) != checksum {
                return Err(bad("a data page's checksum does not match"));
            }
            for (at, entry) in page.chunks_exact(ENTRY_LEN).enumerate() {
                let tag = get_u64(entry, 0).unwrap_or(0);
                let relative = get_u32(entry, 8).unwrap_or(0);
                let previous = entries.last().map(|&(previous, _)| previous);
                if (at == 0 && tag != first) || previous.is_some_and(|p| p >= tag) {
                    return Err(bad("a data page's tags are out of order"));
                }
                entries.push((tag, self.summary.oldest_bucket + u64::from(relative)));
            }
        }
        Ok(entries)
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
        let Some(page) = self.candidate_page(fingerprint) else {
            return Ok(false);
        };
        let mut buffer = [0; PAGE_LEN];
        let bytes = self.read_page(storage, page, &mut buffer)?;
        Ok(self.page_holds(bytes, fingerprint.tag(), window, current))
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
        let fingerprint = |index: u32| fingerprints.get(index as usize).copied();
        let mut candidates: Vec<(PageAt, u32)> = pending
            .iter()
            .filter_map(|&index| Some((self.candidate_page(fingerprint(index)?)?, index)))
            .collect();
        if candidates.is_empty() {
            return Ok(());
        }
        candidates.sort_unstable();
        let mut held = Vec::new();
        let mut buffer = [0; PAGE_LEN];
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

    /// The data page that may hold `fingerprint`, if its section's filter lets it
    /// through (no read yet).
    fn candidate_page(&self, fingerprint: Fingerprint) -> Option<PageAt> {
        let index = fingerprint.shard(self.summary.shard_bits);
        let section = self.sections.get(index)?;
        let tag = fingerprint.tag();
        if section.entries == 0 || !section.filter().contains(&tag) {
            return None;
        }
        let page = section
            .fences
            .partition_point(|&(first, _)| first <= tag)
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
        buffer: &'b mut [u8; PAGE_LEN],
    ) -> Result<&'b [u8]> {
        let missing = || corrupted(&self.path, 0, "a page lies outside its section");
        let section = self.sections.get(at.section as usize).ok_or_else(missing)?;
        let page = at.page as usize;
        let &(_, checksum) = section.fences.get(page).ok_or_else(missing)?;
        let first_entry = (page * PAGE_ENTRIES) as u64;
        let in_page = (section.entries - first_entry).min(PAGE_ENTRIES as u64);
        let len = usize::try_from(in_page).unwrap_or(PAGE_ENTRIES) * ENTRY_LEN;
        let offset = section.data_offset + first_entry * ENTRY_LEN as u64;
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

    /// Whether the checked page `bytes` holds `tag` stamped with a bucket live at
    /// `current` (a binary search over its entries, read in place).
    fn page_holds(&self, bytes: &[u8], tag: u64, window: Window, current: u64) -> bool {
        let count = bytes.len() / ENTRY_LEN;
        let tag_at = |i: usize| get_u64(bytes, i * ENTRY_LEN).unwrap_or(0);
        let (mut low, mut high) = (0, count);
        while low < high {
            let middle = low + (high - low) / 2;
            if tag_at(middle) < tag {
                low = middle + 1;
            } else {
                high = middle;
            }
        }
        low < count
            && tag_at(low) == tag
            && get_u32(bytes, low * ENTRY_LEN + 8).is_some_and(|relative| {
                window.is_live(self.summary.oldest_bucket + u64::from(relative), current)
            })
    }
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
    /// Starts run `summary.run_id` in `dir`; `summary.keys` and the bucket range are
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

    /// Adds the next shard's section: `entries` as (tag, bucket), sorted by tag, each tag
    /// once, every bucket within the summary's range.
    pub(crate) fn add_section(&mut self, entries: &[(u64, u64)]) -> Result<()> {
        let data_offset = self.written;
        let mut fences = Vec::with_capacity(entries.len().div_ceil(PAGE_ENTRIES));
        let mut page = Vec::with_capacity(PAGE_LEN);
        for chunk in entries.chunks(PAGE_ENTRIES) {
            page.clear();
            for &(tag, bucket) in chunk {
                let relative = bucket.saturating_sub(self.summary.oldest_bucket);
                page.extend_from_slice(&tag.to_le_bytes());
                page.extend_from_slice(&u32::try_from(relative).unwrap_or(u32::MAX).to_le_bytes());
            }
            fences.push((chunk.first().map_or(0, |e| e.0), xxh3_64(&page)));
            self.put(&page)?;
        }
        let (descriptor, fingerprints) = if entries.is_empty() {
            ([0; DESCRIPTOR_LEN], Box::default())
        } else {
            let filter = BinaryFuse8::try_from_iterator(entries.iter().map(|e| e.0))
                .map_err(|reason| corrupted(&self.dir, 0, reason))?;
            let mut descriptor = [0; DESCRIPTOR_LEN];
            filter.dma_copy_descriptor_to(&mut descriptor);
            (descriptor, filter.fingerprints)
        };
        self.summary.keys += entries.len() as u64;
        self.sections.push(Section {
            data_offset,
            entries: entries.len() as u64,
            fences: fences.into_boxed_slice(),
            descriptor,
            fingerprints,
        });
        Ok(())
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
        let path = run_path(&self.dir, self.summary.run_id);
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
        summary.keys,
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
    footer.extend_from_slice(&0u32.to_le_bytes());
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
    let (level, replaces_from) = if version == 1 {
        (0, run_id)
    } else {
        if get_u32(footer, 92) != Some(0) {
            return Err(bad("the run's footer has unknown flags"));
        }
        (get_u32(footer, 88).unwrap_or(0), field(96))
    };
    if replaces_from > run_id || (level == 0) != (replaces_from == run_id) {
        return Err(bad("the run's merged range does not match its level"));
    }
    let summary = RunSummary {
        shard_bits: get_u32(footer, 12).unwrap_or(0),
        database_id: field(16),
        run_id,
        keys: field(32),
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
    let mut keys = 0u64;
    for row in table
        .get(..rows_len)
        .unwrap_or_default()
        .chunks_exact(SECTION_ROW_LEN)
    {
        let section = open_section(storage, path, row, table_offset)?;
        keys += section.entries;
        sections.push(section);
    }
    if keys != summary.keys {
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
fn open_section(storage: &dyn Storage, path: &Path, row: &[u8], metas_end: u64) -> Result<Section> {
    let field = |at: usize| get_u64(row, at).unwrap_or(0);
    let (data_offset, entries, meta_offset, meta_len, checksum) =
        (field(0), field(8), field(16), field(24), field(32));
    let bad = |reason| corrupted(path, meta_offset, reason);
    let data_end = entries
        .checked_mul(ENTRY_LEN as u64)
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
    let pages = size(entries.div_ceil(PAGE_ENTRIES as u64))?;
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
    if fences
        .windows(2)
        .any(|pair| pair.first().map(|f| f.0) >= pair.get(1).map(|f| f.0))
    {
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
            keys: 0,
            oldest_bucket: 10,
            newest_bucket: 12,
            covers: LogPosition::default(),
            level: 0,
            replaces_from: 1,
        }
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
        assert_eq!(run.summary().keys, 2000);
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
