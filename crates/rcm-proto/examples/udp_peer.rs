//! Drives `ib::Endpoint` over a plain UDP socket on port 4791: the early proof that the
//! engine speaks the protocol the Linux kernel speaks. Used by `tests/interop/` in the QEMU
//! harness against the kernel's `ucmatose`.
//!
//! ```text
//! udp_peer connect LOCAL_IP REMOTE_IP [PORT] [COUNT]   # active: COUNT connections, wait for the
//!                                                      # peer's DREQ on each (ucmatose -C 0 server)
//! udp_peer listen  LOCAL_IP [PORT] [COUNT]             # passive: accept COUNT connections, then
//!                                                      # disconnect each (ucmatose -C 0 client)
//! ```
//! Exit status 0 when every connection was established and torn down cleanly.
//!
//! With `IP_PMTUDISC_DO`, the IPv4 header a Linux unconnected UDP socket sends has ID 0 and DF
//! set (with the default `IP_PMTUDISC_WANT` the kernel picks a hashed ID instead), so the ICRC,
//! which covers the ID, can be computed before sending.
//! A UDP socket does not see the received IP header, so received ICRCs are not checked here.

use rcm_proto::ib::{AcceptParams, CepHandle, CmEvent, ConnectParams, Endpoint, EndpointConfig};
use rcm_wire::cma::{self, CmaHdr, PortSpace};
use rcm_wire::roce::{self, GsiDatagram, IpForIcrc};
use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::process::ExitCode;
use std::time::{Duration, Instant};

fn usage() -> ExitCode {
    eprintln!("usage: udp_peer connect LOCAL_IP REMOTE_IP [PORT] [COUNT] | udp_peer listen LOCAL_IP [PORT] [COUNT]");
    ExitCode::from(2)
}

struct Io {
    sock: UdpSocket,
    local: Ipv4Addr,
    sport: u16,
    psn: u32,
}

impl Io {
    fn flush(&mut self, ep: &mut Endpoint) {
        while let Some(t) = ep.poll_transmit() {
            let IpAddr::V4(dst) = t.dst else { continue };
            let ip = IpForIcrc::v4(self.local, dst);
            // The ICRC covers the UDP header: use the port the socket really sends from.
            let payload = roce::emit_gsi(&ip, self.sport, self.psn, &t.mad);
            self.psn = (self.psn + 1) & 0xFF_FFFF;
            if let Err(e) = self
                .sock
                .send_to(&payload, SocketAddr::new(t.dst, roce::ROCE_V2_UDP_PORT))
            {
                eprintln!("udp_peer: send to {dst}: {e}");
            }
        }
    }

    /// Receives for up to `wait`, feeding MADs and timers to the engine.
    fn poll(&mut self, ep: &mut Endpoint, wait: Duration) {
        let now = Instant::now();
        let until = ep.poll_timeout().map_or(now + wait, |t| t.min(now + wait));
        let timeout = until
            .saturating_duration_since(now)
            .max(Duration::from_millis(1));
        let _ = self.sock.set_read_timeout(Some(timeout));
        let mut buf = [0u8; 2048];
        if let Ok((n, from)) = self.sock.recv_from(&mut buf) {
            match GsiDatagram::parse(&buf[..n]) {
                Ok(g) => ep.handle_datagram(Instant::now(), from.ip(), g.mad),
                Err(e) => eprintln!("udp_peer: {n} bytes from {from} dropped: {e}"),
            }
        }
        ep.handle_timeout(Instant::now());
        self.flush(ep);
    }
}

