//! Per-answer hooks around sampling: [`TokenControl`], which a caller (the HTTP service) hands
//! to [`Session::generate_with`](super::Session::generate_with) to reshape the logits before a
//! token is drawn (penalties, a grammar), to ask for each token's log-probabilities, and to
//! decide what text a token releases and whether the answer ends there (stop strings).
//!
//! They live outside [`GenerateOptions`](super::GenerateOptions) because they carry state
//! across the tokens of one answer (counts, a grammar's parse stacks, held-back text) and may
//! own foreign resources, while the options stay a small `Copy` value every benchmark shares.

use serde::{Deserialize, Serialize};

use crate::engine::Token;

/// What a token releases.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Accept {
    /// Text to emit now (may be empty: held back, or part of a stop string).
    pub emit: String,
    /// End the answer after this token (`finish_reason: "stop"`).
    pub stop: bool,
}

/// Hooks around one answer's sampling. Every method has a neutral default.
pub trait TokenControl {
    /// Reshapes a copy of the rung's logits before sampling; the log-probabilities reported
    /// with a token are the rung's own, before this.
    fn shape(&mut self, _logits: &mut [f32]) {}

    /// How many alternatives to report with each token (`Some(0)`: the token's own
    /// log-probability only; `None`: no log-probabilities).
    fn logprobs(&self) -> Option<usize> {
        None
    }

    /// The token drawn (never an end-of-generation token) and the text it completed.
    fn accept(&mut self, _token: Token, piece: String) -> Accept {
        Accept {
            emit: piece,
            stop: false,
        }
    }

    /// The answer ended without a stop from [`accept`](Self::accept): `tail` is what the
    /// detokenizer still held (an incomplete character, usually empty); returns the text to
    /// emit last (the tail and whatever the control held back, up to a stop in them).
    fn finish(&mut self, tail: String) -> String {
        tail
    }
}

/// The control that changes nothing ([`Session::generate`](super::Session::generate)).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoControl;

impl TokenControl for NoControl {}

/// One token's log-probability and its most likely alternatives, from the logits of the rung
/// that produced it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprobs {
    /// The token's own bytes.
    pub bytes: Vec<u8>,
    /// Natural log of its probability.
    pub logprob: f64,
    /// The most likely tokens at this step, most likely first: `(token, bytes, logprob)`.
    pub top: Vec<(Token, Vec<u8>, f64)>,
}

/// The log-probability of `token` and the `top` most likely tokens of a logits row.
#[must_use]
pub fn logprobs_of(
    logits: &[f32],
    token: Token,
    top: usize,
    bytes: impl Fn(Token) -> Vec<u8>,
) -> TokenLogprobs {
    let lp = crate::engine::log_softmax(logits);
    let at = |t: Token| {
        usize::try_from(t)
            .ok()
            .and_then(|i| lp.get(i).copied())
            .unwrap_or(f64::NEG_INFINITY)
    };
    let mut order: Vec<usize> = (0..lp.len()).collect();
    let k = top.min(order.len());
    if k > 0 {
        order.select_nth_unstable_by(k - 1, |&a, &b| lp[b].total_cmp(&lp[a]));
        order.truncate(k);
        order.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]));
    } else {
        order.clear();
    }
    TokenLogprobs {
        bytes: bytes(token),
        logprob: at(token),
        top: order
            .into_iter()
            .filter_map(|i| Token::try_from(i).ok())
            .map(|t| (t, bytes(t), at(t)))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_rank_the_row_and_sum_to_one() {
        let row = [0.0_f32, 2.0, 1.0, -1.0];
        let l = logprobs_of(&row, 2, 2, |t| vec![u8::try_from(t).unwrap()]);
        assert_eq!(l.bytes, vec![2]);
        assert_eq!(
            l.top.iter().map(|(t, _, _)| *t).collect::<Vec<_>>(),
            vec![1, 2]
        );
        assert!((l.top[1].2 - l.logprob).abs() < 1e-12);
        let z: f64 = crate::engine::log_softmax(&row)
            .iter()
            .map(|x| x.exp())
            .sum();
        assert!((z - 1.0).abs() < 1e-12);
        assert!(logprobs_of(&row, 0, 0, |_| vec![]).top.is_empty());
    }
}
