//! `kiln chat`: one question from the command line, or a conversation on
//! the terminal (one line per turn, history kept until Ctrl-D), or one turn
//! per line of piped input.

use std::io::{BufRead, IsTerminal, Write};
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use kiln_core::{Backend, Chat, ChatTemplate, Model, SamplingParams};

use crate::print_text;

/// The options of `kiln chat` besides the model and backend.
#[derive(Clone, Debug, clap::Args)]
pub struct ChatOptions {
    /// Most tokens per reply (fewer when the context is fuller).
    #[arg(long, default_value_t = 512)]
    pub max_tokens: usize,
    /// 0 for greedy decoding.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Sample from the k most likely tokens only (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Sample from the smallest set of tokens whose probability reaches p.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// A system message to start the conversation with.
    #[arg(long)]
    pub system: Option<String>,
    /// Print each turn's rendered prompt to stderr.
    #[arg(long)]
    pub show_prompt: bool,
}

/// The pinned model `kiln chat` talks to when `--model` is left out.
pub const DEFAULT_MODEL: &str = "smollm2-135m-instruct";

/// The default model and its template. Asking `kiln chat` without `--model`
/// asks for this model, so a first use pulls it (pinned URL and sha256, with
/// a progress bar), saying so first; later uses read the cache.
pub fn default_model() -> Result<(Model, ChatTemplate)> {
    let pinned = kiln_core::pinned::find(DEFAULT_MODEL)
        .with_context(|| format!("nix/pins.json has no model {DEFAULT_MODEL}"))?;
    if pinned.check(kiln_core::pinned::Rehash::IfChanged)? != kiln_core::pinned::Pulled::Intact {
        eprintln!(
            "kiln chat: the default model, {DEFAULT_MODEL}, is not in the cache yet; pulling it \
             once (`kiln pull {DEFAULT_MODEL}`; pass --model to chat with another model)"
        );
        crate::pull::pull(DEFAULT_MODEL, false)?;
    }
    load(&pinned.pulled()?)
}

/// What `--model` names (a folder, a GGUF file or a pulled model's name) and
/// its chat template; a model without one is an error.
pub fn load(spec: &Path) -> Result<(Model, ChatTemplate)> {
    let (model, template) = load_with_template(spec)?;
    let template = template.with_context(|| {
        format!(
            "{} has no chat template (no chat_template.jinja or tokenizer_config.json chat_template \
             in a folder, no tokenizer.chat_template in a GGUF file); `kiln generate` runs the \
             model without one",
            spec.display()
        )
    })?;
    Ok((model, template))
}

/// What `--model` names and its chat template, if it has one.
pub fn load_with_template(spec: &Path) -> Result<(Model, Option<ChatTemplate>)> {
    if spec == Path::new(crate::backends::EMBEDDED) {
        return Ok((Model::embedded(), Some(ChatTemplate::chatml())));
    }
    let path = kiln_core::pinned::resolve(spec)?;
    let model = Model::load(&path)?;
    let template = if path.is_dir() {
        ChatTemplate::from_model_dir(&path)?
    } else {
        gguf_template(&model, &path)?
    };
    Ok((model, template))
}

/// The template a GGUF file carries, with its BOS and EOS spelled as the
/// vocabulary spells them (templates print them as text).
fn gguf_template(model: &Model, path: &Path) -> Result<Option<ChatTemplate>> {
    let Some(source) = &model.chat.template else {
        return Ok(None);
    };
    let spell = |id: Option<u32>| -> String {
        id.and_then(|id| model.tokenizer.vocabulary_entry(id))
            .unwrap_or_default()
    };
    let template = ChatTemplate::new(
        &path.display().to_string(),
        source,
        &spell(model.chat.bos),
        &spell(model.chat.eos),
    )?;
    Ok(Some(template))
}

/// Runs the chat: `question` alone if given, else the turns read from stdin.
pub fn run(
    model: &Model,
    template: ChatTemplate,
    backend: &mut dyn Backend,
    question: Option<&str>,
    options: &ChatOptions,
) -> Result<()> {
    let mut chat = Chat::new(model, template);
    if let Some(system) = &options.system {
        chat = chat.with_system(system);
    }
    if let Some(question) = question {
        return turn(&mut chat, backend, question, options, true);
    }
    let stdin = std::io::stdin();
    let interactive = stdin.is_terminal();
    if interactive {
        eprintln!(
            "kiln chat with {} on {}; Ctrl-D ends.",
            model.name,
            backend.name()
        );
    }
    let mut line = String::new();
    loop {
        if interactive {
            eprint!("> ");
            std::io::stderr().flush()?;
        }
        line.clear();
        if stdin.lock().read_line(&mut line).context("reading stdin")? == 0 {
            if interactive {
                eprintln!();
            }
            return Ok(());
        }
        let message = line.trim_end_matches(['\n', '\r']);
        if message.trim().is_empty() {
            continue;
        }
        turn(&mut chat, backend, message, options, !interactive)?;
    }
}

/// One exchange: the reply streamed to stdout, then a newline.
fn turn(
    chat: &mut Chat,
    backend: &mut dyn Backend,
    message: &str,
    options: &ChatOptions,
    report: bool,
) -> Result<()> {
    if options.max_tokens == 0 {
        bail!("--max-tokens must be positive");
    }
    if options.show_prompt {
        eprint!("{}", chat.prompt_for(message)?);
        eprintln!("[end of prompt]");
    }
    let sampling = SamplingParams {
        temperature: options.temperature,
        top_k: options.top_k,
        top_p: options.top_p,
        seed: options.seed,
    };
    let started = Instant::now();
    let mut stdout = std::io::stdout().lock();
    let reply = chat.reply(backend, message, options.max_tokens, sampling, |text| {
        print_text(&mut stdout, Some(text))
    })?;
    writeln!(stdout)?;
    if report {
        eprintln!(
            "[{}: {} prompt tokens, {} generated in {:.3}s; {}]",
            backend.name(),
            reply.prompt_tokens,
            reply.generated_tokens,
            started.elapsed().as_secs_f64(),
            if reply.ended_turn {
                "end of turn"
            } else {
                "stopped at the token limit"
            }
        );
    }
    Ok(())
}
