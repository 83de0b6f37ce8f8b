//! The HTTP handlers: validate, queue, then answer from the engine's events
//! as one JSON body or as server-sent events.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::time::Instant;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Request as HttpRequest, State};
use axum::http::{StatusCode, Uri, header};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::AppState;
use super::api;
use super::engine::{Event, Finish, Job};
use super::error::ApiError;
use super::prompt::{Prepared, Prompt, Request};
use super::respond::{Endpoint, Ids, Piece};

pub async fn health(State(state): State<AppState>) -> Response {
    if state.shared.ready.load(Ordering::Acquire) {
        Json(json!({"status": "ok"})).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "loading"})),
        )
            .into_response()
    }
}

pub async fn models(State(state): State<AppState>) -> Json<serde_json::Value> {
    Json(json!({
        "object": "list",
        "data": [{"id": state.model_id, "object": "model", "created": 0, "owned_by": "kiln"}],
    }))
}

pub async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.shared.metrics.render(),
    )
        .into_response()
}

pub async fn not_found(uri: Uri) -> ApiError {
    ApiError::not_found(uri.path())
}

pub async fn chat_completions(State(state): State<AppState>, request: HttpRequest) -> Response {
    complete(state, Endpoint::Chat, request).await
}

pub async fn completions(State(state): State<AppState>, request: HttpRequest) -> Response {
    complete(state, Endpoint::Completion, request).await
}

/// The whole body, within the body limit and the body timeout (or the
/// request's deadline, if sooner): a client that stalls mid-body is
/// answered 408 and its connection and buffer are freed.
async fn read_body(
    state: &AppState,
    request: HttpRequest,
    deadline: Instant,
) -> Result<Bytes, ApiError> {
    let body_deadline = deadline.min(Instant::now() + state.body_timeout);
    let read = axum::body::to_bytes(request.into_body(), state.body_limit);
    match tokio::time::timeout_at(body_deadline.into(), read).await {
        Err(_) => {
            let seconds = state.body_timeout.min(state.shared.request_timeout);
            Err(ApiError::body_timeout(seconds.as_secs()))
        }
        Ok(Ok(body)) => Ok(body),
        Ok(Err(error)) => {
            let too_large = std::error::Error::source(&error)
                .is_some_and(|e| e.is::<http_body_util::LengthLimitError>());
            Err(if too_large {
                ApiError::too_large(state.body_limit)
            } else {
                ApiError::invalid(format!("cannot read the request body: {error}"))
            })
        }
    }
}

/// A validated request, how to answer it, and the model it named.
struct Parsed {
    request: Request,
    stream: bool,
    include_usage: bool,
    model: String,
}

fn parse(state: &AppState, endpoint: Endpoint, body: &[u8]) -> Result<Parsed, ApiError> {
    let body = api::parse(body)?;
    let model = body.model.clone();
    let (request, stream, include_usage) = match endpoint {
        Endpoint::Chat => body.into_chat_request()?,
        Endpoint::Completion => body.into_completion_request()?,
    };
    if model != state.model_id {
        return Err(ApiError::model_not_found(&model, &state.model_id));
    }
    Ok(Parsed {
        request,
        stream,
        include_usage,
        model,
    })
}

