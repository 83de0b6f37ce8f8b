//! The speculative decoding options the CLI and the benchmark share, and the
//! proposers they name.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use kiln_core::{Backend, Model, ModelDraft, PromptLookup, Proposer};

use crate::backends::{self, BackendKind, BackendOptions};

/// How draft tokens are proposed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ProposerKind {
    /// The continuation of the longest recent n-gram match in the prompt
    /// and output (no second model).
    PromptLookup,
    /// A smaller model with the same tokenizer (--draft-model).
    Draft,
    /// The model's own first --draft-layers layers with its final norm and
    /// output head.
    #[value(name = "self")]
    SelfSpeculation,
}

/// The largest `--draft-tokens`: the IREE backends' largest multi-token
/// step (`kiln_xla::APPEND_ROWS`) holds 16 rows, the drafts and the token
/// before them.
pub const MAX_DRAFT_TOKENS: usize = 15;

#[derive(Clone, Debug, clap::Args)]
pub struct SpeculationArgs {
    /// Speculative decoding: propose tokens this way and check them all in
    /// one pass of the model. Greedy: exactly the tokens generated without
    /// it; sampling: the same distribution (rejection sampling).
    #[arg(long, value_enum)]
    pub speculate: Option<ProposerKind>,
    /// With --speculate: the most tokens proposed per step.
    #[arg(long, default_value_t = 4, requires = "speculate",
          value_parser = clap::value_parser!(u16).range(1..=MAX_DRAFT_TOKENS as i64))]
    pub draft_tokens: u16,
    /// With --speculate draft: the draft model (a GGUF file, a folder or a
    /// pulled model's name), run on the same backend as the model.
    #[arg(long, requires = "speculate")]
    pub draft_model: Option<PathBuf>,
    /// With --speculate self: how many of the model's first layers draft
    /// (default: a quarter of them).
    #[arg(long, requires = "speculate")]
    pub draft_layers: Option<usize>,
}

impl SpeculationArgs {
    /// Refuses options of another proposer.
    pub fn check(&self) -> Result<()> {
        match self.speculate {
            Some(ProposerKind::Draft) if self.draft_model.is_none() => {
                bail!(
                    "--speculate draft needs --draft-model PATH (a smaller model with the same tokenizer)"
                )
            }
            Some(kind) if kind != ProposerKind::Draft && self.draft_model.is_some() => {
                bail!("--draft-model is for --speculate draft")
            }
            Some(kind) if kind != ProposerKind::SelfSpeculation && self.draft_layers.is_some() => {
                bail!("--draft-layers is for --speculate self")
            }
            _ => Ok(()),
        }
    }

    /// The draft model the proposer runs, if it runs one.
    pub fn draft_model(&self, target: &Model) -> Result<Option<Model>> {
        draft_model(
            self.speculate,
            target,
            self.draft_model.as_deref(),
            self.draft_layers,
        )
    }
}

/// The draft model of `kind` for `target`: loaded from `path` (`draft`) or
/// `target`'s first `layers` (`self`); `None` for prompt lookup.
pub fn draft_model(
    kind: Option<ProposerKind>,
    target: &Model,
    path: Option<&Path>,
    layers: Option<usize>,
) -> Result<Option<Model>> {
    match kind {
        Some(ProposerKind::Draft) => {
            let path = path.context("--speculate draft needs --draft-model PATH")?;
            let draft = backends::load_model(Some(path))?;
            if draft.config.vocab_size != target.config.vocab_size {
                bail!(
                    "the draft model {} has a vocabulary of {} tokens and {} of {}: a draft must \
                     share the model's tokenizer",
                    path.display(),
                    draft.config.vocab_size,
                    target.name,
                    target.config.vocab_size
                );
            }
            Ok(Some(draft))
        }
        Some(ProposerKind::SelfSpeculation) => {
            let layers = layers.unwrap_or(target.config.num_layers.div_ceil(4));
            Ok(Some(target.first_layers(layers)?))
        }
        Some(ProposerKind::PromptLookup) | None => Ok(None),
    }
}

/// The proposer of `kind`; a draft model runs on `backend` like the model.
pub fn proposer<'m>(
    kind: ProposerKind,
    draft: Option<&'m Model>,
    backend: BackendKind,
    options: &BackendOptions,
) -> Result<Box<dyn Proposer + 'm>> {
    proposer_on(kind, draft, |draft| backends::open(draft, backend, options))
}

/// [`proposer`], with the draft model's backend opened by `open`.
pub fn proposer_on<'m>(
    kind: ProposerKind,
    draft: Option<&'m Model>,
    open: impl FnOnce(&'m Model) -> Result<Box<dyn Backend + 'm>>,
) -> Result<Box<dyn Proposer + 'm>> {
    let name = match kind {
        ProposerKind::PromptLookup => return Ok(Box::new(PromptLookup::default())),
        ProposerKind::Draft => "draft",
        ProposerKind::SelfSpeculation => "self",
    };
    let draft = draft.with_context(|| format!("--speculate {name} needs its draft model"))?;
    Ok(Box::new(ModelDraft::new(name, open(draft)?)))
}
