//! One timer structure per endpoint: a min-heap of (deadline, handle, generation). A
//! connection endpoint has at most one live timer; re-arming bumps its generation, and stale
//! heap entries are skipped when they surface, so nothing is allocated per timer.

use super::CepHandle;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Instant;

#[derive(Debug, Default)]
pub(crate) struct Timers {
    heap: BinaryHeap<Reverse<(Instant, CepHandle, u32)>>,
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
}
