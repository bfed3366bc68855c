//! One timer structure per endpoint: a min-heap of (deadline, handle, generation). A
//! connection endpoint has at most one live timer; re-arming bumps its generation, and stale
//! heap entries are skipped when they surface, so nothing is allocated per timer. When the
//! stale entries may be half the heap they are swept out at once (see [`Timers::note_stale`]).

use super::CepHandle;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Instant;

/// Fewest stale entries worth a sweep.
const SWEEP_MIN: usize = 1024;

#[derive(Debug, Default)]
pub(crate) struct Timers {
    heap: BinaryHeap<Reverse<(Instant, CepHandle, u32)>>,
    /// Entries made stale since the last sweep (an upper bound: some surfaced and went).
    stale: usize,
}

impl Timers {
    pub(crate) fn arm(&mut self, at: Instant, h: CepHandle, gen: u32) {
        self.heap.push(Reverse((at, h, gen)));
    }

    /// The earliest entry, stale ones included (the caller re-checks on expiry).
    pub(crate) fn peek(&self) -> Option<Instant> {
        self.heap.peek().map(|Reverse((at, _, _))| *at)
    }

    /// Pops an entry due at or before `now`.
    pub(crate) fn pop_due(&mut self, now: Instant) -> Option<(CepHandle, u32)> {
        match self.heap.peek() {
            Some(Reverse((at, _, _))) if *at <= now => {
                self.heap.pop().map(|Reverse((_, h, g))| (h, g))
            }
            _ => None,
        }
    }

    /// Drops stale entries from the top, so `peek` answers a live deadline.
    pub(crate) fn prune(&mut self, live: impl Fn(CepHandle, u32) -> bool) {
        while let Some(Reverse((_, h, g))) = self.heap.peek() {
            if live(*h, *g) {
                break;
            }
            self.heap.pop();
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.heap.len()
    }

    /// One entry went stale (its endpoint re-armed, cancelled its timer, or went). When the
    /// stale entries noted since the last sweep are half the heap or more, drops every entry
    /// `live` rejects and gives back the spare capacity: each sweep is paid for by the
    /// entries noted since the last, so the cost stays O(1) per timer. Without it, a burst of
    /// connections leaves a dead entry per answered retransmission until its deadline comes
    /// round (seconds), and the heap's peak capacity for good.
    pub(crate) fn note_stale(&mut self, live: impl Fn(CepHandle, u32) -> bool) {
        self.stale += 1;
        if self.stale < SWEEP_MIN || self.stale * 2 < self.heap.len() {
            return;
        }
        self.heap.retain(|Reverse((_, h, g))| live(*h, *g));
        self.stale = 0;
        if self.heap.capacity() > 2 * self.heap.len() + SWEEP_MIN {
            self.heap.shrink_to_fit();
        }
    }
}
