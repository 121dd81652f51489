//! A private PostgreSQL: `initdb` into a temp dir, `pg_ctl start` on a free loopback
//! port, `pg_ctl stop -m immediate` (or SIGKILL) when dropped. Run as root, the server
//! runs as the `postgres` user, which owns the temp dir.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use super::tls::Certificates;
use super::{alive, children, free_port, signal, wait_for};

/// A PostgreSQL cluster in a temp dir.
pub struct PgServer {
    bin: PathBuf,
    dir: tempfile::TempDir,
    /// The loopback port it listens on.
    pub port: u16,
    /// Who the server runs as when the tests run as root.
    owner: Option<(u32, u32)>,
    /// The certificate and key files of a server that accepts TLS connections only.
    tls: Option<(PathBuf, PathBuf)>,
}

/// The directory holding `initdb` and `pg_ctl`: `PG_BIN`, the `PATH`, or the newest
/// `/usr/lib/postgresql/<version>/bin` (Debian's layout).
fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("PG_BIN") {
        return PathBuf::from(dir);
    }
    let on_path = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .find(|dir| dir.join("initdb").is_file() && dir.join("pg_ctl").is_file())
    });
    if let Some(dir) = on_path {
        return dir;
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL must be installed (.ci/run installs it)")
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let version = entry.file_name().to_str()?.parse().ok()?;
            Some((version, entry.path().join("bin")))
        })
        .collect();
    versions.sort();
    versions
        .pop()
        .expect("no PostgreSQL under /usr/lib/postgresql")
        .1
}

/// The effective user id, from /proc.
fn euid() -> u32 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1)?.parse().ok())
        .unwrap()
}

/// The uid and gid of the `postgres` user, from /etc/passwd.
fn postgres_user() -> (u32, u32) {
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap();
    passwd
        .lines()
        .find_map(|line| {
            let fields: Vec<&str> = line.split(':').collect();
            (fields.first() == Some(&"postgres"))
                .then(|| Some((fields.get(2)?.parse().ok()?, fields.get(3)?.parse().ok()?)))
                .flatten()
        })
        .expect("running as root needs a `postgres` user (Debian's postgresql package adds it)")
}

impl PgServer {
    /// Runs `initdb` and `pg_ctl start` in a temp dir, on a free port.
    pub fn start() -> PgServer {
        PgServer::start_with(None)
    }

    /// A server that accepts TLS connections only (`ssl = on`, `hostssl` lines alone in
    /// `pg_hba.conf`), showing the server certificate of `certificates`.
    pub fn start_tls(certificates: &Certificates) -> PgServer {
        PgServer::start_with(Some(certificates))
    }

    fn start_with(certificates: Option<&Certificates>) -> PgServer {
        let owner = (euid() == 0).then(postgres_user);
        let dir = tempfile::tempdir().unwrap();
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).unwrap();
        }
        let tls = certificates.map(|certificates| certificates.install(dir.path(), owner));
        let server = PgServer {
            bin: bin_dir(),
            dir,
            port: free_port(),
            owner,
            tls,
        };
        let status = server
            .command("initdb")
            .arg("-D")
            .arg(server.data())
            .args([
                "-U",
                "oncedb",
                "--auth=trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ])
            .stdout(Stdio::null())
            .status()
            .expect("initdb must be installed (.ci/run installs PostgreSQL)");
        assert!(status.success(), "initdb failed");
        if server.tls.is_some() {
            let hba = "local all all trust\nhostssl all all 127.0.0.1/32 trust\n";
            std::fs::write(server.data().join("pg_hba.conf"), hba).unwrap();
        }
        server.pg_ctl_start();
        server
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn command(&self, program: &str) -> Command {
        let mut command = Command::new(self.bin.join(program));
        if let Some((uid, gid)) = self.owner {
            command.uid(uid).gid(gid);
        }
        command
    }

    fn pg_ctl_start(&self) {
        let mut options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -c unix_socket_directories={} -c max_connections=200",
            self.port,
            self.dir.path().display()
        );
        if let Some((cert, key)) = &self.tls {
            options += &format!(
                " -c ssl=on -c ssl_cert_file={} -c ssl_key_file={}",
                cert.display(),
                key.display()
            );
        }
        let status = self
            .command("pg_ctl")
            .arg("start")
            .arg("-w")
            .args(["-t", "60"])
            .arg("-D")
            .arg(self.data())
            .arg("-l")
            .arg(self.dir.path().join("server.log"))
            .args(["-o", &options])
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "pg_ctl start failed: {}", self.log());
    }

    /// The server log, for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    /// A libpq-style connection string for the `postgres` database.
    pub fn url(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=oncedb dbname=postgres connect_timeout=5",
            self.port
        )
    }

    /// The postmaster's pid, from `postmaster.pid`.
    pub fn postmaster(&self) -> Option<u32> {
        let pid = std::fs::read_to_string(self.data().join("postmaster.pid")).ok()?;
        pid.lines().next()?.trim().parse().ok()
    }

    /// A crash: SIGKILL to the postmaster and every backend, as an OOM kill or a power
    /// cut would leave it. Returns once they are gone.
    pub fn crash(&self) {
        let Some(postmaster) = self.postmaster() else {
            return;
        };
        let backends = children(postmaster);
        signal("KILL", &[postmaster]);
        signal("KILL", &backends);
        wait_for("PostgreSQL processes to die", || {
            !alive(postmaster) && backends.iter().all(|&pid| !alive(pid))
        });
        // pg_ctl detached the postmaster, so whatever reaps orphans here may leave it a
        // zombie, which the next postmaster would take for a live one.
        // The same holds for the socket's lock file.
        let _ = std::fs::remove_file(self.data().join("postmaster.pid"));
        let socket_lock = format!(".s.PGSQL.{}.lock", self.port);
        let _ = std::fs::remove_file(self.dir.path().join(socket_lock));
    }

    /// Starts the server again on the same data dir and port; it replays its WAL first.
    pub fn restart(&self) {
        self.pg_ctl_start();
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let _ = self
            .command("pg_ctl")
            .args(["stop", "-m", "immediate", "-w", "-D"])
            .arg(self.data())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        self.crash();
    }
}
