//! A hostile length field must be refused without allocating for it. A counting global
//! allocator records the largest single allocation made while parsing; this file holds a
//! single test so no other test's allocations are counted.

#[path = "gguf_common/mod.rs"]
mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use molt::gguf::{GgufError, GgufFile};

struct Counting;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: delegates every call to the system allocator unchanged; only records sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: same layout contract as our caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: ptr was allocated by System.alloc with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: forwarded unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn huge_declared_lengths_allocate_nothing_large() {
    let mut cases = Vec::new();
    // a 2^40-element string array, a 2^40-element u64 array, a 2^40-byte string, 2^40 pairs
    for (elem, n) in [(8u32, 1u64 << 40), (10, 1 << 40), (8, (1 << 20) / 8)] {
        let mut b = common::header(0, 1);
        common::push_str(&mut b, "tokenizer.ggml.tokens");
        b.extend(9u32.to_le_bytes());
        b.extend(elem.to_le_bytes());
        b.extend(n.to_le_bytes());
        b.extend(vec![0u8; 4096]);
        cases.push(b);
    }
    let mut b = common::header(0, 1);
    common::push_str(&mut b, "k");
    b.extend(8u32.to_le_bytes());
    b.extend((1u64 << 40).to_le_bytes());
    cases.push(b);
    cases.push(common::header(1 << 40, 1 << 40));

    for bytes in cases {
        LARGEST.store(0, Ordering::Relaxed);
        let input_len = bytes.len();
        let e = GgufFile::from_bytes("hostile.gguf", bytes).expect_err("refused");
        let largest = LARGEST.load(Ordering::Relaxed);
        assert!(
            matches!(
                e,
                GgufError::LengthTooLarge { .. } | GgufError::Truncated { .. }
            ),
            "{e:?}"
        );
        // Nothing bigger than the input itself (plus small bookkeeping) is ever allocated.
        assert!(
            largest <= input_len.max(4096),
            "largest allocation {largest} B for {e}"
        );
    }
}
