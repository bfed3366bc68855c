//! The one socket option std does not offer. Kept apart so the CM core stays free of `unsafe`.

use std::net::UdpSocket;

/// Sets `IP_MTU_DISCOVER = IP_PMTUDISC_DO` on an IPv4 UDP socket: Linux then sends IPv4 ID 0
/// with DF set from an unconnected socket, which makes the RoCEv2 ICRC (it covers the ID)
/// computable before sending. With the default (`WANT`) the kernel picks a hashed ID.
pub(crate) fn pmtudisc_do(sock: &UdpSocket) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let val: libc::c_int = libc::IP_PMTUDISC_DO;
    // SAFETY: `sock` owns a valid socket fd for the whole call, and the option value points at
    // a live c_int whose size is passed as the length.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
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
    use std::os::fd::AsRawFd;
    let val = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    for (force, plain) in [
        (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF),
        (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF),
    ] {
        for opt in [force, plain] {
            // SAFETY: `sock` owns a valid fd for the call; the value points at a live c_int
            // whose size is passed.
            let rc = unsafe {
                libc::setsockopt(
                    sock.as_raw_fd(),
                    libc::SOL_SOCKET,
                    opt,
                    std::ptr::from_ref(&val).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
            if rc == 0 {
                break;
            }
        }
    }
}
