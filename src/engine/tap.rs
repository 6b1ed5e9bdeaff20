//! An optional attention tap: llama.cpp's eval callback (`cb_eval`) reading the post-softmax
//! attention weights (`kq_soft_max-<layer>` tensors) of one decode, reduced on the spot to one
//! entropy per layer and head for the last query token of that decode.
//!
//! Why it exists: a migrated cache can score well on next-token divergence while attending far
//! more diffusely than a native cache would (a blurred cache). The benchmark's *attention
//! flatness* metric is the ratio of these entropies after a migration to those on a natively
//! built cache; no other signal exposes the blur.
//!
//! The same callback also serves the *hidden-state tap* of selective top-k recompute: while
//! one or more layers are set ([`Context::set_hidden_layers`](super::Context::set_hidden_layers)),
//! every decode copies the residual stream after those layers (`l_out-<layer>`, one row of
//! `n_embd` floats per token) into host memory, in decode order. The context keeps those rows
//! aligned with the positions of its sequence. A boundary layer is never the model's last
//! (whose `l_out` llama.cpp cuts down to the output rows), so every decoded token has a row.
//!
//! A third use, the *attention mass* of selective token recompute: while mass is armed
//! (`arm_mass`), every softmax node adds, for every key cell, the attention weight it gets
//! from every query row of the decode, summed over heads and layers. Decoding a prompt's last
//! tokens (the question) armed says which earlier positions the model reads to answer it (as
//! SnapKV's observation window does); a size switch re-reads those positions natively.
//!
//! Cost: installing the tap makes llama.cpp ask the callback about every graph node (a name
//! comparison, microseconds per decode). While disarmed it asks for nothing, so the graph is
//! computed in one piece as without a tap; only an armed decode splits the graph at the softmax
//! nodes and copies one row per head out of each. Flash attention, which Molt keeps off, would
//! fuse the softmax away and leave nothing to read.

use std::cell::RefCell;
use std::ffi::{CStr, c_void};

/// Name prefix llama.cpp gives the attention weights (`cb(kq, "kq_soft_max", il)`).
const SOFTMAX_PREFIX: &[u8] = b"kq_soft_max-";
/// Name prefix of a block's output, the residual stream entering the next block
/// (`cb(cur, "l_out", il)` in every llama.cpp model graph).
const HIDDEN_PREFIX: &[u8] = b"l_out-";

/// Attention entropies captured from one decode: for every layer seen, one entropy (nats) per
/// query head, over the key positions the last query token attends to.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AttentionCapture {
    /// `(layer, per-head entropy)`, ordered by layer.
    pub layers: Vec<(usize, Vec<f64>)>,
    /// Key positions with non-zero weight in the last row (the attended context length).
    pub n_attended: usize,
}

impl AttentionCapture {
    /// Mean entropy over every layer and head (NaN when nothing was captured).
    #[must_use]
    pub fn mean_entropy(&self) -> f64 {
        let (sum, n) = self
            .layers
            .iter()
            .flat_map(|(_, h)| h.iter())
            .fold((0.0, 0usize), |(s, n), &e| (s + e, n + 1));
        if n == 0 { f64::NAN } else { sum / n as f64 }
    }
}

/// The tap's state, reached from the C callback through the user-data pointer.
#[derive(Debug, Default)]
pub(crate) struct TapState {
    armed: bool,
    current: Vec<(usize, Vec<f64>)>,
    n_attended: usize,
    done: Option<AttentionCapture>,
    row: Vec<f32>,
    /// Layers whose output the hidden-state tap copies (empty: off).
    hidden_layers: Vec<usize>,
    /// Per entry of `hidden_layers`: rows appended in decode order, `n_embd` floats each.
    hidden_rows: Vec<Vec<f32>>,
    /// Row width seen (0 before the first row).
    hidden_width: usize,
    /// Attention mass per key cell, summed over query rows, heads and layers, while armed.
    mass: Option<Vec<f64>>,
}

/// The tap as a context owns it: boxed so the address handed to llama.cpp never moves.
pub(crate) type Tap = Box<RefCell<TapState>>;

