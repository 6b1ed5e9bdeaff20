//! Setting a running answer aside: when no rung holds every running answer together, the
//! scheduler's plan ([`sched::plan`], applied through this module and nowhere else, with the
//! batch's constraints: every running answer on one rung, a parked cache in a file) picks the
//! least protected answers — background before foreground, then the lower priority, the later
//! arrival — whose caches go to files under the state directory, so the others keep running
//! on the largest rung that holds them instead of the whole batch parking. An answer set aside
//! keeps everything but its cache (its sampler, its stream, its text so far); it is told with
//! a stall and a `park` lever, as a parked answer is, and listed as parked.
//!
//! Each round while answers are set aside, the plan is asked again with them as parked
//! tenants: those it resumes are read back from their files and carried onto the rung the
//! batch runs on (imported as they were when it is the rung they left, projected through the
//! switch when it is not), with a `resume` lever; an engine with no running answer loads the
//! rung the plan resumes them on. A file that cannot be read back (or a cache that could not
//! be exported) makes the answer re-read its history there: slower, nothing lost. An answer
//! whose client leaves, or that waits past the park deadline, ends as a parked one does.
//!
//! Without a state directory the cache waits in memory, and the budget the batch fits counts
//! it. When the file cannot be written (a full disk, or past `--state-max-mib`: said in a log
//! line), an answer set aside for memory is put back into its sequence and the batch is fitted
//! as a whole for a while; one set aside for a sequence waits with its cache in memory.

use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::time::Instant;

use super::{
    Engine, Event, Exportedseq, Ladders, LeverInfo, Moving, Scratch, Shared, StateFile, StateMeta,
    StopReason, Tenant, carry_all, carry_into, end_parked, export_for_switch, lever, now_unix_ms,
    publish_batch, publish_engine, report_failed,
};
use crate::conversations::Class;
use molt::engine::SeqId;
use molt::pressure::Budget;
use molt::sched::{self, Lever, Policy, Snapshot, TenantClass, TenantId, TenantView};
use molt::state::Expect;

/// Where a set-aside answer's cache waits.
enum Cache {
    /// Its prompt was not read whole (or the export failed): read again at the resume.
    None,
    /// In host memory (no state directory, or the file could not be written).
    Memory(Exportedseq),
    /// In a file under the state directory's `aside/`, removed when read back.
    File { path: PathBuf, bytes: u64 },
}

/// A running answer set aside.
pub(super) struct Aside {
    t: Tenant,
    /// The rung its cache was exported on.
    rung: usize,
    cache: Cache,
    since: Instant,
}

/// How long the batch is fitted without setting answers aside for memory after a cache could
/// not be written.
const NO_ASIDE_AFTER_FAILURE: std::time::Duration = std::time::Duration::from_secs(30);

/// Why answers are set aside, in the words their streams hear.
pub(super) enum Why {
    /// No rung holds every running answer within the budget.
    Memory,
    /// Every sequence runs an answer and a foreground request waits.
    Sequence,
}

/// Bytes of set-aside caches held in memory: what the batch's budget must leave them.
pub(super) fn in_memory(aside: &[Aside]) -> u64 {
    aside
        .iter()
        .map(|a| match &a.cache {
            Cache::Memory(x) => x.blob.len() as u64,
            _ => 0,
        })
        .sum()
}

/// The folder set-aside caches are written to, if the server has a state directory.
fn folder(shared: &Shared) -> Option<PathBuf> {
    shared.conversations.dir().map(|d| d.path().join("aside"))
}

/// Whether `bytes` more under the state directory keep it within `--state-max-mib`, its
/// conversations' files and the caches set aside counted together; `Err` says why not. A
/// set-aside cache is not a reason to evict a conversation's file: it is refused instead.
fn within_bound(shared: &Shared, aside_dir: &std::path::Path, bytes: u64) -> Result<(), String> {
    let Some(d) = shared.conversations.dir() else {
        return Ok(());
    };
    let files: u64 = d.entries().iter().map(|e| e.bytes).sum();
    let aside: u64 = std::fs::read_dir(aside_dir).map_or(0, |r| {
        r.flatten()
            .filter_map(|e| e.metadata().ok())
            .map(|m| m.len())
            .sum()
    });
    if files + aside + bytes > d.max_bytes() {
        return Err(format!(
            "the state directory's bound ({} MiB) would be passed: {} MiB of state files, {} MiB set aside, {:.1} MiB more",
            d.max_bytes() >> 20,
            files >> 20,
            aside >> 20,
            bytes as f64 / 1_048_576.0
        ));
    }
    Ok(())
}

