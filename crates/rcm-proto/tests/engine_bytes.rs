//! Two IB CM engines driven by byte strings (`engine_bytes/driver.rs`, the same driver the
//! fuzz target `ib_engine` runs): a hand-written input that makes one whole connection,
//! seeded random inputs, and the inputs kept in `testdata/engine_bytes/` (what fuzzing
//! found, kept so that it stays fixed). `RCM_ENGINE_BYTES=<n>` runs n random inputs (20,000
//! by default); `RCM_ENGINE_BYTES_SEED=<s>` runs the one input of seed s.

#[path = "engine_bytes/driver.rs"]
mod driver;
#[path = "support/replay.rs"]
mod replay;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Listen, connect, accept, establish and disconnect, one byte a choice (see the driver's
/// `step`): the mapping reaches a real connection, at both ends.
#[test]
fn a_written_input_makes_one_connection_and_ends_it() {
    #[rustfmt::skip]
    let input: &[u8] = &[
        0x00,                   // flags: backoff retries at both hosts
        0x88, 0, 1, 0,          // host 1 listens on the TCP service, exact, default backlog
        0x00, 0, 0, 0, 20, 15,  // host 0 connects to it: REQ
        42, 0, 0,               // the REQ arrives: a request at host 1
        0x8C, 0, 0, 1, 0, 0, 0, // host 1 accepts it: REP
        42, 0, 0,               // the REP arrives
        34, 0, 0, 1,            // host 0 establishes: RTU, ESTABLISHED at host 0
        42, 0, 0,               // the RTU arrives: ESTABLISHED at host 1
        24, 0, 0, 0,            // host 0 disconnects: DREQ
        42, 0, 0,               // the DREQ arrives
        0x98, 0, 0, 0,          // host 1 answers it: DREP
        42, 0, 0,               // the DREP arrives
    ];
    let c = driver::run(input).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        c.established, 2,
        "one connection, established at both ends: {c:?}"
    );
    assert_eq!(
        c.delivered, 5,
        "REQ, REP, RTU, DREQ and DREP delivered once: {c:?}"
    );
}

fn random_input(seed: u64) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed);
    let len = rng.gen_range(1..1500);
    let mut v = vec![0u8; len];
    rng.fill(&mut v[..]);
    v
}

#[test]
fn random_inputs_break_no_promise() {
    let seeds = replay::seeds("RCM_ENGINE_BYTES_SEED", "RCM_ENGINE_BYTES", 20_000);
    let mut total = driver::Counts::default();
    for &seed in &seeds {
        let c = driver::run(&random_input(seed))
            .unwrap_or_else(|e| panic!("seed {seed} (RCM_ENGINE_BYTES_SEED={seed}): {e}"));
        total.steps += c.steps;
        total.delivered += c.delivered;
        total.events += c.events;
        total.established += c.established;
    }
    eprintln!("{} inputs: {total:?}", seeds.len());
    // Random bytes reach the state machine, connections included, not just its refusals.
    if seeds.len() >= 1000 {
        assert!(
            total.established > 0,
            "no connection was established: {total:?}"
        );
        assert!(total.events > total.established, "{total:?}");
    }
}

#[test]
fn kept_inputs_break_no_promise() {
    replay::kept_inputs("engine_bytes", driver::run);
}
