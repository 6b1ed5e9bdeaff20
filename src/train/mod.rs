//! Fitting the KV projectors of a ladder: the same text through every rung, aligned K and V
//! collected per layer, one projector fitted per route and variant, written bound to the
//! sha256 of both rungs' files, and every residual reported.
//!
//! Activations come from llama.cpp's own cache: each window of the corpus is decoded from
//! position 0 on a fresh sequence, the sequence state exported and parsed by the KV mirror,
//! and K un-rotated at the rung's RoPE angles (the cache holds K after RoPE) — so the maps are
//! fitted on exactly the numbers a migration will carry, no eval tap needed.
//!
//! Main items: [`collect`] (one rung's activations), [`fit_ladder`] (every route and variant),
//! [`RouteResult`] / [`TrainReport`] (the serialisable residuals), `corpus_tokens`, and in
//! [`topk`] the hidden maps of selective top-k recompute ([`topk::fit_topk_maps`]).

pub mod curve;
pub mod topk;

use std::path::{Path, PathBuf};
use std::time::Instant;

use ndarray::{Array2, Axis, concatenate};
use serde::{Deserialize, Serialize};

use crate::engine::{ContextConfig, Token};
use crate::kv::{KvSnapshot, ParseOptions};
use crate::ladder::{Ladder, RungInfo};
use crate::routes::{RouteKind, Variant, binding, file_name, route_kind};
use crate::session::{LiveRung, SessionError};
use crate::transplant::fit::{
    DepthPolicy, FitOptions, FitReport, LayerActivations, RouteSamples, Split, fit_route,
    split_windows,
};
use crate::transplant::projector::{ProjectorKind, TensorDtype};
use crate::transplant::rope::{Direction, rotate};
use crate::transplant::{ProjectorError, TransplantError};

/// Errors while fitting.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// Loading or running a rung failed.
    #[error(transparent)]
    Session(#[from] SessionError),
    /// The exported cache could not be read.
    #[error("rung {rung}: exported cache: {detail}")]
    Cache {
        /// Rung.
        rung: String,
        /// What went wrong.
        detail: String,
    },
    /// Fitting failed.
    #[error("route {route} ({variant}): {source}")]
    Fit {
        /// Route name.
        route: String,
        /// Variant.
        variant: String,
        /// The error.
        source: TransplantError,
    },
    /// Writing a projector failed.
    #[error(transparent)]
    Write(#[from] ProjectorError),
    /// The corpus is missing or too short.
    #[error("corpus: {0}")]
    Corpus(String),
}

/// One rung's activations over the corpus: pre-RoPE K and V per layer, rows in corpus order.
#[derive(Debug, Clone)]
pub struct Activations {
    /// Per layer.
    pub layers: Vec<LayerActivations>,
    /// Position of every row (restarting at 0 in every window).
    pub positions: Vec<i32>,
    /// Wall time, ms.
    pub elapsed_ms: f64,
}

/// Reads every `*.txt` under `dir` (sorted by name) as the fitting corpus.
///
/// # Errors
/// [`TrainError::Corpus`] if the directory has no text.
pub fn read_corpus(dir: &Path) -> Result<String, TrainError> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| TrainError::Corpus(format!("{}: {e}", dir.display())))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "txt"))
        .collect();
    files.sort();
    let mut text = String::new();
    for f in files {
        let t = std::fs::read_to_string(&f)
            .map_err(|e| TrainError::Corpus(format!("{}: {e}", f.display())))?;
        text.push_str(&t);
        text.push('\n');
    }
    if text.trim().is_empty() {
        return Err(TrainError::Corpus(format!(
            "no text in {} (*.txt)",
            dir.display()
        )));
    }
    Ok(text)
}

/// One conversation of the fitting corpus: a user prompt and the answer the largest rung gave
/// (`chats.jsonl` in the corpus directory, one JSON object per line).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatSample {
    /// The user turn.
    pub prompt: String,
    /// The assistant's answer.
    pub answer: String,
}

