//! The library behind the `rcm` command: capture reading, frame building and the decoder.
//! The binary (`src/main.rs`) is a thin command-line layer over it.

pub mod bench;
pub mod breakdown;
pub mod capture;
pub mod decode;
pub mod netbuild;
pub mod ping;
pub mod stress;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};

/// Raises this process's limit of open files to its hard limit, as servers do: an iWARP
/// connection is a TCP socket at each end and a daemon's client a Unix socket or more, and
/// the usual soft limit (1,024) is far below the hard one (on Debian 12, 524,288 or more).
/// Returns the soft limit now in force, if there is one.
pub fn raise_fd_limit() -> Option<u64> {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let l = getrlimit(Resource::Nofile);
    if let (Some(cur), Some(max)) = (l.current, l.maximum) {
        if cur < max {
            let _ = setrlimit(
                Resource::Nofile,
                Rlimit {
                    current: Some(max),
                    maximum: Some(max),
                },
            );
        }
    }
    getrlimit(Resource::Nofile).current
}

/// Adds a device on `ip` to `f`: an iWARP one with `iwarp`, else a RoCEv2 one.
pub fn add_device(f: &rcm::Fabric, ip: std::net::IpAddr, iwarp: bool) -> rcm::Result<rcm::Device> {
    if iwarp {
        f.add_iwarp_device(ip)
    } else {
        f.add_device(ip)
    }
}

/// What a tool says when it cannot open the device `what` (RoCEv2 or iWARP): the error, and
/// for a RoCEv2 device's UDP port another socket holds (one process owns a device's port, as
/// the kernel owns QP1) what usually holds it and the ways past it; for an address this host
/// does not have, that.
pub fn device_error(what: &str, e: &rcm::Error) -> String {
    match e {
        rcm::Error::AddrInUse(a) => {
            let ip = a.ip().to_string();
            let on = if what.contains(&ip) {
                String::new()
            } else {
                format!(" on {ip}")
            };
            format!(
                "{what}: UDP port {}{on} is held by another socket (another rcm process, or \
                 an rcm daemon, whose clients take --daemon PATH); stop it, use its daemon, \
                 or give both ends another --udp-port",
                a.port()
            )
        }
        rcm::Error::AddrNotAvailable(ip) => {
            format!("{what}: {ip} is not an address of this host (`ip addr` lists them)")
        }
        e => format!("{what}: {e}"),
    }
}

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
    #[test]
    fn the_open_file_limit_is_raised_to_the_hard_one() {
        use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
        let hard = getrlimit(Resource::Nofile).maximum;
        // Lowered first (to half the hard limit: enough for tests running beside this one),
        // so the raise has something to do.
        if let Some(h) = hard {
            setrlimit(
                Resource::Nofile,
                Rlimit {
                    current: Some(h / 2),
                    maximum: Some(h),
                },
            )
            .expect("lower the soft limit");
        }
        assert_eq!(
            super::raise_fd_limit(),
            hard,
            "the soft limit is raised to the hard one"
        );
    }

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
