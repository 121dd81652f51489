//! An effectively-once forwarder from one NATS JetStream stream to another, with oncedb
//! as its memory: reserve each message id, forward with the same id as `Nats-Msg-Id`,
//! complete, then acknowledge the input.
//!
//! ```sh
//! cargo run --example jetstream_dedup -- --server nats://127.0.0.1:4222 \
//!     --input-stream ORDERS --output-subject orders.clean --dir /tmp/dedup [--idle-exit 5] [--batch 100]
//! ```
//!
//! `--create-streams --input-subject orders --output-stream CLEAN` first creates the input
//! stream on `orders` and the output stream on `orders.clean` if they are missing.
//!
//! - The dedup key is the input's `Nats-Msg-Id`, or `h:` and the XXH3-128 of the payload
//!   when the header is absent.
//! - A batch is fetched from the durable pull consumer `oncedb` (created if missing,
//!   explicit acks); its keys are reserved concurrently on the consumer's task through
//!   [`Store`] over a `Durability::Sync` store, so that the batch's reserves share one
//!   group commit and no thread waits on the fsync; new messages are published in order
//!   and all their confirmations from the output stream awaited; the records are
//!   completed the same way (one more group commit); then the inputs are acknowledged.
//! - A record found in flight was reserved by a run that died before completing it: it is
//!   taken over and forwarded again with the same id, which the output stream's own
//!   duplicate window absorbs if the first send got through.
//! - A record found completed is a duplicate (a redelivery, or a re-publish older than the
//!   broker's duplicate window): acknowledged and dropped.
//!
//! `--replicate URL --replica NAME [--replica-mode sync|async] [--replica-copies N]`
//! (default 3 copies; 1 on a single server) replicates the store to
//! NATS JetStream (`Options::replicate`): a consumer started on another host with an
//! empty `--dir` restores its partition's window from the replica first (`Db::restore`,
//! which claims it: the old consumer, if it still runs, is refused its next write), so
//! redeliveries and late duplicates of messages the old consumer finished are still
//! dropped.
//!
//! `--naive` runs the broken "remember then forward" pattern instead (insert the ids,
//! fsync, then forward the new ones): a crash between the two loses messages. It exists
//! for the control run of the crash test. `--passthrough` forwards everything with no
//! store in the path: the baseline for throughput. `--one-by-one` awaits each
//! confirmation before the next publish, as a side effect with a round trip per message
//! would (the crash test's control compares both patterns this way).

#![expect(clippy::expect_used, reason = "example: failures abort with a message")]

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer::AckPolicy, consumer::pull};
use futures_util::StreamExt;
use futures_util::future::join_all;
use oncedb::{
    Db, Durability, Lease, Options, ReplicaMode, Replication, Reservation, Scope, Store, StoreLease,
};

struct Args {
    server: String,
    input_stream: String,
    output_subject: String,
    dir: PathBuf,
    idle_exit: Option<Duration>,
    batch: usize,
    ack_wait: Duration,
    mode: Mode,
    /// Await each confirmation before the next publish.
    one_by_one: bool,
    /// Wait this long before each publish, as a slow downstream would.
    forward_delay: Duration,
    /// Create missing streams: `input_stream` on `input_subject`, `output_stream` on
    /// `output_subject`.
    create_streams: bool,
    input_subject: Option<String>,
    output_stream: Option<String>,
    /// Replicate the store to JetStream: (servers, replica name, mode).
    /// URL, replica name, mode, stream copies.
    replicate: Option<(String, String, ReplicaMode, usize)>,
}

/// What stands between input and output.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Reserve, forward, complete, acknowledge.
    Reserve,
    /// Remember, then forward (loses messages on a crash).
    Naive,
    /// No store at all: every message is forwarded (the baseline for throughput).
    Passthrough,
}

/// The largest batch: its confirmations are all pending at once, and the JetStream
/// context admits 5000 pending confirmations before it makes publishers wait.
const MAX_BATCH: usize = 4096;

