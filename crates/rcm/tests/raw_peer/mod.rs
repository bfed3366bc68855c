//! A raw RoCEv2 CM peer for tests that check rcm's bytes or send it what rcm itself would
//! not, and [`chaos`]: CM messages in any order at live ids. Shared by `loopback.rs` (devices
//! in the process) and rcm-ucm's `daemon_chaos.rs` (through the daemon).
#![allow(dead_code)]

use rcm::{
    AcceptOptions, ChannelEvent, CmId, ConnectOptions, DestroyOutcome, Event, EventChannel, Fabric,
    PortSpace, QpState,
};
use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

/// How long any single wait may take.
const T: Duration = Duration::from_secs(10);

/// A raw RoCEv2 CM peer on 127.0.0.2 (UDP port `port`), for tests that check rcm's bytes or
/// send it what rcm itself would not. The fabric under test must not have a device there.
pub struct RawPeer {
    /// Its socket (tests read what rcm sent with it).
    pub sock: std::net::UdpSocket,
    port: u16,
}

impl RawPeer {
    /// Binds 127.0.0.2:`port`.
    pub fn new(port: u16) -> Self {
        let sock = std::net::UdpSocket::bind(("127.0.0.2", port)).unwrap();
        sock.set_read_timeout(Some(T)).unwrap();
        RawPeer { sock, port }
    }

    /// Sends `msg` to 127.0.0.1 as a GSI datagram.
    pub fn send(&self, msg: rcm_wire::cm::CmMessage, tid: u64) {
        self.send_to(std::net::Ipv4Addr::LOCALHOST, msg, tid);
    }

    /// Sends `msg` to the device at `dst` as a GSI datagram.
    pub fn send_to(&self, dst: std::net::Ipv4Addr, msg: rcm_wire::cm::CmMessage, tid: u64) {
        use rcm_wire::roce::{emit_gsi, IpForIcrc};
        let mad = rcm_wire::cm::CmMad::send(tid, msg).emit().expect("encodes");
        let ip = IpForIcrc::v4(std::net::Ipv4Addr::new(127, 0, 0, 2), dst);
        let udp = emit_gsi(&ip, self.port, 0, &mad);
        self.sock.send_to(&udp, (dst, self.port)).unwrap();
    }

    /// The next REQ it receives (anything before it skipped: an earlier child's REP
    /// retries, say).
    pub fn recv_req(&self) -> rcm_wire::cm::Req {
        loop {
            if let rcm_wire::cm::CmMessage::Req(r) = self.recv() {
                return r;
            }
        }
    }

    /// The next CM message it receives.
    pub fn recv(&self) -> rcm_wire::cm::CmMessage {
        let mut buf = [0u8; 4096];
        let (n, _) = self
            .sock
            .recv_from(&mut buf)
            .expect("a datagram within the timeout");
        let d = rcm_wire::roce::GsiDatagram::parse(&buf[..n]).expect("a GSI datagram");
        rcm_wire::cm::CmMad::parse(d.mad).expect("a CM MAD").msg
    }
}

/// A SIDR_REQ from the raw peer (127.0.0.2, rdma_cm source port 40001) for the `ps` service
/// on 127.0.0.1:`port`, with no user private data.
pub fn raw_sidr_req(ps: PortSpace, port: u16, request_id: u32) -> rcm_wire::cm::SidrReq {
    raw_sidr_req_to(IpAddr::from([127, 0, 0, 1]), ps, port, request_id)
}

/// [`raw_sidr_req`] for the service on `dst`:`port`.
pub fn raw_sidr_req_to(
    dst: IpAddr,
    ps: PortSpace,
    port: u16,
    request_id: u32,
) -> rcm_wire::cm::SidrReq {
    use rcm_wire::cma::{self, CmaHdr};
    rcm_wire::cm::SidrReq {
        request_id,
        pkey: 0xFFFF,
        service_id: cma::service_id(ps, port),
        private_data: CmaHdr {
            src_port: 40001,
            src: IpAddr::from([127, 0, 0, 2]),
            dst,
        }
        .with_user_data(b"", cma::limits::CONNECT_UD)
        .expect("cma_hdr"),
        ..rcm_wire::cm::SidrReq::default()
    }
}

