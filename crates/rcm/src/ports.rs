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

#[derive(Debug, Default)]
pub(crate) struct Ports {
    taken: HashMap<(PortSpace, u16), Vec<Binding>>,
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
            v.iter().any(|b| {
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
        // Most ports have one holder: a Vec's first push would reserve four (128 bytes for
        // every connected id).
        let holders = self
            .taken
            .entry((ps, port))
            .or_insert_with(|| Vec::with_capacity(1));
        holders.push(Binding {
            ip,
            key,
            reuse,
            listening: false,
        });
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
        let shared = v.iter().any(|b| {
            b.key != key
                && (b.ip == addr.ip() || b.ip.is_unspecified() || addr.ip().is_unspecified())
        });
        if shared {
            return Err(crate::Error::AddrInUse(addr));
        }
        for b in v.iter_mut().filter(|b| b.key == key) {
            b.listening = true;
            b.reuse = false;
        }
        Ok(())
    }

    /// Releases what `key` bound.
    pub(crate) fn release(&mut self, ps: PortSpace, addr: SocketAddr, key: u64) {
        if let Some(v) = self.taken.get_mut(&(ps, addr.port())) {
            v.retain(|b| b.key != key);
            if v.is_empty() {
                self.taken.remove(&(ps, addr.port()));
            }
        }
    }

    /// Bindings held (for leak checks).
    pub(crate) fn len(&self) -> usize {
        self.taken.values().map(Vec::len).sum()
    }
}
