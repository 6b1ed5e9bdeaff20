//! What a fit is asked: [`FitOptions`] (map kind, sandwich, λ grid, [`DepthPolicy`]) and
//! its presets for the shipped ladder's routes and the baselines.

use serde::{Deserialize, Serialize};

use crate::transplant::project::DepthSearch;
use crate::transplant::projector::ProjectorKind;

/// Which source layers each destination layer may read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DepthPolicy {
    /// Search around the proportional map and keep the best held-out candidate.
    Search(DepthSearch),
    /// The proportional map, no search (the "no depth remap" ablation for unequal depths).
    Uniform,
    /// Index-mapped: destination layer `j` ← source layer `min(j, n_src − 1)` (the naive
    /// baseline).
    Index,
}

/// What to fit and how.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FitOptions {
    /// Map family.
    pub kind: ProjectorKind,
    /// Fit inside the RoPE sandwich (`false` fits rotated keys directly: the ablation).
    pub sandwich: bool,
    /// λ grid relative to the data: absolute λ = relative × mean centred sum of squares per
    /// input feature, so one grid serves keys of any magnitude.
    pub lambdas: Vec<f64>,
    /// Depth remap policy.
    pub depth: DepthPolicy,
    /// A candidate reading more source layers must beat the best smaller one by this
    /// relative margin of held-out score, or the smaller is kept (it has fewer parameters).
    pub multi_layer_margin: f64,
    /// Undo the ridge's shrinkage: after the fit, widen each output head around the
    /// prediction's mean so its spread on the training rows matches the destination's
    /// (`alpha = sqrt(Σ(y−ȳ)² / Σ(ŷ−mean ŷ)²)` per KV head, clamped to [1, 3]), folded into the
    /// map. A regression's prediction is narrower than its target; attention logits built
    /// from narrowed keys are flatter than the destination's own.
    #[serde(default)]
    pub restore_spread: bool,
}

/// `10^lo, 10^(lo+1), …, 10^hi`.
#[must_use]
pub fn log_grid(lo: i32, hi: i32) -> Vec<f64> {
    (lo..=hi).map(|e| 10f64.powi(e)).collect()
}

impl FitOptions {
    /// Size route (e.g. 1.5B → 0.5B): dense maps in the sandwich, depth search.
    #[must_use]
    pub fn size_route() -> Self {
        Self {
            kind: ProjectorKind::Dense,
            sandwich: true,
            lambdas: log_grid(-6, 2),
            depth: DepthPolicy::Search(DepthSearch::default()),
            multi_layer_margin: 0.02,
            restore_spread: false,
        }
    }

    /// Size route with per-head block maps.
    #[must_use]
    pub fn per_head_route() -> Self {
        Self {
            kind: ProjectorKind::PerHead,
            ..Self::size_route()
        }
    }

    /// Precision route (same weights, other quantisation): diagonal maps, layer `j` ← `j`.
    #[must_use]
    pub fn precision_route() -> Self {
        Self {
            kind: ProjectorKind::Diagonal,
            sandwich: true,
            lambdas: log_grid(-6, 2),
            depth: DepthPolicy::Uniform,
            multi_layer_margin: 0.02,
            restore_spread: false,
        }
    }

    /// The naive baseline: truncate each head, index-mapped layers, no fitting.
    #[must_use]
    pub fn truncate_baseline() -> Self {
        Self {
            kind: ProjectorKind::Truncate,
            sandwich: true,
            lambdas: Vec::new(),
            depth: DepthPolicy::Index,
            multi_layer_margin: 0.0,
            restore_spread: false,
        }
    }
}

impl Default for FitOptions {
    fn default() -> Self {
        Self::size_route()
    }
}
