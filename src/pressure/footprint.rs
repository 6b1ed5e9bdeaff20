//! Measured memory footprint: what Molt actually occupies, never a guess from file sizes.
//!
//! - [`process_rss_bytes`] / [`process_pss_bytes`]: the whole process (`VmRSS` from
//!   `/proc/self/status`; `Pss` from `/proc/self/smaps_rollup`, which splits shared pages
//!   among the processes mapping them — the fair number when two processes map one GGUF).
//! - [`resident_bytes_of_mapping`]: the resident pages of one memory-mapped file in this
//!   process (sum of `Rss` over the `/proc/self/smaps` entries naming it) — how much of a
//!   mapped GGUF's weights are really in memory, which for an mmap-backed rung is often far
//!   less than the file size.
//! - [`mincore_resident_bytes`] / [`file_resident_in_page_cache`]: page residency via
//!   `mincore(2)`, for a mapping this process holds, or for a file's pages in the page cache
//!   whether or not anyone maps them (what a parked rung would cost to resume).
//! - [`Footprint`]: the serialisable breakdown the session reports per rung.

use std::fs::File;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::PressureError;
use super::procfile;

/// One rung's footprint: `total = weights_resident + kv_bytes + compute_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Footprint {
    /// Resident bytes of the mapped weights file.
    pub weights_resident: u64,
    /// Bytes of the KV cache (context tokens × bytes per token).
    pub kv_bytes: u64,
    /// Bytes of the compute buffers.
    pub compute_bytes: u64,
    /// Sum of the three (saturating).
    pub total: u64,
}

impl Footprint {
    /// Builds a footprint and its total.
    #[must_use]
    pub fn new(weights_resident: u64, kv_bytes: u64, compute_bytes: u64) -> Footprint {
        Footprint {
            weights_resident,
            kv_bytes,
            compute_bytes,
            total: weights_resident
                .saturating_add(kv_bytes)
                .saturating_add(compute_bytes),
        }
    }
}

/// Resident set of this process (`VmRSS`), in bytes.
///
/// # Errors
///
/// [`PressureError::Io`] if `/proc/self/status` cannot be read, [`PressureError::Parse`] if
/// it has no `VmRSS`.
pub fn process_rss_bytes() -> Result<u64, PressureError> {
    rss_bytes_in(Path::new("/proc/self/status"))
}

/// Peak resident set of this process (`VmHWM`) since it started or since the last
/// [`reset_peak_rss`], in bytes — the transient a sampled RSS misses (two rungs mapped at once
/// during a switch).
///
/// # Errors
///
/// As [`process_rss_bytes`] (`VmHWM` missing is a parse error).
pub fn process_peak_rss_bytes() -> Result<u64, PressureError> {
    let path = Path::new("/proc/self/status");
    procfile::kib_field_bytes(&procfile::read(path)?, "VmHWM").ok_or(PressureError::Parse {
        path: path.to_path_buf(),
        what: "VmHWM",
    })
}

/// Resets [`process_peak_rss_bytes`] to the current RSS (writes `5` to
/// `/proc/self/clear_refs`, Linux ≥ 4.0). Best effort: returns whether it worked.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Anonymous resident memory of this process (`RssAnon`): heap, KV caches, compute buffers —
/// everything but mapped files. A context's own cost is the change of this number.
///
/// # Errors
///
/// As [`process_rss_bytes`] (`RssAnon` missing is a parse error).
pub fn process_anon_rss_bytes() -> Result<u64, PressureError> {
    let path = Path::new("/proc/self/status");
    procfile::kib_field_bytes(&procfile::read(path)?, "RssAnon").ok_or(PressureError::Parse {
        path: path.to_path_buf(),
        what: "RssAnon",
    })
}

/// Resident set (`VmRSS`) from a `status` file — `/proc/<pid>/status` of another process,
/// e.g. the hog.
///
/// # Errors
///
/// As [`process_rss_bytes`].
pub fn rss_bytes_in(status: &Path) -> Result<u64, PressureError> {
    procfile::kib_field_bytes(&procfile::read(status)?, "VmRSS").ok_or(PressureError::Parse {
        path: status.to_path_buf(),
        what: "VmRSS",
    })
}

/// Proportional set size of this process (`Pss` in `/proc/self/smaps_rollup`), in bytes.
///
/// # Errors
///
/// [`PressureError::Io`] if the file cannot be read (kernels before 4.14 lack it),
/// [`PressureError::Parse`] if it has no `Pss`.
pub fn process_pss_bytes() -> Result<u64, PressureError> {
    let path = Path::new("/proc/self/smaps_rollup");
    procfile::sum_kib_fields_bytes(&procfile::read(path)?, "Pss").ok_or(PressureError::Parse {
        path: path.to_path_buf(),
        what: "Pss",
    })
}

