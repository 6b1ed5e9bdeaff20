//! The quality and spread measures the conditions benchmark reports, each a small function
//! or type that can be checked on its own.
//!
//! - [`repetition`]: fraction of repeated n-grams — read beside perplexity, which alone
//!   rewards degenerate loops.
//! - [`Judge`]: the largest rung scoring a continuation (judge perplexity), reusing its cache
//!   across continuations that share a prefix.
//! - [`NativeAttention`]: a rung's attention entropy on a natively built cache, the
//!   denominator of *attention flatness*.
//! - [`Noise`]: whether two repeated timings differ by more than their own spread.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::BenchError;
use super::speed::Rate;
use molt::engine::{Context, ContextConfig, Model, ModelOptions, Token, log_softmax};
use molt::ladder::RungInfo;

/// Fraction of the `n`-grams of `tokens` that repeat an earlier `n`-gram of the same
/// sequence: 0 for text without repeats, close to 1 for a loop. `None` when `tokens` holds no
/// `n`-gram.
#[must_use]
pub fn repetition(tokens: &[Token], n: usize) -> Option<f64> {
    if n == 0 || tokens.len() < n {
        return None;
    }
    let grams: Vec<&[Token]> = tokens.windows(n).collect();
    let distinct: std::collections::HashSet<&[Token]> = grams.iter().copied().collect();
    #[allow(clippy::cast_precision_loss)] // counts far below 2^52
    Some(1.0 - distinct.len() as f64 / grams.len() as f64)
}

/// Length of the common prefix of two token sequences.
#[must_use]
pub fn common_prefix(a: &[Token], b: &[Token]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// A judge's verdict on one continuation.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct JudgeScore {
    /// Summed negative log-likelihood (nats) of the judged tokens.
    pub nll: f64,
    /// Tokens judged.
    pub tokens: usize,
}

impl JudgeScore {
    /// `exp(mean NLL)`.
    #[must_use]
    pub fn perplexity(&self) -> f64 {
        if self.tokens == 0 {
            return f64::NAN;
        }
        #[allow(clippy::cast_precision_loss)]
        (self.nll / self.tokens as f64).exp()
    }
}

/// Perplexity pooled over several scores: `exp(Σ NLL / Σ tokens)`.
#[must_use]
pub fn pooled_perplexity(scores: &[JudgeScore]) -> Option<f64> {
    let n: usize = scores.iter().map(|s| s.tokens).sum();
    if n == 0 {
        return None;
    }
    let nll: f64 = scores.iter().map(|s| s.nll).sum();
    #[allow(clippy::cast_precision_loss)]
    Some((nll / n as f64).exp())
}

/// One rung scoring token sequences; what it has decoded stays cached, so continuations that
/// share a prompt and a prefix pay only for their own suffix.
pub struct Judge {
    ctx: Context,
    cached: Vec<Token>,
}

impl Judge {
    /// Loads `rung` as the judge.
    ///
    /// # Errors
    /// [`BenchError::Engine`] when the rung cannot be loaded.
    pub fn new(rung: &RungInfo, config: ContextConfig) -> Result<Self, BenchError> {
        let wrap = |source| BenchError::Engine {
            rung: rung.name().to_string(),
            source,
        };
        let model = Model::load(&rung.path, rung.name(), ModelOptions::default()).map_err(wrap)?;
        let ctx = Context::new(model, config).map_err(wrap)?;
        Ok(Self {
            ctx,
            cached: Vec::new(),
        })
    }

    /// The judge's model (to tokenize with).
    #[must_use]
    pub fn model(&self) -> &Model {
        self.ctx.model()
    }

    /// Scores `tokens[from..]`, each given everything before it.
    ///
    /// # Errors
    /// [`BenchError::Config`] when `from` is 0 or past the end; [`BenchError::Engine`] when the
    /// judge cannot decode.
    pub fn score(&mut self, tokens: &[Token], from: usize) -> Result<JudgeScore, BenchError> {
        if from == 0 || from >= tokens.len() {
            return Err(BenchError::Config(format!(
                "judge: nothing to score from token {from} of {}",
                tokens.len()
            )));
        }
        let keep = common_prefix(&self.cached, tokens).min(from - 1);
        self.ctx.truncate(keep);
        self.cached.truncate(keep);
        let rows = self
            .ctx
            .decode_all_logits(&tokens[keep..])
            .map_err(|source| BenchError::Engine {
                rung: self.ctx.model().name().to_string(),
                source,
            })?;
        self.cached = tokens.to_vec();
        let mut nll = 0.0;
        for p in from..tokens.len() {
            let row = &rows[p - 1 - keep];
            let t = usize::try_from(tokens[p]).unwrap_or(usize::MAX);
            nll -= log_softmax(row)
                .get(t)
                .copied()
                .unwrap_or(f64::NEG_INFINITY);
        }
        Ok(JudgeScore {
            nll,
            tokens: tokens.len() - from,
        })
    }
}

