//! The tools under valgrind's memcheck: the `unsafe` outside the CM core (coalesced receives
//! and `setsockopt` in `rcm::sys`, the daemon's shared-memory rings in `rcm-shm`) read and
//! write only memory they own, and a program built on rcm can be run under valgrind at all
//! (rustix's vDSO lookup crashed there, rustix issue 1559: rcm no longer asks it for the
//! CPU or the page size).
//!
//! Without valgrind the tests are skipped with a message on stderr, unless
//! `RCM_REQUIRE_VALGRIND=1` is set (CI sets it), in which case they fail.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

mod common;

use common::Started;

/// The exit status valgrind gives a run in which memcheck found an error.
const MEMCHECK_ERRORS: i32 = 99;

/// Whether valgrind can be run here; panics instead of saying no when it is required.
fn have_valgrind(test: &str) -> bool {
    let found = Command::new("valgrind")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        let required = std::env::var("RCM_REQUIRE_VALGRIND").is_ok_and(|v| v == "1");
        assert!(
            !required,
            "RCM_REQUIRE_VALGRIND=1 but valgrind cannot be run (apt-get install valgrind)"
        );
        eprintln!("!!! SKIPPED (no valgrind): {test}");
    }
    found
}

/// `rcm args` under memcheck.
fn memcheck(args: &[&str]) -> Command {
    let mut c = Command::new("valgrind");
    c.args([
        "-q",
        "--error-exitcode=99",
        "--leak-check=no",
        env!("CARGO_BIN_EXE_rcm"),
    ])
    .args(args);
    c
}

/// Runs `rcm args` under memcheck and checks that it found nothing and the tool succeeded;
/// returns the tool's standard output.
fn run_clean(args: &[&str]) -> String {
    let out: Output = memcheck(args).output().expect("run valgrind");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let code = out.status.code();
    assert_ne!(
        code,
        Some(MEMCHECK_ERRORS),
        "memcheck found errors in `rcm {}`:\n{stderr}",
        args.join(" ")
    );
    assert_eq!(
        code,
        Some(0),
        "`rcm {}` under valgrind failed:\n{stdout}\n{stderr}",
        args.join(" ")
    );
    assert!(
        !stderr.contains("Process terminating"),
        "`rcm {}`:\n{stderr}",
        args.join(" ")
    );
    stdout
}

fn json(out: &str) -> serde_json::Value {
    serde_json::from_str(out).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"))
}

/// The in-process tools: RoCEv2 bursts and one-at-a-time connects (coalesced receives),
/// iWARP, UD datagrams, and the stress tester's races.
#[test]
fn in_process_tools_run_clean_under_memcheck() {
    if !have_valgrind("in_process_tools_run_clean_under_memcheck") {
        return;
    }
    // RoCEv2 bursts and one at a time (coalesced receives), iWARP.
    for (args, n) in [
        (&["bench", "-c", "50", "--udp-port", "26911"][..], 50),
        (
            &["bench", "--serial", "-c", "20", "--udp-port", "26912"][..],
            20,
        ),
        (
            &["bench", "--transport", "iwarp", "-c", "20", "-p", "26913"][..],
            20,
        ),
    ] {
        let mut args = args.to_vec();
        args.push("--json");
        let v = json(&run_clean(&args));
        assert_eq!(v["established"], n, "{args:?}: {v}");
        assert_eq!(v["errors"], 0, "{args:?}: {v}");
        // The resident set is still measured (it came from a call that crashed under
        // valgrind).
        if !args.contains(&"--serial") {
            assert!(
                v["rss_per_conn_bytes"].as_f64().is_some_and(|b| b > 0.0),
                "{v}"
            );
        }
    }

    let ud = json(&run_clean(&[
        "ping",
        "--ps",
        "udp",
        "-c",
        "3",
        "--udp-port",
        "26914",
        "--json",
    ]));
    assert_eq!(ud["disconnected"], 3, "{ud}");
    assert_eq!(ud["errors"], serde_json::json!([]), "{ud}");

    let stress = json(&run_clean(&[
        "stress",
        "-d",
        "2",
        "--seed",
        "3",
        "--udp-port",
        "26915",
        "--json",
    ]));
    assert_eq!(stress["violations"], serde_json::json!([]), "{stress}");
    assert!(
        stress["established"].as_u64().is_some_and(|n| n > 0),
        "{stress}"
    );
}

/// The daemon and its clients each under memcheck: the shared-memory rings from both
/// sides, then a clean stop on SIGTERM.
#[test]
fn daemon_and_clients_run_clean_under_memcheck() {
    if !have_valgrind("daemon_and_clients_run_clean_under_memcheck") {
        return;
    }
    let sock: PathBuf =
        std::env::temp_dir().join(format!("rcm-cli-vg-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&sock);
    let p = sock.to_str().expect("utf-8 temp path");
    let mut daemon = Started::serving(
        memcheck(&[
            "daemon",
            "--socket",
            p,
            "--udp-port",
            "26916",
            "--bind",
            "127.0.0.1",
            "--bind",
            "127.0.0.2",
        ]),
        Duration::from_secs(60),
    );

    let bench = json(&run_clean(&["bench", "--daemon", p, "-c", "50", "--json"]));
    assert_eq!(bench["established"], 50, "{bench}");
    assert_eq!(bench["errors"], 0, "{bench}");
    let ping = json(&run_clean(&["ping", "--daemon", p, "-c", "3", "--json"]));
    assert_eq!(ping["disconnected"], 3, "{ping}");
    assert_eq!(ping["errors"], serde_json::json!([]), "{ping}");
    let stress = json(&run_clean(&[
        "stress", "--daemon", p, "-d", "2", "--seed", "5", "--json",
    ]));
    assert_eq!(stress["violations"], serde_json::json!([]), "{stress}");
    assert!(
        stress["established"].as_u64().is_some_and(|n| n > 0),
        "{stress}"
    );

    let pid = daemon.id().to_string();
    let st = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(st.success());
    let t0 = Instant::now();
    let code = loop {
        if let Some(s) = daemon.try_wait().expect("wait") {
            break s.code();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "daemon did not stop"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let rest = daemon.log();
    assert_ne!(
        code,
        Some(MEMCHECK_ERRORS),
        "memcheck found errors in the daemon:\n{rest}"
    );
    assert_eq!(code, Some(0), "daemon exit:\n{rest}");
}