/// Removes the caches a previous run set aside (their requests ended with it).
pub(super) fn clear_leftovers(shared: &Shared) {
    if let Some(dir) = folder(shared) {
        let _ = std::fs::remove_dir_all(dir);
    }
}

fn is_background_job(j: &super::Job) -> bool {
    j.conversation
        .as_ref()
        .is_some_and(|c| c.class == Class::Background)
}

fn is_background(t: &Tenant) -> bool {
    is_background_job(&t.job)
}

/// A foreground request waiting while every sequence runs an answer and one of them is a
/// background answer: the least protected background answer (the lowest priority, then the
/// latest) is set aside — its cache to its file, as when memory runs short — and the request
/// is taken from the queue to join in its sequence, if the budget holds the batch with it
/// instead. The set-aside answer resumes when a sequence frees (`resume`).
pub(super) fn make_room(
    shared: &Shared,
    l: &Ladders,
    engine: &mut Engine,
    tenants: &mut Vec<Tenant>,
    aside: &mut Vec<Aside>,
    budget: Budget,
) -> Option<super::Job> {
    if !l.set_aside || tenants.len() < engine.ctx.max_seqs() {
        return None;
    }
    let victim = tenants
        .iter()
        .enumerate()
        .filter(|(_, t)| is_background(t))
        .min_by_key(|(_, t)| {
            let priority = t.job.conversation.as_ref().map_or(0, |c| c.priority);
            (priority, std::cmp::Reverse(t.job.received))
        })
        .map(|(i, _)| i)?;
    let n_ctx = l.config.n_ctx;
    let reserved: u64 = tenants
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != victim)
        .map(|(_, t)| t.reserved(n_ctx))
        .sum();
    let fits = |j: &super::Job| !is_background_job(j) && l.joins(engine, reserved, j, budget.bytes);
    let job = shared.queue.take_best(fits)?;
    set_aside(
        shared,
        l,
        engine,
        tenants,
        vec![victim],
        aside,
        budget,
        &Why::Sequence,
    );
    Some(job)
}

/// The scheduler's view of a tenant: its class and priority from its conversation (a request
/// outside one is foreground), arrival as when its request came.
fn view(t: &Tenant, id: u64, base: Instant) -> TenantView {
    let (class, priority) = t
        .job
        .conversation
        .as_ref()
        .map_or((TenantClass::Foreground, 0), |c| match c.class {
            Class::Background => (TenantClass::Background, c.priority),
            Class::Foreground => (TenantClass::Foreground, c.priority),
        });
    let arrival = u64::try_from(t.job.received.saturating_duration_since(base).as_nanos())
        .unwrap_or(u64::MAX);
    TenantView::new(id, class).with_order(priority, arrival)
}

/// The batch's policy: no hysteresis (the batch does not move up mid-answer, and a parked
/// answer resumes as soon as it fits), one rung for every running answer.
fn policy() -> Policy {
    Policy {
        one_rung: true,
        ..Policy::exact()
    }
}

