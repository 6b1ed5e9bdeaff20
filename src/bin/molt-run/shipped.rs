//! Projectors built into the binary, so an installed `molt-run` migrates without a checkout.
//!
//! `build.rs` embeds every `projectors/<ladder>/*.{dense,diagonal}.molt-proj` present when the
//! binary was built (the variants a session uses by default; the ablations stay on disk). They
//! are the **last** place a projector is looked for: `--projectors DIR`, `$MOLT_HOME/projectors`,
//! `./projectors` and the per-user data directory all come first, so a freshly fitted file on
//! disk always wins over the copy compiled in. Nothing is written anywhere: an embedded
//! projector is decoded and handed to the session's routes in memory.
//!
//! Embedding was chosen over "`fetch` copies the repository's projectors to the per-user
//! directory" because an installed binary does not know where (or whether) its checkout still
//! is; the cost is the size of the shipped maps in the binary (a few MiB at f16).

use molt::routes::Variant;
use molt::routes::{self, binding, file_name, route_kind};
use molt::session::{Session, Strategy};
use molt::transplant::anchor::{Anchor, file_name as anchor_file_name};
use molt::transplant::projector::Projector;
use std::path::Path;

include!(concat!(env!("OUT_DIR"), "/shipped_projectors.rs"));

/// What [`install`] did, for one line of output.
#[derive(Debug, Default)]
pub struct Installed {
    /// Routes served from the binary, e.g. `tier0 -> tier2`.
    pub embedded: Vec<String>,
    /// Embedded files that do not belong to these rung files (other sha256), with why.
    pub refused: Vec<String>,
}

/// The embedded files of `ladder`.
pub fn files_of(ladder: &str) -> impl Iterator<Item = (&'static str, &'static [u8])> + '_ {
    SHIPPED
        .iter()
        .filter(move |(l, _, _)| *l == ladder)
        .map(|(_, f, b)| (*f, *b))
}

/// Gives the session every embedded projector of its ladder whose route has no file in the
/// session's projector directories. Only for the default variant and the Molt strategy (the
/// other variants and strategies never read these files).
pub fn install(session: &mut Session) -> Installed {
    let mut done = Installed::default();
    let opts = session.options();
    if opts.variant != Variant::Auto || opts.strategy != Strategy::Molt {
        return done;
    }
    let dirs = opts.projector_dirs.clone();
    let ladder = session.ladder().name().to_string();
    let bindings: Vec<_> = session.ladder().rungs.iter().map(binding).collect();
    for (i, src) in bindings.iter().enumerate() {
        for (j, dst) in bindings.iter().enumerate() {
            if i == j {
                continue;
            }
            let file = file_name(
                &src.name,
                &dst.name,
                Variant::Auto.tag(route_kind(src, dst)),
            );
            if dirs.iter().any(|d| d.join(&ladder).join(&file).exists()) {
                continue;
            }
            let Some((_, bytes)) = files_of(&ladder).find(|(f, _)| *f == file) else {
                continue;
            };
            let label = Path::new("<built-in>").join(&ladder).join(&file);
            let decoded = Projector::from_bytes(bytes, &label).and_then(|p| {
                p.check_binding(&label, &src.sha256, &dst.sha256)?;
                Ok(p)
            });
            match decoded {
                Ok(p) => {
                    session.routes_mut().insert(i, j, p);
                    done.embedded.push(format!("{} -> {}", src.name, dst.name));
                }
                Err(e) => done.refused.push(e.to_string()),
            }
        }
    }
    // Anchors (each rung's own cache of the template's opening), likewise after the disk.
    for (i, rung) in bindings.iter().enumerate() {
        if routes::anchor_path(&dirs, &ladder, &rung.name).is_some() {
            continue;
        }
        let file = anchor_file_name(&rung.name);
        let Some((_, _, bytes)) = SHIPPED_ANCHORS
            .iter()
            .find(|(l, f, _)| *l == ladder && *f == file)
        else {
            continue;
        };
        let label = Path::new("<built-in>")
            .join(&ladder)
            .join("anchors")
            .join(&file);
        match Anchor::from_bytes(bytes, label, &rung.sha256) {
            Ok(a) => {
                session.routes_mut().insert_anchor(i, Some(a));
                done.embedded.push(format!("anchor of {}", rung.name));
            }
            Err(e) => done.refused.push(e.to_string()),
        }
    }
    done
}

/// The documented search order, for messages: the directories, then the binary itself.
pub fn search_order(explicit: Option<&Path>) -> String {
    let mut v: Vec<String> = routes::search_dirs(explicit)
        .iter()
        .map(|d| d.display().to_string())
        .collect();
    v.push("built into molt-run".to_string());
    v.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The embedded list is exactly the shipped files of the source tree at build time, byte for
    /// byte (a stale or partial embedding would silently migrate with old maps).
    #[test]
    fn embedded_projectors_match_the_source_tree() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("projectors");
        let mut on_disk = Vec::new();
        for ladder in std::fs::read_dir(&root).into_iter().flatten().flatten() {
            if !ladder.path().is_dir() {
                continue;
            }
            for f in std::fs::read_dir(ladder.path()).unwrap().flatten() {
                let name = f.file_name().to_string_lossy().into_owned();
                if name.ends_with(".dense.molt-proj") || name.ends_with(".diagonal.molt-proj") {
                    let l = ladder.file_name().to_string_lossy().into_owned();
                    on_disk.push((l, name, std::fs::read(f.path()).unwrap()));
                }
            }
        }
        on_disk.sort();
        let embedded: Vec<_> = SHIPPED
            .iter()
            .map(|(l, f, b)| (l.to_string(), f.to_string(), b.to_vec()))
            .collect();
        assert_eq!(embedded.len(), on_disk.len());
        assert!(
            embedded == on_disk,
            "embedded projectors differ from projectors/"
        );
        for (_, f, b) in &embedded {
            Projector::from_bytes(b, Path::new(f)).expect("embedded projector decodes");
        }
    }

    /// The same for the anchors under `projectors/<ladder>/anchors/`.
    #[test]
    fn embedded_anchors_match_the_source_tree() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("projectors");
        let mut on_disk = Vec::new();
        for ladder in std::fs::read_dir(&root).into_iter().flatten().flatten() {
            let dir = ladder.path().join("anchors");
            for f in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                let name = f.file_name().to_string_lossy().into_owned();
                if name.ends_with(".molt-anchor") {
                    let l = ladder.file_name().to_string_lossy().into_owned();
                    on_disk.push((l, name, std::fs::read(f.path()).unwrap()));
                }
            }
        }
        on_disk.sort();
        let embedded: Vec<_> = SHIPPED_ANCHORS
            .iter()
            .map(|(l, f, b)| (l.to_string(), f.to_string(), b.to_vec()))
            .collect();
        assert!(
            embedded == on_disk,
            "embedded anchors differ from projectors/"
        );
    }
}
