//! `molt-run ladder init` / `ladder list` on the tiny models: a ladder of one's own files in
//! one command, ordered largest first and fitted, and refusals that name the files.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use molt::ladder::Ladder;
use molt::ladder::init::{self, InitError};

fn molt_run() -> Command {
    let mut c = Command::new(common::molt_run());
    c.env("OMP_WAIT_POLICY", "PASSIVE");
    c
}

/// The tiny files: big (f32), big requantized to Q8_0, small, and alt (another tokenizer).
fn files() -> (PathBuf, PathBuf, PathBuf, PathBuf) {
    let l = common::tiny_ladder();
    let dir = common::fixture_dir();
    (
        l.rungs[0].path.clone(),
        l.rungs[1].path.clone(),
        l.rungs[2].path.clone(),
        dir.join("tiny-alt.gguf"),
    )
}

fn plan(files: &[&Path]) -> Result<init::Plan, InitError> {
    let files: Vec<PathBuf> = files.iter().map(|p| p.to_path_buf()).collect();
    init::plan("mine", &files, &mut |_| {})
}

#[test]
fn files_given_in_any_order_become_a_ladder_largest_first() {
    let (big, q8, small, _) = files();
    let p = plan(&[&small, &big, &q8]).expect("a ladder");
    let order: Vec<&str> = p.manifest.rungs.iter().map(|r| r.file.as_str()).collect();
    assert_eq!(
        order,
        vec!["tiny-big.gguf", "tiny-big-q8_0.gguf", "tiny-small.gguf"]
    );
    let names: Vec<&str> = p.manifest.rungs.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, vec!["tier0", "tier1", "tier2"]);
    assert!(p.rungs.windows(2).all(|w| w[0].bytes > w[1].bytes));

    // Written into a directory of its own (the files linked there), it opens as a ladder
    // whose rungs are the files given, hashes checked.
    let dir = tempfile::tempdir().unwrap();
    let manifest = init::write(&p, dir.path(), false).expect("written");
    let lock = molt::ladder::Lock::load(&molt::ladder::Lock::path(dir.path(), "mine"));
    assert_eq!(lock.files.len(), 3, "the lock records every rung's hash");
    let ladder = Ladder::open(&manifest, dir.path()).expect("opens");
    assert_eq!(ladder.names(), vec!["tier0", "tier1", "tier2"]);
    assert_eq!(
        ladder.rungs[2].path.canonicalize().unwrap(),
        small.canonicalize().unwrap()
    );
    // A second init of the same name is refused unless forced; nothing is lost.
    let again = init::write(&p, dir.path(), false).unwrap_err();
    assert!(matches!(again, InitError::Exists(_)), "{again}");
    init::write(&p, dir.path(), true).expect("forced");
    assert!(Ladder::open(&manifest, dir.path()).is_ok());
    assert!(
        init::list(&[dir.path().to_path_buf()])
            .iter()
            .any(|f| f.manifest.as_ref().is_ok_and(|m| m.name == "mine"))
    );
}

#[test]
fn files_that_cannot_make_a_ladder_are_refused_by_name() {
    let (big, q8, _, alt) = files();
    let e = plan(&[&big, &alt]).unwrap_err();
    assert!(matches!(e, InitError::Tokenizer { .. }), "{e}");
    let m = e.to_string();
    assert!(
        m.contains("tiny-big.gguf") && m.contains("tiny-alt.gguf") && m.contains("tokenizer"),
        "{m}"
    );

    let e = plan(&[&big, &q8, &big]).unwrap_err();
    assert!(matches!(e, InitError::Duplicate { .. }), "{e}");
    assert!(e.to_string().contains("tiny-big.gguf"), "{e}");

    // The same contents under another name is the same model.
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("copy.gguf");
    std::fs::copy(&q8, &copy).unwrap();
    let e = plan(&[&q8, &copy]).unwrap_err();
    assert!(
        matches!(e, InitError::Duplicate { .. }) && e.to_string().contains("copy.gguf"),
        "{e}"
    );

    // A file that is not a model, and one that is truncated.
    let junk = dir.path().join("notes.gguf");
    std::fs::write(&junk, b"not a model").unwrap();
    let e = plan(&[&big, &junk]).unwrap_err();
    assert!(
        matches!(e, InitError::Gguf { .. }) && e.to_string().contains("notes.gguf"),
        "{e}"
    );
    let cut = dir.path().join("cut.gguf");
    let bytes = std::fs::read(&q8).unwrap();
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let e = plan(&[&big, &cut]).unwrap_err();
    assert!(e.to_string().contains("cut.gguf"), "{e}");

    let e = plan(&[&big]).unwrap_err();
    assert!(matches!(e, InitError::TooFew(1)), "{e}");
    let e = init::plan("../up", &[big.clone(), q8.clone()], &mut |_| {}).unwrap_err();
    assert!(matches!(e, InitError::BadName(_)), "{e}");
}

