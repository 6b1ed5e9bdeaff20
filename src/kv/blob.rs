//! Byte-level reading and writing of the per-sequence state blob (layout in the parent module's
//! docs). The reader checks every count against the bytes left before reserving memory for it,
//! so a corrupt header costs an error, never a huge allocation or a panic.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use ndarray::Array2;

use super::{
    CacheType, Cell, CellExt, IO_MAGIC, KvError, KvSection, KvSnapshot, KvStream, LayerKv, Loc,
    ParseOptions, StreamLayout, Tensor, TensorSpan,
};

/// Bytes of a cell record before its sequence ids: `i32 pos, u32 n_seq_id`.
const CELL_HEAD: u64 = 8;
/// Bytes of a `llama_kv_cell_ext` record: `i32 x, i32 y, i32 tok`.
const CELL_EXT: u64 = 12;
/// Bytes of `u32 v_trans, u32 n_layer, u32 n_rot_k, u32 n_rot_v`.
const STREAM_META: u64 = 16;
/// Bytes of a K record header, and of either V record header: `i32 type` + 8 bytes.
const TENSOR_HEAD: u64 = 12;

struct Reader<'a> {
    buf: &'a [u8],
    /// Invariant: `pos <= buf.len()`.
    pos: usize,
    at: Loc,
    scratch: Scratch,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn truncated(&self, needed: usize, what: &'static str) -> KvError {
        KvError::Truncated {
            offset: self.pos,
            needed,
            len: self.buf.len(),
            what,
            at: self.at,
        }
    }

    fn bytes(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], KvError> {
        let rest = &self.buf[self.pos..];
        let s = rest.get(..n).ok_or_else(|| self.truncated(n, what))?;
        self.pos += n;
        Ok(s)
    }

    /// `rows × row_bytes` bytes, with an overflowing product reported as an (impossible)
    /// truncation rather than wrapping.
    fn block(
        &mut self,
        rows: usize,
        row_bytes: u64,
        what: &'static str,
    ) -> Result<&'a [u8], KvError> {
        let n = usize::try_from(row_bytes)
            .ok()
            .and_then(|rb| rows.checked_mul(rb))
            .ok_or_else(|| self.truncated(usize::MAX, what))?;
        self.bytes(n, what)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], KvError> {
        let rest = &self.buf[self.pos..];
        let a = *rest
            .first_chunk::<N>()
            .ok_or_else(|| self.truncated(N, what))?;
        self.pos += N;
        Ok(a)
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, KvError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn i32(&mut self, what: &'static str) -> Result<i32, KvError> {
        self.array(what).map(i32::from_le_bytes)
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, KvError> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// Reads a `u32` count of items that each take at least `min_each` bytes, followed (if there
    /// is any item) by at least `then` more bytes, and refuses it unless the rest of the blob can
    /// hold that much.
    fn count(&mut self, what: &'static str, min_each: u64, then: u64) -> Result<usize, KvError> {
        let offset = self.pos;
        let count = self.u32(what)?;
        let min_bytes = match count {
            0 => 0,
            n => u64::from(n).saturating_mul(min_each).saturating_add(then),
        };
        let remaining = self.remaining();
        if min_bytes > remaining as u64 {
            return Err(KvError::ImplausibleCount {
                offset,
                what,
                count: u64::from(count),
                min_bytes,
                remaining,
                at: self.at,
            });
        }
        // `count <= remaining` here whenever `min_each > 0`, so it fits a usize.
        usize::try_from(count).map_err(|_| self.truncated(usize::MAX, what))
    }

    fn cache_type(&mut self, what: &'static str) -> Result<CacheType, KvError> {
        let offset = self.pos;
        let t = self.i32(what)?;
        CacheType::from_ggml(t).map_err(|_| KvError::UnsupportedCacheType {
            ggml_type: t,
            offset: Some(offset),
            at: self.at,
        })
    }
}

/// A reader at the start of `bytes`, past the blob's header: with the sequence id it names.
fn open(bytes: &[u8]) -> Result<(Reader<'_>, i32), KvError> {
    let mut r = Reader {
        buf: bytes,
        pos: 0,
        at: Loc::HEADER,
        scratch: Scratch::default(),
    };
    let magic = r.u32("magic")?;
    if magic != IO_MAGIC {
        return Err(KvError::BadMagic { found: magic });
    }
    let seq_id = r.i32("seq_id")?;
    Ok((r, seq_id))
}

/// A stream's `v_trans` field: 0 or 1.
fn read_v_trans(r: &mut Reader<'_>) -> Result<bool, KvError> {
    let offset = r.pos;
    match r.u32("v_trans")? {
        0 => Ok(false),
        1 => Ok(true),
        value => Err(KvError::BadVTrans {
            offset,
            value,
            at: r.at,
        }),
    }
}

pub(super) fn parse(bytes: &[u8], opts: ParseOptions) -> Result<KvSnapshot, KvError> {
    let (mut r, seq_id) = open(bytes)?;

    let mut sections = Vec::new();
    loop {
        let done = match opts.sections {
            Some(n) => sections.len() == n,
            // A blob without any KV section has nothing to mirror; more likely it was cut.
            None => !sections.is_empty() && r.remaining() == 0,
        };
        if done {
            break;
        }
        let section = sections.len();
        r.at = Loc {
            section: Some(section),
            ..Loc::HEADER
        };
        if opts.sections.is_none() && section > 0 && r.remaining() < 4 {
            return Err(KvError::TrailingBytes {
                offset: r.pos,
                remaining: r.remaining(),
            });
        }
        let n_stream = r.count("n_stream", 4, 0)?;
        let mut streams = Vec::with_capacity(n_stream);
        for stream in 0..n_stream {
            r.at.stream = Some(stream);
            streams.push(parse_stream(&mut r, opts)?);
        }
        sections.push(KvSection { streams });
    }
    if r.remaining() > 0 {
        return Err(KvError::TrailingBytes {
            offset: r.pos,
            remaining: r.remaining(),
        });
    }
    Ok(KvSnapshot { seq_id, sections })
}

fn parse_stream(r: &mut Reader<'_>, opts: ParseOptions) -> Result<Option<KvStream>, KvError> {
    let cell_min = CELL_HEAD + if opts.has_cell_ext { CELL_EXT } else { 0 };
    let n_cells = r.count("cell_count", cell_min, STREAM_META)?;
    if n_cells == 0 {
        return Ok(None);
    }

    let mut cells = Vec::with_capacity(n_cells);
    for _ in 0..n_cells {
        let pos = r.i32("cell pos")?;
        let n_seq = r.count("cell n_seq_id", 4, 0)?;
        let ext = if opts.has_cell_ext {
            Some(CellExt {
                x: r.i32("cell ext x")?,
                y: r.i32("cell ext y")?,
                tok: r.i32("cell ext tok")?,
            })
        } else {
            None
        };
        let mut seq_ids = Vec::with_capacity(n_seq);
        for _ in 0..n_seq {
            seq_ids.push(r.i32("cell seq_id")?);
        }
        cells.push(Cell { pos, seq_ids, ext });
    }

    let v_trans = read_v_trans(r)?;
    let per_layer = TENSOR_HEAD * if opts.has_v { 2 } else { 1 };
    let n_layer = r.count("n_layer", per_layer, 8)?;
    let n_rot_k = r.u32("n_rot_k")?;
    let n_rot_v = r.u32("n_rot_v")?;

    let mut ks = Vec::with_capacity(n_layer);
    for layer in 0..n_layer {
        r.at.layer = Some(layer);
        r.at.tensor = Some(Tensor::K);
        ks.push(parse_rows(r, n_cells, Tensor::K)?);
    }

    let mut layers = Vec::with_capacity(n_layer);
    for (layer, (k_type, k)) in ks.into_iter().enumerate() {
        r.at.layer = Some(layer);
        r.at.tensor = Some(Tensor::V);
        let (v_type, v) = if !opts.has_v {
            (k_type, Array2::zeros((n_cells, 0)))
        } else if v_trans {
            parse_transposed(r, n_cells)?
        } else {
            parse_rows(r, n_cells, Tensor::V)?
        };
        layers.push(LayerKv {
            k,
            v,
            k_type,
            v_type,
        });
    }
    r.at.layer = None;
    r.at.tensor = None;

    Ok(Some(KvStream {
        cells,
        v_trans,
        n_rot_k,
        n_rot_v,
        has_v: opts.has_v,
        layers,
    }))
}

/// A layer tensor's record, read and checked, its elements not yet decoded.
struct RawTensor<'a> {
    ty: CacheType,
    data: &'a [u8],
    /// Row width (elements per cell).
    n_embd: usize,
    /// Stored `[dim][cell]` (transposed V).
    transposed: bool,
}

