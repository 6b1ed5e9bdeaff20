//! The entry points of Molt's fuzz targets: one function per parser of untrusted bytes.
//!
//! Each function takes arbitrary bytes, runs them through the same public parser a user's file
//! or a client's request goes through, and — when the bytes are accepted — checks what must
//! then hold (an accepted file re-encodes and parses again; a tensor's extent lies inside the
//! file). It returns nothing: the only failure is a panic (or, under a sanitizer, a fault),
//! which is what the fuzzer looks for.
//!
//! The same functions are called by the `cargo fuzz` targets in `tests/fuzz/fuzz_targets/` and
//! by the CI smoke (`tests/fuzz_smoke.rs`), which replays the committed corpora and runs a
//! seeded mutator for a bounded number of inputs inside the normal release test run; one
//! definition, so the smoke tests exactly what the fuzzer fuzzes. [`TARGETS`] lists them by the
//! names of their corpus directories.
//!
//! Checksums: the projector, hidden-map and anchor files carry sha256s of their header and
//! data, which random mutation almost never gets right, so a fuzzer would spend all its time on
//! the checksum error. Their entries therefore try the bytes twice: as given, and *resealed* —
//! the recorded checksums (and the rung hashes the file is bound to) replaced by the ones the
//! bytes imply — so the decoder behind the checks is reached. Resealing is done here, by the
//! harness; the parsers themselves are not weakened.

use std::path::Path;

use sha2::{Digest, Sha256};

/// One fuzz target: its name (the corpus directory and the `cargo fuzz` target) and its entry.
pub struct Target {
    /// Name, e.g. `"gguf"`.
    pub name: &'static str,
    /// The entry point.
    pub run: fn(&[u8]),
    /// Byte offsets where a length or count sits in a typical input, for a mutator that writes
    /// extreme integers where they do the most damage (empty: anywhere).
    pub header_offsets: &'static [usize],
}

/// Every target, in the order the reliability report lists them.
pub const TARGETS: &[Target] = &[
    Target {
        name: "gguf",
        run: gguf,
        // version, tensor count, metadata count, first key's length
        header_offsets: &[4, 8, 16, 24],
    },
    Target {
        name: "kv_blob",
        run: kv_blob,
        // magic, seq id, stream count, cell count, first position
        header_offsets: &[0, 4, 8, 12, 16, 20],
    },
    Target {
        name: "transplant_files",
        run: transplant_files,
        // version, flags / header length, header length (projector), header checksum
        header_offsets: &[8, 12, 16, 20, 24],
    },
    Target {
        name: "ladder",
        run: ladder,
        header_offsets: &[],
    },
    Target {
        name: "trace",
        run: trace,
        header_offsets: &[],
    },
    Target {
        name: "prompt_file",
        run: prompt_file,
        header_offsets: &[],
    },
    Target {
        name: "chat_request",
        run: chat_request,
        header_offsets: &[],
    },
];

/// The target named `name`.
#[must_use]
pub fn target(name: &str) -> Option<&'static Target> {
    TARGETS.iter().find(|t| t.name == name)
}

/// A GGUF image: the reader, then what Molt reads from an accepted file (model facts,
/// tokenizer identity, every tensor's bytes).
pub fn gguf(data: &[u8]) {
    let Ok(file) = molt::gguf::GgufFile::from_bytes("fuzz.gguf", data.to_vec()) else {
        return;
    };
    for t in file.tensors() {
        // The reader promises every extent was checked against the file when it was opened.
        let bytes = file.tensor_data(t);
        assert_eq!(
            bytes.len() as u64,
            t.n_bytes,
            "tensor {:?}: {} bytes declared, {} readable",
            t.name,
            t.n_bytes,
            bytes.len()
        );
        assert!(file.tensor(&t.name).is_some());
    }
    let _ = file.total_tensor_bytes();
    for (key, _) in file.metadata() {
        let _ = file.get_str(key);
        let _ = file.get_u64(key);
        let _ = file.get_str_array(key);
    }
    if let Ok(facts) = molt::gguf::ModelFacts::from_gguf(&file) {
        let _ = (facts.kv_dim_k(), facts.kv_dim_v(), facts.gqa_group());
        let _ = facts.file_type_name();
    }
    let _ = molt::gguf::TokenizerIdentity::from_gguf(&file);
}

