//! The generation loop over any [`Backend`].

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::sampling::{Sampler, SamplingParams};

/// Generates up to `max_tokens` after `prompt`, stopping early at one of
/// `stop_tokens`; calls `on_token` with each new token as it is chosen.
pub fn generate(
    backend: &mut dyn Backend,
    prompt: &[u32],
    max_tokens: usize,
    sampling: SamplingParams,
    stop_tokens: &[u32],
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<Vec<u32>> {
    check_room(backend, prompt, max_tokens)?;
    let mut sampler = Sampler::new(sampling)?;
    let mut generated = Vec::with_capacity(max_tokens);
    if max_tokens == 0 {
        return Ok(generated);
    }
    let mut token = sampler.sample(&backend.prefill(prompt)?)?;
    loop {
        generated.push(token);
        on_token(token)?;
        if stop_tokens.contains(&token) || generated.len() == max_tokens {
            return Ok(generated);
        }
        // Greedy decoding lets the backend choose where the logits are.
        token = if sampler.is_greedy() {
            backend.decode_greedy(token)?
        } else {
            sampler.sample(&backend.decode(token)?)?
        };
    }
}

/// The prompt and `max_tokens` must fit the backend's context. Saturating: a
/// `max_tokens` near `usize::MAX` is simply more than fits.
pub(crate) fn check_room(backend: &dyn Backend, prompt: &[u32], max_tokens: usize) -> Result<()> {
    let needed = prompt.len().saturating_add(max_tokens);
    if needed > backend.max_context() {
        return Err(Error::ContextFull {
            needed,
            limit: backend.max_context(),
        });
    }
    Ok(())
}
