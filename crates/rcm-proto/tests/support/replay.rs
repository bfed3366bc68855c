//! What the byte-driven engine tests (`engine_bytes.rs`, `iw_bytes.rs`) share: which seeds
//! to run, and replaying the inputs kept in `testdata/`.

/// The seeds to run: the one in `one` (an environment variable) if set, else 1 to the number
/// in `count`, else 1 to `default`.
pub fn seeds(one: &str, count: &str, default: u64) -> Vec<u64> {
    if let Ok(s) = std::env::var(one) {
        return vec![s.parse().unwrap_or_else(|_| panic!("{one} is a number"))];
    }
    let n = std::env::var(count)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    (1..=n).collect()
}

/// Runs every `testdata/<dir>/*.bin` through `run`, failing with the file's name; there must
/// be at least one.
pub fn kept_inputs<T>(dir: &str, run: impl Fn(&[u8]) -> Result<T, String>) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata")
        .join(dir);
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("a directory entry").path();
        if path.extension().is_some_and(|e| e == "bin") {
            let input = std::fs::read(&path).expect("a kept input");
            if let Err(e) = run(&input) {
                panic!("{}: {e}", path.display());
            }
            n += 1;
        }
    }
    assert!(n > 0, "no kept input in {}", dir.display());
}
