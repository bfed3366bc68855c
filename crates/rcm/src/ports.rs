//! Port spaces: which (port space, address, port) are taken, as Linux's per-namespace
//! `rdma_bind_list`s do. A port may be bound by several ids only on distinct specific
//! addresses; a wildcard conflicts with everything on that port.

use rcm_wire::cma::PortSpace;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

/// First and last ephemeral port (Linux `ip_local_port_range` default).
pub const EPHEMERAL: (u16, u16) = (32768, 60999);

#[derive(Debug, Default)]
pub(crate) struct Ports {
    taken: HashMap<(PortSpace, u16), Vec<(IpAddr, u64)>>,
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

    fn conflicts(&self, ps: PortSpace, ip: IpAddr, port: u16) -> bool {
        self.taken.get(&(ps, port)).is_some_and(|v| {
            v.iter()
                .any(|(a, _)| *a == ip || a.is_unspecified() || ip.is_unspecified())
        })
    }

    /// Binds `addr` (port 0 picks a free ephemeral port) for id `key`.
    pub(crate) fn bind(
        &mut self,
        ps: PortSpace,
        addr: SocketAddr,
        key: u64,
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
                if !self.conflicts(ps, ip, p) {
                    found = Some(p);
                    break;
                }
            }
            found.ok_or(crate::Error::NoPorts)?
        } else {
            if self.conflicts(ps, ip, addr.port()) {
                return Err(crate::Error::AddrInUse(addr));
            }
            addr.port()
        };
        self.taken.entry((ps, port)).or_default().push((ip, key));
        Ok(SocketAddr::new(ip, port))
    }

    /// Releases what `key` bound.
    pub(crate) fn release(&mut self, ps: PortSpace, addr: SocketAddr, key: u64) {
        if let Some(v) = self.taken.get_mut(&(ps, addr.port())) {
            v.retain(|(_, k)| *k != key);
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