/// Reads `chats.jsonl` under `dir` (absent: no chats).
///
/// # Errors
/// [`TrainError::Corpus`] naming the line that is not a `{"prompt", "answer"}` object.
pub fn read_chats(dir: &Path) -> Result<Vec<ChatSample>, TrainError> {
    let path = dir.join("chats.jsonl");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(TrainError::Corpus(format!("{}: {e}", path.display()))),
    };
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| {
                TrainError::Corpus(format!(
                    "{} line {}: not a {{\"prompt\", \"answer\"}} object: {e}",
                    path.display(),
                    i + 1
                ))
            })
        })
        .collect()
}

/// The fitting windows of a corpus: the raw text cut into windows of `window` tokens, then
/// one window per chat — the conversation rendered with `model`'s chat template exactly as a
/// session renders a prompt (system turn included), followed by the answer, cut at `window`
/// tokens. The chats put the attention sink and the template's fixed tokens where a real
/// conversation has them. A model without a chat template (a base model) is prompted with raw
/// text, so its chats are fitted as it reads them: the prompt, a blank line, the answer.
///
/// # Errors
/// [`TrainError::Corpus`] if the template cannot be rendered or the text tokenized.
pub fn corpus_windows(
    model: &crate::engine::Model,
    text: &str,
    chats: &[ChatSample],
    window: usize,
) -> Result<Vec<Vec<Token>>, TrainError> {
    let err = |e: crate::engine::EngineError| TrainError::Corpus(e.to_string());
    let tokens = model.tokenize(text, false).map_err(err)?;
    let mut out: Vec<Vec<Token>> = windows(&tokens, window)
        .into_iter()
        .map(<[Token]>::to_vec)
        .collect();
    let templated = model.chat_template().is_some();
    for c in chats {
        let mut rendered = if templated {
            let conv = [crate::engine::ChatMessage::new("user", &c.prompt)];
            model.apply_chat_template(&conv, true).map_err(err)?
        } else {
            format!("{}\n\n", c.prompt)
        };
        rendered.push_str(&c.answer);
        let mut t = model.tokenize(&rendered, true).map_err(err)?;
        t.truncate(window.max(1));
        out.push(t);
    }
    Ok(out)
}

/// The tokens every chat a session renders opens with: the common token prefix of the chat
/// template rendered around two user messages that differ from their first character
/// (`<|im_start|>user\n` for ChatML). Empty when the model has no template.
///
/// # Errors
/// [`TrainError::Corpus`] if the text cannot be tokenized.
pub fn template_opening(model: &crate::engine::Model) -> Result<Vec<Token>, TrainError> {
    let err = |e: crate::engine::EngineError| TrainError::Corpus(e.to_string());
    let render = |text: &str| {
        model
            .apply_chat_template(&[crate::engine::ChatMessage::new("user", text)], true)
            .ok()
    };
    let (Some(a), Some(b)) = (render("Alpha"), render("0 zulu")) else {
        return Ok(Vec::new());
    };
    let (ta, tb) = (
        model.tokenize(&a, true).map_err(err)?,
        model.tokenize(&b, true).map_err(err)?,
    );
    Ok(ta
        .iter()
        .zip(&tb)
        .take_while(|(x, y)| x == y)
        .map(|(x, _)| *x)
        .collect())
}

/// Fits rung `info`'s anchor: its own state over its chat template's opening, decoded on a
/// fresh context (see [`crate::transplant::anchor`]). `None` when the model has no template
/// or the template has no fixed opening.
///
/// # Errors
/// [`TrainError::Session`] if the rung cannot load or decode, [`TrainError::Cache`] if its
/// state cannot be exported.
pub fn fit_anchor(
    info: &RungInfo,
    config: ContextConfig,
) -> Result<Option<crate::transplant::anchor::Anchor>, TrainError> {
    let mut live = LiveRung::load(info, config)?;
    let tokens = template_opening(live.model())?;
    if tokens.is_empty() {
        return Ok(None);
    }
    let engine = |source| {
        TrainError::Session(SessionError::Engine {
            rung: info.name().to_string(),
            source,
        })
    };
    live.ctx.clear();
    live.ctx.decode_cache_only(&tokens).map_err(engine)?;
    let state = live.ctx.export_state().map_err(|e| TrainError::Cache {
        rung: info.name().to_string(),
        detail: e.to_string(),
    })?;
    Ok(Some(crate::transplant::anchor::Anchor {
        rung: info.name().to_string(),
        file: info.spec.file.clone(),
        sha256: info.sha256.clone(),
        tokens,
        state,
    }))
}