/// A row-major record: `i32 type, u64 row_bytes, n_cells × row_bytes`.
fn read_rows<'a>(
    r: &mut Reader<'a>,
    n_cells: usize,
    tensor: Tensor,
) -> Result<RawTensor<'a>, KvError> {
    let (what_type, what_row, what_data) = match tensor {
        Tensor::K => ("K type", "K row bytes", "K data"),
        Tensor::V => ("V type", "V row bytes", "V data"),
    };
    let ty = r.cache_type(what_type)?;
    let offset = r.pos;
    let row_bytes = r.u64(what_row)?;
    let elem = ty.elem_bytes();
    if row_bytes % elem as u64 != 0 {
        return Err(KvError::RowBytesMismatch {
            offset,
            row_bytes,
            elem_bytes: elem,
            at: r.at,
        });
    }
    let data = r.block(n_cells, row_bytes, what_data)?;
    // The block exists, so the element count is bounded by the blob length.
    let n_embd = data.len() / elem / n_cells;
    Ok(RawTensor {
        ty,
        data,
        n_embd,
        transposed: false,
    })
}

/// A transposed V record: `i32 type, u32 el_bytes, u32 n_embd_v, n_embd_v × n_cells × el`.
fn read_transposed<'a>(r: &mut Reader<'a>, n_cells: usize) -> Result<RawTensor<'a>, KvError> {
    let ty = r.cache_type("V type")?;
    let offset = r.pos;
    let el = r.u32("V element bytes")?;
    if el as usize != ty.elem_bytes() {
        return Err(KvError::ElementSizeMismatch {
            offset,
            ggml_type: ty.ggml_type(),
            found: el,
            expected: ty.elem_bytes(),
            at: r.at,
        });
    }
    let n_embd = r.u32("V n_embd_v_gqa")? as usize;
    let row_bytes = (n_embd as u64).saturating_mul(u64::from(el));
    let data = r.block(n_cells, row_bytes, "transposed V data")?;
    Ok(RawTensor {
        ty,
        data,
        n_embd,
        transposed: true,
    })
}

