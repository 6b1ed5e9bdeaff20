//! The speed policy on the tiny ladder ([`molt::speed`]): a rung's micro-batch and repack come
//! from the measured rows and what the budget leaves above the rung's default footprint, the
//! setup's extra memory is part of the footprint the policy compares with the budget, rows of
//! another file are refused, and without a measurement nothing changes.

mod common;

use std::sync::Arc;

use molt::session::{Session, SessionOptions};
use molt::speed::{Measured, SetupSource, SpeedFile, SpeedFileError, SpeedPolicy};
use molt_bench::speed::{PeerRow, Setting};

const MIB: u64 = 1 << 20;
/// What the made-up measurement says repack costs on `big`: far more than the tiny model's
/// real repack, so the accounting cannot pass by what the load itself measured.
const REPACK_EXTRA_MIB: f64 = 300.0;

fn row(rung: &str, repack: bool, prefill: f64, load_anon_mib: f64) -> PeerRow {
    common::speed_row(rung, repack, prefill, load_anon_mib)
}

/// A measurement of `big` saying repack doubles its prefill for `REPACK_EXTRA_MIB`, written
/// and found the way `bench --speed --tune` and the CLI do.
fn measured(dir: &std::path::Path) -> Measured {
    let l = common::tiny_ladder();
    let rows = vec![
        row("big", false, 100.0, 1.0),
        row("big", true, 200.0, 1.0 + REPACK_EXTRA_MIB),
    ];
    SpeedFile::of(l, 2, &rows).save(dir).unwrap();
    let (m, refused) = Measured::find(&[dir.to_path_buf()], l);
    assert!(refused.is_empty(), "{refused:?}");
    m.expect("the file is found")
}

fn session(policy: SpeedPolicy) -> Session {
    let l = common::tiny_ladder();
    let opts = SessionOptions {
        standby: false,
        prepare_up: false,
        projector_dirs: vec![common::tiny_projectors().clone()],
        speed: policy,
        ..SessionOptions::default()
    };
    Session::with_options(l.clone(), common::cfg(), l.rungs[0].name(), opts).unwrap()
}

fn repack_of(s: &mut Session) -> bool {
    let i = s.current_index();
    s.rung_mut(i).unwrap().model().repack()
}

#[test]
fn a_tight_budget_keeps_repack_off_and_a_roomy_one_turns_it_on_and_counts_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = session(SpeedPolicy {
        measured: Some(Arc::new(measured(dir.path()))),
        forced_ubatch: None,
        forced_repack: None,
    });
    let n_ctx = u64::from(s.config().n_ctx);
    // Loaded before any budget was read: the default.
    let start = s.rung_setup(0).unwrap();
    assert_eq!(start.source, SetupSource::Default);
    assert!(!repack_of(&mut s));
    let default_footprint = s.modelled_footprint(0, n_ctx);

    // 100 MiB to spare: repack's 300 MiB does not fit.
    assert_eq!(s.retune_with(default_footprint + 100 * MIB).unwrap(), None);
    let tight = s.rung_setup(0).unwrap();
    assert_eq!(tight.source, SetupSource::Measured);
    assert_eq!(tight.setting, Setting::molt_default());
    assert!(!repack_of(&mut s), "a tight budget keeps repack off");

    // 400 MiB to spare: the rung is loaded again with repack, and its cost says so.
    let roomy = s
        .retune_with(default_footprint + 400 * MIB)
        .unwrap()
        .expect("the rung is loaded again");
    assert!(roomy.setting.repack, "{roomy}");
    assert_eq!(roomy.source, SetupSource::Measured);
    assert!(repack_of(&mut s), "the model was loaded with repack");
    assert_eq!(s.rung_setup(0), Some(roomy));
    let with_repack = s.modelled_footprint(0, n_ctx);
    assert!(
        with_repack >= default_footprint + 300 * MIB,
        "the policy's footprint must hold repack's memory: {} MiB, default {} MiB",
        with_repack >> 20,
        default_footprint >> 20
    );
    assert!(roomy.to_string().contains("repack on (measured"), "{roomy}");

    // The budget tightens: an idle rung goes back to the default, and so does its cost.
    let back = s
        .retune_with(default_footprint + 50 * MIB)
        .unwrap()
        .expect("loaded again without repack");
    assert!(!back.setting.repack);
    assert!(!repack_of(&mut s));
    assert!(s.modelled_footprint(0, n_ctx) < default_footprint + 300 * MIB);
}

