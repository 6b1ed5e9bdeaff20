//! What the chat draws: each token coloured by the rung that produced it, a switch as a line
//! of its own (`⇆ tier0 → tier1 (molt, 31 ms, pressure 0.81)`), notes and the per-answer
//! summary in dim text.
//!
//! Colour follows the usual conventions: only when stdout is a terminal, `NO_COLOR` is unset
//! or empty and `TERM` is not `dumb` (or `--color always`). Without colour the text is plain and
//! the legend says that the `⇆` lines mark where the rung changed. Model text is sanitised: a
//! random-weight or misbehaving model can emit escape bytes, which must not reach the terminal
//! as commands.

use molt::session::{Generation, StopReason, SwitchInfo};
use std::fmt::Write as _;
use std::io::Write;

/// ANSI foreground colours for rungs 0, 1, 2, … (green, yellow, magenta, cyan, blue, red).
const PALETTE: [&str; 6] = [
    "\x1b[32m", "\x1b[33m", "\x1b[35m", "\x1b[36m", "\x1b[34m", "\x1b[31m",
];
const RESET: &str = "\x1b[0m";
const DIM: &str = "\x1b[2m";
const BOLD: &str = "\x1b[1m";

/// Whether to colour, from `--color` and the environment.
pub fn use_color(choice: super::ColorArg, stdout_is_terminal: bool) -> bool {
    match choice {
        super::ColorArg::Always => true,
        super::ColorArg::Never => false,
        super::ColorArg::Auto => {
            stdout_is_terminal
                && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
                && std::env::var_os("TERM").is_none_or(|t| t != "dumb")
        }
    }
}

/// Replaces control characters other than newline and tab by visible stand-ins (C0 by their
/// Unicode control pictures, DEL and C1 by U+FFFD).
pub fn sanitize(text: &str) -> std::borrow::Cow<'_, str> {
    if !text
        .chars()
        .any(|c| c.is_control() && c != '\n' && c != '\t')
    {
        return std::borrow::Cow::Borrowed(text);
    }
    text.chars()
        .map(|c| match c {
            '\n' | '\t' => c,
            c if (c as u32) < 0x20 => char::from_u32(0x2400 + c as u32).unwrap_or('\u{fffd}'),
            c if c.is_control() => '\u{fffd}',
            c => c,
        })
        .collect::<String>()
        .into()
}

/// Draws the conversation on stdout.
pub struct Renderer {
    color: bool,
    rungs: Vec<String>,
    at_line_start: bool,
}

impl Renderer {
    /// A renderer for a ladder's rung names, largest first.
    pub fn new(color: bool, rungs: Vec<String>) -> Self {
        Self {
            color,
            rungs,
            at_line_start: true,
        }
    }

    fn paint(&self, code: &str, text: &str) -> String {
        if self.color {
            format!("{code}{text}{RESET}")
        } else {
            text.to_string()
        }
    }