/// A row-major record, decoded.
fn parse_rows(
    r: &mut Reader<'_>,
    n_cells: usize,
    tensor: Tensor,
) -> Result<(CacheType, Array2<f32>), KvError> {
    let raw = read_rows(r, n_cells, tensor)?;
    let values = r.scratch.decode(raw.ty, raw.data);
    let a =
        Array2::from_shape_vec((n_cells, raw.n_embd), values).map_err(|e| shape_bug(r.at, &e))?;
    Ok((raw.ty, a))
}

/// A transposed V record, decoded to `[cell][dim]`.
fn parse_transposed(
    r: &mut Reader<'_>,
    n_cells: usize,
) -> Result<(CacheType, Array2<f32>), KvError> {
    let raw = read_transposed(r, n_cells)?;
    let v = r
        .scratch
        .decode_transposed(raw.ty, raw.data, raw.n_embd, n_cells);
    let a = Array2::from_shape_vec((n_cells, raw.n_embd), v).map_err(|e| shape_bug(r.at, &e))?;
    Ok((raw.ty, a))
}

/// Where the tensors of a single-stream blob (one section, one stream; no cell ext, K and V
/// present) lie, read and checked as [`parse`] reads them, nothing decoded: what rewriting
/// its K and V in place needs.
pub(super) fn single_stream_layout(bytes: &[u8]) -> Result<StreamLayout, KvError> {
    let (mut r, _) = open(bytes)?;
    r.at = Loc {
        section: Some(0),
        ..Loc::HEADER
    };
    let n_stream = r.count("n_stream", 4, 0)?;
    let not_single = |non_empty| KvError::NotSingleStream {
        sections: 1,
        streams: n_stream,
        non_empty,
    };
    if n_stream != 1 {
        return Err(not_single(n_stream));
    }
    r.at.stream = Some(0);
    let n_cells = r.count("cell_count", CELL_HEAD, STREAM_META)?;
    if n_cells == 0 {
        return Err(not_single(0));
    }
    let mut positions = Vec::with_capacity(n_cells);
    for _ in 0..n_cells {
        positions.push(r.i32("cell pos")?);
        let n_seq = r.count("cell n_seq_id", 4, 0)?;
        for _ in 0..n_seq {
            r.i32("cell seq_id")?;
        }
    }
    let v_trans = read_v_trans(&mut r)?;
    let n_layer = r.count("n_layer", TENSOR_HEAD * 2, 8)?;
    let _n_rot_k = r.u32("n_rot_k")?;
    let _n_rot_v = r.u32("n_rot_v")?;
    let base = bytes.as_ptr() as usize;
    let span = |t: RawTensor<'_>| TensorSpan {
        ty: t.ty,
        offset: t.data.as_ptr() as usize - base,
        len: t.data.len(),
        n_embd: t.n_embd,
        transposed: t.transposed,
    };
    let mut k = Vec::with_capacity(n_layer);
    for layer in 0..n_layer {
        r.at.layer = Some(layer);
        r.at.tensor = Some(Tensor::K);
        k.push(span(read_rows(&mut r, n_cells, Tensor::K)?));
    }
    let mut v = Vec::with_capacity(n_layer);
    for layer in 0..n_layer {
        r.at.layer = Some(layer);
        r.at.tensor = Some(Tensor::V);
        v.push(span(if v_trans {
            read_transposed(&mut r, n_cells)?
        } else {
            read_rows(&mut r, n_cells, Tensor::V)?
        }));
    }
    if r.remaining() > 0 {
        return Err(KvError::TrailingBytes {
            offset: r.pos,
            remaining: r.remaining(),
        });
    }
    Ok(StreamLayout { positions, k, v })
}

