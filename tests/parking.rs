//! Parking on real llama.cpp execution: park, then resume, and the next token's logits are
//! bit-identical to a rung that never parked; while parked the weights' mapping is gone and
//! the process's RSS has fallen by at least the weights' resident size.
//!
//! One test in its own binary on purpose: RSS is a whole-process number, and other tests
//! running in parallel threads would allocate and free memory under it.

mod common;

use molt::engine::{Context, Model, ModelOptions};
use molt::ladder::RungInfo;
use molt::pressure::{process_rss_bytes, resident_bytes_of_mapping};
use molt::session::LiveRung;

const TEXT: &str = "The scheduler parks the weights of a background job while keeping its cache, then maps them back when memory returns. fn main() { let v: Vec<u32> = (0..10).map(|x| x * x).collect(); }";

/// Parks and resumes `info` (whose file nothing else in the process maps); returns
/// (weights resident before, RSS fall).
fn round_trip(info: &RungInfo, reference_path: &std::path::Path, n_ctx: u32) -> (u64, u64) {
    let toks = {
        let m = Model::load(reference_path, "reference", ModelOptions::default()).unwrap();
        m.tokenize(TEXT, false).unwrap()
    };
    let (prefix, next) = (&toks[..toks.len() - 1], toks[toks.len() - 1]);
    let expected = {
        let m = Model::load(reference_path, "reference", ModelOptions::default()).unwrap();
        let mut c = Context::new(m, common::context(n_ctx, 128)).unwrap();
        c.decode(prefix).unwrap();
        c.decode(&[next]).unwrap();
        c.logits().to_vec()
    };

    let mut live = LiveRung::load(info, common::context(n_ctx, 128)).unwrap();
    live.ctx.decode(prefix).unwrap();
    let resident = live.weights_resident();
    assert!(resident > 0, "a decoded rung has resident weight pages");
    let rss_live = process_rss_bytes().unwrap();
    let parked = live.park().unwrap();
    let rss_parked = process_rss_bytes().unwrap();
    assert_eq!(
        resident_bytes_of_mapping(&info.path).unwrap(),
        0,
        "{}: parked, yet the weights are still mapped",
        info.name()
    );
    let fall = rss_live.saturating_sub(rss_parked);
    assert!(
        fall * 100 >= resident * 95,
        "{}: RSS fell by {fall} B, the weights had {resident} B resident",
        info.name()
    );
    assert_eq!(parked.n_past, prefix.len());
    assert_eq!(parked.kv_bytes(), parked.blob.len() as u64);
    let mut back = parked.resume().unwrap();
    assert_eq!(back.ctx.n_past(), prefix.len());
    back.ctx.decode(&[next]).unwrap();
    let d = expected
        .iter()
        .zip(back.ctx.logits())
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert_eq!(d, 0.0, "{}: resumed logits differ by {d}", info.name());
    (resident, fall)
}

#[test]
fn parking_round_trip_is_bit_exact_and_gives_the_weights_back() {
    let l = common::tiny_ladder();
    // A private copy, so that the only mapping of this file is the rung under test.
    let dir = tempfile::tempdir().unwrap();
    let mut info = l.rungs[0].clone();
    info.path = dir.path().join("tiny-big-private.gguf");
    std::fs::copy(&l.rungs[0].path, &info.path).unwrap();
    let (resident, fall) = round_trip(&info, &l.rungs[0].path, 512);
    eprintln!("tiny big: weights resident {resident} B, RSS fell {fall} B when parked");

    // The real ladder's smallest rung (CI): the same checks at the size that matters.
    if let Some(real) = common::real_ladder() {
        let info = real.rungs.last().unwrap();
        // The reference model is loaded and dropped before the rung under test maps the file.
        let (resident, fall) = round_trip(info, &info.path, 2048);
        eprintln!(
            "{}: weights resident {:.1} MiB, RSS fell {:.1} MiB when parked",
            info.name(),
            resident as f64 / 1048576.0,
            fall as f64 / 1048576.0
        );
    }
}
