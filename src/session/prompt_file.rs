//! Prompt files (`generate --prompt-file`): one prompt per line, plain text or a JSON object
//! `{"prompt": "...", "id": ..., "max_tokens": N}`; blank lines and `#` comments are skipped.
//!
//! [`parse`] is a pure function of the file's bytes, so the same code is what `generate` runs
//! and what the fuzz target and its CI smoke feed hostile bytes to. A bad line never fails the
//! file: it comes back in [`PromptFile::bad`] with its number and why, and the others still run.

/// One prompt of a prompt file.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptItem {
    /// 1-based line number in the file.
    pub line: usize,
    /// The line's `id`, or its line number when it gives none.
    pub id: serde_json::Value,
    /// The prompt text (a user turn).
    pub prompt: String,
    /// The line's own token limit, if it sets one (at least 1).
    pub max_tokens: Option<usize>,
}

/// A line that is not a prompt: its 1-based number and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadLine {
    /// 1-based line number.
    pub line: usize,
    /// Why it was skipped.
    pub why: String,
}

/// A parsed prompt file: the prompts in file order and the lines that were refused.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PromptFile {
    /// The prompts.
    pub items: Vec<PromptItem>,
    /// The refused lines.
    pub bad: Vec<BadLine>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonPrompt {
    prompt: String,
    #[serde(default)]
    id: Option<serde_json::Value>,
    #[serde(default)]
    max_tokens: Option<usize>,
}

/// Parses a prompt file's bytes.
///
/// Lines are split as bytes and decoded one by one, so a line that is not UTF-8 is reported by
/// number like any other bad line and the others still run.
#[must_use]
pub fn parse(bytes: &[u8]) -> PromptFile {
    let mut out = PromptFile::default();
    let mut refuse = |line, why: String| out.bad.push(BadLine { line, why });
    let mut items = Vec::new();
    let body = bytes.strip_suffix(b"\n").unwrap_or(bytes);
    for (i, raw) in body.split(|&b| b == b'\n').enumerate() {
        let line = i + 1;
        let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
        let t = match std::str::from_utf8(raw) {
            Ok(t) => t.trim(),
            Err(e) => {
                refuse(
                    line,
                    format!("not valid UTF-8 (at byte {} of the line)", e.valid_up_to()),
                );
                continue;
            }
        };
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        if t.starts_with('{') {
            match serde_json::from_str::<JsonPrompt>(t) {
                Ok(j) if j.max_tokens == Some(0) => {
                    refuse(line, "\"max_tokens\" must be at least 1".to_string());
                }
                Ok(j) if !j.prompt.trim().is_empty() => items.push(PromptItem {
                    line,
                    id: j.id.unwrap_or(serde_json::json!(line)),
                    prompt: j.prompt,
                    max_tokens: j.max_tokens,
                }),
                Ok(_) => refuse(line, "empty \"prompt\"".to_string()),
                Err(e) => refuse(line, format!("not a valid JSON prompt object: {e}")),
            }
        } else {
            items.push(PromptItem {
                line,
                id: serde_json::json!(line),
                prompt: t.to_string(),
                max_tokens: None,
            });
        }
    }
    out.items = items;
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_lines_are_numbered_and_the_rest_run() {
        let f = parse(b"hello\n\n# note\n{\"prompt\": \"x\", \"max_tokens\": 0}\n\xff\xfe\n{\"prompt\": \"y\", \"id\": \"a\"}\r\n");
        assert_eq!(
            f.items
                .iter()
                .map(|i| (i.line, i.prompt.as_str()))
                .collect::<Vec<_>>(),
            vec![(1, "hello"), (6, "y")]
        );
        assert_eq!(f.items[1].id, serde_json::json!("a"));
        assert_eq!(f.bad.iter().map(|b| b.line).collect::<Vec<_>>(), vec![4, 5]);
    }
}