fn shape_bug(at: Loc, e: &ndarray::ShapeError) -> KvError {
    KvError::ShapeMismatch {
        at,
        detail: format!("decoded element count does not fill the array: {e}"),
    }
}

/// Conversion buffers reused from layer to layer, so that only the arrays handed to the caller
/// are fresh memory.
#[derive(Default)]
struct Scratch {
    f32s: Vec<f32>,
    f16s: Vec<f16>,
    bf16s: Vec<bf16>,
}

impl Scratch {
    /// Decodes little-endian elements of `ty` from `data` into `dst`, element for element.
    /// F16/BF16 go through half's slice conversion, which uses F16C/NEON in bulk instead of a
    /// CPU-feature check per element.
    fn decode_into(
        f16s: &mut Vec<f16>,
        bf16s: &mut Vec<bf16>,
        ty: CacheType,
        data: &[u8],
        dst: &mut [f32],
    ) {
        match ty {
            CacheType::F32 => {
                for (d, c) in dst.iter_mut().zip(data.as_chunks::<4>().0) {
                    *d = f32::from_le_bytes(*c);
                }
            }
            CacheType::F16 => {
                f16s.clear();
                f16s.extend(
                    data.as_chunks::<2>()
                        .0
                        .iter()
                        .map(|c| f16::from_le_bytes(*c)),
                );
                // Equal lengths by construction; `min` only keeps the slice conversion from
                // panicking should that ever break.
                let n = dst.len().min(f16s.len());
                f16s[..n].convert_to_f32_slice(&mut dst[..n]);
            }
            CacheType::BF16 => {
                bf16s.clear();
                bf16s.extend(
                    data.as_chunks::<2>()
                        .0
                        .iter()
                        .map(|c| bf16::from_le_bytes(*c)),
                );
                let n = dst.len().min(bf16s.len());
                bf16s[..n].convert_to_f32_slice(&mut dst[..n]);
            }
        }
    }

