//! A guarded request that outlives its client without a task of its own.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::BoxFuture;

/// Runs a future on the caller's task and, if the caller drops it before it ends, on a
/// task of its own from where it stopped: the work finishes either way, and a caller that
/// waits (nearly every one) pays no spawn and no wake-up of another thread. Answers
/// `None` if the future panicked; the panic is caught as a task would catch it, so it
/// ends this request and not the connection.
pub(super) struct Detaching<T: Send + 'static> {
    /// `None` once it ended (answered or panicked).
    future: Option<BoxFuture<T>>,
    /// Where the rest runs if the caller lets go.
    runtime: tokio::runtime::Handle,
}

impl<T: Send + 'static> Detaching<T> {
    /// `future`, to finish on the current runtime if dropped (panics outside a runtime,
    /// as `tokio::spawn` does).
    pub(super) fn new(future: BoxFuture<T>) -> Detaching<T> {
        Detaching {
            future: Some(future),
            runtime: tokio::runtime::Handle::current(),
        }
    }
}

impl<T: Send + 'static> Future for Detaching<T> {
    type Output = Option<T>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let Some(future) = self.future.as_mut() else {
            return Poll::Ready(None);
        };
        match std::panic::catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(value)) => {
                self.future = None;
                Poll::Ready(Some(value))
            }
            Err(_) => {
                self.future = None;
                Poll::Ready(None)
            }
        }
    }
}

impl<T: Send + 'static> Drop for Detaching<T> {
    fn drop(&mut self) {
        if let Some(future) = self.future.take() {
            // Detached: the task ends on its own, and nothing waits for its answer.
            drop(self.runtime.spawn(future));
        }
    }
}
