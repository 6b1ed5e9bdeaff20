//! KV-cache transplant between rungs of one model family.
//!
//! Molt moves a running generation from a source rung to a destination rung between two
//! tokens by *projecting* the source's KV cache instead of re-prefilling. This module is
//! the pure math and file format of that step; the engine and KV mirror feed it arrays.
//!
//! - [`rope`]: RoPE as ggml-cpu computes it ([`rope::rotate`], [`rope::RopeSpec`]); the
//!   cache holds K after rotation, so keys are un-rotated at the source's angles, mapped,
//!   and re-rotated at the destination's (the *sandwich*).
//! - [`ridge`]: closed-form ridge fits in f64 with Cholesky ([`ridge::Affine`],
//!   [`ridge::NormalEquations`], diagonal and per-head variants).
//! - [`map`]: [`map::LayerMap`], the per-layer K or V map (identity, dense, diagonal,
//!   per-head, truncate baseline).
//! - [`projector`]: [`projector::Projector`], one fitted route bound to its two GGUF files
//!   by sha256, and its `.molt-proj` file format.
//! - [`project`]: [`project::project`], applying a projector to a whole cache in parallel,
//!   and the depth-remap candidate helpers.
//! - [`fit`]: [`fit::fit_route`], fitting a projector from paired activations with λ and
//!   depth remap chosen on held-out windows, reported as a serde [`fit::FitReport`].
//! - [`hidden`]: [`hidden::HiddenMap`], the boundary hidden-state map of selective top-k
//!   recompute (the destination's last k blocks computed natively), and its `.molt-hmap` file.
//! - [`shift`]: [`shift::shed_stream`], dropping the oldest unpinned cells of an exported
//!   cache and re-rotating the later keys to their new positions (shedding a parked rung).
//! - [`anchor`]: [`anchor::Anchor`], a rung's own cache of the chat template's opening,
//!   spliced into a switch's head re-read instead of decoded (`.molt-anchor` file).
//! - [`in_place`]: a precision route's projection applied to the source's state blob itself
//!   (diagonal maps, same shapes and RoPE): no decoded copy of the cache.
//! - [`error`]: [`TransplantError`] and [`ProjectorError`].

pub mod anchor;
pub mod error;
pub mod fit;
mod framed;
pub mod hidden;
pub mod in_place;
pub mod map;
pub mod project;
pub mod projector;
pub mod ridge;
pub mod rope;
pub mod select;
pub mod shift;

pub use error::{ProjectorError, TransplantError};
