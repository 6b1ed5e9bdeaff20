//! Which projector carries a cache from one rung to another, and where its file is.
//!
//! A route is an ordered pair of rungs. Its kind follows from geometry: rungs with the same
//! layer count, KV heads and head size are a **precision route** (tier0 ↔ tier1: same weights,
//! other quantization → per-channel diagonal maps); anything else is a **size route**
//! (tier0/tier1 ↔ tier2 → dense maps with a depth remap). Fitted projectors live in
//! `<projectors>/<ladder>/<src>-to-<dst>.<variant>.molt-proj` (ablation variants under
//! `<projectors>/<ladder>/ablations/`), each bound to the sha256 of both
//! rungs' files; [`Routes`] loads them on first use and caches them. The naive truncated map
//! and the identity need no fitting and are built in memory.
//!
//! A ladder switches well the moment it is made: with the shipped variant ([`Variant::Auto`])
//! a precision route without a fitted map carries the cache as it is (the identity, same
//! weights' geometry: [`Routes::is_unfitted_identity`] says when that happened), and the size
//! route's default switch reads natively and projects nothing, so the session does not ask
//! for its map at all (see `session::switch`). Fitting is only for what uses the maps.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::gguf::RopeKind as GgufRopeKind;
use crate::ladder::{Ladder, RungInfo};
use crate::transplant::ProjectorError;
use crate::transplant::anchor::{Anchor, file_name as anchor_file_name};
use crate::transplant::hidden::{HiddenMap, file_name as hidden_file_name};
use crate::transplant::map::LayerMap;
use crate::transplant::project::identity_projector;
use crate::transplant::projector::{LayerProjection, Projector, ProjectorKind, RungBinding};
use crate::transplant::rope::{RopeKind, RopeSpec};

/// Which projector family a session uses; everything but [`Variant::Auto`] is an ablation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Variant {
    /// The shipped choice per route kind: diagonal on the precision route, dense on the size
    /// route (both in the sandwich, size route with the depth remap).
    Auto,
    /// Dense maps on every route (on the precision route: dense instead of diagonal).
    Dense,
    /// Per-head block maps on the size route.
    PerHead,
    /// Dense maps fitted on rotated keys directly (no RoPE sandwich).
    NoSandwich,
    /// Dense maps with the proportional layer correspondence (no depth-remap search).
    NoRemap,
    /// Naive baseline: first dimensions of each head, index-mapped layers, no fitting.
    Truncate,
    /// Copy the cache unchanged (precision route only: "no diagonal scale").
    Identity,
}

impl Variant {
    /// File-name tag of a fitted variant on a route kind.
    #[must_use]
    pub fn tag(self, kind: RouteKind) -> &'static str {
        match (self, kind) {
            (Self::Auto, RouteKind::Precision) => "diagonal",
            (Self::Auto | Self::Dense, _) => "dense",
            (Self::PerHead, _) => "per-head",
            (Self::NoSandwich, RouteKind::Precision) => "diagonal-no-sandwich",
            (Self::NoSandwich, RouteKind::Size) => "dense-no-sandwich",
            (Self::NoRemap, _) => "dense-no-remap",
            (Self::Truncate, _) => "truncate",
            (Self::Identity, _) => "identity",
        }
    }

    /// Whether this variant is read from a fitted file (otherwise it is built in memory).
    #[must_use]
    pub fn is_fitted(self) -> bool {
        !matches!(self, Self::Truncate | Self::Identity)
    }
}

/// The two kinds of route, which are different problems.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RouteKind {
    /// Same geometry, other precision.
    Precision,
    /// Other depth / head size.
    Size,
}

/// The projector-facing identity and geometry of a rung.
#[must_use]
pub fn binding(info: &RungInfo) -> RungBinding {
    let f = &info.facts;
    let head_dim = f.head_dim as usize;
    let kind = match f.rope.kind {
        GgufRopeKind::Norm => RopeKind::Norm,
        _ => RopeKind::Neox,
    };
    let n_rot = if f.rope.dimension_count == 0 {
        head_dim
    } else {
        (f.rope.dimension_count as usize).min(head_dim)
    };
    RungBinding {
        name: info.name().to_string(),
        file: info.spec.file.clone(),
        sha256: info.sha256.clone(),
        n_layer: f.n_layer as usize,
        n_kv_heads: f.n_head_kv as usize,
        head_dim,
        rope: RopeSpec {
            kind,
            head_dim,
            n_rot,
            freq_base: f.rope.freq_base,
            freq_scale: f.rope.freq_scale(),
        },
    }
}

/// The kind of the route between two rungs.
#[must_use]
pub fn route_kind(src: &RungBinding, dst: &RungBinding) -> RouteKind {
    if src.n_layer == dst.n_layer
        && src.n_kv_heads == dst.n_kv_heads
        && src.head_dim == dst.head_dim
    {
        RouteKind::Precision
    } else {
        RouteKind::Size
    }
}

/// File name of a fitted projector.
#[must_use]
pub fn file_name(src: &str, dst: &str, tag: &str) -> String {
    format!("{src}-to-{dst}.{tag}.molt-proj")
}