pub(crate) fn new_tap() -> Tap {
    Box::new(RefCell::new(TapState::default()))
}

/// Arms the tap for the next decode (dropping any capture not yet taken).
pub(crate) fn arm(tap: &Tap) {
    let mut s = tap.borrow_mut();
    s.armed = true;
    s.current.clear();
    s.n_attended = 0;
    s.done = None;
}

/// Called after a decode returns: an armed tap seals what it saw and disarms.
pub(crate) fn finish(tap: &Tap) {
    let mut s = tap.borrow_mut();
    if s.armed {
        s.armed = false;
        let mut layers = std::mem::take(&mut s.current);
        layers.sort_by_key(|(l, _)| *l);
        let n_attended = s.n_attended;
        s.done = Some(AttentionCapture { layers, n_attended });
    }
}

/// Starts summing attention mass over key cells (dropping any sum not yet taken).
pub(crate) fn arm_mass(tap: &Tap) {
    tap.borrow_mut().mass = Some(Vec::new());
}

/// The mass summed since [`arm_mass`], one entry per key cell the decodes saw; disarms.
pub(crate) fn take_mass(tap: &Tap) -> Option<Vec<f64>> {
    tap.borrow_mut().mass.take()
}

pub(crate) fn take(tap: &Tap) -> Option<AttentionCapture> {
    tap.borrow_mut().done.take()
}

/// Sets the layers the hidden-state tap copies, dropping every row kept so far.
pub(crate) fn set_hidden_layers(tap: &Tap, layers: &[usize]) {
    let mut s = tap.borrow_mut();
    s.hidden_layers = layers.to_vec();
    s.hidden_rows = vec![Vec::new(); layers.len()];
    s.hidden_width = 0;
}

/// The layers the hidden-state tap copies.
pub(crate) fn hidden_layers(tap: &Tap) -> Vec<usize> {
    tap.borrow().hidden_layers.clone()
}

/// Keeps the first `n_rows` rows of every tapped layer.
pub(crate) fn truncate_hidden(tap: &Tap, n_rows: usize) {
    let mut s = tap.borrow_mut();
    let w = s.hidden_width;
    for r in &mut s.hidden_rows {
        r.truncate(n_rows * w);
    }
}

/// Rows kept for `layer` (row-major, `width` floats each) and that width.
pub(crate) fn hidden_rows(tap: &Tap, layer: usize) -> Option<(Vec<f32>, usize)> {
    let s = tap.borrow();
    let i = s.hidden_layers.iter().position(|&l| l == layer)?;
    Some((s.hidden_rows[i].clone(), s.hidden_width))
}

/// Number of rows kept (the same for every tapped layer after a complete decode).
pub(crate) fn hidden_len(tap: &Tap) -> usize {
    let s = tap.borrow();
    match (s.hidden_rows.iter().map(Vec::len).min(), s.hidden_width) {
        (Some(n), w) if w > 0 => n / w,
        _ => 0,
    }
}

fn layer_of(name: &[u8]) -> Option<usize> {
    let rest = name.strip_prefix(SOFTMAX_PREFIX)?;
    std::str::from_utf8(rest).ok()?.parse().ok()
}

fn hidden_layer_of(name: &[u8]) -> Option<usize> {
    let rest = name.strip_prefix(HIDDEN_PREFIX)?;
    std::str::from_utf8(rest).ok()?.parse().ok()
}