async fn complete(state: AppState, endpoint: Endpoint, request: HttpRequest) -> Response {
    let metrics = &state.shared.metrics;
    // One deadline from the request's head to its last token: the body's
    // arrival, the queue, prefill and decoding all count against it.
    let deadline = Instant::now() + state.shared.request_timeout;
    let parsed = match read_body(&state, request, deadline)
        .await
        .and_then(|body| parse(&state, endpoint, &body))
    {
        Ok(parsed) => parsed,
        Err(error) => {
            metrics.outcome(match error.status {
                StatusCode::PAYLOAD_TOO_LARGE => "too_large",
                StatusCode::REQUEST_TIMEOUT => "timeout",
                _ => "invalid",
            });
            return error.into_response();
        }
    };
    // A place in the queue first: requests being prepared count as queued.
    let place = match state.queue.reserve(&state.shared) {
        Ok(place) => place,
        Err(error) => {
            metrics.outcome("queue_full");
            return error.into_response();
        }
    };
    let Parsed {
        request,
        stream: streamed,
        include_usage,
        model,
    } = parsed;
    let prepared = match prepare(&state, request.prompt, request.max_tokens, deadline).await {
        Ok(prepared) => prepared,
        Err(error) => {
            metrics.outcome(error.outcome());
            return error.into_response();
        }
    };
    let (events, mut received) = mpsc::unbounded_channel();
    let job = Job {
        prompt: prepared,
        sampling: request.sampling,
        stop: request.stop,
        events,
        deadline,
        place: Some(place),
    };
    if let Err(error) = state.queue.submit(job) {
        metrics.outcome("shutdown");
        return error.into_response();
    }
    // The engine's errors come before any output. A request still queued at its deadline is answered here, not when the
    // engine reaches it; dropping `received` tells the engine, which counts
    // the timeout when it gets there.
    let first = tokio::time::timeout_at(deadline.into(), received.recv()).await;
    match first {
        Ok(Some(Event::Started { .. })) => {}
        Ok(Some(Event::Failed(error))) => return error.into_response(),
        Ok(Some(_) | None) => {
            return ApiError::internal("the engine stopped before answering").into_response();
        }
        Err(_) => {
            return ApiError::timeout(state.shared.request_timeout.as_secs()).into_response();
        }
    }
    let ids = Ids::new(endpoint, &model);
    if streamed {
        stream(ids, received, include_usage).into_response()
    } else {
        whole(ids, received).await
    }
}

/// The request's prompt made ready for the engine (rendered, tokenized,
/// checked against the context) off the engine thread, by its deadline. A
/// request that comes while the model loads waits for it.
async fn prepare(
    state: &AppState,
    prompt: Prompt,
    max_tokens: Option<usize>,
    deadline: Instant,
) -> Result<Prepared, ApiError> {
    let seconds = state.shared.request_timeout.as_secs();
    let mut loaded = state.prompter.clone();
    let prompter =
        match tokio::time::timeout_at(deadline.into(), loaded.wait_for(Option::is_some)).await {
            Err(_) => return Err(ApiError::timeout(seconds)),
            Ok(Err(_)) => return Err(ApiError::unavailable("the model could not be loaded")),
            Ok(Ok(prompter)) => prompter.clone().expect("waited for"),
        };
    prompter
        .prepare(prompt, max_tokens, deadline, seconds)
        .await
}

async fn whole(ids: Ids, mut received: mpsc::UnboundedReceiver<Event>) -> Response {
    let mut text = String::new();
    while let Some(event) = received.recv().await {
        match event {
            Event::Text(piece) => text.push_str(&piece),
            Event::Done(finish) => return Json(ids.response(&text, &finish)).into_response(),
            Event::Failed(error) => return error.into_response(),
            Event::Started { .. } => {}
        }
    }
    ApiError::internal("the engine stopped before the end of the reply").into_response()
}

/// Server-sent events: a task turns engine events into chunks. When the
/// client goes, the response body (and the receiver of the chunks) is
/// dropped, the task's send fails, it drops the engine's receiver, and the
/// engine cancels the sequence at its next step.
fn stream(
    ids: Ids,
    mut received: mpsc::UnboundedReceiver<Event>,
    include_usage: bool,
) -> Sse<ReceiverStream<Result<SseEvent, Infallible>>> {
    let (chunks, out) = mpsc::channel::<Result<SseEvent, Infallible>>(16);
    tokio::spawn(async move {
        let data = |value: serde_json::Value| Ok(SseEvent::default().data(value.to_string()));
        if chunks
            .send(data(ids.chunk(Piece::Start, include_usage)))
            .await
            .is_err()
        {
            return;
        }
        let mut finish: Option<Finish> = None;
        while let Some(event) = received.recv().await {
            let chunk = match &event {
                Event::Text(piece) => ids.chunk(Piece::Text(piece), include_usage),
                Event::Done(done) => {
                    finish = Some(*done);
                    ids.chunk(Piece::End(done), include_usage)
                }
                Event::Failed(error) => error.body(),
                Event::Started { .. } => continue,
            };
            if chunks.send(data(chunk)).await.is_err() {
                return;
            }
            if !matches!(event, Event::Text(_)) {
                break;
            }
        }
        if let Some(finish) = finish.filter(|_| include_usage) {
            let _ = chunks.send(data(ids.usage_chunk(&finish))).await;
        }
        let _ = chunks.send(Ok(SseEvent::default().data("[DONE]"))).await;
    });
    Sse::new(ReceiverStream::new(out))
}
