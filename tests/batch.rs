//! Several sequences in one context (tiny models, real llama.cpp execution): an answer decoded
//! in a batch with others — joining mid-way with a chunked prefill — is the answer it gets
//! alone, and one sequence's cache moves to another context on its own.

mod common;

use std::sync::Arc;

use molt::engine::{
    BatchContext, Context, ContextConfig, Model, ModelOptions, SeqChunk, Token, argmax,
};

const ANSWER: usize = 16;
/// Prefill tokens a newcomer adds to one step.
const CHUNK: usize = 8;

fn config() -> ContextConfig {
    ContextConfig {
        n_ctx: 512,
        n_batch: 64,
        n_threads: 1,
        ..ContextConfig::default()
    }
}

fn model() -> Arc<Model> {
    let l = common::tiny_ladder();
    let r = &l.rungs[0];
    Model::load(&r.path, r.name(), ModelOptions::default()).expect("tiny model loads")
}

fn prompts(m: &Model) -> Vec<Vec<Token>> {
    [
        "the quick brown fox jumps over the lazy dog and then",
        "once upon a time",
        "a model that switches rungs between tokens keeps its cache and the answer goes on with",
    ]
    .iter()
    .map(|t| m.tokenize(t, false).expect("tokenize"))
    .collect()
}

/// Greedy answer of `prompt` on a single-sequence context (how one answer is decoded today).
fn alone(m: &Arc<Model>, prompt: &[Token]) -> Vec<Token> {
    let mut ctx = Context::new(Arc::clone(m), config()).expect("context");
    ctx.decode(prompt).expect("prefill");
    let mut out = Vec::new();
    for _ in 0..ANSWER {
        let t = argmax(ctx.logits());
        out.push(t);
        ctx.decode(&[t]).expect("decode");
    }
    out
}

/// One tenant of the batched loop below.
struct Tenant {
    seq: u32,
    prompt: Vec<Token>,
    /// Prompt tokens decoded so far.
    read: usize,
    /// Sampled, not decoded yet.
    pending: Option<Token>,
    out: Vec<Token>,
}

/// Runs the tenants to `ANSWER` tokens each; tenant `k` joins at step `joins[k]`. Each step
/// carries every running tenant's pending token plus one prefill chunk of at most one
/// newcomer. Returns the answers and how many steps decoded several sequences at once.
fn batched(
    ctx: &mut BatchContext,
    prompts: &[Vec<Token>],
    joins: &[usize],
) -> (Vec<Vec<Token>>, usize) {
    let mut tenants: Vec<Option<Tenant>> = prompts.iter().map(|_| None).collect();
    let mut shared_steps = 0;
    for step in 0.. {
        for (k, &at) in joins.iter().enumerate() {
            if at == step && tenants[k].is_none() {
                let seq = ctx.add_seq().expect("free sequence");
                tenants[k] = Some(Tenant {
                    seq,
                    prompt: prompts[k].clone(),
                    read: 0,
                    pending: None,
                    out: Vec::new(),
                });
            }
        }
        let live: Vec<&Tenant> = tenants
            .iter()
            .flatten()
            .filter(|t| t.out.len() < ANSWER)
            .collect();
        if live.is_empty() && step > *joins.iter().max().unwrap_or(&0) {
            break;
        }
        let pending: Vec<[Token; 1]> = live.iter().filter_map(|t| t.pending.map(|p| [p])).collect();
        let mut chunks = Vec::new();
        let mut pi = 0;
        let mut prefilling = false;
        for t in &live {
            if t.pending.is_some() {
                chunks.push(SeqChunk {
                    seq: t.seq,
                    tokens: &pending[pi],
                    logits: true,
                });
                pi += 1;
            } else if !prefilling {
                prefilling = true;
                let end = (t.read + CHUNK).min(t.prompt.len());
                chunks.push(SeqChunk {
                    seq: t.seq,
                    tokens: &t.prompt[t.read..end],
                    logits: end == t.prompt.len(),
                });
            }
        }
        if chunks.len() > 1 {
            shared_steps += 1;
        }
        let decoded: Vec<(u32, usize)> = chunks.iter().map(|c| (c.seq, c.tokens.len())).collect();
        ctx.step(&chunks).expect("step");
        for t in tenants.iter_mut().flatten() {
            let Some(&(_, n)) = decoded.iter().find(|(s, _)| *s == t.seq) else {
                continue;
            };
            if t.pending.is_none() {
                t.read += n;
                if t.read < t.prompt.len() {
                    continue;
                }
            }
            let next = argmax(ctx.logits(t.seq).expect("logits asked for"));
            t.out.push(next);
            t.pending = (t.out.len() < ANSWER).then_some(next);
        }
    }
    let answers = tenants
        .into_iter()
        .map(|t| t.expect("joined").out)
        .collect();
    (answers, shared_steps)
}

