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

/// The CPU this thread runs on now (it may move at once after), through glibc's
/// `sched_getcpu`. Not `rustix::thread::sched_getcpu`: that looks the vDSO up through the
/// auxiliary vector, which under valgrind names an unmapped page, so every program built
/// on rcm crashed there (rustix issue 1559); glibc's call works under valgrind and natively
/// costs the same vDSO call.
pub(crate) fn current_cpu() -> usize {
    // SAFETY: `sched_getcpu` takes no arguments and touches no memory of ours; it returns
    // the CPU number or -1 with errno set.
    let cpu = unsafe { libc::sched_getcpu() };
    usize::try_from(cpu).unwrap_or(0)
}

/// A descriptor of our own for what `of` refers to (mio's `Poll` gives its epoll instance
/// only as a raw descriptor): a thread can then wait until the epoll instance has
/// readiness (`poll(2)` on it) without holding the `Poll` itself.
pub(crate) fn dup_of(of: &impl std::os::fd::AsRawFd) -> std::io::Result<std::os::fd::OwnedFd> {
    // SAFETY: `of` owns the descriptor and keeps it open for the whole call (it is borrowed
    // for it); the borrow ends before we return, and the duplicate is a new descriptor.
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(of.as_raw_fd()) };
    fd.try_clone_to_owned()
}

/// `setsockopt` with an `int` value.
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
/// call, of equal size but the last ([`gro_size`] reads the size). On loopback a batch
/// sent with [`send_segments`] then crosses the stack once, not once per datagram.
pub(crate) fn enable_gro(sock: &UdpSocket) -> std::io::Result<()> {
    use nix::sys::socket::{setsockopt, sockopt::UdpGroSegment};
    setsockopt(sock, UdpGroSegment, &true).map_err(std::io::Error::from)
}

