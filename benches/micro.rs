//! Micro-benchmarks of the hot paths of a migration and of the scheduler (criterion; run with
//! `cargo bench --bench micro`, or `-- --quick` for a short pass). Inputs are synthetic but
//! shaped like the shipped ladder: tier0's cache is 28 layers × 256-wide K and V rows (2 KV
//! heads × 128), tier2's 24 layers × 128 (2 × 64).
//!
//! - `kv_blob/*`: parse and serialize llama.cpp's sequence-state blob (the KV mirror).
//! - `layer_map/*`: one layer's projection of K for every cell: dense (size route) and
//!   diagonal (precision route).
//! - `rope/*`: un-rotating one layer's keys (the sandwich's first half).
//! - `sched/plan`: one scheduler round over three tenants and three rungs.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use molt::kv::{CacheType, Cell, KvSnapshot, KvStream, LayerKv, ParseOptions};
use molt::sched::{Policy, RungCost, Snapshot, TenantClass, TenantView, plan};
use molt::transplant::map::LayerMap;
use molt::transplant::ridge::Affine;
use molt::transplant::rope::{Direction, RopeSpec, rotate};
use ndarray::{Array1, Array2};
use std::hint::black_box;

/// Deterministic pseudo-random values in [-1, 1) (no RNG crate needed for benchmark inputs).
fn filled(rows: usize, cols: usize, seed: u64) -> Array2<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    Array2::from_shape_fn((rows, cols), |_| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        #[allow(clippy::cast_precision_loss)]
        let u = (s >> 40) as f32 / (1u64 << 24) as f32;
        u * 2.0 - 1.0
    })
}

fn snapshot(n_layer: usize, width: usize, cells: usize) -> KvSnapshot {
    let stream = KvStream {
        cells: (0..cells)
            .map(|p| Cell {
                pos: i32::try_from(p).unwrap(),
                seq_ids: vec![0],
                ext: None,
            })
            .collect(),
        v_trans: true,
        n_rot_k: 0,
        n_rot_v: 0,
        has_v: true,
        layers: (0..n_layer)
            .map(|l| LayerKv {
                k: filled(cells, width, l as u64),
                v: filled(cells, width, 1000 + l as u64),
                k_type: CacheType::F16,
                v_type: CacheType::F16,
            })
            .collect(),
    };
    KvSnapshot::from_single_stream(0, stream)
}

fn kv_blob(c: &mut Criterion) {
    let mut g = c.benchmark_group("kv_blob");
    for cells in [128usize, 512] {
        let snap = snapshot(28, 256, cells);
        let bytes = snap.to_bytes().unwrap();
        g.throughput(Throughput::Bytes(bytes.len() as u64));
        g.bench_with_input(
            BenchmarkId::new("parse_tier0", cells),
            &bytes,
            |b, bytes| {
                b.iter(|| KvSnapshot::parse(black_box(bytes), ParseOptions::default()).unwrap());
            },
        );
        g.bench_with_input(BenchmarkId::new("serialize_tier0", cells), &snap, |b, s| {
            b.iter(|| black_box(s).to_bytes().unwrap());
        });
    }
    g.finish();
}

fn layer_map(c: &mut Criterion) {
    let mut g = c.benchmark_group("layer_map");
    let dense = LayerMap::Affine(Affine {
        w: filled(256, 128, 7) * 0.05,
        b: Array1::zeros(128),
    });
    let diagonal = LayerMap::Diagonal {
        scale: Array1::from_elem(256, 1.01),
        offset: Array1::zeros(256),
    };
    for cells in [128usize, 512] {
        let x = filled(cells, 256, 3);
        g.throughput(Throughput::Elements(cells as u64));
        g.bench_with_input(BenchmarkId::new("dense_256_to_128", cells), &x, |b, x| {
            b.iter(|| dense.apply(black_box(x.view())).unwrap());
        });
        g.bench_with_input(BenchmarkId::new("diagonal_256", cells), &x, |b, x| {
            b.iter(|| diagonal.apply(black_box(x.view())).unwrap());
        });
    }
    g.finish();
}

fn rope(c: &mut Criterion) {
    let mut g = c.benchmark_group("rope");
    let spec = RopeSpec::neox(128, 1e6);
    for cells in [128usize, 512] {
        let k = filled(cells, 256, 11);
        let pos: Vec<i32> = (0..i32::try_from(cells).unwrap()).collect();
        g.throughput(Throughput::Elements(cells as u64));
        g.bench_with_input(
            BenchmarkId::new("unrotate_tier0_layer", cells),
            &k,
            |b, k| {
                b.iter_batched(
                    || k.clone(),
                    |mut k| rotate(k.view_mut(), &pos, &spec, Direction::Unrotate).unwrap(),
                    criterion::BatchSize::LargeInput,
                );
            },
        );
    }
    g.finish();
}

fn sched(c: &mut Criterion) {
    let mib = 1u64 << 20;
    let rungs = vec![
        RungCost::new("tier0", 1066 * mib, 28 << 10, 180 * mib),
        RungCost::new("tier1", 718 * mib, 28 << 10, 180 * mib),
        RungCost::new("tier2", 469 * mib, 12 << 10, 90 * mib),
    ];
    let tenants = vec![
        TenantView::new(0, TenantClass::Foreground).with_context(900, 40),
        TenantView::new(1, TenantClass::Background)
            .with_rung(1)
            .with_context(2000, 40),
        TenantView::new(2, TenantClass::Background)
            .with_rung(2)
            .with_context(3000, 40),
    ];
    let policy = Policy::default();
    let mut g = c.benchmark_group("sched");
    for budget_mib in [4000u64, 1600] {
        let snap = Snapshot::new(budget_mib * mib, rungs.clone(), tenants.clone());
        g.bench_with_input(
            BenchmarkId::new("plan_3_tenants", budget_mib),
            &snap,
            |b, s| {
                b.iter(|| plan(black_box(s), &policy).unwrap());
            },
        );
    }
    g.finish();
}

criterion_group!(benches, kv_blob, layer_map, rope, sched);
criterion_main!(benches);
