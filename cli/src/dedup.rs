//! `oncedb dedup`: a persistent `uniq` for event streams. Lines on stdin whose key has
//! not been seen inside the window go to stdout, in input order; the store in `--dir`
//! remembers keys across runs.

use crate::output::Failure;
use std::borrow::Cow;
use std::io::{BufRead, BufReader, BufWriter, IsTerminal, Read, Write};
use std::path::PathBuf;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use oncedb::{
    Db, Durability, MAX_BATCH_KEYS, MAX_KEY_BYTES_LIMIT, Options, ReplicaMode, Replication,
};

use crate::duration;

/// Arguments of `oncedb dedup`.
#[derive(clap::Args, Debug)]
pub struct DedupArgs {
    /// The store's directory (created if missing).
    #[arg(long)]
    dir: PathBuf,
    /// How long a key is remembered: 90s, 15m, 24h, 7d.
    #[arg(long, value_parser = duration::parse)]
    window: Duration,
    /// Width of one time bucket (the window must be a whole multiple of it). Default:
    /// the window divided into up to 96 buckets.
    #[arg(long, value_parser = duration::parse)]
    bucket: Option<Duration>,
    /// What identifies a line: `line` (the whole line), `json:FIELD.PATH` (a field of a
    /// JSON object; numbers in the path index arrays) or `regex:PATTERN` (the first
    /// capture group, or the whole match).
    #[arg(long, default_value = "line", value_parser = KeySpec::parse)]
    key: KeySpec,
    /// `sync`, `buffered` or `interval:MS`. Default `interval:200`, or `sync` with
    /// `--replica-mode sync`.
    #[arg(long, value_parser = parse_durability)]
    durability: Option<Durability>,
    /// Replicate the store's log to NATS JetStream at this URL (several separated by
    /// commas), so that `oncedb restore` rebuilds the store on another node.
    #[arg(long, requires = "replica")]
    replicate: Option<String>,
    /// The replica's name (with `--replicate`): ASCII letters, digits, `-` and `_`.
    #[arg(long, requires = "replicate")]
    replica: Option<String>,
    /// `sync`: a line passes once JetStream acknowledged its key; `async`: the log is
    /// shipped behind the local commit.
    #[arg(long, default_value = "sync", value_parser = crate::restore::parse_mode)]
    replica_mode: ReplicaMode,
    /// How many copies JetStream keeps of the replica's stream (1 to 5): with 3, the
    /// window outlives the loss of a node with its disk. A cluster needs at least as
    /// many nodes; a single server takes `--replica-copies 1`.
    #[arg(long, default_value_t = oncedb::DEFAULT_REPLICAS, value_parser = parse_copies)]
    replica_copies: usize,
    /// Drop lines whose key cannot be extracted instead of passing them through.
    #[arg(long)]
    drop_keyless: bool,
    /// Most lines checked in one call.
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..=MAX_BATCH_KEYS as i64))]
    batch: u32,
}

/// How a line's key is found.
#[derive(Debug, Clone)]
pub enum KeySpec {
    Line,
    Json(Vec<String>),
    Regex(regex::bytes::Regex),
}

impl KeySpec {
    fn parse(text: &str) -> Result<KeySpec, String> {
        if text == "line" {
            return Ok(KeySpec::Line);
        }
        if let Some(path) = text.strip_prefix("json:") {
            if path.is_empty() || path.split('.').any(str::is_empty) {
                return Err(format!("`{path}` is not a field path like `event.id`"));
            }
            return Ok(KeySpec::Json(path.split('.').map(str::to_owned).collect()));
        }
        if let Some(pattern) = text.strip_prefix("regex:") {
            return regex::bytes::Regex::new(pattern)
                .map(KeySpec::Regex)
                .map_err(|err| format!("bad pattern: {}", err.to_string().replace('\n', " ")));
        }
        Err(format!(
            "`{text}` is not a key: use `line`, `json:FIELD.PATH` or `regex:PATTERN`"
        ))
    }

