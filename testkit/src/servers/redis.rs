//! `redis-server` processes: one standalone, or three primaries joined into a cluster.

use std::net::TcpStream;
use std::path::Path;
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

/// How a server is started, the same on every restart.
#[derive(Clone, Copy)]
struct Setup {
    port: u16,
    cluster: bool,
    persistence: Persistence,
    /// TLS only, no plain port (the certificates are in the server's directory).
    tls: bool,
    /// The client port a cluster node tells clients, when they reach it through a proxy.
    announce_port: Option<u16>,
}

/// A `redis-server` child, killed on drop.
pub struct RedisServer {
    child: Child,
    /// The loopback port it listens on.
    pub port: u16,
    setup: Setup,
    dir: tempfile::TempDir,
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(setup: Setup, dir: &Path) -> Child {
    let port = setup.port.to_string();
    let mut command = Command::new("redis-server");
    if setup.tls {
        command
            .args(["--port", "0", "--tls-port", &port])
            .arg("--tls-cert-file")
            .arg(dir.join("server.pem"))
            .arg("--tls-key-file")
            .arg(dir.join("server.key"))
            .arg("--tls-ca-cert-file")
            .arg(dir.join("ca.pem"))
            .args(["--tls-auth-clients", "no"]);
    } else {
        command.args(["--port", &port]);
    }
    command
        .args(["--bind", "127.0.0.1"])
        .args(["--save", "", "--protected-mode", "no"])
        .arg("--dir")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    match setup.persistence {
        Persistence::None => command.args(["--appendonly", "no"]),
        Persistence::AofAlways => command.args(["--appendonly", "yes", "--appendfsync", "always"]),
    };
    if setup.cluster {
        command.args([
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "2000",
        ]);
    }
    if let Some(announced) = setup.announce_port {
        command.args(["--cluster-announce-port", &announced.to_string()]);
    }
    let child = command
        .spawn()
        .expect("redis-server must be installed (.ci/run installs it)");
    wait_for("redis-server start", || {
        TcpStream::connect(("127.0.0.1", setup.port)).is_ok()
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
        RedisServer::launch(
            Setup {
                port: free_port(),
                cluster,
                persistence,
                tls: false,
                announce_port: None,
            },
            tempfile::tempdir().unwrap(),
        )
    }

    fn launch(setup: Setup, dir: tempfile::TempDir) -> RedisServer {
        let child = spawn(setup, dir.path());
        RedisServer {
            child,
            port: setup.port,
            setup,
            dir,
        }
    }

    /// A standalone server that speaks TLS only, showing the server certificate of
    /// `certificates`.
    pub fn start_tls(certificates: &Certificates) -> RedisServer {
        let dir = tempfile::tempdir().unwrap();
        certificates.install(dir.path(), None);
        std::fs::copy(certificates.ca_file(), dir.path().join("ca.pem")).unwrap();
        let setup = Setup {
            port: free_port(),
            cluster: false,
            persistence: Persistence::None,
            tls: true,
            announce_port: None,
        };
        RedisServer::launch(setup, dir)
    }

    /// A cluster of one primary holding every slot, which tells clients to reach it on
    /// `announce_port` (where a proxy in front of it listens).
    pub fn start_cluster_of_one(announce_port: u16) -> RedisServer {
        let setup = Setup {
            port: free_port(),
            cluster: true,
            persistence: Persistence::None,
            tls: false,
            announce_port: Some(announce_port),
        };
        let node = RedisServer::launch(setup, tempfile::tempdir().unwrap());
        assert!(
            node.cli(&["CLUSTER", "ADDSLOTSRANGE", "0", "16383"])
                .contains("OK")
        );
        wait_for("cluster_state:ok", || {
            node.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok")
        });
        node
    }

    /// SIGKILL: the server dies without a chance to write anything more.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the server again on the same port and directory (after [`kill`]).
    pub fn restart(&mut self) {
        self.child = spawn(self.setup, self.dir.path());
        wait_for("redis-server loading its data", || {
            !self.cli(&["INFO", "persistence"]).contains("loading:1")
                && self.cli(&["PING"]).contains("PONG")
        });
    }

    /// `redis://127.0.0.1:PORT/`, or `rediss://` for a TLS server.
    pub fn url(&self) -> String {
        let scheme = if self.setup.tls { "rediss" } else { "redis" };
        format!("{scheme}://127.0.0.1:{}/", self.port)
    }

    /// Runs `redis-cli` against this server and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        let mut command = Command::new("redis-cli");
        command.args(["-p", &self.port.to_string()]);
        if self.setup.tls {
            command
                .arg("--tls")
                .arg("--cacert")
                .arg(self.dir.path().join("ca.pem"));
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