/// A snapshot of the batch: running answers on `rung` (their whole cache pinned: the server
/// never sheds a conversation), set-aside ones parked on the rung they left, `home` the
/// largest rung a running answer may take.
fn snapshot(
    l: &Ladders,
    shared: &Shared,
    (rung, home): (usize, usize),
    tenants: &[Tenant],
    aside: &[Aside],
    budget: u64,
) -> Snapshot {
    let base = tenants
        .iter()
        .map(|t| t.job.received)
        .chain(aside.iter().map(|a| a.t.job.received))
        .min()
        .unwrap_or_else(Instant::now);
    let mut views: Vec<TenantView> = tenants
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let held = t.holding();
            view(t, i as u64, base)
                .with_home(home)
                .with_rung(rung)
                .with_context(held, held)
        })
        .collect();
    views.extend(aside.iter().enumerate().map(|(j, a)| {
        let held = a.t.holding();
        view(&a.t, (tenants.len() + j) as u64, base)
            .with_home(l.home.min(a.rung))
            .with_rung(a.rung)
            .with_context(held, held)
            .with_parked(true)
    }));
    let mut s = Snapshot::new(budget, l.costs.clone(), views);
    s.parked_kv_in_memory = folder(shared).is_none();
    s
}

/// Which running answers to set aside (indices into `tenants`) when the engine's rung `rung`
/// and every smaller one fail to hold them all within `budget`: the plan's parks, provided
/// it keeps one running (else `None`: the whole batch parks).
pub(super) fn choose(
    l: &Ladders,
    shared: &Shared,
    rung: usize,
    tenants: &[Tenant],
    aside: &[Aside],
    budget: u64,
) -> Option<Vec<usize>> {
    if tenants.len() < 2
        || !l.set_aside
        || l.no_aside_until.get().is_some_and(|t| Instant::now() < t)
    {
        return None;
    }
    let s = snapshot(l, shared, (rung, rung), tenants, aside, budget);
    let plan = sched::plan(&s, &policy()).ok()?;
    let parks: Vec<usize> = plan
        .actions
        .iter()
        .filter_map(|&(TenantId(id), lever)| {
            let i = usize::try_from(id).ok()?;
            (matches!(lever, Lever::Park { .. }) && i < tenants.len()).then_some(i)
        })
        .collect();
    (plan.feasible && plan.running > 0 && !parks.is_empty()).then_some(parks)
}

