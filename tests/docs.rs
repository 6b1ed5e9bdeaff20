//! The documents can be trusted: every relative link in `README.md` and `docs/*.md` resolves,
//! and every shell command they show is one this checkout has — a script that exists, a
//! `molt-run` subcommand with flags its `--help` lists, an example, a package or a test of the
//! workspace. (The README's included example is the file itself, and its results table the one
//! `results/` gives: `molt-bench`'s `page::readme` tests check both; the examples are built and
//! run by `tests/examples.rs`.)

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `README.md` and every page under `docs/`.
fn documents() -> Vec<PathBuf> {
    let mut v = vec![root().join("README.md")];
    let mut pages: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("docs/ exists")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    pages.sort();
    v.extend(pages);
    v
}

/// Fenced code blocks of `text`: `(language, body)`.
fn blocks(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut lines = text.lines();
    while let Some(l) = lines.next() {
        let Some(lang) = l.trim_start().strip_prefix("```") else {
            continue;
        };
        let mut body = String::new();
        for b in lines.by_ref() {
            if b.trim_start().starts_with("```") {
                break;
            }
            body.push_str(b);
            body.push('\n');
        }
        out.push((lang.trim().to_string(), body));
    }
    out
}

/// The text outside fenced code blocks and inline code (links there are examples, not links).
fn prose(text: &str) -> String {
    let mut out = String::new();
    let mut fenced = false;
    for l in text.lines() {
        if l.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            // Inline code spans dropped.
            let mut inside = false;
            for c in l.chars() {
                if c == '`' {
                    inside = !inside;
                } else if !inside {
                    out.push(c);
                }
            }
            out.push('\n');
        }
    }
    out
}

/// Markdown link targets `](target)` in `text`.
fn links(text: &str) -> Vec<String> {
    let mut v = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("](") {
        let after = &rest[i + 2..];
        let Some(j) = after.find(')') else { break };
        v.push(after[..j].to_string());
        rest = &after[j..];
    }
    v
}

#[test]
fn every_relative_link_resolves() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for doc in documents() {
        let text = std::fs::read_to_string(&doc).unwrap();
        let dir = doc.parent().unwrap();
        for target in links(&prose(&text)) {
            if target.contains("://") || target.starts_with('#') || target.starts_with("mailto:") {
                continue;
            }
            let path = target.split('#').next().unwrap_or_default();
            if path.is_empty() {
                continue;
            }
            checked += 1;
            if !dir.join(path).exists() {
                broken.push(format!("{}: {target}", doc.display()));
            }
        }
    }
    assert!(checked > 10, "only {checked} relative links found");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// The flags `molt-run ARGS --help` lists, `None` when `ARGS` is not a command.
fn help_flags(args: &[&str]) -> Option<BTreeSet<String>> {
    let out = Command::new(common::molt_run())
        .args(args)
        .arg("--help")
        .env("COLUMNS", "200")
        .env_remove("MOLT_LADDER")
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    Some(
        text.split(|c: char| c.is_whitespace() || matches!(c, ',' | '[' | ']' | '=' | '<'))
            .filter(|w| w.starts_with("--") && w.len() > 2)
            .map(|w| {
                w.trim_end_matches(|c: char| !c.is_alphanumeric())
                    .to_string()
            })
            .collect(),
    )
}

/// Shell words of one command line (the documents' own simple quoting).
fn words(line: &str) -> Vec<String> {
    let mut v = Vec::new();
    let mut cur = String::new();
    let mut quote: Option<char> = None;
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => cur.push(c),
            (None, '\'' | '"') => quote = Some(c),
            (None, c) if c.is_whitespace() => {
                if !cur.is_empty() {
                    v.push(std::mem::take(&mut cur));
                }
            }
            (None, c) => cur.push(c),
        }
    }
    if !cur.is_empty() {
        v.push(cur);
    }
    v
}

