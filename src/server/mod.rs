//! kiln-server: the OpenAI API over HTTP (axum) in front of one engine
//! thread that owns the backend, joined by a bounded queue.

pub mod api;
pub mod auth;
pub mod engine;
pub mod error;
pub mod listen;
pub mod metrics;
pub mod prompt;
pub mod respond;
pub mod routes;
pub mod stop;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};

use engine::Queue;
use metrics::Metrics;

/// State the HTTP side and the engine thread share.
pub struct Shared {
    /// The model is loaded and the backend open (its modules prepared).
    pub ready: AtomicBool,
    /// Shutdown's grace period is over: the engine ends what it runs.
    pub cancel_all: AtomicBool,
    /// The HTTP side has stopped: the engine returns once its queue is empty.
    pub stopped: AtomicBool,
    pub metrics: Metrics,
    pub request_timeout: Duration,
}

impl Shared {
    pub fn new(request_timeout: Duration) -> Shared {
        Shared {
            ready: AtomicBool::new(false),
            cancel_all: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            metrics: Metrics::new(),
            request_timeout,
        }
    }
}

/// What the handlers read.
#[derive(Clone)]
pub struct AppState {
    pub shared: Arc<Shared>,
    pub queue: Queue,
    /// The loaded model's prompt preparation; `None` while it loads.
    pub prompter: tokio::sync::watch::Receiver<Option<Arc<prompt::Prompter>>>,
    /// The one model this server serves, as `/v1/models` names it.
    pub model_id: String,
    pub api_key: Option<auth::ApiKey>,
    pub body_limit: usize,
    /// How long a request's body may take to arrive (`--idle-timeout`).
    pub body_timeout: Duration,
}

pub fn router(state: AppState) -> Router {
    let protected = Router::new()
        .route("/v1/models", get(routes::models))
        .route("/v1/chat/completions", post(routes::chat_completions))
        .route("/v1/completions", post(routes::completions))
        .route("/metrics", get(routes::metrics))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::require_key,
        ));
    Router::new()
        .route("/health", get(routes::health))
        .merge(protected)
        .fallback(routes::not_found)
        .layer(DefaultBodyLimit::max(state.body_limit))
        .with_state(state)
}
