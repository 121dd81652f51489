//! A `nats-server -js` child with its JetStream store in a temp dir, and clusters of them.
//!
//! Two releases are told apart ([`Release`]): the tests run the newest server installed
//! (`scripts/install-nats-server` installs the pinned one), and the tests of the store's
//! delete path run one from before 2.9.18 (Debian 12's 2.9.10), whose clustered purges
//! the store does not trust.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;

use super::{free_port, wait_for};

/// Which installed `nats-server` a test starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Release {
    /// `ONCEDB_NATS_SERVER` when set, else the newest `nats-server` installed.
    Newest,
    /// `ONCEDB_NATS_SERVER_BEFORE_2_9_18` when set, else the oldest `nats-server`
    /// installed that is older than 2.9.18: a server that replays a purge by subject wrongly on
    /// restart, so the store deletes message by message there.
    BeforePurgeFix,
}

/// `(major, minor, patch)` of `nats-server --version` (`nats-server: v2.9.10`).
fn version_of(binary: &Path) -> Option<(u32, u32, u32)> {
    let output = Command::new(binary).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&output.stdout);
    let number = text.trim().rsplit('v').next()?;
    let mut parts = number
        .split(|c: char| !c.is_ascii_digit())
        .map(|part| part.parse::<u32>().ok());
    Some((parts.next()??, parts.next()??, parts.next()??))
}

/// Every distinct `nats-server` on the `PATH` or in `~/.local/bin` (where
/// `scripts/install-nats-server` puts it when not run as root), with its version.
fn installed() -> Vec<(PathBuf, (u32, u32, u32))> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs: Vec<PathBuf> = std::env::split_paths(&path).collect();
    if let Some(home) = std::env::var_os("HOME") {
        dirs.push(Path::new(&home).join(".local/bin"));
    }
    let mut found: Vec<(PathBuf, (u32, u32, u32))> = Vec::new();
    for dir in dirs {
        let candidate = dir.join("nats-server");
        let Ok(real) = candidate.canonicalize() else {
            continue;
        };
        if found.iter().any(|(seen, _)| *seen == real) {
            continue;
        }
        if let Some(version) = version_of(&real) {
            found.push((real, version));
        }
    }
    found
}

/// `(major, minor, patch)` of `release`'s binary, if it tells.
pub fn version(release: Release) -> Option<(u32, u32, u32)> {
    version_of(binary(release))
}

/// `release`'s binary and version, as a test prints them (`/usr/local/bin/nats-server v2.15.1`).
pub fn describe(release: Release) -> String {
    let path = binary(release);
    match version_of(path) {
        Some((major, minor, patch)) => format!("{} v{major}.{minor}.{patch}", path.display()),
        None => format!("{} (version unknown)", path.display()),
    }
}

/// The binary of `release`, found once per process.
pub fn binary(release: Release) -> &'static Path {
    static NEWEST: OnceLock<PathBuf> = OnceLock::new();
    static BEFORE_FIX: OnceLock<PathBuf> = OnceLock::new();
    let (cell, variable) = match release {
        Release::Newest => (&NEWEST, "ONCEDB_NATS_SERVER"),
        Release::BeforePurgeFix => (&BEFORE_FIX, "ONCEDB_NATS_SERVER_BEFORE_2_9_18"),
    };
    cell.get_or_init(|| {
        if let Some(set) = std::env::var_os(variable) {
            return PathBuf::from(set);
        }
        let mut found = installed();
        found.sort_by_key(|&(_, version)| version);
        let chosen = match release {
            Release::Newest => found.pop(),
            Release::BeforePurgeFix => found.into_iter().find(|&(_, version)| version < (2, 9, 18)),
        };
        match chosen {
            Some((path, _)) => path,
            None => panic!(
                "no {release:?} nats-server installed: `bash scripts/install-nats-server` \
                 installs the newest, Debian 12's `nats-server` package one before 2.9.18 \
                 (or set {variable})"
            ),
        }
    })
}

/// A NATS server with JetStream, killed on drop.
pub struct NatsServer {
    child: Child,
    /// The loopback port it listens on.
    pub port: u16,
    dir: tempfile::TempDir,
}

