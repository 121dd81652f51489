//! `oncedb bench --changelog URL`: the anchor for restores, a window kept the changelog
//! way (as Kafka Streams keeps a store's changelog topic): one JetStream message per
//! admitted key, published to a stream of its own, and a restore that replays every
//! message into an empty store. Printed beside `--restore`'s figure, which ships the log
//! in segment-sized chunks instead.

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull::OrderedConfig, stream};
use futures_util::StreamExt;
use oncedb::{Db, Options};

/// Keys published between two waits for their acknowledgements.
const PUBLISH_BATCH: usize = 2048;

/// Publishes `keys` 16-byte keys, one message each, then times their replay into an
/// in-memory store.
pub fn measure(url: &str, keys: u64) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    runtime.block_on(run(url, keys))
}

fn key(n: u64) -> [u8; 16] {
    let mut key = [0u8; 16];
    key[..8].copy_from_slice(&n.to_le_bytes());
    key[8..].copy_from_slice(&n.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
    key
}

async fn run(url: &str, keys: u64) -> Result<(), String> {
    let client = async_nats::connect(url).await.map_err(|e| e.to_string())?;
    let js = jetstream::new(client);
    let name = format!("ONCEDB_CHANGELOG_{}", std::process::id());
    let subject = format!("changelog.{}", std::process::id());
    let stream = js
        .create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone()],
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    let started = Instant::now();
    let mut n = 0;
    while n < keys {
        let mut acks = Vec::with_capacity(PUBLISH_BATCH);
        for _ in 0..PUBLISH_BATCH.min(usize::try_from(keys - n).unwrap_or(0)) {
            let ack = js
                .publish(subject.clone(), key(n).to_vec().into())
                .await
                .map_err(|e| e.to_string())?;
            acks.push(ack);
            n += 1;
        }
        for ack in acks {
            ack.await.map_err(|e| e.to_string())?;
        }
    }
    let published = started.elapsed();
    let bytes = stream
        .clone()
        .info()
        .await
        .map_err(|e| e.to_string())?
        .state
        .bytes;
    let db = Db::open(Options::in_memory().window(Duration::from_secs(24 * 3600)))
        .map_err(|e| e.to_string())?;
    let started = Instant::now();
    let consumer = stream
        .create_consumer(OrderedConfig::default())
        .await
        .map_err(|e| e.to_string())?;
    let mut messages = consumer.messages().await.map_err(|e| e.to_string())?;
    let mut replayed = 0;
    while replayed < keys {
        let Some(message) = messages.next().await else {
            break;
        };
        let message = message.map_err(|e| e.to_string())?;
        db.insert_if_absent(&message.payload)
            .map_err(|e| e.to_string())?;
        replayed += 1;
    }
    let took = started.elapsed();
    noteln!(
        "   changelog: {keys} keys published one message each in {:.3} s ({bytes} bytes in the stream); replayed into an empty store in {:.3} s ({:.3} M keys/s)",
        published.as_secs_f64(),
        took.as_secs_f64(),
        replayed as f64 / took.as_secs_f64() / 1e6
    );
    js.delete_stream(&name).await.map_err(|e| e.to_string())?;
    Ok(())
}
