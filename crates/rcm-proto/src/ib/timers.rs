//! One timer structure per endpoint. A connection endpoint has at most one live timer;
//! re-arming bumps its generation, and stale entries are skipped when they surface, so
//! nothing is allocated per timer. When the stale entries may be half of all entries they
//! are swept out at once (see [`Timers::note_stale`]).
//!
//! Most timers of a kind are armed with the same wait (the first retransmission of a
//! message, a timewait of the path's ACK timeout), so their deadlines come in the order they
//! were armed: each kind (a *lane*) keeps those in a queue, armed and expired in O(1). A
//! deadline earlier than the last one of its lane (a retry with a longer wait came before
//! it, a path with a shorter timeout) goes to a min-heap instead. The earliest deadline is
//! the least of the heap's and the lanes' first ones. A burst of connections keeps hundreds
//! of thousands of endpoints in timewait: in a heap each expiry cost a sift through all of
//! them.

use super::CepHandle;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::Instant;

/// Fewest stale entries worth a sweep.
const SWEEP_MIN: usize = 1024;

/// How many lanes there are (see the module doc); a lane number past the last uses the last.
pub(crate) const LANES: usize = 2;

type Entry = (Instant, CepHandle, u32);

#[derive(Debug, Default)]
pub(crate) struct Timers {
    heap: BinaryHeap<Reverse<Entry>>,
    lanes: [VecDeque<Entry>; LANES],
    /// Entries made stale since the last sweep (an upper bound: some surfaced and went).
    stale: usize,
    /// The earliest deadline armed since [`Timers::take_armed`] last looked.
    armed: Option<Instant>,
}

/// Where the earliest entry is.
#[derive(Clone, Copy)]
enum Source {
    Heap,
    Lane(usize),
}

impl Timers {
    /// Arms `(h, gen)` at `at` in `lane`.
    pub(crate) fn arm(&mut self, at: Instant, h: CepHandle, gen: u32, lane: usize) {
        self.armed = Some(self.armed.map_or(at, |a| a.min(at)));
        let q = &mut self.lanes[lane.min(LANES - 1)];
        if q.back().is_none_or(|&(last, _, _)| at >= last) {
            q.push_back((at, h, gen));
        } else {
            self.heap.push(Reverse((at, h, gen)));
        }
    }

    /// The earliest entry and where it is.
    fn first(&self) -> Option<(Entry, Source)> {
        let mut best = self.heap.peek().map(|Reverse(e)| (*e, Source::Heap));
        for (i, q) in self.lanes.iter().enumerate() {
            if let Some(&e) = q.front() {
                if best.is_none_or(|(b, _)| e < b) {
                    best = Some((e, Source::Lane(i)));
                }
            }
        }
        best
    }

    fn take(&mut self, from: Source) -> Option<Entry> {
        match from {
            Source::Heap => self.heap.pop().map(|Reverse(e)| e),
            Source::Lane(i) => self.lanes[i].pop_front(),
        }
    }

    /// The earliest deadline armed since the last call, if any (O(1): no entry is looked
    /// at).
    pub(crate) fn take_armed(&mut self) -> Option<Instant> {
        self.armed.take()
    }

    /// The earliest entry, stale ones included (the caller re-checks on expiry).
    pub(crate) fn peek(&self) -> Option<Instant> {
        self.first().map(|((at, _, _), _)| at)
    }

    /// Pops an entry due at or before `now`.
    pub(crate) fn pop_due(&mut self, now: Instant) -> Option<(CepHandle, u32)> {
        match self.first() {
            Some(((at, _, _), from)) if at <= now => self.take(from).map(|(_, h, g)| (h, g)),
            _ => None,
        }
    }

