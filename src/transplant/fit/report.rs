//! What a fit measured, serialisable for the results JSON: [`FitReport`] with a held-out and
//! a training [`Residual`] per layer and pooled.

use serde::{Deserialize, Serialize};

use super::FitOptions;

/// A training and a held-out relative RMS.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Residual {
    /// On training rows.
    pub train: f64,
    /// On held-out rows.
    pub held_out: f64,
}

/// Held-out residuals of one depth-remap candidate.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CandidateScore {
    /// The candidate source layers.
    pub src_layers: Vec<usize>,
    /// K held-out relative RMS at its best λ.
    pub k_held_out: f64,
    /// V held-out relative RMS at its best λ.
    pub v_held_out: f64,
}

/// How one destination layer was fitted.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerFitReport {
    /// Destination layer.
    pub dst_layer: usize,
    /// Chosen source layers.
    pub src_layers: Vec<usize>,
    /// Chosen absolute λ for K (none for unfitted kinds).
    pub lambda_k: Option<f64>,
    /// Chosen absolute λ for V.
    pub lambda_v: Option<f64>,
    /// K residuals.
    pub k: Residual,
    /// V residuals.
    pub v: Residual,
    /// Held-out spread of the K prediction against the destination's:
    /// `sqrt(Σ(ŷ−mean ŷ)² / Σ(y−ȳ)²)` (1: as wide; below 1: shrunk toward the mean).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub k_spread: Option<f64>,
    /// The same for V.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub v_spread: Option<f64>,
    /// Held-out K error relative to the destination's centred spread,
    /// `sqrt(Σ(ŷ−y)² / Σ(y−ȳ)²)`: the residual with the channel means (large for keys with a
    /// bias) taken out of the denominator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub k_centred_held_out: Option<f64>,
    /// The same for V.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub v_centred_held_out: Option<f64>,
    /// Every candidate tried, in search order.
    pub candidates: Vec<CandidateScore>,
}

/// Everything `fit_route` measured, serialisable for the results JSON.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FitReport {
    /// `"src→dst"`.
    pub route: String,
    /// The options used.
    pub options: FitOptions,
    /// Training rows.
    pub n_train_rows: usize,
    /// Held-out rows.
    pub n_held_out_rows: usize,
    /// Per destination layer.
    pub layers: Vec<LayerFitReport>,
    /// K residual pooled over layers (`sqrt(Σ‖E‖² / Σ‖Y‖²)`).
    pub k: Residual,
    /// V residual pooled over layers.
    pub v: Residual,
    /// Wall time of the fit.
    pub elapsed_ms: f64,
}
