//! The speculative decoding options the CLI and the benchmark share.

use anyhow::{Result, bail};
use kiln_core::{PromptLookup, Proposer, SamplingParams};

/// How draft tokens are proposed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ProposerKind {
    /// The continuation of the longest recent n-gram match in the prompt
    /// and output (no second model).
    PromptLookup,
}

impl ProposerKind {
    pub fn proposer(self) -> Box<dyn Proposer> {
        match self {
            ProposerKind::PromptLookup => Box::new(PromptLookup::default()),
        }
    }
}

/// The largest `--draft-tokens`: the IREE backends' largest multi-token
/// step (`kiln_xla::APPEND_ROWS`) holds 16 rows, the drafts and the token
/// before them.
pub const MAX_DRAFT_TOKENS: usize = 15;

#[derive(Clone, Debug, clap::Args)]
pub struct SpeculationArgs {
    /// Speculative decoding: propose tokens this way and check them all in
    /// one pass of the model. Greedy only; the tokens are exactly those
    /// generated without it.
    #[arg(long, value_enum)]
    pub speculate: Option<ProposerKind>,
    /// With --speculate: the most tokens proposed per step.
    #[arg(long, default_value_t = 4, requires = "speculate",
          value_parser = clap::value_parser!(u16).range(1..=MAX_DRAFT_TOKENS as i64))]
    pub draft_tokens: u16,
}

impl SpeculationArgs {
    /// Refuses speculation with sampling: only greedy verification is
    /// implemented, and anything else would change the output distribution.
    pub fn check(&self, sampling: &SamplingParams) -> Result<()> {
        if self.speculate.is_some() && sampling.temperature != 0.0 {
            bail!(
                "--speculate checks proposed tokens against greedy choices only; \
                 drop --temperature (or set it to 0), or drop --speculate to sample"
            );
        }
        Ok(())
    }
}