/// The naive baseline: output head `h` copies the first dimensions of the matching input head,
/// destination layer `j` reads source layer `min(j, n_src − 1)`; keys still go through the
/// sandwich, so only the maps are naive.
#[must_use]
pub fn truncate_projector(src: &RungBinding, dst: &RungBinding) -> Projector {
    let map = || LayerMap::Truncate {
        n_heads_in: src.n_kv_heads,
        head_dim_in: src.head_dim,
        n_heads_out: dst.n_kv_heads,
        head_dim_out: dst.head_dim,
    };
    Projector {
        src: src.clone(),
        dst: dst.clone(),
        kind: ProjectorKind::Truncate,
        sandwich: true,
        layers: (0..dst.n_layer)
            .map(|j| LayerProjection {
                src_layers: vec![j.min(src.n_layer - 1)],
                k: map(),
                v: map(),
                fit: None,
            })
            .collect(),
    }
}

/// Where projector files are searched: an explicit directory, `$MOLT_HOME/projectors`,
/// `./projectors`, the per-user data directory.
#[must_use]
pub fn search_dirs(explicit: Option<&Path>) -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Some(d) = explicit {
        v.push(d.to_path_buf());
    }
    if let Some(h) = std::env::var_os("MOLT_HOME").filter(|v| !v.is_empty()) {
        v.push(PathBuf::from(h).join("projectors"));
    }
    v.push(PathBuf::from("projectors"));
    if let Some(u) = crate::ladder::search::user_models_dir()
        && let Some(p) = u.parent()
    {
        v.push(p.join("projectors"));
    }
    v
}

/// The first of `dirs` holding `<dir>/<ladder>/anchors/<rung>.molt-anchor`.
#[must_use]
pub fn anchor_path(dirs: &[PathBuf], ladder: &str, rung: &str) -> Option<PathBuf> {
    dirs.iter()
        .map(|d| d.join(ladder).join("anchors").join(anchor_file_name(rung)))
        .find(|p| p.exists())
}

/// Why a route has no usable projector.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    /// No file for the route in any searched directory.
    #[error(
        "no {tag} projector for {src} -> {dst} (looked for {file} in {searched}); run `molt-run train-projectors`"
    )]
    Missing {
        /// Source rung.
        src: String,
        /// Destination rung.
        dst: String,
        /// Variant tag.
        tag: String,
        /// File name.
        file: String,
        /// Directories searched.
        searched: String,
    },
    /// The file exists but cannot be used (bound to other files, corrupt, other geometry).
    #[error(transparent)]
    Projector(#[from] ProjectorError),
    /// The identity is only meaningful between rungs of one geometry.
    #[error("the identity map needs rungs of one geometry; {src} -> {dst} is a size route")]
    IdentityOnSizeRoute {
        /// Source rung.
        src: String,
        /// Destination rung.
        dst: String,
    },
}

/// Projectors of one ladder, loaded on first use.
#[derive(Debug)]
pub struct Routes {
    dirs: Vec<PathBuf>,
    ladder_name: String,
    bindings: Vec<RungBinding>,
    variant: Variant,
    cache: HashMap<(usize, usize), Arc<Projector>>,
    /// Precision routes carried by the identity because no map was fitted for them.
    unfitted: std::collections::HashSet<(usize, usize)>,
    hidden: HashMap<(usize, usize, usize), Arc<HiddenMap>>,
    anchors: HashMap<usize, Option<Arc<Anchor>>>,
}