/// Resident bytes of `file` as mapped by this process: the sum of `Rss` over every
/// `/proc/self/smaps` entry whose pathname is `file` (canonicalised, so a symlink or a
/// relative path names the same mapping). 0 when the file is not mapped.
///
/// # Errors
///
/// [`PressureError::Io`] when `file` cannot be canonicalised or `/proc/self/smaps` cannot be
/// read.
pub fn resident_bytes_of_mapping(file: &Path) -> Result<u64, PressureError> {
    mapping_bytes(file, "Rss:")
}

/// The `key` bytes of every mapping of `file` in this process, from one read of
/// `/proc/self/smaps` (`file` canonicalised).
fn mapping_bytes(file: &Path, key: &str) -> Result<u64, PressureError> {
    let canonical = std::fs::canonicalize(file).map_err(|source| PressureError::Io {
        path: file.to_path_buf(),
        source,
    })?;
    let smaps = procfile::read(Path::new("/proc/self/smaps"))?;
    Ok(smaps_sum_of(&smaps, &canonical, key))
}

/// [`resident_bytes_of_mapping`] summed over several files from one read of
/// `/proc/self/smaps` (each read walks every mapping's page tables, which costs tens of ms
/// on a loaded machine once a rung's weights are mapped). Files that cannot be
/// canonicalised count 0.
///
/// # Errors
/// [`PressureError::Io`] when `/proc/self/smaps` cannot be read.
pub fn resident_bytes_of_mappings(files: &[&Path]) -> Result<u64, PressureError> {
    if files.is_empty() {
        return Ok(0);
    }
    let smaps = procfile::read(Path::new("/proc/self/smaps"))?;
    Ok(files
        .iter()
        .filter_map(|f| std::fs::canonicalize(f).ok())
        .map(|c| smaps_rss_of(&smaps, &c))
        .sum())
}

/// Sums `Rss` over the entries of an `smaps` text whose pathname equals `file`.
pub(crate) fn smaps_rss_of(smaps: &str, file: &Path) -> u64 {
    smaps_sum_of(smaps, file, "Rss:")
}

/// The `key` (`Rss:`, `FilePmdMapped:`, …) bytes of every mapping of `file` in an smaps text.
pub(crate) fn smaps_sum_of(smaps: &str, file: &Path, key: &str) -> u64 {
    let Some(wanted) = file.to_str() else {
        return 0;
    };
    let mut in_entry = false;
    let mut total = 0u64;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.ends_with(':') {
            if in_entry
                && let Some(rest) = line.strip_prefix(key)
                && let Some(kib) = rest
                    .split_whitespace()
                    .next()
                    .and_then(|n| n.parse::<u64>().ok())
            {
                total = total.saturating_add(kib.saturating_mul(1024));
            }
        } else if !first.is_empty() {
            let path = mapping_pathname(line);
            in_entry = path == wanted || path.strip_suffix(" (deleted)") == Some(wanted);
        }
    }
    total
}

/// Of this process's mappings of `file`, the bytes mapped a whole 2 MiB folio per page-table
/// entry (`FilePmdMapped` in `/proc/self/smaps`; see
/// [`super::pages::settle_huge_folios`]).
///
/// # Errors
/// [`PressureError::Io`] if the path or `/proc/self/smaps` cannot be read.
pub fn pmd_mapped_bytes_of_mapping(file: &Path) -> Result<u64, PressureError> {
    mapping_bytes(file, "FilePmdMapped:")
}

/// The pathname of an smaps header `start-end perms offset dev inode [pathname]`: everything
/// after the fifth field, so paths with spaces survive.
pub(crate) fn mapping_pathname(header: &str) -> &str {
    let mut rest = header;
    for _ in 0..5 {
        rest = rest.trim_start();
        match rest.find(char::is_whitespace) {
            Some(end) => rest = &rest[end..],
            None => return "",
        }
    }
    rest.trim()
}