/// A REQ from the raw peer for 127.0.0.1:`port` whose rdma_cm header names `dst`.
pub fn raw_req(port: u16, dst: IpAddr, psn: u32) -> rcm_wire::cm::Req {
    use rcm_wire::cm::{Req, ReqPath, TransportType};
    use rcm_wire::cma::{self, CmaHdr};
    let me = IpAddr::from([127, 0, 0, 2]);
    Req {
        local_comm_id: 0xABCD,
        service_id: cma::service_id(PortSpace::Tcp, port),
        local_qpn: 0x77,
        responder_resources: 16,
        initiator_depth: 16,
        remote_cm_response_timeout: 20,
        transport_type: TransportType::Rc,
        starting_psn: psn,
        local_cm_response_timeout: 20,
        retry_count: 7,
        pkey: 0xFFFF,
        path_mtu: 3,
        rnr_retry_count: 7,
        max_cm_retries: 15,
        primary_path: ReqPath {
            local_gid: rcm_wire::Gid::from_ip(me),
            remote_gid: rcm_wire::Gid::from_ip(dst),
            hop_limit: 64,
            local_ack_timeout: 19,
            ..ReqPath::default()
        },
        private_data: CmaHdr {
            src_port: 40000,
            src: me,
            dst,
        }
        .with_user_data(b"", cma::limits::CONNECT)
        .expect("cma_hdr"),
        ..Req::default()
    }
}

/// The raw peer's REP (comm ID 0xBEEF, QPN 0x99, PSN 0x654321) to the REQ of comm ID
/// `req_comm_id`.
pub fn raw_rep(req_comm_id: u32) -> rcm_wire::cm::Rep {
    rcm_wire::cm::Rep {
        local_comm_id: 0xBEEF,
        remote_comm_id: req_comm_id,
        local_qpn: 0x99,
        starting_psn: 0x65_4321,
        rnr_retry_count: 7,
        ..rcm_wire::cm::Rep::default()
    }
}

/// An id on `ch` with its address and route to `dst` resolved (the events taken).
pub fn routed(f: &Fabric, ch: &EventChannel, dst: SocketAddr) -> rcm::CmId {
    let c = f.create_id_on(PortSpace::Tcp, ch);
    c.resolve_addr(None, dst).unwrap();
    assert!(matches!(
        ch.get_event(Some(T)).expect("event").event(),
        Event::AddrResolved
    ));
    c.resolve_route().unwrap();
    assert!(matches!(
        ch.get_event(Some(T)).expect("event").event(),
        Event::RouteResolved
    ));
    c
}

/// A small deterministic generator for [`chaos`] (the rcm crate has no `rand` for tests).
pub struct XorShift(pub u64);

