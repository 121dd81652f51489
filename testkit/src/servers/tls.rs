//! A certificate authority of the tests' own and a server certificate it signed, for
//! servers that speak TLS on loopback: valid for `localhost` and `127.0.0.1`, written
//! as PEM files into a temp dir.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};

/// The authority's certificate and a server certificate with its key, on disk.
pub struct Certificates {
    dir: tempfile::TempDir,
    /// The authority's certificate, PEM: what a client trusts.
    pub ca_pem: String,
}

impl Certificates {
    /// A fresh authority and a server certificate it signed.
    pub fn generate() -> Certificates {
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();
        let mut server =
            CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
        server
            .extended_key_usages
            .push(ExtendedKeyUsagePurpose::ServerAuth);
        let key = KeyPair::generate().unwrap();
        let cert = server.signed_by(&key, &ca).unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
        std::fs::write(dir.path().join("server.pem"), cert.pem()).unwrap();
        std::fs::write(dir.path().join("server.key"), key.serialize_pem()).unwrap();
        Certificates {
            dir,
            ca_pem: ca.pem(),
        }
    }

    /// Another authority's certificate, PEM: one that signed nothing the servers show.
    pub fn stranger() -> String {
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();
        ca.pem()
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The authority's certificate file.
    pub fn ca_file(&self) -> PathBuf {
        self.path("ca.pem")
    }

    /// The server certificate file.
    pub fn cert_file(&self) -> PathBuf {
        self.path("server.pem")
    }

    /// The server key file.
    pub fn key_file(&self) -> PathBuf {
        self.path("server.key")
    }

    /// Copies the server's certificate and key into `dir` (the key readable by its owner
    /// only, as PostgreSQL demands) and returns their paths.
    pub fn install(&self, dir: &Path, owner: Option<(u32, u32)>) -> (PathBuf, PathBuf) {
        use std::os::unix::fs::PermissionsExt;
        let (cert, key) = (dir.join("server.pem"), dir.join("server.key"));
        std::fs::copy(self.cert_file(), &cert).unwrap();
        std::fs::copy(self.key_file(), &key).unwrap();
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::chown(&cert, Some(uid), Some(gid)).unwrap();
            std::os::unix::fs::chown(&key, Some(uid), Some(gid)).unwrap();
        }
        (cert, key)
    }
}
