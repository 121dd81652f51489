//! A `nats-server -js` child with its JetStream store in a temp dir.

use std::net::TcpStream;
use std::process::{Child, Command, Stdio};

use super::{free_port, wait_for};

/// A NATS server with JetStream, killed on drop.
pub struct NatsServer {
    child: Child,
    /// The loopback port it listens on.
    pub port: u16,
    dir: tempfile::TempDir,
}

fn spawn(port: u16, dir: &std::path::Path) -> Child {
    let child = Command::new("nats-server")
        .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("nats-server must be installed (.ci/run installs it)");
    wait_for("nats-server start", || {
        TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    child
}

impl NatsServer {
    /// Starts `nats-server -js` on a free port in a temp dir.
    pub fn start() -> NatsServer {
        let port = free_port();
        let dir = tempfile::tempdir().unwrap();
        NatsServer {
            child: spawn(port, dir.path()),
            port,
            dir,
        }
    }

    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// SIGKILL, then a new server on the same port and store directory.
    pub fn crash_and_restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = spawn(self.port, self.dir.path());
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
