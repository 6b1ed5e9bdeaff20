//! The layout the hidden-map (`.molt-hmap`) and anchor (`.molt-anchor`) files share: an
//! 8-byte magic, a u32 format version, a u64 header length, the JSON header (which records
//! the data's sha256), then the data — and their atomic write (a temporary beside the file,
//! then renamed).

use std::fs;
use std::path::Path;

use sha2::{Digest, Sha256};

use super::error::ProjectorError;

/// The file image of `json` and `data` under `magic` and `version`.
pub(crate) fn frame(magic: &[u8; 8], version: u32, json: &[u8], data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(20 + json.len() + data.len());
    out.extend_from_slice(magic);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(json);
    out.extend_from_slice(data);
    out
}

/// Splits a file image into its JSON header and its data, checking magic, version and the
/// declared header length.
///
/// # Errors
/// [`ProjectorError::Truncated`], [`ProjectorError::BadMagic`],
/// [`ProjectorError::UnsupportedVersion`], naming `file`.
pub(crate) fn unframe<'a>(
    bytes: &'a [u8],
    magic: &[u8; 8],
    version: u32,
    file: &Path,
) -> Result<(&'a [u8], &'a [u8]), ProjectorError> {
    let short = |section, needed, available| truncated(file, section, needed, available);
    if bytes.len() < 20 {
        return Err(short("prefix", 20, bytes.len()));
    }
    if bytes[..8] != magic[..] {
        return Err(ProjectorError::BadMagic {
            file: file.to_path_buf(),
            found: bytes[..8].to_vec(),
        });
    }
    let found = u32::from_le_bytes(bytes[8..12].try_into().unwrap_or_default());
    if found != version {
        return Err(ProjectorError::UnsupportedVersion {
            file: file.to_path_buf(),
            found,
            supported: version,
        });
    }
    let hlen = u64::from_le_bytes(bytes[12..20].try_into().unwrap_or_default());
    let hlen = usize::try_from(hlen).unwrap_or(usize::MAX);
    let rest = &bytes[20..];
    if rest.len() < hlen {
        return Err(short("header", hlen, rest.len()));
    }
    Ok(rest.split_at(hlen))
}

/// The sha256 of `data` in hex, as a header records it.
pub(crate) fn sha256_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// Checks `data`, the `section` of `file`, against the sha256 its header records.
///
/// # Errors
/// [`ProjectorError::Checksum`], naming `file` and `section`.
pub(crate) fn check_sha256(
    file: &Path,
    section: &'static str,
    stored: String,
    data: &[u8],
) -> Result<(), ProjectorError> {
    let computed = sha256_hex(data);
    if computed == stored {
        Ok(())
    } else {
        Err(ProjectorError::Checksum {
            file: file.to_path_buf(),
            section,
            stored,
            computed,
        })
    }
}

/// `file` ends inside `section`, which needs `needed` bytes where `available` are left.
pub(crate) fn truncated(
    file: &Path,
    section: &'static str,
    needed: usize,
    available: usize,
) -> ProjectorError {
    ProjectorError::Truncated {
        file: file.to_path_buf(),
        section,
        needed: needed as u64,
        available: available as u64,
    }
}

/// Writes `bytes` to `path` atomically, creating its directory.
///
/// # Errors
/// [`ProjectorError::Io`].
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), ProjectorError> {
    let io = |source| ProjectorError::Io {
        file: path.to_path_buf(),
        source,
    };
    if let Some(d) = path.parent() {
        fs::create_dir_all(d).map_err(io)?;
    }
    crate::durable::write(path, bytes).map_err(io)
}
