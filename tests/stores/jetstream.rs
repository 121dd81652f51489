//! The effectively-once forwarder (`examples/jetstream_dedup.rs`) against a real
//! `nats-server -js` the test starts: input with publisher retries, the consumer run as a
//! child process and killed with SIGKILL at random points until the input is drained;
//! then late duplicates, published once both streams' duplicate windows have passed (so
//! no broker drops them: only the store can), drained under kills again. Every distinct
//! message must reach the output exactly once. A second variant also kills the broker
//! once; a control run of the naive "remember then forward" consumer must lose messages.

use crate::support::servers;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer::pull, stream};
use futures_util::StreamExt;
use oncedb::io::SplitMix64;
use oncedb::{Db, Options};
use servers::nats::NatsServer;

const MESSAGES: usize = 1500;
/// The input stream's duplicate window: re-publishes after it are new messages to the
/// broker, and only oncedb can drop them.
const INPUT_DUPLICATE_WINDOW: Duration = Duration::from_secs(1);

fn example() -> PathBuf {
    servers::example("jetstream_dedup")
}

/// Creates stream `name` on `subject` with the broker's duplicate window `window`.
async fn create_stream(js: &jetstream::Context, name: &str, subject: &str, window: Duration) {
    js.create_stream(stream::Config {
        name: name.into(),
        subjects: vec![subject.into()],
        duplicate_window: window,
        ..Default::default()
    })
    .await
    .unwrap();
}

/// The output stream's duplicate window: long enough to absorb a re-forward by a
/// consumer restarted after a kill (the example re-sends an in-flight message with its
/// id), shorter than the wait before the late duplicates, so the broker cannot be what
/// drops those: only the store can.
const OUTPUT_DUPLICATE_WINDOW: Duration = Duration::from_secs(8);
/// JetStream's default duplicate window, for the streams of the other tests.
const BROKER_DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

