//! Fitting the hidden maps of selective top-k recompute ([`crate::transplant::hidden`]): the
//! same corpus windows through every rung with the hidden-state tap on, the source's boundary
//! states regressed onto the destination's, one `.molt-hmap` per route and `k`, written under
//! `<out>/<ladder>/ablations/` (top-k is an option, off by default; its maps are regenerated,
//! not shipped).

use std::collections::BTreeSet;

use ndarray::{Array2, Axis, concatenate};
use serde::{Deserialize, Serialize};

use super::{TrainError, TrainOptions, split_windows_by_rows, windows};
use crate::engine::{ContextConfig, Token};
use crate::ladder::{Ladder, RungInfo};
use crate::routes::binding;
use crate::session::{LiveRung, SessionError};
use crate::transplant::ProjectorError;
use crate::transplant::hidden::{
    HiddenFit, HiddenMap, dst_boundary_layer, file_name, fit_hidden, source_layer,
};

/// One fitted hidden map.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TopkResult {
    /// `src→dst`.
    pub route: String,
    /// Destination blocks recomputed.
    pub k: usize,
    /// Source block tapped.
    pub src_layer: usize,
    /// Destination block whose output the map predicts (the input of block `L_dst − k`).
    pub dst_layer: usize,
    /// The fit.
    pub fit: HiddenFit,
    /// Where it was written.
    pub file: String,
}

/// Layers of `rung` whose states the fits need: its boundaries as a destination, and its
/// tapped layers as a source towards every other rung.
fn needed_layers(ladder: &Ladder, rung: usize, ks: &[usize]) -> Vec<usize> {
    let n = |i: usize| ladder.rungs[i].facts.n_layer as usize;
    let mut set = BTreeSet::new();
    for &k in ks {
        set.insert(dst_boundary_layer(n(rung), k));
        for d in (0..ladder.rungs.len()).filter(|&d| d != rung) {
            set.insert(source_layer(n(rung), n(d), k));
        }
    }
    set.into_iter().collect()
}

/// Runs `windows` through `info` and returns the tapped `layers`' states, rows in corpus order.
fn collect_hidden(
    info: &RungInfo,
    config: ContextConfig,
    windows: &[&[Token]],
    layers: &[usize],
) -> Result<Vec<Array2<f32>>, TrainError> {
    let config = ContextConfig {
        hidden_tap: true,
        ..config
    };
    let mut live = LiveRung::load(info, config)?;
    let mut parts: Vec<Vec<Array2<f32>>> = vec![Vec::new(); layers.len()];
    for w in windows {
        live.ctx.clear();
        live.ctx.set_hidden_layers(layers);
        live.ctx.decode(w).map_err(|source| {
            TrainError::Session(SessionError::Engine {
                rung: info.name().to_string(),
                source,
            })
        })?;
        for (i, &l) in layers.iter().enumerate() {
            let h = live.ctx.hidden_states(l).ok_or_else(|| TrainError::Cache {
                rung: info.name().to_string(),
                detail: format!("the hidden-state tap saw no rows of layer {l}"),
            })?;
            parts[i].push(h);
        }
    }
    parts
        .iter()
        .map(|p| {
            let views: Vec<_> = p.iter().map(|a| a.view()).collect();
            concatenate(Axis(0), &views).map_err(|e| TrainError::Cache {
                rung: info.name().to_string(),
                detail: e.to_string(),
            })
        })
        .collect()
}

/// Fits the hidden map of every ordered pair of rungs for every `k` in `ks`, writes them, and
/// reports their residuals.
///
/// # Errors
/// Collection, fitting or write errors, naming the route.
pub fn fit_topk_maps(
    ladder: &Ladder,
    config: ContextConfig,
    tokens: &[Token],
    opts: &TrainOptions,
    ks: &[usize],
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<TopkResult>, TrainError> {
    fit_topk_maps_windows(
        ladder,
        config,
        &windows(tokens, opts.window),
        opts,
        ks,
        progress,
    )
}

/// [`fit_topk_maps`] on windows already cut (see [`super::corpus_windows`]).
///
/// # Errors
/// As [`fit_topk_maps`].
pub fn fit_topk_maps_windows(
    ladder: &Ladder,
    config: ContextConfig,
    wins: &[&[Token]],
    opts: &TrainOptions,
    ks: &[usize],
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<TopkResult>, TrainError> {
    let min_layers = ladder
        .rungs
        .iter()
        .map(|r| r.facts.n_layer as usize)
        .min()
        .unwrap_or(0);
    if let Some(&bad) = ks.iter().find(|&&k| k == 0 || k >= min_layers) {
        return Err(TrainError::Corpus(format!(
            "top-k recompute with k = {bad}: every rung needs more than k blocks (the smallest has {min_layers})"
        )));
    }
    let mut states = Vec::new();
    for (i, r) in ladder.rungs.iter().enumerate() {
        let layers = needed_layers(ladder, i, ks);
        progress(&format!(
            "collecting hidden states of layers {layers:?} on {} ({} windows)",
            r.name(),
            wins.len()
        ));
        let h = collect_hidden(r, config, wins, &layers)?;
        states.push(layers.into_iter().zip(h).collect::<Vec<_>>());
    }
    let n_rows = states[0].first().map_or(0, |(_, a)| a.nrows());
    let positions: Vec<i32> = wins
        .iter()
        .flat_map(|w| (0..i32::try_from(w.len()).unwrap_or(i32::MAX)).collect::<Vec<_>>())
        .collect();
    debug_assert_eq!(positions.len(), n_rows);
    let (train, held) = split_windows_by_rows(&positions, opts.held_out_every, opts.skip_head)
        .map_err(|source| TrainError::Fit {
            route: "*".into(),
            variant: "topk split".into(),
            source,
        })?;
    let dir = opts.out_dir.join(ladder.name()).join("ablations");
    std::fs::create_dir_all(&dir).map_err(|source| ProjectorError::Io {
        file: dir.clone(),
        source,
    })?;
    let get = |rung: usize, layer: usize| -> &Array2<f32> {
        &states[rung]
            .iter()
            .find(|(l, _)| *l == layer)
            .expect("collected by needed_layers")
            .1
    };
    let mut out = Vec::new();
    for (si, s) in ladder.rungs.iter().enumerate() {
        for (di, d) in ladder.rungs.iter().enumerate() {
            if si == di {
                continue;
            }
            let (sb, db) = (binding(s), binding(d));
            for &k in ks {
                let route = format!("{}→{}", s.name(), d.name());
                let src_layer = source_layer(sb.n_layer, db.n_layer, k);
                let dst_layer = dst_boundary_layer(db.n_layer, k);
                let (affine, fit) = fit_hidden(
                    get(si, src_layer).view(),
                    get(di, dst_layer).view(),
                    &train,
                    &held,
                )
                .map_err(|source| TrainError::Fit {
                    route: route.clone(),
                    variant: format!("topk{k} hidden map"),
                    source,
                })?;
                progress(&format!(
                    "fitted {route} top-{k} hidden map (layer {src_layer} → {dst_layer}): held-out {:.3} (train {:.3})",
                    fit.held_out_rel_rms, fit.train_rel_rms
                ));
                let path = dir.join(file_name(s.name(), d.name(), k));
                HiddenMap {
                    src: sb.clone(),
                    dst: db.clone(),
                    k,
                    src_layer,
                    affine,
                    fit: fit.clone(),
                }
                .save(&path)?;
                out.push(TopkResult {
                    route,
                    k,
                    src_layer,
                    dst_layer,
                    fit,
                    file: path.display().to_string(),
                });
            }
        }
    }
    Ok(out)
}