/// A KV state blob, under each combination of the facts a blob does not record; an accepted
/// blob must re-encode to bytes that parse again into the same encoding.
pub fn kv_blob(data: &[u8]) {
    use molt::kv::{KvSnapshot, ParseOptions};
    for has_cell_ext in [false, true] {
        for has_v in [true, false] {
            for sections in [None, Some(1), Some(2)] {
                let opts = ParseOptions {
                    has_cell_ext,
                    has_v,
                    sections,
                };
                let Ok(snap) = KvSnapshot::parse(data, opts) else {
                    continue;
                };
                let _ = (snap.n_cells(), snap.positions(), snap.approx_bytes());
                let bytes = snap.to_bytes().expect("an accepted blob must encode again");
                assert_eq!(snap.encoded_len().ok(), Some(bytes.len()));
                let again = KvSnapshot::parse(&bytes, opts).expect("a re-encoded blob must parse");
                assert_eq!(
                    again.to_bytes().ok().as_deref(),
                    Some(bytes.as_slice()),
                    "re-encoding is not stable"
                );
            }
        }
    }
    let _ = KvSnapshot::parse_single_stream(data);
}

/// A projector (`.molt-proj`), hidden-map (`.molt-hmap`) or anchor (`.molt-anchor`) file,
/// each tried as given and resealed (see the module doc).
pub fn transplant_files(data: &[u8]) {
    use molt::transplant::anchor::Anchor;
    use molt::transplant::hidden::HiddenMap;
    use molt::transplant::projector::{Projector, TensorDtype};

    let path = Path::new("fuzz.molt");
    for bytes in [Some(data.to_vec()), reseal_projector(data)]
        .into_iter()
        .flatten()
    {
        if let Ok(p) = Projector::from_bytes(&bytes, path) {
            let _ = (p.route_name(), p.map_flops(16), p.validate());
            for dtype in [TensorDtype::F32, TensorDtype::F16] {
                if let Ok(out) = p.to_bytes(dtype) {
                    Projector::from_bytes(&out, path).expect("a re-encoded projector must parse");
                }
            }
        }
    }
    for bytes in [Some(data.to_vec()), reseal_framed(data, "data_sha256")]
        .into_iter()
        .flatten()
    {
        let (src, dst) = bound_pair(&bytes);
        if let Ok(m) = HiddenMap::from_bytes(&bytes, path.into(), &src, &dst) {
            let out = m
                .to_bytes()
                .expect("an accepted hidden map must encode again");
            HiddenMap::from_bytes(&out, path.into(), &src, &dst)
                .expect("a re-encoded hidden map must parse");
        }
    }
    for bytes in [Some(data.to_vec()), reseal_framed(data, "state_sha256")]
        .into_iter()
        .flatten()
    {
        let sha = header_json(&bytes, FRAMED_PREFIX)
            .and_then(|h| h.get("sha256").and_then(|s| s.as_str()).map(str::to_owned))
            .unwrap_or_default();
        if let Ok(a) = Anchor::from_bytes(&bytes, path.into(), &sha) {
            let _ = a.covers(&a.tokens);
            let out = a.to_bytes().expect("an accepted anchor must encode again");
            Anchor::from_bytes(&out, path.into(), &sha).expect("a re-encoded anchor must parse");
        }
    }
}

/// A ladder manifest (TOML) and a lock file (JSON): the same bytes fed to both.
pub fn ladder(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data)
        && let Ok(m) = molt::ladder::Manifest::parse(text, Path::new("fuzz.toml"))
    {
        for r in &m.rungs {
            assert_eq!(
                m.rungs[m.index_of(&r.name).expect("a rung's own name")].name,
                r.name
            );
        }
    }
    let lock = molt::ladder::Lock::from_bytes(data);
    let out = serde_json::to_vec(&lock).expect("a lock serializes");
    assert_eq!(molt::ladder::Lock::from_bytes(&out).files, lock.files);
}

/// A pressure trace (JSON), plain and with named references; an accepted trace answers every
/// budget question.
pub fn trace(data: &[u8]) {
    use molt::pressure::{Trace, TraceRefs};
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let refs: TraceRefs = [("tier0", 1u64 << 31), ("tier1", 1 << 30), ("tier2", 0)]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
    for t in [Trace::parse(text), Trace::parse_with(text, "fuzz", &refs)]
        .into_iter()
        .flatten()
    {
        let _ = t.min_budget_bytes();
        for at in [0, 1, 47, 48, 1 << 20, u64::MAX] {
            let _ = t.budget_at(at, at);
        }
    }
}

