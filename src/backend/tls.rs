//! TLS for the shared stores, through rustls on the ring provider: the trusted roots are
//! the PEM certificates given in
//! [`StoreOptions::tls_root_certificates`](crate::StoreOptions::tls_root_certificates),
//! or the system's when none are given. Every connection verifies the server's
//! certificate chain and its name.

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

use crate::base::{Error, Result};

/// The certificates of `pem`, refused with [`Error::InvalidOptions`] when it holds none
/// or one that does not parse.
pub(crate) fn parse_roots(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|err| invalid(format!("bad PEM in the TLS root certificates: {err}")))?;
    if certs.is_empty() {
        return Err(invalid(
            "no certificate in the TLS root certificates".to_owned(),
        ));
    }
    Ok(certs)
}

/// A client configuration trusting the roots of `pem`, or the system's.
#[cfg(feature = "postgres")]
pub(crate) fn client_config(pem: Option<&[u8]>) -> Result<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    let certs = match pem {
        Some(pem) => parse_roots(pem)?,
        None => rustls_native_certs::load_native_certs().certs,
    };
    for cert in certs {
        roots
            .add(cert)
            .map_err(|err| invalid(format!("a TLS root certificate: {err}")))?;
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|err| invalid(format!("TLS protocol versions: {err}")))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// Makes ring the process's default provider unless one is set: the Redis client builds
/// its TLS configuration from the default, and finds none if the application's
/// dependencies enable more than one provider.
#[cfg(feature = "redis")]
pub(crate) fn install_default_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Losing a race to another installer is fine: a default is set either way.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

fn invalid(why: String) -> Error {
    Error::InvalidOptions(why)
}

/// Whether `err` or an error it wraps is a TLS failure (an untrusted certificate, a
/// failed handshake): found by type along the source chain, through the `io::Error`s
/// that TLS streams wrap their errors in, never by message text.
pub(crate) fn is_tls_failure(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(err);
    // A chain longer than this is not one a driver builds; stop rather than loop.
    for _ in 0..16 {
        let Some(err) = next else {
            return false;
        };
        if err.is::<rustls::Error>() {
            return true;
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && let Some(inner) = io.get_ref()
            && is_tls_failure_shallow(inner)
        {
            return true;
        }
        next = err.source();
    }
    false
}

/// One level of [`is_tls_failure`] inside an `io::Error`.
fn is_tls_failure_shallow(err: &(dyn std::error::Error + Send + Sync + 'static)) -> bool {
    err.is::<rustls::Error>()
        || err
            .downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::get_ref)
            .is_some_and(|inner| inner.is::<rustls::Error>())
}
