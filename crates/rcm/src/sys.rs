//! Socket options std does not offer, and segmented sends and coalesced receives. Kept apart
//! so the CM core stays free of `unsafe`.

use std::net::UdpSocket;

/// Sets `IP_MTU_DISCOVER = IP_PMTUDISC_DO` on an IPv4 UDP socket: Linux then sends IPv4 ID 0
/// with DF set from an unconnected socket, which makes the RoCEv2 ICRC (it covers the ID)
/// computable before sending. With the default (`WANT`) the kernel picks a hashed ID.
pub(crate) fn pmtudisc_do(sock: &UdpSocket) -> std::io::Result<()> {
    set_int(
        sock,
        libc::IPPROTO_IP,
        libc::IP_MTU_DISCOVER,
        libc::IP_PMTUDISC_DO,
    )
}

/// Sets `UDP_NO_CHECK6_RX` on an IPv6 UDP socket: it then takes datagrams whose UDP checksum
/// is 0. Linux's soft-RoCE (rxe) sends RoCEv2 over IPv6 with checksum 0 (the ICRC protects
/// the payload), which RFC 8200 forbids for plain UDP, and without this option the kernel
/// drops every one of them before the socket sees it: an IPv6 device heard no REP, REQ or DREQ
/// from a Linux peer (seen in the interop VM).
pub(crate) fn accept_zero_checksum6(sock: &UdpSocket) -> std::io::Result<()> {
    set_int(sock, libc::IPPROTO_UDP, libc::UDP_NO_CHECK6_RX, 1)
}

/// Sets `IP_BIND_ADDRESS_NO_PORT` on a TCP socket about to be bound to an address with port
/// 0 and then connected: the port is then chosen at `connect` for the whole 4-tuple. Without
/// it `bind` picks a port no socket holds, TIME_WAIT ones included, searching the range
/// under the kernel's bind-hash locks: after 15,000 iWARP connections from one address, the
/// next 15,000 spent a whole CPU in that search and most did not connect within 20 s. At
/// `connect`, a port whose TIME_WAIT is towards another peer is free, and on loopback one
/// towards the same peer is reused (`tcp_tw_reuse`).
pub(crate) fn bind_address_no_port(sock: &impl std::os::fd::AsRawFd) -> std::io::Result<()> {
    set_int(sock, libc::IPPROTO_IP, libc::IP_BIND_ADDRESS_NO_PORT, 1)
}

/// `setsockopt` with an `int` value: the one `unsafe` call of this module.
fn set_int(
    sock: &impl std::os::fd::AsRawFd,
    level: libc::c_int,
    opt: libc::c_int,
    val: libc::c_int,
) -> std::io::Result<()> {
    // SAFETY: `sock` owns a valid socket fd for the whole call, and the option value points at
    // a live c_int whose size is passed as the length.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            level,
            opt,
            std::ptr::from_ref(&val).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Asks for `bytes` of socket buffer in each direction: `SO_RCVBUFFORCE`/`SO_SNDBUFFORCE`
/// when permitted (root or CAP_NET_ADMIN), else the capped `SO_RCVBUF`/`SO_SNDBUF`. A burst
/// of thousands of connects arrives faster than one thread drains it; a small buffer turns
/// that into drops and second-long retransmission tails.
pub(crate) fn grow_buffers(sock: &UdpSocket, bytes: usize) {
    let val = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    for (force, plain) in [
        (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF),
        (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF),
    ] {
        if set_int(sock, libc::SOL_SOCKET, force, val).is_err() {
            let _ = set_int(sock, libc::SOL_SOCKET, plain, val);
        }
    }
}

/// Segments a UDP send may carry (`UDP_MAX_SEGMENTS` in Linux 4.18 to 6.8; later kernels allow
/// more).
pub(crate) const MAX_SEGMENTS: usize = 64;

/// Turns on `UDP_GRO`: the kernel may then hand several datagrams of one flow to one receive
/// call, of equal size but the last ([`recv_segments`] says the size). On loopback a batch
/// sent with [`send_segments`] then crosses the stack once, not once per datagram.
pub(crate) fn enable_gro(sock: &UdpSocket) -> std::io::Result<()> {
    use nix::sys::socket::{setsockopt, sockopt::UdpGroSegment};
    setsockopt(sock, UdpGroSegment, &true).map_err(std::io::Error::from)
}

/// Sends `buf` to `dst` as datagrams of `seg` bytes each (the last may be shorter) in one
/// system call (`UDP_SEGMENT`, Linux 4.18+). Fails with `EIO` when the route's device cannot
/// checksum them (the kernel sends nothing then) and `EINVAL` on kernels without it.
pub(crate) fn send_segments(
    sock: &UdpSocket,
    dst: std::net::SocketAddr,
    buf: &[u8],
    seg: u16,
) -> std::io::Result<usize> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags, SockaddrStorage};
    use std::os::fd::AsRawFd;
    let addr = SockaddrStorage::from(dst);
    sendmsg(
        sock.as_raw_fd(),
        &[std::io::IoSlice::new(buf)],
        &[ControlMessage::UdpGsoSegments(&seg)],
        MsgFlags::empty(),
        Some(&addr),
    )
    .map_err(std::io::Error::from)
}

