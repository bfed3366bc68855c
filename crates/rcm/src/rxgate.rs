//! Who receives from a RoCEv2 device's socket: its I/O thread, or a thread waiting in
//! [`crate::EventChannel::get_event`] for the answer to its own call (busy polling).
//!
//! Waking another thread costs tens of µs on a VM, so every rcm thread polls a while before
//! it sleeps. But a caller waiting for its answer and the device's thread both polling means
//! one polling thread more than the work needs: on two cores, three pollers (the caller, its
//! device's thread, the peer's) share two CPUs, and the answer waits for a context switch to
//! be received (2.7 µs of a 14 µs loopback connect, measured), then for another to reach the
//! caller. Linux's answer is the same as this one: with `SO_BUSY_POLL` the waiting
//! application polls the device queue itself. Here the waiter receives and handles the
//! device's datagrams (the engine, routing, its own event) for as long as it polls, and the
//! device's thread stands aside until that poll's deadline. An iWARP device is polled the
//! same way, its streams' readiness (one `epoll`) in place of a socket's datagrams
//! (`iwarp.rs`, `DeviceInner::iw_poll_once`). It uses the gate's deadline, not its turn:
//! each readiness event reaches one thread (edge-triggered), and a stream's bytes are read
//! under the engine lock, which keeps them in order.
//!
//! The gate keeps two promises. Datagrams reach the engine in the order the socket gave
//! them: one thread at a time receives and hands a batch to the engine (`enter`). And the
//! socket is never left unattended for longer than one poll (the channel's spin, 100 µs by
//! default): the device's thread stands aside only until the deadline the last waiter set,
//! whatever becomes of the waiter (it may be descheduled), and no longer than someone polls:
//! the last waiter to stop ([`RxGate::poll_ended`], as soon as it has its event) takes the
//! deadline back. Without that, a waiter whose event came early left the socket unattended
//! for the rest of its spin: a thread that polled one device, got its event, then waited on
//! another channel for an event of this device found it only when the deadline passed
//! (a connection cycle of one thread through the daemon: 350 µs, 200 of them that).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Longest a receiving thread sleeps standing aside before it looks at the gate again: a
/// waiter on another thread may have stopped polling early (it got its event) and gone on
/// without waiting again, so nobody wakes the thread (the same thread waiting again does,
/// `BusyPoll::kick`); the socket is then left for at most this long instead of for the rest
/// of a long poll. Default polls (100 µs) end before it.
pub const STAND_ASIDE_RECHECK: Duration = Duration::from_millis(1);

/// How long a receiving thread standing aside (a device's, a daemon session's reader)
/// sleeps before it looks at the gate again,
/// given its sleep before (`prev`, zero when it was receiving) and what is left of the
/// waiters' poll (`left`, not zero). The first sleep ends with the poll; a thread that wakes
/// to find the poll renewed again and again (a waiter, or a daemon's ring thread, that polls
/// whenever it has nothing else to do) sleeps twice as long each time, up to
/// [`STAND_ASIDE_RECHECK`]: each wake-up takes a CPU from the thread doing the work. The
/// socket is still polled all that time, by the waiter; one that stops for good without a
/// word ([`crate::remote::BusyPoll::kick`]) leaves it for at most the last sleep.
pub fn next_nap(prev: Duration, left: Duration) -> Duration {
    let next = if prev.is_zero() {
        left
    } else {
        (prev * 2).max(left)
    };
    next.min(STAND_ASIDE_RECHECK)
}

/// Who receives from one socket: the thread that serves it, or a thread waiting for its own
/// answer that polls it (see [`crate::remote::BusyPoll`]). Used by rcm's devices; a
/// provider whose ids offer busy polling can use it the same way: its receiving thread
/// stands aside while [`RxGate::polled_left`] is not zero, and whoever receives holds the
/// turn ([`RxGate::enter`]) from the receive until what it received has been handled, so
/// that what came in is handled in the order it came.
pub struct RxGate {
    /// A thread is receiving and handling a batch.
    busy: AtomicBool,
    /// Until when (ns since `base`) a waiter polls the socket; 0: none has.
    polled_until: AtomicU64,
    /// Waiters polling now (begun and not ended).
    pollers: AtomicU32,
    base: Instant,
}

/// The turn of the thread that entered the gate; ends when dropped.
pub struct RxTurn<'a>(&'a RxGate);

impl Drop for RxTurn<'_> {
    fn drop(&mut self) {
        self.0.busy.store(false, Ordering::Release);
    }
}

impl Default for RxGate {
    fn default() -> Self {
        Self::new()
    }
}

impl RxGate {
    /// A gate nobody has entered or polled.
    pub fn new() -> Self {
        RxGate {
            busy: AtomicBool::new(false),
            polled_until: AtomicU64::new(0),
            pollers: AtomicU32::new(0),
            base: Instant::now(),
        }
    }