/// Attention entropy of rungs on caches they built themselves, memoised per sequence.
pub struct NativeAttention {
    config: ContextConfig,
    ctxs: Vec<Option<(Context, Vec<Token>)>>,
    memo: HashMap<(usize, Vec<Token>), f64>,
}

impl NativeAttention {
    /// Contexts are created on first use, with an attention tap.
    #[must_use]
    pub fn new(n_rungs: usize, config: ContextConfig) -> Self {
        Self {
            config: ContextConfig {
                attention_tap: true,
                ..config
            },
            ctxs: (0..n_rungs).map(|_| None).collect(),
            memo: HashMap::new(),
        }
    }

    /// Mean attention entropy (nats, over layers and heads) of rung `index`'s last token of
    /// `seq`, with `seq[..len-1]` decoded natively first.
    ///
    /// # Errors
    /// [`BenchError::Engine`] when the rung cannot load or decode; [`BenchError::Config`] when
    /// the tap saw nothing (flash attention on, or an empty sequence).
    pub fn entropy(
        &mut self,
        index: usize,
        rung: &RungInfo,
        seq: &[Token],
    ) -> Result<f64, BenchError> {
        if let Some(&e) = self.memo.get(&(index, seq.to_vec())) {
            return Ok(e);
        }
        let Some((&last, head)) = seq.split_last() else {
            return Err(BenchError::Config(
                "native attention of an empty sequence".into(),
            ));
        };
        let wrap = |source| BenchError::Engine {
            rung: rung.name().to_string(),
            source,
        };
        if self.ctxs[index].is_none() {
            let model =
                Model::load(&rung.path, rung.name(), ModelOptions::default()).map_err(wrap)?;
            self.ctxs[index] = Some((Context::new(model, self.config).map_err(wrap)?, Vec::new()));
        }
        let (ctx, cached) = self.ctxs[index].as_mut().expect("created above");
        let keep = common_prefix(cached, head);
        ctx.truncate(keep);
        ctx.decode(&head[keep..]).map_err(wrap)?;
        ctx.arm_attention_tap();
        ctx.decode(&[last]).map_err(wrap)?;
        // The cache now holds `seq`; the next call reuses whatever prefix it shares.
        *cached = seq.to_vec();
        let e = ctx
            .take_attention()
            .map(|c| c.mean_entropy())
            .filter(|e| e.is_finite())
            .ok_or_else(|| {
                BenchError::Config(format!("{}: the attention tap saw no softmax", rung.name()))
            })?;
        self.memo.insert((index, seq.to_vec()), e);
        Ok(e)
    }

    /// Frees the contexts (their memory must not count in later footprints).
    pub fn clear(&mut self) {
        self.ctxs.iter_mut().for_each(|c| *c = None);
    }
}

/// How two repeated timings compare.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Noise {
    /// Median of `a` / median of `b`.
    pub ratio: f64,
    /// The `[min, max]` ranges of the repetitions overlap: the difference is inside the noise.
    pub inside_noise: bool,
}

impl Noise {
    /// Compares `a` with `b`.
    #[must_use]
    pub fn between(a: &Rate, b: &Rate) -> Self {
        let ratio = if b.median > 0.0 {
            a.median / b.median
        } else {
            f64::NAN
        };
        Self {
            ratio,
            inside_noise: a.min <= b.max && b.min <= a.max,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repetition_counts_repeated_grams() {
        assert_eq!(repetition(&[1, 2, 3, 4, 5, 6], 4), Some(0.0));
        // 1 2 3 4 1 2 3 4: grams 1234 2341 3412 4123 1234 -> 4 distinct of 5.
        let r = repetition(&[1, 2, 3, 4, 1, 2, 3, 4], 4).unwrap();
        assert!((r - 0.2).abs() < 1e-12);
        let looped: Vec<Token> = std::iter::repeat_n(7, 40).collect();
        assert!(repetition(&looped, 4).unwrap() > 0.9);
        assert_eq!(repetition(&[1, 2], 4), None);
    }

    #[test]
    fn pooled_perplexity_weights_by_tokens() {
        let a = JudgeScore {
            nll: 10.0,
            tokens: 10,
        };
        let b = JudgeScore {
            nll: 0.0,
            tokens: 30,
        };
        assert!((a.perplexity() - 1f64.exp()).abs() < 1e-12);
        assert!((pooled_perplexity(&[a, b]).unwrap() - 0.25f64.exp()).abs() < 1e-12);
        assert_eq!(pooled_perplexity(&[]), None);
    }

    #[test]
    fn noise_is_range_overlap() {
        let a = Rate::from(vec![10.0, 11.0, 12.0]);
        let b = Rate::from(vec![11.5, 13.0, 14.0]);
        let c = Rate::from(vec![20.0, 21.0, 22.0]);
        assert!(Noise::between(&a, &b).inside_noise);
        let n = Noise::between(&c, &a);
        assert!(!n.inside_noise);
        assert!((n.ratio - 21.0 / 11.0).abs() < 1e-12);
    }
}
