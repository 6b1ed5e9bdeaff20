use super::*;
use crate::transplant::rope::RopeSpec;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub(crate) fn binding(name: &str, sha: &str, n_layer: usize) -> RungBinding {
    RungBinding {
        name: name.into(),
        file: format!("{name}.gguf"),
        sha256: sha.into(),
        n_layer,
        n_kv_heads: 2,
        head_dim: 4,
        rope: RopeSpec::neox(4, 1e6),
    }
}

fn rand_affine(d_in: usize, d_out: usize, rng: &mut ChaCha8Rng) -> Affine {
    Affine {
        w: Array2::from_shape_fn((d_in, d_out), |_| rng.random_range(-1.0f32..1.0)),
        b: Array1::from_shape_fn(d_out, |_| rng.random_range(-5.0f32..5.0)),
    }
}

/// A projector exercising every map kind (same geometry, 8 wide).
fn sample() -> Projector {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let fit = LayerFit {
        lambda_k: Some(0.5),
        lambda_v: None,
        k_train_rel_rms: 0.01,
        k_held_out_rel_rms: 0.02,
        v_train_rel_rms: 0.03,
        v_held_out_rel_rms: 0.04,
    };
    let per_head = LayerMap::PerHead {
        in_dim: 16,
        out_dim: 8,
        blocks: (0..2)
            .map(|h| HeadBlock {
                input_ranges: vec![(4 * h, 4 * h + 4), (8 + 4 * h, 12 + 4 * h)],
                output_offset: 4 * h,
                affine: rand_affine(8, 4, &mut rng),
            })
            .collect(),
    };
    let layers = vec![
        LayerProjection {
            src_layers: vec![0],
            k: LayerMap::Identity { dim: 8 },
            v: LayerMap::Affine(rand_affine(8, 8, &mut rng)),
            fit: Some(fit),
        },
        LayerProjection {
            src_layers: vec![1],
            k: LayerMap::Diagonal {
                scale: Array1::from_shape_fn(8, |i| 1.0 + i as f32 / 100.0),
                offset: Array1::from_shape_fn(8, |i| i as f32),
            },
            v: LayerMap::Truncate {
                n_heads_in: 2,
                head_dim_in: 4,
                n_heads_out: 2,
                head_dim_out: 4,
            },
            fit: None,
        },
        LayerProjection {
            src_layers: vec![1, 2],
            k: per_head.clone(),
            v: per_head,
            fit: None,
        },
    ];
    Projector {
        src: binding("big", "aa11", 3),
        dst: binding("small", "bb22", 3),
        kind: ProjectorKind::Dense,
        sandwich: true,
        layers,
    }
}

fn p() -> PathBuf {
    PathBuf::from("test.molt-proj")
}

#[test]
fn f32_round_trip_is_exact() {
    let proj = sample();
    let bytes = proj.to_bytes(TensorDtype::F32).unwrap();
    assert_eq!(&bytes[..8], b"MOLTPROJ");
    let back = Projector::from_bytes(&bytes, &p()).unwrap();
    assert_eq!(back, proj);
}

#[test]
fn f16_round_trip_is_close_and_half_size() {
    let proj = sample();
    let b32 = proj.to_bytes(TensorDtype::F32).unwrap();
    let b16 = proj.to_bytes(TensorDtype::F16).unwrap();
    assert!(b16.len() < b32.len());
    let back = Projector::from_bytes(&b16, &p()).unwrap();
    let (LayerMap::Affine(a), LayerMap::Affine(b)) = (&proj.layers[0].v, &back.layers[0].v) else {
        panic!("layer 0 V should stay dense");
    };
    let err = (&a.w - &b.w).iter().fold(0f32, |m, d| m.max(d.abs()));
    assert!(err > 0.0 && err < 1e-3, "f16 error {err}");
}

#[test]
fn f16_overflow_is_refused() {
    let mut proj = sample();
    if let LayerMap::Affine(a) = &mut proj.layers[0].v {
        a.b[0] = 1e6;
    }
    assert!(matches!(
        proj.to_bytes(TensorDtype::F16),
        Err(ProjectorError::Invalid { .. })
    ));
    assert!(proj.to_bytes(TensorDtype::F32).is_ok());
}

