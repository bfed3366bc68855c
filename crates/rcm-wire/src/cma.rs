//! The rdma_cm layer's marks on IB CM messages: port spaces, service IDs, and the 36-byte
//! `cma_hdr` that opens REQ and SIDR_REQ private data. Reference: wire-formats.md §4 and
//! Linux `cma.c` (`cma_get_service_id`, `cma_format_hdr`).

use crate::{need, Result, WireError};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Length of the rdma_cm private-data header.
pub const CMA_HDR_LEN: usize = 36;
/// The only cma_hdr version Linux accepts.
pub const CMA_VERSION: u8 = 0;
/// Q_Key rdma_cm uses for UD in the UDP and IB port spaces (`RDMA_UDP_QKEY`).
pub const RDMA_UDP_QKEY: u32 = 0x0123_4567;
/// The kernel's cap on private data through the user ABI (`RDMA_MAX_PRIVATE_DATA`).
pub const RDMA_MAX_PRIVATE_DATA: usize = 256;
/// The IBTA Annex A11 IP-CM service-ID prefix and its mask.
pub const IB_CMA_SERVICE_ID: u64 = 0x0000_0000_0100_0000;
/// Mask selecting the IP-CM prefix.
pub const IB_CMA_SERVICE_ID_MASK: u64 = 0xFFFF_FFFF_FF00_0000;

/// User private-data limits of rdma_cm over IB/RoCE (wire-formats.md §4.3).
pub mod limits {
    use super::CMA_HDR_LEN;
    use crate::cm::pd_size;
    /// rdma_connect on RC/UC: REQ area minus the cma_hdr.
    pub const CONNECT: usize = pd_size::REQ - CMA_HDR_LEN;
    /// rdma_connect on UD: SIDR_REQ area minus the cma_hdr.
    pub const CONNECT_UD: usize = pd_size::SIDR_REQ - CMA_HDR_LEN;
    /// rdma_accept (REP).
    pub const ACCEPT: usize = pd_size::REP;
    /// rdma_accept on UD (SIDR_REP).
    pub const ACCEPT_UD: usize = pd_size::SIDR_REP;
    /// rdma_reject (REJ).
    pub const REJECT: usize = pd_size::REJ;
    /// rdma_reject on UD (SIDR_REP).
    pub const REJECT_UD: usize = pd_size::SIDR_REP;
    /// rdma_disconnect (DREQ); rdma_cm sends none, but the area exists.
    pub const DISCONNECT: usize = pd_size::DREQ;
}

/// An rdma_cm port space (`enum rdma_ucm_port_space`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub enum PortSpace {
    /// RDMA_PS_IPOIB.
    Ipoib,
    /// RDMA_PS_TCP: RC connections.
    Tcp,
    /// RDMA_PS_UDP: UD via SIDR.
    Udp,
    /// RDMA_PS_IB: any QP type.
    Ib,
}

impl PortSpace {
    /// The port-space value that forms bits 31..16 of the service ID.
    pub const fn value(self) -> u16 {
        match self {
            PortSpace::Ipoib => 0x0002,
            PortSpace::Tcp => 0x0106,
            PortSpace::Udp => 0x0111,
            PortSpace::Ib => 0x013F,
        }
    }

    /// The port space of a value.
    pub const fn from_value(v: u16) -> Option<Self> {
        Some(match v {
            0x0002 => PortSpace::Ipoib,
            0x0106 => PortSpace::Tcp,
            0x0111 => PortSpace::Udp,
            0x013F => PortSpace::Ib,
            _ => return None,
        })
    }

    /// Lower-case name as the tools spell it: ipoib, tcp, udp, ib.
    pub const fn name(self) -> &'static str {
        match self {
            PortSpace::Ipoib => "ipoib",
            PortSpace::Tcp => "tcp",
            PortSpace::Udp => "udp",
            PortSpace::Ib => "ib",
        }
    }

    /// The port the kernel's example tools use by default in this space (7471 for TCP,
    /// 7174 for UDP).
    pub const fn default_port(self) -> u16 {
        match self {
            PortSpace::Udp => 7174,
            _ => 7471,
        }
    }

    /// The range of service IDs this space covers, as (base, mask).
    pub const fn service_id_range(self) -> (u64, u64) {
        ((self.value() as u64) << 16, 0xFFFF_FFFF_FFFF_0000)
    }
}

impl std::str::FromStr for PortSpace {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "tcp" => Ok(PortSpace::Tcp),
            "udp" => Ok(PortSpace::Udp),
            "ib" => Ok(PortSpace::Ib),
            "ipoib" => Ok(PortSpace::Ipoib),
            _ => Err(format!(
                "unknown port space {s:?} (expected tcp, udp, ib or ipoib)"
            )),
        }
    }
}

/// `cma_get_service_id`: (port space << 16) + port.
pub const fn service_id(ps: PortSpace, port: u16) -> u64 {
    ((ps.value() as u64) << 16) | port as u64
}

/// Splits an rdma_cm service ID into port space and port, or `None` when it is not one.
pub const fn parse_service_id(sid: u64) -> Option<(PortSpace, u16)> {
    if sid >> 32 != 0 {
        return None;
    }
    match PortSpace::from_value((sid >> 16) as u16) {
        Some(ps) => Some((ps, sid as u16)),
        None => None,
    }
}

/// The rdma_cm private-data header, first 36 bytes of REQ and SIDR_REQ private data on
/// AF_INET/AF_INET6 ids (never on iWARP, never in other messages).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct CmaHdr {
    /// The active side's rdma_cm port (not a UDP port).
    pub src_port: u16,
    /// The active side's address.
    pub src: IpAddr,
    /// The address the active side connects to.
    pub dst: IpAddr,
}

