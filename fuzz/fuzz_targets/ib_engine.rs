//! Two live IB CM engines driven by the input: calls, deliveries, losses, duplicates,
//! reorderings, altered and made-up datagrams, time. The driver, and what it checks, is
//! `crates/rcm-proto/tests/engine_bytes/driver.rs`, which the stable test `engine_bytes`
//! runs on seeded inputs and on what this target found (`testdata/engine_bytes/`).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[allow(dead_code)]
#[path = "../../crates/rcm-proto/tests/engine_bytes/driver.rs"]
mod driver;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = driver::run(data) {
        panic!("{e}");
    }
});
