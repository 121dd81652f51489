//! Waiting for an outcome on PostgreSQL: every lease ending (complete, fail, release)
//! runs `pg_notify('oncedb_finished', <topic>)` in its own statement, so the
//! notification goes out when the ending commits (with the caller's transaction, for the
//! `_in` forms) and never for an ending that rolled back. One connection per store
//! listens on the channel and wakes the waiters of the topic. The topic is the record's
//! scoped key hashed (16 hex digits): two records sharing it only wake each other's
//! waiters, which look again.
//!
//! Without that connection (a store built on a caller's pool, or while it cannot be
//! opened) waiters poll the record every [`POLL_WITHOUT_LISTENER`]; a lost connection
//! wakes every waiter to look again, and the next wait opens a new one.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::{AsyncMessage, Socket};

use super::{connect_error, pg_error};
use crate::api::Scope;
use crate::base::Result;

/// The channel every ending notifies.
pub(super) const CHANNEL: &str = "oncedb_finished";

/// How often a waiter looks at the record when no connection listens.
pub(super) const POLL_WITHOUT_LISTENER: Duration = Duration::from_millis(50);

/// How often a waiter looks at the record while a connection listens and no lease
/// timeout is set: a safety net under NOTIFY, which a pooler in transaction mode, or a
/// wait registered while the listener closes, may miss.
pub(super) const LOOK_AGAIN_WHILE_LISTENING: Duration = Duration::from_secs(1);

/// Opens a listening connection: its client (kept while it listens) and the payloads
/// of its notifications, until the connection ends.
type Connector = Arc<
    dyn Fn() -> Pin<
            Box<
                dyn Future<
                        Output = Result<(
                            tokio_postgres::Client,
                            tokio::sync::mpsc::UnboundedReceiver<String>,
                        )>,
                    > + Send,
            >,
        > + Send
        + Sync,
>;

/// The notification topic of the record of `key` in `scope`.
pub(super) fn topic(scope: &Scope, key: &[u8]) -> Result<String> {
    let scoped = scope.encode_key(key)?;
    Ok(format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&scoped)))
}

/// A connector for `config` over `tls`.
pub(super) fn connector<T>(config: tokio_postgres::Config, tls: T) -> Connector
where
    T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
    T::Stream: Send + 'static,
    T::TlsConnect: Send,
    <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
{
    Arc::new(move || {
        let (config, tls) = (config.clone(), tls.clone());
        Box::pin(async move {
            let (client, mut connection) = config.connect(tls).await.map_err(connect_error)?;
            let (sender, payloads) = tokio::sync::mpsc::unbounded_channel();
            tokio::spawn(async move {
                // Drives the connection; ends with it (or when nobody reads).
                while let Some(Ok(message)) =
                    std::future::poll_fn(|cx| connection.poll_message(cx)).await
                {
                    if let AsyncMessage::Notification(note) = message
                        && sender.send(note.payload().to_owned()).is_err()
                    {
                        return;
                    }
                }
            });
            client
                .batch_execute(&format!("LISTEN {CHANNEL}"))
                .await
                .map_err(pg_error)?;
            Ok((client, payloads))
        })
    })
}

/// The waiters of a store, by topic, and the connection that wakes them.
pub(super) struct Listener {
    connect: Option<Connector>,
    waiters: Arc<parking_lot::Mutex<HashMap<String, Arc<Notify>>>>,
    /// The task reading notifications, while one runs.
    task: parking_lot::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("can_listen", &self.connect.is_some())
            .finish_non_exhaustive()
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Some(task) = self.task.lock().take() {
            task.abort();
        }
    }
}

impl Listener {
    pub(super) fn new(connect: Option<Connector>) -> Listener {
        Listener {
            connect,
            waiters: Arc::default(),
            task: parking_lot::Mutex::new(None),
        }
    }

    /// Registers a waiter on `topic`: its signal, if a connection listens (opened
    /// here if none does); `None` if none can, and the waiter polls.
    pub(super) async fn watch(&self, topic: &str) -> Option<Arc<Notify>> {
        if !self.listening() {
            self.listen().await;
        }
        if !self.listening() {
            return None;
        }
        let mut waiters = self.waiters.lock();
        Some(Arc::clone(waiters.entry(topic.to_owned()).or_default()))
    }

    /// Takes back a waiter's registration (dropping `signal` first).
    pub(super) fn forget(&self, signal: Option<Arc<Notify>>) {
        drop(signal);
        self.waiters
            .lock()
            .retain(|_, signal| Arc::strong_count(signal) > 1);
    }

    fn listening(&self) -> bool {
        self.task
            .lock()
            .as_ref()
            .is_some_and(|task| !task.is_finished())
    }

    /// Opens a listening connection and starts the task that wakes waiters from it.
    async fn listen(&self) {
        let Some(connect) = &self.connect else {
            return;
        };
        let Ok((client, mut payloads)) = connect().await else {
            return;
        };
        let waiters = Arc::clone(&self.waiters);
        let task = tokio::spawn(async move {
            let _client = client;
            while let Some(topic) = payloads.recv().await {
                let signal = waiters.lock().get(&topic).cloned();
                if let Some(signal) = signal {
                    signal.notify_waiters();
                }
            }
            // The connection ended: every waiter looks again (and listens anew).
            for signal in waiters.lock().values() {
                signal.notify_waiters();
            }
        });
        let mut running = self.task.lock();
        match running.as_ref() {
            Some(other) if !other.is_finished() => task.abort(),
            _ => *running = Some(task),
        }
    }
}
