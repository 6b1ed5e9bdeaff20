//! Moving a weights file's pages between this process, the page cache and the disk, without
//! unmapping it.
//!
//! A standby rung keeps its llama.cpp model (and context) while its weights cost this process
//! nothing: [`release_mapping`] drops the file's pages from our page tables (`madvise
//! MADV_DONTNEED` on every mapping of the file), so they leave our RSS at once but stay in the
//! kernel's reclaimable page cache; [`populate_mapping`] maps them back in one call when the
//! rung is needed (`MADV_POPULATE_READ`), instead of one page fault per 64 KiB window during
//! the first decode. [`drop_from_page_cache`] and [`read_into_page_cache`] set the page cache
//! itself cold or warm, for the stall benchmark's two conditions.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use super::PressureError;
use super::procfile;

/// `MADV_POPULATE_READ` (Linux 5.14): fault in the pages of a range for reading, now.
#[cfg(target_os = "linux")]
const MADV_POPULATE_READ: libc::c_int = 22;

/// The address ranges `[start, end)` of this process's mappings of `file`, from
/// `/proc/self/maps`.
fn ranges_of(file: &Path) -> Result<Vec<(usize, usize)>, PressureError> {
    let canonical = std::fs::canonicalize(file).map_err(|source| PressureError::Io {
        path: file.to_path_buf(),
        source,
    })?;
    let maps = procfile::read(Path::new("/proc/self/maps"))?;
    Ok(ranges_in(&maps, &canonical))
}

/// The ranges of a `maps` text whose pathname is `file`.
pub(crate) fn ranges_in(maps: &str, file: &Path) -> Vec<(usize, usize)> {
    let Some(wanted) = file.to_str() else {
        return Vec::new();
    };
    maps.lines()
        .filter(|line| {
            let path = super::footprint::mapping_pathname(line);
            path == wanted || path.strip_suffix(" (deleted)") == Some(wanted)
        })
        .filter_map(|line| {
            let range = line.split_whitespace().next()?;
            let (a, b) = range.split_once('-')?;
            let start = usize::from_str_radix(a, 16).ok()?;
            let end = usize::from_str_radix(b, 16).ok()?;
            (end > start).then_some((start, end))
        })
        .collect()
}

/// Applies `advice` to the mappings `ranges` ([`ranges_of`] a file); returns the bytes covered.
fn advise(
    ranges: &[(usize, usize)],
    advice: libc::c_int,
    call: &'static str,
) -> Result<u64, PressureError> {
    let mut covered = 0u64;
    for &(start, end) in ranges {
        // SAFETY: [start, end) is a whole mapping of this process as `/proc/self/maps` lists
        // it (page aligned by construction). The advice values used here do not change the
        // mapping's contents as a reader sees them: MADV_DONTNEED on a file-backed, read-only
        // mapping only drops page-table entries (the next access maps the same file bytes
        // again), MADV_POPULATE_READ / MADV_WILLNEED only fault or read pages in, and
        // MADV_HUGEPAGE only changes how the range is backed.
        let rc = unsafe { libc::madvise(start as *mut libc::c_void, end - start, advice) };
        if rc != 0 {
            return Err(PressureError::Sys {
                call,
                source: std::io::Error::last_os_error(),
            });
        }
        covered += (end - start) as u64;
    }
    Ok(covered)
}

/// Drops the resident pages of every mapping of `file` in this process from our page tables:
/// RSS falls by them at once, the pages stay in the page cache, and the mapping stays valid
/// (the next access faults the same bytes back in). Only for read-only mappings of a file
/// nobody writes — the GGUF files llama.cpp maps `PROT_READ`. Returns the bytes of mappings
/// covered.
///
/// # Errors
/// [`PressureError::Io`] if `/proc/self/maps` or the path cannot be read,
/// [`PressureError::Sys`] if `madvise` fails.
pub fn release_mapping(file: &Path) -> Result<u64, PressureError> {
    advise(
        &ranges_of(file)?,
        libc::MADV_DONTNEED,
        "madvise(MADV_DONTNEED)",
    )
}

