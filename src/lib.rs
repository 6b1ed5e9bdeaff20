//! Molt: an embedded runtime for on-device LLM inference that survives memory pressure.
//!
//! When the operating system takes memory away in the middle of an answer, Molt moves the
//! running generation onto a smaller rung of the same model family *between two tokens*,
//! carrying the attention state (the KV cache) across instead of re-reading the prompt.
//!
//! # Embedding it
//!
//! [`Molt`] is the engine, [`Conversation`] a chat on it, [`Answer`] one reply streaming as
//! [`Event`]s that name the rung each token came from. Here on the tiny random-weight ladder
//! the tests use (the text is nonsense, the machinery real); an application names its own
//! ladder (`Molt::builder("qwen2.5-coder")`) and takes the budget from the system
//! ([`Budget::system`]):
//!
//! ```
//! use molt::{Budget, Event, Molt};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! let manifest = molt::tiny::ladder(dir.path())?; // a ladder of three tiny rungs
//! let molt = Molt::builder(manifest.as_path()).budget(Budget::mib(4096)).build()?;
//! let mut chat = molt.conversation();
//! chat.set_max_tokens(8);
//! for event in chat.send("Where is the build server?")? {
//!     match event? {
//!         Event::Token { text, rung, .. } => print!("[{rung}]{text}"),
//!         Event::Switch(s) => println!("\n↘ {} → {} in {:.0} ms", s.from, s.to, s.timings.cost_ms),
//!         Event::Done(summary) => println!("\n{} tokens", summary.tokens),
//!         _ => {}
//!     }
//! }
//! molt.set_budget(Budget::mib(1))?; // the platform's memory warning, forwarded
//! # Ok(())
//! # }
//! ```
//!
//! Several conversations share one engine and its budget; [`Conversation::hibernate`] writes
//! one to a file that [`Molt::resume`] puts back, in this process or another, on a smaller
//! rung if need be. The examples under `examples/` show each.
//!
//! # The rooms
//!
//! Under the facade, one concept each:
//! - [`gguf`]: GGUF reading (metadata before weights) and writing (tiny test models);
//! - [`ladder`]: the manifest, tokenizer identity, fetch and verification;
//! - [`engine`]: one rung over llama.cpp: model, context, decode, logits, sampling;
//! - [`kv`]: the KV mirror, llama.cpp's sequence state <-> per-layer K/V arrays;
//! - [`session`]: the token loop that streams events and migrates between tokens;
//! - [`transplant`]: RoPE sandwich, ridge, maps and projector files;
//! - [`routes`]: which projector carries a cache between two rungs of a ladder, and its file
//!   (used by the session, the server and the trainer alike);
//! - [`train`]: fitting a ladder's projectors from its own caches;
//! - [`pressure`] and [`sched`]: budgets, footprints and the policy that keeps Molt inside them;
//! - [`speed`]: each rung's micro-batch and CPU repack, chosen by measurement and budget;
//! - [`tiny`]: tiny random-weight models of the real architecture, for hermetic tests;
//! - [`durable`]: files replaced whole or not at all (fsync, rename, fsync the directory),
//!   and the partial files of writes cut short;
//! - [`fault`]: `MOLT_FAULT=site:nth`, failures injected on purpose to test recovery;
//! - [`shipped`]: the projectors and anchors compiled in (feature `shipped-projectors`).
//!
//! The front ends are crates of their own beside this one: `molt-run` (the CLI),
//! `molt-server` (the HTTP service) and `molt-bench` (the benchmarks and the results page).

mod facade;
pub use facade::{
    Answer, Budget, Conversation, Error, Estimate, LadderRef, LoadProgress, Molt, MoltBuilder,
    RungEstimate, Stats,
};
pub use session::{Event, StopReason, SwitchInfo};

pub mod durable;
pub mod engine;
pub mod fault;
pub mod gguf;
pub mod kv;
pub mod ladder;
pub mod pressure;
pub mod routes;
pub mod sched;
pub mod session;
pub mod shipped;
pub mod speed;
pub mod state;
pub mod tiny;
pub mod train;
pub mod transplant;
