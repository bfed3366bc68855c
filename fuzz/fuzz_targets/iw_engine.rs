//! Two live iWARP endpoints over one stream driven by the input: calls, chunks of either
//! direction, altered, lost and made-up bytes, resets, time. The driver, and what it checks,
//! is `crates/rcm-proto/tests/iw_bytes/driver.rs`, which the stable test `iw_bytes` runs on
//! seeded inputs and on what this target found (`testdata/iw_bytes/`).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[allow(dead_code)]
#[path = "../../crates/rcm-proto/tests/iw_bytes/driver.rs"]
mod driver;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = driver::run(data) {
        panic!("{e}");
    }
});