/// Sets the answers at `which` aside: each cache exported on the engine's rung, its sequence
/// freed, the cache written to its file (or kept in memory), the answer told.
#[allow(clippy::too_many_arguments)] // the batch's parts, each needed once
pub(super) fn set_aside(
    shared: &Shared,
    l: &Ladders,
    engine: &mut Engine,
    tenants: &mut Vec<Tenant>,
    mut which: Vec<usize>,
    aside: &mut Vec<Aside>,
    budget: Budget,
    why: &Why,
) {
    static NEXT_FILE: AtomicU64 = AtomicU64::new(0);
    which.sort_unstable();
    which.dedup();
    let protected = tenants.len() - which.len();
    let mut scratch = Scratch::default();
    for i in which.into_iter().rev() {
        let t0 = Instant::now();
        let rss_before = super::super::worker::rss_bytes();
        let mut t = tenants.remove(i);
        let exported = if t.started {
            match export_for_switch(l, &engine.ctx, &mut t, &mut scratch) {
                Ok(x) => Some(x),
                Err(e) => {
                    eprintln!(
                        "molt serve: {} set aside without its cache, its history to be re-read: it could not be exported ({e})",
                        t.job.id
                    );
                    None
                }
            }
        } else {
            None
        };
        engine.ctx.remove_seq(t.seq);
        let cache = match (exported, folder(shared)) {
            (None, _) => Cache::None,
            (Some(x), None) => Cache::Memory(x),
            (Some(x), Some(dir)) => {
                let n = NEXT_FILE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let path = dir.join(format!("{}-{n}.molt-aside", std::process::id()));
                let file = StateFile {
                    meta: StateMeta {
                        conversation: t.job.id.clone(),
                        rung: l.name(engine.rung).to_string(),
                        rung_sha256: engine.sha256.clone(),
                        n_ctx: l.config.n_ctx,
                        tokens: t.cached.clone(),
                        pos_start: 0,
                        pending: None,
                        first_turn_len: 0,
                        pinned: 0,
                        messages: Vec::new(),
                        written_unix_ms: now_unix_ms(),
                    },
                    blob: x.blob,
                };
                let written = within_bound(shared, &dir, file.blob.len() as u64)
                    .and_then(|()| molt::state::create_private_dir(&dir).map_err(|e| e.to_string()))
                    .and_then(|()| {
                        file.write_atomic(&path).map_err(|e| {
                            if e.is_disk_full() {
                                format!("the disk is full: {e}")
                            } else {
                                e.to_string()
                            }
                        })
                    });
                match written {
                    Ok(bytes) => Cache::File { path, bytes },
                    Err(e) => {
                        // Short of memory, a cache held in memory in the source's layout frees
                        // less than the plan counted on: the answer goes back into its
                        // sequence, and the batch is fitted without setting answers aside for
                        // a while (it parks whole when no rung holds it, its caches in memory).
                        let for_memory = matches!(why, Why::Memory);
                        let back = if for_memory {
                            put_back(engine, &file.blob, t.cached.len())
                        } else {
                            None
                        };
                        if let Some(seq) = back {
                            eprintln!(
                                "molt serve: {} could not be set aside: {} could not be written ({e}); the batch is fitted as a whole for {} s",
                                t.job.id,
                                path.display(),
                                NO_ASIDE_AFTER_FAILURE.as_secs()
                            );
                            t.seq = seq;
                            tenants.insert(i, t);
                            l.no_aside_until
                                .set(Some(Instant::now() + NO_ASIDE_AFTER_FAILURE));
                            continue;
                        }
                        eprintln!(
                            "molt serve: {} set aside with its cache in memory: {} could not be written ({e}){}",
                            t.job.id,
                            path.display(),
                            if for_memory {
                                ", nor the cache put back"
                            } else {
                                ""
                            }
                        );
                        Cache::Memory(Exportedseq {
                            blob: file.blob,
                            ms: x.ms,
                        })
                    }
                }
            }
        };
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        let (kept_bytes, where_) = match &cache {
            Cache::None => (0, "its history to be re-read".to_string()),
            Cache::Memory(x) => (x.blob.len() as u64, "its cache in memory".to_string()),
            Cache::File { bytes, .. } => (*bytes, "its cache in a file".to_string()),
        };
        let deadline = l.park_deadline;
        let (cause, awaited) = match why {
            Why::Memory => (
                format!(
                    "budget {} MiB holds no rung with every running answer; set aside for {protected} more protected",
                    budget.bytes >> 20
                ),
                "memory",
            ),
            Why::Sequence => (
                "every sequence runs an answer and a foreground request waits: set aside for it"
                    .to_string(),
                "a sequence",
            ),
        };
        // Listed as parked before its client hears so (a status read on the stall event
        // showed it running).
        if let Some(c) = &t.job.conversation {
            shared.conversations.set_parked(&c.id, true);
        }
        t.emit(
            shared,
            Event::Stall {
                reason: format!(
                    "{cause}, {where_}, waiting for {awaited}{}",
                    deadline.map_or(String::new(), |d| format!(
                        " for up to {:.0} s",
                        d.as_secs_f64()
                    ))
                ),
                deadline_ms: deadline.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            },
        );
        let info = lever(l, engine.rung, &t, "park", ms, budget.bytes);
        t.emit(
            shared,
            Event::Lever(LeverInfo {
                rss_before,
                parked_kv_bytes: kept_bytes,
                ..info
            }),
        );
        shared.recorder.service(
            &t.job.id,
            "set_aside",
            serde_json::json!({"rung": l.name(engine.rung), "tokens": t.cached.len(), "bytes": kept_bytes, "where": where_}),
        );
        aside.push(Aside {
            t,
            rung: engine.rung,
            cache,
            since: Instant::now(),
        });
    }
    publish_batch(shared, l, engine, tenants);
}

/// `blob` imported into a new sequence of `engine`, holding `n_past` positions; the sequence
/// is freed again when that fails.
fn put_back(engine: &mut Engine, blob: &[u8], n_past: usize) -> Option<SeqId> {
    let seq = engine.ctx.add_seq()?;
    if engine.ctx.import_seq(seq, blob).is_ok() && engine.ctx.n_past(seq) == Some(n_past) {
        return Some(seq);
    }
    engine.ctx.remove_seq(seq);
    None
}

