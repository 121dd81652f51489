//! TLS on the shared stores, against real servers that speak TLS only with a certificate
//! of the tests' own authority (the conformance suite runs over TLS too): the server's
//! chain is verified, a plain connection is refused by the server, and bad roots are
//! refused before connecting.

use std::time::Duration;

use oncedb::{Error, Guarded, OutagePolicy, PostgresStore, RedisStore, Scope, Store, StoreOptions};

use crate::support::servers::postgres::PgServer;
use crate::support::servers::redis::RedisServer;
use crate::support::servers::tls::Certificates;

fn options() -> StoreOptions {
    StoreOptions::new(Duration::from_secs(60))
        .connect_timeout(Duration::from_secs(2))
        .response_timeout(Duration::from_secs(2))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_verifies_the_server_and_never_falls_back_to_plain() {
    let certificates = Certificates::generate();
    let server = PgServer::start_tls(&certificates);
    let url = format!("{} sslmode=require", server.url());
    let trusted = options().tls_root_certificates(certificates.ca_pem.clone());
    let store = PostgresStore::connect_with(&url, trusted.clone()).unwrap();
    store.migrate().await.unwrap();
    assert!(store.insert_if_absent(b"k").await.unwrap());
    // The server takes TLS connections only: the calls above went over TLS.
    let plain = format!("{} sslmode=disable", server.url());
    let plain = PostgresStore::connect_with(&plain, trusted).unwrap();
    assert!(plain.insert_if_absent(b"k").await.is_err());
    // A certificate no trusted authority signed is refused, as with the system roots:
    // an authentication failure, which no outage policy runs unprotected.
    let stranger = options().tls_root_certificates(Certificates::stranger());
    let stranger = PostgresStore::connect_with(&url, stranger).unwrap();
    let err = stranger.insert_if_absent(b"k").await.unwrap_err();
    assert!(matches!(err, Error::Authentication { .. }), "{err}");
    let open = Guarded::new(stranger, OutagePolicy::FailOpen);
    assert!(matches!(
        open.reserve(&Scope::new("t", "op"), b"k", b"req").await,
        Err(Error::Authentication { .. })
    ));
    assert!(matches!(
        open.insert_many(vec![b"k".to_vec()]).await,
        Err(Error::Authentication { .. })
    ));
    assert_eq!(open.outages(), 0);
    let system = PostgresStore::connect_with(&url, options()).unwrap();
    assert!(matches!(
        system.insert_if_absent(b"k").await,
        Err(Error::Authentication { .. })
    ));
    // `prefer` would fall back to plain text: refused. No `sslmode` is plain text,
    // which this server refuses as it refuses `disable`.
    let prefer = format!("{} sslmode=prefer", server.url());
    assert!(matches!(
        PostgresStore::connect_with(&prefer, options()),
        Err(Error::InvalidOptions(_))
    ));
    let unnamed = PostgresStore::connect_with(&server.url(), options()).unwrap();
    assert!(matches!(
        unnamed.insert_if_absent(b"k").await,
        Err(Error::Authentication { .. })
    ));
    // Roots that are not PEM certificates are refused at connect.
    assert!(matches!(
        PostgresStore::connect_with(&url, options().tls_root_certificates("not a PEM")),
        Err(Error::InvalidOptions(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_verifies_the_server_and_never_falls_back_to_plain() {
    let certificates = Certificates::generate();
    let server = RedisServer::start_tls(&certificates);
    let url = server.url();
    assert!(url.starts_with("rediss://"));
    let trusted = options().tls_root_certificates(certificates.ca_pem.clone());
    let store = RedisStore::connect_with(&url, "tls", trusted.clone())
        .await
        .unwrap();
    assert!(store.insert_if_absent(b"k").await.unwrap());
    assert!(!store.insert_if_absent(b"k").await.unwrap());
    // No plain port: a `redis://` URL to the TLS port gets no answer.
    let plain = url.replacen("rediss://", "redis://", 1);
    assert!(
        RedisStore::connect_with(&plain, "tls", trusted)
            .await
            .is_err()
    );
    // A certificate no trusted authority signed is refused, as with the system roots.
    let stranger = options().tls_root_certificates(Certificates::stranger());
    let err = RedisStore::connect_with(&url, "tls", stranger)
        .await
        .err()
        .unwrap();
    assert!(matches!(err, Error::Authentication { .. }), "{err}");
    assert!(
        RedisStore::connect_with(&url, "tls", options())
            .await
            .is_err()
    );
    assert!(matches!(
        RedisStore::connect_with(&url, "tls", options().tls_root_certificates("not a PEM")).await,
        Err(Error::InvalidOptions(_))
    ));
}
