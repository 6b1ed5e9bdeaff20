//! Blobs here are assembled field by field from the layout in llama.cpp's `state_write_*`, not
//! with the product writer, so a shared misunderstanding cannot make both sides agree.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell as StdCell;

use half::{bf16, f16};
use ndarray::{Array2, ShapeBuilder};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

// ---------------------------------------------------------------------------------------------
// Allocation watch: the largest single allocation made by the current thread, so tests can prove
// that a corrupt header never reserves memory for the count it claims.

struct Watch;

thread_local! {
    static LARGEST: StdCell<usize> = const { StdCell::new(0) };
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so `System`'s
// guarantees hold; the thread-local bookkeeping neither allocates nor touches the memory.
unsafe impl GlobalAlloc for Watch {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: forwarded verbatim; the caller upholds `alloc`'s contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: forwarded verbatim; the caller upholds `alloc_zeroed`'s contract.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` through this allocator with this `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: `ptr` came from `System` with `layout`; the caller upholds `realloc`'s contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static WATCH: Watch = Watch;

fn note(size: usize) {
    // `try_with`: the slot may already be gone while a thread is being torn down.
    let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
}

/// Runs `f` and returns its result and the largest single allocation it made on this thread.
fn largest_alloc<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.with(|l| l.set(0));
    let out = f();
    (out, LARGEST.with(StdCell::get))
}

// ---------------------------------------------------------------------------------------------
// Reference blob assembly.

#[derive(Default)]
struct Bytes(Vec<u8>);

impl Bytes {
    fn u32(&mut self, x: u32) -> &mut Self {
        self.0.extend_from_slice(&x.to_le_bytes());
        self
    }
    fn i32(&mut self, x: i32) -> &mut Self {
        self.0.extend_from_slice(&x.to_le_bytes());
        self
    }
    fn u64(&mut self, x: u64) -> &mut Self {
        self.0.extend_from_slice(&x.to_le_bytes());
        self
    }
    /// One element of ggml type `t`, given as raw bits.
    fn elem(&mut self, t: i32, bits: u32) -> &mut Self {
        match t {
            0 => self.u32(bits),
            _ => {
                self.0.extend_from_slice(&(bits as u16).to_le_bytes());
                self
            }
        }
    }
}

fn elem_size(t: i32) -> usize {
    if t == 0 { 4 } else { 2 }
}

/// Raw element bits `[cell][dim]` for one tensor.
type Raw = Vec<Vec<u32>>;

#[derive(Clone)]
struct LayerSpec {
    k_type: i32,
    n_k: usize,
    v_type: i32,
    n_v: usize,
}

#[derive(Clone)]
struct StreamSpec {
    cells: Vec<(i32, Vec<i32>, Option<[i32; 3]>)>,
    v_trans: bool,
    has_v: bool,
    n_rot: (u32, u32),
    layers: Vec<LayerSpec>,
}

/// Random element bits of type `t`, with NaNs made quiet: quiet NaNs survive the `f32` round
/// trip bit for bit, signalling ones are quietened (see `signalling_nan_is_quietened`).
fn random_bits(rng: &mut StdRng, t: i32) -> u32 {
    let b: u32 = rng.random();
    match t {
        0 => b,
        1 => {
            let h = b & 0xffff;
            if h & 0x7c00 == 0x7c00 && h & 0x03ff != 0 {
                h | 0x0200
            } else {
                h
            }
        }
        _ => {
            let h = b & 0xffff;
            if h & 0x7f80 == 0x7f80 && h & 0x007f != 0 {
                h | 0x0040
            } else {
                h
            }
        }
    }
}

fn decode_bits(t: i32, b: u32) -> f32 {
    match t {
        0 => f32::from_bits(b),
        1 => f16::from_bits(b as u16).to_f32(),
        _ => bf16::from_bits(b as u16).to_f32(),
    }
}

/// Writes one stream (including its cell count) and returns the raw K and V bits per layer.
fn put_stream(b: &mut Bytes, s: &StreamSpec, rng: &mut StdRng) -> Vec<(Raw, Raw)> {
    let n = s.cells.len();
    b.u32(n as u32);
    if n == 0 {
        return Vec::new();
    }
    for (pos, seqs, ext) in &s.cells {
        b.i32(*pos).u32(seqs.len() as u32);
        if let Some(e) = ext {
            b.i32(e[0]).i32(e[1]).i32(e[2]);
        }
        for &id in seqs {
            b.i32(id);
        }
    }
    b.u32(u32::from(s.v_trans))
        .u32(s.layers.len() as u32)
        .u32(s.n_rot.0)
        .u32(s.n_rot.1);
    let raw = |rng: &mut StdRng, t, w| -> Raw {
        (0..n)
            .map(|_| (0..w).map(|_| random_bits(rng, t)).collect())
            .collect()
    };
    let mut out = Vec::new();
    for l in &s.layers {
        let k = raw(rng, l.k_type, l.n_k);
        b.i32(l.k_type).u64((l.n_k * elem_size(l.k_type)) as u64);
        for row in &k {
            for &x in row {
                b.elem(l.k_type, x);
            }
        }
        out.push((k, raw(rng, l.v_type, if s.has_v { l.n_v } else { 0 })));
    }
    if s.has_v {
        for (l, (_, v)) in s.layers.iter().zip(&out) {
            b.i32(l.v_type);
            if s.v_trans {
                b.u32(elem_size(l.v_type) as u32).u32(l.n_v as u32);
                for j in 0..l.n_v {
                    for row in v {
                        b.elem(l.v_type, row[j]);
                    }
                }
            } else {
                b.u64((l.n_v * elem_size(l.v_type)) as u64);
                for row in v {
                    for &x in row {
                        b.elem(l.v_type, x);
                    }
                }
            }
        }
    }
    out
}

/// A blob of sections of streams (`None` = empty stream), and the raw bits it holds.
fn build(seq_id: i32, sections: &[Vec<Option<StreamSpec>>], seed: u64) -> (Vec<u8>, Vec<Vec<u32>>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut b = Bytes::default();
    b.u32(IO_MAGIC).i32(seq_id);
    let mut raws = Vec::new();
    for sec in sections {
        b.u32(sec.len() as u32);
        for st in sec {
            match st {
                None => {
                    b.u32(0);
                }
                Some(s) => {
                    for (k, v) in put_stream(&mut b, s, &mut rng) {
                        raws.push(k.concat());
                        raws.push(v.concat());
                    }
                }
            }
        }
    }
    (b.0, raws)
}

fn layer(k_type: i32, n_k: usize, v_type: i32, n_v: usize) -> LayerSpec {
    LayerSpec {
        k_type,
        n_k,
        v_type,
        n_v,
    }
}

fn stream(n_cells: usize, v_trans: bool, layers: Vec<LayerSpec>) -> StreamSpec {
    StreamSpec {
        // Cache slots need not be in position order; make sure nothing assumes they are.
        cells: (0..n_cells)
            .map(|i| (((n_cells - i) % n_cells) as i32 + 3, vec![0], None))
            .collect(),
        v_trans,
        has_v: true,
        n_rot: (0, 0),
        layers,
    }
}

fn f16_stream(n_cells: usize, v_trans: bool) -> StreamSpec {
    stream(
        n_cells,
        v_trans,
        vec![layer(1, 4, 1, 3), layer(1, 4, 1, 3), layer(1, 8, 1, 5)],
    )
}

fn f32_stream(n_cells: usize, v_trans: bool) -> StreamSpec {
    stream(n_cells, v_trans, vec![layer(0, 2, 0, 6), layer(0, 3, 0, 2)])
}

fn ext_stream() -> StreamSpec {
    let mut s = f16_stream(3, true);
    s.cells = vec![
        (0, vec![2], Some([5, 6, 1000])),
        (1, vec![2], Some([7, 8, -1])),
        (2, vec![1, 2], Some([0, 0, 42])),
    ];
    s
}

fn mla_stream() -> StreamSpec {
    let mut s = stream(4, true, vec![layer(1, 6, 1, 0), layer(1, 6, 1, 0)]);
    s.has_v = false;
    s
}

const OPTS: ParseOptions = ParseOptions {
    has_cell_ext: false,
    has_v: true,
    sections: None,
};

/// Every blob shape the tests exercise, with the options that read it.
fn corpus() -> Vec<(&'static str, Vec<u8>, ParseOptions)> {
    let one = |s: StreamSpec| vec![vec![Some(s)]];
    let ext = ParseOptions {
        has_cell_ext: true,
        ..OPTS
    };
    let mla = ParseOptions {
        has_v: false,
        ..OPTS
    };
    let two = ParseOptions {
        sections: Some(2),
        ..OPTS
    };
    vec![
        (
            "f16 v_trans",
            build(0, &one(f16_stream(5, true)), 1).0,
            OPTS,
        ),
        (
            "f16 row-major V",
            build(0, &one(f16_stream(5, false)), 2).0,
            OPTS,
        ),
        (
            "f32 v_trans",
            build(3, &one(f32_stream(4, true)), 3).0,
            OPTS,
        ),
        (
            "f32 row-major V",
            build(-1, &one(f32_stream(4, false)), 4).0,
            OPTS,
        ),
        (
            "bf16 v_trans",
            build(0, &one(stream(3, true, vec![layer(30, 4, 30, 4)])), 5).0,
            OPTS,
        ),
        (
            "mixed K/V types",
            build(
                0,
                &one(stream(2, true, vec![layer(0, 4, 1, 4), layer(1, 2, 0, 2)])),
                6,
            )
            .0,
            OPTS,
        ),
        (
            "multi-stream with empty stream",
            build(
                1,
                &[vec![
                    Some(f16_stream(2, true)),
                    None,
                    Some(f16_stream(3, true)),
                ]],
                7,
            )
            .0,
            OPTS,
        ),
        (
            "two sections",
            build(
                0,
                &[
                    vec![Some(f16_stream(4, true))],
                    vec![Some(f32_stream(2, false))],
                ],
                8,
            )
            .0,
            two,
        ),
        (
            "all streams empty",
            build(0, &[vec![None, None]], 9).0,
            OPTS,
        ),
        ("cell ext", build(2, &one(ext_stream()), 10).0, ext),
        ("no V (MLA)", build(0, &one(mla_stream()), 11).0, mla),
        (
            "stream meta only",
            build(0, &one(stream(2, true, Vec::new())), 12).0,
            OPTS,
        ),
    ]
}

/// `KvStream` equality with values compared bit for bit, since random blobs hold NaNs.
fn assert_same(a: &KvStream, b: &KvStream) {
    let bits = |x: &Array2<f32>| (x.dim(), x.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
    assert_eq!(a.cells, b.cells);
    assert_eq!(
        (a.v_trans, a.n_rot_k, a.n_rot_v, a.has_v, a.n_layer()),
        (b.v_trans, b.n_rot_k, b.n_rot_v, b.has_v, b.n_layer())
    );
    for (la, lb) in a.layers.iter().zip(&b.layers) {
        assert_eq!((la.k_type, la.v_type), (lb.k_type, lb.v_type));
        assert_eq!(bits(&la.k), bits(&lb.k));
        assert_eq!(bits(&la.v), bits(&lb.v));
    }
}

// ---------------------------------------------------------------------------------------------
// 1. Round trips.

#[test]
fn round_trip_is_byte_identical() {
    for (name, blob, opts) in corpus() {
        let snap = KvSnapshot::parse(&blob, opts).unwrap_or_else(|e| panic!("{name}: {e}"));
        let again = snap.to_bytes().unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(again, blob, "{name}: re-serialization differs");
        assert_eq!(snap.encoded_len().unwrap(), blob.len(), "{name}");
    }
}

#[test]
fn decoded_values_match_the_raw_elements() {
    let specs = vec![
        vec![Some(f16_stream(5, true))],
        vec![None, Some(f32_stream(3, false))],
        vec![Some(stream(4, true, vec![layer(30, 3, 0, 5)]))],
    ];
    let (blob, raws) = build(0, &specs, 99);
    let snap = KvSnapshot::parse(&blob, OPTS).unwrap();
    let layer_specs: Vec<&LayerSpec> = specs
        .iter()
        .flatten()
        .flatten()
        .flat_map(|s| s.layers.iter())
        .collect();
    let layers: Vec<&LayerKv> = snap
        .sections
        .iter()
        .flat_map(|s| s.streams.iter().flatten())
        .flat_map(|s| s.layers.iter())
        .collect();
    assert_eq!(layers.len(), layer_specs.len());
    for (i, (l, spec)) in layers.iter().zip(&layer_specs).enumerate() {
        let k: Vec<u32> = l.k.iter().map(|x| x.to_bits()).collect();
        let want_k: Vec<u32> = raws[2 * i]
            .iter()
            .map(|&b| decode_bits(spec.k_type, b).to_bits())
            .collect();
        assert_eq!(k, want_k, "layer {i} K");
        let v: Vec<u32> = l.v.iter().map(|x| x.to_bits()).collect();
        let want_v: Vec<u32> = raws[2 * i + 1]
            .iter()
            .map(|&b| decode_bits(spec.v_type, b).to_bits())
            .collect();
        assert_eq!(v, want_v, "layer {i} V");
        assert_eq!(l.k_type.ggml_type(), spec.k_type);
        assert_eq!(l.v_type.ggml_type(), spec.v_type);
        assert_eq!((l.n_embd_k(), l.n_embd_v()), (spec.n_k, spec.n_v));
    }
}

// ---------------------------------------------------------------------------------------------
// 2. Hand-placed values.

const H_ONE: u16 = 0x3c00; // 1.0
const H_MINUS_TWO: u16 = 0xc000; // -2.0
const H_HALF: u16 = 0x3800; // 0.5
const H_65504: u16 = 0x7bff; // largest finite f16
const H_TINY: u16 = 0x0001; // smallest subnormal, 2^-24

/// 3 cells, 1 layer, F16; K is 2 wide, V 2 wide and transposed.
fn hand_blob(v_trans: bool) -> Vec<u8> {
    let mut b = Bytes::default();
    b.u32(IO_MAGIC).i32(7).u32(1).u32(3);
    for (pos, seq) in [(10, 7), (11, 7), (12, 7)] {
        b.i32(pos).u32(1).i32(seq);
    }
    b.u32(u32::from(v_trans)).u32(1).u32(0).u32(0);
    b.i32(1).u64(4);
    for h in [H_ONE, H_MINUS_TWO, H_HALF, H_65504, H_TINY, 0x8000] {
        b.elem(1, u32::from(h));
    }
    // V[cell][dim]: cell0 = (1, 0.5), cell1 = (-2, 65504), cell2 = (tiny, 1).
    let v = [[H_ONE, H_HALF], [H_MINUS_TWO, H_65504], [H_TINY, H_ONE]];
    b.i32(1);
    if v_trans {
        b.u32(2).u32(2);
        for dim in 0..2 {
            for cell in &v {
                b.elem(1, u32::from(cell[dim]));
            }
        }
    } else {
        b.u64(4);
        for cell in &v {
            for &x in cell {
                b.elem(1, u32::from(x));
            }
        }
    }
    b.0
}

#[test]
fn hand_placed_f16_values_decode() {
    let tiny = 2f32.powi(-24);
    let want_v = ndarray::arr2(&[[1.0, 0.5], [-2.0, 65504.0], [tiny, 1.0]]);
    for v_trans in [true, false] {
        let blob = hand_blob(v_trans);
        let snap = KvSnapshot::parse(&blob, OPTS).unwrap();
        assert_eq!(snap.seq_id, 7);
        let s = snap.single_stream().unwrap();
        assert_eq!(s.v_trans, v_trans);
        assert_eq!(s.positions(), vec![10, 11, 12]);
        assert_eq!(s.cells[1].seq_ids, vec![7]);
        let l = &s.layers[0];
        assert_eq!(
            l.k,
            ndarray::arr2(&[[1.0, -2.0], [0.5, 65504.0], [tiny, -0.0]])
        );
        assert!(l.k[[2, 1]].is_sign_negative(), "-0.0 keeps its sign");
        assert_eq!(l.v, want_v, "v_trans = {v_trans}");
        assert!(l.v.is_standard_layout());
        assert_eq!(snap.to_bytes().unwrap(), blob);
    }
}

#[test]
fn edited_values_are_written_in_blob_layout() {
    let blob = hand_blob(true);
    let mut snap = KvSnapshot::parse(&blob, OPTS).unwrap();
    let s = snap.single_stream_mut().unwrap();
    s.layers[0].v[[1, 0]] = 0.5;
    let out = snap.to_bytes().unwrap();
    // V data starts after: header 8, n_stream 4, cell_count 4, cells 36, meta 16, K 12 + 12,
    // V header 12. Transposed: dim 0 of cells 0..3, then dim 1; (cell 1, dim 0) is element 1.
    let v0 = 8 + 4 + 4 + 36 + 16 + 24 + 12;
    assert_eq!(out[v0 + 2..v0 + 4], H_HALF.to_le_bytes());
    assert_eq!(out.len(), blob.len());
}

#[test]
fn signalling_nan_is_quietened() {
    let mut blob = hand_blob(false);
    let k0 = 8 + 4 + 4 + 36 + 16 + 12;
    blob[k0..k0 + 2].copy_from_slice(&0x7c01u16.to_le_bytes());
    let snap = KvSnapshot::parse(&blob, OPTS).unwrap();
    assert!(snap.single_stream().unwrap().layers[0].k[[0, 0]].is_nan());
    let out = snap.to_bytes().unwrap();
    assert_eq!(u16::from_le_bytes([out[k0], out[k0 + 1]]), 0x7e01);
}

#[test]
fn cell_ext_and_multi_seq_cells_parse() {
    let (blob, _) = build(2, &[vec![Some(ext_stream())]], 3);
    let opts = ParseOptions {
        has_cell_ext: true,
        ..OPTS
    };
    let snap = KvSnapshot::parse(&blob, opts).unwrap();
    let s = snap.single_stream().unwrap();
    assert_eq!(
        s.cells[0].ext,
        Some(CellExt {
            x: 5,
            y: 6,
            tok: 1000
        })
    );
    assert_eq!(s.cells[1].ext.map(|e| e.tok), Some(-1));
    assert_eq!(s.cells[2].seq_ids, vec![1, 2]);
    // Read without ext, the same bytes must not pass as a valid blob.
    assert!(KvSnapshot::parse(&blob, OPTS).is_err());
}

#[test]
fn mla_blob_has_no_v_records() {
    let (blob, _) = build(0, &[vec![Some(mla_stream())]], 4);
    let opts = ParseOptions {
        has_v: false,
        ..OPTS
    };
    let snap = KvSnapshot::parse(&blob, opts).unwrap();
    let s = snap.single_stream().unwrap();
    assert!(!s.has_v);
    assert_eq!(s.layers[1].v.dim(), (4, 0));
    assert_eq!(s.layers[1].k.dim(), (4, 6));
    // Expecting V, the reader runs out of bytes.
    assert!(matches!(
        KvSnapshot::parse(&blob, OPTS),
        Err(KvError::Truncated { .. } | KvError::ImplausibleCount { .. })
    ));
}

#[test]
fn snapshot_accessors() {
    let (blob, _) = build(
        4,
        &[vec![
            Some(f16_stream(2, true)),
            None,
            Some(f16_stream(3, true)),
        ]],
        5,
    );
    let snap = KvSnapshot::parse(&blob, OPTS).unwrap();
    assert_eq!(snap.n_cells(), 5);
    assert_eq!(snap.positions(), vec![3, 4, 3, 5, 4]);
    let err = snap.single_stream().unwrap_err();
    assert_eq!(
        err,
        KvError::NotSingleStream {
            sections: 1,
            streams: 3,
            non_empty: 2
        }
    );
    assert!(snap.approx_bytes() > 5 * (3 * (4 + 3)) * 4);

    let one = snap.sections[0].streams[2].clone().unwrap();
    let mut single = KvSnapshot::from_single_stream(4, one.clone());
    assert_same(single.single_stream().unwrap(), &one);
    single.single_stream_mut().unwrap().n_rot_k = 0;
    assert_eq!(single.single_stream().unwrap().n_layer(), 3);

    let empty = KvSnapshot::parse(&build(0, &[vec![None]], 0).0, OPTS).unwrap();
    assert!(matches!(
        empty.single_stream(),
        Err(KvError::NotSingleStream { non_empty: 0, .. })
    ));
}

#[test]
fn cache_type_ids() {
    for t in [CacheType::F32, CacheType::F16, CacheType::BF16] {
        assert_eq!(CacheType::from_ggml(t.ggml_type()), Ok(t));
    }
    assert_eq!(CacheType::F16.ggml_type(), 1);
    assert_eq!(CacheType::F32.ggml_type(), 0);
    let e = CacheType::from_ggml(8).unwrap_err();
    assert!(e.to_string().contains("Q8_0"), "{e}");
    assert_eq!(
        CacheType::F16.quantize(1.0 / 3.0),
        f16::from_f32(1.0 / 3.0).to_f32()
    );
}

/// The one cache type is also a context's: its config spells it in lowercase and defaults to
/// llama.cpp's F16, as the engine's own enum did.
#[test]
fn cache_type_config_names() {
    assert_eq!(CacheType::default(), CacheType::F16);
    for (t, name) in [
        (CacheType::F16, "\"f16\""),
        (CacheType::F32, "\"f32\""),
        (CacheType::BF16, "\"bf16\""),
    ] {
        assert_eq!(serde_json::to_string(&t).unwrap(), name);
        assert_eq!(serde_json::from_str::<CacheType>(name).unwrap(), t);
    }
}

// ---------------------------------------------------------------------------------------------
// 3. Truncations.

#[test]
fn every_truncation_is_an_error() {
    for (name, blob, opts) in corpus() {
        for cut in 0..blob.len() {
            let r = KvSnapshot::parse(&blob[..cut], opts);
            assert!(
                r.is_err(),
                "{name}: prefix of {cut}/{} bytes parsed",
                blob.len()
            );
        }
    }
}

#[test]
fn truncation_error_names_offset_and_layer() {
    let blob = hand_blob(true);
    let cut = blob.len() - 3;
    let e = KvSnapshot::parse(&blob[..cut], OPTS).unwrap_err();
    let KvError::Truncated { at, offset, .. } = &e else {
        panic!("{e:?}")
    };
    assert_eq!(at.layer, Some(0));
    assert_eq!(at.tensor, Some(Tensor::V));
    assert_eq!(*offset, 8 + 4 + 4 + 36 + 16 + 24 + 12);
    let msg = e.to_string();
    assert!(msg.contains("section 0, stream 0, layer 0 V"), "{msg}");
}

#[test]
fn trailing_bytes_and_section_count() {
    let (mut blob, _) = build(0, &[vec![Some(f16_stream(2, true))]], 1);
    let n = blob.len();
    blob.extend_from_slice(&[1, 2]);
    assert_eq!(
        KvSnapshot::parse(&blob, OPTS).unwrap_err(),
        KvError::TrailingBytes {
            offset: n,
            remaining: 2
        }
    );
    blob.truncate(n);
    let one = ParseOptions {
        sections: Some(1),
        ..OPTS
    };
    assert!(KvSnapshot::parse(&blob, one).is_ok());
    let two = ParseOptions {
        sections: Some(2),
        ..OPTS
    };
    assert!(matches!(
        KvSnapshot::parse(&blob, two),
        Err(KvError::Truncated { .. })
    ));
    // With the count given, a complete extra section is trailing.
    blob.extend_from_slice(&0u32.to_le_bytes());
    assert!(matches!(
        KvSnapshot::parse(&blob, one),
        Err(KvError::TrailingBytes { .. })
    ));
    assert_eq!(KvSnapshot::parse(&blob, OPTS).unwrap().sections.len(), 2);
}

#[test]
fn header_errors() {
    assert!(matches!(
        KvSnapshot::parse(&[], OPTS),
        Err(KvError::Truncated { offset: 0, .. })
    ));
    let mut blob = hand_blob(true);
    blob[0] ^= 1;
    assert!(matches!(
        KvSnapshot::parse(&blob, OPTS),
        Err(KvError::BadMagic { found }) if found == IO_MAGIC ^ 1
    ));
    // Magic and seq id alone: no KV section to mirror.
    assert!(matches!(
        KvSnapshot::parse(&hand_blob(true)[..8], OPTS),
        Err(KvError::Truncated { offset: 8, .. })
    ));
}

// ---------------------------------------------------------------------------------------------
// 4. Fuzzing.

/// Parses `bytes`; if that succeeds, the re-serialization must parse to the same snapshot and
/// serialize identically. Also bounds the largest allocation by the input size.
fn check_mutant(bytes: &[u8], opts: ParseOptions) -> Result<(), TestCaseError> {
    let (parsed, largest) = largest_alloc(|| KvSnapshot::parse(bytes, opts));
    // Claimed counts never size an allocation; what the bytes really hold may: up to 2x for
    // F16 -> f32 arrays, 16x for a run of empty streams (a 64-byte `Option<KvStream>` per 4 bytes).
    prop_assert!(
        largest <= 32 * bytes.len() + 4096,
        "allocated {largest} for {} bytes",
        bytes.len()
    );
    if let Ok(snap) = parsed {
        let out = snap
            .to_bytes()
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let again =
            KvSnapshot::parse(&out, opts).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let out2 = again
            .to_bytes()
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(out, out2);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn mutated_blobs_never_panic(
        which in 0usize..12,
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..8),
        cut in any::<prop::sample::Index>(),
        do_cut in any::<bool>(),
    ) {
        let corpus = corpus();
        let (_, blob, opts) = &corpus[which % corpus.len()];
        let mut bytes = blob.clone();
        for (at, byte) in edits {
            let i = at.index(bytes.len());
            bytes[i] = byte;
        }
        if do_cut {
            let n = cut.index(bytes.len() + 1);
            bytes.truncate(n);
        }
        check_mutant(&bytes, *opts)?;
    }

    #[test]
    fn random_bytes_never_panic(
        tail in proptest::collection::vec(any::<u8>(), 0..256),
        ext in any::<bool>(),
        has_v in any::<bool>(),
    ) {
        let mut bytes = IO_MAGIC.to_le_bytes().to_vec();
        bytes.extend_from_slice(&tail);
        check_mutant(&bytes, ParseOptions { has_cell_ext: ext, has_v, sections: None })?;
    }
}

/// Many cheap single-field mutations at count-bearing offsets, beyond proptest's case budget.
#[test]
fn word_mutations_never_panic() {
    let mut rng = StdRng::seed_from_u64(0x5eed);
    let specials = [
        0u32,
        1,
        2,
        0x7fff_ffff,
        0x8000_0000,
        u32::MAX,
        0x0001_0000,
        3,
    ];
    for (_, blob, opts) in corpus() {
        for at in (0..blob.len().saturating_sub(4)).step_by(2) {
            for _ in 0..3 {
                let mut bytes = blob.clone();
                let w = if rng.random_bool(0.5) {
                    specials[rng.random_range(0..specials.len())]
                } else {
                    rng.random()
                };
                bytes[at..at + 4].copy_from_slice(&w.to_le_bytes());
                check_mutant(&bytes, opts).unwrap();
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 5. Quantized caches.

#[test]
fn quantized_cache_is_refused_naming_the_layer() {
    let mut s = f16_stream(2, true);
    s.layers[1].k_type = 8; // Q8_0
    s.layers[1].n_k = 17; // 34-byte blocks: any row size will do, it must not be read
    let (blob, _) = build(0, &[vec![Some(s)]], 1);
    let e = KvSnapshot::parse(&blob, OPTS).unwrap_err();
    let KvError::UnsupportedCacheType {
        ggml_type,
        offset,
        at,
    } = &e
    else {
        panic!("{e:?}")
    };
    assert_eq!(*ggml_type, 8);
    assert_eq!(at.layer, Some(1));
    assert_eq!(at.tensor, Some(Tensor::K));
    let k1 = 8 + 4 + 4 + 2 * 12 + 16 + (12 + 2 * 4 * 2);
    assert_eq!(*offset, Some(k1));
    let msg = e.to_string();
    assert!(
        msg.contains("Q8_0") && msg.contains("layer 1 K") && msg.contains("F16"),
        "{msg}"
    );

    let mut s = f16_stream(2, false);
    s.layers[2].v_type = 12; // Q4_K
    let (blob, _) = build(0, &[vec![Some(s)]], 1);
    let e = KvSnapshot::parse(&blob, OPTS).unwrap_err();
    assert!(
        matches!(e, KvError::UnsupportedCacheType { ggml_type: 12, at, .. }
            if at.layer == Some(2) && at.tensor == Some(Tensor::V)),
        "{e:?}"
    );
}

#[test]
fn size_fields_must_agree_with_the_type() {
    // K row of 5 bytes in an F16 cache.
    let mut b = Bytes::default();
    b.u32(IO_MAGIC).i32(0).u32(1).u32(1).i32(0).u32(1).i32(0);
    b.u32(0).u32(1).u32(0).u32(0).i32(1).u64(5);
    // Enough bytes after the row-size field that no count looks implausible first.
    b.0.extend_from_slice(&[0; 64]);
    let e = KvSnapshot::parse(&b.0, OPTS).unwrap_err();
    assert!(
        matches!(
            e,
            KvError::RowBytesMismatch {
                row_bytes: 5,
                elem_bytes: 2,
                ..
            }
        ),
        "{e:?}"
    );

    // Transposed V claiming 4-byte elements for F16.
    let mut blob = hand_blob(true);
    let el = 8 + 4 + 4 + 36 + 16 + 24 + 4;
    blob[el..el + 4].copy_from_slice(&4u32.to_le_bytes());
    let e = KvSnapshot::parse(&blob, OPTS).unwrap_err();
    assert!(
        matches!(
            e,
            KvError::ElementSizeMismatch {
                found: 4,
                expected: 2,
                ggml_type: 1,
                ..
            }
        ),
        "{e:?}"
    );

    let mut blob = hand_blob(true);
    let vt = 8 + 4 + 4 + 36;
    blob[vt..vt + 4].copy_from_slice(&2u32.to_le_bytes());
    let e = KvSnapshot::parse(&blob, OPTS).unwrap_err();
    assert!(matches!(e, KvError::BadVTrans { value: 2, .. }), "{e:?}");
}

// ---------------------------------------------------------------------------------------------
// 6. Implausible counts.

#[test]
fn huge_counts_are_refused_without_allocating() {
    let base = hand_blob(true);
    // (offset of the field, name in the error)
    let fields = [
        (8, "n_stream"),
        (12, "cell_count"),
        (16 + 4, "cell n_seq_id"),
        (16 + 36 + 4, "n_layer"),
    ];
    for (at, what) in fields {
        for huge in [u32::MAX, 0x1000_0000, 1_000_000] {
            let mut blob = base.clone();
            blob[at..at + 4].copy_from_slice(&huge.to_le_bytes());
            let (r, largest) = largest_alloc(|| KvSnapshot::parse(&blob, OPTS));
            let e = r.unwrap_err();
            assert!(
                matches!(&e, KvError::ImplausibleCount { what: w, offset, count, .. }
                    if *w == what && *offset == at && *count == u64::from(huge)),
                "{what}: {e:?}"
            );
            assert!(largest < 4096, "{what} = {huge}: allocated {largest} bytes");
        }
    }
    // A huge row size or V width is caught as a block that does not fit.
    for (at, what) in [
        (16 + 36 + 16 + 4, "K data"),
        (16 + 36 + 16 + 24 + 8, "transposed V data"),
    ] {
        let mut blob = base.clone();
        let w = if what == "K data" { 8 } else { 4 };
        blob[at..at + w].fill(0xf0);
        let (r, largest) = largest_alloc(|| KvSnapshot::parse(&blob, OPTS));
        let e = r.unwrap_err();
        assert!(
            matches!(&e, KvError::Truncated { what: w, .. } if *w == what),
            "{e:?}"
        );
        assert!(largest < 4096, "{what}: allocated {largest} bytes");
    }
}

// ---------------------------------------------------------------------------------------------
// 7. Validation on write.

fn parsed_f16() -> KvSnapshot {
    KvSnapshot::parse(&build(0, &[vec![Some(f16_stream(4, true))]], 1).0, OPTS).unwrap()
}

#[test]
fn inconsistent_cell_counts_are_refused_on_write() {
    let mut snap = parsed_f16();
    snap.single_stream_mut().unwrap().layers[1].k = Array2::zeros((3, 4));
    let e = snap.to_bytes().unwrap_err();
    let KvError::ShapeMismatch { at, detail } = &e else {
        panic!("{e:?}")
    };
    assert_eq!(
        (at.section, at.stream, at.layer, at.tensor),
        (Some(0), Some(0), Some(1), Some(Tensor::K))
    );
    assert!(detail.contains("3 K rows for 4 cells"), "{detail}");
    assert!(snap.single_stream().unwrap().validate().is_err());

    let mut snap = parsed_f16();
    snap.single_stream_mut().unwrap().layers[2].v = Array2::zeros((5, 5));
    assert!(matches!(
        snap.to_bytes(),
        Err(KvError::ShapeMismatch { at, .. }) if at.layer == Some(2) && at.tensor == Some(Tensor::V)
    ));

    let mut snap = parsed_f16();
    snap.single_stream_mut().unwrap().cells.pop();
    assert!(matches!(
        snap.to_bytes(),
        Err(KvError::ShapeMismatch { .. })
    ));

    let mut snap = parsed_f16();
    snap.single_stream_mut().unwrap().cells[2].ext = Some(CellExt { x: 0, y: 0, tok: 0 });
    assert!(matches!(
        snap.to_bytes(),
        Err(KvError::ShapeMismatch { .. })
    ));

    let mut snap = parsed_f16();
    let s = snap.single_stream_mut().unwrap();
    s.has_v = false;
    assert!(matches!(
        snap.to_bytes(),
        Err(KvError::ShapeMismatch { .. })
    ));
}

#[test]
fn layout_and_type_changes_are_honoured_on_write() {
    let snap = parsed_f16();
    let s = snap.single_stream().unwrap();

    // Same arrays written row-major and as F32 parse back to the same values.
    let mut t = s.clone();
    t.v_trans = false;
    for l in &mut t.layers {
        l.k_type = CacheType::F32;
        l.v_type = CacheType::F32;
    }
    let out = KvSnapshot::from_single_stream(9, t.clone())
        .to_bytes()
        .unwrap();
    let back = KvSnapshot::parse(&out, OPTS).unwrap();
    assert_eq!(back.seq_id, 9);
    assert_same(back.single_stream().unwrap(), &t);

    // Non-standard (column-major) arrays are written in logical order.
    let mut f = s.clone();
    for l in &mut f.layers {
        let mut v = Array2::zeros(l.v.raw_dim().f());
        v.assign(&l.v);
        l.v = v;
    }
    let out = KvSnapshot::from_single_stream(0, f).to_bytes().unwrap();
    assert_eq!(out, snap.to_bytes().unwrap());

    // An empty `Some` stream is written as llama.cpp writes an empty stream.
    let mut e = s.clone();
    e.cells.clear();
    let out = KvSnapshot::from_single_stream(0, e).to_bytes().unwrap();
    assert_eq!(out, build(0, &[vec![None]], 0).0);
}

// ---------------------------------------------------------------------------------------------
// Speed: run with `cargo test --release -- --ignored --nocapture parse_speed`.

#[test]
#[ignore = "timing; run in release"]
fn parse_speed() {
    let spec = stream(1024, true, (0..24).map(|_| layer(1, 128, 1, 128)).collect());
    let (blob, _) = build(0, &[vec![Some(spec)]], 1);
    let t = std::time::Instant::now();
    let n = 20;
    let mut snap = None;
    for _ in 0..n {
        snap = Some(KvSnapshot::parse(&blob, OPTS).unwrap());
    }
    let parse = t.elapsed() / n;
    let snap = snap.unwrap();
    let t = std::time::Instant::now();
    for _ in 0..n {
        assert_eq!(snap.to_bytes().unwrap().len(), blob.len());
    }
    let write = t.elapsed() / n;
    println!(
        "{} MB blob: parse {:?}, to_bytes {:?}",
        blob.len() / 1_000_000,
        parse,
        write
    );
}

/// Blob sizes llama.cpp produced on this machine for 29 cells of Qwen2.5 0.5B and 1.5B (F16
/// cache, flash attention off; `shared/probe/run-qwen*.txt`) are what this layout predicts.
#[test]
fn sizes_match_real_llama_cpp_blobs() {
    for (n_layer, width, bytes) in [(24, 128, 357_308), (28, 256, 832_540)] {
        let spec = stream(
            29,
            true,
            (0..n_layer).map(|_| layer(1, width, 1, width)).collect(),
        );
        let (blob, _) = build(0, &[vec![Some(spec)]], 1);
        assert_eq!(blob.len(), bytes);
        let snap = KvSnapshot::parse(&blob, OPTS).unwrap();
        assert_eq!(snap.encoded_len().unwrap(), bytes);

        let cells = (0..29)
            .map(|p| Cell {
                pos: p,
                seq_ids: vec![0],
                ext: None,
            })
            .collect();
        let zeros = || Array2::zeros((29, width));
        let layers = (0..n_layer)
            .map(|_| LayerKv {
                k: zeros(),
                v: zeros(),
                k_type: CacheType::F16,
                v_type: CacheType::F16,
            })
            .collect();
        let fresh = KvSnapshot::from_single_stream(
            0,
            KvStream {
                cells,
                v_trans: true,
                n_rot_k: 0,
                n_rot_v: 0,
                has_v: true,
                layers,
            },
        );
        assert_eq!(fresh.to_bytes().unwrap().len(), bytes);
    }
}