impl CmaHdr {
    /// Parses the header at the start of `pd`. Fails on a version other than 0 (Linux's passive
    /// side rejects it with -EINVAL), an IP version other than 4 or 6, or mixed address
    /// families (impossible, as the IP version covers both).
    pub fn parse(pd: &[u8]) -> Result<Self> {
        need("cma_hdr", pd, CMA_HDR_LEN)?;
        if pd[0] != CMA_VERSION {
            return Err(WireError::BadField {
                field: "cma_hdr version",
                value: pd[0].into(),
            });
        }
        let ipv = pd[1] >> 4;
        let src_port = u16::from_be_bytes([pd[2], pd[3]]);
        let addr = |at: usize| -> Result<IpAddr> {
            let mut b = [0u8; 16];
            b.copy_from_slice(&pd[at..at + 16]);
            Ok(match ipv {
                4 => IpAddr::V4(Ipv4Addr::new(b[12], b[13], b[14], b[15])),
                6 => IpAddr::V6(Ipv6Addr::from(b)),
                other => {
                    return Err(WireError::BadField {
                        field: "cma_hdr IP version",
                        value: other.into(),
                    })
                }
            })
        };
        Ok(CmaHdr {
            src_port,
            src: addr(4)?,
            dst: addr(20)?,
        })
    }

    /// Writes the 36 bytes into the start of `pd`. IPv4 addresses are written as 12 zero
    /// bytes and the address (not `::ffff:`-mapped), as Linux does. Fails when the two
    /// addresses are of different families.
    pub fn emit(&self, pd: &mut [u8]) -> Result<()> {
        need("cma_hdr", pd, CMA_HDR_LEN)?;
        let ipv = match (self.src, self.dst) {
            (IpAddr::V4(_), IpAddr::V4(_)) => 4u8,
            (IpAddr::V6(_), IpAddr::V6(_)) => 6,
            _ => {
                return Err(WireError::BadField {
                    field: "cma_hdr address families differ",
                    value: 0,
                })
            }
        };
        pd[..CMA_HDR_LEN].fill(0);
        pd[0] = CMA_VERSION;
        pd[1] = ipv << 4;
        pd[2..4].copy_from_slice(&self.src_port.to_be_bytes());
        for (at, a) in [(4, self.src), (20, self.dst)] {
            match a {
                IpAddr::V4(v4) => pd[at + 12..at + 16].copy_from_slice(&v4.octets()),
                IpAddr::V6(v6) => pd[at..at + 16].copy_from_slice(&v6.octets()),
            }
        }
        Ok(())
    }

    /// The header followed by user data, checked against `max_user` (56 for a REQ, 180 for a
    /// SIDR_REQ: see [`limits`]).
    pub fn with_user_data(&self, user: &[u8], max_user: usize) -> Result<Vec<u8>> {
        if user.len() > max_user {
            return Err(WireError::PrivateDataTooLong {
                what: "rdma_cm connect",
                len: user.len(),
                max: max_user,
            });
        }
        let mut pd = vec![0u8; CMA_HDR_LEN + user.len()];
        self.emit(&mut pd)?;
        pd[CMA_HDR_LEN..].copy_from_slice(user);
        Ok(pd)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_ids_match_the_kernel() {
        assert_eq!(service_id(PortSpace::Tcp, 7471), 0x0000_0000_0106_1D2F);
        assert_eq!(
            service_id(PortSpace::Udp, 7174).to_be_bytes(),
            [0, 0, 0, 0, 1, 0x11, 0x1C, 0x06]
        );
        assert_eq!(service_id(PortSpace::Ib, 1), 0x013F_0001);
        assert_eq!(service_id(PortSpace::Ipoib, 2), 0x0002_0002);
        assert_eq!(parse_service_id(0x0106_1D2F), Some((PortSpace::Tcp, 7471)));
        assert_eq!(parse_service_id(0x0200_0000_0106_1D2F), None);
        assert_eq!(parse_service_id(0x0107_0000), None);
        assert_eq!(
            service_id(PortSpace::Tcp, 0) & IB_CMA_SERVICE_ID_MASK,
            IB_CMA_SERVICE_ID
        );
        assert_eq!(limits::CONNECT, 56);
        assert_eq!(limits::CONNECT_UD, 180);
    }

    #[test]
    fn cma_hdr_v4_and_v6() {
        let h = CmaHdr {
            src_port: 0xB26E,
            src: "192.168.1.10".parse().unwrap(),
            dst: "192.168.1.20".parse().unwrap(),
        };
        let pd = h.with_user_data(b"USERDATA", limits::CONNECT).unwrap();
        assert_eq!(&pd[..4], &[0, 0x40, 0xB2, 0x6E]);
        assert_eq!(
            &pd[4..20],
            &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 192, 168, 1, 10]
        );
        assert_eq!(&pd[36..], b"USERDATA");
        assert_eq!(CmaHdr::parse(&pd).unwrap(), h);
        let h6 = CmaHdr {
            src_port: 1,
            src: "fd00::10".parse().unwrap(),
            dst: "fd00::20".parse().unwrap(),
        };
        let mut b = [0u8; 36];
        h6.emit(&mut b).unwrap();
        assert_eq!(b[1], 0x60);
        assert_eq!(CmaHdr::parse(&b).unwrap(), h6);
        assert!(h.with_user_data(&[0; 57], limits::CONNECT).is_err());
        b[0] = 1;
        assert!(CmaHdr::parse(&b).is_err());
        b[0] = 0;
        b[1] = 0x50;
        assert!(CmaHdr::parse(&b).is_err());
        let mixed = CmaHdr {
            src_port: 1,
            src: "::1".parse().unwrap(),
            dst: "127.0.0.1".parse().unwrap(),
        };
        assert!(mixed.emit(&mut b).is_err());
    }
}
