//! Shared fixtures for the integration tests: a small GGUF image with every value type.
#![allow(dead_code)] // each test binary uses a different subset

use molt::gguf::{ArrayValue, GgmlType, GgufWriter, Value};

/// One metadata pair per scalar type and per array element type, with edge values.
pub fn all_values() -> Vec<(&'static str, Value)> {
    vec![
        ("t.u8", Value::U8(255)),
        ("t.i8", Value::I8(-128)),
        ("t.u16", Value::U16(65_535)),
        ("t.i16", Value::I16(-32_768)),
        ("t.u32", Value::U32(4_000_000_000)),
        ("t.i32", Value::I32(-2_000_000_000)),
        ("t.f32", Value::F32(-1.5e-7)),
        ("t.bool", Value::Bool(true)),
        ("t.string", Value::String("héllo ✓ \u{0}nul".to_owned())),
        ("t.empty_string", Value::String(String::new())),
        ("t.u64", Value::U64(u64::MAX)),
        ("t.i64", Value::I64(i64::MIN)),
        ("t.f64", Value::F64(std::f64::consts::PI)),
        ("a.u8", ArrayValue::U8s(vec![0, 1, 255]).into()),
        ("a.i8", ArrayValue::I8s(vec![-1, 0, 127]).into()),
        ("a.u16", ArrayValue::U16s(vec![1, 65_535]).into()),
        ("a.i16", ArrayValue::I16s(vec![-300, 300]).into()),
        ("a.u32", ArrayValue::U32s(vec![7, u32::MAX]).into()),
        ("a.i32", ArrayValue::I32s(vec![1, 3, -5]).into()),
        (
            "a.f32",
            ArrayValue::F32s(vec![0.25, f32::INFINITY, -0.0]).into(),
        ),
        ("a.bool", ArrayValue::Bools(vec![true, false, true]).into()),
        (
            "a.string",
            ArrayValue::Strings(vec!["Ġthe".into(), String::new(), "<|im_end|>".into()]).into(),
        ),
        ("a.u64", ArrayValue::U64s(vec![u64::MAX, 0]).into()),
        ("a.i64", ArrayValue::I64s(vec![i64::MIN, i64::MAX]).into()),
        ("a.f64", ArrayValue::F64s(vec![1e300, -2.5]).into()),
        ("a.empty", ArrayValue::Strings(Vec::new()).into()),
    ]
}

/// A writer holding [`all_values`] and three tensors (F32, F16 and two `Q8_0` blocks of
/// raw bytes).
pub fn sample_writer() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.add("general.architecture", "qwen2").expect("add");
    for (k, v) in all_values() {
        w.add(k, v).expect("add");
    }
    let f: Vec<f32> = (0..12u8).map(|i| f32::from(i) * 0.5 - 2.0).collect();
    w.add_f32_tensor("a.f32", &[4, 3], &f, GgmlType::F32)
        .expect("tensor");
    w.add_f32_tensor("b.f16", &[6], &f[..6], GgmlType::F16)
        .expect("tensor");
    let q8: Vec<u8> = (0..68u8).collect();
    w.add_tensor("c.q8_0", &[64], GgmlType::Q8_0, q8)
        .expect("tensor");
    w
}

/// The bytes of [`sample_writer`].
pub fn sample_bytes() -> Vec<u8> {
    sample_writer().to_bytes()
}

/// A hand-built header: magic, version 3, the two counts.
pub fn header(n_tensors: u64, n_kv: u64) -> Vec<u8> {
    let mut v = b"GGUF".to_vec();
    v.extend(3u32.to_le_bytes());
    v.extend(n_tensors.to_le_bytes());
    v.extend(n_kv.to_le_bytes());
    v
}

/// Appends a GGUF string.
pub fn push_str(v: &mut Vec<u8>, s: &str) {
    v.extend((s.len() as u64).to_le_bytes());
    v.extend(s.as_bytes());
}
