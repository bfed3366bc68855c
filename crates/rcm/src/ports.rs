//! Port spaces: which (port space, address, port) are taken, as Linux's per-namespace
//! `rdma_bind_list`s do. A port may be bound by several ids only on distinct specific
//! addresses; a wildcard conflicts with everything on that port.

use rcm_wire::cma::PortSpace;
// Keyed by local ports and addresses: a fast hash.
use foldhash::HashMap;
use std::net::{IpAddr, SocketAddr};

/// First and last ephemeral port (Linux `ip_local_port_range` default).
pub const EPHEMERAL: (u16, u16) = (32768, 60999);

#[derive(Debug, Clone, Copy)]
struct Binding {
    ip: IpAddr,
    key: u64,
    /// `rdma_set_reuseaddr`: may share the port with other reusing, non-listening ids.
    reuse: bool,
    listening: bool,
}

/// Who holds one port: nearly always one id, kept inline (a list cost every bound id an
/// allocation of its own).
#[derive(Debug)]
enum Holders {
    One(Binding),
    Many(Vec<Binding>),
}

impl Holders {
    fn all(&self) -> &[Binding] {
        match self {
            Holders::One(b) => std::slice::from_ref(b),
            Holders::Many(v) => v,
        }
    }

    fn all_mut(&mut self) -> &mut [Binding] {
        match self {
            Holders::One(b) => std::slice::from_mut(b),
            Holders::Many(v) => v,
        }
    }

    fn push(&mut self, b: Binding) {
        match self {
            Holders::One(a) => *self = Holders::Many(vec![*a, b]),
            Holders::Many(v) => v.push(b),
        }
    }

    /// Drops `key`'s bindings; whether any holder is left.
    fn release(&mut self, key: u64) -> bool {
        match self {
            Holders::One(b) => b.key != key,
            Holders::Many(v) => {
                v.retain(|b| b.key != key);
                !v.is_empty()
            }
        }
    }
}

#[derive(Debug, Default)]
pub(crate) struct Ports {
    taken: HashMap<(PortSpace, u16), Holders>,
    next: u16,
    /// Ephemeral ports on which an address (`None`: a wildcard) holds a binding, counted so
    /// that a range used up answers `NoPorts` at once: the scan for a free port holds the
    /// fabric's port lock for the whole range (28,232 lookups), and a burst past the range
    /// took ~3 ms per failing call (20,000 such calls: over a minute).
    held: HashMap<(PortSpace, Option<IpAddr>), u32>,
    /// Ephemeral ports with any binding, per port space.
    any: HashMap<PortSpace, u32>,
}

fn ephemeral(port: u16) -> bool {
    (EPHEMERAL.0..=EPHEMERAL.1).contains(&port)
}

/// The key of `ip` in `Ports::held`.
fn holder(ip: IpAddr) -> Option<IpAddr> {
    (!ip.is_unspecified()).then_some(ip)
}

fn count_down<K: std::hash::Hash + Eq>(m: &mut HashMap<K, u32>, k: K) {
    if let std::collections::hash_map::Entry::Occupied(mut e) = m.entry(k) {
        *e.get_mut() -= 1;
        if *e.get() == 0 {
            e.remove();
        }
    }
}

impl Ports {
    pub(crate) fn new(seed: u16) -> Self {
        let span = EPHEMERAL.1 - EPHEMERAL.0 + 1;
        Ports {
            taken: HashMap::default(),
            next: EPHEMERAL.0 + seed % span,
            held: HashMap::default(),
            any: HashMap::default(),
        }
    }

    /// Whether `ip`:`port` clashes with a binding of another id, and how (`cma_check_port`):
    /// two reusing ids never clash unless one listens; a clash involving a wildcard, on
    /// either side, is `AddrNotAvailable`; one on the same specific address `AddrInUse`.
    fn clash(
        &self,
        ps: PortSpace,
        ip: IpAddr,
        port: u16,
        reuse: bool,
        key: Option<u64>,
    ) -> Option<crate::Error> {
        let v = self.taken.get(&(ps, port))?;
        let mut found = None;
        for b in v.all() {
            if Some(b.key) == key || (reuse && b.reuse && !b.listening) {
                continue;
            }
            if b.ip.is_unspecified() || ip.is_unspecified() {
                return Some(crate::Error::AddrNotAvailable(ip));
            }
            if b.ip == ip {
                found = Some(crate::Error::AddrInUse(SocketAddr::new(ip, port)));
            }
        }
        found
    }

    /// Binds `addr` (port 0 picks a free ephemeral port) for id `key`.
    pub(crate) fn bind(
        &mut self,
        ps: PortSpace,
        addr: SocketAddr,
        key: u64,
    ) -> crate::Result<SocketAddr> {
        self.bind_with(ps, addr, key, false)
    }

