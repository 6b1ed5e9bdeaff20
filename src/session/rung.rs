//! A rung as the session holds it: live (weights mapped, context ready), on standby (model and
//! context kept, weight pages released from this process) or parked (weights unmapped, the
//! sequence's KV state kept in host memory as llama.cpp's own blob).
//!
//! Standby exists for the switch's stall: loading a rung — llama.cpp's model load with its
//! mapping populated, a context with a full-window KV buffer cleared, a warm-up decode — took
//! 400–550 ms on the real ladder, ten times the gap between two tokens, and it was on the
//! switch's critical path. A [`StandbyRung`] has done all of that ahead; what it costs while
//! waiting is its anonymous memory (context buffers, tokenizer tables), measured, while its
//! weight pages stay in the page cache and out of this process's RSS.
//!
//! Parking is lossless: [`ParkedRung::resume`] maps the weights again, creates a fresh
//! context and re-imports the blob byte for byte, so the logits after resuming equal those
//! before parking (tested). While parked, the weights' pages belong to the page cache, not to
//! this process: RSS falls by their resident size.

use std::sync::Arc;
use std::time::Instant;

use crate::engine::{Context, ContextConfig, Model, ModelOptions};
use crate::ladder::RungInfo;
use crate::pressure::{
    process_anon_rss_bytes, resident_bytes_of_mapping, return_freed_buffers_to_os,
};
use crate::speed::RungSetup;
use crate::transplant::anchor::Anchor;

use super::SessionError;

/// A rung with its weights mapped and a context ready.
pub struct LiveRung {
    /// What the ladder knows about the rung.
    pub info: RungInfo,
    /// Its llama.cpp context (which holds the model).
    pub ctx: Context,
    /// Anonymous memory the rung added when it was loaded and first used — weights llama.cpp
    /// repacked into its own buffers, the KV buffer, compute and output buffers — measured as
    /// the change of `RssAnon`; 0 when it could not be read. The mapped weights are not in
    /// it (see [`LiveRung::weights_resident`]).
    pub context_bytes: u64,
    /// Time to map the weights and create the context, ms.
    pub load_ms: f64,
    /// Where `load_ms` went.
    pub parts: LoadParts,
    /// The micro-batch and repack it was loaded with, and why ([`crate::speed`]).
    pub setup: RungSetup,
    /// The part of `context_bytes` llama.cpp's model itself holds (its tensor and tokenizer
    /// tables; repacked weights too, when repacked), measured as the change of `RssAnon` over
    /// the model's load: what a model kept after its context is freed still holds
    /// (`super::Session::reap_rungs`).
    pub model_bytes: u64,
}

/// Where a rung's load time went, ms: the parts of [`LiveRung::load`].
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LoadParts {
    /// Our GGUF metadata parse and llama.cpp's model load (the mapping populated).
    pub model_ms: f64,
    /// The context: KV buffer allocated and cleared, compute buffers reserved.
    pub context_ms: f64,
    /// The warm-up decode and the clear after it (0 when the rung's footprint was already
    /// known: see [`LiveRung::load_known`]).
    pub warmup_ms: f64,
}

impl LiveRung {
    /// Maps the rung's weights and creates its context; measures what the rung costs in
    /// anonymous memory (repacked weights and the context's buffers) by running one warm-up
    /// token through it (then clearing it). Micro-batch `config`'s, repack as `MOLT_REPACK`
    /// says (off when unset): Molt's default setup (see [`LiveRung::load_with`]).
    ///
    /// # Errors
    /// [`SessionError::Engine`] when llama.cpp refuses the file or the context.
    pub fn load(info: &RungInfo, config: ContextConfig) -> Result<Self, SessionError> {
        let setup =
            crate::speed::SpeedPolicy::from_env().choose(info.name(), config.n_ubatch, None);
        Self::load_with(info, config, setup)
    }

    /// [`LiveRung::load`] with `setup`'s micro-batch (in place of `config`'s) and repack.
    ///
    /// # Errors
    /// [`SessionError::Engine`] when llama.cpp refuses the file or the context.
    pub fn load_with(
        info: &RungInfo,
        config: ContextConfig,
        setup: RungSetup,
    ) -> Result<Self, SessionError> {
        Self::load_known(info, config, setup, None)
    }