    /// The key of `line`, or `None` if it has none.
    fn extract<'a>(&self, line: &'a [u8]) -> Option<Cow<'a, [u8]>> {
        let key: Cow<'a, [u8]> = match self {
            KeySpec::Line => Cow::Borrowed(line),
            KeySpec::Json(path) => {
                let value: serde_json::Value = serde_json::from_slice(line).ok()?;
                let mut at = &value;
                for segment in path {
                    at = match at {
                        serde_json::Value::Object(map) => map.get(segment)?,
                        serde_json::Value::Array(items) => {
                            items.get(segment.parse::<usize>().ok()?)?
                        }
                        _ => return None,
                    };
                }
                match at {
                    serde_json::Value::Null => return None,
                    serde_json::Value::String(text) => Cow::Owned(text.as_bytes().to_vec()),
                    other => Cow::Owned(other.to_string().into_bytes()),
                }
            }
            KeySpec::Regex(regex) => {
                let captures = regex.captures(line)?;
                let found = captures.get(1).or_else(|| captures.get(0))?;
                Cow::Borrowed(found.as_bytes())
            }
        };
        if key.is_empty() {
            // An empty line is a line like any other (`awk '!seen[$0]++'` prints the first
            // one only). No line holds a newline, so "\n" stands for it without colliding.
            // An empty JSON field or regex capture is no key.
            return matches!(self, KeySpec::Line).then_some(Cow::Borrowed(b"\n"));
        }
        if key.len() > MAX_KEY_BYTES_LIMIT {
            // Longer keys are stored by a 128-bit hash of their bytes.
            let hash = xxhash_rust::xxh3::xxh3_128(&key);
            return Some(Cow::Owned(hash.to_le_bytes().to_vec()));
        }
        Some(key)
    }
}

/// A stream's copies: 1 to 5, as JetStream keeps.
pub fn parse_copies(text: &str) -> Result<usize, String> {
    text.parse::<usize>()
        .ok()
        .filter(|copies| (1..=5).contains(copies))
        .ok_or_else(|| format!("`{text}` is not a number of copies from 1 to 5"))
}

fn parse_durability(text: &str) -> Result<Durability, String> {
    match text {
        "sync" => Ok(Durability::Sync),
        "buffered" => Ok(Durability::Buffered),
        _ => {
            let ms = text
                .strip_prefix("interval:")
                .and_then(|ms| ms.parse::<u64>().ok())
                .filter(|&ms| ms > 0)
                .ok_or_else(|| format!("`{text}` is not sync, buffered or interval:MS"))?;
            Ok(Durability::Interval(Duration::from_millis(ms)))
        }
    }
}

/// The bucket width when none is given: the smallest round width (1 s, 5 s, 10 s, 15 s,
/// 30 s, 1 m, 5 m, 10 m, 15 m, 30 m, 1 h, 6 h, 1 d) that divides the window into at most
/// 96 buckets, or else the window in up to 96 whole buckets.
fn default_bucket(window: Duration) -> Duration {
    const ROUND_MS: [u64; 13] = [
        1_000, 5_000, 10_000, 15_000, 30_000, 60_000, 300_000, 600_000, 900_000, 1_800_000,
        3_600_000, 21_600_000, 86_400_000,
    ];
    let window_ms = u64::try_from(window.as_millis()).unwrap_or(u64::MAX);
    let round = ROUND_MS
        .iter()
        .copied()
        .find(|&width| window_ms.is_multiple_of(width) && window_ms / width <= 96);
    let width = round.unwrap_or_else(|| {
        let buckets = (1..=96u64)
            .rev()
            .find(|n| window_ms.is_multiple_of(*n))
            .unwrap_or(1);
        window_ms / buckets
    });
    Duration::from_millis(width)
}

/// What a run saw.
#[derive(Debug, Default)]
struct Counts {
    lines: u64,
    emitted: u64,
    duplicates: u64,
    keyless: u64,
}

/// Runs the filter; errors are reported by the caller in one line.
pub fn run(args: &DedupArgs) -> Result<(), Failure> {
    let bucket = args.bucket.unwrap_or_else(|| default_bucket(args.window));
    let replicated_sync = args.replicate.is_some() && args.replica_mode == ReplicaMode::Sync;
    let durability = args.durability.unwrap_or(if replicated_sync {
        Durability::Sync
    } else {
        Durability::Interval(Duration::from_millis(200))
    });
    let mut options = Options::new(&args.dir)
        .window(args.window)
        .bucket_width(bucket)
        .durability(durability)
        .max_key_bytes(MAX_KEY_BYTES_LIMIT);
    if let (Some(url), Some(name)) = (&args.replicate, &args.replica) {
        options = options.replicate(
            Replication::new(url, name)
                .mode(args.replica_mode)
                .replicas(args.replica_copies),
        );
    }
    let db = Db::open(options).map_err(|err| err.to_string())?;
    let progress = progress_bar();
    let mut counts = Counts::default();
    let result = filter(&db, args, &progress, &mut counts);
    progress.finish_and_clear();
    let flushed = db.flush().map_err(|err| err.to_string());
    noteln!(
        "oncedb dedup: {} lines, {} emitted, {} duplicates, {} without a key",
        counts.lines,
        counts.emitted,
        counts.duplicates,
        counts.keyless
    );
    result.and(flushed.map_err(Failure::from))
}

