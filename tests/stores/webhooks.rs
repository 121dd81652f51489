//! The webhook receiver example (`examples/webhook_receiver.rs`) as a real server in a
//! child process, keyed by the `webhook-id` header: a duplicate delivery (also one with
//! a new timestamp, and sixteen at once) gets the stored answer and the handler runs
//! once per message id; a changed payload under one id is `422`.

use crate::support::ExampleServer;

use reqwest::StatusCode;

/// The example as a child process, SIGKILLed on drop.
struct Receiver(ExampleServer);

impl std::ops::Deref for Receiver {
    type Target = ExampleServer;

    fn deref(&self) -> &ExampleServer {
        &self.0
    }
}

impl Receiver {
    fn start(dir: &std::path::Path) -> Receiver {
        Receiver(ExampleServer::start("webhook_receiver", dir, &[]))
    }

    async fn deliver(&self, id: &str, body: &str) -> (StatusCode, Option<String>, String) {
        let response = self
            .http
            .post(format!("{}/webhooks", self.base))
            .header("webhook-id", id)
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
            .await
            .unwrap();
        let replayed = response
            .headers()
            .get("idempotent-replayed")
            .map(|v| v.to_str().unwrap().to_owned());
        (response.status(), replayed, response.text().await.unwrap())
    }

    async fn handled(&self) -> u64 {
        let text = self
            .http
            .get(format!("{}/handled", self.base))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.trim().parse().unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_delivery_gets_the_stored_answer_and_the_handler_runs_once() {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Receiver::start(dir.path());
    let event =
        |ts: u32| format!(r#"{{"type":"invoice.paid","data":{{"id":"in_1"}},"timestamp":{ts}}}"#);
    let first = receiver.deliver("msg_1", &event(1)).await;
    assert_eq!((first.0, first.1.as_deref()), (StatusCode::OK, None));
    let again = receiver.deliver("msg_1", &event(2)).await;
    assert_eq!(
        (again.0, again.1.as_deref()),
        (StatusCode::OK, Some("true"))
    );
    assert_eq!(again.2, first.2);
    // Sixteen redeliveries of a new message at once: one runs, fifteen replay.
    let mut deliveries = Vec::new();
    for ts in 0..16 {
        let (http, base) = (receiver.http.clone(), receiver.base.clone());
        let body = event(ts);
        deliveries.push(tokio::spawn(async move {
            let response = http
                .post(format!("{base}/webhooks"))
                .header("webhook-id", "msg_2")
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            (response.status(), response.text().await.unwrap())
        }));
    }
    let mut bodies = Vec::new();
    for delivery in deliveries {
        let (status, body) = delivery.await.unwrap();
        assert_eq!(status, StatusCode::OK);
        bodies.push(body);
    }
    bodies.dedup();
    assert_eq!(bodies.len(), 1, "every delivery got the one answer");
    assert_eq!(receiver.handled().await, 2);
    let changed = r#"{"type":"invoice.paid","data":{"id":"in_2"}}"#;
    assert_eq!(
        receiver.deliver("msg_1", changed).await.0,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(receiver.handled().await, 2);
}
