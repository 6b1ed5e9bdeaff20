//! The conditions benchmark end to end on the tiny ladder (real llama.cpp execution, random
//! weights): every arm runs under the benchmark's own trace, the seam pass reads attention
//! through the eval tap, the judge scores continuations, and the figures and the results page
//! are generated from the JSON written — so a broken pipeline fails here, not after an hour on
//! the real ladder.

mod common;

use molt::engine::{Context, ContextConfig, Model, ModelOptions};
use molt::routes::RouteKind;
use molt::routes::Variant;
use molt::train::{TrainOptions, fit_ladder, read_corpus};
use molt::transplant::projector::TensorDtype;
use molt_bench::conditions::{self, ConditionsOptions, PromptSpec, RunLog};
use molt_bench::{figures, page};
use std::path::PathBuf;

fn projectors(out: &std::path::Path) -> molt::train::TrainReport {
    let l = common::tiny_ladder();
    let corpus =
        read_corpus(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("projectors/corpus")).unwrap();
    let model = Model::load(&l.rungs[0].path, "big", ModelOptions::default()).unwrap();
    let tokens = model.tokenize(&corpus, false).unwrap();
    fit_ladder(
        l,
        common::cfg_conditions(),
        &tokens[..tokens.len().min(1600)],
        &TrainOptions {
            window: 128,
            held_out_every: 4,
            variants: vec![
                Variant::Auto,
                Variant::Dense,
                Variant::PerHead,
                Variant::NoSandwich,
                Variant::NoRemap,
            ],
            dtype: TensorDtype::F32,
            out_dir: out.to_path_buf(),
            skip_head: 0,
            restore_spread: false,
        },
        &mut |_| {},
    )
    .unwrap()
}

#[test]
fn attention_tap_reads_entropies_without_changing_logits() {
    let l = common::tiny_ladder();
    let info = &l.rungs[0];
    let model = Model::load(&info.path, info.name(), ModelOptions::default()).unwrap();
    let toks = model
        .tokenize("the cache moves between two tokens", false)
        .unwrap();
    let mut plain = Context::new(model.clone(), common::cfg_conditions()).unwrap();
    assert!(!plain.arm_attention_tap(), "no tap unless configured");
    // The same batches on both contexts (batch shape changes rounding).
    plain.decode(&toks[..toks.len() - 1]).unwrap();
    plain.decode(&toks[toks.len() - 1..]).unwrap();
    let mut tapped = Context::new(
        model,
        ContextConfig {
            attention_tap: true,
            ..common::cfg_conditions()
        },
    )
    .unwrap();
    tapped.decode(&toks[..toks.len() - 1]).unwrap();
    assert!(
        tapped.take_attention().is_none(),
        "a disarmed tap records nothing"
    );
    assert!(tapped.arm_attention_tap());
    tapped.decode(&toks[toks.len() - 1..]).unwrap();
    assert_eq!(plain.logits(), tapped.logits(), "the tap only reads");
    let cap = tapped.take_attention().expect("armed decode captured");
    assert_eq!(cap.layers.len(), 4, "one entry per layer of tiny-big");
    assert_eq!(
        cap.n_attended,
        toks.len(),
        "the last token attends to every position"
    );
    let max = (toks.len() as f64).ln();
    for (_, heads) in &cap.layers {
        assert_eq!(heads.len(), 4, "one entropy per query head");
        assert!(
            heads.iter().all(|&h| (0.0..=max + 1e-6).contains(&h)),
            "{heads:?}"
        );
    }
    assert!(tapped.take_attention().is_none(), "taken once");
}

