//! A request's prompt made ready for the engine, on the HTTP side: the chat
//! template rendered (in a child process, bounded by the request's deadline),
//! the text tokenized and its length checked against the context. The engine
//! thread only ever receives token ids that fit, so nothing a client sends
//! can hold it: a template that never ends or a megabyte of digits costs the
//! request that sent it, not the requests decoding beside it.

use std::sync::Arc;
use std::time::Instant;

use kiln_core::{ChatTemplate, Message, Model, SamplingParams, Tokenizer};
use tokio::sync::Semaphore;

use super::error::ApiError;

/// A request's prompt as the client sent it.
pub enum Prompt {
    Text(String),
    Chat(Vec<Message>),
}

/// A parsed request, before its prompt is prepared.
pub struct Request {
    pub prompt: Prompt,
    /// At most this many tokens; up to the context's room when `None`.
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
}

/// The read-only part of the loaded model that validation needs; built by
/// the engine thread once the model is loaded, then shared.
pub struct Prompter {
    model_name: String,
    tokenizer: Tokenizer,
    /// With `--user-content-as-text`: the tokenizer reading special tokens
    /// as text, for what users wrote.
    user_text: Option<Tokenizer>,
    /// The model's chat template, if it has one (shared: it is read only).
    template: Option<Arc<ChatTemplate>>,
    /// The model's end-of-sequence ids: a text completion's stop tokens.
    eos_ids: Vec<u32>,
    /// A chat's stop tokens (computed once: it renders the template).
    chat_stops: Vec<u32>,
    max_context: usize,
    /// The most bytes of text one token stands for (see `encode_bounded`).
    longest_token_bytes: usize,
    /// Tokenizations and renders at once: one per core, so that a flood of
    /// long prompts queues here instead of taking every core from the
    /// engine.
    busy: Semaphore,
}

/// A prompt the engine can run: its ids fit the context with `max_tokens`.
pub struct Prepared {
    pub ids: Vec<u32>,
    pub stop_tokens: Vec<u32>,
    pub max_tokens: usize,
}

impl Prompter {
    pub fn new(
        model: &Model,
        template: Option<Arc<ChatTemplate>>,
        user_content_as_text: bool,
        max_context: usize,
    ) -> Prompter {
        let chat_stops = template
            .as_deref()
            .map(|t| kiln_core::chat::stop_tokens(&model.tokenizer, &model.config.eos_token_ids, t))
            .unwrap_or_default();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Prompter {
            model_name: model.name.clone(),
            tokenizer: model.tokenizer.clone(),
            user_text: user_content_as_text.then(|| model.tokenizer.with_special_tokens_as_text()),
            template,
            eos_ids: model.config.eos_token_ids.clone(),
            chat_stops,
            max_context,
            longest_token_bytes: model.tokenizer.longest_token_bytes().max(1),
            busy: Semaphore::new(cores),
        }
    }

    /// `prompt` tokenized and checked, by the request's `deadline`: a 504
    /// when it passes first (a render still running is killed then).
    pub async fn prepare(
        self: &Arc<Self>,
        prompt: Prompt,
        max_tokens: Option<usize>,
        deadline: Instant,
        timeout_seconds: u64,
    ) -> Result<Prepared, ApiError> {
        let timed_out = || ApiError::timeout(timeout_seconds);
        let _turn = tokio::time::timeout_at(deadline.into(), self.busy.acquire())
            .await
            .map_err(|_| timed_out())?
            .map_err(|_| ApiError::unavailable("the server is shutting down"))?;
        let this = Arc::clone(self);
        let work =
            tokio::task::spawn_blocking(move || this.prepare_now(prompt, max_tokens, deadline));
        match tokio::time::timeout_at(deadline.into(), work).await {
            Err(_) => Err(timed_out()),
            Ok(Err(_)) => Err(ApiError::internal("the prompt's preparation failed")),
            Ok(Ok(Err(PrepareError::PastDeadline))) => Err(timed_out()),
            Ok(Ok(Err(PrepareError::Api(error)))) => Err(error),
            Ok(Ok(Ok(prepared))) => Ok(prepared),
        }
    }