/// The hidden-state half of the callback: `Some(answer)` when `t` is a tapped `l_out` node.
fn hidden_node(
    s: &mut TapState,
    t: *mut llama_cpp_sys_2::ggml_tensor,
    name: &[u8],
    ask: bool,
) -> Option<bool> {
    let layer = hidden_layer_of(name)?;
    let slot = s.hidden_layers.iter().position(|&l| l == layer)?;
    // SAFETY: t is a live tensor (checked non-null by the caller).
    let tensor = unsafe { &*t };
    if ask {
        return Some(tensor.type_ == llama_cpp_sys_2::GGML_TYPE_F32);
    }
    let (Ok(width), Ok(n_tok)) = (usize::try_from(tensor.ne[0]), usize::try_from(tensor.ne[1]))
    else {
        return Some(true);
    };
    if width == 0 || (s.hidden_width != 0 && s.hidden_width != width) {
        return Some(true);
    }
    s.hidden_width = width;
    let rows = &mut s.hidden_rows[slot];
    let start = rows.len();
    rows.resize(start + n_tok * width, 0.0);
    for i in 0..n_tok {
        // SAFETY: row i spans [i * nb[1], i * nb[1] + width * 4) inside the computed F32
        // tensor (ne/nb describe it), and the destination slice has room for width floats.
        unsafe {
            llama_cpp_sys_2::ggml_backend_tensor_get(
                t,
                rows[start + i * width..].as_mut_ptr().cast(),
                i * tensor.nb[1],
                width * std::mem::size_of::<f32>(),
            );
        }
    }
    Some(true)
}

/// Entropy (nats) of a probability row; zero entries (masked positions) contribute nothing.
#[must_use]
pub fn entropy(p: &[f32]) -> f64 {
    p.iter()
        .filter(|&&x| x > 0.0)
        .map(|&x| {
            let x = f64::from(x);
            -x * x.ln()
        })
        .sum()
}

/// The `cb_eval` callback. With `ask = true` llama.cpp asks whether we want a node's data;
/// with `ask = false` the node has been computed and we may read it. Returning `false` to the
/// second call would abort the graph, so that call always returns `true`.
///
/// # Safety
/// `t` must point to a live ggml tensor and `user_data` to the `RefCell<TapState>` boxed in
/// the context that installed this callback (llama.cpp passes back what we gave it).
pub(crate) unsafe extern "C" fn callback(
    t: *mut llama_cpp_sys_2::ggml_tensor,
    ask: bool,
    user_data: *mut c_void,
) -> bool {
    if t.is_null() || user_data.is_null() {
        return !ask;
    }
    // SAFETY: user_data is the Box<RefCell<TapState>> address installed by Context::new, alive
    // as long as the llama context (the context frees llama.cpp before dropping the box).
    let cell = unsafe { &*user_data.cast::<RefCell<TapState>>() };
    // A re-entrant call cannot happen (llama.cpp calls back on the decoding thread, which is
    // inside Context::decode and holds no borrow), but never panic across FFI.
    let Ok(mut s) = cell.try_borrow_mut() else {
        return !ask;
    };
    if !s.armed && s.mass.is_none() && s.hidden_layers.is_empty() {
        return !ask;
    }
    // SAFETY: t is a live tensor; its name is a NUL-terminated array inside the struct.
    let tensor = unsafe { &*t };
    // SAFETY: as above: ggml always NUL-terminates the 64-byte name.
    let name = unsafe { CStr::from_ptr(tensor.name.as_ptr()) }.to_bytes();
    if let Some(answer) = hidden_node(&mut s, t, name, ask) {
        return answer;
    }
    if !s.armed && s.mass.is_none() {
        return !ask;
    }
    let Some(layer) = layer_of(name) else {
        return !ask;
    };
    if ask {
        return tensor.type_ == llama_cpp_sys_2::GGML_TYPE_F32;
    }
    if s.mass.is_some() {
        add_mass(&mut s, t);
    }
    if !s.armed {
        return true;
    }
    let (Ok(n_kv), Ok(n_tok), Ok(n_head)) = (
        usize::try_from(tensor.ne[0]),
        usize::try_from(tensor.ne[1]),
        usize::try_from(tensor.ne[2]),
    ) else {
        return true;
    };
    if n_kv == 0 || n_tok == 0 {
        return true;
    }
    let last = n_tok - 1;
    let mut heads = Vec::with_capacity(n_head);
    let mut row = std::mem::take(&mut s.row);
    row.resize(n_kv, 0.0);
    let mut attended = 0;
    for h in 0..n_head {
        let offset = h * tensor.nb[2] + last * tensor.nb[1];
        // SAFETY: the row [offset, offset + n_kv * 4) lies inside the computed F32 tensor
        // (ne/nb describe it); ggml_backend_tensor_get copies from whatever buffer holds it.
        unsafe {
            llama_cpp_sys_2::ggml_backend_tensor_get(
                t,
                row.as_mut_ptr().cast(),
                offset,
                n_kv * std::mem::size_of::<f32>(),
            );
        }
        attended = attended.max(row.iter().filter(|&&x| x > 0.0).count());
        heads.push(entropy(&row));
    }
    s.row = row;
    s.n_attended = attended;
    // A later chunk of the same decode replaces an earlier one: the last row is the last token.
    if let Some(slot) = s.current.iter_mut().find(|(l, _)| *l == layer) {
        slot.1 = heads;
    } else {
        s.current.push((layer, heads));
    }
    true
}

