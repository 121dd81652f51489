//! [`Store::run_once`] on every store: the loop of [`Db::run_once`], asynchronous, with
//! the lease renewed by a timer beside the operation.

use std::future::Future;
use std::time::Duration;

use super::{Store, StoreLease};
use crate::api::{OnError, Once, Reservation, RunOnce, Scope, renew_every};
use crate::base::{Error, Result};

pub(super) async fn run_once<S, F, Fut, E>(
    store: &S,
    scope: &Scope,
    (key, request): (&[u8], &[u8]),
    how: RunOnce,
    operation: F,
) -> Result<Once<E>>
where
    S: Store,
    F: FnOnce(u64) -> Fut + Send,
    Fut: Future<Output = std::result::Result<Vec<u8>, E>> + Send,
    E: std::fmt::Display + Send,
{
    // Read the clock only when an attempt is in flight: the common call acquires.
    let mut deadline = None;
    loop {
        match store.reserve(scope, key, request).await? {
            Reservation::Acquired(lease) => {
                let output = kept_alive(&lease, store.lease_timeout(), operation).await;
                return finish(lease, how, output).await;
            }
            Reservation::InFlight { since, .. } => {
                let deadline =
                    *deadline.get_or_insert_with(|| tokio::time::Instant::from_std(how.deadline()));
                let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                if left.is_zero() {
                    return Err(Error::StillInFlight { since });
                }
                store.wait_finished(scope, key, left).await?;
            }
            Reservation::Completed(record)
            | Reservation::Failed(record)
            | Reservation::Expired(record) => return Ok(Once::Replayed(record)),
            Reservation::Mismatch => return Err(Error::RequestMismatch),
        }
    }
}

/// Runs `operation` while a timer renews `lease` every third of `lease_timeout` (if
/// set); the renewals stop when it returns, or after one is refused (the lease was
/// lost, and finishing will say so).
async fn kept_alive<L, F, Fut, T>(lease: &L, lease_timeout: Option<Duration>, operation: F) -> T
where
    L: StoreLease,
    F: FnOnce(u64) -> Fut,
    Fut: Future<Output = T>,
{
    let work = operation(lease.epoch());
    let Some(timeout) = lease_timeout else {
        return work.await;
    };
    let every = renew_every(timeout);
    let mut work = std::pin::pin!(work);
    let mut renewing = true;
    let mut next = tokio::time::Instant::now() + every;
    loop {
        tokio::select! {
            output = &mut work => return output,
            () = tokio::time::sleep_until(next), if renewing => {
                renewing = lease.keep_alive().await.is_ok();
                next = tokio::time::Instant::now() + every;
            }
        }
    }
}

async fn finish<L: StoreLease, E: std::fmt::Display>(
    lease: L,
    how: RunOnce,
    output: std::result::Result<Vec<u8>, E>,
) -> Result<Once<E>> {
    match output {
        Ok(output) => {
            lease.complete(&output).await?;
            Ok(Once::Ran(output))
        }
        Err(err) => {
            match how.on_error {
                OnError::Release => lease.release().await?,
                OnError::Fail => lease.fail(err.to_string().as_bytes()).await?,
            }
            Ok(Once::Errored(err))
        }
    }
}