    /// Binds with `rdma_set_reuseaddr` semantics when `reuse`: an explicit port may be shared
    /// with other reusing ids as long as none of them listens.
    pub(crate) fn bind_with(
        &mut self,
        ps: PortSpace,
        addr: SocketAddr,
        key: u64,
        reuse: bool,
    ) -> crate::Result<SocketAddr> {
        let ip = addr.ip();
        let port = if addr.port() == 0 {
            let span = EPHEMERAL.1 - EPHEMERAL.0 + 1;
            if self.used_up(ps, ip, u32::from(span)) {
                return Err(crate::Error::NoPorts);
            }
            let mut found = None;
            for _ in 0..span {
                let p = self.next;
                self.next = if self.next >= EPHEMERAL.1 {
                    EPHEMERAL.0
                } else {
                    self.next + 1
                };
                if self.clash(ps, ip, p, false, None).is_none() {
                    found = Some(p);
                    break;
                }
            }
            found.ok_or(crate::Error::NoPorts)?
        } else {
            if let Some(e) = self.clash(ps, ip, addr.port(), reuse, None) {
                return Err(e);
            }
            addr.port()
        };
        let b = Binding {
            ip,
            key,
            reuse,
            listening: false,
        };
        if ephemeral(port) {
            let held = self.taken.get(&(ps, port));
            if held.is_none_or(|v| v.all().iter().all(|o| holder(o.ip) != holder(ip))) {
                *self.held.entry((ps, holder(ip))).or_default() += 1;
            }
            if held.is_none() {
                *self.any.entry(ps).or_default() += 1;
            }
        }
        match self.taken.entry((ps, port)) {
            std::collections::hash_map::Entry::Occupied(mut e) => e.get_mut().push(b),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(Holders::One(b));
            }
        }
        Ok(SocketAddr::new(ip, port))
    }

    /// Marks `key`'s binding as listening: a listener shares its port with nobody. Fails if
    /// another id shares the port now (`cma_bind_listen` checks it as a bind without reuse).
    pub(crate) fn listen(
        &mut self,
        ps: PortSpace,
        addr: SocketAddr,
        key: u64,
    ) -> crate::Result<()> {
        if let Some(e) = self.clash(ps, addr.ip(), addr.port(), false, Some(key)) {
            return Err(e);
        }
        if let Some(v) = self.taken.get_mut(&(ps, addr.port())) {
            for b in v.all_mut().iter_mut().filter(|b| b.key == key) {
                b.listening = true;
                b.reuse = false;
            }
        }
        Ok(())
    }

    /// `rdma_set_reuseaddr(id, 1)` on a bound id: its binding may now be shared with other
    /// reusing ids. A listening binding keeps sharing nothing (the caller refuses that).
    pub(crate) fn set_reuse(&mut self, ps: PortSpace, addr: SocketAddr, key: u64) {
        if let Some(v) = self.taken.get_mut(&(ps, addr.port())) {
            for b in v
                .all_mut()
                .iter_mut()
                .filter(|b| b.key == key && !b.listening)
            {
                b.reuse = true;
            }
        }
    }

    /// Releases what `key` bound.
    pub(crate) fn release(&mut self, ps: PortSpace, addr: SocketAddr, key: u64) {
        let port = addr.port();
        let Some(v) = self.taken.get_mut(&(ps, port)) else {
            return;
        };
        let gone = v.all().iter().find(|b| b.key == key).map(|b| holder(b.ip));
        let left = v.release(key);
        if !ephemeral(port) {
            if !left {
                self.taken.remove(&(ps, port));
            }
            return;
        }
        if let Some(h) = gone {
            if !left || v.all().iter().all(|b| holder(b.ip) != h) {
                count_down(&mut self.held, (ps, h));
            }
        }
        if !left {
            self.taken.remove(&(ps, port));
            rcm_proto::room::shrink_map(&mut self.taken);
            count_down(&mut self.any, ps);
        }
    }

    /// Whether no ephemeral port of `span` can be free for `ip`: this address, or a
    /// wildcard, holds every one (for a wildcard, anyone does). A range with a port free
    /// only for another address is left to the scan.
    fn used_up(&self, ps: PortSpace, ip: IpAddr, span: u32) -> bool {
        let held = |k| self.held.get(&(ps, k)).copied().unwrap_or(0);
        if ip.is_unspecified() {
            self.any.get(&ps).copied().unwrap_or(0) >= span
        } else {
            held(Some(ip)) >= span || held(None) >= span
        }
    }

    /// Bindings held (for leak checks).
    pub(crate) fn len(&self) -> usize {
        self.taken.values().map(|h| h.all().len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(ip: [u8; 4], port: u16) -> SocketAddr {
        SocketAddr::from((ip, port))
    }

    #[test]
    fn one_holder_many_holders_and_back_to_free() {
        let mut p = Ports::new(0);
        let ps = PortSpace::Tcp;
        // Two addresses share a port; a third bind on one of them is refused.
        p.bind(ps, a([127, 0, 0, 1], 7000), 1).unwrap();
        p.bind(ps, a([127, 0, 0, 2], 7000), 2).unwrap();
        assert!(matches!(
            p.bind(ps, a([127, 0, 0, 2], 7000), 3),
            Err(crate::Error::AddrInUse(_))
        ));
        // A wildcard conflicts with both.
        assert!(p.bind(ps, a([0, 0, 0, 0], 7000), 4).is_err());
        assert_eq!(p.len(), 2);
        p.release(ps, a([127, 0, 0, 2], 7000), 2);
        assert_eq!(p.len(), 1);
        p.listen(ps, a([127, 0, 0, 1], 7000), 1).unwrap();
        // Releasing a key that does not hold the port changes nothing.
        p.release(ps, a([127, 0, 0, 1], 7000), 9);
        assert_eq!(p.len(), 1);
        p.release(ps, a([127, 0, 0, 1], 7000), 1);
        assert_eq!(p.len(), 0);
        // Free again, for a wildcard too.
        p.bind(ps, a([0, 0, 0, 0], 7000), 5).unwrap();
    }

    #[test]
    fn reusing_ids_share_a_port_until_one_listens() {
        let mut p = Ports::new(0);
        let ps = PortSpace::Tcp;
        p.bind_with(ps, a([127, 0, 0, 1], 7001), 1, true).unwrap();
        p.bind_with(ps, a([127, 0, 0, 1], 7001), 2, true).unwrap();
        assert!(p.bind_with(ps, a([127, 0, 0, 1], 7001), 3, false).is_err());
        assert_eq!(p.len(), 2);
        assert!(p.listen(ps, a([127, 0, 0, 1], 7001), 1).is_err());
        p.release(ps, a([127, 0, 0, 1], 7001), 1);
        p.release(ps, a([127, 0, 0, 1], 7001), 2);
        assert_eq!(p.len(), 0);
    }

    /// The counts behind `used_up` follow binds and releases: a range taken whole on one
    /// address fails at once there, other addresses still get ports, and a released port is
    /// found again.
    #[test]
    fn a_used_up_range_fails_at_once_and_frees_again() {
        let mut p = Ports::new(7);
        let ps = PortSpace::Tcp;
        let span = u64::from(EPHEMERAL.1 - EPHEMERAL.0 + 1);
        let one = [127, 0, 0, 1];
        for k in 0..span {
            p.bind(ps, a(one, 0), k).unwrap();
        }
        assert!(p.used_up(ps, one.into(), span as u32));
        assert!(matches!(
            p.bind(ps, a(one, 0), span),
            Err(crate::Error::NoPorts)
        ));
        // A wildcard conflicts with every one of them; another address with none.
        assert!(matches!(
            p.bind(ps, a([0, 0, 0, 0], 0), span),
            Err(crate::Error::NoPorts)
        ));
        let other = p.bind(ps, a([127, 0, 0, 2], 0), span + 1).unwrap();
        // That port now has two holders: releasing one of them frees it for that one only.
        p.release(
            ps,
            a(one, other.port()),
            (0..span)
                .find(|k| {
                    p.taken[&(ps, other.port())]
                        .all()
                        .iter()
                        .any(|b| b.key == *k)
                })
                .unwrap(),
        );
        assert!(!p.used_up(ps, one.into(), span as u32));
        assert_eq!(
            p.bind(ps, a(one, 0), span + 2).unwrap().port(),
            other.port()
        );
        assert!(matches!(
            p.bind(ps, a(one, 0), span + 3),
            Err(crate::Error::NoPorts)
        ));
        // Everything released: the counts are back to nothing.
        let all: Vec<_> = p
            .taken
            .iter()
            .flat_map(|((_, port), h)| h.all().iter().map(|b| (b.ip, *port, b.key)))
            .collect();
        for (ip, port, key) in all {
            p.release(ps, SocketAddr::new(ip, port), key);
        }
        assert_eq!(p.len(), 0);
        assert!(
            p.held.is_empty() && p.any.is_empty(),
            "{:?} {:?}",
            p.held,
            p.any
        );
    }

    #[test]
    fn ephemeral_ports_skip_taken_ones() {
        let mut p = Ports::new(0);
        let ps = PortSpace::Udp;
        let first = p.bind(ps, a([127, 0, 0, 1], 0), 1).unwrap().port();
        assert!((EPHEMERAL.0..=EPHEMERAL.1).contains(&first));
        let second = p.bind(ps, a([127, 0, 0, 1], 0), 2).unwrap().port();
        assert_ne!(first, second);
    }
}