/// A prompt file (`generate --prompt-file`): every line is a prompt or a numbered bad line.
pub fn prompt_file(data: &[u8]) {
    let f = molt::session::prompt_file::parse(data);
    let n_lines = data.split(|&b| b == b'\n').count();
    for line in f
        .items
        .iter()
        .map(|i| i.line)
        .chain(f.bad.iter().map(|b| b.line))
    {
        assert!((1..=n_lines).contains(&line), "line {line} of {n_lines}");
    }
    assert!(f.items.iter().all(|i| i.max_tokens != Some(0)));
}

/// A request body of the HTTP service: chat and text completions, checked as the routes check
/// them, and the budget endpoint's body.
pub fn chat_request(data: &[u8]) {
    use molt_server::completions::CompletionRequest;
    use molt_server::openai::ChatRequest;
    if let Ok(req) = serde_json::from_slice::<ChatRequest>(data) {
        let _ = req.validate();
    }
    if let Ok(req) = serde_json::from_slice::<CompletionRequest>(data) {
        let _ = req.validate();
    }
    let _ = serde_json::from_slice::<molt_server::BudgetRequest>(data);
}

/// Bytes before the JSON header of a hidden-map or anchor file: magic, version, header length.
const FRAMED_PREFIX: usize = 8 + 4 + 8;
/// Bytes before the JSON header of a projector file: magic, version, flags, length, checksum.
const PROJECTOR_PREFIX: usize = 8 + 4 + 4 + 8 + 32;

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// The JSON header of a file whose header length is the u64 at `prefix - 8` (framed) or at 16
/// (projector), if it is there and parses.
fn header_json(bytes: &[u8], prefix: usize) -> Option<serde_json::Value> {
    let (json, _) = split_header(bytes, prefix)?;
    serde_json::from_slice(json).ok()
}

fn split_header(bytes: &[u8], prefix: usize) -> Option<(&[u8], &[u8])> {
    let len_at = if prefix == PROJECTOR_PREFIX { 16 } else { 12 };
    let len = u64::from_le_bytes(bytes.get(len_at..len_at + 8)?.try_into().ok()?);
    let rest = bytes.get(prefix..)?;
    let len = usize::try_from(len).ok().filter(|&l| l <= rest.len())?;
    Some(rest.split_at(len))
}

/// The `src` and `dst` sha256s a hidden map's header binds (empty when absent).
fn bound_pair(bytes: &[u8]) -> (String, String) {
    let h = header_json(bytes, FRAMED_PREFIX);
    let get = |side: &str| {
        h.as_ref()
            .and_then(|h| h.get(side)?.get("sha256")?.as_str().map(str::to_owned))
            .unwrap_or_default()
    };
    (get("src"), get("dst"))
}

/// A hidden-map or anchor image with its data checksum field `field` set to the data's sha256.
fn reseal_framed(bytes: &[u8], field: &str) -> Option<Vec<u8>> {
    let (json, data) = split_header(bytes, FRAMED_PREFIX)?;
    let mut header: serde_json::Value = serde_json::from_slice(json).ok()?;
    *header.as_object_mut()?.get_mut(field)? = sha256_hex(data).into();
    let json = serde_json::to_vec(&header).ok()?;
    let mut out = bytes[..12].to_vec();
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    out.extend_from_slice(data);
    Some(out)
}

/// A projector image with its data checksum and header checksum recomputed.
fn reseal_projector(bytes: &[u8]) -> Option<Vec<u8>> {
    let (json, data) = split_header(bytes, PROJECTOR_PREFIX)?;
    let mut header: serde_json::Value = serde_json::from_slice(json).ok()?;
    *header.as_object_mut()?.get_mut("data_sha256")? = sha256_hex(data).into();
    let json = serde_json::to_vec(&header).ok()?;
    let mut out = bytes[..16].to_vec();
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&Sha256::digest(&json));
    out.extend_from_slice(&json);
    out.extend_from_slice(data);
    Some(out)
}
