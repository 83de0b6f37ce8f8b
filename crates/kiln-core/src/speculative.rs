//! Lossless speculative decoding with greedy choice: a [`Proposer`] guesses
//! the next few tokens, the target model checks all of them in one
//! [`Backend::append`], and the longest prefix equal to the target's own
//! greedy choices is kept, followed by the target's next token. The tokens
//! are those [`crate::generate`] chooses, one for one; only the number of
//! passes over the weights changes.

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::sampling::{Sampler, SamplingParams, argmax};

/// Guesses how a token sequence goes on. More kinds (a draft model,
/// self-speculation) implement the same trait.
pub trait Proposer {
    /// A short name for reports (`prompt-lookup`).
    fn name(&self) -> &str;

    /// Up to `max` tokens expected to follow `tokens` (the prompt and every
    /// token generated so far); fewer or none when there is no good guess.
    fn propose(&mut self, tokens: &[u32], max: usize) -> Result<Vec<u32>>;
}

/// Prompt lookup: finds the most recent earlier occurrence of the sequence's
/// last n tokens (the longest n from `max_ngram` down to 1 that occurs) and
/// proposes what followed it (from an earlier occurrence if the latest is
/// followed by fewer tokens than asked for). It pays when the output repeats its input
/// (quoting, editing, summarising with the source's words) and needs no
/// second model.
#[derive(Clone, Debug)]
pub struct PromptLookup {
    pub max_ngram: usize,
}

impl Default for PromptLookup {
    fn default() -> PromptLookup {
        PromptLookup { max_ngram: 3 }
    }
}

impl Proposer for PromptLookup {
    fn name(&self) -> &str {
        "prompt-lookup"
    }

    fn propose(&mut self, tokens: &[u32], max: usize) -> Result<Vec<u32>> {
        Ok(self.lookup(tokens, max))
    }
}

impl PromptLookup {
    fn lookup(&self, tokens: &[u32], max: usize) -> Vec<u32> {
        if max == 0 {
            return Vec::new();
        }
        let len = tokens.len();
        for n in (1..=self.max_ngram.min(len.saturating_sub(1))).rev() {
            let suffix = &tokens[len - n..];
            // Matches that start before the suffix itself, latest first; the
            // continuation may run into the suffix (a repeating pattern). In
            // a repeating pattern the latest match leaves the fewest tokens
            // to propose, so an earlier one serves when it has more.
            let mut best: Option<&[u32]> = None;
            for start in (0..len - n).rev() {
                if &tokens[start..start + n] != suffix {
                    continue;
                }
                let from = start + n;
                let continuation = &tokens[from..len.min(from + max)];
                if best.is_none_or(|b| continuation.len() > b.len()) {
                    best = Some(continuation);
                }
                if continuation.len() == max {
                    break;
                }
            }
            if let Some(best) = best {
                return best.to_vec();
            }
        }
        Vec::new()
    }
}

/// A draft model's own greedy continuation: a smaller model sharing the
/// target's tokenizer (`draft`), or the target's first layers with its final
/// norm and output head (`self`, see [`crate::Model::first_layers`]). Its
/// cache follows the sequence: what the target rejected is rewound, what is
/// new is appended, so each proposal costs about K draft steps.
pub struct ModelDraft<'m> {
    name: &'static str,
    backend: Box<dyn Backend + 'm>,
    /// The tokens whose keys and values the draft's cache holds.
    cached: Vec<u32>,
}

impl<'m> ModelDraft<'m> {
    pub fn new(name: &'static str, backend: Box<dyn Backend + 'm>) -> ModelDraft<'m> {
        ModelDraft {
            name,
            backend,
            cached: Vec::new(),
        }
    }
}

impl Proposer for ModelDraft<'_> {
    fn name(&self) -> &str {
        self.name
    }

    fn propose(&mut self, tokens: &[u32], max: usize) -> Result<Vec<u32>> {
        // A draft that runs out of context has no guess; the target goes on.
        if max == 0 || tokens.is_empty() || tokens.len() + max > self.backend.max_context() {
            return Ok(Vec::new());
        }
        // Keep what the cache shares with `tokens`, but run at least the
        // last token again: its logits give the first draft.
        let shared = self
            .cached
            .iter()
            .zip(tokens)
            .take_while(|(a, b)| a == b)
            .count()
            .min(tokens.len() - 1);
        let mut next = if shared == 0 {
            argmax(&self.backend.prefill(tokens)?)
        } else {
            self.backend.rewind(shared)?;
            *self
                .backend
                .append_greedy(&tokens[shared..])?
                .last()
                .ok_or_else(|| Error::Backend("the draft backend chose no token".into()))?
        };
        self.cached = tokens.to_vec();
        let mut drafts = vec![next];
        while drafts.len() < max {
            next = self.backend.decode_greedy(next)?;
            self.cached.push(drafts[drafts.len() - 1]);
            drafts.push(next);
        }
        Ok(drafts)
    }
}