    /// [`LiveRung::load_with`], told what an earlier load of the same rung, context and
    /// setting measured (`known_context_bytes`): the warm-up decode, whose only purpose is to
    /// make llama.cpp touch its compute buffers so that measurement sees them, is then
    /// skipped, and the rung's `context_bytes` is the known figure (or what llama.cpp reserved,
    /// if larger). `None` loads as [`LiveRung::load_with`] does.
    ///
    /// # Errors
    /// [`SessionError::Engine`] when llama.cpp refuses the file or the context.
    pub fn load_known(
        info: &RungInfo,
        mut config: ContextConfig,
        setup: RungSetup,
        known_context_bytes: Option<u64>,
    ) -> Result<Self, SessionError> {
        config.n_ubatch = setup.setting.n_ubatch;
        let t0 = Instant::now();
        let wrap = |source| SessionError::Engine {
            rung: info.name().to_string(),
            source,
        };
        return_freed_buffers_to_os();
        // Before llama.cpp maps the file: its pages in 2 MiB folios map and unmap at a switch
        // in ~1 ms instead of ~40-85 (never fatal: the load reads them as it always did).
        let _ = crate::pressure::pages::settle_huge_folios(&info.path);
        let before = process_anon_rss_bytes().unwrap_or(0);
        let opts = ModelOptions {
            mmap: true,
            repack: setup.setting.repack,
        };
        let model = Model::load(&info.path, info.name(), opts).map_err(wrap)?;
        let t_model = Instant::now();
        let model_bytes = process_anon_rss_bytes().unwrap_or(0).saturating_sub(before);
        let mut ctx = Context::new(model, config).map_err(wrap)?;
        let t_context = Instant::now();
        if known_context_bytes.is_none() {
            // One token makes llama.cpp touch its compute buffers, so the measurement sees them.
            let warm = ctx.model().tokenize(" ", false).map_err(wrap)?;
            if let Some(&t) = warm.first() {
                ctx.decode(&[t]).map_err(wrap)?;
            }
            ctx.clear();
        }
        let t_warm = Instant::now();
        let reserved = ctx.reserved_bytes();
        let measured = known_context_bytes
            .unwrap_or_else(|| process_anon_rss_bytes().unwrap_or(0).saturating_sub(before));
        Ok(Self {
            info: info.clone(),
            ctx,
            // A warm-up token touches only part of the compute buffer; a full prompt batch can
            // touch all of what llama.cpp reserved, so the policy counts the larger of the two.
            context_bytes: measured.max(reserved),
            load_ms: t0.elapsed().as_secs_f64() * 1e3,
            parts: LoadParts {
                model_ms: ms_between(t0, t_model),
                context_ms: ms_between(t_model, t_context),
                warmup_ms: if known_context_bytes.is_some() {
                    0.0
                } else {
                    ms_between(t_context, t_warm)
                },
            },
            setup,
            model_bytes,
        })
    }

    /// The rung's name.
    pub fn name(&self) -> &str {
        self.info.name()
    }

    /// The model.
    pub fn model(&self) -> &Model {
        self.ctx.model()
    }

    /// Resident bytes of the rung's mapped weights right now (0 if unreadable).
    pub fn weights_resident(&self) -> u64 {
        resident_bytes_of_mapping(&self.info.path).unwrap_or(0)
    }

    /// Parks the rung: exports the sequence's state, then drops the context and the model
    /// (unmapping the weights).
    ///
    /// # Errors
    /// [`SessionError::Engine`] if the state cannot be exported (the rung is then dropped
    /// anyway: the caller decided it must go).
    pub fn park(self) -> Result<ParkedRung, SessionError> {
        let t0 = Instant::now();
        let blob = self
            .ctx
            .export_state()
            .map_err(|source| SessionError::Engine {
                rung: self.info.name().to_string(),
                source,
            })?;
        let n_past = self.ctx.n_past();
        let config = self.ctx.config();
        let info = self.info.clone();
        let setup = self.setup;
        drop(self);
        crate::pressure::trim_heap();
        Ok(ParkedRung {
            info,
            config,
            setup,
            blob,
            n_past,
            park_ms: t0.elapsed().as_secs_f64() * 1e3,
        })
    }
}

fn ms_between(a: Instant, b: Instant) -> f64 {
    b.duration_since(a).as_secs_f64() * 1e3
}

