//! The four conditions Molt is measured against, as session settings: which rung an answer
//! starts on and how it may change rung. All four run through the same token loop and read
//! the same budget trace, so their differences are the conditions' alone.

use serde::{Deserialize, Serialize};

use super::Strategy;
use crate::ladder::Ladder;

/// A benchmark condition (see the design's table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Condition {
    /// A: hold the largest rung; when the budget falls below its footprint the process is
    /// killed and the answer lost ([`super::StopReason::Killed`], `lost_tokens`).
    AlwaysLarge,
    /// B: run the smallest rung from the start and never move; killed only if even that
    /// does not fit.
    AlwaysSmall,
    /// C: switch rung under pressure and re-read prompt and answer on the destination.
    Restart,
    /// D: switch rung between two tokens, projecting the KV cache (Molt).
    Molt,
}

impl Condition {
    /// All four, in the design's order.
    pub const ALL: [Condition; 4] = [
        Condition::AlwaysLarge,
        Condition::AlwaysSmall,
        Condition::Restart,
        Condition::Molt,
    ];

    /// The design's letter.
    #[must_use]
    pub fn letter(self) -> char {
        match self {
            Condition::AlwaysLarge => 'A',
            Condition::AlwaysSmall => 'B',
            Condition::Restart => 'C',
            Condition::Molt => 'D',
        }
    }

    /// How the session changes rung.
    #[must_use]
    pub fn strategy(self) -> Strategy {
        match self {
            Condition::AlwaysLarge | Condition::AlwaysSmall => Strategy::Never,
            Condition::Restart => Strategy::Reprefill,
            Condition::Molt => Strategy::Molt,
        }
    }

    /// Index of the rung the answer starts on (and, as the session's home, the largest it
    /// may use): the smallest rung for B, the largest otherwise.
    #[must_use]
    pub fn start_index(self, ladder: &Ladder) -> usize {
        match self {
            Condition::AlwaysSmall => ladder.rungs.len().saturating_sub(1),
            _ => 0,
        }
    }

    /// Name of the start rung.
    #[must_use]
    pub fn start_rung(self, ladder: &Ladder) -> &str {
        ladder.rungs[self.start_index(ladder)].name()
    }
}
