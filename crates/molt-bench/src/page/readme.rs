//! The generated blocks of the top README, which `molt-run figures` refreshes:
//!
//! - the headline table between [`HEADLINE_BEGIN`] and [`HEADLINE_END`], rendered by
//!   [`super::headline::headline`] from the JSON under `results/`;
//! - every `<!-- include: PATH -->` … [`INCLUDE_END`] block, holding the file at `PATH`
//!   (relative to the repository root) as a fenced code block, so the README's code is the
//!   file itself.

use std::path::{Component, Path};

use super::headline::{Headline, headline};

/// Opens the headline table.
pub const HEADLINE_BEGIN: &str = "<!-- results: headline -->";
/// Closes it.
pub const HEADLINE_END: &str = "<!-- end results -->";
/// Opens an include block; the path follows, then ` -->`.
pub const INCLUDE_BEGIN: &str = "<!-- include:";
/// Closes an include block.
pub const INCLUDE_END: &str = "<!-- end include -->";

/// `text` with what lies between `begin` and the first `end` after it replaced by `body` (on
/// lines of its own); `None` when `text` has no `begin` (nothing to update).
///
/// # Errors
/// A `begin` without an `end` after it, or more than one `begin`.
pub fn splice(text: &str, begin: &str, end: &str, body: &str) -> Result<Option<String>, String> {
    let Some(b) = text.find(begin) else {
        return Ok(None);
    };
    let from = b + begin.len();
    if text[from..].contains(begin) {
        return Err(format!("more than one {begin:?} marker"));
    }
    let e = text[from..]
        .find(end)
        .map(|i| from + i)
        .ok_or_else(|| format!("{begin:?} has no {end:?} after it"))?;
    Ok(Some(format!(
        "{}\n{}\n{}",
        &text[..from],
        body.trim(),
        &text[e..]
    )))
}

/// The file's text as a fenced code block: the fence longer than any run of backticks inside,
/// the language from the extension (`rs` is `rust`).
fn fenced(path: &str, code: &str) -> String {
    let longest = code.split(|c| c != '`').map(str::len).max().unwrap_or(0);
    let fence = "`".repeat(longest.max(2) + 1);
    let lang = match Path::new(path).extension().and_then(|e| e.to_str()) {
        Some("rs") => "rust",
        Some(other) => other,
        None => "",
    };
    format!("{fence}{lang}\n{}\n{fence}", code.trim_end())
}

/// `text` with every include block holding its file, read under `root`; the paths included,
/// in order.
///
/// # Errors
/// A block without its end, a path that is absolute or leaves `root`, or a file that cannot
/// be read.
pub fn refresh_includes(text: &str, root: &Path) -> Result<(String, Vec<String>), String> {
    let mut out = String::with_capacity(text.len());
    let mut paths = Vec::new();
    let mut rest = text;
    while let Some(b) = rest.find(INCLUDE_BEGIN) {
        let after = &rest[b + INCLUDE_BEGIN.len()..];
        let close = after
            .find("-->")
            .ok_or_else(|| format!("{INCLUDE_BEGIN:?} is not closed by \"-->\""))?;
        let path = after[..close].trim();
        let body = &after[close + 3..];
        let e = body
            .find(INCLUDE_END)
            .ok_or_else(|| format!("include of {path:?} has no {INCLUDE_END:?} after it"))?;
        if body[..e].contains(INCLUDE_BEGIN) {
            return Err(format!(
                "include of {path:?} holds another include before its end"
            ));
        }
        let inside = Path::new(path)
            .components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
        if path.is_empty() || !inside {
            return Err(format!(
                "include path {path:?} is not a path inside the repository"
            ));
        }
        let code = std::fs::read_to_string(root.join(path))
            .map_err(|e| format!("include of {path:?}: {e}"))?;
        out.push_str(&rest[..b + INCLUDE_BEGIN.len() + close + 3]);
        out.push('\n');
        out.push_str(&fenced(path, &code));
        out.push('\n');
        out.push_str(INCLUDE_END);
        paths.push(path.to_string());
        rest = &body[e + INCLUDE_END.len()..];
    }
    out.push_str(rest);
    Ok((out, paths))
}

/// What [`refresh`] made of a README.
#[derive(Debug, Clone)]
pub struct Refreshed {
    /// The README's new text.
    pub text: String,
    /// The headline table, when the README has its markers (`None`: no block to fill).
    pub headline: Option<Headline>,
    /// The files included, in order.
    pub includes: Vec<String>,
}