/// Maps every page of every mapping of `file` in this process now (`MADV_POPULATE_READ`;
/// where the kernel lacks it, `MADV_WILLNEED`, which only starts reading them). From a warm
/// page cache this costs page-table work only; from a cold one it reads the file — asking for
/// huge pages first, so that what it reads lands in 2 MiB folios as [`settle_huge_folios`]
/// leaves a load's (read back through llama.cpp's plain mapping, a standby rung's pages came
/// in small folios, and letting them go at the next switch cost ~40-85 ms again). Returns the
/// bytes of mappings covered.
///
/// # Errors
/// As [`release_mapping`].
pub fn populate_mapping(file: &Path) -> Result<u64, PressureError> {
    let ranges = ranges_of(file)?;
    #[cfg(target_os = "linux")]
    if thp_allowed() {
        // Only how the range is backed changes; a kernel that refuses it reads as before.
        let _ = advise(&ranges, libc::MADV_HUGEPAGE, "madvise(MADV_HUGEPAGE)");
    }
    #[cfg(target_os = "linux")]
    match advise(&ranges, MADV_POPULATE_READ, "madvise(MADV_POPULATE_READ)") {
        Ok(n) => return Ok(n),
        Err(PressureError::Sys { source, .. }) if source.raw_os_error() == Some(libc::EINVAL) => {}
        Err(e) => return Err(e),
    }
    advise(&ranges, libc::MADV_WILLNEED, "madvise(MADV_WILLNEED)")
}

/// Asks the kernel to drop `file`'s clean pages from the page cache
/// (`posix_fadvise(POSIX_FADV_DONTNEED)`): the next load reads it from disk. Pages some
/// process still maps stay; measure with [`super::file_resident_in_page_cache`].
///
/// # Errors
/// [`PressureError::Io`] if the file cannot be opened, [`PressureError::Sys`] if the call
/// fails.
pub fn drop_from_page_cache(file: &Path) -> Result<(), PressureError> {
    use std::os::fd::AsRawFd;
    let f = File::open(file).map_err(|source| PressureError::Io {
        path: file.to_path_buf(),
        source,
    })?;
    // SAFETY: a valid open descriptor; offset 0 and length 0 mean the whole file; the call
    // only changes caching.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        return Err(PressureError::Sys {
            call: "posix_fadvise(POSIX_FADV_DONTNEED)",
            source: std::io::Error::from_raw_os_error(rc),
        });
    }
    Ok(())
}

/// Reads `file` through once so its pages are in the page cache (the warm condition).
///
/// # Errors
/// [`PressureError::Io`] if it cannot be read.
pub fn read_into_page_cache(file: &Path) -> Result<u64, PressureError> {
    let io = |source| PressureError::Io {
        path: file.to_path_buf(),
        source,
    };
    let mut f = File::open(file).map_err(io)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(io)?;
        if n == 0 {
            return Ok(total);
        }
        total += n as u64;
    }
}

/// The size of a page-middle-directory mapping on x86-64 and arm64 (4 KiB pages): one page-table
/// entry maps a whole 2 MiB folio.
const PMD_BYTES: usize = 2 << 20;

/// Of a file's PMD-sized stretches, the share that must map as whole folios for its page cache
/// to count as held in huge folios.
const HUGE_ENOUGH: f64 = 0.9;

/// How a weights file's pages sit in the page cache, as [`settle_huge_folios`] found and left
/// them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Folios {
    /// In 2 MiB folios already.
    Huge {
        /// The share of the file's 2 MiB stretches that mapped whole.
        share: f64,
    },
    /// Were in small folios (or absent), dropped and read again in 2 MiB ones.
    Reread {
        /// The share that mapped whole before.
        before: f64,
        /// The share that maps whole now.
        share: f64,
    },
    /// In small folios, and reading them again did not help (or was tried already): left.
    Small {
        /// The share that maps whole.
        share: f64,
    },
    /// Nothing to do: transparent huge pages are off, the file is smaller than two folios, or
    /// its mapping is not 2 MiB aligned.
    NotApplicable,
}

