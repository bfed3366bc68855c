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

/// `setsockopt` with an `int` value: the one `unsafe` call of this module.
fn set_int(
    sock: &UdpSocket,
    level: libc::c_int,
    opt: libc::c_int,
    val: libc::c_int,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
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
