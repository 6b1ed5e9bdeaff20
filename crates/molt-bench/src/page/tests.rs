use super::*;

#[test]
fn the_curve_section_lists_every_point_from_its_json() {
    let doc: CurveDoc = serde_json::from_value(serde_json::json!({
        "ladder": "l",
        "curve": {
            "route": "a→b", "window": 256, "held_out_every": 5, "held_out_tokens": 2980,
            "held_out_rows": 2934, "base_train_tokens": 11623, "extra_available_tokens": 0,
            "collect_ms": [], "skipped_sizes": [],
            "points": [
                {"train_tokens": 3657, "extra_tokens": 0, "train_windows": 15, "train_rows": 3597,
                 "k_held_out": 0.07, "v_held_out": 0.81, "k_train": 0.05, "v_train": 0.6,
                 "lambda": {"k": 12.5, "v": null}, "fit_ms": 1.0},
                {"train_tokens": 30000, "extra_tokens": 18377, "train_windows": 118,
                 "train_rows": 29528, "k_held_out": 0.06, "v_held_out": 0.74, "k_train": 0.055,
                 "v_train": 0.7, "lambda": {"k": 40.0, "v": 90.0}, "fit_ms": 1.0}
            ]
        }
    }))
    .unwrap();
    let s = curve_section(&doc);
    assert!(
        s.contains("(a→b)") && s.contains("2980 held-out tokens"),
        "{s}"
    );
    assert!(
        s.contains("| 3657 | 0 | 0.0700 | 0.0500 | 0.8100 | 0.6000 | 1.25e1 / – |"),
        "{s}"
    );
    assert!(s.contains("| 30000 | 18377 | 0.0600 |"), "{s}");
}