/// What speculation did during one generation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpeculationStats {
    /// Passes of the target over the weights after prefill (each a
    /// [`Backend::append`] or a plain one-token step).
    pub steps: usize,
    /// Tokens the proposer proposed and the target checked.
    pub proposed: usize,
    /// Proposed tokens equal to the target's greedy choice.
    pub accepted: usize,
    /// Tokens generated.
    pub generated: usize,
}

impl SpeculationStats {
    /// The fraction of proposed tokens the target accepted.
    pub fn acceptance_rate(&self) -> f64 {
        self.accepted as f64 / self.proposed.max(1) as f64
    }

    /// Tokens generated per pass of the target after prefill: 1 without
    /// speculation, up to K + 1 with K draft tokens.
    pub fn tokens_per_step(&self) -> f64 {
        // The first token comes from prefill.
        self.generated.saturating_sub(1) as f64 / self.steps.max(1) as f64
    }
}

/// Generates like [`crate::generate`] (the same stopping at `stop_tokens`
/// and `max_tokens`), asking `proposer` for up to `draft_tokens` tokens
/// before each pass of the target; see [`Speculator`] for the rule. Greedy:
/// exactly `generate`'s tokens. Sampling: the target's distribution.
// `generate`'s arguments plus the proposer and K.
#[allow(clippy::too_many_arguments)]
pub fn generate_speculative(
    backend: &mut dyn Backend,
    proposer: &mut dyn Proposer,
    draft_tokens: usize,
    prompt: &[u32],
    max_tokens: usize,
    sampling: SamplingParams,
    stop_tokens: &[u32],
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<(Vec<u32>, SpeculationStats)> {
    crate::generate::check_room(backend, prompt, max_tokens)?;
    let sampler = Sampler::new(sampling)?;
    if max_tokens == 0 {
        return Ok((Vec::new(), SpeculationStats::default()));
    }
    let (mut speculator, first) = Speculator::start(
        backend,
        proposer,
        draft_tokens,
        sampler,
        prompt,
        &mut || true,
    )?;
    let mut generated = Vec::with_capacity(max_tokens);
    let mut choices = vec![first];
    loop {
        for token in choices {
            generated.push(token);
            on_token(token)?;
            if stop_tokens.contains(&token) || generated.len() == max_tokens {
                let mut stats = speculator.stats();
                stats.generated = generated.len();
                return Ok((generated, stats));
            }
        }
        choices = speculator.step(max_tokens - generated.len())?;
    }
}

/// Speculative decoding one pass of the target at a time, for a caller that
/// stops on its own terms between passes (a server: stop strings, a client
/// gone, a deadline). Before each pass `proposer` guesses up to
/// `draft_tokens` tokens and one [`Backend::append`] checks them all.
/// Greedy: the longest prefix of drafts equal to the target's own choices
/// is kept, then the target's next token, so the tokens are exactly those of
/// plain greedy decoding. Sampling: each draft d is kept with the target's
/// probability p(d) of it, and the first one refused is replaced by a draw
/// from p without d (the drafts are deterministic, so this is the standard
/// rejection rule with a one-point draft distribution): every token has the
/// target's distribution. The backend must support [`Backend::append`] and
/// [`Backend::rewind`].
pub struct Speculator<'s, 'b> {
    backend: &'s mut (dyn Backend + 'b),
    proposer: &'s mut (dyn Proposer + 'b),
    draft_tokens: usize,
    sampler: Sampler,
    /// The prompt and every token handed out; the last is not yet in the
    /// backend's cache.
    tokens: Vec<u32>,
    stats: SpeculationStats,
}