/// The cache of a set-aside answer, taken back: read from its file (removed), or `None` to
/// re-read its history.
fn take_cache(l: &Ladders, a: &Aside, cache: Cache) -> Option<Exportedseq> {
    match cache {
        Cache::None => None,
        Cache::Memory(x) => Some(x),
        Cache::File { path, .. } => {
            let t0 = Instant::now();
            let rungs = [(
                l.name(a.rung).to_string(),
                l.ladder.rungs[a.rung].sha256.clone(),
            )];
            let expect = Expect {
                rungs: &rungs,
                n_ctx: l.config.n_ctx,
                continues: None,
            };
            let loaded = StateFile::load(&path, &expect);
            let _ = std::fs::remove_file(&path);
            match loaded {
                Ok(f) if f.meta.tokens == a.t.cached => Some(Exportedseq {
                    blob: f.blob,
                    ms: t0.elapsed().as_secs_f64() * 1e3,
                }),
                Ok(_) => {
                    eprintln!(
                        "molt serve: {}: {} holds other tokens than the answer; its history is re-read",
                        a.t.job.id,
                        path.display()
                    );
                    None
                }
                Err(e) => {
                    eprintln!(
                        "molt serve: {}: its set-aside cache is re-read: {e}",
                        a.t.job.id
                    );
                    None
                }
            }
        }
    }
}

/// Ends set-aside answers whose clients left or whose park deadline passed, as parked ones
/// end (`end_parked`); true when one ended.
pub(super) fn tend(shared: &Shared, l: &Ladders, aside: &mut Vec<Aside>) -> bool {
    let deadline = l.park_deadline;
    let mut ended = false;
    let mut i = 0;
    while i < aside.len() {
        let a = &aside[i];
        let stop = if a.t.job.cancelled() {
            Some(StopReason::Cancelled)
        } else if deadline.is_some_and(|d| a.since.elapsed() >= d) {
            Some(StopReason::ParkDeadline)
        } else {
            None
        };
        let Some(stop) = stop else {
            i += 1;
            continue;
        };
        let mut a = aside.remove(i);
        a.t.stall_ms += a.since.elapsed().as_secs_f64() * 1e3;
        let cache = std::mem::replace(&mut a.cache, Cache::None);
        let x = take_cache(l, &a, cache);
        end_parked(shared, l, a.rung, a.t, x, stop);
        ended = true;
    }
    ended
}

