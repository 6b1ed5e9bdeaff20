//! Molt: an embedded runtime for on-device LLM inference that survives memory pressure.
//!
//! When the operating system takes memory away in the middle of an answer, Molt moves the
//! running generation onto a smaller rung of the same model family *between two tokens*,
//! carrying the attention state (the KV cache) across by projection instead of re-reading the
//! prompt.
//!
//! The rooms, one concept each:
//! - [`gguf`]: GGUF reading (metadata before weights) and writing (tiny test models);
//! - [`ladder`]: the manifest, tokenizer identity, fetch and verification;
//! - [`engine`]: one rung over llama.cpp: model, context, decode, logits, sampling;
//! - [`kv`]: the KV mirror, llama.cpp's sequence state <-> per-layer K/V arrays;
//! - [`session`]: the token loop that streams events and migrates between tokens;
//! - [`server`]: the streaming HTTP service (OpenAI-compatible, every token names its rung);
//! - [`transplant`]: RoPE sandwich, ridge, maps and projector files;
//! - [`routes`]: which projector carries a cache between two rungs of a ladder, and its file
//!   (used by the session, the server and the trainer alike);
//! - [`train`]: fitting a ladder's projectors from its own caches;
//! - [`pressure`] and [`sched`]: budgets, footprints and the policy that keeps Molt inside them;
//! - [`speed`]: each rung's micro-batch and CPU repack, chosen by measurement and budget;
//! - [`bench`]: the benchmark programs;
//! - [`tiny`]: tiny random-weight models of the real architecture, for hermetic tests;
//! - [`durable`]: files replaced whole or not at all (fsync, rename, fsync the directory),
//!   and the partial files of writes cut short;
//! - [`fault`]: `MOLT_FAULT=site:nth`, failures injected on purpose to test recovery;
//! - [`fuzzing`]: the entry points of the fuzz targets and their CI smoke, one per parser of
//!   untrusted bytes.

pub mod bench;
pub mod durable;
pub mod engine;
pub mod fault;
pub mod fuzzing;
pub mod gguf;
pub mod kv;
pub mod ladder;
pub mod pressure;
pub mod routes;
pub mod sched;
pub mod server;
pub mod session;
pub mod speed;
pub mod state;
pub mod tiny;
pub mod train;
pub mod transplant;