    fn prepare_now(
        &self,
        prompt: Prompt,
        max_tokens: Option<usize>,
        deadline: Instant,
    ) -> Result<Prepared, PrepareError> {
        let (ids, stop_tokens, param) = match prompt {
            Prompt::Text(text) => (
                self.encode_bounded(&text, "prompt", |t| self.tokenizer.encode(t))?,
                self.eos_ids.clone(),
                "prompt",
            ),
            Prompt::Chat(messages) => {
                let template = self.template.as_deref().ok_or_else(|| {
                    ApiError::invalid(format!(
                        "the model {} has no chat template; use /v1/completions",
                        self.model_name
                    ))
                })?;
                let ids = match &self.user_text {
                    Some(as_text) => {
                        self.encode_chat_keeping_user_text(template, as_text, messages, deadline)?
                    }
                    None => {
                        let rendered = render(template, &messages, deadline)?;
                        self.encode_bounded(&rendered, "messages", |t| {
                            self.tokenizer.encode_rendered(t)
                        })?
                    }
                };
                (ids, self.chat_stops.clone(), "messages")
            }
        };
        // A model that adds no BOS encodes "" to nothing: nothing to prefill.
        if ids.is_empty() {
            return Err(ApiError::invalid_param(
                param,
                "the prompt is empty (it encodes to no tokens and this model adds no \
                 beginning-of-sequence token); send at least one character",
            )
            .into());
        }
        let context = self.max_context;
        if ids.len() >= context {
            return Err(too_long(param, &format!("{} tokens long", ids.len()), context).into());
        }
        let room = context - ids.len();
        let max_tokens = match max_tokens {
            Some(max) if max > room => {
                return Err(ApiError::context_length(
                    "max_tokens",
                    format!(
                        "the prompt ({} tokens) and max_tokens ({max}) need {} positions and the \
                         model's context holds {context}; lower max_tokens or shorten the prompt",
                        ids.len(),
                        ids.len() + max
                    ),
                )
                .into());
            }
            Some(max) => max,
            None => room,
        };
        Ok(Prepared {
            ids,
            stop_tokens,
            max_tokens,
        })
    }

    /// `encode(text)`, unless `text` cannot fit the context, which is found
    /// without tokenizing it whole: first from its length in bytes (no token
    /// stands for more than `longest_token_bytes`; twice that, for
    /// normalizers that shorten text), then from a prefix of a few bytes a
    /// position, which a prompt of digits or symbols fills past the context.
    /// A refused megabyte costs milliseconds.
    fn encode_bounded(
        &self,
        text: &str,
        param: &str,
        encode: impl Fn(&str) -> kiln_core::Result<Vec<u32>>,
    ) -> Result<Vec<u32>, PrepareError> {
        let context = self.max_context;
        let encoded =
            |t: &str| encode(t).map_err(|e| ApiError::invalid_param(param, e.to_string()));
        if text.len() / 2 > context.saturating_mul(self.longest_token_bytes) {
            return Err(too_long(param, &format!("{} bytes long", text.len()), context).into());
        }
        let probe = context.saturating_mul(PROBE_BYTES_PER_POSITION);
        if text.len() > probe {
            let mut cut = probe;
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            let counted = encoded(&text[..cut])?.len();
            // The prefix's tokens may differ from the whole text's near the
            // cut by a few; the margin keeps the refusal certain.
            if counted > context + context / 8 {
                let what = format!(
                    "{} bytes long and its first {cut} are {counted} tokens",
                    text.len()
                );
                return Err(too_long(param, &what, context).into());
            }
        }
        Ok(encoded(text)?)
    }

    /// The prompt of `messages` with what users wrote encoded by `as_text`,
    /// so that a special token typed in a user turn stays text (a user
    /// cannot forge a system turn). Each user content is rendered as a
    /// marker that no message contains; the rendered text is split at the
    /// markers, the template's parts encoded as usual and each user's part
    /// as text. A template that changes or drops a user's content (so its
    /// marker is not found whole) is an error: the option cannot be kept
    /// with it.
    fn encode_chat_keeping_user_text(
        &self,
        template: &ChatTemplate,
        as_text: &Tokenizer,
        mut messages: Vec<Message>,
        deadline: Instant,
    ) -> Result<Vec<u32>, PrepareError> {
        let mut tag = 0u64;
        let marker = loop {
            let marker = format!("\u{E000}kiln-user-{tag}:");
            if !messages.iter().any(|m| m.content.contains(&marker)) {
                break marker;
            }
            tag += 1;
        };
        let mut users = Vec::new();
        for message in messages.iter_mut().filter(|m| m.role == "user") {
            let marked = format!("{marker}{}\u{E000}", users.len());
            users.push(std::mem::replace(&mut message.content, marked));
        }
        let rendered = render(template, &messages, deadline)?;
        // Bounded as a whole first: the pieces below are encoded one by one.
        let whole = rendered.len() + users.iter().map(String::len).sum::<usize>();
        if whole / 2 > self.max_context.saturating_mul(self.longest_token_bytes) {
            let what = format!("{whole} bytes long");
            return Err(too_long("messages", &what, self.max_context).into());
        }
        let encoded = |tokenizer: &Tokenizer, text: &str| {
            tokenizer
                .encode_rendered(text)
                .map_err(|e| ApiError::invalid_param("messages", e.to_string()))
        };
        let mut ids = Vec::new();
        let mut found = vec![false; users.len()];
        let mut rest = rendered.as_str();
        while let Some(at) = rest.find(&marker) {
            ids.extend(encoded(&self.tokenizer, &rest[..at])?);
            let after = &rest[at + marker.len()..];
            let index = after
                .find('\u{E000}')
                .and_then(|end| Some((after[..end].parse::<usize>().ok()?, end)))
                .filter(|(index, _)| *index < users.len());
            let Some((index, end)) = index else { break };
            ids.extend(encoded(as_text, &users[index])?);
            found[index] = true;
            rest = &after[end + '\u{E000}'.len_utf8()..];
        }
        if found.iter().any(|f| !f) || rest.contains(&marker) {
            return Err(ApiError::invalid_param(
                "messages",
                "this model's chat template changes or drops what users wrote, so the server's \
                 --user-content-as-text cannot keep it as text; restart the server without it",
            )
            .into());
        }
        ids.extend(encoded(&self.tokenizer, rest)?);
        Ok(ids)
    }
}

