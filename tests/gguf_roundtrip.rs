//! Write → read round trips and the typed accessors.
#![allow(
    clippy::float_cmp,
    clippy::cast_precision_loss,
    clippy::many_single_char_names
)]
// Round trips are checked bit-exactly on purpose; the counts cast to f64 are small.

#[path = "gguf_common/mod.rs"]
mod common;

use molt::gguf::{
    ArrayValue, GgmlType, GgufError, GgufFile, GgufWriter, Value, ValueType, WriteError,
};

#[test]
fn every_value_type_round_trips() {
    let f = GgufFile::from_bytes("sample.gguf", common::sample_bytes()).expect("parse");
    assert_eq!(f.version(), 3);
    let values = common::all_values();
    assert_eq!(f.metadata().len(), values.len() + 1);
    for (k, v) in values {
        assert_eq!(f.get(k), Some(&v), "{k}");
    }
    // file order is kept
    assert_eq!(f.metadata()[0].0, "general.architecture");
    assert_eq!(f.metadata()[1].0, "t.u8");
    // every scalar and array type is covered by the fixture
    let mut types: Vec<u32> = f
        .metadata()
        .iter()
        .map(|(_, v)| v.value_type().code())
        .collect();
    let mut elems: Vec<u32> = f
        .metadata()
        .iter()
        .filter_map(|(_, v)| v.as_array().map(|a| a.element_type().code()))
        .collect();
    types.sort_unstable();
    types.dedup();
    elems.sort_unstable();
    elems.dedup();
    assert_eq!(types, (0..=12).collect::<Vec<_>>());
    assert_eq!(elems, (0..=12).filter(|&c| c != 9).collect::<Vec<_>>());
}

#[test]
fn written_file_round_trips_through_the_filesystem() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("m.gguf");
    let n = common::sample_writer().write(&path).expect("write");
    assert_eq!(std::fs::metadata(&path).expect("stat").len(), n);
    // no partial file is left behind
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .expect("readdir")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("m.gguf")]);
    let f = GgufFile::open(&path).expect("open");
    assert_eq!(f.path(), path);
    assert_eq!(f.file_len(), n);
    assert_eq!(f.get_u64("t.u64").expect("u64"), u64::MAX);
}

#[test]
fn tensors_round_trip_with_aligned_offsets() {
    let f = GgufFile::from_bytes("sample.gguf", common::sample_bytes()).expect("parse");
    let names: Vec<&str> = f.tensors().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["a.f32", "b.f16", "c.q8_0"]);
    assert_eq!(f.alignment(), 32);
    assert_eq!(f.data_offset() % 32, 0);
    for t in f.tensors() {
        assert_eq!(t.offset % 32, 0, "{}", t.name);
    }
    let a = f.tensor("a.f32").expect("a");
    assert_eq!(a.dims, [4, 3]);
    assert_eq!(a.ggml_type, GgmlType::F32);
    assert_eq!(a.n_bytes, 48);
    assert_eq!(a.n_elements(), 12);
    let vals: Vec<f32> = f
        .tensor_data(a)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    assert_eq!(vals[0], -2.0);
    assert_eq!(vals[11], 3.5);
    let b = f.tensor("b.f16").expect("b");
    assert_eq!(b.n_bytes, 12);
    let halfs: Vec<f32> = f
        .tensor_data(b)
        .chunks_exact(2)
        .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect();
    assert_eq!(halfs, [-2.0, -1.5, -1.0, -0.5, 0.0, 0.5]);
    let c = f.tensor("c.q8_0").expect("c");
    assert_eq!(c.n_bytes, 68);
    assert_eq!(f.tensor_data(c), (0..68u8).collect::<Vec<_>>());
    // the file ends exactly at the last tensor's data
    assert_eq!(f.data_offset() + c.offset + c.n_bytes, f.file_len());
    assert_eq!(f.total_tensor_bytes(), 48 + 12 + 68);
    assert!(f.tensor("nope").is_none());
    assert!(matches!(
        f.require_tensor("nope"),
        Err(GgufError::MissingTensor { tensor, .. }) if tensor == "nope"
    ));
}