#[test]
fn a_sequence_decoded_in_a_batch_of_three_answers_as_alone() {
    let m = model();
    let ps = prompts(&m);
    let want: Vec<Vec<Token>> = ps.iter().map(|p| alone(&m, p)).collect();
    let mut ctx = BatchContext::new(Arc::clone(&m), config(), 3).expect("batch context");
    // The second and third join while the first is answering: their prompts are read in
    // chunks beside its tokens.
    let (got, shared) = batched(&mut ctx, &ps, &[0, 3, 5]);
    assert!(
        shared >= ANSWER,
        "only {shared} steps decoded several sequences"
    );
    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            g, w,
            "tenant {k}: batched answer differs from its answer alone"
        );
    }
}

#[test]
fn finished_sequences_free_their_cells_and_the_others_go_on() {
    let m = model();
    let ps = prompts(&m);
    let mut ctx = BatchContext::new(Arc::clone(&m), config(), 2).expect("batch context");
    let a = ctx.add_seq().expect("a");
    let b = ctx.add_seq().expect("b");
    assert!(ctx.add_seq().is_none(), "only two sequences fit");
    ctx.step(&[
        SeqChunk {
            seq: a,
            tokens: &ps[0],
            logits: true,
        },
        SeqChunk {
            seq: b,
            tokens: &ps[1],
            logits: true,
        },
    ])
    .expect("both prompts in one step");
    assert_eq!(ctx.cells_used(), ps[0].len() + ps[1].len());
    let b_next = argmax(ctx.logits(b).expect("b's logits"));
    ctx.remove_seq(a);
    assert_eq!(ctx.cells_used(), ps[1].len());
    assert!(ctx.logits(a).is_none());
    // b continues exactly as alone, and a's id is free again.
    let mut out = vec![b_next];
    for _ in 1..ANSWER {
        let t = [*out.last().expect("token")];
        ctx.step(&[SeqChunk {
            seq: b,
            tokens: &t,
            logits: true,
        }])
        .expect("step");
        out.push(argmax(ctx.logits(b).expect("logits")));
    }
    assert_eq!(out, alone(&m, &ps[1]));
    assert_eq!(ctx.add_seq(), Some(a));
    // A sequence named twice, or one not in use, is refused before anything is decoded.
    let one = [out[0]];
    assert!(
        ctx.step(&[
            SeqChunk {
                seq: b,
                tokens: &one,
                logits: false
            },
            SeqChunk {
                seq: b,
                tokens: &one,
                logits: false
            },
        ])
        .is_err()
    );
    assert!(
        ctx.step(&[SeqChunk {
            seq: 7,
            tokens: &one,
            logits: false
        }])
        .is_err()
    );
    assert_eq!(ctx.n_past(b), Some(ps[1].len() + ANSWER - 1));
}

#[test]
fn one_sequence_moves_to_another_context_alone() {
    let m = model();
    let ps = prompts(&m);
    let want = alone(&m, &ps[2]);
    let mut src = BatchContext::new(Arc::clone(&m), config(), 3).expect("source");
    let other = src.add_seq().expect("other");
    let s = src.add_seq().expect("moving");
    src.step(&[
        SeqChunk {
            seq: other,
            tokens: &ps[0],
            logits: false,
        },
        SeqChunk {
            seq: s,
            tokens: &ps[2],
            logits: true,
        },
    ])
    .expect("prefill");
    let mut out = vec![argmax(src.logits(s).expect("logits"))];
    for _ in 0..5 {
        let t = [*out.last().expect("token")];
        src.step(&[SeqChunk {
            seq: s,
            tokens: &t,
            logits: true,
        }])
        .expect("step");
        out.push(argmax(src.logits(s).expect("logits")));
    }
    // The blob holds this sequence alone: the other one's cells stay behind.
    let blob = src.export_seq(s).expect("export");
    let n_past = src.n_past(s).expect("in use");
    src.remove_seq(s);
    assert_eq!(src.n_past(other), Some(ps[0].len()));
    let mut dst = BatchContext::new(Arc::clone(&m), config(), 3).expect("destination");
    let busy = dst.add_seq().expect("busy");
    dst.step(&[SeqChunk {
        seq: busy,
        tokens: &ps[1],
        logits: false,
    }])
    .expect("busy prefill");
    dst.import_seq(2, &blob).expect("import into sequence 2");
    assert_eq!(dst.n_past(2), Some(n_past));
    assert_eq!(dst.cells_used(), ps[1].len() + n_past);
    while out.len() < ANSWER {
        let t = [*out.last().expect("token")];
        dst.step(&[SeqChunk {
            seq: 2,
            tokens: &t,
            logits: true,
        }])
        .expect("step");
        out.push(argmax(dst.logits(2).expect("logits")));
    }
    assert_eq!(out, want, "the moved sequence answers as one never moved");
    // A blob that is not a state is refused, and the sequence is left empty.
    assert!(dst.import_seq(2, b"not a state").is_err());
    assert_eq!(dst.n_past(2), Some(0));
}