    fn decode(&mut self, ty: CacheType, data: &[u8]) -> Vec<f32> {
        let mut out = vec![0f32; data.len() / ty.elem_bytes()];
        Self::decode_into(&mut self.f16s, &mut self.bf16s, ty, data, &mut out);
        out
    }

    /// Decodes a `[rows][cols]` block and returns it as `[cols][rows]`.
    fn decode_transposed(
        &mut self,
        ty: CacheType,
        data: &[u8],
        rows: usize,
        cols: usize,
    ) -> Vec<f32> {
        let n = data.len() / ty.elem_bytes();
        self.f32s.clear();
        self.f32s.resize(n, 0.0);
        Self::decode_into(&mut self.f16s, &mut self.bf16s, ty, data, &mut self.f32s);
        let mut out = vec![0f32; n];
        transpose_into(&self.f32s, rows, cols, &mut out);
        out
    }
}

/// `src` `[rows][cols]` -> `dst` `[cols][rows]`.
///
/// Goes through a 16×16 tile so every cache line is read and written whole, once: with a
/// 1024-cell cache one side has a 4 KiB stride, which a plain strided loop turns into L1
/// set conflicts (it was 10× slower).
fn transpose_into(src: &[f32], rows: usize, cols: usize, dst: &mut [f32]) {
    const T: usize = 16;
    if rows == 0 || cols == 0 || rows.checked_mul(cols) != Some(src.len()) || dst.len() != src.len()
    {
        return;
    }
    let mut tile = [[0f32; T]; T];
    for r0 in (0..rows).step_by(T) {
        let r1 = (r0 + T).min(rows);
        for c0 in (0..cols).step_by(T) {
            let c1 = (c0 + T).min(cols);
            for (t, r) in tile.iter_mut().zip(r0..r1) {
                let seg = &src[r * cols + c0..r * cols + c1];
                // A fixed-size copy compiles to two vector moves; a variable one to a memcpy call.
                match seg.first_chunk::<T>() {
                    Some(full) => *t = *full,
                    None => t[..seg.len()].copy_from_slice(seg),
                }
            }
            for (j, c) in (c0..c1).enumerate() {
                let d = &mut dst[c * rows + r0..c * rows + r1];
                for (x, t) in d.iter_mut().zip(&tile) {
                    *x = t[j];
                }
            }
        }
    }
}

/// The elements of `a` as one slice, in `[row][col]` order, or `[col][row]` if `transposed`;
/// borrowed when `a` is already laid out so, else gathered into `buf`.
fn ordered<'a>(a: &'a Array2<f32>, transposed: bool, buf: &'a mut Vec<f32>) -> &'a [f32] {
    buf.clear();
    match (transposed, a.as_slice()) {
        (false, Some(s)) => s,
        (true, Some(s)) => {
            buf.resize(s.len(), 0.0);
            transpose_into(s, a.nrows(), a.ncols(), buf);
            buf
        }
        (false, None) => {
            buf.extend(a.iter().copied());
            buf
        }
        (true, None) => {
            buf.extend(a.t().iter().copied());
            buf
        }
    }
}

fn u32_field(value: usize, what: &str, at: Loc) -> Result<u32, KvError> {
    u32::try_from(value).map_err(|_| KvError::ShapeMismatch {
        at,
        detail: format!("{what} = {value} does not fit the blob's u32 field"),
    })
}

pub(super) fn validate_stream(s: &KvStream) -> Result<(), KvError> {
    validate_at(s, Loc::HEADER)
}