#[test]
fn integer_accessors_accept_any_integer_that_fits() {
    let f = GgufFile::from_bytes("sample.gguf", common::sample_bytes()).expect("parse");
    assert_eq!(f.get_u32("t.u8").expect("u8 as u32"), 255);
    assert_eq!(f.get_u64("t.u32").expect("u32 as u64"), 4_000_000_000);
    assert_eq!(f.get_i64("t.i8").expect("i8 as i64"), -128);
    assert_eq!(f.get_i32("t.i16").expect("i16 as i32"), -32_768);
    assert_eq!(f.get_as::<u16>("t.u8").expect("u8 as u16"), 255);
    assert_eq!(
        f.get_f64("t.f32").expect("f32 as f64"),
        f64::from(-1.5e-7f32)
    );
    assert!((f.get_f32("t.f64").expect("f64 as f32") - std::f32::consts::PI).abs() < 1e-6);
    assert!(f.get_bool("t.bool").expect("bool"));
    assert_eq!(f.get_str("t.string").expect("str"), "héllo ✓ \u{0}nul");
    assert_eq!(f.get_str_array("a.string").expect("strs")[0], "Ġthe");
    assert_eq!(f.get_i32_array("a.i32").expect("i32s"), [1, 3, -5]);
    assert_eq!(f.get_f32_array("a.f32").expect("f32s")[0], 0.25);
    assert_eq!(f.get_array("a.u8").expect("arr").len(), 3);
    assert_eq!(f.get_opt::<u32>("absent").expect("opt"), None);
    assert_eq!(f.get_opt::<u32>("t.u8").expect("opt"), Some(255));
}

#[test]
fn accessors_report_missing_keys_and_wrong_types_with_the_file() {
    let f = GgufFile::from_bytes("/models/x.gguf", common::sample_bytes()).expect("parse");
    match f.get_u32("absent.key") {
        Err(GgufError::MissingKey { key, file }) => {
            assert_eq!(key, "absent.key");
            assert_eq!(file, std::path::Path::new("/models/x.gguf"));
        }
        other => panic!("expected MissingKey, got {other:?}"),
    }
    // out of range: u64::MAX does not fit u32
    let e = f.get_u32("t.u64").expect_err("out of range");
    assert!(
        matches!(&e, GgufError::WrongType { key, .. } if key == "t.u64"),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "/models/x.gguf: metadata key 't.u64' is u64 18446744073709551615, expected an integer \
         fitting u32"
    );
    // negative into unsigned
    assert!(matches!(
        f.get_u64("t.i8"),
        Err(GgufError::WrongType { .. })
    ));
    // string is not an integer, an integer is not a string, floats are not integers
    assert!(matches!(
        f.get_u32("t.string"),
        Err(GgufError::WrongType { .. })
    ));
    assert!(matches!(
        f.get_str("t.u32"),
        Err(GgufError::WrongType { .. })
    ));
    assert!(matches!(
        f.get_u32("t.f32"),
        Err(GgufError::WrongType { .. })
    ));
    assert!(matches!(
        f.get_bool("t.u8"),
        Err(GgufError::WrongType { .. })
    ));
    let e = f.get_str_array("a.i32").expect_err("not strings");
    assert!(e.to_string().contains("array<i32>[3]"), "{e}");
    assert!(matches!(
        f.get_opt::<u32>("t.string"),
        Err(GgufError::WrongType { .. })
    ));
}

#[test]
fn custom_alignment_is_honoured() {
    let mut w = GgufWriter::new();
    w.add("general.alignment", 64u32).expect("alignment");
    w.add_f32_tensor("x", &[3], &[1.0, 2.0, 3.0], GgmlType::F32)
        .expect("x");
    w.add_f32_tensor("y", &[1], &[4.0], GgmlType::F32)
        .expect("y");
    assert_eq!(w.alignment(), 64);
    let f = GgufFile::from_bytes("a.gguf", w.to_bytes()).expect("parse");
    assert_eq!(f.alignment(), 64);
    assert_eq!(f.data_offset() % 64, 0);
    assert_eq!(f.tensor("y").expect("y").offset, 64);
    assert_eq!(
        f.tensor_data(f.tensor("y").expect("y")),
        4.0f32.to_le_bytes()
    );
}

#[test]
fn version_2_files_are_read() {
    let mut bytes = common::sample_bytes();
    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    let f = GgufFile::from_bytes("v2.gguf", bytes).expect("v2");
    assert_eq!(f.version(), 2);
}

#[test]
fn file_without_tensors_round_trips() {
    let mut w = GgufWriter::new();
    w.add("k", "v").expect("k");
    let f = GgufFile::from_bytes("meta-only.gguf", w.to_bytes()).expect("parse");
    assert!(f.tensors().is_empty());
    assert_eq!(f.get_str("k").expect("k"), "v");
    let empty = GgufFile::from_bytes("empty.gguf", GgufWriter::new().to_bytes()).expect("parse");
    assert!(empty.metadata().is_empty());
}