/// Sets `IP_MTU_DISCOVER = IP_PMTUDISC_DO`, which makes Linux send IPv4 ID 0.
fn pmtudisc_do(sock: &UdpSocket) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let val: libc::c_int = libc::IP_PMTUDISC_DO;
    // SAFETY: the fd is a live socket owned by `sock` for the duration of the call, and the
    // option value points at a c_int of the size passed.
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

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (Some(mode), Some(local)) = (
        args.get(1),
        args.get(2).and_then(|s| s.parse::<Ipv4Addr>().ok()),
    ) else {
        return usage();
    };
    let active = match mode.as_str() {
        "connect" => true,
        "listen" => false,
        _ => return usage(),
    };
    let rest = if active { 4 } else { 3 };
    let remote: Option<Ipv4Addr> = if active {
        args.get(3).and_then(|s| s.parse().ok())
    } else {
        None
    };
    if active && remote.is_none() {
        return usage();
    }
    let port: u16 = args.get(rest).and_then(|s| s.parse().ok()).unwrap_or(7471);
    let count: usize = args.get(rest + 1).and_then(|s| s.parse().ok()).unwrap_or(1);
    let sock = match UdpSocket::bind((local, roce::ROCE_V2_UDP_PORT)) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("udp_peer: bind {local}:4791: {e}");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = pmtudisc_do(&sock) {
        eprintln!("udp_peer: IP_MTU_DISCOVER: {e}");
        return ExitCode::from(2);
    }
    println!("udp_peer: listening on udp {local}:4791");
    let seed = u64::from(std::process::id())
        ^ Instant::now().elapsed().as_nanos() as u64
        ^ 0x9E37_79B9_7F4A_7C15;
    let mut cfg = EndpointConfig::new(IpAddr::V4(local), 0x0200_00FF_FE00_0001, seed);
    cfg.retry = rcm_proto::ib::RetryPolicy::Classic;
    let mut ep = Endpoint::new(cfg);
    let mut io = Io {
        sock,
        local,
        sport: roce::ROCE_V2_UDP_PORT,
        psn: 0,
    };
    let sid = cma::service_id(PortSpace::Tcp, port);
    let deadline = Instant::now() + Duration::from_secs(60);
    let (mut established, mut closed, mut failed) = (0usize, 0usize, 0usize);
    let mut live: HashSet<CepHandle> = HashSet::new();

    if let Some(remote) = remote {
        for i in 0..count {
            let mut p = ConnectParams::new(IpAddr::V4(remote), sid, 0x100 + i as u32);
            let hdr = CmaHdr {
                src_port: 40000 + i as u16,
                src: IpAddr::V4(local),
                dst: IpAddr::V4(remote),
            };
            p.private_data = hdr
                .with_user_data(b"rcm udp_peer", cma::limits::CONNECT)
                .unwrap_or_default();
            p.path.flow_label = (u32::from(hdr.src_port) * 31 + u32::from(port)) & 0xF_FFFF;
            match ep.connect(Instant::now(), &p) {
                Ok(h) => {
                    live.insert(h);
                }
                Err(e) => {
                    eprintln!("udp_peer: connect: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
    } else if let Err(e) = ep.listen(sid, u64::MAX, 0) {
        eprintln!("udp_peer: listen: {e}");
        return ExitCode::FAILURE;
    }
    io.flush(&mut ep);

    while closed + failed < count && Instant::now() < deadline {
        io.poll(&mut ep, Duration::from_millis(200));
        while let Some((h, ev)) = ep.poll_event() {
            let now = Instant::now();
            println!("udp_peer: {h:?} {ev:?}");
            match ev {
                CmEvent::ReqReceived { cep, info, .. } => {
                    let p = AcceptParams {
                        qpn: 0x200 + live.len() as u32,
                        responder_resources: info.initiator_depth,
                        initiator_depth: info.responder_resources,
                        rnr_retry_count: 7,
                        private_data: b"rcm accepts".to_vec(),
                        ..AcceptParams::default()
                    };
                    live.insert(cep);
                    if let Err(e) = ep.accept(now, cep, &p) {
                        eprintln!("udp_peer: accept: {e}");
                        failed += 1;
                    }
                }
                CmEvent::RepReceived(_) => {
                    if let Err(e) = ep.establish(h) {
                        eprintln!("udp_peer: establish: {e}");
                        failed += 1;
                    }
                }
                CmEvent::Established => {
                    established += 1;
                    if !active {
                        // The kernel's ucmatose client waits for the server to disconnect.
                        let _ = ep.disconnect(now, h, &[]);
                    }
                }
                CmEvent::DreqReceived { .. } => {
                    let _ = ep.disconnect(now, h, &[]);
                    closed += 1;
                }
                CmEvent::DrepReceived => closed += 1,
                CmEvent::Rejected { reason, .. } => {
                    eprintln!("udp_peer: rejected: {reason:?}");
                    failed += 1;
                }
                CmEvent::TimedOut(what) => {
                    eprintln!("udp_peer: timed out: {what:?}");
                    failed += 1;
                }
                _ => {}
            }
        }
        io.flush(&mut ep);
    }
    // Let the last DREP/RTU leave and answer stragglers for a moment.
    let linger = Instant::now() + Duration::from_millis(500);
    while Instant::now() < linger {
        io.poll(&mut ep, Duration::from_millis(50));
        while ep.poll_event().is_some() {}
    }
    println!("udp_peer: established={established} closed={closed} failed={failed} of {count}");
    if established == count && closed == count && failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