/// Makes freed large buffers go back to the operating system at once, process-wide
/// (idempotent).
///
/// glibc serves allocations above `M_MMAP_THRESHOLD` with their own mappings, unmapped on
/// free — but by default the threshold *rises* to the size of each such block freed (up to
/// 32 MiB), after which blocks of that size come from the heap, where a free keeps the pages.
/// Parking drops a context's KV and compute buffers (tens to hundreds of MiB) and must give
/// them back, and a rung's measured cost is the change of `RssAnon` when it loads, which a
/// recycled heap block would hide. Setting the threshold explicitly (to glibc's own default,
/// 128 KiB) turns the adjustment off. Other C libraries return large blocks already.
///
/// It also keeps glibc to one heap arena. By default each thread that allocates while the
/// others' arenas are busy gets an arena of its own (up to eight per core), and a switch runs
/// three threads at once (the answer's, the reaper freeing the source, the one mapping the
/// destination back): every arena keeps its own free blocks, which `malloc_trim` cannot hand
/// back while a live block sits above them. Measured on the tiny ladder's 1,000-switch soak
/// (three runs each): with the default arenas the resident set wandered by 0.3-0.8 MiB and its
/// slope over the run came out anywhere from 0.0 to 1.06 KiB per switch (the last on CI, past
/// the soak's goal); with one arena, 0.13-0.16 KiB per switch and ~1 MiB less resident. Two
/// arenas: 0.14-0.92. The threads that allocate here do so a few times per switch, so the one
/// lock costs nothing measurable.
pub fn return_freed_buffers_to_os() {
    static DONE: std::sync::Once = std::sync::Once::new();
    DONE.call_once(|| {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: mallopt only changes allocator tuning; M_MMAP_THRESHOLD with a value below
        // the maximum is always accepted and affects only future allocations; M_ARENA_MAX
        // only limits how many arenas later threads may create.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
            libc::mallopt(libc::M_ARENA_MAX, 1);
        }
    });
}

/// Hands the heap's free pages back to the operating system (glibc `malloc_trim`; a no-op
/// elsewhere). A model's tokenizer tables are many small heap blocks; once the model is
/// dropped, their pages stay in the process unless trimmed, so a parked rung would still
/// show in RSS. Call after freeing a rung.
pub fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory of the allocator's own arenas; it has no
    // preconditions and is thread-safe.
    unsafe {
        libc::malloc_trim(0);
    }
}

pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions; it only reads a configuration value.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size)
        .ok()
        .filter(|&s| s > 0)
        .unwrap_or(4096)
}

/// Bytes of `region` whose pages are resident, page-granular: every page overlapping the
/// region that `mincore(2)` reports resident counts as a whole page. The region must lie in
/// memory this process has mapped (any `&[u8]` does).
///
/// # Errors
///
/// [`PressureError::Sys`] if `mincore` fails.
pub fn mincore_resident_bytes(region: &[u8]) -> Result<u64, PressureError> {
    if region.is_empty() {
        return Ok(0);
    }
    let page = page_size();
    let start = region.as_ptr() as usize;
    let aligned = start - start % page;
    let len = start - aligned + region.len();
    let pages = len.div_ceil(page);
    let mut vec = vec![0u8; pages];
    // SAFETY: [aligned, aligned + len) covers only pages overlapping `region`, which is
    // mapped for the lifetime of the borrow; `aligned` is page aligned as mincore requires;
    // `vec` holds one byte per page of that range. mincore reads no memory of the range.
    let rc = unsafe { libc::mincore(aligned as *mut libc::c_void, len, vec.as_mut_ptr()) };
    if rc != 0 {
        return Err(PressureError::Sys {
            call: "mincore",
            source: std::io::Error::last_os_error(),
        });
    }
    let resident = vec.iter().filter(|&&v| v & 1 == 1).count();
    Ok((resident as u64).saturating_mul(page as u64))
}

/// Page-cache residency of a whole file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageCacheResidency {
    /// File length in bytes.
    pub file_bytes: u64,
    /// Bytes of it in the page cache (page-granular, at most the file length rounded up).
    pub resident_bytes: u64,
}