impl<'s, 'b> Speculator<'s, 'b> {
    /// Prefills `prompt`, asking `keep_going` as it goes
    /// ([`Backend::prefill_until`]); returns the speculator and the first
    /// token. The caller checks that the prompt and its longest answer fit
    /// the backend's context.
    pub fn start(
        backend: &'s mut (dyn Backend + 'b),
        proposer: &'s mut (dyn Proposer + 'b),
        draft_tokens: usize,
        mut sampler: Sampler,
        prompt: &[u32],
        keep_going: &mut dyn FnMut() -> bool,
    ) -> Result<(Speculator<'s, 'b>, u32)> {
        let first = sampler.sample(&backend.prefill_until(prompt, keep_going)?)?;
        let mut tokens = prompt.to_vec();
        tokens.push(first);
        let speculator = Speculator {
            backend,
            proposer,
            draft_tokens,
            sampler,
            tokens,
            stats: SpeculationStats {
                generated: 1,
                ..SpeculationStats::default()
            },
        };
        Ok((speculator, first))
    }

    /// One pass of the target: the next tokens, one or more, in order. At
    /// most `room` more tokens are wanted, so no more than `room` are
    /// proposed: the cache never grows past the context the caller checked.
    /// Tokens after the one the caller stops at are simply not used.
    pub fn step(&mut self, room: usize) -> Result<Vec<u32>> {
        let pending = *self.tokens.last().expect("start pushed a token");
        let wanted = self.draft_tokens.min(room);
        let mut drafts = self.proposer.propose(&self.tokens, wanted)?;
        drafts.truncate(wanted);
        self.stats.steps += 1;
        let choices = if drafts.is_empty() {
            vec![if self.sampler.is_greedy() {
                self.backend.decode_greedy(pending)?
            } else {
                self.sampler.sample(&self.backend.decode(pending)?)?
            }]
        } else {
            // The cache holds every token but `pending`; check pending and
            // the drafts in one step. Row i's choice follows drafts[..i].
            let start = self.tokens.len() - 1;
            let mut step = Vec::with_capacity(drafts.len() + 1);
            step.push(pending);
            step.extend_from_slice(&drafts);
            let choices = if self.sampler.is_greedy() {
                accept_greedy(&self.backend.append_greedy(&step)?, &drafts)?
            } else {
                accept_sampled(&mut self.sampler, &self.backend.append(&step)?, &drafts)?
            };
            let accepted = choices.len() - 1;
            self.stats.proposed += drafts.len();
            self.stats.accepted += accepted;
            // Keep pending and the accepted drafts; the last choice is the
            // new pending token.
            self.backend.rewind(start + 1 + accepted)?;
            choices
        };
        self.tokens.extend_from_slice(&choices);
        self.stats.generated += choices.len();
        Ok(choices)
    }

    /// What speculation did so far; `generated` counts every token handed
    /// out, including any the caller did not use.
    pub fn stats(&self) -> SpeculationStats {
        self.stats
    }
}

/// The greedy choices of one step's rows while each confirms its draft,
/// then the first that does not (or the one after the last draft).
fn accept_greedy(greedy: &[u32], drafts: &[u32]) -> Result<Vec<u32>> {
    if greedy.len() != drafts.len() + 1 {
        return Err(Error::Backend(format!(
            "the backend chose {} tokens for {} appended tokens",
            greedy.len(),
            drafts.len() + 1
        )));
    }
    let mut choices = Vec::with_capacity(greedy.len());
    for (i, &choice) in greedy.iter().enumerate() {
        choices.push(choice);
        if drafts.get(i) != Some(&choice) {
            break;
        }
    }
    Ok(choices)
}

/// The rejection rule on one step's rows of logits: each draft kept with
/// its probability, the first refused one replaced by a draw from the rest
/// of the distribution; after the last kept draft, a draw from its row.
fn accept_sampled(sampler: &mut Sampler, logits: &[f32], drafts: &[u32]) -> Result<Vec<u32>> {
    let rows = drafts.len() + 1;
    if logits.is_empty() || !logits.len().is_multiple_of(rows) {
        return Err(Error::Backend(format!(
            "the backend returned {} logits for {rows} appended tokens",
            logits.len()
        )));
    }
    let mut choices = Vec::with_capacity(rows);
    for (i, row) in logits.chunks_exact(logits.len() / rows).enumerate() {
        let mut distribution = sampler.distribution(row)?;
        let Some(&draft) = drafts.get(i) else {
            choices.push(sampler.draw(&distribution));
            break;
        };
        let p = distribution
            .iter()
            .find(|(t, _)| *t == draft)
            .map_or(0.0, |(_, p)| *p);
        if sampler.accept(p) {
            choices.push(draft);
            continue;
        }
        distribution.retain(|(t, _)| *t != draft);
        choices.push(sampler.draw(&distribution));
        break;
    }
    Ok(choices)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_lookup_proposes_what_followed_the_longest_latest_match() {
        let lookup = PromptLookup::default();
        // "1 2 3" occurs at 0 (then 4 5) and the latest match of "2 3" is at
        // 6 (then 9); the 3-gram wins over the later 2-gram.
        let tokens = [1, 2, 3, 4, 5, 8, 2, 3, 9, 1, 2, 3];
        assert_eq!(lookup.lookup(&tokens, 2), vec![4, 5]);
        // Only a 1-gram matches: its latest occurrence.
        assert_eq!(lookup.lookup(&[7, 1, 7, 2, 6, 7], 3), vec![2, 6, 7]);
        // A repeating pattern runs into the suffix.
        assert_eq!(lookup.lookup(&[5, 6, 5, 6], 4), vec![5, 6]);
        // In a run, the latest match leaves 1 token; earlier ones more.
        assert_eq!(lookup.lookup(&[7, 7, 7, 7, 7], 3), vec![7, 7]);
        assert_eq!(lookup.lookup(&[7, 7, 7, 7, 7, 7, 7, 7], 3), vec![7, 7, 7]);
        // The latest full-length continuation wins over earlier ones.
        assert_eq!(lookup.lookup(&[4, 1, 2, 4, 3, 3, 4], 2), vec![3, 3]);
        assert_eq!(lookup.lookup(&[1, 2, 3], 4), Vec::<u32>::new());
        assert_eq!(lookup.lookup(&[1, 2, 1], 0), Vec::<u32>::new());
        assert_eq!(lookup.lookup(&[], 4), Vec::<u32>::new());
    }
}
