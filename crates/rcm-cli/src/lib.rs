//! The library behind the `rcm` command: capture reading, frame building and the decoder.
//! The binary (`src/main.rs`) is a thin command-line layer over it.

pub mod bench;
pub mod capture;
pub mod decode;
pub mod netbuild;
pub mod ping;
pub mod stress;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};

/// The local address a tool binds its device to when it connects to `dst` without `--bind`.
/// Toward loopback: another loopback address (127.0.0.2, or 127.0.0.1 toward 127.0.0.2), as
/// a device per address cannot share its UDP port with the peer's; IPv6 has only `::1`.
/// Otherwise: the address the kernel's routing table picks for `dst`, found by connecting
/// a UDP socket, which sends nothing.
pub fn default_source(dst: IpAddr) -> Result<IpAddr, String> {
    match dst {
        IpAddr::V4(v4) if v4.is_loopback() => {
            Ok(IpAddr::V4(if v4 == Ipv4Addr::new(127, 0, 0, 2) {
                Ipv4Addr::LOCALHOST
            } else {
                Ipv4Addr::new(127, 0, 0, 2)
            }))
        }
        IpAddr::V6(v6) if v6.is_loopback() => Ok(IpAddr::V6(Ipv6Addr::LOCALHOST)),
        _ => {
            let any: IpAddr = if dst.is_ipv4() {
                Ipv4Addr::UNSPECIFIED.into()
            } else {
                Ipv6Addr::UNSPECIFIED.into()
            };
            let s = UdpSocket::bind(SocketAddr::new(any, 0))
                .and_then(|s| s.connect(SocketAddr::new(dst, 4791)).map(|()| s))
                .and_then(|s| s.local_addr())
                .map_err(|e| format!("no local address routes to {dst} ({e}); give --bind"))?;
            Ok(s.ip())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_source_picks_another_loopback_or_the_routed_address() {
        let v4 = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(default_source(v4("127.0.0.1")), Ok(v4("127.0.0.2")));
        assert_eq!(default_source(v4("127.0.0.5")), Ok(v4("127.0.0.2")));
        assert_eq!(default_source(v4("127.0.0.2")), Ok(v4("127.0.0.1")));
        assert_eq!(default_source(v4("::1")), Ok(v4("::1")));
        // A test-net address with no route here fails with advice, or (with a default
        // route) gives a local, non-loopback address; either way nothing is sent.
        match default_source(v4("198.18.0.77")) {
            Ok(ip) => assert!(!ip.is_unspecified() && !ip.is_loopback(), "{ip}"),
            Err(e) => assert!(e.contains("give --bind"), "{e}"),
        }
    }
}
