//! Choosing the next token from logits: greedy, or temperature with top-k and
//! top-p, from a seeded generator so every run is reproducible.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{Error, Result};

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Keep the k most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches p (1.0: all).
    pub top_p: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
}

/// The index of the largest value (the first, on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Sampler> {
        if !(params.temperature >= 0.0 && params.temperature.is_finite()) {
            return Err(Error::Invalid(format!(
                "--temperature must be a finite number >= 0, not {}",
                params.temperature
            )));
        }
        if !(params.top_p > 0.0 && params.top_p <= 1.0) {
            return Err(Error::Invalid(format!(
                "--top-p must be in (0, 1], not {}",
                params.top_p
            )));
        }
        Ok(Sampler {
            rng: ChaCha8Rng::seed_from_u64(params.seed),
            params,
        })
    }

    /// Whether this sampler always takes the first largest logit.
    pub fn is_greedy(&self) -> bool {
        self.params.temperature == 0.0
    }

    /// The distribution [`Sampler::sample`] draws from: the kept candidates
    /// and their probabilities (summing to 1); one candidate when greedy.
    pub fn distribution(&self, logits: &[f32]) -> Result<Vec<(u32, f64)>> {
        if logits.is_empty() {
            return Err(Error::Backend(
                "the backend returned no logits to sample from".into(),
            ));
        }
        if self.params.temperature == 0.0 {
            return Ok(vec![(argmax(logits), 1.0)]);
        }
        // Candidates by descending logit (index order on ties: deterministic).
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if self.params.top_k > 0 {
            order.truncate(self.params.top_k);
        }
        let max = logits[order[0]];
        let weights: Vec<f64> = order
            .iter()
            .map(|&i| (((logits[i] - max) / self.params.temperature) as f64).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        let mut kept = 0;
        let mut mass = 0.0;
        for w in &weights {
            kept += 1;
            mass += w / total;
            if mass >= self.params.top_p as f64 {
                break;
            }
        }
        let kept_total: f64 = weights[..kept].iter().sum();
        Ok(order[..kept]
            .iter()
            .zip(&weights)
            .map(|(&i, w)| (i as u32, w / kept_total))
            .collect())
    }

    /// True with probability `p`.
    pub fn accept(&mut self, p: f64) -> bool {
        self.rng.random::<f64>() < p
    }

    /// A token drawn from `distribution` (probabilities summing to 1, or
    /// weights: they are normalised here).
    pub fn draw(&mut self, distribution: &[(u32, f64)]) -> u32 {
        let total: f64 = distribution.iter().map(|(_, p)| p).sum();
        let mut draw = self.rng.random::<f64>() * total;
        for &(token, p) in distribution {
            if draw < p {
                return token;
            }
            draw -= p;
        }
        distribution.last().map_or(0, |&(t, _)| t)
    }

    /// The next token; empty logits (a backend's fault) are an error.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        // Greedy: one candidate, the first largest logit.
        let distribution = self.distribution(logits)?;
        Ok(self.draw(&distribution))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            seed,
        }
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(SamplingParams::default()).unwrap();
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 3.0]).unwrap(), 1);
    }

    #[test]
    fn the_same_seed_gives_the_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let run = |seed| {
            let mut s = Sampler::new(params(1.0, 0, 1.0, seed)).unwrap();
            (0..40)
                .map(|_| s.sample(&logits).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn top_k_and_top_p_restrict_the_candidates() {
        let logits = [5.0, 4.9, 4.8, -10.0, 0.0];
        let mut s = Sampler::new(params(1.0, 2, 1.0, 1)).unwrap();
        assert!((0..200).map(|_| s.sample(&logits).unwrap()).all(|t| t < 2));
        // Token 0 alone holds ~36% of the mass, so top-p 0.3 keeps only it.
        let mut s = Sampler::new(params(1.0, 0, 0.3, 1)).unwrap();
        assert!((0..200).map(|_| s.sample(&logits).unwrap()).all(|t| t == 0));
        let mut s = Sampler::new(params(1.0, 0, 1.0, 1)).unwrap();
        let seen: std::collections::BTreeSet<u32> =
            (0..500).map(|_| s.sample(&logits).unwrap()).collect();
        assert!(seen.contains(&2) && seen.contains(&4), "{seen:?}");
    }

    #[test]
    fn empty_logits_are_an_error_not_a_panic() {
        for temperature in [0.0, 1.0] {
            let mut s = Sampler::new(params(temperature, 0, 1.0, 0)).unwrap();
            let error = s.sample(&[]).unwrap_err().to_string();
            assert!(error.contains("no logits"), "{error}");
        }
    }

    #[test]
    fn bad_parameters_are_named() {
        assert!(Sampler::new(params(-1.0, 0, 1.0, 0)).is_err());
        let error = Sampler::new(params(1.0, 0, 0.0, 0)).err().unwrap();
        assert!(error.to_string().contains("--top-p"), "{error}");
    }
}
