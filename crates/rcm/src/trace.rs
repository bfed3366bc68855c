//! Timestamps along the critical path of one connect at a time, for `rcm bench --serial
//! --breakdown`: where the time between `connect` and the event that ends it goes, measured
//! in the real run (callgrind counts instructions, and a profile of a polling process is
//! mostly its polling; neither says which of a connect's hops the microseconds are in).
//!
//! A trace starts with [`begin`], just before the `connect` it follows. From then on each
//! device keeps the first time it handed datagrams to `sendto`, the first receive that
//! brought datagrams and the first time its engine was done with them, and the first
//! `accept` is kept too ([`accept_time`]). Only the first of each: in a one-at-a-time run
//! the client's device holds the sending of its REQ and the receipt of the REP, the
//! server's the receipt of the REQ and the sending of its REP, whatever follows (the RTU,
//! the disconnect).
//!
//! Off by default, when each point costs one relaxed load. On, a point costs a clock read
//! (~25 ns), about 0.15 µs a connect.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;
use std::time::Instant;

static ON: AtomicBool = AtomicBool::new(false);
static BASE: OnceLock<Instant> = OnceLock::new();
/// When the traced connect began; stamps older than it belong to an earlier one.
static EPOCH: AtomicU64 = AtomicU64::new(u64::MAX);
static ACCEPT: AtomicU64 = AtomicU64::new(0);

/// Turns the stamps on or off for the whole process.
pub fn enable(on: bool) {
    now();
    ON.store(on, Relaxed);
}

/// Whether the stamps are on.
#[inline]
pub fn on() -> bool {
    ON.load(Relaxed)
}

/// Nanoseconds since the first use of the trace (never 0).
pub fn now() -> u64 {
    let base = BASE.get_or_init(Instant::now);
    u64::try_from(base.elapsed().as_nanos())
        .unwrap_or(u64::MAX)
        .max(1)
}

/// Starts the trace of one connect (call it just before `connect`): returns its start.
pub fn begin() -> u64 {
    let t = now();
    EPOCH.store(t, Relaxed);
    t
}

/// When the current trace began ([`begin`]), if one did.
pub fn started() -> Option<u64> {
    let t = EPOCH.load(Relaxed);
    (t != u64::MAX).then_some(t)
}

/// Stores now into `a` unless it holds a time of this trace already.
fn first(a: &AtomicU64) {
    if a.load(Relaxed) < EPOCH.load(Relaxed) {
        a.store(now(), Relaxed);
    }
}

/// The time in `a` if it belongs to this trace.
fn this_trace(a: &AtomicU64) -> Option<u64> {
    let t = a.load(Relaxed);
    (t >= EPOCH.load(Relaxed) && t != 0).then_some(t)
}

/// `accept` was called.
#[inline]
pub(crate) fn accept_called() {
    if on() {
        first(&ACCEPT);
    }
}

/// When `accept` was first called in this trace.
pub fn accept_time() -> Option<u64> {
    this_trace(&ACCEPT)
}

/// One device's stamps (see the module documentation).
#[derive(Debug, Default)]
pub struct DeviceStamps {
    send: AtomicU64,
    received: AtomicU64,
    handled: AtomicU64,
}

/// The stamps of one device in the current trace (`None`: not reached).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceTrace {
    /// Datagrams first handed to `sendto` (the system call, their packets built).
    pub send: Option<u64>,
    /// The first receive that brought datagrams returned.
    pub received: Option<u64>,
    /// The engine was first done with what was received.
    pub handled: Option<u64>,
}

impl DeviceStamps {
    #[inline]
    pub(crate) fn sending(&self) {
        if on() {
            first(&self.send);
        }
    }

    /// A receive that returned at `at` (a [`now`] reading) brought datagrams.
    #[inline]
    pub(crate) fn received(&self, at: u64) {
        if on() && self.received.load(Relaxed) < EPOCH.load(Relaxed) && at >= EPOCH.load(Relaxed) {
            self.received.store(at, Relaxed);
        }
    }

    /// The engine is done with a call; kept only for the first after the first receive.
    #[inline]
    pub(crate) fn engine_done(&self) {
        if !on() {
            return;
        }
        let r = self.received.load(Relaxed);
        if r >= EPOCH.load(Relaxed) && self.handled.load(Relaxed) < r {
            self.handled.store(now(), Relaxed);
        }
    }

    /// The stamps of the current trace.
    pub fn read(&self) -> DeviceTrace {
        DeviceTrace {
            send: this_trace(&self.send),
            received: this_trace(&self.received),
            handled: this_trace(&self.handled),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One test for the process-wide switch and epoch (tests run in threads).
    #[test]
    fn a_trace_keeps_the_first_of_each_point_after_its_start_only() {
        let d = DeviceStamps::default();
        enable(false);
        begin();
        d.sending();
        d.received(now());
        assert_eq!(d.read(), DeviceTrace::default(), "stamped while off");
        enable(true);
        // The engine's first call after a receive, not one before it.
        d.engine_done();
        assert_eq!(d.read().handled, None, "handled with nothing received");
        let t0 = begin();
        assert_eq!(started(), Some(t0));
        d.sending();
        let send = d.read().send.expect("send");
        assert!(send >= t0);
        d.sending();
        assert_eq!(d.read().send, Some(send), "a later send replaced the first");
        let at = now();
        d.received(at);
        d.engine_done();
        let handled = d.read().handled.expect("handled");
        assert!(handled >= at);
        d.received(now());
        d.engine_done();
        assert_eq!(
            d.read().received,
            Some(at),
            "a later receive replaced the first"
        );
        assert_eq!(d.read().handled, Some(handled));
        // A receive that returned before the trace began is not this trace's.
        let e = DeviceStamps::default();
        let before = now();
        begin();
        e.received(before);
        assert_eq!(e.read().received, None);
        // The next trace forgets this one's.
        let t1 = begin();
        assert!(t1 > t0);
        assert_eq!(
            d.read(),
            DeviceTrace::default(),
            "an earlier trace's stamps"
        );
        enable(false);
    }
}
