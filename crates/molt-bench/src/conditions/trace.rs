//! The pressure trace every arm replays: [`spike_trace`] builds it from the rungs' measured
//! costs, at the generated-token steps [`default_steps`] places inside the answer (or the
//! caller gives). Pure functions over numbers; the costs come from the run's probe.

use crate::BenchError;
use molt::pressure::{Trace, TraceStep};
use molt::sched::RungCost;

/// The benchmark's pressure trace, built against the rungs' modelled footprints so that it
/// means the same thing whatever they measure: it starts with room for the largest rung, and
/// at `steps[k - 1]` drops to halfway between what rung `k` needs with the longest context
/// and what rung `k - 1`'s weights and buffers need with no context at all — so rung `k - 1`
/// can never fit again and rung `k` always does, with the widest margin on both sides.
///
/// # Errors
/// [`BenchError::Config`] when `steps` does not have one step per rung below the largest,
/// is not increasing, or two adjacent rungs are too close for such a budget to exist.
pub fn spike_trace(
    costs: &[RungCost],
    ctx_tokens: u64,
    steps: &[usize],
) -> Result<Trace, BenchError> {
    if costs.len() < 2 || steps.len() != costs.len() - 1 {
        return Err(BenchError::Config(format!(
            "the trace needs one step per rung below the largest: {} rungs, {} steps given",
            costs.len(),
            steps.len()
        )));
    }
    if steps.windows(2).any(|w| w[0] >= w[1]) || steps[0] == 0 {
        return Err(BenchError::Config(format!(
            "trace steps must be positive and increasing: {steps:?}"
        )));
    }
    let need = |r: &RungCost| r.resident_bytes() + r.kv_bytes(ctx_tokens);
    let mut out = Vec::new();
    for (k, &at) in steps.iter().enumerate() {
        let (upper, lower) = (&costs[k], &costs[k + 1]);
        let (hi, lo) = (upper.resident_bytes(), need(lower));
        if lo >= hi {
            return Err(BenchError::Config(format!(
                "{} with {ctx_tokens} tokens needs {} MiB, no less than {}'s weights and buffers \
                 ({} MiB): no budget separates them",
                lower.name,
                lo >> 20,
                upper.name,
                hi >> 20
            )));
        }
        out.push(TraceStep {
            at: at as u64,
            budget_bytes: lo + (hi - lo) / 2,
        });
    }
    let initial = need(&costs[0]) + need(&costs[0]) / 4;
    Ok(Trace {
        name: "spike_mid_answer_bench".into(),
        description: format!(
            "Starts with 25% room above the largest rung; at each step the budget falls halfway \
             between the next rung's need ({ctx_tokens} tokens of context) and the current \
             rung's weights and buffers alone, so the answer walks down the ladder one rung per \
             step: {}.",
            costs
                .iter()
                .map(|c| c.name.as_str())
                .collect::<Vec<_>>()
                .join(" -> ")
        ),
        clock: molt::pressure::Clock::Token,
        initial_bytes: initial,
        steps: out,
    })
}

/// The default trace steps for an answer of `max_tokens` on a ladder of `n_rungs`: the first
/// a quarter into the answer, the rest spread evenly up to five eighths of it (16 and 40 for
/// 64 tokens and three rungs), so every rung produces a stretch of the answer.
#[must_use]
pub fn default_steps(max_tokens: usize, n_rungs: usize) -> Vec<usize> {
    let k = n_rungs.saturating_sub(1);
    let first = (max_tokens / 4).max(1);
    let last = (max_tokens * 5 / 8).max(first + k);
    (0..k)
        .map(|i| {
            if k == 1 {
                first
            } else {
                first + (last - first) * i / (k - 1)
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn costs() -> Vec<RungCost> {
        vec![
            RungCost::new("big", 1000 << 20, 28 << 10, 150 << 20),
            RungCost::new("mid", 700 << 20, 28 << 10, 150 << 20),
            RungCost::new("small", 450 << 20, 12 << 10, 60 << 20),
        ]
    }

    #[test]
    fn spike_trace_walks_one_rung_per_step() {
        let c = costs();
        let t = spike_trace(&c, 200, &[16, 40]).unwrap();
        assert_eq!(t.steps.len(), 2);
        assert_eq!((t.steps[0].at, t.steps[1].at), (16, 40));
        for (k, s) in t.steps.iter().enumerate() {
            let need_lower = c[k + 1].resident_bytes() + c[k + 1].kv_bytes(200);
            assert!(s.budget_bytes > need_lower, "rung {} must fit", k + 1);
            assert!(
                s.budget_bytes < c[k].resident_bytes(),
                "rung {k} must not fit even empty"
            );
        }
        assert!(t.initial_bytes > c[0].resident_bytes() + c[0].kv_bytes(200));
    }

    #[test]
    fn default_steps_fall_inside_the_answer() {
        assert_eq!(default_steps(64, 3), vec![16, 40]);
        assert_eq!(default_steps(64, 2), vec![16]);
        let s = default_steps(12, 4);
        assert!(
            s.windows(2).all(|w| w[0] < w[1]) && *s.last().unwrap() < 12,
            "{s:?}"
        );
    }

    #[test]
    fn spike_trace_refuses_bad_steps_and_close_rungs() {
        let c = costs();
        assert!(spike_trace(&c, 200, &[16]).is_err());
        assert!(spike_trace(&c, 200, &[40, 16]).is_err());
        let close = vec![
            RungCost::new("a", 500 << 20, 1 << 10, 0),
            RungCost::new("b", 499 << 20, 1 << 10, 0),
        ];
        assert!(spike_trace(&close, 4096, &[8]).is_err());
    }
}