/// Adds every query row of the softmax node `t` (`[n_kv, n_tok, n_head]`, F32) into the
/// armed mass, cell by cell.
fn add_mass(s: &mut TapState, t: *mut llama_cpp_sys_2::ggml_tensor) {
    // SAFETY: t is a live tensor (checked non-null by the caller).
    let tensor = unsafe { &*t };
    let (Ok(n_kv), Ok(n_tok), Ok(n_head)) = (
        usize::try_from(tensor.ne[0]),
        usize::try_from(tensor.ne[1]),
        usize::try_from(tensor.ne[2]),
    ) else {
        return;
    };
    if n_kv == 0 || n_tok == 0 {
        return;
    }
    let mut row = std::mem::take(&mut s.row);
    row.resize(n_kv, 0.0);
    let Some(mass) = s.mass.as_mut() else {
        return;
    };
    if mass.len() < n_kv {
        mass.resize(n_kv, 0.0);
    }
    for h in 0..n_head {
        for r in 0..n_tok {
            let offset = h * tensor.nb[2] + r * tensor.nb[1];
            // SAFETY: the row [offset, offset + n_kv * 4) lies inside the computed F32 tensor
            // (ne/nb describe it); ggml_backend_tensor_get copies from whatever buffer holds it.
            unsafe {
                llama_cpp_sys_2::ggml_backend_tensor_get(
                    t,
                    row.as_mut_ptr().cast(),
                    offset,
                    n_kv * std::mem::size_of::<f32>(),
                );
            }
            for (m, &x) in mass.iter_mut().zip(&row) {
                *m += f64::from(x);
            }
        }
    }
    s.row = row;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entropy_of_uniform_and_point_masses() {
        assert!((entropy(&[0.25; 4]) - 4f64.ln()).abs() < 1e-9);
        assert_eq!(entropy(&[0.0, 1.0, 0.0]), 0.0);
        // Masked (zero) positions do not change the entropy of the rest.
        assert!((entropy(&[0.5, 0.0, 0.5, 0.0]) - 2f64.ln()).abs() < 1e-9);
    }

    #[test]
    fn only_softmax_nodes_are_layers() {
        assert_eq!(layer_of(b"kq_soft_max-17"), Some(17));
        assert_eq!(layer_of(b"kq_soft_max"), None);
        assert_eq!(layer_of(b"kq-3"), None);
        assert_eq!(hidden_layer_of(b"l_out-7"), Some(7));
        assert_eq!(hidden_layer_of(b"l_out"), None);
        assert_eq!(hidden_layer_of(b"kq_soft_max-7"), None);
    }

    #[test]
    fn arm_finish_take_cycle() {
        let tap = new_tap();
        finish(&tap);
        assert!(take(&tap).is_none(), "a disarmed tap seals nothing");
        arm(&tap);
        tap.borrow_mut().current.push((1, vec![1.0, 3.0]));
        tap.borrow_mut().current.push((0, vec![2.0]));
        finish(&tap);
        let c = take(&tap).unwrap();
        assert_eq!(c.layers[0].0, 0, "sorted by layer");
        assert!((c.mean_entropy() - 2.0).abs() < 1e-12);
        assert!(take(&tap).is_none());
    }
}
