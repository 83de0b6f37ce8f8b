//! Chat templates: the Jinja template a model ships (`tokenizer_config.json`
//! or `chat_template.jinja` in a Hugging Face folder, `tokenizer.chat_template`
//! in a GGUF file), rendered with minijinja the way Hugging Face transformers
//! renders it with Jinja2: `trim_blocks`, `lstrip_blocks`, loop controls,
//! `raise_exception`, `strftime_now`, a Python-style `tojson`, and Python
//! string, dict and list methods.
//!
//! A template is untrusted input: it can only read the conversation it is
//! given (no loader, no files), its source and output are bounded, and each
//! render runs on a fuel budget that bounds both its steps and the memory it
//! allocates.

mod isolated;

use std::path::Path;

use minijinja::value::Value;
use minijinja::{AutoEscape, Environment, ErrorKind};
use serde::Serialize;
use serde_json::ser::{Formatter, PrettyFormatter, Serializer};

use crate::error::{Error, Result};
pub use isolated::{CHILD_ENV, RENDER_MEMORY_LIMIT, RENDER_TIME_LIMIT, serve_child_if_asked};

/// One turn of a conversation, as chat templates read it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// Longest template source accepted (real ones are a few KiB; tool-calling
/// ones up to some tens).
pub const MAX_TEMPLATE_BYTES: usize = 256 << 10;
/// Longest rendered prompt: far beyond any context kiln runs.
pub const MAX_RENDERED_BYTES: usize = 4 << 20;
/// minijinja fuel per render: one unit per instruction and per 64 bytes
/// allocated, so about 64 MiB of values at most. Rendering the SmolLM2
/// template for a 10-turn conversation takes a few hundred.
pub const RENDER_FUEL: u64 = 1_000_000;
/// Widest field a format spec may ask for (`'{:>N}'.format(x)`), and the
/// deepest `tojson(indent=N)`: real templates use a handful of spaces.
pub const MAX_FORMAT_WIDTH: usize = 4096;
pub const MAX_JSON_INDENT: usize = 64;
/// The most parts (items, keys, values) a value printed or serialised may
/// have, and how deeply they may nest. A namespace can be put inside its
/// own attribute (`{% set ns.x = [ns] %}`): printing that recursed until
/// the stack overflowed, whatever its size. Real templates print the
/// conversation, some hundreds of parts.
pub const MAX_PRINTED_PARTS: usize = 1 << 20;
pub const MAX_PRINTED_DEPTH: usize = 10_000;
/// The stack a render runs on. Printing, comparing or serialising a value
/// recurses once per level of nesting (dropping it too), and within its
/// fuel a template can nest a list about 110,000 deep (`{% set ns.x =
/// [ns.x] %}` in a loop): this stack holds 100,000 levels (the tests
/// measure it), where the server's threads overflowed and aborted the
/// process. It is reserved, not committed, until used.
const RENDER_STACK_BYTES: usize = 512 << 20;

const NAME: &str = "chat_template";

