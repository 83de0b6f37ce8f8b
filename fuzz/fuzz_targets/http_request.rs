//! kiln-server's HTTP side as a client reaches it: any method, path,
//! headers and body through the router (authentication, body limits and
//! timeouts, JSON validation, routing, both response forms) on an
//! in-process service. Each request is answered, within seconds, with a
//! status other than 500: no panic, no hang. Prompts are prepared as the
//! server prepares them (the embedded model's tokenizer, ChatML rendered in
//! a child); the engine is a stand-in that answers every queued job at once
//! (the model is not what is fuzzed here).
//!
//! The input: the method (one byte), the path up to a newline, header lines
//! (`name: value`) up to an empty line, then the body.
#![no_main]

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::body::Body;
use axum::http::Request;
use kiln::server::engine::{self, Event, Finish, FinishReason};
use kiln::server::prompt::Prompter;
use kiln::server::{AppState, Shared, auth::ApiKey, router};
use libfuzzer_sys::fuzz_target;
use tower::ServiceExt;

struct Fixture {
    runtime: tokio::runtime::Runtime,
    app: axum::Router,
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let shared = Arc::new(Shared::new(Duration::from_secs(5)));
        shared
            .ready
            .store(true, std::sync::atomic::Ordering::Release);
        let (queue, jobs) = engine::queue(4);
        // The stand-in engine: every job gets its start, one piece of text
        // and its end.
        std::thread::spawn(move || {
            for job in jobs {
                let prompt_tokens = job.prompt.ids.len();
                let _ = job.events.send(Event::Started { prompt_tokens });
                let _ = job.events.send(Event::Text("x".into()));
                let _ = job.events.send(Event::Done(Finish {
                    reason: FinishReason::Length,
                    prompt_tokens: 1,
                    completion_tokens: 1,
                }));
            }
        });
        let model = kiln::backends::load_model(None).expect("the embedded model");
        let chatml = Arc::new(kiln_core::ChatTemplate::chatml());
        let prompter = Prompter::new(&model, Some(chatml), false, 256);
        let (_, prompter) = tokio::sync::watch::channel(Some(Arc::new(prompter)));
        let app = router(AppState {
            shared,
            queue,
            prompter,
            model_id: "embedded".into(),
            api_key: Some(ApiKey::new("sesame")),
            body_limit: 1 << 16,
            body_timeout: Duration::from_secs(2),
        });
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        Fixture { runtime, app }
    })
}

fuzz_target!(init: {
    // Chat requests render the template in a child, this executable, as
    // kiln-server does.
    kiln_core::chat_template::serve_child_if_asked();
    // A fuzzer whose children cannot render would answer every chat
    // request with a template failure and test nothing past it.
    let hello = [kiln_core::chat_template::Message::new("user", "hi")];
    let rendered = kiln_core::ChatTemplate::chatml().render_isolated(&hello, true);
    assert!(rendered.expect("the renderer child works").contains("hi"));
}, |data: &[u8]| {
    let Some((&method, rest)) = data.split_first() else {
        return;
    };
    let method = ["GET", "POST", "HEAD", "OPTIONS", "PUT", "DELETE"][method as usize % 6];
    let text = String::from_utf8_lossy(rest);
    let (head, body) = text.split_once("\n\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let path = lines.next().unwrap_or("/");
    let mut request = Request::builder().method(method).uri(path);
    for line in lines {
        if let Some((name, value)) = line.split_once(':') {
            request = request.header(name.trim(), value.trim());
        }
    }
    let Ok(request) = request.body(Body::from(body.to_owned())) else {
        return; // Not an HTTP request hyper would have handed over.
    };
    let fixture = fixture();
    let answered = fixture.runtime.block_on(async {
        let response = fixture.app.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), 16 << 20).await;
        (status, body.is_ok())
    });
    let (status, read) = answered;
    assert!(read, "the response body could not be read ({status})");
    assert_ne!(status.as_u16(), 500, "an internal error for a client's request");
});