impl XorShift {
    /// The next number below `n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// A peer that answers with CM messages in any order, right or wrong (REP, MRA, REJ of any
/// reason, RTU, DREQ, DREP and repeated REQs, with the right comm IDs, swapped ones or
/// others), at an active id (after its REQ) and at a passive one (after its REQ to a
/// listener), while the application answers what it sees (establish, reject, disconnect)
/// and then destroys the id. Nothing panics; every destroy completes at once; no event
/// comes for an id after its destroy returned, nor a second DISCONNECTED or a
/// CONNECT_RESPONSE after ESTABLISHED; and afterwards no id, port or engine endpoint is left.
/// The fabric under test has a device on 127.0.0.1 and none on 127.0.0.2, where `peer` is;
/// the listener takes 127.0.0.1:7479. `RCM_CHAOS_SEED=<n>` replaces `seed`.
pub fn chaos(f: &Fabric, peer: &RawPeer, seed: u64, rounds: u32) {
    use rcm_wire::cm::{CmMessage, Drep, Dreq, Mra, MsgCode, Rej, RejReason, Rep, Rtu};
    // What rcm sent meanwhile (answers, retries): read and dropped, without waiting.
    let drain_peer = || {
        let mut buf = [0u8; 4096];
        peer.sock.set_nonblocking(true).unwrap();
        while peer.sock.recv_from(&mut buf).is_ok() {}
        peer.sock.set_nonblocking(false).unwrap();
    };
    let ch = EventChannel::new();
    let l = f.create_id_on(PortSpace::Tcp, &ch);
    l.bind(SocketAddr::new(IpAddr::from([127, 0, 0, 1]), 7479))
        .unwrap();
    l.listen(64).unwrap();
    let seed = std::env::var("RCM_CHAOS_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(seed);
    let mut app = App::new(seed);
    for round in 0..rounds {
        let active = app.rng.below(2) == 0;
        // The id under test, rcm's comm ID and QPN, and the peer's.
        let (id, rcm_comm, rcm_qpn, peer_comm) = if active {
            let c = f.create_id_on(PortSpace::Tcp, &ch);
            let dst = SocketAddr::new(IpAddr::from([127, 0, 0, 2]), 7480);
            c.resolve_addr(None, dst).unwrap();
            drop(app.wait_for(&ch, |e| {
                e.id() == &c && matches!(e.event(), Event::AddrResolved)
            }));
            c.resolve_route().unwrap();
            drop(app.wait_for(&ch, |e| {
                e.id() == &c && matches!(e.event(), Event::RouteResolved)
            }));
            c.connect(&ConnectOptions::default()).unwrap();
            let req = peer.recv_req();
            (c, req.local_comm_id, req.local_qpn, 0x1_0000 + round)
        } else {
            // A REQ whose starting PSN names the round: its child is told from late children
            // of the last round's repeated REQs (the PSN is the child's RTS send PSN).
            let mut req = raw_req(7479, IpAddr::from([127, 0, 0, 1]), round);
            req.local_comm_id = 0x2_0000 + round;
            req.local_qpn = 0x1000 + round;
            peer.send(CmMessage::Req(req), u64::from(round));
            let e = app.wait_for(&ch, |e| {
                matches!(e.event(), Event::ConnectRequest { .. })
                    && e.id()
                        .init_qp_attr(QpState::Rts)
                        .is_ok_and(|a| a.sq_psn == round)
            });
            let child = e.id().clone();
            drop(e);
            if app.rng.below(4) == 0 {
                let _ = child.reject(b"no");
            } else {
                let _ = child.accept(&AcceptOptions::default());
            }
            // Its answer (earlier rounds' retries may come first).
            let mine = 0x2_0000 + round;
            let (comm, qpn) = loop {
                match peer.recv() {
                    CmMessage::Rep(r) if r.remote_comm_id == mine => {
                        break (r.local_comm_id, r.local_qpn)
                    }
                    CmMessage::Rej(r) if r.remote_comm_id == mine => break (r.local_comm_id, 0),
                    _ => {}
                }
            };
            (child, comm, qpn, 0x2_0000 + round)
        };
        for _ in 0..=app.rng.below(8) {
            let rng = &mut app.rng;
            // Right IDs mostly; sometimes swapped, stale or made up.
            let (mut local, mut remote) = (peer_comm, rcm_comm);
            match rng.below(6) {
                0 => (local, remote) = (remote, local),
                1 => remote = rcm_comm.wrapping_add(1),
                2 => local = 0,
                _ => {}
            }
            let msg = match rng.below(9) {
                0 | 1 => CmMessage::Rep(Rep {
                    local_comm_id: local,
                    remote_comm_id: remote,
                    local_qpn: 0x500 + round,
                    starting_psn: round,
                    rnr_retry_count: 7,
                    ..Rep::default()
                }),
                2 => CmMessage::Mra(Mra {
                    local_comm_id: local,
                    remote_comm_id: remote,
                    message_mraed: if rng.below(2) == 0 {
                        MsgCode::Req
                    } else {
                        MsgCode::Rep
                    },
                    service_timeout: rng.below(14) as u8,
                    ..Mra::default()
                }),
                3 => CmMessage::Rej(Rej {
                    local_comm_id: local,
                    remote_comm_id: remote,
                    message_rejected: [MsgCode::Req, MsgCode::Rep, MsgCode::Other]
                        [rng.below(3) as usize],
                    reason: [
                        RejReason::ConsumerDefined,
                        RejReason::Timeout,
                        RejReason::StaleConn,
                        RejReason::InvalidCommId,
                    ][rng.below(4) as usize],
                    ..Rej::default()
                }),
                4 | 5 => CmMessage::Rtu(Rtu {
                    local_comm_id: local,
                    remote_comm_id: remote,
                    ..Rtu::default()
                }),
                6 => CmMessage::Dreq(Dreq {
                    local_comm_id: local,
                    remote_comm_id: remote,
                    remote_qpn: if rng.below(3) == 0 { 0x77 } else { rcm_qpn },
                    ..Dreq::default()
                }),
                7 => CmMessage::Drep(Drep {
                    local_comm_id: local,
                    remote_comm_id: remote,
                    ..Drep::default()
                }),
                _ => {
                    let mut req = raw_req(7479, IpAddr::from([127, 0, 0, 1]), round);
                    req.local_comm_id = local;
                    req.local_qpn = 0x1000 + round;
                    CmMessage::Req(req)
                }
            };
            peer.send(msg, rng.below(4));
            // The application answers what came of it.
            while let Some(e) = ch.get_event(Some(Duration::from_millis(3))) {
                app.answer(&e);
            }
            drain_peer();
        }
        if app.rng.below(2) == 0 {
            let _ = id.disconnect();
        }
        app.destroy(&id, round);
        for c in std::mem::take(&mut app.children) {
            app.destroy(&c, round);
        }
    }
    // What is still queued (late children of repeated REQs among it): answered, destroyed.
    while let Some(e) = ch.get_event(Some(Duration::from_millis(50))) {
        app.answer(&e);
    }
    for c in std::mem::take(&mut app.children) {
        app.destroy(&c, rounds);
    }
    assert_eq!(l.destroy(), Ok(DestroyOutcome::Done));
    // Timewaits end (ACK timeout 19: ~2 s each, in parallel); the peer's retried REQs and
    // REPs go unanswered meanwhile.
    let left = || (f.live_ids(), f.bound_ports(), f.engine_ceps());
    let gone = (0..1000).any(|_| {
        drain_peer();
        std::thread::sleep(Duration::from_millis(10));
        left() == (0, 0, 0)
    });
    assert!(
        gone,
        "left (ids, ports, engine endpoints): {:?} (seed {seed})",
        left()
    );
}

/// The application of [`chaos`]: what it saw of each id, and how it answers.
struct App {
    seed: u64,
    rng: XorShift,
    /// Per id (by key): the events seen.
    seen: HashMap<u64, Vec<&'static str>>,
    /// Ids whose destroy returned.
    destroyed: HashSet<u64>,
    /// Children it accepted (of the peer's repeated REQs, late ones too), destroyed at the
    /// end of the round.
    children: Vec<CmId>,
}

impl App {
    fn new(seed: u64) -> Self {
        App {
            seed,
            rng: XorShift(seed | 1),
            seen: HashMap::new(),
            destroyed: HashSet::new(),
            children: Vec::new(),
        }
    }

    /// Checks an event against what its id saw before, and answers it.
    fn answer(&mut self, e: &ChannelEvent) {
        let seed = self.seed;
        let k = e.id().key();
        let ev = e.event();
        assert!(
            !self.destroyed.contains(&k),
            "{} after destroy (seed {seed})",
            ev.name()
        );
        let v = self.seen.entry(k).or_default();
        match ev {
            Event::Disconnected => {
                assert!(
                    !v.contains(&"DISCONNECTED"),
                    "a second DISCONNECTED: {v:?} (seed {seed})"
                );
            }
            Event::ConnectResponse { .. } => {
                assert!(
                    !v.contains(&"ESTABLISHED"),
                    "CONNECT_RESPONSE after {v:?} (seed {seed})"
                );
            }
            _ => {}
        }
        v.push(ev.name());
        match ev {
            Event::ConnectResponse { .. } => {
                let _ = if self.rng.below(4) == 0 {
                    e.id().reject(b"no")
                } else {
                    e.id().establish()
                };
            }
            Event::ConnectRequest { .. } => {
                let _ = e.id().accept(&AcceptOptions::default());
                self.children.push(e.id().clone());
            }
            Event::Established { .. } if self.rng.below(3) == 0 => {
                let _ = e.id().disconnect();
            }
            _ => {}
        }
    }

    /// Takes events until one that `want` picks (returned, unanswered), answering the others.
    fn wait_for(
        &mut self,
        ch: &EventChannel,
        want: impl Fn(&ChannelEvent) -> bool,
    ) -> ChannelEvent {
        loop {
            let e = ch
                .get_event(Some(T))
                .unwrap_or_else(|| panic!("no awaited event (seed {})", self.seed));
            if want(&e) {
                self.seen
                    .entry(e.id().key())
                    .or_default()
                    .push(e.event().name());
                return e;
            }
            self.answer(&e);
        }
    }

    fn destroy(&mut self, id: &CmId, round: u32) {
        assert_eq!(
            id.destroy(),
            Ok(DestroyOutcome::Done),
            "seed {}, round {round}",
            self.seed
        );
        self.destroyed.insert(id.key());
    }
}