/// A rung loaded ahead and waiting: its model and context exist (loaded, warmed up, cleared).
/// Cold, its weight pages are released from this process (see [`crate::pressure::pages`]), and
/// taking it live maps them back in one call; hot ([`StandbyRung::from_live_hot`], while the
/// budget holds them), they stay mapped and count in full, and taking it live costs nothing.
/// Nothing else of [`LiveRung::load`] is repeated.
pub struct StandbyRung {
    live: LiveRung,
    /// What it holds in this process while waiting, measured: the anonymous memory its load
    /// added (context buffers, tokenizer tables, repacked weights if any) plus its weight
    /// pages resident (cold: 0 unless the release failed; hot: all of them).
    pub rss_bytes: u64,
    /// The conversation's head read natively on this rung ([`StandbyRung::read_head`]).
    head: Option<Arc<Anchor>>,
    /// Its weight pages are kept mapped.
    hot: bool,
}

impl StandbyRung {
    /// Loads the rung (as [`LiveRung::load`]) and puts it on standby.
    ///
    /// # Errors
    /// A load failure.
    pub fn prepare(info: &RungInfo, config: ContextConfig) -> Result<Self, SessionError> {
        Ok(Self::from_live(LiveRung::load(info, config)?))
    }

    /// How it was loaded.
    pub fn setup(&self) -> RungSetup {
        self.live.setup
    }

    /// Puts a loaded rung on standby: its cache cleared, its weight pages released. A failed
    /// release (no `/proc`, an old kernel) leaves the pages resident, and `rss_bytes` says so.
    pub fn from_live(mut live: LiveRung) -> Self {
        live.ctx.clear();
        let _ = crate::pressure::pages::release_mapping(&live.info.path);
        let rss_bytes = live.context_bytes + live.weights_resident();
        Self {
            live,
            rss_bytes,
            head: None,
            hot: false,
        }
    }

    /// Puts a loaded rung on standby hot: its cache cleared, every weight page mapped (what
    /// its warm-up did not touch is mapped now) and counted in `rss_bytes`. A switch down onto
    /// it then maps nothing: that took 35-85 ms of a switch's gap on the real ladder, on the
    /// cores the first token needs (`results/switch_stall.json`).
    pub fn from_live_hot(mut live: LiveRung) -> Self {
        live.ctx.clear();
        populate(&live.info.path);
        let rss_bytes = live.context_bytes + live.weights_resident();
        Self {
            live,
            rss_bytes,
            head: None,
            hot: true,
        }
    }

    /// Puts a rung that was just decoding on standby hot without touching its pages or
    /// reading this process's maps: every weight page is mapped already, so `weights_bytes`
    /// (the file's tensor bytes) stands for them until [`StandbyRung::measure`] reads them
    /// after the answer. The source of a switch up is retired this way before the switch's
    /// token is shown: populating and measuring it put 50-120 ms into that gap.
    pub fn from_live_hot_unmeasured(mut live: LiveRung, weights_bytes: u64) -> Self {
        live.ctx.clear();
        let rss_bytes = live.context_bytes + weights_bytes;
        Self {
            live,
            rss_bytes,
            head: None,
            hot: true,
        }
    }

    /// Makes a cold rung hot: its pages mapped back and counted. Nothing happens to a hot one.
    pub fn heat(&mut self) {
        if self.hot {
            return;
        }
        populate(&self.live.info.path);
        self.hot = true;
        self.measure();
    }

    /// Measures what it holds again (its context and its resident weight pages).
    pub fn measure(&mut self) {
        self.rss_bytes = self.live.context_bytes + self.live.weights_resident();
    }

    /// Whether its weight pages are kept mapped.
    pub fn is_hot(&self) -> bool {
        self.hot
    }

    /// Releases a hot rung's weight pages (it stays on standby, cold); `rss_bytes` measured
    /// again. Nothing happens to a cold one.
    pub fn cool(&mut self) {
        if !self.hot {
            return;
        }
        let _ = crate::pressure::pages::release_mapping(&self.live.info.path);
        self.rss_bytes = self.live.context_bytes + self.live.weights_resident();
        self.hot = false;
    }