fn validate_at(s: &KvStream, base: Loc) -> Result<(), KvError> {
    let n = s.cells.len();
    if n == 0 {
        // Written as an empty stream: nothing of it reaches the blob.
        return Ok(());
    }
    u32_field(n, "cell count", base)?;
    u32_field(s.layers.len(), "layer count", base)?;
    let has_ext = s.cells[0].ext.is_some();
    for (i, c) in s.cells.iter().enumerate() {
        u32_field(c.seq_ids.len(), "cell n_seq_id", base)?;
        if c.ext.is_some() != has_ext {
            return Err(KvError::ShapeMismatch {
                at: base,
                detail: format!(
                    "cell {i} {} an ext record but cell 0 {}: a cache has ext on every cell or none",
                    if c.ext.is_some() { "has" } else { "lacks" },
                    if has_ext { "has one" } else { "does not" }
                ),
            });
        }
    }
    for (layer, l) in s.layers.iter().enumerate() {
        let at_k = Loc {
            layer: Some(layer),
            tensor: Some(Tensor::K),
            ..base
        };
        let at_v = Loc {
            tensor: Some(Tensor::V),
            ..at_k
        };
        if l.k.nrows() != n {
            return Err(KvError::ShapeMismatch {
                at: at_k,
                detail: format!("{} K rows for {n} cells", l.k.nrows()),
            });
        }
        if l.v.nrows() != n {
            return Err(KvError::ShapeMismatch {
                at: at_v,
                detail: format!("{} V rows for {n} cells", l.v.nrows()),
            });
        }
        if !s.has_v && l.v.ncols() != 0 {
            return Err(KvError::ShapeMismatch {
                at: at_v,
                detail: format!(
                    "V has {} columns in a stream without V (has_v = false); it must be empty",
                    l.v.ncols()
                ),
            });
        }
        if s.has_v && s.v_trans {
            u32_field(l.v.ncols(), "n_embd_v_gqa", at_v)?;
        }
    }
    Ok(())
}

fn stream_len(s: &KvStream, at: Loc) -> Result<usize, KvError> {
    let overflow = || KvError::ShapeMismatch {
        at,
        detail: "encoded stream would exceed the address space".to_owned(),
    };
    let n = s.cells.len();
    let mut len: usize = 4;
    if n == 0 {
        return Ok(len);
    }
    for c in &s.cells {
        let ext = if c.ext.is_some() {
            CELL_EXT as usize
        } else {
            0
        };
        len = c
            .seq_ids
            .len()
            .checked_mul(4)
            .and_then(|b| b.checked_add(CELL_HEAD as usize + ext))
            .and_then(|b| b.checked_add(len))
            .ok_or_else(overflow)?;
    }
    len = len.checked_add(STREAM_META as usize).ok_or_else(overflow)?;
    for l in &s.layers {
        let k = l.k.len().checked_mul(l.k_type.elem_bytes());
        let v = if s.has_v {
            l.v.len().checked_mul(l.v_type.elem_bytes())
        } else {
            Some(0)
        };
        let heads = TENSOR_HEAD as usize * if s.has_v { 2 } else { 1 };
        len = k
            .zip(v)
            .and_then(|(k, v)| k.checked_add(v))
            .and_then(|b| b.checked_add(heads))
            .and_then(|b| b.checked_add(len))
            .ok_or_else(overflow)?;
    }
    Ok(len)
}

/// Validates every stream and returns the exact blob length.
pub(super) fn encoded_len(snap: &KvSnapshot) -> Result<usize, KvError> {
    let mut len: usize = 8;
    for (section, sec) in snap.sections.iter().enumerate() {
        let at = Loc {
            section: Some(section),
            ..Loc::HEADER
        };
        u32_field(sec.streams.len(), "n_stream", at)?;
        len = len.checked_add(4).ok_or_else(|| overflow_err(at))?;
        for (stream, st) in sec.streams.iter().enumerate() {
            let at = Loc {
                stream: Some(stream),
                ..at
            };
            let sl = match st {
                None => 4,
                Some(s) => {
                    validate_at(s, at)?;
                    stream_len(s, at)?
                }
            };
            len = len.checked_add(sl).ok_or_else(|| overflow_err(at))?;
        }
    }
    Ok(len)
}

fn overflow_err(at: Loc) -> KvError {
    KvError::ShapeMismatch {
        at,
        detail: "encoded blob would exceed the address space".to_owned(),
    }
}

