//! Giving back the room a flood left in a table.
//!
//! std's and hashbrown's tables keep their peak capacity when entries go: after a burst of
//! connections a long-lived process (the daemon) would hold a burst's tables for good. The
//! rule here is the one every per-connection table of rcm follows.

use std::collections::{HashMap, VecDeque};
use std::mem::size_of;

/// Room a table may keep whatever it holds, in bytes: up to it, giving room back would
/// only churn as connections come and go (a serial workload's tables never get there).
pub const FLOOR_BYTES: usize = 16 << 10;

/// Entries a table may keep room for however small they are.
pub const FLOOR_ENTRIES: usize = 16;

/// Whether a table with room for `cap` entries of `entry` bytes each that holds `len` should
/// give most of it back: once a quarter full, shrunk to twice what it holds (which leaves it
/// more than a quarter full, so it does not shrink again at once), a shrink's rehash is paid
/// for by the removals before it: O(1) each.
pub fn too_roomy(cap: usize, len: usize, entry: usize) -> bool {
    !kept(cap, entry) && len <= cap / 4
}

/// Whether room for `cap` entries of `entry` bytes is within what a table keeps whatever it
/// holds.
pub fn kept(cap: usize, entry: usize) -> bool {
    cap <= FLOOR_ENTRIES || cap.saturating_mul(entry) <= FLOOR_BYTES
}

/// Bytes `m` has room for: an entry's place and hashbrown's control byte each.
pub fn map_bytes<K, V, S>(m: &HashMap<K, V, S>) -> usize {
    m.capacity() * (size_of::<(K, V)>() + 1)
}

/// Shrinks `m` to twice what it holds if it is [`too_roomy`]; a few comparisons otherwise.
pub fn shrink_map<K: Eq + std::hash::Hash, V, S: std::hash::BuildHasher>(m: &mut HashMap<K, V, S>) {
    if too_roomy(m.capacity(), m.len(), size_of::<(K, V)>()) {
        m.shrink_to(2 * m.len());
    }
}

/// [`shrink_map`] for a queue.
pub fn shrink_deque<T>(d: &mut VecDeque<T>) {
    if too_roomy(d.capacity(), d.len(), size_of::<T>()) {
        d.shrink_to(2 * d.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_shrinks_once_a_quarter_full_and_not_again_at_once() {
        let entry = size_of::<(u32, u32)>();
        let mut m: HashMap<u32, u32> = (0..10_000).map(|k| (k, k)).collect();
        let peak = m.capacity();
        for k in 0..10_000 {
            m.remove(&k);
            shrink_map(&mut m);
            // Above the floor, never a quarter full or less after a look.
            assert!(
                kept(m.capacity(), entry) || m.len() > m.capacity() / 4,
                "{} held, room for {}",
                m.len(),
                m.capacity()
            );
        }
        assert!(
            kept(m.capacity(), entry),
            "room for {} of {peak}",
            m.capacity()
        );
        assert!(m.capacity() < peak / 4);
        // Small tables are left alone.
        let mut m: HashMap<u32, u32> = (0..100).map(|k| (k, k)).collect();
        let cap = m.capacity();
        m.clear();
        shrink_map(&mut m);
        assert_eq!(m.capacity(), cap);
        // Big entries: the floor is bytes, not entries.
        let mut d: VecDeque<[u8; 1024]> = (0..100).map(|_| [0; 1024]).collect();
        d.clear();
        shrink_deque(&mut d);
        assert_eq!(d.capacity(), 0);
    }
}
