//! What one request asks of the sampling loop beyond temperature and nucleus: stop strings
//! ([`StopFilter`]), OpenAI's presence and frequency penalties ([`Penalties`]), a grammar
//! (`response_format: json_object`) and log-probabilities — gathered in [`RequestControl`],
//! the [`TokenControl`] the engine thread runs the answer with.
//!
//! Stop strings are matched on text, not tokens: a stop string may end in the middle of a token
//! or span several. The filter releases text only once no stop string can still begin in it,
//! so a client never receives part of a stop string, streaming or not; the text before a match
//! is released and the answer ends with `finish_reason: "stop"`.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use molt::engine::{Grammar, Token};
use molt::session::{Accept, TokenControl};

/// Holds back text that could be the start of a stop string.
#[derive(Debug, Clone, Default)]
pub struct StopFilter {
    stops: Vec<String>,
    pending: String,
}

impl StopFilter {
    /// A filter for `stops` (empty strings must have been refused already).
    #[must_use]
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops,
            pending: String::new(),
        }
    }

    /// Adds `piece`; returns the text now safe to release and whether a stop string matched
    /// (then the text is everything before the earliest match, and the rest is dropped).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        self.pending.push_str(piece);
        if self.stops.is_empty() {
            return (std::mem::take(&mut self.pending), false);
        }
        if let Some(at) = self.stops.iter().filter_map(|s| self.pending.find(s)).min() {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, true);
        }
        // The earliest char boundary from which the rest is a proper prefix of a stop string.
        let hold = self
            .pending
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.pending[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.pending.len());
        let rest = self.pending.split_off(hold);
        (std::mem::replace(&mut self.pending, rest), false)
    }

    /// Releases what is held back (the answer ended without completing a stop string).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// OpenAI's penalties: each generated token's logit is lowered by `frequency × count` and,
/// once it has appeared, by `presence` (negative values encourage repetition). Counted over
/// the answer's own tokens, as OpenAI documents. Then llama.cpp's repetition penalty, over
/// the answer's last [`REPEAT_LAST_N`] tokens: a positive logit is divided by it, a negative
/// one multiplied (llama.cpp's `penalties` sampler, which also looks at the prompt; an
/// answer's own tokens are what a client means by "repeating itself").
#[derive(Debug, Clone, Default)]
pub struct Penalties {
    presence: f32,
    frequency: f32,
    repeat: f32,
    counts: HashMap<Token, u32>,
    recent: VecDeque<Token>,
}

/// How many of the answer's latest tokens the repetition penalty looks at (llama.cpp's
/// default `repeat_last_n`).
pub const REPEAT_LAST_N: usize = 64;

impl Penalties {
    /// `None` when none would change anything (both 0, repetition 1).
    #[must_use]
    pub fn new(presence: f32, frequency: f32, repeat: f32) -> Option<Self> {
        #[allow(clippy::float_cmp)]
        let off = presence == 0.0 && frequency == 0.0 && repeat == 1.0;
        (!off).then(|| Self {
            presence,
            frequency,
            repeat,
            counts: HashMap::new(),
            recent: VecDeque::new(),
        })
    }

    fn apply(&self, logits: &mut [f32]) {
        for (&t, &c) in &self.counts {
            if let Some(l) = usize::try_from(t).ok().and_then(|i| logits.get_mut(i)) {
                #[allow(clippy::cast_precision_loss)]
                let count = c as f32;
                *l -= self.frequency * count + self.presence;
            }
        }
        #[allow(clippy::float_cmp)]
        if self.repeat != 1.0 {
            let distinct: HashSet<Token> = self.recent.iter().copied().collect();
            for t in distinct {
                if let Some(l) = usize::try_from(t).ok().and_then(|i| logits.get_mut(i)) {
                    *l = if *l > 0.0 {
                        *l / self.repeat
                    } else {
                        *l * self.repeat
                    };
                }
            }
        }
    }

    fn seen(&mut self, t: Token) {
        *self.counts.entry(t).or_insert(0) += 1;
        self.recent.push_back(t);
        if self.recent.len() > REPEAT_LAST_N {
            self.recent.pop_front();
        }
    }
}

/// Everything a request asks of the token loop.
#[derive(Default)]
pub struct RequestControl {
    /// Stop strings.
    pub stop: StopFilter,
    /// Presence and frequency penalties.
    pub penalties: Option<Penalties>,
    /// A grammar the answer must follow.
    pub grammar: Option<Grammar>,
    /// Alternatives per token for log-probabilities (`None`: not asked for).
    pub logprobs: Option<usize>,
    /// The shortest time between two tokens (`serve --pace-ms`).
    pub pace: Option<Pace>,
}

