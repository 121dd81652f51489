//! A TCP proxy on loopback that can lose a reply: armed, it forwards a client's command to
//! the server, takes the server's reply, and closes both connections instead of handing
//! the reply on. The client sees a connection reset for a command the server ran, the
//! case in which a client library re-sends the command. Held, it keeps new connections
//! waiting before they reach the server, so that a test can let another client act
//! between a command's first run and its re-sending.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::{Arc, Condvar, Mutex};

/// A proxy forwarding its port to an upstream port, with a thread per direction of every
/// connection; it stops accepting when dropped.
pub struct Proxy {
    /// The loopback port clients connect to.
    pub port: u16,
    state: Arc<State>,
}

struct State {
    upstream: AtomicU16,
    /// The next reply from the server is lost, with its connection.
    armed: AtomicBool,
    /// Replies lost so far, and whether new connections wait: one lock, one condition.
    gate: Mutex<Gate>,
    changed: Condvar,
    stopped: AtomicBool,
}

#[derive(Default)]
struct Gate {
    lost: u64,
    held: bool,
}

impl State {
    fn gate(&self) -> std::sync::MutexGuard<'_, Gate> {
        self.gate
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Blocks while new connections are held.
    fn pass_gate(&self) {
        let mut gate = self.gate();
        while gate.held && !self.stopped.load(Ordering::SeqCst) {
            gate = self
                .changed
                .wait(gate)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }
}

impl Proxy {
    /// A proxy listening on a free loopback port; set its upstream before use.
    pub fn start() -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(State {
            upstream: AtomicU16::new(0),
            armed: AtomicBool::new(false),
            gate: Mutex::new(Gate::default()),
            changed: Condvar::new(),
            stopped: AtomicBool::new(false),
        });
        let accepting = Arc::clone(&state);
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if accepting.stopped.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(client) = client else { continue };
                accepting.pass_gate();
                let upstream = accepting.upstream.load(Ordering::SeqCst);
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
                    continue;
                };
                pipe(&client, &server, None);
                pipe(&server, &client, Some(Arc::clone(&accepting)));
            }
        });
        Proxy { port, state }
    }

    /// Forwards to `port` from now on.
    pub fn forward_to(&self, port: u16) {
        self.state.upstream.store(port, Ordering::SeqCst);
    }

    /// Loses the next reply the server sends, and its connection.
    pub fn lose_next_reply(&self) {
        self.state.armed.store(true, Ordering::SeqCst);
    }

    /// Loses the next reply the server sends, and its connection, and holds every new
    /// connection (the client's reconnection to re-send) until [`release`](Self::release).
    pub fn lose_next_reply_and_hold(&self) {
        self.state.gate().held = true;
        self.lose_next_reply();
    }

    /// Lets held connections through to the server.
    pub fn release(&self) {
        self.state.gate().held = false;
        self.state.changed.notify_all();
    }

    /// Blocks until `count` replies in all have been lost (at most 30 s).
    pub fn wait_lost(&self, count: u64) {
        let gate = self.state.gate();
        let (gate, _) = self
            .state
            .changed
            .wait_timeout_while(gate, std::time::Duration::from_secs(30), |gate| {
                gate.lost < count
            })
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        assert!(gate.lost >= count, "no reply was lost within 30 s");
    }

    /// How many replies were lost.
    pub fn lost(&self) -> u64 {
        self.state.gate().lost
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.state.stopped.store(true, Ordering::SeqCst);
        self.state.changed.notify_all();
        // Wakes the accept loop so that it sees the flag.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

/// Copies `from` to `to` on a thread of its own; with `state`, the server-to-client
/// direction, which loses a reply when armed.
fn pipe(from: &TcpStream, to: &TcpStream, state: Option<Arc<State>>) {
    let (mut from, mut to) = (from.try_clone().unwrap(), to.try_clone().unwrap());
    std::thread::spawn(move || {
        let mut buffer = vec![0u8; 64 * 1024];
        loop {
            let n = match from.read(&mut buffer) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if let Some(state) = &state
                && state.armed.swap(false, Ordering::SeqCst)
            {
                state.gate().lost += 1;
                state.changed.notify_all();
                break;
            }
            if to.write_all(buffer.get(..n).unwrap()).is_err() {
                break;
            }
        }
        let _ = from.shutdown(Shutdown::Both);
        let _ = to.shutdown(Shutdown::Both);
    });
}