/// Turns `UDP_GRO` off: from then on the kernel cuts every coalesced run before it queues
/// it, and each receive brings one datagram.
pub(crate) fn disable_gro(sock: &UdpSocket) -> std::io::Result<()> {
    use nix::sys::socket::{setsockopt, sockopt::UdpGroSegment};
    setsockopt(sock, UdpGroSegment, &false).map_err(std::io::Error::from)
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

/// One datagram into `buf` with `recvfrom`, never waiting: 1 if the socket had one (`out`
/// says what `buf` got, `None` for a sender that is not IP), 0 if it had none. An empty
/// look costs 290 ns on the 2-core VM against 430 for [`recv_many`] of one (a message
/// header copied in and out), and a polling thread makes many; but it cannot see the
/// `UDP_GRO` control message: what it brings is cut as [`gsi_run_stride`] guesses.
pub(crate) fn recv_one(sock: &UdpSocket, buf: &mut [u8], out: &mut Option<Received>) -> usize {
    let Ok((n, _, from)) = rustix::net::recvfrom(sock, &mut *buf, rustix::net::RecvFlags::DONTWAIT)
    else {
        return 0;
    };
    let len = n.min(buf.len());
    *out = from
        .and_then(|a| std::net::SocketAddr::try_from(a).ok())
        .map(|from| {
            (
                from,
                len,
                gsi_run_stride(buf.get(..len).unwrap_or_default()),
            )
        });
    1
}

/// The size of the datagrams a receive without the `UDP_GRO` control message brought: a
/// GSI datagram's ([`GSI_UDP_PAYLOAD_LEN`]) when it is two or more of those and every piece
/// parses as one (a GSI datagram is always that size, and the kernel coalesces only
/// datagrams of one size but the last); else its whole length, one datagram, so that an
/// oversized datagram is dropped whole, as Linux drops it. Runs of other datagrams (UD
/// SENDs) are never guessed at: a device turns `UDP_GRO` off before it receives any (see
/// `rcm::id`'s UD registration), and what was coalesced before is for no QP. The one
/// datagram read otherwise than Linux would: a single one made of whole GSI datagrams
/// end to end, which only a sender crafting it makes; it is cut, and each piece judged as
/// the datagram its sender could have sent on its own.
///
/// [`GSI_UDP_PAYLOAD_LEN`]: rcm_wire::roce::GSI_UDP_PAYLOAD_LEN
pub(crate) fn gsi_run_stride(d: &[u8]) -> usize {
    use rcm_wire::roce::{GsiDatagram, GSI_UDP_PAYLOAD_LEN as GSI};
    let run = d.len() > GSI
        && d.len() % GSI == 0
        && d.chunks(GSI).all(|piece| GsiDatagram::parse(piece).is_ok());
    if run {
        GSI
    } else {
        d.len()
    }
}

/// Datagrams one [`recv_many`] call can take.
pub(crate) const RECV_MANY: usize = 2;

/// One received (possibly coalesced) datagram: its sender, its length and the size of the
/// datagrams it is made of (its length when it is one).
pub(crate) type Received = (std::net::SocketAddr, usize, usize);

/// Up to one datagram into each of the first `want` of `bufs` (1 to [`RECV_MANY`]), in one
/// system call (`recvmmsg`), never waiting; `out[i]` says what `bufs[i]` got, and the
/// result how many were filled. Fewer than `want` means the socket had no more queued: the
/// caller need not ask again, which saves the receive that would find nothing (half a µs,
/// on the path of every answer).
/// With `UDP_GRO` a datagram may be a coalesced run of one sender's datagrams, so each
/// buffer should hold 64 KiB.
pub(crate) fn recv_many(
    sock: &UdpSocket,
    bufs: [&mut [u8]; RECV_MANY],
    out: &mut [Option<Received>; RECV_MANY],
    want: usize,
) -> usize {
    use std::os::fd::AsRawFd;
    let want = want.clamp(1, RECV_MANY);
    // Room for the `UDP_GRO` control message (one int) of each datagram, aligned for
    // `cmsghdr`.
    let mut cmsg = [[0u64; 4]; RECV_MANY];
    // SAFETY: `sockaddr_storage` is plain old data, valid all zeroes.
    let mut names: [libc::sockaddr_storage; RECV_MANY] = unsafe { std::mem::zeroed() };
    let mut bufs = bufs;
    let mut iovs: [libc::iovec; RECV_MANY] = std::array::from_fn(|i| libc::iovec {
        iov_base: bufs[i].as_mut_ptr().cast(),
        iov_len: bufs[i].len(),
    });
    // SAFETY: `mmsghdr` is plain old data, valid all zeroes (null pointers, zero lengths).
    let mut hdrs: [libc::mmsghdr; RECV_MANY] = unsafe { std::mem::zeroed() };
    for (i, h) in hdrs.iter_mut().enumerate() {
        h.msg_hdr.msg_name = std::ptr::from_mut(&mut names[i]).cast();
        h.msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        h.msg_hdr.msg_iov = std::ptr::from_mut(&mut iovs[i]);
        h.msg_hdr.msg_iovlen = 1;
        h.msg_hdr.msg_control = cmsg[i].as_mut_ptr().cast();
        h.msg_hdr.msg_controllen = std::mem::size_of_val(&cmsg[i]) as _;
    }
    // SAFETY: every header points at memory that lives across the call and is as long as
    // its length says (a buffer of `bufs`, a `sockaddr_storage`, a control area), and the
    // count passed is the array's length; the kernel writes only within them.
    let n = unsafe {
        libc::recvmmsg(
            sock.as_raw_fd(),
            hdrs.as_mut_ptr(),
            want as libc::c_uint,
            libc::MSG_DONTWAIT,
            std::ptr::null_mut(),
        )
    };
    let Ok(n) = usize::try_from(n) else {
        return 0;
    };
    let n = n.min(want);
    for (i, (h, name)) in hdrs.iter().zip(&names).enumerate().take(n) {
        let len = (h.msg_len as usize).min(iovs[i].iov_len);
        // SAFETY: the kernel filled `name` (of the length it reports) for this datagram.
        let from = unsafe { socket2::SockAddr::new(*name, h.msg_hdr.msg_namelen) }.as_socket();
        // `None` for a sender that is not IP (cannot happen on a UDP socket): nothing to
        // answer. Kept in its place: `out[i]` is what `bufs[i]` holds.
        // Without the control message (the kernel adds it only while `UDP_GRO` is on, and a
        // run coalesced before it was turned off stays coalesced), the stride is guessed as
        // a quiet receive guesses it: else that run would be one bad datagram, every MAD in
        // it lost.
        let stride = gro_size(&h.msg_hdr)
            .unwrap_or_else(|| gsi_run_stride(bufs[i].get(..len).unwrap_or_default()));
        out[i] = from.map(|from| (from, len, stride));
    }
    n
}

/// The segment size of a coalesced receive, from its `UDP_GRO` control message.
fn gro_size(m: &libc::msghdr) -> Option<usize> {
    // SAFETY: `m` is a header the kernel just filled: its control pointer and length
    // describe the control messages it wrote, which the CMSG macros walk within bounds.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(m);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_UDP
                && (*c).cmsg_type == libc::UDP_GRO
                && (*c).cmsg_len as usize
                    >= libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as usize
            {
                let v = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<libc::c_int>());
                return usize::try_from(v).ok().filter(|&v| v > 0);
            }
            c = libc::CMSG_NXTHDR(m, c);
        }
    }
    None
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
    /// Each buffer gets one datagram and `out[i]` describes `bufs[i]`; a call bringing fewer
    /// than it could means the socket is empty.
    #[test]
    fn recv_many_fills_the_buffers_in_order_and_says_when_the_socket_is_empty() {
        use super::{recv_many, RECV_MANY};
        let rx = std::net::UdpSocket::bind("127.0.0.1:0").expect("receiver");
        let tx = std::net::UdpSocket::bind("127.0.0.1:0").expect("sender");
        let (to, from) = (
            rx.local_addr().expect("addr"),
            tx.local_addr().expect("addr"),
        );
        for k in 1..=3u8 {
            tx.send_to(&vec![k; usize::from(k) * 10], to).expect("send");
        }
        let mut areas = [[0u8; 64]; RECV_MANY];
        let take = |areas: &mut [[u8; 64]; RECV_MANY]| {
            let mut out = [None; RECV_MANY];
            let [a, b] = areas;
            let n = recv_many(&rx, [&mut a[..], &mut b[..]], &mut out, RECV_MANY);
            (n, out)
        };
        let (n, out) = take(&mut areas);
        assert_eq!(n, 2);
        assert_eq!(out, [Some((from, 10, 10)), Some((from, 20, 20))]);
        assert_eq!(
            (&areas[0][..10], &areas[1][..20]),
            (&[1; 10][..], &[2; 20][..])
        );
        let (n, out) = take(&mut areas);
        assert_eq!(n, 1, "one was left");
        assert_eq!(out[0], Some((from, 30, 30)));
        assert_eq!(&areas[0][..30], &[3; 30][..]);
        assert_eq!(take(&mut areas).0, 0, "nothing was left");
    }

    /// A GSI datagram with PSN `psn` and a MAD of `psn`'s low byte throughout.
    fn gsi(psn: u32) -> Vec<u8> {
        let ip = rcm_wire::roce::IpForIcrc::v4([127, 0, 0, 1].into(), [127, 0, 0, 2].into());
        rcm_wire::roce::emit_gsi(&ip, 4791, psn, &[psn as u8; rcm_wire::roce::MAD_LEN])
    }

    /// Two or more whole GSI datagrams, each a valid one, are a run of them; anything else
    /// is one datagram.
    #[test]
    fn a_run_is_guessed_only_from_whole_gsi_datagrams() {
        use super::gsi_run_stride;
        use rcm_wire::roce::GSI_UDP_PAYLOAD_LEN as GSI;
        let run: Vec<u8> = (0..3).flat_map(gsi).collect();
        assert_eq!(gsi_run_stride(&run), GSI);
        assert_eq!(gsi_run_stride(&run[..2 * GSI]), GSI);
        assert_eq!(gsi_run_stride(&run[..GSI]), GSI, "one is one");
        assert_eq!(gsi_run_stride(&run[..GSI + 100]), GSI + 100, "not whole");
        assert_eq!(gsi_run_stride(&[]), 0);
        // Whole in size, but the first is no GSI datagram (a UD SEND to another QP).
        let mut other = run.clone();
        other[4..8].copy_from_slice(&0x0000_1234u32.to_be_bytes());
        assert_eq!(gsi_run_stride(&other), 3 * GSI);
        let junk = vec![0x64u8; 2 * GSI];
        assert_eq!(gsi_run_stride(&junk), 2 * GSI);
        // A valid first piece padded to a whole number of them (an oversized REQ): one.
        let mut padded = run[..GSI].to_vec();
        padded.resize(5 * GSI, 0xA5);
        assert_eq!(gsi_run_stride(&padded), 5 * GSI);
        let mut last_bad = run.clone();
        last_bad[2 * GSI + 4..2 * GSI + 8].copy_from_slice(&0x0000_1234u32.to_be_bytes());
        assert_eq!(
            gsi_run_stride(&last_bad),
            3 * GSI,
            "the last piece is no GSI datagram"
        );
    }

    /// `recv_one` takes one datagram a call with its sender, and says when the socket is
    /// empty; with `UDP_GRO` a segmented run of GSI datagrams comes in one call, told apart
    /// by its sizes, and a run of other datagrams as one.
    #[test]
    fn recv_one_takes_a_datagram_or_a_run_a_call() {
        use super::{enable_gro, recv_one, send_segments};
        use rcm_wire::roce::GSI_UDP_PAYLOAD_LEN as GSI;
        let rx = std::net::UdpSocket::bind("127.0.0.1:0").expect("receiver");
        enable_gro(&rx).expect("UDP_GRO");
        let tx = std::net::UdpSocket::bind("127.0.0.1:0").expect("sender");
        let (to, from) = (
            rx.local_addr().expect("addr"),
            tx.local_addr().expect("addr"),
        );
        let mut area = vec![0u8; 1 << 16];
        let mut out = None;
        assert_eq!(recv_one(&rx, &mut area, &mut out), 0, "empty");
        tx.send_to(&[7; 50], to).expect("send");
        assert_eq!(recv_one(&rx, &mut area, &mut out), 1);
        assert_eq!(out, Some((from, 50, 50)));
        assert_eq!(&area[..50], &[7; 50][..]);
        let run: Vec<u8> = (0..3).flat_map(gsi).collect();
        send_segments(&tx, to, &run, GSI as u16).expect("segmented send");
        assert_eq!(recv_one(&rx, &mut area, &mut out), 1);
        assert_eq!(out, Some((from, 3 * GSI, GSI)), "the run, cut by its size");
        assert_eq!(&area[..3 * GSI], &run[..]);
        let other = vec![9u8; 3 * 296];
        send_segments(&tx, to, &other, 296).expect("segmented send");
        assert_eq!(recv_one(&rx, &mut area, &mut out), 1);
        assert_eq!(out, Some((from, 3 * 296, 3 * 296)), "taken as one");
        assert_eq!(recv_one(&rx, &mut area, &mut out), 0, "nothing was left");
    }

    /// With `UDP_GRO` turned off again, the kernel cuts a segmented run before it queues
    /// it: a datagram a receive.
    #[test]
    fn without_gro_a_run_comes_one_datagram_a_receive() {
        use super::{disable_gro, enable_gro, recv_one, send_segments};
        let rx = std::net::UdpSocket::bind("127.0.0.1:0").expect("receiver");
        enable_gro(&rx).expect("UDP_GRO");
        disable_gro(&rx).expect("UDP_GRO off");
        let tx = std::net::UdpSocket::bind("127.0.0.1:0").expect("sender");
        let (to, from) = (
            rx.local_addr().expect("addr"),
            tx.local_addr().expect("addr"),
        );
        let run: Vec<u8> = (0..3u8).flat_map(|k| [k; 296]).collect();
        send_segments(&tx, to, &run, 296).expect("segmented send");
        let mut area = vec![0u8; 1 << 16];
        for k in 0..3u8 {
            let mut out = None;
            assert_eq!(recv_one(&rx, &mut area, &mut out), 1);
            assert_eq!(out, Some((from, 296, 296)));
            assert_eq!(&area[..296], &[k; 296][..]);
        }
        assert_eq!(recv_one(&rx, &mut area, &mut None), 0);
    }

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
