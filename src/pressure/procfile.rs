//! Small readers for the `key: value kB` and single-number files of `/proc` and `/sys`.
//!
//! Written by hand rather than through `procfs` because every root must be injectable (tests
//! point them at temp directories with fake files) and the formats needed are tiny.

use std::io;
use std::path::Path;

use super::PressureError;

/// Reads a whole file, mapping errors to [`PressureError::Io`] with the path.
pub(crate) fn read(path: &Path) -> Result<String, PressureError> {
    std::fs::read_to_string(path).map_err(|source| PressureError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Reads a file that may legitimately be absent: `Ok(None)` when it does not exist.
pub(crate) fn read_optional(path: &Path) -> Result<Option<String>, PressureError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(PressureError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Finds `key:` in a `/proc/*/status`- or `meminfo`-style text and returns its value in
/// bytes (the files state kB, which are KiB).
pub(crate) fn kib_field_bytes(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(key)?.strip_prefix(':')?;
        let number = rest.split_whitespace().next()?;
        number
            .parse::<u64>()
            .ok()
            .map(|kib| kib.saturating_mul(1024))
    })
}

/// Sums `key:` over every entry of an `smaps`-style text, in bytes.
pub(crate) fn sum_kib_fields_bytes(text: &str, key: &str) -> Option<u64> {
    let mut found = false;
    let mut total = 0u64;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(key).and_then(|r| r.strip_prefix(':')) else {
            continue;
        };
        if let Some(kib) = rest
            .split_whitespace()
            .next()
            .and_then(|n| n.parse::<u64>().ok())
        {
            found = true;
            total = total.saturating_add(kib.saturating_mul(1024));
        }
    }
    found.then_some(total)
}

/// What a cgroup limit file holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Limit {
    /// `max` (v2) or the v1 "no limit" sentinel.
    Unlimited,
    /// A limit in bytes.
    Bytes(u64),
}

/// cgroup v1 reports "no limit" as `PAGE_COUNTER_MAX` rounded to pages (9223372036854771712
/// on x86-64); anything at or above 2^62 is treated as unlimited.
const V1_UNLIMITED_FLOOR: u64 = 1 << 62;

/// Parses a cgroup limit (`max`, or a byte count).
pub(crate) fn parse_limit(text: &str) -> Option<Limit> {
    let t = text.trim();
    if t == "max" {
        return Some(Limit::Unlimited);
    }
    let n = t.parse::<u64>().ok()?;
    Some(if n >= V1_UNLIMITED_FLOOR {
        Limit::Unlimited
    } else {
        Limit::Bytes(n)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kib_field_reads_the_named_key_only() {
        let text = "VmHWM:\t  2000 kB\nVmRSS:\t  1234 kB\nRssAnon: 5 kB\n";
        assert_eq!(kib_field_bytes(text, "VmRSS"), Some(1234 * 1024));
        assert_eq!(kib_field_bytes(text, "Vm"), None);
        assert_eq!(kib_field_bytes(text, "Missing"), None);
    }

    #[test]
    fn sums_over_entries() {
        let text = "Rss: 4 kB\nPss: 2 kB\nRss: 8 kB\n";
        assert_eq!(sum_kib_fields_bytes(text, "Rss"), Some(12 * 1024));
        assert_eq!(sum_kib_fields_bytes(text, "Swap"), None);
    }

    #[test]
    fn limits() {
        assert_eq!(parse_limit("max\n"), Some(Limit::Unlimited));
        assert_eq!(parse_limit("9223372036854771712\n"), Some(Limit::Unlimited));
        assert_eq!(parse_limit("1048576\n"), Some(Limit::Bytes(1 << 20)));
        assert_eq!(parse_limit("lots"), None);
    }
}