/// Control-message space for a receive with `UDP_GRO` (one `int`).
pub(crate) fn gro_cmsg_space() -> Vec<u8> {
    nix::cmsg_space!(libc::c_int)
}

/// One (possibly coalesced) datagram into `buf` if one is queued, never waiting: its sender,
/// its length and the size of the datagrams it is made of (its length when it is one).
pub(crate) fn recv_segments(
    sock: &UdpSocket,
    buf: &mut [u8],
    cmsg: &mut [u8],
) -> Option<(std::net::SocketAddr, usize, usize)> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags, SockaddrStorage};
    use std::os::fd::AsRawFd;
    let mut iov = [std::io::IoSliceMut::new(buf)];
    let m = recvmsg::<SockaddrStorage>(
        sock.as_raw_fd(),
        &mut iov,
        Some(cmsg),
        MsgFlags::MSG_DONTWAIT,
    )
    .ok()?;
    let from = m.address?;
    let from = if let Some(a) = from.as_sockaddr_in() {
        std::net::SocketAddr::V4((*a).into())
    } else {
        std::net::SocketAddr::V6((*from.as_sockaddr_in6()?).into())
    };
    let len = m.bytes;
    let mut stride = len;
    if let Ok(cmsgs) = m.cmsgs() {
        for c in cmsgs {
            if let ControlMessageOwned::UdpGroSegments(s) = c {
                if let Ok(s) = usize::try_from(s) {
                    if s > 0 {
                        stride = s;
                    }
                }
            }
        }
    }
    Some((from, len, stride))
}

/// Sets `SO_NO_CHECK` (no UDP checksums on send): the kernel then refuses segmented sends
/// with `EINVAL`, which is how the tests reach the one-by-one fallback.
#[cfg(test)]
pub(crate) fn set_no_check(sock: &UdpSocket) -> std::io::Result<()> {
    set_int(sock, libc::SOL_SOCKET, libc::SO_NO_CHECK, 1)
}

/// Sets `UDP_NO_CHECK6_TX`: the socket sends IPv6 datagrams with UDP checksum 0, as rxe does
/// (for tests of [`accept_zero_checksum6`]).
#[cfg(test)]
pub(crate) fn send_zero_checksum6(sock: &UdpSocket) -> std::io::Result<()> {
    set_int(sock, libc::IPPROTO_UDP, libc::UDP_NO_CHECK6_TX, 1)
}

#[cfg(test)]
mod tests {
    /// With the option, binding to an address and port 0 leaves the port to `connect`
    /// (without it, `bind` takes one at once).
    #[test]
    fn bind_address_no_port_leaves_the_port_to_connect() {
        use socket2::{Domain, Socket, Type};
        use std::net::{Ipv4Addr, SocketAddr};
        let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("listener");
        let bound_port = |no_port: bool| {
            let s = Socket::new(Domain::IPV4, Type::STREAM, None).expect("socket");
            if no_port {
                super::bind_address_no_port(&s).expect("IP_BIND_ADDRESS_NO_PORT");
            }
            let here = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
            s.bind(&here.into()).expect("bind");
            let port = |s: &Socket| {
                s.local_addr()
                    .ok()
                    .and_then(|a| a.as_socket())
                    .map(|a| a.port())
            };
            let before = port(&s);
            s.connect(&listener.local_addr().expect("addr").into())
                .expect("connect");
            (before, port(&s))
        };
        let (before, after) = bound_port(true);
        assert_eq!(before, Some(0));
        assert!(after.is_some_and(|p| p != 0), "{after:?}");
        let (before, _) = bound_port(false);
        assert!(before.is_some_and(|p| p != 0), "{before:?}");
    }
}