/// Resumes the set-aside answers the plan resumes within `budget` (in-memory caches already
/// taken off it), most protected first: onto the engine's rung when answers run there, else
/// onto the rung the plan picks, loaded for them. Kept sequences make room first.
pub(super) fn resume(
    shared: &Shared,
    l: &mut Ladders,
    engine: &mut Option<Engine>,
    tenants: &mut Vec<Tenant>,
    aside: &mut Vec<Aside>,
    budget: Budget,
) {
    if aside.is_empty() {
        return;
    }
    let (rung, home) = match engine.as_ref() {
        Some(e) if !tenants.is_empty() => (e.rung, e.rung),
        Some(e) => (e.rung, l.home),
        None => (l.home, l.home),
    };
    let s = snapshot(l, shared, (rung, home), tenants, aside, budget.bytes);
    if sched::usage(&s) > budget.bytes {
        // Relief first: the running answers are fitted (`fit_rung`).
        return;
    }
    let Ok(plan) = sched::plan(&s, &policy()) else {
        return;
    };
    let Ok(after) = sched::apply(&plan, &s) else {
        return;
    };
    let n = tenants.len();
    // (aside index, rung), most protected first (the plan's order for helpful actions).
    let resumed: Vec<(usize, usize)> = plan
        .actions
        .iter()
        .filter_map(|&(TenantId(id), lever)| {
            let j = usize::try_from(id).ok()?.checked_sub(n)?;
            matches!(lever, Lever::Resume { .. }).then(|| (j, after.tenants[n + j].rung))
        })
        .collect();
    if resumed.is_empty() {
        return;
    }
    // Demoting the running answers so that a set-aside one runs beside them is less harm than
    // leaving it parked (a park outranks a rung): the batch moves first.
    if let (Some(e), Some(v)) = (engine.as_ref(), after.tenants.first())
        && n > 0
        && v.rung != e.rung
    {
        let to = v.rung;
        if let Err(e) = super::move_all(l, shared, engine, tenants, to, budget) {
            let api = crate::error::ApiError::from_session(&e);
            for t in tenants.drain(..) {
                report_failed(shared, t, &api);
            }
            publish_engine(shared, l, None, tenants);
            return;
        }
    }
    // Taken out highest index first, then resumed in the plan's order.
    let mut order: Vec<usize> = resumed.iter().map(|&(j, _)| j).collect();
    order.sort_unstable();
    let mut taken: Vec<(usize, Aside)> = order
        .into_iter()
        .rev()
        .map(|j| (j, aside.remove(j)))
        .collect();
    for (j, to) in resumed {
        let Some(k) = taken.iter().position(|(i, _)| *i == j) else {
            continue;
        };
        let (_, mut a) = taken.swap_remove(k);
        // Every sequence runs an answer: it waits for one to end. A background answer leaves
        // the last free sequence to a foreground request waiting for one.
        if let Some(e) = engine.as_ref()
            && e.rung == to
            && (tenants.len() >= e.ctx.max_seqs()
                || (tenants.len() + 1 == e.ctx.max_seqs()
                    && is_background(&a.t)
                    && shared.queue.any(|j| !is_background_job(j))))
        {
            aside.push(a);
            continue;
        }
        let parked_ms = a.since.elapsed().as_secs_f64() * 1e3;
        a.t.stall_ms += parked_ms;
        let cache = std::mem::replace(&mut a.cache, Cache::None);
        let x = take_cache(l, &a, cache);
        let from = a.rung;
        let mut one = [a.t];
        let carried = match engine.as_mut() {
            Some(e) if e.rung == to => {
                while e.ctx.active() >= e.ctx.max_seqs() && e.let_go_next(shared) {}
                let cells: u64 = tenants.iter().map(Tenant::holding).sum::<u64>()
                    + one[0].holding()
                    + e.kept_cells();
                while l.need_on(e, cells) > budget.bytes && e.let_go_next(shared) {}
                let t0 = Instant::now();
                carry_into(
                    l,
                    shared,
                    e,
                    from,
                    &mut one,
                    vec![x],
                    budget,
                    (0.0, t0, 0.0),
                    Moving::Resumed,
                )
            }
            _ if tenants.is_empty() => {
                if let Some(mut e) = engine.take() {
                    e.let_go_all(shared);
                    drop(e);
                    molt::pressure::trim_heap();
                }
                carry_all(
                    l,
                    shared,
                    from,
                    to,
                    &mut one,
                    vec![x],
                    budget,
                    0.0,
                    Moving::Resumed,
                )
                .map(|e| {
                    *engine = Some(e);
                })
            }
            // The plan keeps every running answer on one rung, where the batch now is: not
            // reached; the answer waits for the next round.
            _ => {
                let [t] = one;
                aside.push(Aside {
                    t,
                    rung: from,
                    cache: Cache::None,
                    since: Instant::now(),
                });
                continue;
            }
        };
        let [t] = one;
        match carried {
            Ok(()) => {
                let info = lever(l, to, &t, "resume", parked_ms, budget.bytes);
                t.emit(shared, Event::Lever(LeverInfo { parked_ms, ..info }));
                if let Some(c) = &t.job.conversation {
                    shared.conversations.set_parked(&c.id, false);
                }
                shared.recorder.service(
                    &t.job.id,
                    "resumed",
                    serde_json::json!({"rung": l.name(to), "from": l.name(from), "parked_ms": parked_ms}),
                );
                tenants.push(t);
            }
            Err(e) => report_failed(shared, t, &crate::error::ApiError::from_session(&e)),
        }
    }
    // Any not resumed (not reached) go back to waiting.
    aside.extend(taken.into_iter().map(|(_, a)| a));
    match engine.as_ref() {
        Some(e) => publish_batch(shared, l, e, tenants),
        None => publish_engine(shared, l, None, tenants),
    }
}