#[test]
fn save_load_checks_binding() {
    let dir = std::env::temp_dir().join(format!("molt-proj-test-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    let path = dir.join("r.molt-proj");
    let proj = sample();
    proj.save(&path, TensorDtype::F32).unwrap();
    assert_eq!(Projector::load(&path, "AA11", "bb22").unwrap(), proj);
    let err = Projector::load(&path, "aa11", "cc33").unwrap_err();
    match &err {
        ProjectorError::BoundToOtherFiles {
            expected_dst_sha256,
            found_dst_sha256,
            found_dst_file,
            found_src_name,
            ..
        } => {
            assert_eq!(expected_dst_sha256, "cc33");
            assert_eq!(found_dst_sha256, "bb22");
            assert_eq!(found_dst_file, "small.gguf");
            assert_eq!(found_src_name, "big");
        }
        other => panic!("wrong error {other}"),
    }
    let msg = err.to_string();
    for needle in ["cc33", "bb22", "small.gguf", "big.gguf", "r.molt-proj"] {
        assert!(msg.contains(needle), "{msg} lacks {needle}");
    }
    assert!(matches!(
        Projector::load(&dir.join("missing"), "aa11", "bb22"),
        Err(ProjectorError::Io { .. })
    ));
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn every_prefix_is_an_error() {
    let bytes = sample().to_bytes(TensorDtype::F16).unwrap();
    for n in 0..bytes.len() {
        assert!(
            Projector::from_bytes(&bytes[..n], &p()).is_err(),
            "prefix {n} parsed"
        );
    }
    let mut longer = bytes.clone();
    longer.push(0);
    assert!(matches!(
        Projector::from_bytes(&longer, &p()),
        Err(ProjectorError::TrailingBytes { extra: 1, .. })
    ));
}

#[test]
fn every_header_byte_flip_is_an_error() {
    let bytes = sample().to_bytes(TensorDtype::F32).unwrap();
    let header_end = PREFIX_LEN
        + usize::try_from(u64::from_le_bytes(bytes[16..24].try_into().unwrap())).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    for i in 0..header_end {
        let mut bad = bytes.clone();
        bad[i] ^= 1u8 << rng.random_range(0..8);
        assert!(
            Projector::from_bytes(&bad, &p()).is_err(),
            "flip at {i} parsed"
        );
    }
    // And random flips in the data section.
    for _ in 0..200 {
        let i = rng.random_range(header_end..bytes.len());
        let mut bad = bytes.clone();
        bad[i] ^= 1u8 << rng.random_range(0..8);
        assert!(matches!(
            Projector::from_bytes(&bad, &p()),
            Err(ProjectorError::Checksum {
                section: "data",
                ..
            })
        ));
    }
}

#[test]
fn hostile_header_with_valid_checksum_is_an_error() {
    // Re-sign a header that points a tensor far outside the data section.
    let bytes = sample().to_bytes(TensorDtype::F32).unwrap();
    let hlen = usize::try_from(u64::from_le_bytes(bytes[16..24].try_into().unwrap())).unwrap();
    let json = std::str::from_utf8(&bytes[PREFIX_LEN..PREFIX_LEN + hlen]).unwrap();
    let hostile = json.replacen("\"offset\":0,", "\"offset\":18446744073709551000,", 1);
    assert_ne!(hostile, json);
    let huge = json.replacen("\"shape\":[8,8]", "\"shape\":[4294967296,4294967296]", 1);
    assert_ne!(huge, json);
    for h in [hostile, huge] {
        let mut out = bytes[..16].to_vec();
        out.extend_from_slice(&(h.len() as u64).to_le_bytes());
        out.extend_from_slice(&Sha256::digest(h.as_bytes()));
        out.extend_from_slice(h.as_bytes());
        out.extend_from_slice(&bytes[PREFIX_LEN + hlen..]);
        assert!(matches!(
            Projector::from_bytes(&out, &p()),
            Err(ProjectorError::Invalid { .. })
        ));
    }
}

#[test]
fn magic_version_and_validation() {
    let bytes = sample().to_bytes(TensorDtype::F32).unwrap();
    let mut bad = bytes.clone();
    bad[0] = b'X';
    assert!(matches!(
        Projector::from_bytes(&bad, &p()),
        Err(ProjectorError::BadMagic { .. })
    ));
    let mut v2 = bytes.clone();
    v2[8] = 2;
    assert!(matches!(
        Projector::from_bytes(&v2, &p()),
        Err(ProjectorError::UnsupportedVersion { found: 2, .. })
    ));
    let mut proj = sample();
    proj.layers[2].src_layers = vec![1, 5];
    assert!(matches!(
        proj.to_bytes(TensorDtype::F32),
        Err(ProjectorError::Transplant(
            TransplantError::LayerOutOfRange { layer: 5, .. }
        ))
    ));
    let mut proj = sample();
    proj.layers.pop();
    assert!(proj.validate().is_err());
    let mut proj = sample();
    proj.layers[0].src_layers = vec![0, 1];
    assert!(matches!(
        proj.validate(),
        Err(TransplantError::ShapeMismatch {
            what: "K map input width",
            ..
        })
    ));
}
