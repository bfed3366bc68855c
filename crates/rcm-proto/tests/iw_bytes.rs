//! Two iWARP endpoints over one stream driven by byte strings (`iw_bytes/driver.rs`, the
//! same driver the fuzz target `iw_engine` runs): a hand-written input that connects, sends
//! a message each way and disconnects, seeded random inputs (half of them after a connect
//! and an accept), and the inputs kept in
//! `testdata/iw_bytes/`. `RCM_IW_BYTES=<n>` runs n random inputs (20,000 by default);
//! `RCM_IW_BYTES_SEED=<s>` runs the one input of seed s.

#[path = "iw_bytes/driver.rs"]
mod driver;
#[path = "support/replay.rs"]
mod replay;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Connect, accept, a message each way, disconnect, one byte a choice (see the driver's
/// `step`): the mapping reaches a real connection and real messages.
#[test]
fn a_written_input_connects_exchanges_and_disconnects() {
    #[rustfmt::skip]
    let input: &[u8] = &[
        0x20, 255, 0x0F, 0xFF, 0xFF, 0xFF, // active: revision 2, no hold, segments of 256
        0x20, 255, 0x0F, 0xFF, 0xFF, 0xFF, // passive: the same
        0x00, 0, 1, 1, 0, 0, 0, 8,  // connect: revision 2, IRD 1, ORD 1, no p2p, no CRC, 8 bytes
        39, 0x07, 0xFF,         // the Request arrives (up to 2,048 bytes of it: all)
        0x06, 1, 1, 0, 0, 8,    // the passive side accepts: Reply
        0x80 | 0x27, 0x07, 0xFF,  // the Reply arrives: both up
        19, 0, 100,             // the active side sends 100 bytes
        39, 0x07, 0xFF,         // they arrive
        0x80 | 0x13, 0, 50,       // the passive side sends 50
        0x80 | 0x27, 0x07, 0xFF,  // they arrive
        14,                     // the active side disconnects: FIN
        39, 0, 0,               // the FIN arrives
    ];
    let c = driver::run(input).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(c.connected, 2, "up at both ends: {c:?}");
    assert_eq!(c.messages, 2, "one message each way: {c:?}");
    assert_eq!(c.protocol_closes, 0, "{c:?}");
}

/// Random bytes; every other seed starts with a connect and an accept (their parameters
/// and both configs random) so that the rest happens on a connection more often than
/// random bytes alone make one.
fn random_input(seed: u64) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut v = Vec::new();
    if seed % 2 == 1 {
        let mut r = |n: usize| (0..n).map(|_| rng.gen::<u8>()).collect::<Vec<u8>>();
        v.extend(r(12)); // both configs
        v.push(0x00); // connect
        v.extend(r(7));
        v.extend([39, 0x07, 0xFF]); // the Request arrives
        v.push(0x06); // accept
        v.extend(r(5));
        v.extend([0x80 | 0x27, 0x07, 0xFF]); // the Reply arrives
    }
    let len = rng.gen_range(1..1500);
    v.extend((0..len).map(|_| rng.gen::<u8>()));
    v
}

#[test]
fn random_inputs_break_no_promise() {
    let seeds = replay::seeds("RCM_IW_BYTES_SEED", "RCM_IW_BYTES", 20_000);
    let mut total = driver::Counts::default();
    for &seed in &seeds {
        let c = driver::run(&random_input(seed))
            .unwrap_or_else(|e| panic!("seed {seed} (RCM_IW_BYTES_SEED={seed}): {e}"));
        total.steps += c.steps;
        total.connected += c.connected;
        total.messages += c.messages;
        total.protocol_closes += c.protocol_closes;
    }
    eprintln!("{} inputs: {total:?}", seeds.len());
    // Random bytes reach connections and messages, not just refusals.
    if seeds.len() >= 1000 {
        assert!(total.connected > 0, "no connection came up: {total:?}");
        assert!(total.messages > 0, "no message was delivered: {total:?}");
    }
}

#[test]
fn kept_inputs_break_no_promise() {
    replay::kept_inputs("iw_bytes", driver::run);
}