fn progress_bar() -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("{spinner} {pos} lines, {per_sec} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    bar
}

/// One batch of lines: their bytes back to back, and where each ends.
#[derive(Default)]
struct Batch {
    bytes: Vec<u8>,
    /// End of each line's content, and whether a newline followed it.
    lines: Vec<(usize, bool)>,
}

impl Batch {
    fn line(&self, index: usize) -> (&[u8], bool) {
        let start = index.checked_sub(1).map_or(0, |i| {
            self.lines.get(i).map_or(0, |l| l.0 + usize::from(l.1))
        });
        let (end, newline) = self.lines.get(index).copied().unwrap_or((start, false));
        (self.bytes.get(start..end).unwrap_or_default(), newline)
    }
}

fn filter(
    db: &Db,
    args: &DedupArgs,
    progress: &ProgressBar,
    counts: &mut Counts,
) -> Result<(), Failure> {
    let mut input = BufReader::with_capacity(1 << 20, std::io::stdin().lock());
    let mut output = BufWriter::with_capacity(1 << 20, std::io::stdout().lock());
    let mut batch = Batch::default();
    let mut admitted = Vec::new();
    loop {
        let more = read_batch(&mut input, &mut batch, args.batch as usize)?;
        if batch.lines.is_empty() {
            break;
        }
        let keys: Vec<Option<Cow<'_, [u8]>>> = (0..batch.lines.len())
            .map(|i| args.key.extract(batch.line(i).0))
            .collect();
        let present: Vec<&Cow<'_, [u8]>> = keys.iter().flatten().collect();
        admit_through_outages(db, &present, &mut admitted)?;
        let mut answers = admitted.iter();
        for (i, key) in keys.iter().enumerate() {
            counts.lines += 1;
            let emit = match key {
                None => {
                    counts.keyless += 1;
                    !args.drop_keyless
                }
                Some(_) if answers.next().copied().unwrap_or(false) => true,
                Some(_) => {
                    counts.duplicates += 1;
                    false
                }
            };
            if emit {
                counts.emitted += 1;
                let (line, newline) = batch.line(i);
                // A reader that went away (`| head`) ends the run as a success, like
                // `uniq`; any other write failure is an error.
                write_line(&mut output, line, newline)?;
            }
        }
        progress.set_position(counts.lines);
        if input.buffer().is_empty() {
            output.flush()?;
        }
        if !more {
            break;
        }
    }
    output.flush()?;
    Ok(())
}

/// Longest pause between two tries of a batch its replica did not acknowledge.
const MAX_RETRY_PAUSE: Duration = Duration::from_secs(1);

