//! How messages leave the replica's stream: the segments and runs that left the store,
//! and the chunks a compaction replaced.
//!
//! A purge by subject is one request, but clustered nats-server releases before
//! [`FIXED_RELEASE`] replay it wrongly: a node that restarts and replays its Raft log
//! applies each purge by subject it finds there as a purge of the *whole stream* below the
//! purge's last sequence (nats-server#4196). A node restarted after a segment expired would
//! then hold a stream without its owner claim, its manifest and the live segments' first
//! chunks, and a restore served by it would fail or come back smaller. Against those
//! servers the store deletes messages one by one, by sequence, which every release
//! replays as written; it then keeps sealed segments as they were shipped (no compaction,
//! whose removals would cost a request a message).

use async_nats::jetstream::stream::{LastRawMessageErrorKind, Stream};

/// The first release whose clustered streams replay a purge by subject correctly.
const FIXED_RELEASE: (u64, u64, u64) = (2, 9, 18);

/// How the shipper removes messages from the replica's stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Removal {
    /// One purge request per subject: a fixed release, or a server outside a cluster
    /// (whose streams have no Raft log to replay).
    Purge,
    /// One delete request per message: a clustered server before [`FIXED_RELEASE`], or one
    /// whose version cannot be read.
    Delete,
}

impl Removal {
    /// The removal safe on the server the store connected to: `version` as the server's
    /// `INFO` gives it, `clustered` whether it runs in a cluster.
    pub(super) fn for_server(version: &str, clustered: bool) -> Removal {
        if !clustered {
            return Removal::Purge;
        }
        match parse_version(version) {
            Some(found) if found >= FIXED_RELEASE => Removal::Purge,
            _ => Removal::Delete,
        }
    }

    /// Whether sealed segments are compacted (shipped again in whole chunks, the older
    /// chunks then removed).
    pub(super) fn compacts(self) -> bool {
        self == Removal::Purge
    }

    /// Removes the messages on `subject` below sequence `below` (all of them if `None`).
    /// A deletion removes at most `budget` messages and takes them from it. Whether
    /// nothing is left to remove; an error is JetStream's, to try again.
    pub(super) async fn remove(
        self,
        stream: &Stream,
        subject: &str,
        below: Option<u64>,
        budget: &mut usize,
    ) -> Result<bool, String> {
        match self {
            Removal::Purge => {
                let purge = stream.purge().filter(subject);
                match below {
                    Some(below) => purge.sequence(below).await,
                    None => purge.await,
                }
                .map_err(|err| err.to_string())?;
                Ok(true)
            }
            Removal::Delete => delete_below(stream, subject, below, budget).await,
        }
    }
}

/// Deletes the messages on `subject` below `below`, oldest first, at most `budget`.
async fn delete_below(
    stream: &Stream,
    subject: &str,
    below: Option<u64>,
    budget: &mut usize,
) -> Result<bool, String> {
    let mut from = 1;
    loop {
        let next = stream
            .raw_message_builder()
            .sequence(from)
            .next_by_subject(subject)
            .send()
            .await;
        let sequence = match next {
            Ok(message) => message.sequence,
            Err(err) if err.kind() == LastRawMessageErrorKind::NoMessageFound => return Ok(true),
            Err(err) => return Err(err.to_string()),
        };
        if below.is_some_and(|below| sequence >= below) {
            return Ok(true);
        }
        if *budget == 0 {
            return Ok(false);
        }
        // `false` is a message already gone (a delete whose answer was lost, sent again).
        stream
            .delete_message(sequence)
            .await
            .map_err(|err| err.to_string())?;
        *budget -= 1;
        from = sequence + 1;
    }
}

/// `major.minor.patch` of a server version such as `2.9.10` or `2.10.0-beta.3`.
fn parse_version(version: &str) -> Option<(u64, u64, u64)> {
    let core = version.trim_start_matches('v');
    let core = core.split(['-', '+']).next()?;
    let mut parts = core.split('.').map(str::parse::<u64>);
    let major = parts.next()?.ok()?;
    let minor = parts.next()?.ok()?;
    let patch = parts.next().unwrap_or(Ok(0)).ok()?;
    Some((major, minor, patch))
}

#[cfg(test)]
mod tests {
    use super::{Removal, parse_version};

    #[test]
    fn clustered_servers_before_the_fix_delete_message_by_message() {
        for version in ["2.9.10", "2.9.17", "2.8.4", "v2.2.0", "", "not a version"] {
            assert_eq!(
                Removal::for_server(version, true),
                Removal::Delete,
                "{version}"
            );
        }
        for version in ["2.9.18", "2.9.25", "2.10.0-beta.3", "2.11.1", "3.0.0"] {
            assert_eq!(
                Removal::for_server(version, true),
                Removal::Purge,
                "{version}"
            );
        }
        assert_eq!(Removal::for_server("2.9.10", false), Removal::Purge);
        assert_eq!(parse_version("2.10.0-RC.1"), Some((2, 10, 0)));
        assert_eq!(parse_version("2.9"), Some((2, 9, 0)));
        assert!(Removal::Purge.compacts() && !Removal::Delete.compacts());
    }
}
