//! A conversation with a model: the history, rendered by the model's chat
//! template into a prompt for each turn, and each reply generated until an
//! end-of-turn or end-of-sequence token and streamed as text.

use crate::backend::Backend;
use crate::chat_template::{ChatTemplate, Message};
use crate::error::{Error, Result};
use crate::model::Model;
use crate::sampling::SamplingParams;
use crate::stream::TextStream;
use crate::tokenizer::Tokenizer;

/// One conversation; the backend is passed to each turn, so one backend can
/// serve several conversations in turn.
pub struct Chat<'m> {
    model: &'m Model,
    template: ChatTemplate,
    stop_tokens: Vec<u32>,
    messages: Vec<Message>,
}

/// What a turn produced.
#[derive(Debug)]
pub struct Reply {
    /// The assistant's text (what was streamed), without the end-of-turn token.
    pub text: String,
    pub prompt_tokens: usize,
    /// Generated tokens, the end-of-turn token included.
    pub generated_tokens: usize,
    /// Whether the model ended its turn (rather than reaching the token limit).
    pub ended_turn: bool,
}

impl<'m> Chat<'m> {
    /// A new conversation, generating until one of [`stop_tokens`].
    pub fn new(model: &'m Model, template: ChatTemplate) -> Chat<'m> {
        let stop_tokens = stop_tokens(&model.tokenizer, &model.config.eos_token_ids, &template);
        Chat {
            model,
            template,
            stop_tokens,
            messages: Vec::new(),
        }
    }

    /// Starts the conversation with a system message.
    pub fn with_system(mut self, system: &str) -> Self {
        self.messages.push(Message::new("system", system));
        self
    }

    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    pub fn stop_tokens(&self) -> &[u32] {
        &self.stop_tokens
    }

    /// The prompt the next turn would give the model for `user`'s message.
    /// The template came with the model file: it is rendered bounded in time
    /// and memory (in a child process where the program allows it).
    pub fn prompt_for(&self, user: &str) -> Result<String> {
        let mut messages = self.messages.clone();
        messages.push(Message::new("user", user));
        self.template.render_bounded(&messages, true)
    }

    /// Adds `user`'s message, generates the reply (at most `max_tokens`, and
    /// no more than the context has room for), hands its text to `on_text`
    /// as it becomes final, and adds it to the history. On an error the
    /// history is left as it was.
    pub fn reply(
        &mut self,
        backend: &mut dyn Backend,
        user: &str,
        max_tokens: usize,
        sampling: SamplingParams,
        mut on_text: impl FnMut(&str) -> Result<()>,
    ) -> Result<Reply> {
        let prompt = self.prompt_for(user)?;
        let prompt_ids = self.model.tokenizer.encode_rendered(&prompt)?;
        let room = backend.max_context().saturating_sub(prompt_ids.len());
        if room == 0 {
            return Err(Error::Invalid(format!(
                "the conversation is {} tokens long and the context holds {}; \
                 start a new chat (or raise --max-context for an IREE backend)",
                prompt_ids.len(),
                backend.max_context()
            )));
        }
        let mut text = TextStream::new(&self.model.tokenizer);
        let mut reply = String::new();
        let mut emit = |piece: Option<String>| -> Result<()> {
            if let Some(piece) = piece {
                on_text(&piece)?;
                reply.push_str(&piece);
            }
            Ok(())
        };
        let stop_tokens = &self.stop_tokens;
        let generated = crate::generate(
            backend,
            &prompt_ids,
            max_tokens.min(room),
            sampling,
            stop_tokens,
            |token| {
                if stop_tokens.contains(&token) {
                    return Ok(());
                }
                emit(text.push(token)?)
            },
        )?;
        emit(text.finish()?)?;
        let ended_turn = generated.last().is_some_and(|t| stop_tokens.contains(t));
        self.messages.push(Message::new("user", user));
        self.messages.push(Message::new("assistant", &reply));
        Ok(Reply {
            text: reply,
            prompt_tokens: prompt_ids.len(),
            generated_tokens: generated.len(),
            ended_turn,
        })
    }
}

/// The tokens that end a reply: every end-of-sequence id of the model
/// (`eos_ids`: `config.json` and `generation_config.json`, a GGUF file's
/// EOS, EOT and EOM), the template's `eos_token`, and the special token the
/// template writes right after an assistant's text. The last catches a file
/// whose EOS is not its end of turn (llama.cpp's Llama 3 vocabulary has
/// `<|end_of_text|>` for EOS while the instruct template ends turns with
/// `<|eot_id|>`), which would otherwise go on into turns the model invents.
pub fn stop_tokens(tokenizer: &Tokenizer, eos_ids: &[u32], template: &ChatTemplate) -> Vec<u32> {
    let mut stops = eos_ids.to_vec();
    stops.extend(tokenizer.token_to_id(template.eos_token()));
    let end_of_turn = template
        .after_assistant_text()
        .and_then(|after| tokenizer.encode_rendered(&after).ok())
        .and_then(|ids| ids.first().copied())
        .filter(|&id| tokenizer.is_special(id));
    stops.extend(end_of_turn);
    stops.sort_unstable();
    stops.dedup();
    stops
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chatml_model(dir: &std::path::Path) -> Model {
        crate::testing::chatml_model(dir, None).unwrap();
        Model::load(dir).unwrap()
    }

    #[test]
    fn a_turn_stops_at_the_templates_end_of_turn_token() {
        let dir = tempfile::tempdir().unwrap();
        let model = chatml_model(dir.path());
        assert_eq!(
            model.tokenizer.encode_rendered("\n").unwrap()[0],
            3 + 94 + 12 + 82 + 10
        );
        let mut backend = crate::CpuBackend::new(&model);
        let mut chat = Chat::new(&model, ChatTemplate::chatml());
        // config.json's EOS (0) and the template's `<|im_end|>` (2).
        assert_eq!(chat.stop_tokens(), &[0, 2]);

        let mut streamed = String::new();
        let reply = chat
            .reply(&mut backend, "Hello", 50, SamplingParams::default(), |t| {
                streamed.push_str(t);
                Ok(())
            })
            .unwrap();
        assert_eq!(reply.text, "Hi");
        assert_eq!(streamed, "Hi");
        assert!(reply.ended_turn);
        assert_eq!(reply.generated_tokens, 3);
        assert_eq!(
            chat.prompt_for("Again").unwrap(),
            "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nHi<|im_end|>\n\
             <|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n"
        );
        // The rendered prompt's special tokens are single ids, and no BOS is added.
        let ids = model
            .tokenizer
            .encode_rendered("<|im_start|>user\n")
            .unwrap();
        assert_eq!(ids[0], 1);
        assert_eq!(model.tokenizer.decode(&ids[1..]).unwrap(), "user\n");
    }

    /// A template whose `eos_token` is unset (or another token) still ends
    /// a reply at the special token it writes after the assistant's text;
    /// ordinary text written there is no stop.
    #[test]
    fn the_token_a_template_writes_after_a_reply_stops_it() {
        let dir = tempfile::tempdir().unwrap();
        let model = chatml_model(dir.path());
        let source = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}";
        let template = ChatTemplate::new("t", source, "", "").unwrap();
        assert_eq!(
            template.after_assistant_text().as_deref(),
            Some("<|im_end|>\n")
        );
        let eos = &model.config.eos_token_ids;
        assert_eq!(stop_tokens(&model.tokenizer, eos, &template), [0, 2]);
        let plain = ChatTemplate::new(
            "t",
            "{% for m in messages %}{{ m.content }}\n{% endfor %}",
            "",
            "",
        )
        .unwrap();
        assert_eq!(plain.after_assistant_text().as_deref(), Some("\n"));
        assert_eq!(stop_tokens(&model.tokenizer, eos, &plain), [0]);
    }