#[test]
fn writer_rejects_bad_input() {
    let mut w = GgufWriter::new();
    w.add("k", 1u32).expect("k");
    assert!(matches!(w.add("k", 2u32), Err(WriteError::DuplicateKey { key }) if key == "k"));
    assert!(matches!(w.add("", 2u32), Err(WriteError::EmptyKey)));
    assert!(matches!(
        w.add("general.alignment", 48u32),
        Err(WriteError::BadAlignment { .. })
    ));
    assert!(matches!(
        w.add("general.alignment", 64u64),
        Err(WriteError::BadAlignment { .. })
    ));
    assert!(matches!(
        w.add_tensor("t", &[3], GgmlType::F32, vec![0; 11]),
        Err(WriteError::SizeMismatch {
            expected: 12,
            actual: 11,
            ..
        })
    ));
    assert!(matches!(
        w.add_tensor("q", &[16], GgmlType::Q4_0, vec![0; 9]),
        Err(WriteError::BadShape { .. })
    ));
    assert!(matches!(
        w.add_tensor("z", &[], GgmlType::F32, vec![]),
        Err(WriteError::BadShape { .. })
    ));
    assert!(matches!(
        w.add_tensor("d", &[1, 1, 1, 1, 1], GgmlType::F32, vec![0; 4]),
        Err(WriteError::BadShape { .. })
    ));
    let long = "x".repeat(64);
    assert!(matches!(
        w.add_tensor(long, &[1], GgmlType::F32, vec![0; 4]),
        Err(WriteError::TensorNameTooLong { len: 64, .. })
    ));
    w.add_tensor("t", &[1], GgmlType::F32, vec![0; 4])
        .expect("t");
    assert!(matches!(
        w.add_tensor("t", &[1], GgmlType::F32, vec![0; 4]),
        Err(WriteError::DuplicateTensor { .. })
    ));
    assert!(matches!(
        w.add_f32_tensor("q", &[32], &[0.0; 32], GgmlType::Q8_0),
        Err(WriteError::BadShape { .. })
    ));
}

#[test]
fn write_failure_names_the_file_and_leaves_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("missing-dir").join("m.gguf");
    let e = common::sample_writer()
        .write(&path)
        .expect_err("no such dir");
    let WriteError::Io { file, .. } = &e else {
        panic!("expected Io, got {e:?}");
    };
    assert!(file.to_string_lossy().contains("m.gguf"), "{e}");
    assert!(file.to_string_lossy().ends_with(".partial"), "{e}");
    assert!(!path.exists());
}

#[test]
fn value_type_codes_are_the_spec_codes() {
    for code in 0..=12 {
        let t = ValueType::from_code(code).expect("known code");
        assert_eq!(t.code(), code);
    }
    assert_eq!(ValueType::from_code(13), None);
    assert_eq!(Value::from("x").value_type(), ValueType::String);
    assert_eq!(
        Value::from(vec![1i32, 2]),
        Value::Array(ArrayValue::I32s(vec![1, 2]))
    );
}

#[test]
fn real_gguf_metadata_if_available() {
    // Tier (c): set MOLT_REAL_GGUF to a real model (e.g. Qwen2.5-Coder-0.5B-Instruct Q4_K_M).
    let Some(path) = std::env::var_os("MOLT_REAL_GGUF") else {
        eprintln!("MOLT_REAL_GGUF not set: skipping the real-file check");
        return;
    };
    let t = std::time::Instant::now();
    let f = GgufFile::open(&path).expect("open real file");
    let elapsed = t.elapsed();
    let n = f
        .get_str_array("tokenizer.ggml.tokens")
        .expect("tokens")
        .len();
    let m = f
        .get_str_array("tokenizer.ggml.merges")
        .expect("merges")
        .len();
    eprintln!(
        "{}: {} kv, {} tensors, {n} tokens, {m} merges, parsed in {elapsed:?}",
        f.path().display(),
        f.metadata().len(),
        f.tensors().len()
    );
    assert!(n > 100_000, "vocab truncated? {n}");
    assert!(m > 100_000, "merges truncated? {m}");
    assert!(elapsed < std::time::Duration::from_secs(2), "{elapsed:?}");
    // a truncated download of the same file is refused with the tensor named
    let cut = f.bytes()[..(f.data_offset() as usize + 1000)].to_vec();
    let e = GgufFile::from_bytes("cut.gguf", cut).expect_err("truncated");
    assert!(matches!(e, GgufError::TruncatedTensorData { .. }), "{e}");
}
