//! The optional bearer API key, compared in constant time. Both sides are
//! hashed first, so that the comparison does not reveal the key's length.

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::AppState;
use super::error::ApiError;

#[derive(Clone)]
pub struct ApiKey([u8; 32]);

impl ApiKey {
    pub fn new(key: &str) -> ApiKey {
        ApiKey(Sha256::digest(key.as_bytes()).into())
    }

    fn matches(&self, given: &str) -> bool {
        let given: [u8; 32] = Sha256::digest(given.as_bytes()).into();
        self.0.ct_eq(&given).into()
    }
}

pub async fn require_key(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let Some(key) = &state.api_key else {
        return next.run(request).await;
    };
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match given {
        Some(given) if key.matches(given) => next.run(request).await,
        _ => {
            state.shared.metrics.outcome("unauthorized");
            ApiError::unauthorized().into_response()
        }
    }
}