pub(super) fn write(snap: &KvSnapshot) -> Result<Vec<u8>, KvError> {
    let len = encoded_len(snap)?;
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(&IO_MAGIC.to_le_bytes());
    out.extend_from_slice(&snap.seq_id.to_le_bytes());
    // Counts below were checked to fit by `encoded_len`, so the `as u32` casts are lossless.
    for sec in &snap.sections {
        out.extend_from_slice(&(sec.streams.len() as u32).to_le_bytes());
        for st in &sec.streams {
            match st {
                Some(s) if !s.cells.is_empty() => write_stream(s, &mut out),
                _ => out.extend_from_slice(&0u32.to_le_bytes()),
            }
        }
    }
    debug_assert_eq!(out.len(), len);
    Ok(out)
}

fn write_stream(s: &KvStream, out: &mut Vec<u8>) {
    out.extend_from_slice(&(s.cells.len() as u32).to_le_bytes());
    for c in &s.cells {
        out.extend_from_slice(&c.pos.to_le_bytes());
        out.extend_from_slice(&(c.seq_ids.len() as u32).to_le_bytes());
        if let Some(e) = c.ext {
            out.extend_from_slice(&e.x.to_le_bytes());
            out.extend_from_slice(&e.y.to_le_bytes());
            out.extend_from_slice(&e.tok.to_le_bytes());
        }
        for id in &c.seq_ids {
            out.extend_from_slice(&id.to_le_bytes());
        }
    }
    out.extend_from_slice(&u32::from(s.v_trans).to_le_bytes());
    out.extend_from_slice(&(s.layers.len() as u32).to_le_bytes());
    out.extend_from_slice(&s.n_rot_k.to_le_bytes());
    out.extend_from_slice(&s.n_rot_v.to_le_bytes());

    let mut scratch = Scratch::default();
    for l in &s.layers {
        out.extend_from_slice(&l.k_type.ggml_type().to_le_bytes());
        let row = (l.k.ncols() * l.k_type.elem_bytes()) as u64;
        out.extend_from_slice(&row.to_le_bytes());
        scratch.encode(l.k_type, &l.k, false, out);
    }
    if !s.has_v {
        return;
    }
    for l in &s.layers {
        out.extend_from_slice(&l.v_type.ggml_type().to_le_bytes());
        let elem = l.v_type.elem_bytes();
        if s.v_trans {
            out.extend_from_slice(&(elem as u32).to_le_bytes());
            out.extend_from_slice(&(l.v.ncols() as u32).to_le_bytes());
        } else {
            out.extend_from_slice(&((l.v.ncols() * elem) as u64).to_le_bytes());
        }
        scratch.encode(l.v_type, &l.v, s.v_trans, out);
    }
}

impl Scratch {
    /// Appends the elements of `a` (`[dim][cell]` order if `transposed`) little-endian in `ty`'s
    /// encoding.
    fn encode(&mut self, ty: CacheType, a: &Array2<f32>, transposed: bool, out: &mut Vec<u8>) {
        let Self { f32s, f16s, bf16s } = self;
        let values = ordered(a, transposed, f32s);
        let start = out.len();
        out.resize(start + values.len() * ty.elem_bytes(), 0);
        let dst = &mut out[start..];
        match ty {
            CacheType::F32 => {
                for (d, x) in dst.as_chunks_mut::<4>().0.iter_mut().zip(values) {
                    *d = x.to_le_bytes();
                }
            }
            CacheType::F16 => {
                f16s.clear();
                f16s.resize(values.len(), f16::ZERO);
                f16s.convert_from_f32_slice(values);
                for (d, h) in dst.as_chunks_mut::<2>().0.iter_mut().zip(f16s.iter()) {
                    *d = h.to_le_bytes();
                }
            }
            CacheType::BF16 => {
                bf16s.clear();
                bf16s.resize(values.len(), bf16::ZERO);
                bf16s.convert_from_f32_slice(values);
                for (d, h) in dst.as_chunks_mut::<2>().0.iter_mut().zip(bf16s.iter()) {
                    *d = h.to_le_bytes();
                }
            }
        }
    }
}