/// Files whose page cache a re-read did not put in huge folios: not tried again.
static SMALL_ONLY: std::sync::Mutex<Vec<std::path::PathBuf>> = std::sync::Mutex::new(Vec::new());

/// Whether transparent huge pages may back a mapping that asks for them (`always` or
/// `madvise`).
fn thp_allowed() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .is_ok_and(|s| s.contains("[always]") || s.contains("[madvise]"))
}

/// The `FilePmdMapped` bytes of the mapping of this process that starts at `start`, from a
/// `/proc/self/smaps` text.
pub(crate) fn file_pmd_mapped_in(smaps: &str, start: usize) -> Option<u64> {
    let mut inside = false;
    for line in smaps.lines() {
        let head = line.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = head.split_once('-')
            && let (Ok(a), Ok(_)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
        {
            inside = a == start;
            continue;
        }
        if inside && let Some(rest) = line.strip_prefix("FilePmdMapped:") {
            let kb = rest.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()?;
            return Some(kb * 1024);
        }
    }
    None
}

/// Maps `file` asking for huge pages, touches one byte of every 2 MiB stretch (a stretch not
/// in the page cache is read in then, as one 2 MiB folio), and returns the share of its 2 MiB
/// stretches mapped whole. `None` when the mapping is not 2 MiB aligned (none could be).
#[cfg(target_os = "linux")]
fn huge_share(file: &Path) -> Result<Option<f64>, PressureError> {
    use std::os::fd::AsRawFd;
    let io = |source| PressureError::Io {
        path: file.to_path_buf(),
        source,
    };
    let f = File::open(file).map_err(io)?;
    let len = usize::try_from(f.metadata().map_err(io)?.len()).unwrap_or(usize::MAX);
    let stretches = len / PMD_BYTES;
    if stretches == 0 {
        return Ok(None);
    }
    // SAFETY: a fresh shared read-only mapping of an open file, unmapped below; nothing else
    // holds its address.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(PressureError::Sys {
            call: "mmap",
            source: std::io::Error::last_os_error(),
        });
    }
    let start = p as usize;
    let share = if start.is_multiple_of(PMD_BYTES) {
        // SAFETY: the mapping above; the advice only changes how it is backed.
        unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) };
        for i in 0..stretches {
            // SAFETY: inside the mapping (i * 2 MiB < len), readable; a volatile read so the
            // touch is not optimized away.
            unsafe { std::ptr::read_volatile(p.cast::<u8>().add(i * PMD_BYTES)) };
        }
        let smaps = procfile::read(Path::new("/proc/self/smaps"));
        smaps.map(|s| {
            let whole = file_pmd_mapped_in(&s, start).unwrap_or(0) as f64;
            Some(whole / (stretches * PMD_BYTES) as f64)
        })
    } else {
        Ok(None)
    };
    // SAFETY: the mapping made above, of `len` bytes.
    unsafe { libc::munmap(p, len) };
    share
}