/// Checks `molt-run …`: its subcommand exists and every `--flag` is one it (or the global
/// options) takes.
fn check_molt_run(words: &[String], doc: &Path, line: &str, problems: &mut Vec<String>) {
    let globals = help_flags(&[]).expect("molt-run --help");
    // Global options before the subcommand take a value.
    let mut i = 1;
    while i < words.len() && words[i].starts_with("--") {
        i += if words[i].contains('=') { 1 } else { 2 };
    }
    let mut path: Vec<&str> = Vec::new();
    while i < words.len() && !words[i].starts_with('-') && path.len() < 2 {
        let w = words[i].as_str();
        if w.contains('/') || w.contains('.') || w.contains('"') {
            break;
        }
        let mut probe = path.clone();
        probe.push(w);
        if help_flags(&probe).is_none() {
            if path.is_empty() {
                problems.push(format!(
                    "{}: `{line}`: `molt-run {w}` is not a command",
                    doc.display()
                ));
                return;
            }
            break;
        }
        path.push(w);
        i += 1;
    }
    let mut flags = help_flags(&path).unwrap_or_default();
    flags.extend(globals);
    for w in &words[1..] {
        let Some(f) = w.strip_prefix("--") else {
            continue;
        };
        let flag = format!("--{}", f.split('=').next().unwrap_or(f));
        if !flags.contains(&flag) {
            problems.push(format!(
                "{}: `{line}`: `molt-run {}` has no {flag}",
                doc.display(),
                path.join(" ")
            ));
        }
    }
}

#[test]
fn every_shell_command_in_the_documents_exists() {
    let members = [
        "molt",
        "molt-run",
        "molt-server",
        "molt-bench",
        "molt-testkit",
    ];
    let mut problems = Vec::new();
    let mut checked = 0;
    for doc in documents() {
        let text = std::fs::read_to_string(&doc).unwrap();
        for (lang, body) in blocks(&text) {
            if lang != "sh" {
                continue;
            }
            for raw in body.lines() {
                let line = raw
                    .split(" # ")
                    .next()
                    .unwrap_or(raw)
                    .trim()
                    .trim_end_matches('\\')
                    .trim();
                if line.is_empty() || line.starts_with('#') {
                    continue;
                }
                let mut w = words(line);
                // Environment assignments before the program.
                while w
                    .first()
                    .is_some_and(|x| x.contains('=') && !x.starts_with('-'))
                {
                    w.remove(0);
                }
                let Some(program) = w.first().cloned() else {
                    continue;
                };
                if program.starts_with('-') || program.starts_with('"') {
                    // A continuation line of the command above.
                    continue;
                }
                checked += 1;
                if program == "molt-run" || program.ends_with("/molt-run") {
                    check_molt_run(&w, &doc, line, &mut problems);
                } else if program.starts_with("scripts/")
                    || program.starts_with("./scripts/")
                    || program.starts_with(".ci/")
                {
                    if !root().join(program.trim_start_matches("./")).exists() {
                        problems.push(format!("{}: `{line}`: no {program}", doc.display()));
                    }
                } else if program == "cargo" {
                    for pair in w.windows(2) {
                        let (flag, value) = (pair[0].as_str(), pair[1].as_str());
                        let missing = match flag {
                            "--example" => {
                                !root().join("examples").join(format!("{value}.rs")).exists()
                            }
                            "-p" | "--package" => !members.contains(&value),
                            "--path" => !root().join(value).exists(),
                            "--test" => !root().join("tests").join(format!("{value}.rs")).exists(),
                            _ => false,
                        };
                        if missing {
                            problems.push(format!(
                                "{}: `{line}`: {flag} {value} does not exist",
                                doc.display()
                            ));
                        }
                    }
                }
            }
        }
    }
    assert!(checked > 10, "only {checked} shell commands found");
    assert!(
        problems.is_empty(),
        "commands that do not exist:\n{}",
        problems.join("\n")
    );
}
