//! Capture of llama.cpp's log stream. llama.cpp reports *why* a load failed only through its
//! logger, so Molt keeps the last warnings and errors to quote them in [`super::EngineError`].

use std::collections::VecDeque;
use std::ffi::{CStr, c_char, c_void};
use std::sync::Mutex;

static RECENT: Mutex<VecDeque<String>> = Mutex::new(VecDeque::new());
thread_local! {
    /// `(what, MiB)` of every "… buffer size = X MiB" line this thread saw since the last
    /// [`take_buffer_sizes`]: llama.cpp's own account of what a context reserves (KV, compute,
    /// output buffers). Per thread, because llama.cpp logs them synchronously on the thread
    /// creating the context, and two threads creating contexts at once must not swap them.
    static BUFFERS: std::cell::RefCell<Vec<(String, f64)>> = const { std::cell::RefCell::new(Vec::new()) };
}
const KEEP: usize = 16;

extern "C" fn on_log(level: llama_cpp_sys_2::ggml_log_level, text: *const c_char, _: *mut c_void) {
    if text.is_null() {
        return;
    }
    // SAFETY: llama.cpp passes a NUL-terminated string valid for the duration of the call.
    let line = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    if std::env::var_os("MOLT_LLAMA_LOG").is_some() {
        eprint!("{line}");
    }
    if let Some(rec) = parse_buffer_size(&line) {
        BUFFERS.with(|b| b.borrow_mut().push(rec));
    }
    if (level == llama_cpp_sys_2::GGML_LOG_LEVEL_WARN
        || level == llama_cpp_sys_2::GGML_LOG_LEVEL_ERROR)
        && let Ok(mut q) = RECENT.lock()
    {
        if q.len() == KEEP {
            q.pop_front();
        }
        q.push_back(line.trim_end().to_string());
    }
}

pub(super) fn install() {
    // SAFETY: `on_log` is a plain function valid for the whole program and ignores user data.
    unsafe {
        llama_cpp_sys_2::llama_log_set(Some(on_log), std::ptr::null_mut());
    }
}

/// Takes (and clears) the warnings and errors llama.cpp logged since the last call, joined
/// into one line; "no detail logged" when there were none.
pub fn recent_llama_errors() -> String {
    let lines: Vec<String> = RECENT
        .lock()
        .map(|mut q| q.drain(..).collect())
        .unwrap_or_default();
    if lines.is_empty() {
        "no detail logged".to_string()
    } else {
        lines.join(" | ")
    }
}

/// Parses `"<prefix>: <what> buffer size = <x> MiB"`.
fn parse_buffer_size(line: &str) -> Option<(String, f64)> {
    let (head, tail) = line.split_once("buffer size =")?;
    let mib: f64 = tail.trim().strip_suffix("MiB")?.trim().parse().ok()?;
    let what = head.rsplit(':').next()?.trim().to_string();
    Some((what, mib))
}

/// Takes (and clears) the buffer sizes llama.cpp reported since the last call.
pub fn take_buffer_sizes() -> Vec<(String, f64)> {
    BUFFERS.with(|b| std::mem::take(&mut *b.borrow_mut()))
}

#[cfg(test)]
mod tests {
    #[test]
    fn buffer_size_lines_parse() {
        let r = super::parse_buffer_size(
            "sched_reserve:        CPU compute buffer size =   310.02 MiB\n",
        );
        assert_eq!(r, Some(("CPU compute".to_string(), 310.02)));
        assert!(super::parse_buffer_size("compute buffer size is 310.0 MiB, matches").is_none());
    }
}