/// Writes every rung's anchor to `<out_dir>/<ladder>/anchors/<rung>.molt-anchor`, returning
/// the files written (a rung without a template opening gets none).
///
/// # Errors
/// As [`fit_anchor`]; [`TrainError::Write`] if a file cannot be written.
pub fn write_anchors(
    ladder: &Ladder,
    config: ContextConfig,
    out_dir: &Path,
) -> Result<Vec<PathBuf>, TrainError> {
    let dir = out_dir.join(ladder.name()).join("anchors");
    let mut written = Vec::new();
    for info in &ladder.rungs {
        if let Some(a) = fit_anchor(info, config)? {
            let path = dir.join(crate::transplant::anchor::file_name(info.name()));
            a.save(&path)?;
            written.push(path);
        }
    }
    Ok(written)
}

/// Cuts `tokens` into windows of `window` tokens (the last partial window is dropped if it
/// is shorter than a quarter window).
#[must_use]
pub fn windows(tokens: &[Token], window: usize) -> Vec<&[Token]> {
    tokens
        .chunks(window.max(1))
        .filter(|c| c.len() * 4 >= window)
        .collect()
}

/// Runs `windows` through `rung` and collects pre-RoPE K and V of every layer.
///
/// # Errors
/// [`TrainError::Session`] if the rung cannot decode, [`TrainError::Cache`] if its exported
/// state cannot be parsed or un-rotated.
pub fn collect(
    info: &RungInfo,
    config: ContextConfig,
    windows: &[&[Token]],
) -> Result<Activations, TrainError> {
    let t0 = Instant::now();
    let mut live = LiveRung::load(info, config)?;
    let b = binding(info);
    let fail = |detail: String| TrainError::Cache {
        rung: info.name().to_string(),
        detail,
    };
    let mut ks: Vec<Vec<Array2<f32>>> = vec![Vec::new(); b.n_layer];
    let mut vs: Vec<Vec<Array2<f32>>> = vec![Vec::new(); b.n_layer];
    let mut positions = Vec::new();
    for w in windows {
        live.ctx.clear();
        live.ctx.decode(w).map_err(|source| {
            TrainError::Session(SessionError::Engine {
                rung: info.name().to_string(),
                source,
            })
        })?;
        let blob = live.ctx.export_state().map_err(|e| fail(e.to_string()))?;
        let snap =
            KvSnapshot::parse(&blob, ParseOptions::default()).map_err(|e| fail(e.to_string()))?;
        let stream = snap.single_stream().map_err(|e| fail(e.to_string()))?;
        if stream.layers.len() != b.n_layer {
            return Err(fail(format!(
                "{} cache layers, the model has {}",
                stream.layers.len(),
                b.n_layer
            )));
        }
        // Rows in position order (cells are in slot order, which a fresh sequence keeps).
        let pos = stream.positions();
        for (l, layer) in stream.layers.iter().enumerate() {
            let mut k = layer.k.clone();
            rotate(k.view_mut(), &pos, &b.rope, Direction::Unrotate)
                .map_err(|e| fail(e.to_string()))?;
            ks[l].push(k);
            vs[l].push(layer.v.clone());
        }
        positions.extend(pos);
    }
    live.ctx.clear();
    let join = |parts: &[Array2<f32>]| -> Result<Array2<f32>, TrainError> {
        let views: Vec<_> = parts.iter().map(|a| a.view()).collect();
        concatenate(Axis(0), &views).map_err(|e| fail(e.to_string()))
    };
    let layers = ks
        .iter()
        .zip(&vs)
        .map(|(k, v)| {
            Ok(LayerActivations {
                k: join(k)?,
                v: join(v)?,
            })
        })
        .collect::<Result<Vec<_>, TrainError>>()?;
    Ok(Activations {
        layers,
        positions,
        elapsed_ms: t0.elapsed().as_secs_f64() * 1e3,
    })
}