fn args() -> Result<Args, String> {
    let mut parsed = Args {
        server: String::new(),
        input_stream: String::new(),
        output_subject: String::new(),
        dir: PathBuf::new(),
        idle_exit: None,
        batch: 100,
        ack_wait: Duration::from_secs(30),
        mode: Mode::Reserve,
        one_by_one: false,
        forward_delay: Duration::ZERO,
        create_streams: false,
        input_subject: None,
        output_stream: None,
        replicate: None,
    };
    let (mut replicate_url, mut replica, mut replica_mode) = (None, None, ReplicaMode::Sync);
    let mut copies = oncedb::DEFAULT_REPLICAS;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--naive" || flag == "--passthrough" {
            parsed.mode = if flag == "--naive" {
                Mode::Naive
            } else {
                Mode::Passthrough
            };
            continue;
        }
        if flag == "--one-by-one" || flag == "--create-streams" {
            if flag == "--one-by-one" {
                parsed.one_by_one = true;
            } else {
                parsed.create_streams = true;
            }
            continue;
        }
        let value = args.next().ok_or(format!("{flag} needs a value"))?;
        let number = |what: &str| value.parse::<u64>().map_err(|e| format!("{what}: {e}"));
        match flag.as_str() {
            "--server" => parsed.server = value.clone(),
            "--input-stream" => parsed.input_stream = value.clone(),
            "--output-subject" => parsed.output_subject = value.clone(),
            "--input-subject" => parsed.input_subject = Some(value.clone()),
            "--replicate" => replicate_url = Some(value.clone()),
            "--replica" => replica = Some(value.clone()),
            "--replica-mode" => {
                replica_mode = match value.as_str() {
                    "sync" => ReplicaMode::Sync,
                    "async" => ReplicaMode::Async,
                    _ => return Err(format!("--replica-mode {value}: sync or async")),
                };
            }
            "--replica-copies" => {
                copies = usize::try_from(number("--replica-copies")?)
                    .ok()
                    .filter(|n| (1..=5).contains(n))
                    .ok_or("--replica-copies must be within 1..=5")?;
            }
            "--output-stream" => parsed.output_stream = Some(value.clone()),
            "--dir" => parsed.dir = PathBuf::from(&value),
            "--idle-exit" => parsed.idle_exit = Some(Duration::from_secs(number("--idle-exit")?)),
            "--batch" => {
                parsed.batch = usize::try_from(number("--batch")?)
                    .ok()
                    .filter(|&n| (1..=MAX_BATCH).contains(&n))
                    .ok_or(format!("--batch must be within 1..={MAX_BATCH}"))?;
            }
            "--ack-wait-ms" => parsed.ack_wait = Duration::from_millis(number("--ack-wait-ms")?),
            "--forward-delay-ms" => {
                parsed.forward_delay = Duration::from_millis(number("--forward-delay-ms")?);
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if parsed.server.is_empty()
        || parsed.input_stream.is_empty()
        || parsed.output_subject.is_empty()
        || parsed.dir.as_os_str().is_empty()
    {
        return Err("--server, --input-stream, --output-subject and --dir are required".into());
    }
    if parsed.create_streams && (parsed.input_subject.is_none() || parsed.output_stream.is_none()) {
        return Err("--create-streams needs --input-subject and --output-stream".into());
    }
    parsed.replicate = match (replicate_url, replica) {
        (Some(url), Some(name)) => Some((url, name, replica_mode, copies)),
        (None, None) => None,
        _ => return Err("--replicate and --replica go together".into()),
    };
    Ok(parsed)
}

/// The dedup key of a message: its `Nats-Msg-Id`, or a hash of its payload.
fn key_of(message: &async_nats::Message) -> String {
    message
        .headers
        .as_ref()
        .and_then(|headers| headers.get(async_nats::header::NATS_MESSAGE_ID))
        .map_or_else(
            || format!("h:{:032x}", xxhash_rust::xxh3::xxh3_128(&message.payload)),
            |id| id.as_str().to_owned(),
        )
}

/// What the store said about each message of a batch.
enum Step {
    /// Forward with this lease, then complete it.
    Forward(Lease),
    /// Forward (naive mode: nothing to complete).
    ForwardUnleased,
    /// A duplicate: acknowledge only.
    Drop,
}

/// Reserves every key of a batch at once: each reserve writes inline and awaits its
/// group commit, so the batch's reserves are durable after one or two fsyncs and no
/// thread is held while they wait.
async fn reserve_batch(db: &Db, scope: &Scope, batch: &[(String, Vec<u8>)]) -> Vec<Step> {
    let mut seen = HashSet::new();
    // The same id twice in one batch: the first one carries it.
    let first: Vec<bool> = batch.iter().map(|(key, _)| seen.insert(key)).collect();
    let reserves = batch
        .iter()
        .zip(first)
        .map(|((key, payload), first)| async move {
            if first {
                reserve_one(db, scope, key, payload).await
            } else {
                Step::Drop
            }
        });
    join_all(reserves).await
}

async fn reserve_one(db: &Db, scope: &Scope, key: &str, payload: &[u8]) -> Step {
    let reservation = Store::reserve(db, scope, key.as_bytes(), payload).await;
    match reservation.expect("reserve") {
        Reservation::Acquired(lease) => Step::Forward(lease),
        // Left in flight by a run that died before completing it.
        Reservation::InFlight { .. } => Store::take_over(db, scope, key.as_bytes())
            .await
            .expect("take over")
            .map_or(Step::Drop, Step::Forward),
        Reservation::Completed(_)
        | Reservation::Failed(_)
        | Reservation::Expired(_)
        | Reservation::Mismatch => Step::Drop,
    }
}

/// The naive pattern: remember every key (one fsync), forward the new ones afterwards.
fn remember_batch(db: &Db, batch: &[(String, Vec<u8>)]) -> Vec<Step> {
    let keys: Vec<Vec<u8>> = batch.iter().map(|(k, _)| k.as_bytes().to_vec()).collect();
    let new = db.insert_many(&keys).expect("insert_many");
    db.flush().expect("flush");
    new.into_iter()
        .map(|new| {
            if new {
                Step::ForwardUnleased
            } else {
                Step::Drop
            }
        })
        .collect()
}

#[tokio::main]
async fn main() {
    let args = match args() {
        Ok(args) => args,
        Err(err) => {
            eprintln!(
                "jetstream_dedup: {err}\nusage: jetstream_dedup --server URL --input-stream NAME \
                 --output-subject SUBJECT --dir DIR [--idle-exit SECONDS] [--batch N] [--ack-wait-ms MS] [--naive | --passthrough] [--one-by-one] [--forward-delay-ms MS] \
                 [--create-streams --input-subject SUBJECT --output-stream NAME] \
                 [--replicate URL --replica NAME [--replica-mode sync|async] [--replica-copies N]]"
            );
            std::process::exit(2);
        }
    };
    if let Err(err) = run(&args).await {
        eprintln!("jetstream_dedup: {err}");
        std::process::exit(1);
    }
}

/// Creates the input and the output stream where missing (`--create-streams`), so the
/// example runs against a bare `nats-server -js` with no other NATS tool. A stream that
/// exists is left as it is.
async fn create_streams(js: &jetstream::Context, args: &Args) -> Result<(), async_nats::Error> {
    let streams = [
        (&args.input_stream, args.input_subject.as_ref()),
        (
            args.output_stream.as_ref().unwrap_or(&args.input_stream),
            Some(&args.output_subject),
        ),
    ];
    for (name, subject) in streams {
        let subjects = subject.into_iter().cloned().collect();
        js.get_or_create_stream(jetstream::stream::Config {
            name: name.clone(),
            subjects,
            ..Default::default()
        })
        .await?;
    }
    Ok(())
}

/// The consumer's store. With `--replicate`, a directory that holds no store yet is first
/// restored from the replica (a partition moved here from another host), unless no
/// replica of that name exists yet (the partition's first run anywhere).
fn open_store(args: &Args) -> Result<Db, oncedb::Error> {
    let options = || {
        let options = Options::new(&args.dir)
            .durability(Durability::Sync)
            .window(Duration::from_secs(7 * 24 * 3600));
        match &args.replicate {
            Some((url, name, mode, copies)) => {
                options.replicate(Replication::new(url, name).mode(*mode).replicas(*copies))
            }
            None => options,
        }
    };
    if args.replicate.is_some() && !args.dir.join("MANIFEST").exists() {
        match Db::restore(options(), &mut |_, _| {}) {
            Ok((db, report)) => {
                println!(
                    "restored: {} segments, {} bytes from {} messages",
                    report.segments, report.bytes, report.messages
                );
                return Ok(db);
            }
            Err(oncedb::Error::ReplicaNotFound { .. }) => {}
            Err(err) => return Err(err),
        }
    }
    Db::open(options())
}

async fn run(args: &Args) -> Result<(), async_nats::Error> {
    let client = async_nats::connect(&args.server).await?;
    let js = jetstream::new(client);
    if args.create_streams {
        create_streams(&js, args).await?;
    }
    let consumer: jetstream::consumer::PullConsumer = js
        .get_stream(&args.input_stream)
        .await?
        .get_or_create_consumer(
            "oncedb",
            pull::Config {
                durable_name: Some("oncedb".into()),
                ack_policy: AckPolicy::Explicit,
                ack_wait: args.ack_wait,
                ..Default::default()
            },
        )
        .await?;
    let db = open_store(args)?;
    let scope = Scope::new(args.input_stream.as_bytes(), b"forward");
    let (started, mut last_message) = (Instant::now(), Instant::now());
    let mut finished = started;
    let mut idle = false;
    let (mut received, mut forwarded, mut dropped) = (0u64, 0u64, 0u64);
    loop {
        let mut fetched = consumer
            .batch()
            .max_messages(args.batch)
            .expires(Duration::from_millis(500))
            .messages()
            .await?;
        let mut messages = Vec::with_capacity(args.batch);
        while let Some(message) = fetched.next().await {
            messages.push(message?);
        }
        if messages.is_empty() {
            if !idle {
                println!("idle: the input is drained for now");
                idle = true;
            }
            if args
                .idle_exit
                .is_some_and(|idle| last_message.elapsed() >= idle)
            {
                break;
            }
            continue;
        }
        last_message = Instant::now();
        idle = false;
        received += messages.len() as u64;
        let batch: Vec<(String, Vec<u8>)> = messages
            .iter()
            .map(|m| (key_of(&m.message), m.message.payload.to_vec()))
            .collect();
        let steps = match args.mode {
            Mode::Reserve => reserve_batch(&db, &scope, &batch).await,
            Mode::Naive => {
                let (db, batch) = (db.clone(), batch.clone());
                tokio::task::spawn_blocking(move || remember_batch(&db, &batch)).await?
            }
            Mode::Passthrough => batch.iter().map(|_| Step::ForwardUnleased).collect(),
        };
        // Forward the new ones: every publish is sent in order on the one connection, then
        // every confirmation is awaited. A missing confirmation ends the run before any
        // record is completed, so the leases stay in flight and the redelivery takes over.
        let mut leases = Vec::new();
        let mut confirmations = Vec::new();
        for ((key, payload), step) in batch.into_iter().zip(steps) {
            let lease = match step {
                Step::Drop => {
                    dropped += 1;
                    continue;
                }
                Step::Forward(lease) => Some(lease),
                Step::ForwardUnleased => None,
            };
            if !args.forward_delay.is_zero() {
                // A slow downstream: the time between deciding and forwarding grows.
                tokio::time::sleep(args.forward_delay).await;
            }
            let mut headers = HeaderMap::new();
            headers.insert(async_nats::header::NATS_MESSAGE_ID, key.as_str());
            let confirmation = js
                .publish_with_headers(args.output_subject.clone(), headers, payload.into())
                .await?;
            if args.one_by_one {
                confirmation.await?;
                forwarded += 1;
            } else {
                confirmations.push(confirmation);
            }
            leases.extend(lease);
        }
        for confirmation in confirmations {
            confirmation.await?;
            forwarded += 1;
        }
        // Every completion awaits its group commit before any input is acknowledged.
        let completions = leases
            .into_iter()
            .map(|lease| StoreLease::complete(lease, b""));
        for result in join_all(completions).await {
            if let Err(err) = result {
                eprintln!("complete: {err}");
            }
        }
        for message in &messages {
            message.ack().await?;
        }
        finished = Instant::now();
        let stats = db.stats();
        println!(
            "batch: received {received} forwarded {forwarded} dropped {dropped} replays {} take_overs {} duplicates {}",
            stats.replays, stats.take_overs, stats.duplicates
        );
    }
    let busy = finished.duration_since(started).as_secs_f64().max(1e-3);
    println!(
        "done: received {received} forwarded {forwarded} dropped {dropped} in {busy:.2} s ({:.0} messages/s)",
        received as f64 / busy
    );
    Ok(())
}
