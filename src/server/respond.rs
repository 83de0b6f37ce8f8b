//! OpenAI's response bodies and stream chunks for chat and text
//! completions, one request's engine events in, JSON out.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

use super::engine::Finish;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Endpoint {
    Chat,
    Completion,
}

/// Names one response (and all its chunks).
pub struct Ids {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub endpoint: Endpoint,
}

impl Ids {
    pub fn new(endpoint: Endpoint, model: &str) -> Ids {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let prefix = match endpoint {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completion => "cmpl",
        };
        Ids {
            id: format!(
                "{prefix}-kiln-{created:x}-{}",
                NEXT.fetch_add(1, Ordering::Relaxed)
            ),
            created,
            model: model.to_string(),
            endpoint,
        }
    }

    /// The whole response of a request that was not streamed.
    pub fn response(&self, text: &str, finish: &Finish) -> Value {
        let choice = match self.endpoint {
            Endpoint::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": null,
                "finish_reason": finish.reason.as_str(),
            }),
            Endpoint::Completion => json!({
                "index": 0,
                "text": text,
                "logprobs": null,
                "finish_reason": finish.reason.as_str(),
            }),
        };
        json!({
            "id": self.id,
            "object": self.object(false),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(finish),
        })
    }

    /// A stream chunk: the first (the assistant's role, for chat), one of
    /// text, or the last (with its finish reason). `with_usage` adds the
    /// `usage: null` that OpenAI sends on every chunk when usage comes at
    /// the end.
    pub fn chunk(&self, piece: Piece, with_usage: bool) -> Value {
        let (text, finish_reason) = match piece {
            Piece::Start => ("", None),
            Piece::Text(text) => (text, None),
            Piece::End(finish) => ("", Some(finish.reason.as_str())),
        };
        let choice = match self.endpoint {
            Endpoint::Chat => {
                let delta = match piece {
                    Piece::Start => json!({"role": "assistant", "content": ""}),
                    Piece::Text(_) => json!({"content": text}),
                    Piece::End(_) => json!({}),
                };
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason})
            }
            Endpoint::Completion => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish_reason})
            }
        };
        let mut chunk = self.envelope(vec![choice]);
        if with_usage {
            chunk["usage"] = Value::Null;
        }
        chunk
    }

    /// The chunk after the last one when `stream_options.include_usage` is
    /// set: no choices, the usage.
    pub fn usage_chunk(&self, finish: &Finish) -> Value {
        let mut chunk = self.envelope(Vec::new());
        chunk["usage"] = usage(finish);
        chunk
    }

    fn envelope(&self, choices: Vec<Value>) -> Value {
        json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completion, _) => "text_completion",
        }
    }
}

#[derive(Clone, Copy)]
pub enum Piece<'a> {
    Start,
    Text(&'a str),
    End(&'a Finish),
}

fn usage(finish: &Finish) -> Value {
    json!({
        "prompt_tokens": finish.prompt_tokens,
        "completion_tokens": finish.completion_tokens,
        "total_tokens": finish.prompt_tokens + finish.completion_tokens,
    })
}