#[test]
fn conditions_pipeline_on_tiny_ladder() {
    let l = common::tiny_ladder();
    let dir = tempfile::tempdir().unwrap();
    let proj = dir.path().join("projectors");
    let fitted = projectors(&proj);
    let prompts = vec![
        PromptSpec {
            id: "p1".into(),
            kind: "code".into(),
            prompt: "fn main() { let v: Vec<u32> = (0..10).collect(); }".into(),
        },
        PromptSpec {
            id: "p2".into(),
            kind: "general".into(),
            prompt: "The scheduler parks the weights of a background job.".into(),
        },
    ];
    let opts = ConditionsOptions {
        arms: conditions::select_arms("all").unwrap(),
        prompts,
        max_tokens: 16,
        reps: 2,
        quality: true,
        steps: conditions::default_steps(16, l.rungs.len()),
        trace: None,
        projector_dirs: vec![proj],
        chat: false,
    };
    let (report, logs) = conditions::run(l, common::cfg_conditions(), &opts, &mut |s| {
        eprintln!("{s}")
    })
    .unwrap();
    let arm = |id: &str| report.summary.iter().find(|s| s.arm == id).unwrap();
    eprintln!("{}", page::table(&report));

    // A holds the big rung and is killed at the first step; B never moves and survives.
    assert_eq!(arm("A").killed, 2);
    assert_eq!(arm("A").tokens_delivered, 0.0);
    assert_eq!(arm("B").killed, 0);
    assert_eq!(arm("B").switches_per_answer, 0.0);
    // C and D walk down the whole ladder, one rung per step, the same way.
    for id in ["C", "D", "D-truncate"] {
        for c in report.cells.iter().filter(|c| c.arm == id) {
            for t in &c.timed {
                assert_eq!(t.rungs_used, ["big", "big-q8", "small"], "{id}");
                assert!(!t.killed);
                assert_eq!(
                    t.switches.iter().map(|s| s.at_token).collect::<Vec<_>>(),
                    opts.steps
                );
                assert!(t.max_overshoot_bytes.is_some());
            }
        }
    }
    assert!(
        report
            .cells
            .iter()
            .filter(|c| c.arm == "C")
            .all(|c| c.timed[0].switches[0].method == "reprefill")
    );
    // Timings carry one sample per repetition.
    assert_eq!(arm("D").switch_cost_ms.as_ref().unwrap().samples.len(), 2);
    // A re-prefilled cache is native: its attention is as sharp as native, to rounding.
    let c = arm("C");
    for v in [c.flatness_precision, c.flatness_size] {
        let v = v.expect("flatness measured");
        assert!((v - 1.0).abs() < 0.02, "re-prefill flatness {v}");
    }
    // Molt's seam is measured on both route kinds, and the ablations change only their route:
    // the depth-remap ablation leaves the precision route (and its JSD) exactly as D has it.
    let d = arm("D");
    assert!(d.handoff_jsd_precision.is_some() && d.handoff_jsd_size.is_some());
    let seams = |id: &str| {
        report
            .cells
            .iter()
            .filter(|c| c.arm == id)
            .flat_map(|c| c.quality.as_ref().unwrap().seams.clone())
            .filter(|s| s.kind == RouteKind::Precision)
            .map(|s| s.handoff_jsd.unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(seams("D-no-remap"), seams("D"));
    assert!(d.judge_ppl.is_some_and(f64::is_finite));
    assert!(
        arm("A").judge_ppl.is_none(),
        "a killed answer is not judged"
    );
    assert!(
        report.summary.iter().all(|s| !s.arm.starts_with("D-topk")),
        "`all` leaves the top-k arms to be chosen by name"
    );
    assert!(report.representative.is_some());

    // Outputs, figures and the page, from the files alone.
    let out = dir.path().join("results");
    conditions::write_outputs(&report, &logs, &out).unwrap();
    let lines = std::fs::read_to_string(out.join("conditions_events.jsonl")).unwrap();
    let parsed: Vec<RunLog> = lines
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(parsed.len(), logs.len());
    // The other two inputs of the page, in the shapes their commands write.
    std::fs::write(
        out.join("projector_residuals.json"),
        serde_json::to_string(&serde_json::json!({ "ladder": "tiny", "report": fitted })).unwrap(),
    )
    .unwrap();
    let corpus =
        read_corpus(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("projectors/corpus")).unwrap();
    let model = Model::load(&l.rungs[0].path, "big", ModelOptions::default()).unwrap();
    let tokens = model.tokenize(&corpus, false).unwrap();
    let need = 64 + 1 + molt_bench::cost_sweep::SEAM;
    // The sweep's default contexts: conversations in the chat form a session holds.
    let chats = molt::train::read_chats(
        &PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("projectors/corpus"),
    )
    .unwrap();
    let contexts = molt_bench::cost_sweep::chat_contexts(&model, &chats, need, 2).unwrap();
    assert_eq!(contexts.len(), 2);
    assert_ne!(
        contexts[0], contexts[1],
        "each repetition opens another conversation"
    );
    assert!(contexts.iter().all(|c| c.len() >= need));
    let mut routes =
        molt::routes::Routes::new(l, vec![dir.path().join("projectors")], Variant::Auto);
    // The session's default switch: its rungs observe attention for the token recompute.
    let mut observing = common::cfg_conditions();
    observing.attention_tap = true;
    let points = molt_bench::cost_sweep::run(
        l,
        observing,
        &mut routes,
        &contexts,
        &molt_bench::cost_sweep::SweepOptions {
            lengths: vec![32, 64],
            reps: 2,
            head: 4,
            recompute: Some(molt::transplant::select::TokenRecompute::default_size()),
            tails: vec![8, 48],
            heads: vec![0],
            routes: vec![],
        },
        &mut |_| {},
    )
    .unwrap();
    // A tail that does not fit beside the head is skipped at that length, measured where it
    // fits; the other head re-read (0: the projection alone) follows the tails, and on a size
    // route the same head without the token recompute. The measured switch re-reads the head,
    // the anchor-less tiny projectors decoding all of it, and on a size route (only there)
    // recomputes tokens, inside its cost.
    assert!(points.iter().any(|p| p.kind == RouteKind::Size));
    for p in &points {
        assert_eq!((p.head, p.head_anchored), (4, 0), "{p:?}");
        let size = p.kind == RouteKind::Size;
        assert_eq!(p.recomputed > 0, size, "{p:?}");
        assert!(
            (p.recompute_ms > 0.0) == size && p.recompute_ms < p.transplant_ms.max,
            "{p:?}"
        );
        let rereads: Vec<(usize, usize)> = p.tails.iter().map(|t| (t.head, t.tail)).collect();
        let mut want = if p.context_tokens >= 52 {
            vec![(4, 8), (4, 48), (0, 0)]
        } else {
            vec![(4, 8), (0, 0)]
        };
        if size {
            want.push((4, 0));
        }
        assert_eq!(rereads, want);
        for t in &p.tails {
            assert!(
                t.cost_ms.median > 0.0 && t.jsd.is_finite() && t.jsd_mean >= 0.0,
                "{t:?}"
            );
        }
    }
    // A route filter measures only the routes it names.
    let (a, b) = (l.rungs[1].name().to_string(), l.rungs[0].name().to_string());
    let only = molt_bench::cost_sweep::run(
        l,
        common::cfg_conditions(),
        &mut routes,
        &molt_bench::cost_sweep::raw_contexts(&tokens, 32 + 1 + molt_bench::cost_sweep::SEAM, 1),
        &molt_bench::cost_sweep::SweepOptions {
            lengths: vec![32],
            reps: 1,
            head: 0,
            recompute: None,
            tails: vec![],
            heads: vec![],
            routes: vec![(a.clone(), b.clone())],
        },
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(
        only.iter().map(|p| p.route.as_str()).collect::<Vec<_>>(),
        [format!("{a}→{b}")]
    );
    std::fs::write(
        out.join("cost_sweep.json"),
        serde_json::to_string(&serde_json::json!({ "reps": 2, "points": points })).unwrap(),
    )
    .unwrap();
    let set = figures::draw_all(&out, &out.join("figures")).unwrap();
    let names: Vec<_> = set.written.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "hero",
            "conditions",
            "seams",
            "cost_sweep",
            "projector_residuals"
        ],
        "skipped: {:?}",
        set.skipped
    );
    for f in &set.written {
        let bytes = std::fs::read(&f.path).unwrap();
        assert!(bytes.starts_with(b"\x89PNG"), "{} is a PNG", f.name);
    }
    page::write(
        &page::PageOptions {
            results: out.clone(),
            figures_rel_results: "figures".into(),
            figures_rel_root: "results/figures".into(),
        },
        &set,
    )
    .unwrap();
    let readme = std::fs::read_to_string(out.join("README.md")).unwrap();
    assert!(readme.contains("The trade-off, stated plainly"));
    assert!(readme.contains("What this does not show"));
    assert!(readme.contains("figures/hero.png"));
    assert!(readme.contains("What a switch costs, by context length"));
    assert!(readme.contains("How well the maps fit"));
    let snippet = std::fs::read_to_string(out.join("figures.md")).unwrap();
    assert!(snippet.contains("results/figures/hero.png"));
}
