//! Keyboard input for the chat, in two modes that share one file descriptor.
//!
//! - Between answers, a line is read with `rustyline` (editing, history) when stdin is a
//!   terminal, else from [`FdLines`].
//! - While an answer streams, the terminal is in its normal (canonical) mode and the main
//!   thread polls stdin between drawing tokens: a line typed then (`/budget 800`) is read
//!   whole when Enter is pressed and acted on before the next token. Ctrl-C raises SIGINT, whose
//!   handler only sets a flag; the main thread turns it into the session's cancel flag, so it
//!   stops the answer, not the program.
//!
//! Everything reads fd 0 directly (never through `std::io::Stdin`'s buffer), so no line can
//! be swallowed by one reader and missed by the other.

use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rustyline::DefaultEditor;
use rustyline::error::ReadlineError;

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Makes SIGINT set a flag instead of ending the process.
///
/// # Errors
/// `sigaction` failed.
pub fn install_sigint() -> io::Result<()> {
    // SAFETY: a zeroed `sigaction` is a valid initial value; the handler only stores to an
    // atomic, which is async-signal-safe; no SA_RESTART, so a blocking call returns EINTR.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigint as *const () as libc::sighandler_t;
        libc::sigemptyset(&mut sa.sa_mask);
        sa.sa_flags = 0;
        if libc::sigaction(libc::SIGINT, &raw const sa, std::ptr::null_mut()) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Whether Ctrl-C was pressed since the last call.
pub fn take_interrupt() -> bool {
    INTERRUPTED.swap(false, Ordering::SeqCst)
}

/// What the user gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Line {
    /// A line of text (without its newline).
    Text(String),
    /// Ctrl-C at the prompt.
    Interrupted,
    /// Ctrl-D, or the end of piped input.
    Eof,
}

/// Lines from fd 0, read with `poll` so that waiting never blocks the token stream.
#[derive(Debug, Default)]
pub struct FdLines {
    buf: Vec<u8>,
    closed: bool,
    /// A pipe's end is final; a terminal's Ctrl-D is not (reading goes on afterwards).
    sticky_eof: bool,
}

impl FdLines {
    fn new(sticky_eof: bool) -> Self {
        Self {
            sticky_eof,
            ..Self::default()
        }
    }

    fn take_line(&mut self) -> Option<String> {
        let line = if let Some(p) = self.buf.iter().position(|&b| b == b'\n') {
            let mut l: Vec<u8> = self.buf.drain(..=p).collect();
            l.pop();
            l
        } else if self.closed && !self.buf.is_empty() {
            std::mem::take(&mut self.buf)
        } else {
            return None;
        };
        Some(
            String::from_utf8_lossy(&line)
                .trim_end_matches('\r')
                .to_string(),
        )
    }

    /// A complete line if one is (or within `timeout` becomes) available.
    ///
    /// # Errors
    /// `poll` or `read` failed for a reason other than a signal.
    pub fn poll(&mut self, timeout: Duration) -> io::Result<Option<Line>> {
        if let Some(l) = self.take_line() {
            return Ok(Some(Line::Text(l)));
        }
        if self.closed {
            return Ok(Some(Line::Eof));
        }
        let mut pfd = libc::pollfd {
            fd: 0,
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
        // SAFETY: one valid pollfd, count 1.
        let n = unsafe { libc::poll(&raw mut pfd, 1, ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::Interrupted {
                Ok(None)
            } else {
                Err(e)
            };
        }
        if n == 0 {
            return Ok(None);
        }
        let mut chunk = [0u8; 4096];
        // SAFETY: reads at most chunk.len() bytes into a buffer of that size.
        let r = unsafe { libc::read(0, chunk.as_mut_ptr().cast(), chunk.len()) };
        if r < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock => Ok(None),
                _ => Err(e),
            };
        }
        if r == 0 {
            if self.sticky_eof {
                self.closed = true;
                return Ok(Some(self.take_line().map_or(Line::Eof, Line::Text)));
            }
            return Ok(Some(Line::Eof));
        }
        self.buf
            .extend_from_slice(&chunk[..usize::try_from(r).unwrap_or(0)]);
        Ok(self.take_line().map(Line::Text))
    }
}

/// The chat's input.
pub struct Input {
    editor: Option<DefaultEditor>,
    fd: FdLines,
    history: Option<PathBuf>,
}

impl Input {
    /// Line editing when stdin is a terminal; `history` is loaded now and saved by
    /// [`Input::save_history`].
    pub fn new(interactive: bool, history: Option<PathBuf>) -> Self {
        let editor = if interactive {
            let config = rustyline::Config::builder()
                .auto_add_history(false)
                .max_history_size(1000)
                .map(rustyline::config::Builder::build)
                .ok();
            config.and_then(|c| DefaultEditor::with_config(c).ok())
        } else {
            None
        };
        let mut input = Self {
            fd: FdLines::new(editor.is_none()),
            editor,
            history,
        };
        if let (Some(ed), Some(h)) = (input.editor.as_mut(), input.history.as_ref()) {
            let _ = ed.load_history(h);
        }
        input
    }

    /// Whether lines are edited (stdin is a terminal).
    pub fn is_editing(&self) -> bool {
        self.editor.is_some()
    }

    /// Reads one line between answers (blocking).
    ///
    /// # Errors
    /// The terminal or stdin failed.
    pub fn read(&mut self, prompt: &str) -> io::Result<Line> {
        if let Some(ed) = self.editor.as_mut() {
            return match ed.readline(prompt) {
                Ok(l) => Ok(Line::Text(l)),
                Err(ReadlineError::Interrupted) => Ok(Line::Interrupted),
                Err(ReadlineError::Eof) => Ok(Line::Eof),
                Err(ReadlineError::Io(e)) => Err(e),
                Err(e) => Err(io::Error::other(e.to_string())),
            };
        }
        loop {
            if take_interrupt() {
                return Ok(Line::Interrupted);
            }
            if let Some(l) = self.fd.poll(Duration::from_millis(100))? {
                return Ok(l);
            }
        }
    }

    /// A line typed while an answer streams, if one is complete within `timeout`.
    ///
    /// # Errors
    /// stdin failed.
    pub fn poll(&mut self, timeout: Duration) -> io::Result<Option<Line>> {
        self.fd.poll(timeout)
    }

    /// Remembers a line in the history.
    pub fn remember(&mut self, line: &str) {
        if let Some(ed) = self.editor.as_mut() {
            let _ = ed.add_history_entry(line);
        }
    }

    /// Writes the history file (best effort: a read-only home must not end the chat badly).
    pub fn save_history(&mut self) {
        if let (Some(ed), Some(h)) = (self.editor.as_mut(), self.history.as_ref()) {
            if let Some(dir) = h.parent() {
                let _ = std::fs::create_dir_all(dir);
            }
            let _ = ed.save_history(h);
        }
    }
}
