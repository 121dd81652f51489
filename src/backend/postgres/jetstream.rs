//! An outbox [`Publisher`] for NATS JetStream (feature `nats`): each message goes to one
//! subject with `Nats-Msg-Id` set to the outbox message id, so the stream's duplicate
//! window drops the re-sends of a relay that died between publishing and marking.

use async_nats::HeaderMap;
use async_nats::jetstream::Context;

use super::outbox::{OutboxMessage, Publisher};
use crate::base::{Error, Result};

fn nats_error(err: impl std::fmt::Display) -> Error {
    Error::Unavailable {
        engine: "nats",
        message: err.to_string(),
    }
}

/// Publishes outbox messages to a JetStream subject and waits for the stream's ack.
#[derive(Debug, Clone)]
pub struct JetStreamPublisher {
    context: Context,
    subject: String,
}

impl JetStreamPublisher {
    /// Publishes to `subject` (whose stream the caller creates) through `context`.
    pub fn new(context: Context, subject: impl Into<String>) -> Self {
        JetStreamPublisher {
            context,
            subject: subject.into(),
        }
    }
}

impl Publisher for JetStreamPublisher {
    async fn publish(&self, message: &OutboxMessage) -> Result<()> {
        let mut headers = HeaderMap::new();
        headers.insert(async_nats::header::NATS_MESSAGE_ID, message.id.as_str());
        headers.insert("Oncedb-Message-Type", message.message_type.as_str());
        headers.insert("Oncedb-Aggregate-Type", message.aggregate_type.as_str());
        headers.insert("Oncedb-Aggregate-Id", message.aggregate_id.as_str());
        let ack = self
            .context
            .publish_with_headers(
                self.subject.clone(),
                headers,
                message.payload.clone().into(),
            )
            .await
            .map_err(nats_error)?;
        ack.await.map_err(nats_error)?;
        Ok(())
    }
}
