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

/// The model `kiln chat` uses when `--model` is left out, and its template.
///
/// Today: the embedded model (random weights) with kiln's ChatML template,
/// so the command works offline. Once pinned models can be pulled, this
/// becomes the pinned `smollm2-135m-instruct`, pulled on first use.
pub fn default_model() -> Result<(Model, ChatTemplate)> {
    eprintln!(
        "note: chatting with kiln's embedded model (random weights, so its replies are noise); \
         pass --model for a real one"
    );
    Ok((Model::embedded(), ChatTemplate::chatml()))
}

/// A model folder and its chat template; a folder without one is an error.
pub fn load(path: &Path) -> Result<(Model, ChatTemplate)> {
    let model = Model::load(path)?;
    let template = ChatTemplate::from_model_dir(path)?.with_context(|| {
        format!(
            "{} has no chat template (no chat_template.jinja, and no chat_template in \
             tokenizer_config.json); `kiln generate` runs the model without one",
            path.display()
        )
    })?;
    Ok((model, template))
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
