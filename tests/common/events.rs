//! What the session tests read from an answer's events: token-clocked traces, the switches and
//! background preparations, and the footprint rule.

use molt::pressure::{Trace, TraceBudget};
use molt::session::{
    Event, GenerateOptions, Generation, LeverInfo, PrepareInfo, PrepareState, Prompt, Session,
    SessionOptions, SwitchInfo,
};

/// Tests that measure rung costs one at a time within a process: a rung's cost is measured at
/// its load as the growth of the process's anonymous memory, and a test loading rungs beside
/// another would be charged for the other's allocations.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Holds [`ONE_AT_A_TIME`] for the caller's test.
pub fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A token-clocked trace: `initial`, then each `(token, bytes)`.
pub fn token_trace(initial: u64, events: &[(usize, u64)]) -> Box<TraceBudget> {
    let ev: Vec<String> = events
        .iter()
        .map(|(at, b)| format!(r#"{{"at":{at},"budget":{b}}}"#))
        .collect();
    let json = format!(
        r#"{{"name":"t","unit":"B","clock":"token","initial":{initial},"events":[{}]}}"#,
        ev.join(",")
    );
    Box::new(TraceBudget::new(Trace::parse(&json).unwrap()))
}

/// The background preparations, in order.
pub fn prepares(events: &[Event]) -> Vec<&PrepareInfo> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Prepare(p) => Some(p),
            _ => None,
        })
        .collect()
}

/// The switches, in order.
pub fn switches(events: &[Event]) -> Vec<&SwitchInfo> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Switch(w) => Some(w),
            _ => None,
        })
        .collect()
}

/// The rung of every token, by index.
pub fn token_rungs(events: &[Event]) -> Vec<(usize, String)> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Token { index, rung, .. } => Some((*index, rung.clone())),
            _ => None,
        })
        .collect()
}

/// Every footprint the session reported, and every preparation started, stayed within the
/// budget in force.
pub fn assert_never_over(events: &[Event]) {
    for e in events {
        if let Event::Footprint(f) = e {
            assert!(
                f.modelled_bytes <= f.budget_bytes,
                "modelled {} B over the budget {} B at token {}",
                f.modelled_bytes,
                f.budget_bytes,
                f.at_token
            );
        }
        if let Event::Prepare(p) = e
            && p.state == PrepareState::Started
        {
            assert!(p.modelled_bytes <= p.budget_bytes, "{p:?}");
        }
    }
}

/// The cache rung `index` of `s` ended the answer with reads as one fresh decode of the same
/// tokens on that rung: holds more than `at_token` positions, and its last logits are within
/// JSD 1e-4 of a fresh context's. `what` names the cache in the failure.
pub fn assert_reads_as_fresh(
    s: &mut molt::session::Session,
    index: usize,
    at_token: usize,
    what: &str,
) {
    let history = s.history().to_vec();
    let info = s.ladder().rungs[index].clone();
    let live = s.rung_mut(index).expect("the answer ended on that rung");
    let n = live.ctx.n_past();
    assert!(
        n > at_token && n <= history.len(),
        "{n} of {}",
        history.len()
    );
    let carried = live.ctx.logits().to_vec();
    let mut fresh = molt::session::LiveRung::load(&info, super::cfg()).unwrap();
    fresh.ctx.decode(&history[..n]).unwrap();
    let jsd = molt::session::jsd(&carried, fresh.ctx.logits());
    assert!(
        jsd < 1e-4,
        "{what} reads as the rung's own: JSD {jsd} against one fresh decode of {n} tokens"
    );
}

/// A session on the tiny ladder, starting on `big` with the tiny projectors and `opts` (no
/// live footprint), answering `text` for 40 tokens with a switch forced onto rung `to` before
/// token `at`: the answer, the levers its events sent, and the session after it (to read its
/// history and caches). The switch is checked to be a single Molt switch.
pub fn forced_switch(
    opts: SessionOptions,
    text: &str,
    at: usize,
    to: usize,
) -> (Generation, Vec<LeverInfo>, Session) {
    let opts = SessionOptions {
        projector_dirs: vec![super::tiny_projectors().clone()],
        observe_footprint: false,
        ..opts
    };
    let l = super::tiny_ladder().clone();
    let mut s = Session::with_options(l, super::cfg_long(), "big", opts).unwrap();
    let mut levers = Vec::new();
    let g = s
        .generate(
            &Prompt::Text(text.into()),
            &GenerateOptions {
                max_tokens: 40,
                force_switch: Some((at, to)),
                ..GenerateOptions::default()
            },
            &mut |e| {
                if let Event::Lever(x) = e {
                    levers.push(x.clone());
                }
            },
        )
        .unwrap();
    assert_eq!(g.switches.len(), 1, "{:?}", g.switches);
    assert_eq!(g.switches[0].method, "molt");
    (g, levers, s)
}