/// The fit options of a variant on a route kind, or `None` where the variant does not apply
/// (per-head and no-remap maps on the precision route, identity on the size route).
#[must_use]
pub fn fit_options(variant: Variant, kind: RouteKind) -> Option<FitOptions> {
    let same_depth = |mut o: FitOptions| {
        o.depth = DepthPolicy::Uniform;
        o
    };
    Some(match (variant, kind) {
        (Variant::Auto, RouteKind::Precision) => FitOptions::precision_route(),
        (Variant::Auto | Variant::Dense, RouteKind::Size) => FitOptions::size_route(),
        (Variant::Dense, RouteKind::Precision) => same_depth(FitOptions::size_route()),
        (Variant::PerHead, RouteKind::Size) => FitOptions::per_head_route(),
        (Variant::NoSandwich, RouteKind::Size) => FitOptions {
            sandwich: false,
            ..FitOptions::size_route()
        },
        (Variant::NoSandwich, RouteKind::Precision) => FitOptions {
            sandwich: false,
            ..FitOptions::precision_route()
        },
        (Variant::NoRemap, RouteKind::Size) => same_depth(FitOptions::size_route()),
        (Variant::Truncate, RouteKind::Size) => FitOptions::truncate_baseline(),
        (Variant::Identity, RouteKind::Precision) => FitOptions {
            kind: ProjectorKind::Identity,
            lambdas: Vec::new(),
            ..FitOptions::precision_route()
        },
        _ => return None,
    })
}

/// One fitted route and variant.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RouteResult {
    /// `src→dst`.
    pub route: String,
    /// Source rung.
    pub src: String,
    /// Destination rung.
    pub dst: String,
    /// Precision or size.
    pub kind: RouteKind,
    /// The variant.
    pub variant: Variant,
    /// Where the projector was written (None for variants not written).
    pub file: Option<String>,
    /// File size in bytes.
    pub file_bytes: u64,
    /// The fit's full report (per-layer residuals, λ, depth candidates).
    pub fit: FitReport,
}

/// Everything one fitting run measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainReport {
    /// Corpus tokens used.
    pub corpus_tokens: usize,
    /// Window length.
    pub window: usize,
    /// Every `held_out_every`-th window was held out.
    pub held_out_every: usize,
    /// Activation collection time per rung, ms.
    pub collect_ms: Vec<(String, f64)>,
    /// One entry per route and variant.
    pub routes: Vec<RouteResult>,
    /// Top-k recompute hidden maps, when asked for.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub topk: Vec<topk::TopkResult>,
}

/// Options for [`fit_ladder`].
#[derive(Debug, Clone)]
pub struct TrainOptions {
    /// Tokens per window (each decoded from position 0).
    pub window: usize,
    /// Every n-th window is held out.
    pub held_out_every: usize,
    /// Variants to fit (on the routes they apply to).
    pub variants: Vec<Variant>,
    /// Element type of the written maps.
    pub dtype: TensorDtype,
    /// Where to write: `<out>/<ladder>/<file>`.
    pub out_dir: PathBuf,
    /// Rows of each window's first `skip_head` positions are left out of the fit (and of the
    /// held-out residuals): the attention sink's outsized K/V would otherwise weigh on every
    /// map, and a switch with a head re-read of at least this many tokens never projects them.
    pub skip_head: usize,
    /// Widen every fitted map's output heads to the destination's spread
    /// ([`FitOptions::restore_spread`]).
    pub restore_spread: bool,
}