#[test]
fn without_a_measurement_the_default_stays_and_an_explicit_micro_batch_wins() {
    let mut s = session(SpeedPolicy::default());
    assert_eq!(s.retune_with(u64::MAX / 4).unwrap(), None);
    let setup = s.rung_setup(0).unwrap();
    assert_eq!(setup.source, SetupSource::Default);
    assert_eq!(setup.setting, Setting::molt_default());
    assert!(!repack_of(&mut s));

    let dir = tempfile::tempdir().unwrap();
    let mut s = session(SpeedPolicy {
        measured: Some(Arc::new(measured(dir.path()))),
        forced_ubatch: Some(64),
        forced_repack: None,
    });
    assert_eq!(s.retune_with(u64::MAX / 4).unwrap(), None);
    let setup = s.rung_setup(0).unwrap();
    assert_eq!(setup.source, SetupSource::Forced);
    assert_eq!(setup.setting.n_ubatch, 64);
    assert!(
        !setup.setting.repack,
        "a forced micro-batch leaves repack at its default"
    );
    assert_eq!(s.rung_mut(0).unwrap().ctx.config().n_ubatch, 64);
}

#[test]
fn rows_measured_on_another_file_are_refused_with_the_rung_named() {
    let l = common::tiny_ladder();
    let dir = tempfile::tempdir().unwrap();
    let mut file = SpeedFile::of(
        l,
        2,
        &[
            row("big", false, 100.0, 1.0),
            row("big", true, 200.0, 301.0),
        ],
    );
    file.rungs[0].sha256 = "00".repeat(32);
    file.save(dir.path()).unwrap();
    let (m, refused) = Measured::find(&[dir.path().to_path_buf()], l);
    assert!(m.is_none(), "nothing usable is left");
    assert_eq!(refused.len(), 1);
    assert!(matches!(&refused[0], SpeedFileError::Stale { rung, .. } if rung == "big"));
    assert!(refused[0].to_string().contains("measured on another file"));

    // A file that is not one is reported, not used.
    std::fs::write(SpeedFile::path(dir.path(), l.name()), b"{").unwrap();
    let (m, refused) = Measured::find(&[dir.path().to_path_buf()], l);
    assert!(m.is_none());
    assert!(matches!(refused[..], [SpeedFileError::Parse { .. }]));
}

#[test]
fn rows_measured_on_another_processor_are_refused_and_say_how_to_measure_this_one() {
    let l = common::tiny_ladder();
    let dir = tempfile::tempdir().unwrap();
    let rows = [
        row("big", false, 100.0, 1.0),
        row("big", true, 200.0, 301.0),
    ];
    let mut file = SpeedFile::of(l, 2, &rows);
    assert_eq!(file.cpu.as_deref(), Some(molt::speed::this_cpu().as_str()));
    file.cpu = Some("Some Other CPU @ 1.0GHz × 64".into());
    file.save(dir.path()).unwrap();
    let (m, refused) = Measured::find(&[dir.path().to_path_buf()], l);
    assert!(m.is_none(), "another machine's speeds are not this one's");
    assert!(matches!(refused[..], [SpeedFileError::OtherCpu { .. }]));
    let msg = refused[0].to_string();
    assert!(
        msg.contains("Some Other CPU") && msg.contains("bench --speed --tune"),
        "{msg}"
    );

    // Measured here: used.
    SpeedFile::of(l, 2, &rows).save(dir.path()).unwrap();
    let (m, refused) = Measured::find(&[dir.path().to_path_buf()], l);
    assert!(m.is_some() && refused.is_empty());
}