    /// Drops stale entries from the fronts, so `peek` answers a live deadline.
    pub(crate) fn prune(&mut self, live: impl Fn(CepHandle, u32) -> bool) {
        while let Some(Reverse((_, h, g))) = self.heap.peek() {
            if live(*h, *g) {
                break;
            }
            self.heap.pop();
        }
        for q in &mut self.lanes {
            while let Some(&(_, h, g)) = q.front() {
                if live(h, g) {
                    break;
                }
                q.pop_front();
            }
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.heap.len() + self.lanes.iter().map(VecDeque::len).sum::<usize>()
    }

    /// One entry went stale (its endpoint re-armed, cancelled its timer, or went). When the
    /// stale entries noted since the last sweep are half of all entries or more, drops every
    /// entry `live` rejects and gives back the spare capacity: each sweep is paid for by the
    /// entries noted since the last, so the cost stays O(1) per timer. Without it, a burst of
    /// connections leaves a dead entry per answered retransmission until its deadline comes
    /// round (seconds), and the peak capacity for good.
    pub(crate) fn note_stale(&mut self, live: impl Fn(CepHandle, u32) -> bool) {
        self.stale += 1;
        if self.stale < SWEEP_MIN || self.stale * 2 < self.len() {
            return;
        }
        self.drop_stale(live, SWEEP_MIN);
    }

    /// Drops every entry `live` rejects now and gives back the room beyond twice what is
    /// left, however few entries were stale (what [`Timers::note_stale`] does once enough
    /// are).
    pub(crate) fn sweep(&mut self, live: impl Fn(CepHandle, u32) -> bool) {
        self.drop_stale(live, 0);
    }

    /// Gives back the room of queues that expiries emptied (`crate::room`): a sweep
    /// only runs once stale entries are many, and entries that come due leave their room.
    pub(crate) fn shrink(&mut self) {
        if crate::room::too_roomy(
            self.heap.capacity(),
            self.heap.len(),
            std::mem::size_of::<Entry>(),
        ) {
            self.heap.shrink_to(2 * self.heap.len());
        }
        for q in &mut self.lanes {
            crate::room::shrink_deque(q);
        }
    }

    /// Bytes the queues have room for.
    pub(crate) fn bytes(&self) -> usize {
        let room = self.heap.capacity() + self.lanes.iter().map(VecDeque::capacity).sum::<usize>();
        room * std::mem::size_of::<Entry>()
    }

    /// Drops every entry `live` rejects; a queue with more room than twice its entries and
    /// `slack` more gives it back.
    fn drop_stale(&mut self, live: impl Fn(CepHandle, u32) -> bool, slack: usize) {
        self.heap.retain(|Reverse((_, h, g))| live(*h, *g));
        if self.heap.capacity() > 2 * self.heap.len() + slack {
            self.heap.shrink_to_fit();
        }
        // Filtering keeps a lane in deadline order.
        for q in &mut self.lanes {
            q.retain(|&(_, h, g)| live(h, g));
            if q.capacity() > 2 * q.len() + slack {
                q.shrink_to_fit();
            }
        }
        self.stale = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::num::NonZeroU64;
    use std::time::Duration;

    fn drain(t: &mut Timers, now: Instant) -> Vec<u64> {
        std::iter::from_fn(|| t.pop_due(now))
            .map(|(h, _)| h.0.get())
            .collect()
    }

    #[allow(non_snake_case)]
    fn CepHandle(n: u64) -> super::CepHandle {
        super::CepHandle(NonZeroU64::new(n).expect("nonzero"))
    }

    #[test]
    fn entries_expire_in_deadline_order_whatever_lane_or_arming_order() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut t = Timers::default();
        // Lane 0 in order, then one earlier (to the heap); lane 1 in order; a lane past the
        // last is the last.
        t.arm(ms(10), CepHandle(1), 0, 0);
        t.arm(ms(30), CepHandle(2), 0, 0);
        t.arm(ms(20), CepHandle(3), 0, 0);
        t.arm(ms(5), CepHandle(4), 0, 1);
        t.arm(ms(40), CepHandle(5), 0, 1);
        t.arm(ms(25), CepHandle(6), 0, 7);
        assert_eq!(t.len(), 6);
        assert_eq!(t.peek(), Some(ms(5)));
        assert_eq!(drain(&mut t, ms(22)), vec![4, 1, 3]);
        assert_eq!(t.peek(), Some(ms(25)));
        assert_eq!(drain(&mut t, ms(100)), vec![6, 2, 5]);
        assert_eq!(t.peek(), None);
        assert_eq!(t.len(), 0);
    }

    #[test]
    fn take_armed_gives_the_earliest_deadline_armed_since_it_last_looked() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut t = Timers::default();
        assert_eq!(t.take_armed(), None);
        t.arm(ms(30), CepHandle(1), 0, 1);
        t.arm(ms(10), CepHandle(2), 0, 0);
        t.arm(ms(20), CepHandle(3), 0, 0);
        assert_eq!(t.take_armed(), Some(ms(10)));
        assert_eq!(t.take_armed(), None, "nothing armed since");
        // Expiring and pruning arm nothing.
        assert_eq!(drain(&mut t, ms(15)), vec![2]);
        t.prune(|_, _| false);
        assert_eq!(t.take_armed(), None);
        t.arm(ms(50), CepHandle(4), 0, 0);
        assert_eq!(t.take_armed(), Some(ms(50)));
    }

    #[test]
    fn stale_fronts_are_pruned_and_a_sweep_keeps_the_order() {
        let t0 = Instant::now();
        let mut t = Timers::default();
        let n = (SWEEP_MIN * 4) as u64;
        for i in 1..=n {
            t.arm(
                t0 + Duration::from_micros(i),
                CepHandle(i),
                0,
                (i % 2) as usize,
            );
        }
        // The even handles go stale: a sweep happens on the way.
        let live = |h: super::CepHandle, _| h.0.get() % 2 == 1;
        for _ in 0..n / 2 {
            t.note_stale(live);
        }
        assert!(t.len() < n as usize, "swept: {}", t.len());
        t.prune(live);
        assert_eq!(t.peek(), Some(t0 + Duration::from_micros(1)));
        let got = drain(&mut t, t0 + Duration::from_secs(1));
        let want: Vec<u64> = (1..=n).filter(|h| h % 2 == 1).collect();
        let live_got: Vec<u64> = got.into_iter().filter(|h| h % 2 == 1).collect();
        assert_eq!(live_got, want);
    }

    /// A sweep asked for drops the stale entries however few there are, and gives their
    /// room back; the live ones keep their order.
    #[test]
    fn a_sweep_asked_for_drops_every_stale_entry_and_its_room() {
        let t0 = Instant::now();
        let mut t = Timers::default();
        for i in 1..=100u64 {
            t.arm(t0 + Duration::from_micros(i), CepHandle(i), 0, 0);
        }
        let live = |h: super::CepHandle, _| h.0.get() % 10 == 0;
        for _ in 0..90 {
            t.note_stale(live);
        }
        assert_eq!(t.len(), 100, "too few stale entries for a sweep of its own");
        t.sweep(live);
        assert_eq!(t.len(), 10);
        assert!(
            t.lanes[0].capacity() <= 20,
            "room kept: {}",
            t.lanes[0].capacity()
        );
        let got = drain(&mut t, t0 + Duration::from_secs(1));
        assert_eq!(got, (1..=10).map(|k| k * 10).collect::<Vec<u64>>());
    }
}