/// Leaves `file`'s pages in the page cache in 2 MiB folios when the kernel can, so that every
/// mapping of it maps them one page-table entry per 2 MiB: mapping a 1.5B rung's weights
/// back then takes ~1 ms instead of ~85, and letting them go ~0.2 ms instead of ~40-85 (this
/// VM, measured on the q4_k_m rung with small folios against huge ones). Small folios come
/// from however the file was last read or written (`fetch` writes it; llama.cpp's own load
/// reads it ahead in small pieces). Checks with one touch per 2 MiB through a mapping that
/// asks for huge pages; if fewer than 90% map whole, drops the file's pages no process maps
/// from the page cache and touches them again, which reads them from disk as 2 MiB folios
/// (once: the page cache keeps them for every later process). A file whose re-read did not
/// help is not tried again in this process. Call it before llama.cpp maps the file.
///
/// # Errors
/// [`PressureError::Io`] if the file cannot be read, [`PressureError::Sys`] if it cannot be
/// mapped or dropped.
pub fn settle_huge_folios(file: &Path) -> Result<Folios, PressureError> {
    #[cfg(target_os = "linux")]
    {
        if !thp_allowed() {
            return Ok(Folios::NotApplicable);
        }
        let Some(before) = huge_share(file)? else {
            return Ok(Folios::NotApplicable);
        };
        if before >= HUGE_ENOUGH {
            return Ok(Folios::Huge { share: before });
        }
        let canonical = std::fs::canonicalize(file).unwrap_or_else(|_| file.to_path_buf());
        let mut small = SMALL_ONLY
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if small.contains(&canonical) {
            return Ok(Folios::Small { share: before });
        }
        drop_from_page_cache(file)?;
        let share = huge_share(file)?.unwrap_or(0.0);
        if share < HUGE_ENOUGH {
            small.push(canonical);
            return Ok(Folios::Small { share });
        }
        Ok(Folios::Reread { before, share })
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = file;
        Ok(Folios::NotApplicable)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn reads_the_file_pmd_mapped_bytes_of_one_mapping() {
        let smaps = "\
7f00000000-7f40000000 r--s 00000000 08:01 42 /models/a.gguf
Size:            1048576 kB
FilePmdMapped:    2048 kB
7f40000000-7f80000000 r--s 00000000 08:01 43 /models/b.gguf
Size:            1048576 kB
FilePmdMapped:  1046528 kB
";
        assert_eq!(
            file_pmd_mapped_in(smaps, 0x007f_4000_0000),
            Some(1_046_528 * 1024)
        );
        assert_eq!(
            file_pmd_mapped_in(smaps, 0x007f_0000_0000),
            Some(2048 * 1024)
        );
        assert_eq!(file_pmd_mapped_in(smaps, 0x1000), None);
    }

    #[test]
    fn maps_ranges_of_one_file_only() {
        let maps = "\
55d0-55d1 r--p 00000000 08:01 11 /usr/bin/molt
7f00-7f10 r--s 00000000 08:01 42 /models/my model.gguf
7f10-7f20 r--s 00010000 08:01 42 /models/my model.gguf
7f20-7f30 rw-p 00000000 00:00 0
7f30-7f40 r--s 00000000 08:01 43 /models/my model.gguf.bak
";
        assert_eq!(
            ranges_in(maps, Path::new("/models/my model.gguf")),
            vec![(0x7f00, 0x7f10), (0x7f10, 0x7f20)]
        );
        assert!(ranges_in(maps, Path::new("/models/my")).is_empty());
    }

    #[test]
    fn release_drops_resident_pages_and_populate_brings_them_back() {
        let page = super::super::footprint::page_size();
        let pages = 256;
        let mut f = tempfile::NamedTempFile::new().expect("temp file");
        for i in 0..pages {
            #[expect(clippy::cast_possible_truncation, reason = "a fill pattern")]
            f.write_all(&vec![i as u8; page]).expect("write");
        }
        f.flush().expect("flush");
        let file = File::open(f.path()).expect("open");
        // SAFETY: the temp file is private to this test and not modified while mapped.
        let map = unsafe { memmap2::Mmap::map(&file) }.expect("map");
        let sum: u64 = (0..pages).map(|i| u64::from(map[i * page])).sum();
        std::hint::black_box(sum);
        let all = (pages * page) as u64;
        let resident = || super::super::resident_bytes_of_mapping(f.path()).expect("smaps");
        assert!(resident() >= all - page as u64, "touched: {}", resident());
        assert_eq!(release_mapping(f.path()).expect("release"), all);
        assert_eq!(resident(), 0, "released pages leave our RSS");
        // The mapping still reads the same bytes.
        assert_eq!(map[7 * page], 7);
        release_mapping(f.path()).expect("release");
        populate_mapping(f.path()).expect("populate");
        assert!(resident() >= all - page as u64, "populated: {}", resident());
        drop(map);
    }
}
