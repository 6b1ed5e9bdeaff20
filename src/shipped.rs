//! Projectors and anchors compiled into the library, so an embedded engine (and an installed
//! `molt-run`) switches with its maps without a checkout.
//!
//! `build.rs` embeds every `projectors/<ladder>/*.{dense,diagonal}.molt-proj` present when the
//! crate was built (the variants a session uses by default; the ablations stay on disk) and
//! every anchor, with the default feature `shipped-projectors`. They are the **last** place a
//! projector is looked for: an explicit directory, `$MOLT_HOME/projectors`, `./projectors` and
//! the per-user data directory all come first, so a freshly fitted file on disk always wins
//! over the copy compiled in. Nothing is written anywhere: an embedded projector is decoded and
//! handed to the routes in memory ([`install`], called by every [`Routes`] a session builds).
//!
//! Embedding was chosen over "`fetch` copies the repository's projectors to the per-user
//! directory" because an installed program does not know where (or whether) its checkout still
//! is; the cost is the size of the shipped maps in the library (a few MiB at f16).

use crate::ladder::Ladder;
use crate::routes::{self, Routes, Variant, binding, file_name, route_kind};
use crate::transplant::anchor::{Anchor, file_name as anchor_file_name};
use crate::transplant::projector::Projector;
use std::path::{Path, PathBuf};

#[cfg(feature = "shipped-projectors")]
include!(concat!(env!("OUT_DIR"), "/shipped_projectors.rs"));

/// Shipped projectors embedded at build time: none without the `shipped-projectors` feature.
#[cfg(not(feature = "shipped-projectors"))]
pub static SHIPPED: &[(&str, &str, &[u8])] = &[];
/// Shipped anchors embedded at build time: none without the `shipped-projectors` feature.
#[cfg(not(feature = "shipped-projectors"))]
pub static SHIPPED_ANCHORS: &[(&str, &str, &[u8])] = &[];

/// What [`install`] did, for one line of output.
#[derive(Debug, Default, Clone)]
pub struct Installed {
    /// Routes served from the library, e.g. `tier0 -> tier2`, and anchors (`anchor of tier2`).
    pub embedded: Vec<String>,
    /// Embedded files that do not belong to these rung files (other sha256), with why.
    pub refused: Vec<String>,
}

/// The embedded projector files of `ladder`.
pub fn files_of(ladder: &str) -> impl Iterator<Item = (&'static str, &'static [u8])> + '_ {
    SHIPPED
        .iter()
        .filter(move |(l, _, _)| *l == ladder)
        .map(|(_, f, b)| (*f, *b))
}

/// Gives `routes` every embedded projector of `ladder` whose route has no file in `dirs`, and
/// every embedded anchor likewise. Only for the default variant (the ablation variants never
/// read these files). A file bound to other rung files (another sha256) is refused, named in
/// [`Installed::refused`], and the route stays without a map.
pub fn install(routes: &mut Routes, ladder: &Ladder, dirs: &[PathBuf]) -> Installed {
    let mut done = Installed::default();
    if routes.variant() != Variant::Auto {
        return done;
    }
    let name = ladder.name().to_string();
    let bindings: Vec<_> = ladder.rungs.iter().map(binding).collect();
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
            if dirs.iter().any(|d| d.join(&name).join(&file).exists()) {
                continue;
            }
            let Some((_, bytes)) = files_of(&name).find(|(f, _)| *f == file) else {
                continue;
            };
            let label = Path::new("<built-in>").join(&name).join(&file);
            let decoded = Projector::from_bytes(bytes, &label).and_then(|p| {
                p.check_binding(&label, &src.sha256, &dst.sha256)?;
                Ok(p)
            });
            match decoded {
                Ok(p) => {
                    routes.insert(i, j, p);
                    done.embedded.push(format!("{} -> {}", src.name, dst.name));
                }
                Err(e) => done.refused.push(e.to_string()),
            }
        }
    }
    for (i, rung) in bindings.iter().enumerate() {
        if routes::anchor_path(dirs, &name, &rung.name).is_some() {
            continue;
        }
        let file = anchor_file_name(&rung.name);
        let Some((_, _, bytes)) = SHIPPED_ANCHORS
            .iter()
            .find(|(l, f, _)| *l == name && *f == file)
        else {
            continue;
        };
        let label = Path::new("<built-in>")
            .join(&name)
            .join("anchors")
            .join(&file);
        match Anchor::from_bytes(bytes, label, &rung.sha256) {
            Ok(a) => {
                routes.insert_anchor(i, Some(a));
                done.embedded.push(format!("anchor of {}", rung.name));
            }
            Err(e) => done.refused.push(e.to_string()),
        }
    }
    done
}

/// The documented search order, for messages: the directories, then the library itself.
#[must_use]
pub fn search_order(explicit: Option<&Path>) -> String {
    let mut v: Vec<String> = routes::search_dirs(explicit)
        .iter()
        .map(|d| d.display().to_string())
        .collect();
    if cfg!(feature = "shipped-projectors") {
        v.push("built into the library".to_string());
    }
    v.join(", ")
}

#[cfg(all(test, feature = "shipped-projectors"))]
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
