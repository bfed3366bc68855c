//! The endpoint's tables of what a peer chose: its comm IDs and its QPNs, each with its CA
//! GUID, naming our endpoint for them (duplicate and stale detection, IBTA 12.9.8).
//!
//! A peer picks these values, so they are hashed with std's keyed SipHash (random keys per
//! table set): a peer cannot aim its values at one bucket. SipHash costs ~200 instructions
//! a key, and a REQ or REP looks each of its two keys up and then inserts it: the hash is
//! made once per key and message ([`PeerTables::key`]) and serves both (a connect made six
//! SipHashes, now four: ~290 of its ~21,000 instructions, callgrind of `examples/cycles`).
//! An entry is the same 24 bytes a `HashMap<(u32, u64), CepHandle>` entry was.

use super::types::CepHandle;
use hashbrown::hash_table::Entry;
use hashbrown::HashTable;
use std::hash::{BuildHasher, RandomState};

/// A peer's value (comm ID or QPN) with its CA GUID, and their hash.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PeerKey {
    id: u32,
    guid: u64,
    hash: u64,
}

/// One table: a peer's value and CA GUID to our endpoint.
#[derive(Debug, Default)]
pub(crate) struct PeerTable(HashTable<(u32, u64, CepHandle)>);

/// The hash key both tables share.
#[derive(Debug, Default)]
pub(crate) struct PeerTables {
    state: RandomState,
}

impl PeerTables {
    /// The key of `id` from CA `guid`, hashed.
    pub(crate) fn key(&self, id: u32, guid: u64) -> PeerKey {
        PeerKey {
            id,
            guid,
            hash: self.state.hash_one((id, guid)),
        }
    }

    /// Gives back `t`'s room beyond `min` entries (what is held stays).
    pub(crate) fn shrink_to(&self, t: &mut PeerTable, min: usize) {
        t.0.shrink_to(min, |e| self.state.hash_one((e.0, e.1)));
    }

    /// Sets `k` to `h` in `t` (replacing what it named).
    pub(crate) fn insert(&self, t: &mut PeerTable, k: PeerKey, h: CepHandle) {
        let rehash = |e: &(u32, u64, CepHandle)| self.state.hash_one((e.0, e.1));
        match t.0.entry(k.hash, |e| e.0 == k.id && e.1 == k.guid, rehash) {
            Entry::Occupied(mut o) => o.get_mut().2 = h,
            Entry::Vacant(v) => {
                v.insert((k.id, k.guid, h));
            }
        }
    }
}

impl PeerTable {
    /// Bytes an entry takes.
    pub(crate) const ENTRY: usize = std::mem::size_of::<(u32, u64, CepHandle)>();

    /// The endpoint `k` names, if any.
    pub(crate) fn get(&self, k: PeerKey) -> Option<CepHandle> {
        self.0
            .find(k.hash, |e| e.0 == k.id && e.1 == k.guid)
            .map(|e| e.2)
    }

    /// Forgets `k` if it names `h` (another endpoint may have taken it since).
    pub(crate) fn remove_if(&mut self, k: PeerKey, h: CepHandle) {
        if let Ok(o) = self.0.find_entry(k.hash, |e| e.0 == k.id && e.1 == k.guid) {
            if o.get().2 == h {
                o.remove();
            }
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    /// Entries it has room for without growing.
    pub(crate) fn capacity(&self) -> usize {
        self.0.capacity()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(n: u64) -> CepHandle {
        CepHandle(std::num::NonZeroU64::new(n).expect("nonzero"))
    }

    #[test]
    fn a_key_finds_what_was_set_under_the_same_value_and_guid_only() {
        let tables = PeerTables::default();
        let mut t = PeerTable::default();
        // Enough entries that the table grows (and rehashes) several times.
        for i in 0..1000u32 {
            tables.insert(&mut t, tables.key(i, 7), h(u64::from(i) + 1));
        }
        assert_eq!(t.len(), 1000);
        for i in 0..1000u32 {
            assert_eq!(t.get(tables.key(i, 7)), Some(h(u64::from(i) + 1)));
            assert_eq!(t.get(tables.key(i, 8)), None, "another CA's value {i}");
        }
        // Setting a key again replaces, it does not add.
        tables.insert(&mut t, tables.key(5, 7), h(5000));
        assert_eq!(t.len(), 1000);
        assert_eq!(t.get(tables.key(5, 7)), Some(h(5000)));
    }

    #[test]
    fn a_key_is_forgotten_only_for_the_endpoint_it_names() {
        let tables = PeerTables::default();
        let mut t = PeerTable::default();
        tables.insert(&mut t, tables.key(1, 2), h(10));
        t.remove_if(tables.key(1, 2), h(11));
        assert_eq!(t.get(tables.key(1, 2)), Some(h(10)));
        t.remove_if(tables.key(1, 2), h(10));
        assert_eq!(t.get(tables.key(1, 2)), None);
        assert!(t.is_empty());
    }
}