/// The top README `readme` with its headline table rendered from `results` and its include
/// blocks read under `root` (the repository root).
///
/// # Errors
/// Markers that do not pair up, or an include that cannot be read (see [`splice`] and
/// [`refresh_includes`]).
pub fn refresh(readme: &str, root: &Path, results: &Path) -> Result<Refreshed, String> {
    let (text, headline) = if readme.contains(HEADLINE_BEGIN) {
        let h = headline(results);
        let text = splice(readme, HEADLINE_BEGIN, HEADLINE_END, &h.markdown)?
            .unwrap_or_else(|| readme.to_string());
        (text, Some(h))
    } else {
        (readme.to_string(), None)
    };
    let (text, includes) = refresh_includes(&text, root)?;
    Ok(Refreshed {
        text,
        headline,
        includes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_is_replaced_between_its_markers() {
        let (b, e) = (HEADLINE_BEGIN, HEADLINE_END);
        let r = format!("intro\n{b}\nold table\n{e}\nrest\n");
        let out = splice(&r, b, e, "\n| a |\n").unwrap().unwrap();
        assert_eq!(out, format!("intro\n{b}\n| a |\n{e}\nrest\n"));
        // Idempotent: splicing the same block again changes nothing.
        assert_eq!(splice(&out, b, e, "| a |").unwrap().unwrap(), out);
        assert_eq!(splice("no markers", b, e, "x").unwrap(), None);
        assert!(splice(&format!("{b} no end"), b, e, "x").is_err());
        assert!(splice(&format!("{b}{e}{b}{e}"), b, e, "x").is_err());
    }

    #[test]
    fn include_blocks_hold_their_files_fenced() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("examples")).unwrap();
        std::fs::write(dir.path().join("examples/a.rs"), "fn main() {}\n\n").unwrap();
        std::fs::write(dir.path().join("b.md"), "text with ```code``` in it\n").unwrap();
        let readme = format!(
            "top\n{INCLUDE_BEGIN} examples/a.rs -->\nstale\n{INCLUDE_END}\nmid\n{INCLUDE_BEGIN} b.md -->{INCLUDE_END}\nend\n"
        );
        let (out, paths) = refresh_includes(&readme, dir.path()).unwrap();
        assert_eq!(
            out,
            format!(
                "top\n{INCLUDE_BEGIN} examples/a.rs -->\n```rust\nfn main() {{}}\n```\n{INCLUDE_END}\nmid\n{INCLUDE_BEGIN} b.md -->\n````md\ntext with ```code``` in it\n````\n{INCLUDE_END}\nend\n"
            )
        );
        assert_eq!(paths, ["examples/a.rs", "b.md"]);
        assert_eq!(refresh_includes(&out, dir.path()).unwrap().0, out);
        for bad in [
            format!("{INCLUDE_BEGIN} examples/a.rs -->\nno end\n"),
            format!("{INCLUDE_BEGIN} missing.rs -->{INCLUDE_END}"),
            format!("{INCLUDE_BEGIN} ../a.rs -->{INCLUDE_END}"),
            format!("{INCLUDE_BEGIN} /etc/hostname -->{INCLUDE_END}"),
        ] {
            assert!(refresh_includes(&bad, dir.path()).is_err(), "{bad}");
        }
    }

    /// The committed README's generated blocks are what `molt-run figures` writes from the
    /// committed files: a table that disagrees with `results/`, or an embedding example that is
    /// not `examples/`' own, fails here.
    #[test]
    fn the_committed_readme_holds_what_the_committed_files_generate() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
        let results = root.join("results");
        let h = headline(&results);
        assert!(h.left_out.is_empty(), "rows left out: {:?}", h.left_out);
        let from = readme.find(HEADLINE_BEGIN).expect("the headline marker") + HEADLINE_BEGIN.len();
        let to = from + readme[from..].find(HEADLINE_END).expect("the headline end");
        assert_eq!(
            readme[from..to].trim(),
            h.markdown.trim(),
            "README.md's headline table is stale: run `molt-run figures`"
        );
        let r = refresh(&readme, &root, &results).unwrap();
        assert!(
            r.includes.iter().any(|p| p == "examples/stream.rs"),
            "{:?}",
            r.includes
        );
        assert!(
            r.text == readme,
            "README.md's generated blocks are stale: run `molt-run figures`"
        );
    }
}