/// Fits every ordered pair of rungs of `ladder` for every variant in `opts`, writes the
/// projectors, and reports the residuals. `progress` receives one line per step.
///
/// # Errors
/// Any collection, fitting or write error, naming the route.
pub fn fit_ladder(
    ladder: &Ladder,
    config: ContextConfig,
    tokens: &[Token],
    opts: &TrainOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<TrainReport, TrainError> {
    fit_ladder_windows(
        ladder,
        config,
        &windows(tokens, opts.window),
        opts,
        progress,
    )
}

/// [`fit_ladder`] on windows already cut (see [`corpus_windows`]), each decoded from
/// position 0.
///
/// # Errors
/// As [`fit_ladder`].
pub fn fit_ladder_windows(
    ladder: &Ladder,
    config: ContextConfig,
    wins: &[&[Token]],
    opts: &TrainOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<TrainReport, TrainError> {
    let n_tokens: usize = wins.iter().map(|w| w.len()).sum();
    if wins.len() < opts.held_out_every.max(2) {
        return Err(TrainError::Corpus(format!(
            "{} tokens make {} windows of {}; need at least {}",
            n_tokens,
            wins.len(),
            opts.window,
            opts.held_out_every.max(2)
        )));
    }
    let mut acts = Vec::new();
    let mut collect_ms = Vec::new();
    for r in &ladder.rungs {
        progress(&format!(
            "collecting K/V on {} ({} windows of {} tokens)",
            r.name(),
            wins.len(),
            opts.window
        ));
        let a = collect(r, config, wins)?;
        collect_ms.push((r.name().to_string(), a.elapsed_ms));
        acts.push(a);
    }
    let n_rows = acts[0].positions.len();
    let (train, held_out) =
        split_windows_by_rows(&acts[0].positions, opts.held_out_every, opts.skip_head).map_err(
            |source| TrainError::Fit {
                route: "*".into(),
                variant: "split".into(),
                source,
            },
        )?;
    let dir = opts.out_dir.join(ladder.name());
    std::fs::create_dir_all(&dir).map_err(|source| ProjectorError::Io {
        file: dir.clone(),
        source,
    })?;
    let mut routes = Vec::new();
    for (si, s) in ladder.rungs.iter().enumerate() {
        for (di, d) in ladder.rungs.iter().enumerate() {
            if si == di {
                continue;
            }
            let (sb, db) = (binding(s), binding(d));
            let kind = route_kind(&sb, &db);
            for &variant in &opts.variants {
                let Some(mut fo) = fit_options(variant, kind) else {
                    continue;
                };
                fo.restore_spread = opts.restore_spread;
                // On the size route the shipped choice *is* the dense map: fit it once.
                if variant == Variant::Dense
                    && kind == RouteKind::Size
                    && opts.variants.contains(&Variant::Auto)
                {
                    continue;
                }
                let route = format!("{}→{}", s.name(), d.name());
                progress(&format!("fitting {route} ({})", variant.tag(kind)));
                let samples = RouteSamples {
                    src: sb.clone(),
                    dst: db.clone(),
                    src_layers: acts[si].layers.clone(),
                    dst_layers: acts[di].layers.clone(),
                    positions: acts[si].positions.clone(),
                    train: train.clone(),
                    held_out: held_out.clone(),
                };
                debug_assert_eq!(samples.n_rows(), n_rows);
                let (projector, fit) =
                    fit_route(&samples, &fo).map_err(|source| TrainError::Fit {
                        route: route.clone(),
                        variant: variant.tag(kind).to_string(),
                        source,
                    })?;
                drop(samples);
                let (file, file_bytes) = if variant.is_fitted() {
                    // Shipped maps beside the ladder, ablations in a subdirectory (regenerated
                    // by the benchmark, not committed).
                    let sub = if variant == Variant::Auto {
                        dir.clone()
                    } else {
                        dir.join("ablations")
                    };
                    std::fs::create_dir_all(&sub).map_err(|source| ProjectorError::Io {
                        file: sub.clone(),
                        source,
                    })?;
                    let path = sub.join(file_name(s.name(), d.name(), variant.tag(kind)));
                    projector.save(&path, opts.dtype)?;
                    let bytes = std::fs::metadata(&path).map_or(0, |m| m.len());
                    (Some(path.display().to_string()), bytes)
                } else {
                    (None, 0)
                };
                progress(&format!(
                    "  K held-out {:.3} (train {:.3}), V held-out {:.3} (train {:.3})",
                    fit.k.held_out, fit.k.train, fit.v.held_out, fit.v.train
                ));
                routes.push(RouteResult {
                    route,
                    src: s.name().to_string(),
                    dst: d.name().to_string(),
                    kind,
                    variant,
                    file,
                    file_bytes,
                    fit,
                });
            }
        }
    }
    Ok(TrainReport {
        corpus_tokens: n_tokens,
        window: opts.window,
        held_out_every: opts.held_out_every,
        collect_ms,
        routes,
        topk: Vec::new(),
    })
}

/// Train / held-out row ranges by window: a window starts where the position returns to 0.
/// The first `skip_head` rows of every window are left out of both.
fn split_windows_by_rows(
    positions: &[i32],
    held_out_every: usize,
    skip_head: usize,
) -> Result<Split, TransplantError> {
    let starts: Vec<usize> = positions
        .iter()
        .enumerate()
        .filter(|&(_, &p)| p == 0)
        .map(|(i, _)| i)
        .collect();
    if starts.len() < 2 {
        // One window: fall back to fixed-size pieces of it.
        return split_windows(
            positions.len(),
            positions.len().div_ceil(8).max(1),
            held_out_every,
        );
    }
    let mut train = Vec::new();
    let mut held = Vec::new();
    for (w, &st) in starts.iter().enumerate() {
        let end = starts.get(w + 1).copied().unwrap_or(positions.len());
        let st = (st + skip_head).min(end);
        if w % held_out_every == held_out_every - 1 {
            held.push(st..end);
        } else {
            train.push(st..end);
        }
    }
    if held.is_empty()
        && let Some(last) = train.pop()
    {
        held.push(last);
    }
    Ok((train, held))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // vectors of row ranges, one per window
    fn skip_head_leaves_each_windows_first_rows_out() {
        let positions: Vec<i32> = (0..3).flat_map(|_| 0..10).collect();
        let (train, held) = split_windows_by_rows(&positions, 3, 4).unwrap();
        assert_eq!(train, vec![4..10, 14..20]);
        assert_eq!(held, vec![24..30]);
        let (train, _) = split_windows_by_rows(&positions, 3, 0).unwrap();
        assert_eq!(train, vec![0..10, 10..20]);
        // A skip longer than a window leaves it empty rather than reaching into the next.
        let (train, held) = split_windows_by_rows(&positions, 3, 99).unwrap();
        assert_eq!((train, held), (vec![10..10, 20..20], vec![30..30]));
    }

    #[test]
    fn chats_are_read_line_by_line_and_a_bad_line_is_named() {
        let dir = std::env::temp_dir().join(format!("molt-chats-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(read_chats(&dir).unwrap().is_empty(), "no file: no chats");
        std::fs::write(
            dir.join("chats.jsonl"),
            "{\"prompt\": \"p1\", \"answer\": \"a1\"}\n\n{\"prompt\": \"p2\", \"answer\": \"a2\"}\n",
        )
        .unwrap();
        let c = read_chats(&dir).unwrap();
        assert_eq!(c.len(), 2);
        assert_eq!((c[1].prompt.as_str(), c[1].answer.as_str()), ("p2", "a2"));
        std::fs::write(
            dir.join("chats.jsonl"),
            "{\"prompt\": \"p1\", \"answer\": \"a1\"}\n{\"prompt\": \"p2\"}\n",
        )
        .unwrap();
        let e = read_chats(&dir).unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains("answer"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
