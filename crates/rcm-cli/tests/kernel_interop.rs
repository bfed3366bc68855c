//! The real Linux kernel judges the IB CM engine: `tests/interop/run-proto.sh` boots Debian
//! 12's kernel in QEMU (../shared/interop) with soft-RoCE, runs rdma-core's `ucmatose` against
//! the `udp_peer` example (rcm-proto's engine over a UDP socket) in both directions, and
//! checks the captured exchange with `rcm decode`.
//!
//! Needs root and the harness beside the checkout. Without them it is skipped loudly; with
//! `RCM_REQUIRE_INTEROP=1` (CI) a skip is a failure.

use std::path::{Path, PathBuf};
use std::process::Command;

fn skip_or_fail(why: &str) {
    assert!(
        std::env::var("RCM_REQUIRE_INTEROP").as_deref() != Ok("1"),
        "kernel interop test cannot run: {why}"
    );
    eprintln!("\n==============================================================");
    eprintln!("SKIPPED: kernel interop test: {why}");
    eprintln!("==============================================================\n");
}

/// The checkout's top directory when the harness can run here; otherwise skips (or fails,
/// under RCM_REQUIRE_INTEROP=1) and returns `None`.
fn preflight() -> Option<PathBuf> {
    let top = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let harness = top.join("../shared/interop/run-vm.sh");
    if !harness.exists() {
        skip_or_fail(&format!("{} not found", harness.display()));
        return None;
    }
    let uid = Command::new("id")
        .arg("-u")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
    if uid.as_deref() != Some("0") {
        skip_or_fail("not root (QEMU and apt need it)");
        return None;
    }
    Some(top)
}

#[test]
fn engine_connects_and_disconnects_with_the_linux_kernel_both_ways() {
    let Some(top) = preflight() else { return };
    let build = Command::new(env!("CARGO"))
        .current_dir(&top)
        .args([
            "build",
            "--release",
            "-p",
            "rcm-proto",
            "--example",
            "udp_peer",
        ])
        .status()
        .expect("run cargo");
    assert!(build.success(), "building udp_peer failed");
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| top.join("target"), PathBuf::from);
    let peer = target.join("release/examples/udp_peer");
    let out = target.join("interop/proto");
    let _ = std::fs::remove_dir_all(&out);
    let status = Command::new(top.join("tests/interop/run-proto.sh"))
        .arg(&peer)
        .arg(env!("CARGO_BIN_EXE_rcm"))
        .arg(&out)
        .status()
        .expect("run tests/interop/run-proto.sh");
    let show = |name: &str| std::fs::read_to_string(Path::new(&out).join(name)).unwrap_or_default();
    assert!(
        status.success(),
        "interop failed; decoded active side:\n{}\npassive side:\n{}",
        show("active.txt"),
        show("passive.txt")
    );
    println!("{}", show("active.txt"));
    println!("{}", show("passive.txt"));
}

/// The `rcm` binary itself against the kernel: `rcm ping` both ways, rejects both ways
/// (reasons 8 and 28), the kernel's cmtime client with 50 connections in flight against
/// `rcm bench --listen`, SIDR and UD SENDs, the daemon, RC, SIDR and UD over IPv6, an MRA
/// from the kernel, and SIDR rejects both ways (tests/interop/rcm-roce.sh).
/// Runs one rcm scenario in the VM; returns its verdict lines after checking they all passed.
fn run_scenario(
    top: &std::path::Path,
    name: &str,
    scenario: &str,
    rdma: &str,
    verdicts_expected: usize,
) {
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| top.join("target"), PathBuf::from);
    let out = target.join("interop").join(name);
    let _ = std::fs::remove_dir_all(&out);
    let status = Command::new(top.join("tests/interop/run-rcm.sh"))
        .arg(env!("CARGO_BIN_EXE_rcm"))
        .arg(&out)
        .arg(top.join("tests/interop").join(scenario))
        .arg(rdma)
        .status()
        .expect("run tests/interop/run-rcm.sh");
    let console = std::fs::read_to_string(out.join("console.log")).unwrap_or_default();
    let verdicts: Vec<&str> = console
        .lines()
        .filter(|l| l.starts_with("verdict "))
        .collect();
    println!("{}", verdicts.join("\n"));
    assert!(status.success(), "interop failed:\n{}", verdicts.join("\n"));
    assert_eq!(verdicts.len(), verdicts_expected, "every check ran");
    assert!(verdicts.iter().all(|v| v.ends_with(" 0")));
}

#[test]
fn rcm_tools_interoperate_with_the_linux_kernel() {
    let Some(top) = preflight() else { return };
    run_scenario(&top, "rcm", "rcm-roce.sh", "rxe", 41);
}

/// rcm's iWARP devices (plain TCP) against the kernel's siw0: `rcm ping --transport iwarp`
/// both ways with the kernel's ucmatose, a reject, MPA revision 1 both ways, messages both
/// ways, IPv6 both ways, MPA CRC and peer-to-peer RTR asked for by the kernel
/// (tests/interop/rcm-iwarp.sh).
#[test]
fn rcm_iwarp_interoperates_with_linux_siw() {
    let Some(top) = preflight() else { return };
    run_scenario(&top, "rcm-iwarp", "rcm-iwarp.sh", "siw", 24);
}

/// Connection-setup rates inside the VM, same emulated CPU: the kernel's cmtime against
/// itself over rxe0, `rcm bench` against itself in-process and through an `rcm daemon` (the
/// hop, as cmtime crosses ucma), and the kernel's cmtime client against
/// `rcm bench --listen` (tests/interop/rates.sh). Prints the rates and the ratio; asserts
/// only that every tool succeeded (a rate is measured, not asserted).
#[test]
fn connection_rates_side_by_side_in_the_vm() {
    let Some(top) = preflight() else { return };
    run_scenario(&top, "rates", "rates.sh", "rxe", 4);
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| top.join("target"), PathBuf::from);
    let console =
        std::fs::read_to_string(target.join("interop/rates/console.log")).unwrap_or_default();
    let rate = |name: &str| -> Option<f64> {
        console
            .lines()
            .find_map(|l| l.strip_prefix(&format!("rate {name} ")))
            .and_then(|v| v.trim().parse().ok())
    };
    let (kk, rr, kr) = (rate("kernel-kernel"), rate("rcm-rcm"), rate("kernel-rcm"));
    let rd = rate("rcm-daemon");
    println!("rates in the VM (conn/s, connect step, 100 in flight): kernel<->kernel {kk:?}, rcm<->rcm {rr:?}, rcm<->rcm through rcm daemon {rd:?}, kernel->rcm {kr:?}");
    if let (Some(k), Some(r)) = (kk, rr) {
        println!("rcm/kernel = {:.2}x", r / k);
    }
}