/// The whole command: files in, a fitted ladder out that answers across a switch with the
/// projectors it fitted (no re-prefill), and `ladder list` shows it.
#[test]
fn ladder_init_fits_a_ladder_a_session_switches_on() {
    let (big, _, small, _) = files();
    let home = tempfile::tempdir().unwrap();
    let models = home.path().join("models");
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/tiny");
    let out = molt_run()
        .args(["--n-ctx", "512", "--threads", "2", "ladder", "init", "mine"])
        .arg("--rung")
        .arg(&small)
        .arg("--rung")
        .arg(&big)
        .arg("--dir")
        .arg(&models)
        .arg("--corpus")
        .arg(&corpus)
        .output()
        .unwrap();
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{log}");
    assert!(log.contains("elapsed") && log.contains("left"), "{log}");
    assert!(log.contains("ready in"), "{log}");
    let proj = home.path().join("projectors").join("mine");
    assert!(
        proj.join("tier0-to-tier1.dense.molt-proj").exists(),
        "{log}"
    );
    assert!(
        proj.join("tier1-to-tier0.dense.molt-proj").exists(),
        "{log}"
    );

    // The ladder lists, and a generation that is cut to the small rung migrates with the
    // fitted projector.
    let list = molt_run()
        .env("MOLT_HOME", home.path())
        .args(["ladder", "list"])
        .output()
        .unwrap();
    let listed = String::from_utf8_lossy(&list.stdout);
    assert!(
        listed.contains("mine") && listed.contains("tier1"),
        "{listed}"
    );
    let trace = home.path().join("cut.json");
    std::fs::write(
        &trace,
        r#"{"name":"cut","clock":"token","initial":100000,"events":[{"at":3,"frac":1.05,"of":"tier1"}]}"#,
    )
    .unwrap();
    let gen_out = molt_run()
        .env("MOLT_HOME", home.path())
        .args(["--ladder", "mine", "--threads", "1", "generate"])
        .args(["--prompt", "hello there", "--max-tokens", "8", "--trace"])
        .arg(&trace)
        .output()
        .unwrap();
    let g = format!(
        "{}{}",
        String::from_utf8_lossy(&gen_out.stdout),
        String::from_utf8_lossy(&gen_out.stderr)
    );
    assert!(gen_out.status.success(), "{g}");
    let row: serde_json::Value =
        serde_json::from_slice(&gen_out.stdout).unwrap_or_else(|e| panic!("{e}: {g}"));
    let sw = &row["switches"][0];
    assert_eq!(
        (&sw["from"], &sw["to"], &sw["method"]),
        (&"tier0".into(), &"tier1".into(), &"molt".into()),
        "{g}"
    );
}

