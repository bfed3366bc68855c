//! Port spaces: which (port space, address, port) are taken, as Linux's per-namespace
//! `rdma_bind_list`s do. A port may be bound by several ids only on distinct specific
//! addresses; a wildcard conflicts with everything on that port.

use rcm_wire::cma::PortSpace;
use std::collections::HashMap;
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
}

impl Ports {
    pub(crate) fn new(seed: u16) -> Self {
        let span = EPHEMERAL.1 - EPHEMERAL.0 + 1;
        Ports {
            taken: HashMap::new(),
            next: EPHEMERAL.0 + seed % span,
        }
    }

    fn conflicts(&self, ps: PortSpace, ip: IpAddr, port: u16, reuse: bool) -> bool {
        self.taken.get(&(ps, port)).is_some_and(|v| {
            v.all().iter().any(|b| {
                let overlap = b.ip == ip || b.ip.is_unspecified() || ip.is_unspecified();
                overlap && !(reuse && b.reuse && !b.listening)
            })
        })
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
            let mut found = None;
            for _ in 0..span {
                let p = self.next;
                self.next = if self.next >= EPHEMERAL.1 {
                    EPHEMERAL.0
                } else {
                    self.next + 1
                };
                if !self.conflicts(ps, ip, p, false) {
                    found = Some(p);
                    break;
                }
            }
            found.ok_or(crate::Error::NoPorts)?
        } else {
            if self.conflicts(ps, ip, addr.port(), reuse) {
                return Err(crate::Error::AddrInUse(addr));
            }
            addr.port()
        };
        let b = Binding {
            ip,
            key,
            reuse,
            listening: false,
        };
        match self.taken.entry((ps, port)) {
            std::collections::hash_map::Entry::Occupied(mut e) => e.get_mut().push(b),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(Holders::One(b));
            }
        }
        Ok(SocketAddr::new(ip, port))
    }

    /// Marks `key`'s binding as listening: a listener shares its port with nobody. Fails if
    /// another id shares the port now.
    pub(crate) fn listen(
        &mut self,
        ps: PortSpace,
        addr: SocketAddr,
        key: u64,
    ) -> crate::Result<()> {
        let Some(v) = self.taken.get_mut(&(ps, addr.port())) else {
            return Ok(());
        };
        let shared = v.all().iter().any(|b| {
            b.key != key
                && (b.ip == addr.ip() || b.ip.is_unspecified() || addr.ip().is_unspecified())
        });
        if shared {
            return Err(crate::Error::AddrInUse(addr));
        }
        for b in v.all_mut().iter_mut().filter(|b| b.key == key) {
            b.listening = true;
            b.reuse = false;
        }
        Ok(())
    }

    /// Releases what `key` bound.
    pub(crate) fn release(&mut self, ps: PortSpace, addr: SocketAddr, key: u64) {
        if let Some(v) = self.taken.get_mut(&(ps, addr.port())) {
            if !v.release(key) {
                self.taken.remove(&(ps, addr.port()));
            }
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