#[test]
fn a_shared_prefix_answers_as_one_read_in_full() {
    let m = model();
    let ps = prompts(&m);
    // Two prompts that begin alike: the second takes the first's cells for the common part.
    let head = &ps[2][..12];
    let mut second = head.to_vec();
    second.extend_from_slice(&ps[1]);
    let want = alone(&m, &second);
    let mut ctx = BatchContext::new(Arc::clone(&m), config(), 2).expect("batch context");
    let a = ctx.add_seq().expect("a");
    let b = ctx.add_seq().expect("b");
    ctx.step(&[SeqChunk {
        seq: a,
        tokens: &ps[2],
        logits: false,
    }])
    .expect("first prompt");
    assert!(ctx.share_prefix(a, a, 4).is_err(), "not into itself");
    assert!(
        ctx.share_prefix(a, b, ps[2].len() + 1).is_err(),
        "not past what a holds"
    );
    ctx.share_prefix(a, b, head.len()).expect("share");
    assert_eq!(ctx.n_past(b), Some(head.len()));
    ctx.step(&[SeqChunk {
        seq: b,
        tokens: &second[head.len()..],
        logits: true,
    }])
    .expect("rest");
    // The donor leaves: the shared cells stay for b.
    ctx.remove_seq(a);
    let mut out = vec![argmax(ctx.logits(b).expect("logits"))];
    while out.len() < ANSWER {
        let t = [*out.last().expect("token")];
        ctx.step(&[SeqChunk {
            seq: b,
            tokens: &t,
            logits: true,
        }])
        .expect("step");
        out.push(argmax(ctx.logits(b).expect("logits")));
    }
    assert_eq!(out, want, "sharing the head changes nothing");
}

/// The batched loop's refill: a sequence whose cells hold other text at its history's
/// positions (a stand-in for projected cells) re-reads them in place, a span per step in the
/// `llama_decode` of its own next token and another sequence's; once every position before
/// the newest is re-read, it answers exactly as a native cache of its text does — and the
/// other sequence, decoded beside it all along, answers as alone.
#[test]
fn a_sequence_rereads_its_cells_in_place_in_the_steps_of_the_batch() {
    let m = model();
    let ps = prompts(&m);
    let (history, other) = (&ps[2], &ps[1]);
    let mut ctx = BatchContext::new(Arc::clone(&m), config(), 3).expect("batch context");
    let (a, b) = (ctx.add_seq().unwrap(), ctx.add_seq().unwrap());
    let wrong: Vec<Token> = history.iter().rev().copied().collect();
    ctx.step(&[
        SeqChunk {
            seq: a,
            tokens: &wrong,
            logits: false,
        },
        SeqChunk {
            seq: b,
            tokens: other,
            logits: true,
        },
    ])
    .expect("prefill");
    // The cache of `a` holds `wrong` at the history's positions; its answer starts from the
    // history's last token, decoded with the first span.
    let (mut fed_a, mut out_a, mut out_b) = (history.clone(), Vec::new(), Vec::new());
    let mut pending_a = *history.last().unwrap();
    ctx.truncate(a, history.len() - 1).unwrap();
    fed_a.pop();
    let mut next = 0;
    let mut done_at = None;
    let mut pending_b = argmax(ctx.logits(b).unwrap());
    for step in 0..ANSWER {
        out_b.push(pending_b);
        let held = ctx.n_past(a).unwrap();
        let span = (next < held).then(|| molt::engine::SeqSpan {
            seq: a,
            start: next,
            tokens: &fed_a[next..(next + 6).min(held)],
        });
        let end = span.map(|s| s.start + s.tokens.len());
        let chunks = [
            SeqChunk {
                seq: a,
                tokens: &[pending_a],
                logits: true,
            },
            SeqChunk {
                seq: b,
                tokens: &[pending_b],
                logits: true,
            },
        ];
        // The last span in a step of its own before the tokens (as the server reads it).
        if end.is_some_and(|e| e >= held) {
            ctx.step_rereading(&[], span).expect("the last span");
            ctx.step(&chunks).expect("the step after it");
        } else {
            ctx.step_rereading(&chunks, span).expect("step with a span");
        }
        assert_eq!(ctx.n_past(a), Some(held + 1), "the span adds no position");
        assert_eq!(ctx.active(), 2, "the scratch sequence is freed");
        if let Some(e) = end {
            next = e;
            if e >= held && done_at.is_none() {
                done_at = Some(step);
            }
        }
        fed_a.push(pending_a);
        pending_a = argmax(ctx.logits(a).unwrap());
        out_a.push(pending_a);
        pending_b = argmax(ctx.logits(b).unwrap());
    }
    let k = done_at.expect("re-read every position within the answer");
    assert!(k + 2 < ANSWER, "done at step {k}");
    // From the step of the last span on, `a` is a native cache of its text: the token
    // sampled after it is the native cache's.
    let mut native = Context::new(Arc::clone(&m), config()).unwrap();
    native.decode(&fed_a[..history.len() + k]).unwrap();
    let mut again: Vec<Token> = out_a[..k].to_vec();
    while again.len() < out_a.len() {
        let t = argmax(native.logits());
        again.push(t);
        if again.len() < out_a.len() {
            native.decode(&[t]).unwrap();
        }
    }
    assert_eq!(again, out_a, "after the re-read, the native cache's answer");
    assert_eq!(out_b, alone(&m, other), "the other sequence as alone");
}