/// Bytes of a prompt's prefix tokenized per context position to find a
/// prompt that cannot fit: real text averages about 4 bytes a token.
const PROBE_BYTES_PER_POSITION: usize = 2;

enum PrepareError {
    /// The deadline passed while the template rendered.
    PastDeadline,
    Api(ApiError),
}

impl From<ApiError> for PrepareError {
    fn from(error: ApiError) -> Self {
        PrepareError::Api(error)
    }
}

/// `messages` through the model's template in a child process, killed at
/// the deadline. A conversation the template rejects is the client's
/// error; a template that fails, overruns its limits or crashes is the
/// server's (the model's), named as such.
fn render(
    template: &ChatTemplate,
    messages: &[Message],
    deadline: Instant,
) -> Result<String, PrepareError> {
    match template.render_isolated_until(messages, true, deadline) {
        Ok(text) => Ok(text),
        Err(_) if Instant::now() >= deadline => Err(PrepareError::PastDeadline),
        Err(error @ kiln_core::Error::ConversationRejected { .. }) => {
            Err(ApiError::invalid_param("messages", error.to_string()).into())
        }
        Err(error) => Err(ApiError::template_failed(error.to_string()).into()),
    }
}

fn too_long(param: &str, what: &str, context: usize) -> ApiError {
    ApiError::context_length(
        param,
        format!("the prompt is {what} and the model's context holds {context}; shorten it"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The pinned model's prompter at a context of `context` tokens.
    fn smollm2(context: usize) -> Option<Prompter> {
        static MODEL: std::sync::OnceLock<Option<Model>> = std::sync::OnceLock::new();
        let model = MODEL.get_or_init(|| {
            let path = kiln_core::testing::pulled_model("smollm2-135m-instruct")?;
            Some(Model::load_or_embedded(Some(&path)).unwrap())
        });
        Some(Prompter::new(model.as_ref()?, None, false, context))
    }

    /// Text of digits, letters, spaces, punctuation and multi-byte
    /// characters in runs: what tokenizes to many or few tokens a byte.
    fn text() -> impl Strategy<Value = String> {
        let run = prop_oneof![
            "[0-9]{1,400}",
            "[a-z ]{1,400}",
            "[!-/:-@]{1,200}",
            "(é|ß|日本|🙂| ){1,100}",
        ];
        proptest::collection::vec(run, 1..40).prop_map(|runs| runs.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// The refusal from a prompt's length or prefix is never wrong: a
        /// refused prompt's whole tokenization does not fit either, and an
        /// accepted one is tokenized exactly as a whole.
        #[test]
        fn refusing_early_agrees_with_tokenizing_whole(text in text(), context in 8usize..600) {
            let Some(prompter) = smollm2(context) else { return Ok(()) };
            let whole = prompter.tokenizer.encode(&text).unwrap();
            match prompter.encode_bounded(&text, "prompt", |t| prompter.tokenizer.encode(t)) {
                Ok(ids) => prop_assert_eq!(ids, whole),
                Err(PrepareError::Api(error)) => {
                    prop_assert!(whole.len() >= context, "{} tokens refused at {context}: {}", whole.len(), error.message);
                }
                Err(PrepareError::PastDeadline) => prop_assert!(false, "no deadline here"),
            }
        }
    }
}
