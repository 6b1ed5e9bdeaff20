//! Capture of llama.cpp's log stream. llama.cpp reports *why* a load failed only through its
//! logger, so Molt keeps the last warnings and errors to quote them in [`super::EngineError`].

use std::collections::VecDeque;
use std::ffi::{CStr, c_char, c_void};
use std::sync::Mutex;

static RECENT: Mutex<VecDeque<String>> = Mutex::new(VecDeque::new());
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
