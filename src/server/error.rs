//! Errors in OpenAI's JSON shape (`{"error": {"message", "type", "param",
//! "code"}}`), each with its HTTP status.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds, for 429 and 503.
    pub retry_after: Option<u32>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn invalid_param(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            param: Some(param.into()),
            ..ApiError::invalid(message)
        }
    }

    pub fn unsupported(param: &str, what: &str) -> ApiError {
        ApiError {
            code: Some("unsupported_parameter"),
            ..ApiError::invalid_param(
                param,
                format!("`{param}` {what} is not supported by kiln-server"),
            )
        }
    }

    pub fn context_length(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::invalid_param(param, message)
        }
    }

    pub fn unauthorized() -> ApiError {
        ApiError {
            code: Some("invalid_api_key"),
            ..ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                "missing or wrong API key: send `Authorization: Bearer KEY` with the server's key",
            )
        }
    }

    pub fn model_not_found(asked: &str, served: &str) -> ApiError {
        ApiError {
            code: Some("model_not_found"),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("the model `{asked}` does not exist; this server serves `{served}`"),
            )
        }
    }

    pub fn not_found(path: &str) -> ApiError {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!(
                "no route {path}; see GET /v1/models, POST /v1/completions, POST /v1/chat/completions"
            ),
        )
    }

    pub fn queue_full(capacity: usize) -> ApiError {
        ApiError {
            retry_after: Some(1),
            code: Some("queue_full"),
            ..ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                format!("the request queue is full ({capacity} waiting); retry later"),
            )
        }
    }

    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError {
            retry_after: Some(1),
            ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
        }
    }

    pub fn too_large(limit: usize) -> ApiError {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("the request body is larger than the server's limit of {limit} bytes"),
        )
    }

    pub fn timeout(seconds: u64) -> ApiError {
        ApiError {
            code: Some("timeout"),
            ..ApiError::new(
                StatusCode::GATEWAY_TIMEOUT,
                "server_error",
                format!(
                    "the request ran longer than the server's --request-timeout of {seconds} s"
                ),
            )
        }
    }

    /// The body did not arrive whole in time (408): a client that stalls
    /// mid-body holds a connection and its buffer no longer than this.
    pub fn body_timeout(seconds: u64) -> ApiError {
        ApiError {
            code: Some("request_timeout"),
            ..ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                format!(
                    "the request body did not arrive within {seconds} s (the server's --idle-timeout, \
                     or --request-timeout if shorter); send it whole, at once"
                ),
            )
        }
    }

    /// How a request that ends with this error is counted in `/metrics`.
    pub fn outcome(&self) -> &'static str {
        match self.status {
            StatusCode::GATEWAY_TIMEOUT => "timeout",
            StatusCode::SERVICE_UNAVAILABLE => "shutdown",
            status if status.is_client_error() => "invalid",
            _ => "error",
        }
    }

    /// The model's own chat template failed (not the conversation): the
    /// server's fault, named so that its operator can act.
    pub fn template_failed(message: impl Into<String>) -> ApiError {
        ApiError {
            code: Some("chat_template_failed"),
            ..ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
        }
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The JSON body (also sent as an event inside a stream).
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}