async fn jetstream(url: &str) -> jetstream::Context {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let failure = match async_nats::connect(url).await {
            Ok(client) => {
                let js = jetstream::new(client);
                // Ready when the JetStream API answers (here: that a stream is absent).
                match js.get_stream("NO_SUCH_STREAM").await {
                    Err(err) if err.to_string().contains("not found") => return js,
                    Ok(_) => return js,
                    Err(err) => err.to_string(),
                }
            }
            Err(err) => err.to_string(),
        };
        assert!(
            Instant::now() < deadline,
            "JetStream never became ready: {failure}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Publishes message `i` of the input with its id; whether the broker called it a
/// duplicate.
async fn publish(js: &jetstream::Context, i: usize) -> bool {
    let mut headers = HeaderMap::new();
    headers.insert(
        async_nats::header::NATS_MESSAGE_ID,
        format!("m-{i}").as_str(),
    );
    js.publish_with_headers("in", headers, format!("payload {i}").into())
        .await
        .unwrap()
        .await
        .unwrap()
        .duplicate
}

/// Creates the streams and publishes the input: `MESSAGES` distinct ids, every tenth
/// published twice at once (a publisher retry the broker drops).
async fn publish_input(js: &jetstream::Context) {
    create_stream(js, "IN", "in", INPUT_DUPLICATE_WINDOW).await;
    create_stream(js, "OUT", "out", OUTPUT_DUPLICATE_WINDOW).await;
    for i in 0..MESSAGES {
        assert!(!publish(js, i).await);
        if i % 10 == 0 {
            assert!(publish(js, i).await, "the broker drops a quick retry");
        }
    }
}

/// Every seventh message again, once the input has been forwarded and both streams'
/// duplicate windows have passed: late duplicates that both brokers accept.
async fn publish_late_duplicates(js: &jetstream::Context) {
    // Real time must pass the brokers' windows; nothing else marks it.
    tokio::time::sleep(
        OUTPUT_DUPLICATE_WINDOW.max(INPUT_DUPLICATE_WINDOW) + Duration::from_secs(1),
    )
    .await;
    for i in (0..MESSAGES).step_by(7) {
        assert!(!publish(js, i).await, "a late duplicate passes the broker");
    }
}

/// The output stream's messages, counted by `Nats-Msg-Id`.
async fn output(js: &jetstream::Context) -> BTreeMap<String, usize> {
    let consumer: jetstream::consumer::PullConsumer = js
        .get_stream("OUT")
        .await
        .unwrap()
        .create_consumer(pull::Config::default())
        .await
        .unwrap();
    let mut counts = BTreeMap::new();
    loop {
        let mut batch = consumer
            .batch()
            .max_messages(500)
            .expires(Duration::from_millis(300))
            .messages()
            .await
            .unwrap();
        let mut got = 0;
        while let Some(message) = batch.next().await {
            let message = message.unwrap();
            let id = message
                .headers
                .as_ref()
                .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
                .unwrap()
                .as_str()
                .to_owned();
            *counts.entry(id).or_insert(0) += 1;
            message.ack().await.unwrap();
            got += 1;
        }
        if got == 0 {
            return counts;
        }
    }
}

/// What the consumer runs printed, summed.
#[derive(Default, Debug)]
struct Runs {
    kills: usize,
    /// Broker crashes under a running consumer.
    broker_crashes: usize,
    /// Kills that landed before the run had drained the input.
    busy_kills: usize,
    replays: u64,
    completed_runs: usize,
}

/// Runs the consumer (with `flags`) until it drains the input and exits on idle, killing
/// it with SIGKILL after a random delay each time (at least `min_kills` times), and
/// crashing the broker once if `crash_broker`. The same `seed` gives the same delays.
fn drain(
    server: &mut NatsServer,
    dir: &Path,
    flags: &[&str],
    seed: u64,
    min_kills: usize,
    crash_broker: bool,
) -> Runs {
    let mut rng = SplitMix64::new(seed);
    let mut runs = Runs::default();
    let mut broker_crashed = !crash_broker;
    let deadline = Instant::now() + Duration::from_secs(240);
    loop {
        assert!(
            Instant::now() < deadline,
            "the input was never drained (seed {seed})"
        );
        let mut command = Command::new(example());
        command
            .args(["--server", &server.url(), "--input-stream", "IN"])
            .args([
                "--output-subject",
                "out",
                "--batch",
                "50",
                "--ack-wait-ms",
                "1000",
            ])
            .args(["--idle-exit", "3", "--dir"])
            .arg(dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        command.args(flags);
        let mut child = command.spawn().unwrap();
        let mut kill_at = Instant::now() + Duration::from_millis(150 + rng.below(500));
        let killing = runs.kills < min_kills || rng.below(3) == 0;
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break Some(status);
            }
            if killing && Instant::now() >= kill_at {
                if !broker_crashed && runs.kills == 1 {
                    // The broker dies under the consumer, once; the consumer is killed
                    // later if it is still running.
                    server.crash_and_restart();
                    broker_crashed = true;
                    runs.broker_crashes += 1;
                    kill_at = Instant::now() + Duration::from_millis(rng.below(2000));
                    continue;
                }
                child.kill().unwrap();
                child.wait().unwrap();
                break None;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let mut stdout = String::new();
        std::io::Read::read_to_string(child.stdout.as_mut().unwrap(), &mut stdout).unwrap();
        if let Some(last) = stdout.lines().rfind(|l| l.starts_with("batch:")) {
            let words: Vec<&str> = last.split_whitespace().collect();
            let at = words.iter().position(|w| *w == "replays").unwrap();
            runs.replays += words.get(at + 1).unwrap().parse::<u64>().unwrap();
        }
        match status {
            Some(status) if status.success() && stdout.contains("done:") => {
                runs.completed_runs += 1;
                return runs;
            }
            // Killed, or the broker went away under it: a supervisor restarts it.
            _ => {
                runs.kills += 1;
                if !stdout.contains("idle:") {
                    runs.busy_kills += 1;
                }
            }
        }
    }
}

fn seed() -> u64 {
    let nanos: u64 = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos()
        .into();
    // xorshift needs a non-zero state.
    nanos | 1
}

/// Publishes the input to a fresh broker and drains it with the consumer under kills;
/// returns the output's counts per id and what the runs printed.
async fn kill_run(
    flags: &[&str],
    seed: u64,
    crash_broker: bool,
) -> (BTreeMap<String, usize>, Runs, tempfile::TempDir) {
    let mut server = NatsServer::start();
    let js = jetstream(&server.url()).await;
    publish_input(&js).await;
    let dir = tempfile::tempdir().unwrap();
    let mut runs = tokio::task::block_in_place(|| {
        drain(&mut server, dir.path(), flags, seed, 3, crash_broker)
    });
    // The late duplicates, under kills again: only the store can drop them now.
    let js = jetstream(&server.url()).await;
    publish_late_duplicates(&js).await;
    let late = tokio::task::block_in_place(|| {
        drain(&mut server, dir.path(), flags, seed ^ 0x1a7e, 1, false)
    });
    runs.kills += late.kills;
    runs.busy_kills += late.busy_kills;
    runs.replays += late.replays;
    runs.completed_runs += late.completed_runs;
    let js = jetstream(&server.url()).await;
    (output(&js).await, runs, dir)
}

/// Every distinct id of the input appears in the output exactly once.
fn assert_exactly_once(out: &BTreeMap<String, usize>, runs: &Runs, seed: u64) {
    let missing = (0..MESSAGES)
        .filter(|i| !out.contains_key(&format!("m-{i}")))
        .count();
    assert_eq!(
        missing, 0,
        "lost {missing} messages ({runs:?}, seed {seed})"
    );
    let repeated: Vec<_> = out.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        repeated.is_empty(),
        "forwarded twice: {repeated:?} (seed {seed})"
    );
    assert_eq!(out.len(), MESSAGES);
}

async fn scenario(crash_broker: bool) {
    let seed = seed();
    let (out, runs, dir) = kill_run(&[], seed, crash_broker).await;
    assert_exactly_once(&out, &runs, seed);
    assert_eq!(
        runs.broker_crashes,
        usize::from(crash_broker),
        "the broker crashed as planned: {runs:?} (seed {seed})"
    );
    assert!(runs.kills >= 3, "{runs:?}");
    assert!(
        runs.busy_kills >= 1,
        "no kill landed mid-stream: {runs:?} (seed {seed})"
    );
    // The store holds one completed record per distinct id, late duplicates included.
    let db = Db::open(Options::from_dir(dir.path()).unwrap()).unwrap();
    assert_eq!(db.stats().live_records, MESSAGES as u64);
    assert!(db.in_flight(Duration::ZERO).is_empty());
    assert!(
        runs.replays > 0,
        "no duplicate was found in the store: {runs:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_message_is_forwarded_once_across_consumer_kills() {
    scenario(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_message_is_forwarded_once_across_a_broker_crash() {
    scenario(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remember_then_forward_loses_messages_under_the_same_kills() {
    // Both patterns forward one message at a time, each confirmed before the next, under
    // the same kill schedule: reserve-forward-complete loses nothing, remember-then-
    // forward loses the messages remembered but not yet forwarded when a kill lands.
    // A kill loses messages only when it lands between remembering and forwarding, so
    // the forward is made slow (1 ms per message, a slow downstream): a batch's forwards
    // then take most of a run, and a kill mid-stream lands among them. Up to three kill
    // schedules are tried in case every kill of one lands between batches.
    let mut lost = 0;
    for _ in 0..3 {
        let seed = seed();
        let slow = ["--one-by-one", "--forward-delay-ms", "1"];
        let (out, runs, _dir) = kill_run(&slow, seed, false).await;
        assert_exactly_once(&out, &runs, seed);
        let naive_flags = ["--one-by-one", "--forward-delay-ms", "1", "--naive"];
        let (out, naive, _dir) = kill_run(&naive_flags, seed, false).await;
        lost = MESSAGES - out.len();
        println!(
            "seed {seed}: reserve lost 0 with {} busy kills; naive lost {lost} of {MESSAGES} with {} busy kills",
            runs.busy_kills, naive.busy_kills
        );
        if lost > 0 {
            break;
        }
    }
    assert!(lost > 0, "the naive consumer lost nothing across its kills");
}

/// The outbox relay's JetStream sink: re-sends of a relay that died after publishing
/// carry the same `Nats-Msg-Id`, and the stream keeps one copy.
#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outbox_relay_publishes_to_jetstream_with_stable_ids() {
    use oncedb::PostgresStore;
    use oncedb::postgres::jetstream::JetStreamPublisher;
    use oncedb::postgres::outbox::{self, NewMessage, Relay};
    use servers::postgres::PgServer;
    use std::io::BufRead;

    let nats = NatsServer::start();
    let postgres = PgServer::start();
    let js = jetstream(&nats.url()).await;
    create_stream(&js, "EVENTS", "events", BROKER_DUPLICATE_WINDOW).await;
    let store = PostgresStore::connect(&postgres.url(), Duration::from_secs(60)).unwrap();
    store.migrate().await.unwrap();
    let mut client = store.pool().get().await.unwrap();
    let tx = client.transaction().await.unwrap();
    for i in 0..20 {
        outbox::enqueue(
            &tx,
            &NewMessage {
                id: None,
                aggregate_type: "payment",
                aggregate_id: &(i % 4).to_string(),
                message_type: "payment.authorized",
                payload: format!("event {i}").as_bytes(),
            },
        )
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    drop(client);
    // A relay process publishes to JetStream and is killed with SIGKILL before it marks
    // anything published.
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "jetstream::jetstream_relay_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(RELAY_CHILD_NATS, nats.url())
        .env(RELAY_CHILD_POSTGRES, postgres.url())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let published_by_child = loop {
        let line = lines.next().expect("the child published nothing").unwrap();
        if let Some((_, count)) = line.split_once("published ") {
            break count.trim().parse::<u64>().unwrap();
        }
    };
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(published_by_child > 0);
    let mut events = js.get_stream("EVENTS").await.unwrap();
    assert_eq!(
        events.info().await.unwrap().state.messages,
        published_by_child
    );
    crate::support::await_dead_transactions(&store).await;
    // A new relay publishes everything again, with the same ids: the stream keeps one
    // copy of each of the 20.
    let relay = Relay::new(&store, JetStreamPublisher::new(js.clone(), "events"));
    let mut published = 0;
    while let n @ 1.. = relay.run_once().await.unwrap() {
        published += n;
    }
    assert_eq!(
        published, 20,
        "nothing was marked published by the killed relay"
    );
    assert_eq!(events.info().await.unwrap().state.messages, 20);
}

#[cfg(feature = "nats")]
const RELAY_CHILD_NATS: &str = "ONCEDB_JS_RELAY_NATS";
#[cfg(feature = "nats")]
const RELAY_CHILD_POSTGRES: &str = "ONCEDB_JS_RELAY_POSTGRES";

/// Publishes through JetStream, says how many so far, and hangs after the fifth, before
/// the relay can mark anything published: the relay of the test above, killed there.
#[cfg(feature = "nats")]
struct PublishThenHang {
    inner: oncedb::postgres::jetstream::JetStreamPublisher,
    count: std::sync::atomic::AtomicU64,
}

#[cfg(feature = "nats")]
impl oncedb::postgres::outbox::Publisher for PublishThenHang {
    async fn publish(
        &self,
        message: &oncedb::postgres::outbox::OutboxMessage,
    ) -> oncedb::Result<()> {
        use std::io::Write;
        self.inner.publish(message).await?;
        let n = self.count.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        if n == 5 {
            // Straight to the pipe, past the test harness's output capture.
            {
                let mut out = std::io::stdout().lock();
                writeln!(out, "published {n}").unwrap();
                out.flush().unwrap();
            }
            std::future::pending::<()>().await;
        }
        Ok(())
    }
}

/// The relay child of the JetStream relay test.
#[cfg(feature = "nats")]
#[test]
#[ignore = "child process of the JetStream relay test"]
fn jetstream_relay_child() {
    let (Ok(nats), Ok(postgres)) = (
        std::env::var(RELAY_CHILD_NATS),
        std::env::var(RELAY_CHILD_POSTGRES),
    ) else {
        return;
    };
    servers::runtime().block_on(async {
        let js = jetstream(&nats).await;
        let store = oncedb::PostgresStore::connect(&postgres, Duration::from_secs(60)).unwrap();
        let publisher = PublishThenHang {
            inner: oncedb::postgres::jetstream::JetStreamPublisher::new(js, "events"),
            count: std::sync::atomic::AtomicU64::new(0),
        };
        let relay = oncedb::postgres::outbox::Relay::new(&store, publisher);
        relay.run_once().await.unwrap();
    });
}

/// Messages per second through the consumer with oncedb in the path and without
/// (`--passthrough`), on one broker: `cargo test --all-features --release --test
/// jetstream -- --ignored --nocapture throughput` (docs/stream-processing.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement, run by hand"]
async fn throughput_with_and_without_oncedb() {
    let server = NatsServer::start();
    let js = jetstream(&server.url()).await;
    let messages = 20_000;
    let modes: [&[&str]; 3] = [&[], &["--passthrough"], &["--one-by-one"]];
    for (n, mode) in modes.into_iter().cycle().take(9).enumerate() {
        let (input, subject) = (format!("IN{n}"), format!("in{n}"));
        create_stream(&js, &input, &subject, BROKER_DUPLICATE_WINDOW).await;
        create_stream(
            &js,
            &format!("OUT{n}"),
            &format!("out{n}"),
            BROKER_DUPLICATE_WINDOW,
        )
        .await;
        let mut acks = Vec::new();
        for i in 0..messages {
            let mut headers = HeaderMap::new();
            headers.insert(
                async_nats::header::NATS_MESSAGE_ID,
                format!("m-{i}").as_str(),
            );
            acks.push(
                js.publish_with_headers(subject.clone(), headers, vec![b'x'; 100].into())
                    .await
                    .unwrap(),
            );
            // Each pending ack holds one of the context's in-flight permits:
            // settle them in chunks rather than holding all of them.
            if acks.len() == 1_000 {
                for ack in acks.drain(..) {
                    ack.await.unwrap();
                }
            }
        }
        for ack in acks {
            ack.await.unwrap();
        }
        let dir = tempfile::tempdir().unwrap();
        let out = Command::new(example())
            .args(["--server", &server.url(), "--input-stream", &input])
            .args([
                "--output-subject",
                &format!("out{n}"),
                "--batch",
                "500",
                "--idle-exit",
                "1",
                "--dir",
            ])
            .arg(dir.path())
            .args(mode)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let done = stdout.lines().find(|l| l.starts_with("done:")).unwrap();
        println!("oncedb {mode:?}: {done}");
        assert!(done.contains(&format!("forwarded {messages}")));
    }
}

const PARTITIONS: usize = 8;
const PER_PARTITION: usize = 150;

/// One consumer of partition `p` (the example, on input stream `IN-p`), its store in
/// `dir` replicated to replica `part-p`.
fn partition_consumer(server: &NatsServer, p: usize, dir: &Path) -> std::process::Child {
    Command::new(example())
        .args(["--server", &server.url()])
        .args(["--input-stream", &format!("IN-{p}")])
        .args(["--output-subject", &format!("out.{p}")])
        .args(["--batch", "20", "--ack-wait-ms", "1000", "--idle-exit", "3"])
        .args(["--forward-delay-ms", "2"])
        .args([
            "--replicate",
            &server.url(),
            "--replica",
            &format!("part-{p}"),
            "--replica-copies",
            "1",
        ])
        .arg("--dir")
        .arg(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Waits for `child` to exit on idle; its output.
fn finish(mut child: std::process::Child) -> String {
    let status = child.wait().unwrap();
    let mut stdout = String::new();
    std::io::Read::read_to_string(child.stdout.as_mut().unwrap(), &mut stdout).unwrap();
    assert!(status.success() && stdout.contains("done:"), "{stdout}");
    stdout
}

/// A rebalance: two consumer hosts share eight partitions, each partition's store
/// replicated to JetStream in sync mode. The first host's consumers are SIGKILLed
/// mid-stream and its disk is lost; the second host restores their partitions from the
/// replicas and drains them. Redeliveries, re-forwards of records left in flight, and
/// late duplicates (published once both brokers' duplicate windows passed) of the moved
/// partitions are all dropped: every message reaches the output exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moved_partition_keeps_its_window_through_its_replica() {
    let server = NatsServer::start();
    let js = jetstream(&server.url()).await;
    for p in 0..PARTITIONS {
        create_stream(
            &js,
            &format!("IN-{p}"),
            &format!("in.{p}"),
            INPUT_DUPLICATE_WINDOW,
        )
        .await;
    }
    create_stream(&js, "OUT", "out.>", OUTPUT_DUPLICATE_WINDOW).await;
    let publish_all = |ids: Vec<(usize, usize)>| {
        let js = js.clone();
        async move {
            for (p, i) in ids {
                let mut headers = HeaderMap::new();
                headers.insert(
                    async_nats::header::NATS_MESSAGE_ID,
                    format!("p{p}-m{i}").as_str(),
                );
                let ack = js
                    .publish_with_headers(format!("in.{p}"), headers, format!("payload {i}").into())
                    .await
                    .unwrap()
                    .await
                    .unwrap();
                assert!(!ack.duplicate);
            }
        }
    };
    let every: Vec<(usize, usize)> = (0..PARTITIONS)
        .flat_map(|p| (0..PER_PARTITION).map(move |i| (p, i)))
        .collect();
    publish_all(every.clone()).await;

    let first_host = tempfile::tempdir().unwrap();
    let second_host = tempfile::tempdir().unwrap();
    let dir = |host: &tempfile::TempDir, p: usize| host.path().join(format!("partition-{p}"));
    let (moved, stayed): (Vec<usize>, Vec<usize>) = (0..PARTITIONS).partition(|p| p % 2 == 0);
    let outputs = tokio::task::block_in_place(|| {
        let mut doomed: Vec<_> = moved
            .iter()
            .map(|&p| partition_consumer(&server, p, &dir(&first_host, p)))
            .collect();
        let staying: Vec<_> = stayed
            .iter()
            .map(|&p| partition_consumer(&server, p, &dir(&second_host, p)))
            .collect();
        // The first host dies mid-stream (each consumer forwards for at least 300 ms at
        // 2 ms a message): SIGKILL, then its disk is gone.
        let dying = Instant::now() + Duration::from_millis(600);
        while Instant::now() < dying {
            std::thread::yield_now();
        }
        for child in &mut doomed {
            child.kill().unwrap();
            child.wait().unwrap();
        }
        std::fs::remove_dir_all(first_host.path()).unwrap();
        // The second host takes the moved partitions at once (as a rebalance does, well
        // within the output's duplicate window, which absorbs the re-forward of a record
        // the first host left in flight): each restores from its replica.
        let moving: Vec<_> = moved
            .iter()
            .map(|&p| partition_consumer(&server, p, &dir(&second_host, p)))
            .collect();
        for child in staying {
            finish(child);
        }
        moving.into_iter().map(finish).collect::<Vec<_>>()
    });
    for output in &outputs {
        assert!(output.contains("restored:"), "{output}");
    }
    // Late duplicates of every partition, once both brokers' windows passed: only the
    // stores (the restored ones included) can drop them.
    tokio::time::sleep(
        OUTPUT_DUPLICATE_WINDOW.max(INPUT_DUPLICATE_WINDOW) + Duration::from_secs(1),
    )
    .await;
    publish_all(every.iter().copied().filter(|(_, i)| i % 5 == 0).collect()).await;
    tokio::task::block_in_place(|| {
        let children: Vec<_> = (0..PARTITIONS)
            .map(|p| partition_consumer(&server, p, &dir(&second_host, p)))
            .collect();
        for child in children {
            finish(child);
        }
    });
    let out = output(&js).await;
    let missing: Vec<_> = every
        .iter()
        .filter(|(p, i)| !out.contains_key(&format!("p{p}-m{i}")))
        .collect();
    assert!(missing.is_empty(), "lost: {missing:?}");
    let repeated: Vec<_> = out.iter().filter(|(_, n)| **n != 1).collect();
    assert!(repeated.is_empty(), "forwarded twice: {repeated:?}");
    assert_eq!(out.len(), every.len());
}