impl Routes {
    /// The search directories, for a [`RouteError::Missing`] to name.
    fn searched(&self) -> String {
        self.dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The first of the search directories holding `file` for this ladder, the shipped
    /// variants' folder before its `ablations/`.
    fn find_file(&self, file: &str) -> Option<PathBuf> {
        self.dirs
            .iter()
            .flat_map(|dir| {
                let l = dir.join(&self.ladder_name);
                [l.join(file), l.join("ablations").join(file)]
            })
            .find(|p| p.exists())
    }

    /// Routes between the rungs of `ladder`, searching `dirs` (see [`search_dirs`]) for
    /// `<dir>/<ladder>/<file>`.
    #[must_use]
    pub fn new(ladder: &Ladder, dirs: Vec<PathBuf>, variant: Variant) -> Self {
        Self {
            dirs,
            ladder_name: ladder.name().to_string(),
            bindings: ladder.rungs.iter().map(binding).collect(),
            variant,
            cache: HashMap::new(),
            unfitted: std::collections::HashSet::new(),
            hidden: HashMap::new(),
            anchors: HashMap::new(),
        }
    }

    /// The top-k recompute hidden map from rung `src` to rung `dst` for `k` blocks
    /// (`<src>-to-<dst>.topk<k>.molt-hmap`, beside the projectors or under `ablations/`).
    ///
    /// # Errors
    /// [`RouteError::Missing`] when no file exists, [`RouteError::Projector`] when it is bound
    /// to other GGUF files or damaged.
    pub fn hidden(
        &mut self,
        src: usize,
        dst: usize,
        k: usize,
    ) -> Result<Arc<HiddenMap>, RouteError> {
        if let Some(m) = self.hidden.get(&(src, dst, k)) {
            return Ok(Arc::clone(m));
        }
        let (s, d) = (&self.bindings[src], &self.bindings[dst]);
        let file = hidden_file_name(&s.name, &d.name, k);
        let found = self.find_file(&file);
        let Some(path) = found else {
            return Err(RouteError::Missing {
                src: s.name.clone(),
                dst: d.name.clone(),
                tag: format!("topk{k} hidden-map"),
                file,
                searched: self.searched(),
            });
        };
        let m = Arc::new(HiddenMap::load(&path, &s.sha256, &d.sha256)?);
        self.hidden.insert((src, dst, k), Arc::clone(&m));
        Ok(m)
    }

    /// Rung `i`'s anchor (`anchors/<rung>.molt-anchor` beside the projectors): its native
    /// state over the chat template's opening, spliced into a switch's head re-read. `None`
    /// when no file is shipped (the head is then decoded).
    ///
    /// # Errors
    /// [`RouteError::Projector`] when the file is bound to another GGUF file or damaged.
    pub fn anchor(&mut self, i: usize) -> Result<Option<Arc<Anchor>>, RouteError> {
        if let Some(a) = self.anchors.get(&i) {
            return Ok(a.clone());
        }
        let b = &self.bindings[i];
        let a = match anchor_path(&self.dirs, &self.ladder_name, &b.name) {
            Some(p) if crate::fault::hit(crate::fault::Site::AnchorRead) => {
                return Err(crate::transplant::ProjectorError::Io {
                    file: p,
                    source: std::io::Error::other(crate::fault::detail(
                        crate::fault::Site::AnchorRead,
                    )),
                }
                .into());
            }
            Some(p) => Some(Arc::new(Anchor::load(&p, &b.sha256)?)),
            None => None,
        };
        self.anchors.insert(i, a.clone());
        Ok(a)
    }

    /// Installs an anchor for rung `i` (tests, freshly fitted anchors; `None`: use none).
    pub fn insert_anchor(&mut self, i: usize, anchor: Option<Anchor>) {
        self.anchors.insert(i, anchor.map(Arc::new));
    }

    /// Installs a hidden map for a route (tests, freshly fitted maps).
    pub fn insert_hidden(&mut self, src: usize, dst: usize, map: HiddenMap) {
        self.hidden.insert((src, dst, map.k), Arc::new(map));
    }

    /// The variant in use.
    #[must_use]
    pub fn variant(&self) -> Variant {
        self.variant
    }

    /// The binding of rung `i`.
    #[must_use]
    pub fn binding(&self, i: usize) -> &RungBinding {
        &self.bindings[i]
    }

    /// Whether the route `src → dst` is a precision route that [`Routes::get`] carries by the
    /// identity because no map is fitted for it (a switch's note says so).
    #[must_use]
    pub fn is_unfitted_identity(&self, src: usize, dst: usize) -> bool {
        self.unfitted.contains(&(src, dst))
    }

    /// The projector from rung `src` to rung `dst`. With [`Variant::Auto`], a precision route
    /// without a fitted file is carried by the identity (two quantizations of the same weights
    /// cache nearly the same K/V; measured by `molt-run bench --recall-identity`).
    ///
    /// # Errors
    /// [`RouteError::Missing`] when no file exists (a size route, or an ablation variant),
    /// [`RouteError::Projector`] when the file is bound to other GGUF files or is corrupt.
    pub fn get(&mut self, src: usize, dst: usize) -> Result<Arc<Projector>, RouteError> {
        if let Some(p) = self.cache.get(&(src, dst)) {
            return Ok(Arc::clone(p));
        }
        let (s, d) = (&self.bindings[src], &self.bindings[dst]);
        let kind = route_kind(s, d);
        let p = match self.variant {
            Variant::Truncate => truncate_projector(s, d),
            Variant::Identity => {
                if kind != RouteKind::Precision {
                    return Err(RouteError::IdentityOnSizeRoute {
                        src: s.name.clone(),
                        dst: d.name.clone(),
                    });
                }
                let mut p = identity_projector(s);
                p.dst = d.clone();
                p
            }
            v => {
                let tag = v.tag(kind);
                let file = file_name(&s.name, &d.name, tag);
                match self.find_file(&file) {
                    Some(path) => Projector::load(&path, &s.sha256, &d.sha256)?,
                    None if v == Variant::Auto && kind == RouteKind::Precision => {
                        let mut p = identity_projector(s);
                        p.dst = d.clone();
                        self.unfitted.insert((src, dst));
                        p
                    }
                    None => {
                        return Err(RouteError::Missing {
                            src: s.name.clone(),
                            dst: d.name.clone(),
                            tag: tag.to_string(),
                            file,
                            searched: self.searched(),
                        });
                    }
                }
            }
        };
        let p = Arc::new(p);
        self.cache.insert((src, dst), Arc::clone(&p));
        Ok(p)
    }

    /// Installs a projector for a route (tests, freshly fitted maps).
    pub fn insert(&mut self, src: usize, dst: usize, projector: Projector) {
        self.cache.insert((src, dst), Arc::new(projector));
    }
}
