//! `redis-server` processes: one standalone, or three primaries joined into a cluster.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use super::tls::Certificates;
use super::{free_port, wait_for};

/// How a server persists its data.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Persistence {
    /// Memory only.
    None,
    /// An append-only file fsynced before every reply (`appendfsync always`).
    AofAlways,
}

/// A `redis-server` child, killed on drop.
pub struct RedisServer {
    child: Child,
    /// The loopback port it listens on.
    pub port: u16,
    cluster: bool,
    persistence: Persistence,
    dir: tempfile::TempDir,
    /// The authority's certificate file of a server that speaks TLS only.
    tls: Option<PathBuf>,
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(port: u16, dir: &Path, cluster: bool, persistence: Persistence) -> Child {
    let mut command = Command::new("redis-server");
    if dir.join("server.pem").exists() {
        // TLS only: no plain port.
        command
            .args(["--port", "0", "--tls-port", &port.to_string()])
            .arg("--tls-cert-file")
            .arg(dir.join("server.pem"))
            .arg("--tls-key-file")
            .arg(dir.join("server.key"))
            .arg("--tls-ca-cert-file")
            .arg(dir.join("ca.pem"))
            .args(["--tls-auth-clients", "no"]);
    } else {
        command.args(["--port", &port.to_string()]);
    }
    command
        .args(["--bind", "127.0.0.1"])
        .args(["--save", "", "--protected-mode", "no"])
        .arg("--dir")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    match persistence {
        Persistence::None => command.args(["--appendonly", "no"]),
        Persistence::AofAlways => command.args(["--appendonly", "yes", "--appendfsync", "always"]),
    };
    if cluster {
        command.args([
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "2000",
        ]);
    }
    let child = command
        .spawn()
        .expect("redis-server must be installed (.ci/run installs it)");
    wait_for("redis-server start", || {
        TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    child
}

impl RedisServer {
    /// Starts `redis-server` (cluster-enabled if `cluster`) with default persistence.
    pub fn start(cluster: bool) -> RedisServer {
        RedisServer::start_with(cluster, Persistence::None)
    }

    /// Starts `redis-server` with `persistence`.
    pub fn start_with(cluster: bool, persistence: Persistence) -> RedisServer {
        let port = free_port();
        let dir = tempfile::tempdir().unwrap();
        let child = spawn(port, dir.path(), cluster, persistence);
        RedisServer {
            child,
            port,
            cluster,
            persistence,
            dir,
            tls: None,
        }
    }

    /// A standalone server that speaks TLS only, showing the server certificate of
    /// `certificates`.
    pub fn start_tls(certificates: &Certificates) -> RedisServer {
        let port = free_port();
        let dir = tempfile::tempdir().unwrap();
        certificates.install(dir.path(), None);
        let ca = dir.path().join("ca.pem");
        std::fs::copy(certificates.ca_file(), &ca).unwrap();
        let child = spawn(port, dir.path(), false, Persistence::None);
        RedisServer {
            child,
            port,
            cluster: false,
            persistence: Persistence::None,
            dir,
            tls: Some(ca),
        }
    }

    /// SIGKILL: the server dies without a chance to write anything more.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the server again on the same port and directory (after [`kill`]).
    pub fn restart(&mut self) {
        self.child = spawn(self.port, self.dir.path(), self.cluster, self.persistence);
        wait_for("redis-server loading its data", || {
            !self.cli(&["INFO", "persistence"]).contains("loading:1")
                && self.cli(&["PING"]).contains("PONG")
        });
    }

    /// `redis://127.0.0.1:PORT/`, or `rediss://` for a TLS server.
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://127.0.0.1:{}/", self.port)
    }

    /// Runs `redis-cli` against this server and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        let mut command = Command::new("redis-cli");
        command.args(["-p", &self.port.to_string()]);
        if let Some(ca) = &self.tls {
            command.arg("--tls").arg("--cacert").arg(ca);
        }
        let out = command
            .args(args)
            .output()
            .expect("redis-cli must be installed (.ci/run installs it)");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

/// Three primaries sharing the 16384 slots.
pub fn start_cluster() -> Vec<RedisServer> {
    let nodes: Vec<RedisServer> = (0..3).map(|_| RedisServer::start(true)).collect();
    let addresses: Vec<String> = nodes
        .iter()
        .map(|node| format!("127.0.0.1:{}", node.port))
        .collect();
    let status = Command::new("redis-cli")
        .args(["--cluster", "create"])
        .args(&addresses)
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("redis-cli must be installed");
    assert!(status.success(), "redis-cli --cluster create failed");
    for node in &nodes {
        wait_for("cluster_state:ok", || {
            node.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok")
        });
    }
    nodes
}
