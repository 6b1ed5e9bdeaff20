//! Next-token selection over raw logits. Molt samples in Rust rather than with llama.cpp's
//! sampler chain because every metric it reports (handoff JSD, judge perplexity) needs the
//! full distribution anyway, and a seeded Rust RNG makes runs reproducible across rungs.

use super::Token;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// How to pick the next token.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 = greedy (argmax).
    pub temperature: f32,
    /// Nucleus mass kept (1.0 = all).
    pub top_p: f32,
    /// Keep only the k most likely tokens (0 = no limit).
    pub top_k: usize,
    /// RNG seed, so sampled runs are reproducible.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self::greedy()
    }
}

impl SamplingParams {
    /// Argmax: deterministic, what the benchmarks use.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
        }
    }

    /// Temperature and nucleus sampling without a top-k limit, as a request or the command
    /// line asks for it: a temperature of 0 (or below) is [`greedy`](Self::greedy), whatever
    /// `top_p` and `seed` say. The ranges a caller accepts are its own to check.
    #[must_use]
    pub fn nucleus(temperature: f32, top_p: f32, seed: u64) -> Self {
        if temperature > 0.0 {
            Self {
                temperature,
                top_p,
                top_k: 0,
                seed,
            }
        } else {
            Self::greedy()
        }
    }

    /// A chat preset: temperature 0.7, top-p 0.9, top-k 40, seeded.
    pub fn balanced(seed: u64) -> Self {
        Self {
            temperature: 0.7,
            top_p: 0.9,
            top_k: 40,
            seed,
        }
    }
}

/// Stateful sampler (the RNG advances per token).
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
}

impl Sampler {
    /// A sampler with the given parameters.
    pub fn new(params: SamplingParams) -> Self {
        Self {
            params,
            rng: ChaCha8Rng::seed_from_u64(params.seed),
        }
    }

    /// The parameters.
    pub fn params(&self) -> SamplingParams {
        self.params
    }

    /// Picks a token from a logits row. An empty or all-NaN row yields token 0.
    pub fn sample(&mut self, logits: &[f32]) -> Token {
        if self.params.temperature <= 0.0 {
            return argmax(logits);
        }
        let t = self.params.temperature;
        let mut idx: Vec<(usize, f32)> = logits
            .iter()
            .copied()
            .enumerate()
            .filter(|(_, x)| x.is_finite())
            .collect();
        if idx.is_empty() {
            return 0;
        }
        idx.sort_unstable_by(|a, b| b.1.total_cmp(&a.1));
        if self.params.top_k > 0 {
            idx.truncate(self.params.top_k);
        }
        let max = idx[0].1;
        let mut probs: Vec<f64> = idx
            .iter()
            .map(|(_, x)| f64::from((x - max) / t).exp())
            .collect();
        let z: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= z);
        let mut keep = probs.len();
        let mut acc = 0.0;
        for (i, p) in probs.iter().enumerate() {
            acc += p;
            if acc >= f64::from(self.params.top_p) {
                keep = i + 1;
                break;
            }
        }
        let z: f64 = probs[..keep].iter().sum();
        let mut u = self.rng.random::<f64>() * z;
        for (i, p) in probs[..keep].iter().enumerate() {
            if u < *p {
                return to_token(idx[i].0);
            }
            u -= p;
        }
        to_token(idx[keep - 1].0)
    }
}

fn to_token(i: usize) -> Token {
    Token::try_from(i).unwrap_or(0)
}

/// Index of the largest finite logit (0 for an empty row).
pub fn argmax(logits: &[f32]) -> Token {
    let mut best = 0;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &x) in logits.iter().enumerate() {
        if x > best_v {
            best_v = x;
            best = i;
        }
    }
    to_token(best)
}

/// Numerically stable log-softmax in f64.
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = logits
        .iter()
        .map(|&x| f64::from(x - max).exp())
        .sum::<f64>()
        .ln()
        + f64::from(max);
    logits.iter().map(|&x| f64::from(x) - lse).collect()
}

/// Softmax in f64.
pub fn softmax(logits: &[f32]) -> Vec<f64> {
    log_softmax(logits).into_iter().map(f64::exp).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_argmax() {
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 2.9]), 1);
    }

    #[test]
    fn nucleus_is_greedy_at_temperature_zero_and_unlimited_in_k_above() {
        assert_eq!(
            SamplingParams::nucleus(0.0, 0.5, 9),
            SamplingParams::greedy()
        );
        assert_eq!(
            SamplingParams::nucleus(0.8, 0.9, 9),
            SamplingParams {
                temperature: 0.8,
                top_p: 0.9,
                top_k: 0,
                seed: 9,
            }
        );
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_respects_top_k() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 3,
            seed: 7,
        };
        let a: Vec<Token> = {
            let mut s = Sampler::new(p);
            (0..64).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<Token> = {
            let mut s = Sampler::new(p);
            (0..64).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
        let mut order: Vec<usize> = (0..50).collect();
        order.sort_by(|&x, &y| logits[y].total_cmp(&logits[x]));
        let top3: Vec<Token> = order[..3].iter().map(|&i| i as Token).collect();
        assert!(
            a.iter().all(|t| top3.contains(t)),
            "sampled outside top-k: {a:?}"
        );
        assert!(
            a.iter().collect::<std::collections::HashSet<_>>().len() > 1,
            "temperature 1 never varied"
        );
    }

    #[test]
    fn softmax_sums_to_one() {
        let p = softmax(&[1000.0, 999.0, -5.0]);
        assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        assert!(p[0] > p[1] && p[1] > p[2]);
    }
}
