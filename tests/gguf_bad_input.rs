//! Parser edge cases on hand-built and damaged files: every error is an `Err` naming the
//! file, never a panic.
#![allow(
    clippy::float_cmp,
    clippy::cast_precision_loss,
    clippy::many_single_char_names
)]
// Round trips are checked bit-exactly on purpose; the counts cast to f64 are small.

#[path = "gguf_common/mod.rs"]
mod common;

use common::{header, push_str};
use molt::gguf::{GgmlType, GgufError, GgufFile, GgufWriter, Section};
use proptest::prelude::*;

const LABEL: &str = "/models/bad.gguf";

fn parse(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
    GgufFile::from_bytes(LABEL, bytes)
}

#[test]
fn every_prefix_truncation_is_an_error_naming_the_file() {
    let full = common::sample_bytes();
    assert!(parse(full.clone()).is_ok());
    for len in 0..full.len() {
        match parse(full[..len].to_vec()) {
            Ok(_) => panic!("prefix of {len} / {} bytes parsed", full.len()),
            Err(e) => {
                assert!(e.to_string().starts_with(LABEL), "{len}: {e}");
                assert_eq!(e.file(), std::path::Path::new(LABEL));
            }
        }
    }
}

#[test]
fn truncation_errors_say_where() {
    let full = common::sample_bytes();
    // inside the header
    let e = parse(full[..10].to_vec()).expect_err("cut header");
    assert!(
        matches!(
            e,
            GgufError::Truncated {
                section: Section::Header,
                offset: 8,
                needed: 8,
                available: 2,
                ..
            }
        ),
        "{e:?}"
    );
    // cutting anywhere after the header leaves too few bytes for the declared counts: the
    // count check fires before any pair is read
    let e = parse(full[..30].to_vec()).expect_err("cut metadata");
    assert!(
        matches!(
            e,
            GgufError::LengthTooLarge {
                section: Section::Header,
                offset: 16,
                ..
            }
        ),
        "{e:?}"
    );
    // a pair whose value is cut short, with the counts satisfiable
    let mut b = header(0, 1);
    push_str(&mut b, "general.architecture");
    b.extend(8u32.to_le_bytes());
    b.extend(5u64.to_le_bytes());
    b.extend(b"qw");
    let e = parse(b).expect_err("cut value");
    assert!(
        matches!(
            e,
            GgufError::LengthTooLarge {
                section: Section::Metadata,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("general.architecture"), "{e}");
    let mut b = header(0, 1);
    push_str(&mut b, "general.block_count");
    b.extend(10u32.to_le_bytes());
    b.extend([1, 2, 3]);
    let e = parse(b).expect_err("cut u64");
    assert!(
        matches!(
            e,
            GgufError::Truncated {
                section: Section::Metadata,
                needed: 8,
                available: 3,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(
        e.to_string().contains("value of key 'general.block_count'"),
        "{e}"
    );
    // a tensor info cut short
    let mut b = header(1, 0);
    push_str(&mut b, "blk.0.attn_q.weight");
    b.extend(2u32.to_le_bytes());
    b.extend(8u64.to_le_bytes());
    let e = parse(b).expect_err("cut info");
    assert!(
        matches!(
            e,
            GgufError::Truncated {
                section: Section::TensorInfo,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("blk.0.attn_q.weight"), "{e}");
    // empty file and a file of 2 bytes of the magic: truncated, not "not GGUF"
    assert!(matches!(
        parse(Vec::new()),
        Err(GgufError::Truncated { .. })
    ));
    assert!(matches!(
        parse(b"GG".to_vec()),
        Err(GgufError::Truncated { .. })
    ));
}

#[test]
fn last_tensor_cut_short_is_truncated_tensor_data() {
    let full = common::sample_bytes();
    let e = parse(full[..full.len() - 10].to_vec()).expect_err("cut data");
    match e {
        GgufError::TruncatedTensorData {
            ref tensor,
            end,
            file_len,
            ..
        } => {
            assert_eq!(tensor, "c.q8_0");
            assert_eq!(end, full.len() as u64);
            assert_eq!(file_len, full.len() as u64 - 10);
        }
        other => panic!("expected TruncatedTensorData, got {other:?}"),
    }
    assert!(e.to_string().contains("truncated download"), "{e}");
}

#[test]
fn bad_magic_shows_the_first_bytes() {
    let e = parse(b"PK\x03\x04zip archive".to_vec()).expect_err("zip");
    assert!(matches!(e, GgufError::NotGguf { .. }));
    assert_eq!(
        e.to_string(),
        "/models/bad.gguf: not a GGUF file (starts with [50 4b 03 04 7a 69 70 20] \"PK..zip \")"
    );
    let e = parse(b"<html>".to_vec()).expect_err("html");
    assert!(e.to_string().contains("\"<html>\""), "{e}");
}

#[test]
fn unsupported_versions_are_refused() {
    for v in [0u32, 1, 4, 0x0300_0000] {
        let mut b = header(0, 0);
        b[4..8].copy_from_slice(&v.to_le_bytes());
        match parse(b) {
            Err(GgufError::UnsupportedVersion { version, .. }) => assert_eq!(version, v),
            other => panic!("version {v}: {other:?}"),
        }
    }
}

#[test]
fn huge_counts_and_lengths_are_refused_before_allocating() {
    // n_kv = 2^62: cannot fit in 0 remaining bytes
    let e = parse(header(0, 1 << 62)).expect_err("huge n_kv");
    assert!(
        matches!(e, GgufError::LengthTooLarge { length, .. } if length == 1 << 62),
        "{e:?}"
    );
    let e = parse(header(u64::MAX, 0)).expect_err("huge n_tensors");
    assert!(matches!(e, GgufError::LengthTooLarge { .. }), "{e:?}");

    // a string value claiming 2^60 bytes
    let mut b = header(0, 1);
    push_str(&mut b, "k");
    b.extend(8u32.to_le_bytes());
    b.extend((1u64 << 60).to_le_bytes());
    b.extend(b"abc");
    let e = parse(b).expect_err("huge string");
    assert!(
        matches!(e, GgufError::LengthTooLarge { length, available: 3, .. } if length == 1 << 60),
        "{e:?}"
    );

    // arrays of every element type claiming 2^61 elements
    for elem in [0u32, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12] {
        let mut b = header(0, 1);
        push_str(&mut b, "tokenizer.ggml.tokens");
        b.extend(9u32.to_le_bytes());
        b.extend(elem.to_le_bytes());
        b.extend((1u64 << 61).to_le_bytes());
        b.extend([0u8; 64]);
        let e = parse(b).expect_err("huge array");
        assert!(
            matches!(
                e,
                GgufError::LengthTooLarge {
                    section: Section::Metadata,
                    ..
                }
            ),
            "{elem}: {e:?}"
        );
        assert!(e.to_string().contains("tokenizer.ggml.tokens"), "{e}");
    }

    // a string array whose count fits 8-byte lengths but whose strings do not
    let mut b = header(0, 1);
    push_str(&mut b, "a");
    b.extend(9u32.to_le_bytes());
    b.extend(8u32.to_le_bytes());
    b.extend(2u64.to_le_bytes());
    b.extend(5u64.to_le_bytes());
    b.extend(b"hello");
    b.extend(1000u64.to_le_bytes());
    b.extend(b"x");
    let e = parse(b).expect_err("second string too long");
    assert!(e.to_string().contains("element 1"), "{e}");
}

#[test]
fn invalid_value_types_and_nested_arrays_are_refused() {
    let mut b = header(0, 1);
    push_str(&mut b, "k");
    b.extend(13u32.to_le_bytes());
    b.extend([0u8; 8]);
    let e = parse(b).expect_err("type 13");
    assert!(
        matches!(e, GgufError::InvalidValueType { code: 13, ref key, .. } if key == "k"),
        "{e:?}"
    );

    let mut b = header(0, 1);
    push_str(&mut b, "nested");
    b.extend(9u32.to_le_bytes());
    b.extend(9u32.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    b.extend([0u8; 16]);
    let e = parse(b).expect_err("nested");
    assert!(
        matches!(e, GgufError::InvalidValueType { code: 9, .. }),
        "{e:?}"
    );
}

#[test]
fn invalid_utf8_empty_and_duplicate_keys_are_refused() {
    let mut b = header(0, 1);
    b.extend(2u64.to_le_bytes());
    b.extend([0xff, 0xfe]);
    b.extend(0u32.to_le_bytes());
    b.push(1);
    assert!(matches!(parse(b), Err(GgufError::InvalidUtf8 { .. })));

    let mut b = header(0, 1);
    push_str(&mut b, "");
    b.extend(0u32.to_le_bytes());
    b.extend([1, 0]);
    assert!(matches!(
        parse(b),
        Err(GgufError::EmptyKey { index: 0, .. })
    ));

    let mut b = header(0, 2);
    for _ in 0..2 {
        push_str(&mut b, "dup");
        b.extend(0u32.to_le_bytes());
        b.push(1);
    }
    assert!(matches!(parse(b), Err(GgufError::DuplicateKey { key, .. }) if key == "dup"));
}

#[test]
fn bad_alignment_is_refused() {
    for (value, code) in [
        (48u32.to_le_bytes().to_vec(), 4u32),
        (0u32.to_le_bytes().to_vec(), 4),
    ] {
        let mut b = header(0, 1);
        push_str(&mut b, "general.alignment");
        b.extend(code.to_le_bytes());
        b.extend(value);
        assert!(matches!(parse(b), Err(GgufError::BadAlignment { .. })));
    }
    // llama.cpp requires u32 exactly
    let mut b = header(0, 1);
    push_str(&mut b, "general.alignment");
    b.extend(10u32.to_le_bytes());
    b.extend(32u64.to_le_bytes());
    assert!(matches!(parse(b), Err(GgufError::WrongType { .. })));
}

/// A file with one tensor info, given raw fields, and `data_len` bytes of data.
fn one_tensor(name: &str, dims: &[u64], ty: u32, offset: u64, data_len: usize) -> Vec<u8> {
    let mut b = header(1, 0);
    push_str(&mut b, name);
    b.extend((dims.len() as u32).to_le_bytes());
    for d in dims {
        b.extend(d.to_le_bytes());
    }
    b.extend(ty.to_le_bytes());
    b.extend(offset.to_le_bytes());
    while !b.len().is_multiple_of(32) {
        b.push(0);
    }
    b.extend(vec![0u8; data_len]);
    b
}

#[test]
fn bad_tensor_infos_are_refused() {
    assert!(parse(one_tensor("ok", &[8], 0, 0, 32)).is_ok());
    assert!(matches!(
        parse(one_tensor("t", &[1, 1, 1, 1, 1], 0, 0, 4)),
        Err(GgufError::TooManyDims { n_dims: 5, .. })
    ));
    assert!(matches!(
        parse(one_tensor("t", &[8], 4, 0, 32)),
        Err(GgufError::UnknownGgmlType { code: 4, .. })
    ));
    assert!(matches!(
        parse(one_tensor("t", &[8], 99, 0, 32)),
        Err(GgufError::UnknownGgmlType { code: 99, .. })
    ));
    let e = parse(one_tensor("t", &[100], GgmlType::Q4K.code(), 0, 1000)).expect_err("block");
    assert!(matches!(e, GgufError::BadShape { .. }), "{e:?}");
    assert!(e.to_string().contains("block size"), "{e}");
    assert!(matches!(
        parse(one_tensor("t", &[u64::MAX / 2, 4], 0, 0, 32)),
        Err(GgufError::BadShape { .. })
    ));
    assert!(matches!(
        parse(one_tensor("t", &[1 << 40, 1 << 40], 0, 0, 32)),
        Err(GgufError::BadShape { .. })
    ));
    assert!(matches!(
        parse(one_tensor("t", &[8], 0, 3, 64)),
        Err(GgufError::MisalignedTensor { offset: 3, .. })
    ));
    // offset far past the end, offset + size overflowing u64
    assert!(matches!(
        parse(one_tensor("t", &[8], 0, 1 << 40, 32)),
        Err(GgufError::TruncatedTensorData { .. })
    ));
    assert!(matches!(
        parse(one_tensor("t", &[8], 0, u64::MAX - 31, 32)),
        Err(GgufError::TruncatedTensorData { .. })
    ));
    // duplicate tensor names
    let mut w = GgufWriter::new();
    w.add_tensor("a", &[1], GgmlType::F32, vec![0; 4])
        .expect("a");
    w.add_tensor("b", &[1], GgmlType::F32, vec![0; 4])
        .expect("b");
    let mut bytes = w.to_bytes();
    let pos = bytes
        .windows(9)
        .rposition(|win| win == [1, 0, 0, 0, 0, 0, 0, 0, b'b'])
        .expect("name b");
    bytes[pos + 8] = b'a';
    assert!(
        matches!(parse(bytes), Err(GgufError::DuplicateTensor { tensor, .. }) if tensor == "a")
    );
}

#[test]
fn open_reports_io_errors_with_the_path() {
    let e = GgufFile::open("/nonexistent/dir/model.gguf").expect_err("missing");
    assert!(matches!(e, GgufError::Io { .. }));
    assert!(
        e.to_string().starts_with("/nonexistent/dir/model.gguf: "),
        "{e}"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let empty = dir.path().join("empty.gguf");
    std::fs::write(&empty, b"").expect("write");
    assert!(matches!(
        GgufFile::open(&empty),
        Err(GgufError::Truncated { .. })
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn random_mutations_never_panic(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
        do_cut in any::<bool>(),
    ) {
        let mut bytes = common::sample_bytes();
        for (i, v) in &edits {
            let i = i.index(bytes.len());
            bytes[i] = *v;
        }
        if do_cut {
            let n = cut.index(bytes.len());
            bytes.truncate(n);
        }
        // Ok or Err are both fine; a panic fails the test.
        let _ = parse(bytes);
    }

    #[test]
    fn random_length_fields_never_panic(at in 0usize..400, value in any::<u64>()) {
        let mut bytes = common::sample_bytes();
        let at = at.min(bytes.len() - 8);
        bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
        let _ = parse(bytes);
    }

    #[test]
    fn random_bytes_after_magic_never_panic(tail in prop::collection::vec(any::<u8>(), 0..512)) {
        let mut bytes = b"GGUF\x03\0\0\0".to_vec();
        bytes.extend(tail);
        let _ = parse(bytes);
    }
}