    /// Reads `head` — the conversation's first tokens, the part of the history a switch's
    /// head re-read gives the destination's own K/V — on this rung, off the answer's path, and
    /// keeps its state (a few cells) as an anchor of this conversation: a switch down onto the
    /// rung then splices every head position in with the projection, where the shipped anchor
    /// covers only the chat template's opening and the first token of the conversation's own
    /// was decoded in the batch of the switch's first token. That batch of two tokens cost
    /// ~85 ms on a 1.5B rung where one token takes ~45 (2 cores: decoding is compute-bound).
    /// Under causal attention the head's cells depend only on the head, so these are the
    /// cells the switch would have computed. The context is cleared and the weight pages the
    /// decode touched released again; on failure the rung stays on standby without a head.
    ///
    /// # Errors
    /// The engine's, when the decode or the export fails.
    pub fn read_head(&mut self, head: &[crate::engine::Token]) -> Result<(), SessionError> {
        if self.head_for(head).is_some() {
            return Ok(());
        }
        self.head = None;
        let rung = self.live.name().to_string();
        let engine = |source| SessionError::Engine { rung, source };
        let ctx = &mut self.live.ctx;
        ctx.clear();
        let state = ctx
            .decode_cache_only(head)
            .and_then(|()| ctx.export_state())
            .map_err(engine);
        ctx.clear();
        if !self.hot {
            let _ = crate::pressure::pages::release_mapping(&self.live.info.path);
        }
        let info = &self.live.info;
        self.head = Some(Arc::new(Anchor {
            rung: info.name().to_string(),
            file: info
                .path
                .file_name()
                .map_or_else(String::new, |f| f.to_string_lossy().into_owned()),
            sha256: info.sha256.clone(),
            tokens: head.to_vec(),
            state: state?,
        }));
        Ok(())
    }

    /// The conversation's head on this rung when it is exactly `head`
    /// ([`StandbyRung::read_head`]).
    pub fn head_for(&self, head: &[crate::engine::Token]) -> Option<Arc<Anchor>> {
        self.head
            .as_ref()
            .filter(|a| !head.is_empty() && a.tokens == head)
            .cloned()
    }

    /// The rung's name.
    pub fn name(&self) -> &str {
        self.live.name()
    }

    /// Its weights file.
    pub fn path(&self) -> &std::path::Path {
        &self.live.info.path
    }

    /// Takes the rung live: maps its weight pages back in (from the page cache when warm,
    /// else from disk; nothing when hot). Returns it with the time that took, ms.
    pub fn activate(self) -> (LiveRung, f64) {
        if self.hot {
            return (self.live, 0.0);
        }
        let ms = populate(&self.live.info.path);
        (self.live, ms)
    }

    /// Takes the rung live without mapping its pages back: for a caller that maps them on a
    /// thread of its own (`populate`) while it does other work.
    pub fn into_live(self) -> LiveRung {
        self.live
    }
}

/// Maps the weight pages of the rung file `path` back into this process (from the page cache
/// when warm, else from disk), as [`StandbyRung::activate`] does. Returns the time that took,
/// ms. A failed populate only means the first decode faults the pages in itself.
pub fn populate(path: &std::path::Path) -> f64 {
    let t0 = Instant::now();
    let _ = crate::pressure::pages::populate_mapping(path);
    t0.elapsed().as_secs_f64() * 1e3
}

/// A rung whose weights are unmapped while its sequence's KV state is kept in host memory.
pub struct ParkedRung {
    /// The rung.
    pub info: RungInfo,
    /// The context configuration to resume with.
    pub config: ContextConfig,
    /// The micro-batch and repack to resume with (the ones it ran with).
    pub setup: RungSetup,
    /// llama.cpp's exported sequence state.
    pub blob: Vec<u8>,
    /// Positions the sequence had.
    pub n_past: usize,
    /// Time the park took, ms.
    pub park_ms: f64,
}

impl ParkedRung {
    /// Bytes the parked state occupies.
    pub fn kv_bytes(&self) -> u64 {
        self.blob.len() as u64
    }

    /// Maps the weights again, creates a context and re-imports the state.
    ///
    /// # Errors
    /// A load failure, or [`SessionError::Engine`] if llama.cpp refuses the blob.
    pub fn resume(self) -> Result<LiveRung, SessionError> {
        let mut live = LiveRung::load_with(&self.info, self.config, self.setup)?;
        if self.n_past > 0 {
            live.ctx
                .import_state(&self.blob)
                .map_err(|source| SessionError::Engine {
                    rung: self.info.name().to_string(),
                    source,
                })?;
        }
        Ok(live)
    }
}