/// Asks for `keys` until the store answers. A batch answered `Unavailable` (its replica
/// did not acknowledge in time: the outcome unknown to this run, and nothing admitted)
/// is asked again, pausing a little longer each time up to `MAX_RETRY_PAUSE`, until
/// JetStream is back: a stall passes each line exactly once, none lost. Said on stderr
/// once per outage. Any other error ends the run.
fn admit_through_outages(
    db: &Db,
    keys: &[&Cow<'_, [u8]>],
    admitted: &mut Vec<bool>,
) -> Result<(), Failure> {
    let mut pause = Duration::from_millis(20);
    let mut outage = false;
    loop {
        match db.insert_many_into(keys, admitted) {
            Ok(()) => {
                if outage {
                    noteln!("oncedb dedup: the replica acknowledges again");
                }
                return Ok(());
            }
            Err(oncedb::Error::Unavailable { message, .. }) => {
                if !outage {
                    noteln!("oncedb dedup: {message}; asking again until it answers");
                    outage = true;
                }
                // A back-off between tries of a call to a server that stalls.
                std::thread::sleep(pause);
                pause = (pause * 2).min(MAX_RETRY_PAUSE);
            }
            Err(err) => return Err(err.to_string().into()),
        }
    }
}

fn write_line(output: &mut impl Write, line: &[u8], newline: bool) -> std::io::Result<()> {
    output.write_all(line)?;
    if newline {
        output.write_all(b"\n")?;
    }
    Ok(())
}

/// Longest line accepted; a longer one stops the run with an error rather than grow
/// memory without bound.
const MAX_LINE_BYTES: u64 = 16 << 20;
/// A batch ends once it holds this many bytes, whatever its line count.
const MAX_BATCH_BYTES: usize = 8 << 20;

/// Reads lines into `batch` (cleared first) until `max` lines or `MAX_BATCH_BYTES`, the
/// end of the input, or the end of what is buffered without blocking (after at least one
/// line), so that a slow stream is answered line by line and a fast one in large
/// batches. Returns false at the end of the input.
fn read_batch(
    input: &mut BufReader<impl Read>,
    batch: &mut Batch,
    max: usize,
) -> Result<bool, String> {
    batch.bytes.clear();
    batch.lines.clear();
    while batch.lines.len() < max && batch.bytes.len() < MAX_BATCH_BYTES {
        let before = batch.bytes.len();
        let read = (&mut *input)
            .take(MAX_LINE_BYTES + 1)
            .read_until(b'\n', &mut batch.bytes)
            .map_err(|err| format!("reading stdin: {err}"))?;
        if read == 0 {
            return Ok(false);
        }
        let newline = batch.bytes.last() == Some(&b'\n');
        let end = batch.bytes.len() - usize::from(newline);
        if (end - before) as u64 > MAX_LINE_BYTES {
            return Err(format!("a line is longer than {MAX_LINE_BYTES} bytes"));
        }
        batch.lines.push((end, newline));
        if input.buffer().is_empty() {
            break;
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_extracted_or_absent() {
        let json = KeySpec::parse("json:event.id").unwrap();
        assert_eq!(
            json.extract(br#"{"event":{"id":"a1"}}"#).as_deref(),
            Some(&b"a1"[..])
        );
        assert_eq!(
            json.extract(br#"{"event":{"id":42}}"#).as_deref(),
            Some(&b"42"[..])
        );
        assert_eq!(json.extract(br#"{"event":{}}"#), None);
        assert_eq!(json.extract(b"not json"), None);
        let array = KeySpec::parse("json:items.1").unwrap();
        assert_eq!(
            array.extract(br#"{"items":["x","y"]}"#).as_deref(),
            Some(&b"y"[..])
        );
        let regex = KeySpec::parse("regex:id=(\\w+)").unwrap();
        assert_eq!(regex.extract(b"a id=77 b").as_deref(), Some(&b"77"[..]));
        assert_eq!(regex.extract(b"none"), None);
        assert_eq!(KeySpec::Line.extract(b"").as_deref(), Some(&b"\n"[..]));
        assert!(KeySpec::parse("json:").is_err());
        assert!(KeySpec::parse("regex:(").is_err());
        assert!(KeySpec::parse("column:3").is_err());
    }

    #[test]
    fn batches_are_bounded_and_overlong_lines_refused() {
        let mut batch = Batch::default();
        let mut input = BufReader::new(&b"a\nbb\nccc"[..]);
        assert!(read_batch(&mut input, &mut batch, 2).unwrap());
        assert_eq!(
            (batch.line(0), batch.line(1)),
            ((&b"a"[..], true), (&b"bb"[..], true))
        );
        assert!(read_batch(&mut input, &mut batch, 2).unwrap());
        assert_eq!(batch.line(0), (&b"ccc"[..], false));
        assert!(!read_batch(&mut input, &mut batch, 2).unwrap());
        let long = vec![b'x'; usize::try_from(MAX_LINE_BYTES).unwrap() + 2];
        let mut input = BufReader::new(&long[..]);
        assert!(read_batch(&mut input, &mut batch, 2).is_err());
    }

    #[test]
    fn default_buckets_divide_the_window() {
        let secs = Duration::from_secs;
        assert_eq!(default_bucket(secs(86_400)), secs(900));
        assert_eq!(default_bucket(secs(3_600)), secs(60));
        assert_eq!(default_bucket(secs(90)), secs(1));
        assert_eq!(default_bucket(secs(7 * 86_400)), secs(6 * 3_600));
        assert_eq!(
            default_bucket(Duration::from_millis(7)),
            Duration::from_millis(1)
        );
        assert_eq!(
            default_bucket(Duration::from_millis(1_500)),
            Duration::from_millis(20)
        );
    }
}
