//! What `rcm stress` reports as checked, end to end: device removal is listed only when it
//! ran, and the counts of failures the run used to ignore are in its JSON. (The checks
//! themselves, fed violations no correct rcm produces, are unit tests in `stress.rs`.)

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

mod common;

use common::{rcm, Started};

const REMOVAL: &str = "device removal completes within 10 s of its ids' destruction";

/// In process, the remover runs: removal is checked, and nothing failed or panicked.
#[test]
fn stress_in_process_lists_removal_as_checked() {
    let (code, out, err) = rcm(&[
        "stress",
        "-d",
        "1",
        "--seed",
        "41",
        "--udp-port",
        "41001",
        "--json",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    let r: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(r["violations"], serde_json::json!([]), "{out}");
    assert!(r["removals"].as_u64().unwrap_or(0) > 0, "{out}");
    assert_eq!(r["removal_failures"], 0, "{out}");
    assert_eq!(r["panics"], 0, "{out}");
    assert!(r["channel_events_at_end"].is_u64(), "{out}");
    let checked = r["invariants"].as_array().expect("invariants");
    assert!(checked.iter().any(|i| i == REMOVAL), "{out}");
    assert_eq!(r["not_checked"], serde_json::json!([]), "{out}");
}

/// Through a daemon nothing is removed, so removal is not printed as checked.
#[test]
fn stress_through_a_daemon_does_not_claim_removal() {
    let path: PathBuf =
        std::env::temp_dir().join(format!("rcm-cli-sc-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let p = path.to_str().expect("UTF-8 path");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rcm"));
    cmd.args([
        "daemon",
        "--socket",
        p,
        "--udp-port",
        "41002",
        "--bind",
        "127.0.0.1",
        "--bind",
        "127.0.0.2",
    ]);
    let daemon = Started::serving(cmd, Duration::from_secs(10));
    let (code, out, err) = rcm(&["stress", "--daemon", p, "-d", "1", "--seed", "42"]);
    let (jcode, json, jerr) = rcm(&["stress", "--daemon", p, "-d", "1", "--seed", "43", "--json"]);
    drop(daemon);
    let _ = std::fs::remove_file(&path);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains("checked: no callback runs after destroy"),
        "{out}"
    );
    assert!(!out.contains(REMOVAL), "{out}");
    assert_eq!(jcode, 0, "{json}\n{jerr}");
    let r: serde_json::Value = serde_json::from_str(&json).expect("JSON");
    assert_eq!(r["removals"], 0, "{json}");
    assert_eq!(r["not_checked"], serde_json::json!([REMOVAL]), "{json}");
}