/// Holds each token until at least `interval` has passed since the previous one. It runs on
/// the engine thread, between two tokens, where the budget is read: a budget change posted
/// while a token is held applies to the next one.
#[derive(Debug, Clone)]
pub struct Pace {
    interval: Duration,
    last: Option<Instant>,
}

impl Pace {
    /// A pace of one token per `interval` at most.
    #[must_use]
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            last: None,
        }
    }

    /// Waits out what is left of the interval since the previous token.
    fn hold(&mut self) {
        if let Some(last) = self.last {
            std::thread::sleep(self.interval.saturating_sub(last.elapsed()));
        }
        self.last = Some(Instant::now());
    }
}

impl TokenControl for RequestControl {
    fn shape(&mut self, logits: &mut [f32]) {
        if let Some(p) = &self.penalties {
            p.apply(logits);
        }
        if let Some(g) = &mut self.grammar {
            g.constrain(logits);
        }
    }

    fn logprobs(&self) -> Option<usize> {
        self.logprobs
    }

    fn accept(&mut self, token: Token, piece: String) -> Accept {
        if let Some(p) = &mut self.pace {
            p.hold();
        }
        if let Some(p) = &mut self.penalties {
            p.seen(token);
        }
        if let Some(g) = &mut self.grammar {
            g.accept(token);
        }
        let (emit, stop) = self.stop.push(&piece);
        Accept { emit, stop }
    }

    fn finish(&mut self, tail: String) -> String {
        let (mut out, stop) = self.stop.push(&tail);
        if !stop {
            out.push_str(&self.stop.flush());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (Vec<String>, bool) {
        let mut f = StopFilter::new(stops.iter().map(|s| (*s).to_string()).collect());
        let mut out = Vec::new();
        for p in pieces {
            let (t, stop) = f.push(p);
            out.push(t);
            if stop {
                return (out, true);
            }
        }
        out.push(f.flush());
        (out, false)
    }

    #[test]
    fn a_stop_string_spanning_pieces_is_never_released() {
        let (out, stop) = run(&["END"], &["ab", "cE", "N", "Dx"]);
        assert!(stop);
        assert_eq!(out, vec!["ab", "c", "", ""]);
        assert_eq!(out.concat(), "abc");
    }

    #[test]
    fn a_false_start_is_released_once_it_cannot_match() {
        let (out, stop) = run(&["END"], &["aE", "Nb", "c"]);
        assert!(!stop);
        assert_eq!(out.concat(), "aENbc");
        assert_eq!(out[0], "a");
        assert_eq!(out[1], "ENb");
    }

    #[test]
    fn the_earliest_of_several_stops_wins_and_multibyte_text_is_cut_on_boundaries() {
        let (out, stop) = run(&["zz", "é!"], &["aé", "!zz"]);
        assert!(stop);
        assert_eq!(out.concat(), "a");
        let (out, stop) = run(&["x"], &["ééé"]);
        assert!(!stop);
        assert_eq!(out.concat(), "ééé");
    }

    #[test]
    fn penalties_lower_seen_tokens_by_openai_rule() {
        let mut p = Penalties::new(0.5, 1.0, 1.0).unwrap();
        p.seen(1);
        p.seen(1);
        p.seen(2);
        let mut row = [0.0_f32; 4];
        p.apply(&mut row);
        assert_eq!(row, [0.0, -2.5, -1.5, 0.0]);
        assert!(Penalties::new(0.0, 0.0, 1.0).is_none());
    }

    #[test]
    fn the_repetition_penalty_pushes_recent_tokens_toward_zero_probability_as_llama_cpp_does() {
        let mut p = Penalties::new(0.0, 0.0, 2.0).unwrap();
        p.seen(0);
        p.seen(1);
        p.seen(1);
        let mut row = [4.0_f32, -1.0, 3.0];
        p.apply(&mut row);
        assert_eq!(row, [2.0, -2.0, 3.0]);
        for t in 0..REPEAT_LAST_N {
            p.seen(Token::try_from(t).unwrap() + 10);
        }
        let mut row = [4.0_f32, -1.0, 3.0];
        p.apply(&mut row);
        assert_eq!(
            row,
            [4.0, -1.0, 3.0],
            "tokens older than the window still penalised"
        );
    }
}
