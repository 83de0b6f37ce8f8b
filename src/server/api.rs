//! The OpenAI request bodies kiln-server reads, and their validation into
//! an engine [`Request`]. Fields kiln does not implement are refused by name
//! rather than ignored, so that a client never gets silently different
//! behaviour; fields that change nothing (`user`, `metadata`, ...) pass.

use kiln_core::{Message, SamplingParams};
use serde::Deserialize;
use serde_json::{Map, Value};

use super::error::ApiError;
use super::prompt::{Prompt, Request};

/// The body of either endpoint: chat needs `messages`, text completions
/// `prompt`. One flat struct, so that a field of the wrong type is named in
/// the error.
#[derive(Deserialize)]
pub struct Body {
    pub model: String,
    pub messages: Option<Vec<ChatMessage>>,
    pub prompt: Option<String>,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<u32>,
    /// Everything else, checked by [`refuse_unsupported`].
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

#[derive(Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: Content,
}

/// A message's content: a string, or text parts (other part types are
/// refused).
#[derive(Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// OpenAI allows at most 4 stop strings.
const MAX_STOPS: usize = 4;

/// Parameters that change what would be generated or returned, and that
/// kiln does not implement; refused unless given their neutral value.
fn refuse_unsupported(rest: &Map<String, Value>) -> Result<(), ApiError> {
    for (name, value) in rest {
        let neutral = match name.as_str() {
            // Harmless: bookkeeping that does not change the output.
            "user" | "metadata" | "store" | "service_tier" => true,
            "tools" | "functions" | "logit_bias" => {
                value.is_null()
                    || value.as_array().is_some_and(|a| a.is_empty())
                    || value.as_object().is_some_and(|o| o.is_empty())
            }
            "tool_choice" | "function_call" => value.is_null() || value == "none",
            "parallel_tool_calls" => true,
            "logprobs" | "echo" => value.is_null() || value == false,
            "top_logprobs" => value.is_null() || value == 0,
            "best_of" => value.is_null() || value == 1,
            "frequency_penalty" | "presence_penalty" => {
                value.is_null() || value.as_f64() == Some(0.0)
            }
            "response_format" => value.is_null() || value.get("type").is_some_and(|t| t == "text"),
            "suffix" => value.is_null() || value == "",
            // Unknown names are ignored, as OpenAI's own server does for
            // fields newer than a client; known ones above are refused.
            _ => true,
        };
        if !neutral {
            return Err(ApiError::unsupported(name, &format!("= {value}")));
        }
    }
    Ok(())
}

impl Body {
    fn into_request(self, prompt: Prompt) -> Result<(Request, bool, bool), ApiError> {
        refuse_unsupported(&self.rest)?;
        if let Some(n) = self.n
            && n != 1
        {
            return Err(ApiError::unsupported("n", &format!("= {n} (only n = 1)")));
        }
        let max_tokens = match (self.max_completion_tokens, self.max_tokens) {
            (Some(m), _) | (None, Some(m)) => Some(m as usize),
            (None, None) => None,
        };
        if max_tokens == Some(0) {
            return Err(ApiError::invalid_param(
                "max_tokens",
                "`max_tokens` must be at least 1",
            ));
        }
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid_param(
                "temperature",
                format!("`temperature` must be between 0 and 2, not {temperature}"),
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid_param(
                "top_p",
                format!("`top_p` must be in (0, 1], not {top_p}"),
            ));
        }
        let stop = match self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s],
            Some(Stop::Many(v)) => v,
        };
        if stop.len() > MAX_STOPS {
            return Err(ApiError::invalid_param(
                "stop",
                format!("at most {MAX_STOPS} stop strings, not {}", stop.len()),
            ));
        }
        let include_usage = self.stream_options.is_some_and(|o| o.include_usage);
        let request = Request {
            prompt,
            max_tokens,
            sampling: SamplingParams {
                temperature,
                top_k: 0,
                top_p,
                // OpenAI's seed is any integer; kiln's generator takes its bits.
                seed: self.seed.unwrap_or(0) as u64,
            },
            stop,
        };
        Ok((request, self.stream, include_usage))
    }

    /// The engine request, whether to stream, and whether to end a stream
    /// with usage.
    pub fn into_chat_request(mut self) -> Result<(Request, bool, bool), ApiError> {
        let given = self.messages.take().ok_or_else(|| {
            ApiError::invalid_param("messages", "a chat completion needs `messages`")
        })?;
        if given.is_empty() {
            return Err(ApiError::invalid_param(
                "messages",
                "`messages` must not be empty",
            ));
        }
        let mut messages = Vec::with_capacity(given.len());
        for (i, m) in given.into_iter().enumerate() {
            if !matches!(
                m.role.as_str(),
                "system" | "developer" | "user" | "assistant"
            ) {
                return Err(ApiError::unsupported(
                    &format!("messages[{i}].role"),
                    &format!("= {:?} (only system, developer, user, assistant)", m.role),
                ));
            }
            let content = match m.content {
                Content::Text(text) => text,
                Content::Parts(parts) => {
                    let mut text = String::new();
                    for part in parts {
                        match (part.kind.as_str(), part.text) {
                            ("text", Some(t)) => text.push_str(&t),
                            (kind, _) => {
                                return Err(ApiError::unsupported(
                                    &format!("messages[{i}].content"),
                                    &format!("part of type {kind:?} (only text)"),
                                ));
                            }
                        }
                    }
                    text
                }
            };
            // Templates know `system`; `developer` is its newer name.
            let role = if m.role == "developer" {
                "system"
            } else {
                &m.role
            };
            messages.push(Message::new(role, &content));
        }
        self.into_request(Prompt::Chat(messages))
    }

    pub fn into_completion_request(mut self) -> Result<(Request, bool, bool), ApiError> {
        let prompt = self
            .prompt
            .take()
            .ok_or_else(|| ApiError::invalid_param("prompt", "a text completion needs `prompt`"))?;
        self.into_request(Prompt::Text(prompt))
    }
}

/// Parses a JSON body, a 400 naming what is wrong otherwise.
pub fn parse(body: &[u8]) -> Result<Body, ApiError> {
    let json = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(json).map_err(|e| {
        let path = e.path().to_string();
        let message = format!("the request body is not a valid request: {}", e.inner());
        if path == "." {
            ApiError::invalid(message)
        } else {
            ApiError::invalid_param(&path, format!("{message} (at `{path}`)"))
        }
    })
}
