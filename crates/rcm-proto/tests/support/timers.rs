//! Moving an engine's clock.

use rcm_proto::ib::Endpoint;
use std::time::{Duration, Instant};

/// Moves `now` on by `d`, firing each of the engine's timers at its own deadline.
pub fn advance(ep: &mut Endpoint, now: &mut Instant, d: Duration) {
    let end = *now + d;
    while let Some(at) = ep.poll_timeout() {
        if at > end {
            break;
        }
        *now = (*now).max(at);
        ep.handle_timeout(*now);
    }
    *now = end;
}
