//! Helpers shared by the test files that run the `rcm` binary.
#![allow(dead_code)] // each test file uses its own subset

use std::process::Command;

/// Runs `rcm` with `args`; returns (exit code, stdout, stderr).
pub fn rcm(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_rcm"))
        .args(args)
        .output()
        .expect("run rcm");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