/// A compiled chat template and the special tokens it may print.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The source, for [`ChatTemplate::render_isolated`]'s child.
    source: String,
    origin: String,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`, a Hugging Face chat template; `origin` names where
    /// it came from in error messages (a file path). `bos_token` and
    /// `eos_token` are the texts of the model's special tokens, which
    /// templates print as `{{ bos_token }}` and `{{ eos_token }}`; the
    /// end-of-turn is `eos_token`.
    pub fn new(origin: &str, source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let invalid = |message: String| Error::ChatTemplate {
            origin: origin.into(),
            message,
        };
        if source.len() > MAX_TEMPLATE_BYTES {
            return Err(invalid(format!(
                "it is {} bytes long; kiln accepts up to {MAX_TEMPLATE_BYTES}{UNUSABLE}",
                source.len()
            )));
        }
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| invalid(e.to_string()))?,
        );
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_formatter(|out, state, value| {
            check_printable(value)?;
            minijinja::escape_formatter(out, state, value)
        });
        env.add_filter("string", |value: Value| {
            check_printable(&value)?;
            Ok::<_, minijinja::Error>(match value.as_str() {
                Some(_) => value,
                None => Value::from(value.to_string()),
            })
        });
        env.set_fuel(Some(RENDER_FUEL));
        env.set_unknown_method_callback(python_method);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_filter("join", join);
        env.add_template_owned(NAME, source.to_owned())
            .map_err(|e| invalid(describe(&e)))?;
        Ok(ChatTemplate {
            env,
            source: source.to_owned(),
            origin: origin.into(),
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        })
    }

    /// The template of a Hugging Face model folder: `chat_template.jinja` if
    /// there is one (as transformers saves it now), else `chat_template` in
    /// `tokenizer_config.json`; `None` when the folder has neither. Special
    /// tokens come from `tokenizer_config.json`.
    pub fn from_model_dir(dir: &Path) -> Result<Option<Self>> {
        let config_path = dir.join("tokenizer_config.json");
        let config = match read_bounded(&config_path)? {
            Some(text) => Some(parse_tokenizer_config(&config_path, &text)?),
            None => None,
        };
        let jinja_path = dir.join("chat_template.jinja");
        let (origin, source) = match read_bounded(&jinja_path)? {
            Some(source) => (jinja_path, source),
            None => match config.as_ref().and_then(|c| c.chat_template.clone()) {
                Some(source) => (config_path, source),
                None => return Ok(None),
            },
        };
        let (bos, eos) = config
            .map(|c| (c.bos_token, c.eos_token))
            .unwrap_or_default();
        Self::new(
            &origin.display().to_string(),
            &source,
            bos.as_deref().unwrap_or(""),
            eos.as_deref().unwrap_or(""),
        )
        .map(Some)
    }

    /// ChatML (`<|im_start|>role\n…<|im_end|>\n`), the format SmolLM2 and
    /// Qwen use; kiln's template for the embedded model.
    pub fn chatml() -> Self {
        Self::new("kiln's built-in ChatML", CHATML, "", "<|im_end|>")
            .expect("the built-in template compiles")
    }

    /// The text that ends an assistant turn.
    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }

    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    /// What the template writes right after an assistant message's text
    /// (Llama 3's `<|eot_id|>`, ChatML's `<|im_end|>\n`, Mistral's `</s>`),
    /// found by rendering an exchange; `None` when the template renders no
    /// such exchange or writes nothing after the reply.
    pub fn after_assistant_text(&self) -> Option<String> {
        const PROBE: &str = "kilnAssistantReplyProbe";
        let exchange = [
            Message::new("user", "Hello"),
            Message::new("assistant", PROBE),
        ];
        let rendered = self.render_bounded(&exchange, false).ok()?;
        let (_, after) = rendered.rsplit_once(PROBE)?;
        (!after.is_empty()).then(|| after.to_string())
    }

    /// The prompt for `messages`; with `add_generation_prompt`, ending where
    /// the assistant's next turn begins.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let failed = |message: String| Error::ChatTemplate {
            origin: self.origin.clone(),
            message,
        };
        let template = self
            .env
            .get_template(NAME)
            .map_err(|e| failed(describe(&e)))?;
        let context = minijinja::context! {
            messages => minijinja::value::Serde(messages),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        };
        let mut out = BoundedWriter::default();
        // On a stack of its own, deep enough for the deepest value the fuel
        // lets a template build; the thread's stack is reserved, not
        // touched, until used.
        let rendered = std::thread::scope(|scope| {
            std::thread::Builder::new()
                .name("kiln-chat-template".into())
                .stack_size(RENDER_STACK_BYTES)
                .spawn_scoped(scope, || {
                    // The render's state (and every value the template
                    // made) is dropped here too: dropping a nested value
                    // recurses as deeply as printing it.
                    template.render_captured_to(context, &mut out).map(drop)
                })
                .map(|thread| thread.join())
        });
        let rendered = match rendered {
            Ok(Ok(rendered)) => rendered,
            Ok(Err(panic)) => std::panic::resume_unwind(panic),
            Err(e) => return Err(failed(format!("cannot start a thread to render it: {e}"))),
        };
        match rendered {
            Ok(_) => String::from_utf8(out.bytes)
                .map_err(|_| failed("it rendered text that is not UTF-8".into())),
            Err(_) if out.overflowed => Err(failed(format!(
                "it rendered more than {MAX_RENDERED_BYTES} bytes{UNUSABLE}"
            ))),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(failed(format!(
                "rendering took more than kiln's budget ({RENDER_FUEL} steps of minijinja fuel){UNUSABLE}"
            ))),
            Err(e) => match rejection(&e) {
                Some(message) => Err(Error::ConversationRejected {
                    origin: self.origin.clone(),
                    message: message.to_owned(),
                }),
                None => Err(failed(describe(&e))),
            },
        }
    }
}

const CHATML: &str = "{% for message in messages %}\
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// A minijinja error as one line: what went wrong, where, and what to do.
fn describe(error: &minijinja::Error) -> String {
    let mut what = error.to_string();
    if let Some(line) = error.line()
        && !what.contains(NAME)
    {
        what.push_str(&format!(" (template line {line})"));
    }
    what + UNUSABLE
}

/// The template's own message when it rejected the conversation
/// (`raise_exception`): the conversation's fault, not the template's.
fn rejection(error: &minijinja::Error) -> Option<&str> {
    let detail = error.detail()?;
    (error.kind() == ErrorKind::InvalidOperation && detail.starts_with(REJECTED))
        .then(|| &detail[REJECTED.len()..])
}

/// The advice for a template kiln cannot use.
const UNUSABLE: &str =
    "; `kiln chat` needs a working template, `kiln generate` runs the model without one";

/// Output that refuses to grow past [`MAX_RENDERED_BYTES`].
#[derive(Default)]
struct BoundedWriter {
    bytes: Vec<u8>,
    overflowed: bool,
}

impl std::io::Write for BoundedWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len() + buf.len() > MAX_RENDERED_BYTES {
            self.overflowed = true;
            return Err(std::io::Error::other("rendered prompt too long"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

const REJECTED: &str = "the template rejected the conversation: ";

/// `raise_exception(message)`: templates call it to reject a conversation
/// (roles that do not alternate, a system message where none is allowed).
fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(
        ErrorKind::InvalidOperation,
        format!("{REJECTED}{message}"),
    ))
}

/// `strftime_now(format)`: the local date and time, as Python's `strftime`.
fn strftime_now(format: String) -> std::result::Result<String, minijinja::Error> {
    use std::fmt::Write;
    let mut out = String::new();
    write!(out, "{}", chrono::Local::now().format(&format)).map_err(|_| {
        minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: {format:?} is not a valid strftime format"),
        )
    })?;
    Ok(out)
}

/// `tojson` as transformers defines it: Python's `json.dumps` with
/// `ensure_ascii=False` — `", "` and `": "` between items, or `indent`
/// spaces per level.
fn tojson(
    value: Value,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    check_printable(&value)?;
    if indent.is_some_and(|n| n > MAX_JSON_INDENT) {
        return Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: an indent of more than {MAX_JSON_INDENT} spaces"),
        ));
    }
    // The output is bounded like the prompt it goes into.
    let mut out = BoundedWriter::default();
    let result = match indent {
        Some(n) => {
            let spaces = vec![b' '; n];
            value.serialize(&mut Serializer::with_formatter(
                &mut out,
                PrettyFormatter::with_indent(&spaces),
            ))
        }
        None => value.serialize(&mut Serializer::with_formatter(&mut out, PythonFormatter)),
    };
    result
        .map_err(|e| minijinja::Error::new(ErrorKind::BadSerialization, format!("tojson: {e}")))?;
    let text = String::from_utf8(out.bytes).expect("serde_json writes UTF-8");
    Ok(Value::from_safe_string(text))
}

/// `join`, charged by the size of what it builds: minijinja's own charges
/// an item at a time but lets the text grow unpaid when the separator is
/// empty (`(['x' * 1000000] * 1000) | join('')` built a gigabyte). Here the
/// string items are paid for by their bytes before anything is joined, and
/// a result longer than any prompt is refused; the builtin then joins.
fn join(
    state: &mut minijinja::State,
    value: &Value,
    joiner: Option<minijinja::value::StringInput<'_>>,
    attribute: Option<&str>,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<Value, minijinja::Error> {
    let separator = joiner.as_ref().map_or(0, |j| j.as_str().len());
    // Sized sequences (lists, lazy repeats and concatenations) can be walked
    // twice; a one-shot iterable has no size and is left to the builtin.
    if value.len().is_some() {
        let mut bytes = 0usize;
        for item in value.try_iter()? {
            let len = item.as_str().map_or(1, str::len) + separator;
            bytes = bytes.saturating_add(len);
            if bytes > MAX_RENDERED_BYTES {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("join: a result of more than {MAX_RENDERED_BYTES} bytes"),
                ));
            }
            state.consume_fuel(1 + len as u64 / 64)?;
        }
    }
    minijinja::filters::join(state, value, joiner, attribute, kwargs)
}

/// Walks `value` without recursing, and refuses it when printing it would
/// visit more than [`MAX_PRINTED_PARTS`] parts or nest deeper than
/// [`MAX_PRINTED_DEPTH`] (a value that contains itself does both). One-shot
/// iterables are not walked: walking would use them up.
fn check_printable(value: &Value) -> std::result::Result<(), minijinja::Error> {
    let refused = |what: String| minijinja::Error::new(ErrorKind::InvalidOperation, what);
    let mut pending = vec![(value.clone(), 0usize)];
    let mut parts = 0usize;
    while let Some((value, depth)) = pending.pop() {
        parts += 1;
        if parts > MAX_PRINTED_PARTS {
            return Err(refused(format!(
                "a value of more than {MAX_PRINTED_PARTS} parts (or one that contains itself) \
                 cannot be printed"
            )));
        }
        if depth > MAX_PRINTED_DEPTH {
            return Err(refused(format!(
                "a value nested more than {MAX_PRINTED_DEPTH} deep (or one that contains itself) \
                 cannot be printed"
            )));
        }
        match value.kind() {
            minijinja::value::ValueKind::Seq => {
                for item in value.try_iter()? {
                    pending.push((item, depth + 1));
                }
            }
            minijinja::value::ValueKind::Map => {
                for key in value.try_iter()? {
                    let item = value.get_item(&key)?;
                    pending.push((key, depth + 1));
                    pending.push((item, depth + 1));
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// Python's string, list and dict methods (minijinja-contrib's), with the
/// field widths of `str.format` bounded first: its implementation allocates
/// the width it is given before any fuel is charged.
fn python_method(
    state: &mut minijinja::State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> std::result::Result<Value, minijinja::Error> {
    if method == "format"
        && let Some(spec) = value.as_str()
    {
        check_format_widths(spec)?;
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// Refuses a `str.format` string with a number in a replacement field
/// (`{0:>N}`, `{:.N}`) above [`MAX_FORMAT_WIDTH`].
fn check_format_widths(spec: &str) -> std::result::Result<(), minijinja::Error> {
    let mut in_field = false;
    let mut number: usize = 0;
    for c in spec.chars() {
        match c {
            '{' => in_field = true,
            '}' => in_field = false,
            _ => {}
        }
        if in_field && let Some(digit) = c.to_digit(10) {
            number = number.saturating_mul(10).saturating_add(digit as usize);
            if number > MAX_FORMAT_WIDTH {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("str.format: a field wider than {MAX_FORMAT_WIDTH} characters"),
                ));
            }
        } else {
            number = 0;
        }
    }
    Ok(())
}

/// serde_json's compact output with Python's default separators.
struct PythonFormatter;

impl Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        item_separator(writer, first)
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        item_separator(writer, first)
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

/// Python's `", "` between the items of a list or an object.
fn item_separator<W: ?Sized + std::io::Write>(writer: &mut W, first: bool) -> std::io::Result<()> {
    if first {
        Ok(())
    } else {
        writer.write_all(b", ")
    }
}

/// The fields of `tokenizer_config.json` a chat needs.
#[derive(Default)]
struct TokenizerConfig {
    chat_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

/// Largest `tokenizer_config.json` or `chat_template.jinja` read (the former
/// lists every added token, some tens of KiB for large vocabularies).
const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// The text of `path`, `None` if it does not exist.
fn read_bounded(path: &Path) -> Result<Option<String>> {
    let io = |error| Error::Io {
        path: path.to_path_buf(),
        error,
    };
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io(e)),
    };
    if meta.len() > MAX_CONFIG_BYTES {
        return Err(Error::ChatTemplate {
            origin: path.display().to_string(),
            message: format!(
                "the file is {} bytes; kiln reads up to {MAX_CONFIG_BYTES}",
                meta.len()
            ),
        });
    }
    std::fs::read_to_string(path).map(Some).map_err(io)
}

fn parse_tokenizer_config(path: &Path, text: &str) -> Result<TokenizerConfig> {
    let invalid = |message: String| Error::ChatTemplate {
        origin: path.display().to_string(),
        message,
    };
    let json: serde_json::Value =
        serde_json::from_str(text).map_err(|e| invalid(format!("not valid JSON: {e}")))?;
    // A special token is its text, or an AddedToken object with `content`.
    let token = |key: &str| -> Result<Option<String>> {
        match json.get(key) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => match v.get("content").and_then(|c| c.as_str()) {
                Some(s) => Ok(Some(s.to_owned())),
                None => Err(invalid(format!(
                    "{key} is neither a string nor an object with \"content\""
                ))),
            },
        }
    };
    // The template is a string, or a list of named ones ("default" is used).
    let chat_template = match json.get("chat_template") {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(serde_json::Value::Array(list)) => {
            let named = |name: &str| {
                list.iter().find_map(|t| {
                    (t.get("name")?.as_str()? == name)
                        .then(|| t.get("template")?.as_str().map(str::to_owned))
                        .flatten()
                })
            };
            Some(named("default").ok_or_else(|| {
                invalid("chat_template is a list with no template named \"default\"".into())
            })?)
        }
        Some(_) => {
            return Err(invalid(
                "chat_template is neither a string nor a list".into(),
            ));
        }
    };
    Ok(TokenizerConfig {
        chat_template,
        bos_token: token("bos_token")?,
        eos_token: token("eos_token")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-135M-Instruct's template, as its GGUF file and its
    /// tokenizer_config.json carry it.
    pub const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn render(source: &str, messages: &[Message]) -> Result<String> {
        ChatTemplate::new("test", source, "<s>", "</s>")?.render(messages, true)
    }

    #[test]
    fn smollm2_chatml_renders_exactly() {
        let t = ChatTemplate::new("smollm2", SMOLLM2, "<|im_start|>", "<|im_end|>").unwrap();
        let prompt = t
            .render(
                &[Message::new("user", "What is the capital of France?")],
                true,
            )
            .unwrap();
        assert_eq!(
            prompt,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nWhat is the capital of France?<|im_end|>\n\
             <|im_start|>assistant\n"
        );
        let history = [
            Message::new("system", "Be brief."),
            Message::new("user", "Hi"),
            Message::new("assistant", "Hello!"),
            Message::new("user", "Bye"),
        ];
        assert_eq!(
            t.render(&history, false).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
        );
    }

    #[test]
    fn the_builtin_chatml_matches_smollm2_after_its_system_turn() {
        let messages = [Message::new("system", "S"), Message::new("user", "Q")];
        let smollm2 = ChatTemplate::new("smollm2", SMOLLM2, "", "<|im_end|>").unwrap();
        assert_eq!(
            ChatTemplate::chatml().render(&messages, true).unwrap(),
            smollm2.render(&messages, true).unwrap()
        );
    }

    #[test]
    fn hugging_face_helpers_work() {
        let user = [Message::new("user", "  hi  ")];
        // Python string methods, tojson with Python's separators, loop controls.
        let source = "{{ messages[0].content.strip().upper() }}|{{ messages | tojson }}|\
            {% for m in messages %}{% if m.role == 'user' %}{% break %}{% endif %}x{% endfor %}|\
            {{ {'a': [1, 2]} | tojson(indent=2) }}|{{ bos_token }}{{ eos_token }}";
        assert_eq!(
            render(source, &user).unwrap(),
            "HI|[{\"role\": \"user\", \"content\": \"  hi  \"}]||{\n  \"a\": [\n    1,\n    2\n  ]\n}|<s></s>"
        );
        let year = render("{{ strftime_now('%Y') }}", &user).unwrap();
        assert!(year.len() == 4 && year.starts_with('2'), "{year}");
    }

    /// Jinja2 as transformers configures it rendered these
    /// (scripts/chat_template_reference.py); minijinja must agree.
    #[test]
    fn renders_as_transformers_jinja2() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/chat_templates.json"
        );
        let cases: Vec<serde_json::Value> =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        assert_eq!(cases.len(), 48);
        for case in cases {
            let text = |key: &str| case[key].as_str().unwrap();
            let messages: Vec<Message> = case["messages"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| Message::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
                .collect();
            let template = ChatTemplate::new(
                text("template"),
                text("source"),
                text("bos_token"),
                text("eos_token"),
            )
            .unwrap();
            let rendered =
                template.render(&messages, case["add_generation_prompt"].as_bool().unwrap());
            match case.get("expected") {
                Some(expected) => assert_eq!(
                    rendered.unwrap(),
                    expected.as_str().unwrap(),
                    "{} {:?}",
                    text("template"),
                    messages
                ),
                None => {
                    let error = rendered.unwrap_err().to_string();
                    assert!(error.contains(text("error")), "{error}");
                }
            }
        }
    }

    #[test]
    fn trim_and_lstrip_blocks_are_on() {
        let source = "A\n  {% if true %}\nB\n  {% endif %}\nC";
        assert_eq!(render(source, &[]).unwrap(), "A\nB\nC");
    }

    #[test]
    fn template_errors_are_clear() {
        let user = [Message::new("user", "hi")];
        let cases = [
            ("{% if %}", "syntax error"),
            (
                "{{ raise_exception('roles must alternate') }}",
                "roles must alternate",
            ),
            ("{{ strftime_now('%Q') }}", "not a valid strftime format"),
            (
                "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                "budget",
            ),
            (
                "{{ 'x' * 3000000 }}{{ 'x' * 3000000 }}",
                "more than 4194304 bytes",
            ),
            // No includes, no loader: a template cannot read files.
            ("{% include '/etc/passwd' %}", "unknown statement include"),
            // Unbounded recursion is an error, not a stack overflow.
            (
                "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
                "recursion",
            ),
        ];
        for (source, expected) in cases {
            let error = render(source, &user).unwrap_err().to_string();
            assert!(error.contains("chat template from test"), "{error}");
            assert!(error.contains(expected), "{source}: {error}");
        }
        let long = "x".repeat(MAX_TEMPLATE_BYTES + 1);
        assert!(
            render(&long, &user)
                .unwrap_err()
                .to_string()
                .contains("bytes long")
        );
    }

    /// Templates that aborted kiln-server (a model file is untrusted): sizes
    /// that allocate before fuel is charged, and nesting deeper than a
    /// thread's stack.
    #[test]
    fn hostile_templates_get_errors_or_bounded_output_never_an_abort() {
        let user = [Message::new("user", "hi")];
        for (source, expected) in [
            ("{{ messages|tojson(indent=1000000000000) }}", "indent"),
            ("{{ messages|tojson(indent=65) }}", "indent"),
            ("{{ '{:>1000000000000}'.format('x') }}", "wider"),
            ("{{ '{0:.99999999999}'.format('x') }}", "wider"),
            ("{{ '%1000000000000s'|format('x') }}", "budget"),
        ] {
            let error = render(source, &user).unwrap_err().to_string();
            assert!(error.contains(expected), "{source}: {error}");
        }
        // Real widths and indents still work.
        assert_eq!(
            render("{{ '{:>4}|{:.2f}'.format('x', 1.5) }}", &user).unwrap(),
            "   x|1.50"
        );
        assert!(
            render("{{ messages|tojson(indent=4) }}", &user)
                .unwrap()
                .contains("    ")
        );
        // Nearly as deep as the fuel lets a template nest a list (about
        // 110,000 levels), then printed, serialised, compared, converted and
        // dropped: each recurses once per level. On a server thread's stack
        // each aborted the process.
        let deep = "{% set ns = namespace(x=[]) %}{% for j in range(10) %}\
            {% for i in range(10000) %}{% set ns.x = [ns.x] %}{% endfor %}{% endfor %}";
        for use_it in [
            "{{ ns.x }}",
            "{{ ns.x|tojson }}",
            "{{ ns.x|string|length }}",
        ] {
            let error = render(&format!("{deep}{use_it}"), &user).unwrap_err();
            assert!(
                error.to_string().contains("nested more than"),
                "{use_it}: {error}"
            );
        }
        assert_eq!(
            render(&format!("{deep}{{{{ ns.x == ns.x }}}}"), &user).unwrap(),
            "True"
        );
        // A namespace inside its own attribute: printing it never ended.
        let cycle = "{% set ns = namespace(x=[]) %}{% set ns.x = [ns, 1] %}";
        for use_it in [
            "{{ ns }}",
            "{{ ns.x }}",
            "{{ ns|tojson }}",
            "{{ ns.x|string }}",
        ] {
            let error = render(&format!("{cycle}{use_it}"), &user).unwrap_err();
            assert!(
                error.to_string().contains("contains itself"),
                "{use_it}: {error}"
            );
        }
        // Deeper, the fuel runs out first.
        let deeper = deep.replace("range(10)", "range(13)");
        let error = render(&format!("{deeper}{{{{ ns.x }}}}"), &user).unwrap_err();
        assert!(error.to_string().contains("budget"), "{error}");
        // Nesting in the source is refused by the parser.
        let literal = format!("{{{{ {}{} }}}}", "[".repeat(100_000), "]".repeat(100_000));
        let error = render(&literal, &user).unwrap_err().to_string();
        assert!(error.contains("recursion"), "{error}");
    }

    /// `join` with an empty separator let its result grow unpaid: a
    /// gigabyte from a one-line template. It is paid by its bytes now, and
    /// refused past the longest prompt; ordinary joins are unchanged.
    #[test]
    fn joins_are_charged_by_what_they_build() {
        let messages = [Message::new("user", "Hi")];
        let huge = render(
            "{{ (['x' * 1000000] * 1000) | join('') | length }}",
            &messages,
        );
        let error = huge.unwrap_err().to_string();
        assert!(error.contains("join: a result of more than"), "{error}");
        let many = render(
            "{{ (['x' * 1000] * 1000000) | join(',') | length }}",
            &messages,
        );
        assert!(many.is_err());
        let cases = [
            ("{{ (['ab'] * 3) | join(', ') }}", "ab, ab, ab"),
            ("{{ messages | join('|', attribute='role') }}", "user"),
            ("{{ 'abc' | join('-') }}", "a-b-c"),
            ("{{ [1, 2] | join }}", "12"),
        ];
        for (source, expected) in cases {
            assert_eq!(render(source, &messages).unwrap(), expected, "{source}");
        }
    }

    #[test]
    fn doubling_a_string_runs_out_of_fuel_not_memory() {
        let source = "{% set ns = namespace(s='x') %}{% for i in range(64) %}\
            {% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}";
        let error = render(source, &[]).unwrap_err().to_string();
        assert!(error.contains("budget"), "{error}");
    }

    #[test]
    fn tokenizer_config_forms() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| std::fs::write(dir.path().join(name), text).unwrap();
        assert!(ChatTemplate::from_model_dir(dir.path()).unwrap().is_none());

        write(
            "tokenizer_config.json",
            r#"{"bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>",
                "chat_template": [{"name": "tool_use", "template": "T"},
                                  {"name": "default", "template": "{{ bos_token }}D{{ eos_token }}"}]}"#,
        );
        let t = ChatTemplate::from_model_dir(dir.path()).unwrap().unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "<s>D</s>");
        assert_eq!(t.eos_token(), "</s>");

        // chat_template.jinja wins over tokenizer_config.json, as in transformers.
        write("chat_template.jinja", "J{{ eos_token }}");
        let t = ChatTemplate::from_model_dir(dir.path()).unwrap().unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "J</s>");

        write("tokenizer_config.json", r#"{"chat_template": 3}"#);
        let error = ChatTemplate::from_model_dir(dir.path())
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("tokenizer_config.json") && error.contains("neither"),
            "{error}"
        );
        write("tokenizer_config.json", "{");
        let error = ChatTemplate::from_model_dir(dir.path())
            .unwrap_err()
            .to_string();
        assert!(error.contains("not valid JSON"), "{error}");
    }
}
