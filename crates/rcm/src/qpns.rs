//! The QP numbers a fabric hands out: 24 bits, above the special and reserved ones, taken
//! in turn and none twice while it is in use.
//!
//! Handed out by a counter alone, a number came round again after 16.7 million QPs (a day
//! of a daemon at 200 connections a second) whether or not its first holder was still
//! connected, and a peer that still had that QPN from this CA for a live connection took
//! the new REQ for a stale one (IBTA 12.9.8.3.2: REJ, and the old connection disconnected).
//! One bit per number tells which are in use; its pages are made as the counter reaches
//! them (2 MB once it has gone all the way round).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// Numbers per lazily made chunk of the bitmap (2 KiB): the chunks' table is 16 KiB a
/// fabric, and a burst of a few thousand connections makes one or two chunks.
const CHUNK_BITS: u32 = 14;
const CHUNK_WORDS: usize = 1 << (CHUNK_BITS - 6);

type Chunk = [AtomicU64; CHUNK_WORDS];

/// A range of QP numbers, each in use or free.
pub(crate) struct QpnSpace {
    base: u32,
    range: u32,
    next: AtomicU64,
    chunks: Box<[OnceLock<Box<Chunk>>]>,
}

impl QpnSpace {
    /// The numbers `base..base + range`, the first one handed out `base + start % range`.
    pub(crate) fn new(base: u32, range: u32, start: u32) -> Self {
        let range = range.max(1);
        let chunks = range.div_ceil(1 << CHUNK_BITS) as usize;
        QpnSpace {
            base,
            range,
            next: AtomicU64::new(u64::from(start % range)),
            chunks: (0..chunks).map(|_| OnceLock::new()).collect(),
        }
    }

    fn bit(&self, i: u32) -> Option<(&AtomicU64, u64)> {
        let chunk = self
            .chunks
            .get((i >> CHUNK_BITS) as usize)?
            .get_or_init(|| Box::new(std::array::from_fn(|_| AtomicU64::new(0))));
        let word = chunk.get(((i & ((1 << CHUNK_BITS) - 1)) >> 6) as usize)?;
        Some((word, 1u64 << (i & 63)))
    }

    fn next_index(&self) -> u32 {
        (self.next.fetch_add(1, Ordering::Relaxed) % u64::from(self.range)) as u32
    }

    /// The next number not in use, now in use. With every number in use (16.7 million QPs
    /// at once on the fabric's full range) the next in turn is handed out again, as before
    /// there was this table, rather than none.
    pub(crate) fn take(&self) -> u32 {
        for _ in 0..self.range {
            let i = self.next_index();
            match self.bit(i) {
                Some((word, bit)) if word.fetch_or(bit, Ordering::AcqRel) & bit != 0 => {}
                _ => return self.base + i,
            }
        }
        self.base + self.next_index()
    }

    /// `qpn` is no longer in use (a number outside the range, one a caller chose, is
    /// ignored).
    pub(crate) fn give_back(&self, qpn: u32) {
        let Some(i) = qpn.checked_sub(self.base).filter(|&i| i < self.range) else {
            return;
        };
        if let Some((word, bit)) = self.bit(i) {
            word.fetch_and(!bit, Ordering::AcqRel);
        }
    }

    /// Numbers in use.
    pub(crate) fn in_use(&self) -> usize {
        self.chunks
            .iter()
            .filter_map(OnceLock::get)
            .flat_map(|c| c.iter())
            .map(|w| w.load(Ordering::Relaxed).count_ones() as usize)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::QpnSpace;

    #[test]
    fn numbers_come_in_turn_and_skip_those_in_use_when_they_come_round() {
        let s = QpnSpace::new(0x100, 8, 6);
        let first: Vec<u32> = (0..5).map(|_| s.take()).collect();
        assert_eq!(first, vec![0x106, 0x107, 0x100, 0x101, 0x102]);
        s.give_back(0x107);
        s.give_back(0x101);
        // Round again: 0x103, 0x104, 0x105 are free, 0x106 in use, 0x107 free again.
        let next: Vec<u32> = (0..5).map(|_| s.take()).collect();
        assert_eq!(next, vec![0x103, 0x104, 0x105, 0x107, 0x101]);
        assert_eq!(s.in_use(), 8);
        // All in use: the next in turn comes again rather than none (or no end).
        let again = s.take();
        assert!((0x100..0x108).contains(&again));
        // A number outside the range (a caller's own) changes nothing.
        s.give_back(0x50);
        s.give_back(0x108);
        assert_eq!(s.in_use(), 8);
    }

    #[test]
    fn a_number_past_the_first_chunk_is_kept_apart() {
        let s = QpnSpace::new(0x100, 0xFF_FE00, 0xFF_FDFE);
        let (a, b, c) = (s.take(), s.take(), s.take());
        assert_eq!((a, b, c), (0x100 + 0xFF_FDFE, 0x100 + 0xFF_FDFF, 0x100));
        assert_eq!(s.in_use(), 3);
        s.give_back(a);
        assert_eq!(s.in_use(), 2);
    }
}