    fn rung_code(&self, rung: &str) -> &'static str {
        let i = self.rungs.iter().position(|r| r == rung).unwrap_or(0);
        PALETTE[i % PALETTE.len()]
    }

    /// `tier0` in its colour.
    pub fn rung_name(&self, rung: &str) -> String {
        self.paint(self.rung_code(rung), rung)
    }

    /// The legend line.
    pub fn legend(&self) -> String {
        if self.color {
            let names: Vec<String> = self
                .rungs
                .iter()
                .map(|r| self.paint(self.rung_code(r), &format!("■ {r}")))
                .collect();
            format!(
                "rungs: {}  (each token in the colour of its rung)",
                names.join("  ")
            )
        } else {
            format!(
                "rungs: {} (no colour: each ⇆ line marks where the answer changed rung)",
                self.rungs.join(", ")
            )
        }
    }

    fn out(&mut self, s: &str) {
        if s.is_empty() {
            return;
        }
        let mut o = std::io::stdout().lock();
        let _ = o.write_all(s.as_bytes());
        let _ = o.flush();
        self.at_line_start = s.ends_with('\n');
    }

    /// Ends the current line if text is on it.
    pub fn break_line(&mut self) {
        if !self.at_line_start {
            self.out("\n");
        }
    }

    /// The line of text the user sent (shown for piped input, where nothing echoes it).
    pub fn user_line(&mut self, prompt: &str, text: &str) {
        self.break_line();
        let s = format!("{prompt}{}\n", sanitize(text));
        self.out(&s);
    }

    /// One generated token's text.
    pub fn token(&mut self, rung: &str, text: &str) {
        let clean = sanitize(text);
        let s = self.paint(self.rung_code(rung), &clean);
        self.out(&s);
    }

    /// A switch, on its own line.
    pub fn switch(&mut self, s: &SwitchInfo) {
        self.break_line();
        let mut line = format!(
            "⇆ {} → {} ({}, {:.0} ms, pressure {:.2})",
            self.rung_name(&s.from),
            self.rung_name(&s.to),
            s.method,
            s.timings.cost_ms,
            s.pressure
        );
        if s.timings.load_ms >= 0.5 {
            let _ = write!(line, " · mapped {} in {:.0} ms", s.to, s.timings.load_ms);
        }
        line.push_str(&crate::common::background_part(s));
        if let Some(setup) = &s.setup {
            let _ = write!(line, " · {setup}");
        }
        let line = if self.color {
            format!("{BOLD}{line}{RESET}\n")
        } else {
            format!("{line}\n")
        };
        self.out(&line);
    }

    /// A note in dim text on its own line.
    pub fn note(&mut self, text: &str) {
        self.break_line();
        let s = format!("{}\n", self.paint(DIM, text));
        self.out(&s);
    }

    /// The end-of-answer summary.
    pub fn summary(&mut self, g: &Generation, reused: usize) {
        self.note(&summary_line(g, reused));
    }
}

/// `[87 tokens · tier0 → tier2 · 1 switch at token 24 · prompt 312 (280 cached) · TTFT 412 ms ·
/// 21.3 tok/s · eos]`
pub fn summary_line(g: &Generation, reused: usize) -> String {
    let mut s = format!("[{} tokens · {}", g.tokens.len(), g.rungs_used.join(" → "));
    match g.switches.len() {
        0 => {}
        1 => {
            let _ = write!(s, " · 1 switch at token {}", g.switches[0].at_token);
        }
        n => {
            let at: Vec<String> = g.switches.iter().map(|w| w.at_token.to_string()).collect();
            let _ = write!(s, " · {n} switches at tokens {}", at.join(", "));
        }
    }
    let _ = write!(
        s,
        " · prompt {} ({reused} cached) · TTFT {:.0} ms · {:.1} tok/s · {}]",
        g.prompt_tokens,
        g.ttft_ms,
        g.tokens_per_s(),
        match g.stop {
            StopReason::Eos => "end of answer",
            StopReason::Length => "max tokens",
            StopReason::ContextFull => "context full (/reset)",
            StopReason::Cancelled => "stopped",
            StopReason::Killed => "killed",
            StopReason::ParkDeadline =>
                "no memory within the park deadline (/budget, then ask again)",
        }
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_bytes_never_reach_the_terminal() {
        assert_eq!(sanitize("plain\ttext\n"), "plain\ttext\n");
        let s = sanitize("a\x1b[2Jb\u{1e}c\u{7f}\u{85}");
        assert!(!s.chars().any(|c| c.is_control()), "{s:?}");
        assert_eq!(s, "a\u{241b}[2Jb\u{241e}c\u{fffd}\u{fffd}");
    }

    #[test]
    fn plain_output_has_no_escapes_and_colour_has_one_per_rung() {
        let names = vec!["tier0".to_string(), "tier1".into(), "tier2".into()];
        let plain = Renderer::new(false, names.clone());
        assert!(!plain.legend().contains('\x1b'));
        assert!(plain.legend().contains("⇆"));
        assert_eq!(plain.rung_name("tier1"), "tier1");
        let col = Renderer::new(true, names);
        assert_eq!(col.rung_name("tier0"), "\x1b[32mtier0\x1b[0m");
        assert_eq!(col.rung_name("tier2"), "\x1b[35mtier2\x1b[0m");
        assert_ne!(col.rung_code("tier0"), col.rung_code("tier1"));
    }
}