    #[test]
    fn without_the_end_of_turn_token_it_runs_to_the_limit() {
        let dir = tempfile::tempdir().unwrap();
        let model = chatml_model(dir.path());
        let mut backend = crate::CpuBackend::new(&model);
        // A template whose end-of-turn is not a token: only EOS (0) stops.
        let template = ChatTemplate::new("t", "{{ messages[0].content + '\\n' }}", "", "").unwrap();
        let mut chat = Chat::new(&model, template);
        let reply = chat
            .reply(&mut backend, "x", 6, SamplingParams::default(), |_| Ok(()))
            .unwrap();
        assert_eq!(reply.text, "Hi!!!");
        assert!(!reply.ended_turn);
    }

    #[test]
    fn a_conversation_longer_than_the_context_is_an_error_and_keeps_history() {
        let model = Model::embedded();
        let mut backend = crate::CpuBackend::new(&model);
        let mut chat = Chat::new(&model, ChatTemplate::chatml());
        let long = "x".repeat(300);
        let error = chat
            .reply(
                &mut backend,
                &long,
                8,
                SamplingParams::default(),
                |_| Ok(()),
            )
            .unwrap_err();
        assert!(error.to_string().contains("start a new chat"), "{error}");
        assert!(chat.messages().is_empty());
    }
}