/// How much of `path` is in the page cache, mapped by anyone or not. Maps the file
/// read-only without touching it (so the measurement does not fault pages in) and asks
/// `mincore`.
///
/// # Errors
///
/// [`PressureError::Io`] if the file cannot be opened or stat'ed, [`PressureError::Sys`] if
/// `mmap` or `mincore` fails.
pub fn file_resident_in_page_cache(path: &Path) -> Result<PageCacheResidency, PressureError> {
    let io = |source| PressureError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    let file_bytes = file.metadata().map_err(io)?.len();
    if file_bytes == 0 {
        return Ok(PageCacheResidency {
            file_bytes,
            resident_bytes: 0,
        });
    }
    // SAFETY: the map is only handed to mincore, which never reads through it, so a
    // concurrent truncation or write of the file cannot make us read invalid memory.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| PressureError::Sys {
        call: "mmap",
        source,
    })?;
    Ok(PageCacheResidency {
        file_bytes,
        resident_bytes: mincore_resident_bytes(&map)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn footprint_total_and_serde() {
        let f = Footprint::new(1000, 20, 300);
        assert_eq!(f.total, 1320);
        let json = serde_json::to_string(&f).expect("serialise");
        assert_eq!(
            json,
            r#"{"weights_resident":1000,"kv_bytes":20,"compute_bytes":300,"total":1320}"#
        );
        assert_eq!(serde_json::from_str::<Footprint>(&json).expect("parse"), f);
        assert_eq!(Footprint::new(u64::MAX, 1, 0).total, u64::MAX);
    }

    #[test]
    fn smaps_fixture() {
        let smaps = "\
55d0-55d1 r--p 00000000 08:01 11 /usr/bin/molt
Rss:                   8 kB
Pss:                   8 kB
7f00-7f10 r--p 00000000 08:01 42 /models/my model.gguf
Size:                 64 kB
Rss:                  12 kB
VmFlags: rd mr mw me
7f10-7f20 r--p 00010000 08:01 42 /models/my model.gguf
Rss:                   4 kB
7f20-7f30 rw-p 00000000 00:00 0
Rss:                 100 kB
7f30-7f40 r--p 00000000 08:01 43 /models/old.gguf (deleted)
Rss:                   2 kB
";
        assert_eq!(
            smaps_rss_of(smaps, Path::new("/models/my model.gguf")),
            16 * 1024
        );
        assert_eq!(smaps_rss_of(smaps, Path::new("/models/old.gguf")), 2 * 1024);
        assert_eq!(smaps_rss_of(smaps, Path::new("/usr/bin/molt")), 8 * 1024);
        assert_eq!(smaps_rss_of(smaps, Path::new("/models/my")), 0);
    }

    #[test]
    fn process_measures_are_positive() {
        let rss = process_rss_bytes().expect("rss");
        let pss = process_pss_bytes().expect("pss");
        assert!(rss > 0 && pss > 0);
        // A test binary shares little; PSS cannot exceed RSS by more than rounding.
        assert!(pss <= rss + 64 * 1024, "pss {pss} rss {rss}");
    }

    /// A temp file of `pages` pages, each filled with its index.
    fn temp_pages(pages: usize, page: usize) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().expect("temp file");
        for i in 0..pages {
            #[expect(clippy::cast_possible_truncation, reason = "a fill pattern")]
            f.write_all(&vec![i as u8; page]).expect("write");
        }
        f.flush().expect("flush");
        f
    }

    #[test]
    fn resident_bytes_of_mapping_counts_touched_half() {
        let page = page_size();
        // 512 pages; the first 256 are touched. The boundary is a multiple of 64 KiB, the
        // kernel's fault-around window, so fault-around cannot map pages past it.
        let pages = 512;
        let f = temp_pages(pages, page);
        let file = File::open(f.path()).expect("open");
        // SAFETY: the temp file is private to this test and not modified while mapped.
        let map = unsafe { memmap2::Mmap::map(&file) }.expect("map");
        assert_eq!(resident_bytes_of_mapping(f.path()).expect("smaps"), 0);
        let mut sum = 0u64;
        for i in 0..pages / 2 {
            sum += u64::from(map[i * page]);
        }
        std::hint::black_box(sum);
        let resident = resident_bytes_of_mapping(f.path()).expect("smaps");
        let half = (pages / 2 * page) as u64;
        let slack = 2 * page as u64;
        assert!(
            resident.abs_diff(half) <= slack,
            "resident {resident} vs half {half}"
        );
        drop(map);
        assert_eq!(resident_bytes_of_mapping(f.path()).expect("smaps"), 0);
    }

    #[test]
    fn mincore_sees_exactly_the_touched_anonymous_pages() {
        let page = page_size();
        let pages = 64;
        let mut map = memmap2::MmapMut::map_anon(pages * page).expect("anon map");
        assert_eq!(mincore_resident_bytes(&map).expect("mincore"), 0);
        for i in (0..pages).step_by(2) {
            map[i * page] = 1;
        }
        assert_eq!(
            mincore_resident_bytes(&map).expect("mincore"),
            (pages / 2 * page) as u64
        );
        // Two bytes straddling a touched and an untouched page: the touched page, whole.
        let sub = &map[page - 1..=page];
        assert_eq!(mincore_resident_bytes(sub).expect("mincore"), page as u64);
        assert_eq!(mincore_resident_bytes(&[]).expect("empty"), 0);
    }

    #[test]
    fn freshly_written_file_is_in_page_cache() {
        let page = page_size();
        let f = temp_pages(32, page);
        let r = file_resident_in_page_cache(f.path()).expect("residency");
        assert_eq!(r.file_bytes, (32 * page) as u64);
        assert_eq!(r.resident_bytes, r.file_bytes);
        let empty = tempfile::NamedTempFile::new().expect("temp");
        assert_eq!(
            file_resident_in_page_cache(empty.path()).expect("empty"),
            PageCacheResidency {
                file_bytes: 0,
                resident_bytes: 0
            }
        );
        assert!(file_resident_in_page_cache(Path::new("/no/such/file")).is_err());
    }
}
