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
    ///
    /// Only the head of the ranking is ever read (the top k, or the nucleus), so only the head
    /// is sorted: the rest of a 152k-token vocabulary is partitioned away in linear time, where
    /// a full sort cost several milliseconds per token — a fifth of a small rung's decode.
    pub fn sample(&mut self, logits: &[f32]) -> Token {
        if self.params.temperature <= 0.0 {
            return argmax(logits);
        }
        let t = self.params.temperature;
        let mut idx = candidates(logits);
        if idx.is_empty() {
            return 0;
        }
        let max = idx.iter().map(|x| x.1).fold(f32::NEG_INFINITY, f32::max);
        let weight = |x: f32| f64::from((x - max) / t).exp();
        if self.params.top_k > 0 {
            rank_head(&mut idx, self.params.top_k);
            idx.truncate(self.params.top_k);
        }
        // The mass every kept candidate is measured against: the top k's, or the whole row's.
        let z: f64 = idx.iter().map(|x| weight(x.1)).sum();
        let top_p = f64::from(self.params.top_p);
        if top_p >= 1.0 && self.params.top_k == 0 {
            // The nucleus is the whole row: no ranking changes what is drawn from, so draw in
            // token order.
            let mut u = self.rng.random::<f64>() * z;
            for &(i, x) in &idx {
                let w = weight(x);
                if u < w {
                    return to_token(i);
                }
                u -= w;
            }
            return to_token(idx[idx.len() - 1].0);
        }
        // Rank a head large enough to hold the nucleus, growing it until it does.
        let mut head = if self.params.top_k > 0 {
            idx.len()
        } else {
            NUCLEUS_HEAD.min(idx.len())
        };
        let keep = loop {
            rank_head(&mut idx, head);
            let mut acc = 0.0;
            let reached = idx[..head].iter().position(|x| {
                acc += weight(x.1) / z;
                acc >= top_p
            });
            match reached {
                Some(i) => break i + 1,
                None if head == idx.len() => break head,
                None => head = (head * 4).min(idx.len()),
            }
        };
        let probs: Vec<f64> = idx[..keep].iter().map(|x| weight(x.1) / z).collect();
        let kept: f64 = probs.iter().sum();
        let mut u = self.rng.random::<f64>() * kept;
        for (i, p) in probs.iter().enumerate() {
            if u < *p {
                return to_token(idx[i].0);
            }
            u -= p;
        }
        to_token(idx[keep - 1].0)
    }
}

/// Every token with a finite logit, as `(token id, logit)`: what a draw chooses from.
fn candidates(logits: &[f32]) -> Vec<(usize, f32)> {
    logits
        .iter()
        .copied()
        .enumerate()
        .filter(|(_, x)| x.is_finite())
        .collect()
}

/// Candidates ranked first when a nucleus is sampled without a top-k limit (grown ×4 until
/// the nucleus fits): a sharp distribution's nucleus is a few tokens, a flat one's thousands.
const NUCLEUS_HEAD: usize = 64;

/// Puts the `n` best candidates first, best first (higher logit, then lower token id: a total
/// order, so the ranking does not depend on how the row was partitioned), the rest after in no
/// order.
fn rank_head(idx: &mut [(usize, f32)], n: usize) {
    let order = |a: &(usize, f32), b: &(usize, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let n = n.min(idx.len());
    if n == 0 {
        return;
    }
    if n < idx.len() {
        idx.select_nth_unstable_by(n - 1, order);
    }
    idx[..n].sort_unstable_by(order);
}

fn to_token(i: usize) -> Token {
    Token::try_from(i).unwrap_or(0)
}

/// The draw [`Sampler::sample`] makes for a uniform `u` in [0, 1), by the method it used before
/// it ranked only the head: the whole finite row sorted (higher logit, then lower token id),
/// cut to the top k, the nucleus taken from the front. Kept as the benchmark's baseline
/// (`bench --sampling` times both on real logits) and as the tests' reference; a temperature of
/// 0 or below is argmax, as in the sampler.
#[must_use]
pub fn sample_by_full_sort(p: SamplingParams, logits: &[f32], u: f64) -> Token {
    if p.temperature <= 0.0 {
        return argmax(logits);
    }
    let mut idx = candidates(logits);
    if idx.is_empty() {
        return 0;
    }
    idx.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if p.top_k > 0 {
        idx.truncate(p.top_k);
    }
    let max = idx[0].1;
    let probs: Vec<f64> = idx
        .iter()
        .map(|x| f64::from((x.1 - max) / p.temperature).exp())
        .collect();
    let z: f64 = probs.iter().sum();
    let mut keep = probs.len();
    let mut acc = 0.0;
    for (i, q) in probs.iter().enumerate() {
        acc += q / z;
        if acc >= f64::from(p.top_p) {
            keep = i + 1;
            break;
        }
    }
    let kept: f64 = probs[..keep].iter().map(|q| q / z).sum();
    let mut u = u * kept;
    for (i, q) in probs[..keep].iter().enumerate() {
        if u < q / z {
            return to_token(idx[i].0);
        }
        u -= q / z;
    }
    to_token(idx[keep - 1].0)
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
    fn ranking_only_the_head_samples_what_a_full_sort_samples() {
        // A vocabulary-sized row with a flat tail (the nucleus must grow past the first head)
        // and a sharp one; with and without top-k; ties included.
        let flat: Vec<f32> = (0..20_000)
            .map(|i| ((i * 7919) % 1000) as f32 / 400.0)
            .collect();
        let sharp: Vec<f32> = (0..20_000)
            .map(|i| {
                if i % 977 == 0 {
                    12.0
                } else {
                    ((i * 31) % 97) as f32 / 50.0
                }
            })
            .collect();
        for logits in [&flat, &sharp] {
            for (temperature, top_p, top_k) in
                [(0.7, 0.9, 40), (1.0, 0.95, 0), (0.8, 0.5, 0), (0.7, 1.0, 5)]
            {
                let p = SamplingParams {
                    temperature,
                    top_p,
                    top_k,
                    seed: 11,
                };
                let mut s = Sampler::new(p);
                let mut rng = ChaCha8Rng::seed_from_u64(11);
                for _ in 0..40 {
                    let want = sample_by_full_sort(p, logits, rng.random::<f64>());
                    assert_eq!(s.sample(logits), want, "{p:?}");
                }
            }
        }
    }

    #[test]
    fn the_whole_row_nucleus_draws_each_token_at_its_probability() {
        let logits = [2.0_f32, 0.5, -1.0, 1.5, f32::NAN, 0.0];
        let p = SamplingParams {
            temperature: 0.9,
            top_p: 1.0,
            top_k: 0,
            seed: 3,
        };
        let scaled: Vec<f32> = logits.iter().map(|x| x / 0.9).collect();
        let want = softmax(&[scaled[0], scaled[1], scaled[2], scaled[3], scaled[5]]);
        let mut s = Sampler::new(p);
        let n = 40_000;
        let mut seen = [0usize; 6];
        for _ in 0..n {
            seen[s.sample(&logits) as usize] += 1;
        }
        assert_eq!(seen[4], 0, "a NaN logit was drawn");
        for (k, &w) in [0, 1, 2, 3, 5].iter().zip(&want) {
            let got = seen[*k] as f64 / f64::from(n);
            assert!(
                (got - w).abs() < 0.01,
                "token {k}: {got} drawn, {w} expected"
            );
        }
    }

    #[test]
    fn softmax_sums_to_one() {
        let p = softmax(&[1000.0, 999.0, -5.0]);
        assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        assert!(p[0] > p[1] && p[1] > p[2]);
    }
}
