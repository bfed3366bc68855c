//! Sans-IO connection-manager engines for rcm.
//!
//! [`ib`] holds the IB CM (the IBTA chapter 12 state machine over RoCEv2 MADs), [`iw`] the iWARP
//! CM (the iw_cm states over MPA on one TCP byte stream), and [`sim`] a deterministic network
//! to drive the IB CM through loss, duplication, reordering, delay, partitions
//! and crashes. Nothing here does I/O: datagrams and the current time go in; datagrams, a
//! deadline and events come out. No threads, sockets, clocks or `unsafe`.
#![forbid(unsafe_code)]

pub mod ib;
pub mod iw;
pub mod room;
pub mod sim;

use std::time::{Duration, Instant};

/// `now + d`, capped some thirty years on: a duration of `Duration::MAX` (what a caller or a
/// configuration writes for "for ever", "no deadline", "no cap") would overflow an `Instant`
/// and panic; no wait outlives the cap.
pub fn later(now: Instant, d: Duration) -> Instant {
    const FAR: Duration = Duration::from_secs(1 << 30);
    now.checked_add(d.min(FAR)).unwrap_or(now)
}