    /// The turn to receive and hand a batch to the engine, unless another thread has it
    /// (never waits: a thread without the turn has nothing to do that the other is not
    /// doing).
    pub fn enter(&self) -> Option<RxTurn<'_>> {
        self.busy
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| RxTurn(self))
    }

    fn nanos(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.base).as_nanos()).unwrap_or(u64::MAX)
    }

    /// A waiter polls for up to `spin` from now: the receiving thread stands aside until then,
    /// or until the last waiter's [`RxGate::poll_ended`]. Each call must be followed by one
    /// `poll_ended`.
    pub fn polled_for(&self, spin: Duration) {
        self.pollers.fetch_add(1, Ordering::AcqRel);
        let until = self.nanos(rcm_proto::later(Instant::now(), spin)).max(1);
        self.polled_until.fetch_max(until, Ordering::Release);
    }

    /// A waiter stopped polling (it has its event, or its spin is over). True when it was the
    /// last: the deadline is taken back and the receiving thread must resume now (wake it if
    /// it stands aside asleep). A waiter beginning meanwhile keeps the deadline it set when it
    /// was later; when it was not, the thread resumes beside it (both then receive, one at a
    /// time: only the CPU is spent).
    pub fn poll_ended(&self) -> bool {
        if self.pollers.fetch_sub(1, Ordering::AcqRel) != 1 {
            return false;
        }
        // Read after the count, not before: a waiter that began and ended between the two
        // would have left its later deadline set with nobody polling, the receiving thread
        // standing aside until it passed.
        let until = self.polled_until.load(Ordering::Acquire);
        let _ = self
            .polled_until
            .compare_exchange(until, 0, Ordering::AcqRel, Ordering::Relaxed);
        true
    }

    /// How long a waiter still polls (zero when none does). Meant to be asked on every look
    /// of a receiving thread's polling loop: without a waiter it reads no clock (a passed
    /// deadline is cleared, unless a waiter set a new one meanwhile).
    pub fn polled_left(&self) -> Duration {
        let until = self.polled_until.load(Ordering::Acquire);
        if until == 0 {
            return Duration::ZERO;
        }
        let left = until.saturating_sub(self.nanos(Instant::now()));
        if left == 0 {
            let _ =
                self.polled_until
                    .compare_exchange(until, 0, Ordering::AcqRel, Ordering::Relaxed);
        }
        Duration::from_nanos(left)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_turn_at_a_time() {
        let g = RxGate::new();
        let t = g.enter();
        assert!(t.is_some());
        assert!(g.enter().is_none(), "a second thread entered during a turn");
        drop(t);
        assert!(g.enter().is_some(), "the turn was not given back");
    }

    #[test]
    fn the_last_waiter_to_stop_ends_the_standing_aside() {
        let g = RxGate::new();
        g.polled_for(Duration::from_secs(60));
        g.polled_for(Duration::from_secs(60));
        assert!(!g.poll_ended(), "one waiter still polls");
        assert!(g.polled_left() > Duration::from_secs(59), "it still polls");
        assert!(g.poll_ended(), "the last one");
        assert_eq!(g.polled_left(), Duration::ZERO, "the deadline was kept");
        // A new poll after that stands the thread aside again.
        g.polled_for(Duration::from_secs(60));
        assert!(g.polled_left() > Duration::from_secs(59));
        assert!(g.poll_ended());
    }

    #[test]
    fn a_thread_finding_the_poll_renewed_sleeps_longer_each_time_up_to_the_recheck() {
        let us = Duration::from_micros;
        // The first sleep ends with the poll.
        assert_eq!(next_nap(Duration::ZERO, us(100)), us(100));
        // Renewed: twice as long, then again, never past the recheck.
        assert_eq!(next_nap(us(100), us(100)), us(200));
        assert_eq!(next_nap(us(200), us(90)), us(400));
        assert_eq!(next_nap(us(800), us(100)), STAND_ASIDE_RECHECK);
        assert_eq!(next_nap(STAND_ASIDE_RECHECK, us(100)), STAND_ASIDE_RECHECK);
        // A longer poll than the doubled sleep is slept to its end (up to the recheck).
        assert_eq!(next_nap(us(100), us(300)), us(300));
        assert_eq!(
            next_nap(Duration::ZERO, Duration::from_secs(60)),
            STAND_ASIDE_RECHECK
        );
    }

    #[test]
    fn the_thread_stands_aside_only_until_the_latest_deadline() {
        let g = RxGate::new();
        assert_eq!(g.polled_left(), Duration::ZERO);
        g.polled_for(Duration::from_secs(60));
        // A shorter poll after a longer one does not cut the longer one short.
        g.polled_for(Duration::from_millis(1));
        assert!(g.polled_left() > Duration::from_secs(59));
        let g = RxGate::new();
        g.polled_for(Duration::from_millis(2));
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(g.polled_left(), Duration::ZERO, "the deadline did not pass");
    }
}