fn log_of(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Generates 8 tokens on ladder `name` (found through `MOLT_HOME`) under a budget cut to
/// `mib` MiB at token 3, and returns the first switch (null: none).
fn switch_under_cut(home: &Path, name: &str, mib: u64) -> serde_json::Value {
    let trace = home.join(format!("cut-{mib}.json"));
    std::fs::write(
        &trace,
        format!(
            r#"{{"name":"cut","clock":"token","unit":"MiB","initial":100000,"events":[{{"at":3,"budget":{mib}}}]}}"#
        ),
    )
    .unwrap();
    let out = molt_run()
        .env("MOLT_HOME", home)
        .args(["--ladder", name, "--threads", "1", "generate"])
        .args(["--prompt", "hello there", "--max-tokens", "8", "--trace"])
        .arg(&trace)
        .output()
        .unwrap();
    let g = log_of(&out);
    match serde_json::from_slice::<serde_json::Value>(&out.stdout) {
        Ok(row) => row["switches"][0].clone(),
        // Below every rung: the answer parks, and the token clock cannot resume it.
        Err(_) if g.contains("below every rung") => serde_json::Value::Null,
        Err(e) => panic!("{e}: {g}"),
    }
}

/// The first switch onto rung `to` among budgets falling from 24 MiB (the tiny rungs' needs
/// depend on the machine's buffers, so the budget between two rungs is found, not assumed).
fn first_switch_to(home: &Path, name: &str, to: &str) -> serde_json::Value {
    (4..=24)
        .rev()
        .map(|mib| switch_under_cut(home, name, mib))
        .find(|sw| sw["to"] == to)
        .unwrap_or_else(|| panic!("no budget moved {name} onto {to}"))
}

/// One file and `--requantize`: the precision rung is built with llama.cpp's quantizer beside
/// the manifest and ordered under its source; with no map fitted, a switch onto it carries the
/// cache as it is (a Molt switch, not a re-prefill), and so does a switch onto the smaller
/// model of another ladder made without a fit (its sparse native read projects nothing).
#[test]
fn one_file_and_requantize_make_a_ladder_that_switches_without_a_fit() {
    let (big, _, small, _) = files();
    let home = tempfile::tempdir().unwrap();
    let models = home.path().join("models");
    let out = molt_run()
        .args(["--threads", "2", "ladder", "init", "one", "--no-fit"])
        .arg("--rung")
        .arg(&big)
        .args(["--requantize", "q8_0", "--dir"])
        .arg(&models)
        .output()
        .unwrap();
    let log = log_of(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("[1/1] requantizing") && log.contains("written"),
        "{log}"
    );
    let built = models.join("tiny-big-q8_0.gguf");
    let facts =
        molt::gguf::ModelFacts::from_gguf(&molt::gguf::GgufFile::open(&built).unwrap()).unwrap();
    assert_eq!(facts.file_type_name(), Some("Q8_0"));
    let ladder = Ladder::open(&models.join("one.toml"), &models).expect("opens");
    assert_eq!(ladder.names(), vec!["tier0", "tier1"]);
    assert_eq!(ladder.rungs[1].path.file_name(), built.file_name());
    let sw = first_switch_to(home.path(), "one", "tier1");
    assert_eq!(sw["method"], "molt", "{sw}");
    assert!(
        sw["note"].as_str().is_some_and(|n| n.contains("as it is")),
        "{sw}"
    );

    // A size route with no map: the default switch reads natively and projects nothing.
    let out = molt_run()
        .args(["ladder", "init", "two", "--no-fit", "--rung"])
        .arg(&big)
        .arg("--rung")
        .arg(&small)
        .arg("--dir")
        .arg(&models)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", log_of(&out));
    let sw = first_switch_to(home.path(), "two", "tier1");
    assert_eq!(sw["method"], "molt", "{sw}");
    assert_eq!(sw["sparse"], true, "{sw}");
}

/// Requantize requests that cannot make a rung are refused by name before anything is built,
/// and a ladder refused after its rung was built leaves no file behind.
#[test]
fn requantize_requests_that_cannot_make_a_rung_are_refused_by_name() {
    let (big, q8, _, alt) = files();
    let home = tempfile::tempdir().unwrap();
    let models = home.path().join("models");
    let init = |rungs: &[&Path], types: &[&str]| {
        let mut c = molt_run();
        c.args(["ladder", "init", "bad", "--no-fit", "--dir"])
            .arg(&models);
        for r in rungs {
            c.arg("--rung").arg(r);
        }
        for t in types {
            c.args(["--requantize", t]);
        }
        let out = c.output().unwrap();
        assert!(!out.status.success(), "{}", log_of(&out));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let e = init(&[&big], &["IQ2_XXS"]);
    assert!(
        e.contains("IQ2_XXS") && e.contains("importance matrix"),
        "{e}"
    );
    let e = init(&[&big], &["Q3_K_XL"]);
    assert!(e.contains("unknown quantization type \"Q3_K_XL\""), "{e}");
    let e = init(&[&q8], &["Q8_0"]);
    assert!(e.contains("tiny-big-q8_0.gguf is already Q8_0"), "{e}");
    let e = init(&[&big], &["Q8_0", "q8_0"]);
    assert!(e.contains("Q8_0 given twice"), "{e}");
    // Built, then refused for the other file's tokenizer: the built rung is removed.
    let e = init(&[&big, &alt], &["Q8_0"]);
    assert!(e.contains("tokenizer"), "{e}");
    // Fitting a ladder other than the shipped one never writes over another ladder's report.
    let other = home.path().join("report.json");
    std::fs::write(&other, r#"{"ladder": "qwen2.5-coder", "report": {}}"#).unwrap();
    let out = molt_run()
        .args(["--ladder"])
        .arg({
            common::tiny_ladder();
            common::fixture_dir().join("tiny.toml")
        })
        .args(["train-projectors", "--report"])
        .arg(&other)
        .output()
        .unwrap();
    let e = log_of(&out);
    assert!(!out.status.success() && e.contains("qwen2.5-coder"), "{e}");
    assert!(
        std::fs::read_to_string(&other)
            .unwrap()
            .contains("qwen2.5-coder")
    );
    let left: Vec<_> = std::fs::read_dir(&models)
        .map(|d| d.filter_map(Result::ok).map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "left behind: {left:?}");
}