fn spawn(port: u16, dir: &std::path::Path) -> Child {
    let child = Command::new(binary(Release::Newest))
        .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("nats-server runs (scripts/install-nats-server installs it)");
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

    /// SIGKILL: the server is gone until [`start_again`](Self::start_again).
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// A new server on the same port and store directory, after [`stop`](Self::stop).
    pub fn start_again(&mut self) {
        self.child = spawn(self.port, self.dir.path());
    }

    /// SIGSTOP: the server holds its connections but answers nothing (a stall) until
    /// [`resume`](Self::resume).
    pub fn pause(&self) {
        super::signal("STOP", &[self.child.id()]);
    }

    /// SIGCONT after [`pause`](Self::pause).
    pub fn resume(&self) {
        super::signal("CONT", &[self.child.id()]);
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
        // A paused server dies on SIGKILL as well.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `size` pairs of free loopback ports (client, cluster), all distinct: every port is
/// held until all are chosen, so no two picks return the same one.
fn distinct_ports(size: usize) -> Vec<(u16, u16)> {
    let held: Vec<std::net::TcpListener> = (0..size * 2)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let ports: Vec<u16> = held
        .iter()
        .map(|listener| listener.local_addr().unwrap().port())
        .collect();
    drop(held);
    ports
        .chunks(2)
        .map(|pair| {
            (
                pair.first().copied().unwrap_or(0),
                pair.get(1).copied().unwrap_or(0),
            )
        })
        .collect()
}

/// How one node of a [`NatsCluster`] is started, the same on every restart.
struct NodeSetup {
    binary: &'static Path,
    name: String,
    port: u16,
    cluster_port: u16,
    routes: String,
}

/// One `nats-server -js` of a cluster, killed on drop.
pub struct ClusterNode {
    child: Option<Child>,
    /// The loopback port clients connect to.
    pub port: u16,
    setup: NodeSetup,
    dir: tempfile::TempDir,
}

/// Starts a node; `None` if it exited before listening (one of its ports was taken
/// meanwhile by another process: the caller picks new ports).
fn try_spawn_node(setup: &NodeSetup, dir: &std::path::Path) -> Option<Child> {
    let mut child = Command::new(setup.binary)
        .args(["-js", "-a", "127.0.0.1", "-p", &setup.port.to_string()])
        .args(["--server_name", &setup.name, "--cluster_name", "oncedb"])
        .arg("--cluster")
        .arg(format!("nats://127.0.0.1:{}", setup.cluster_port))
        .args(["--routes", &setup.routes])
        .arg("-sd")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("nats-server runs (scripts/install-nats-server installs it)");
    let port = setup.port;
    let mut exited = false;
    wait_for("nats-server start", || {
        exited = child.try_wait().ok().flatten().is_some();
        exited || TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    (!exited).then_some(child)
}

/// Starts a node on ports that are its own.
fn spawn_node(setup: &NodeSetup, dir: &std::path::Path) -> Child {
    try_spawn_node(setup, dir).expect("nats-server exited at start: a port of its was taken")
}

/// Three (or more) `nats-server -js` joined by cluster routes on loopback: JetStream
/// streams of up to that many replicas, replicated with Raft.
pub struct NatsCluster {
    /// The nodes, in start order.
    pub nodes: Vec<ClusterNode>,
}

impl NatsCluster {
    /// Starts `size` nodes of the newest server installed, each routing to every other;
    /// on fresh ports again if a node exits at start because another process took one of
    /// its ports meanwhile.
    pub fn start(size: usize) -> NatsCluster {
        NatsCluster::start_release(size, Release::Newest)
    }

    /// [`start`](Self::start) with the server of `release`.
    pub fn start_release(size: usize, release: Release) -> NatsCluster {
        let binary = binary(release);
        for _ in 0..5 {
            if let Some(cluster) = NatsCluster::try_start(size, binary) {
                return cluster;
            }
        }
        panic!("no cluster of {size} nats-server nodes started in 5 tries");
    }

    fn try_start(size: usize, binary: &'static Path) -> Option<NatsCluster> {
        let ports = distinct_ports(size);
        let nodes = ports
            .iter()
            .enumerate()
            .map(|(i, &(port, cluster_port))| {
                let routes = ports
                    .iter()
                    .enumerate()
                    .filter(|&(j, _)| j != i)
                    .map(|(_, &(_, cluster))| format!("nats://127.0.0.1:{cluster}"))
                    .collect::<Vec<_>>()
                    .join(",");
                let setup = NodeSetup {
                    binary,
                    name: format!("n{i}"),
                    port,
                    cluster_port,
                    routes,
                };
                let dir = tempfile::tempdir().unwrap();
                let child = try_spawn_node(&setup, dir.path())?;
                Some(ClusterNode {
                    child: Some(child),
                    port,
                    setup,
                    dir,
                })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(NatsCluster { nodes })
    }

    /// Every node's URL, comma-separated: a client reaches whichever is up.
    pub fn url(&self) -> String {
        self.nodes
            .iter()
            .map(|node| format!("nats://127.0.0.1:{}", node.port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// SIGKILL of node `index`.
    pub fn kill(&mut self, index: usize) {
        if let Some(mut child) = self.nodes.get_mut(index).and_then(|node| node.child.take()) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGSTOP of node `index`: it holds its connections and answers nothing.
    pub fn pause(&self, index: usize) {
        if let Some(child) = self.nodes.get(index).and_then(|node| node.child.as_ref()) {
            super::signal("STOP", &[child.id()]);
        }
    }

    /// SIGCONT of node `index` after [`pause`](Self::pause).
    pub fn resume(&self, index: usize) {
        if let Some(child) = self.nodes.get(index).and_then(|node| node.child.as_ref()) {
            super::signal("CONT", &[child.id()]);
        }
    }

    /// SIGKILL of node `index`, and the loss of its disk: its store directory emptied.
    /// [`restart`](Self::restart) brings it back empty, to be caught up by its peers.
    pub fn kill_and_lose_disk(&mut self, index: usize) {
        self.kill(index);
        if let Some(node) = self.nodes.get(index) {
            let dir = node.dir.path();
            if let Ok(entries) = std::fs::read_dir(dir) {
                for entry in entries.flatten() {
                    let path = entry.path();
                    let _ = std::fs::remove_dir_all(&path).or_else(|_| std::fs::remove_file(&path));
                }
            }
        }
    }

    /// Starts node `index` again on its ports and store directory.
    pub fn restart(&mut self, index: usize) {
        let Some(node) = self.nodes.get_mut(index) else {
            return;
        };
        if node.child.is_none() {
            node.child = Some(spawn_node(&node.setup, node.dir.path()));
        }
    }
}

impl Drop for ClusterNode {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
