//! The UD data path of RoCEv2 devices: after SIDR, `send_ud` / `recv_ud` between two UD ids
//! over loopback devices; what is dropped (wrong Q_Key, unknown QPN, a full queue, a
//! destroyed id) and counted; hostile datagrams never panic the device; and the bytes on the
//! wire (BTH, DETH, ImmDt, pad, ICRC). Each test has UDP ports of its own (28100..=28119).

mod common;

use common::{config, eventually, T};
use rcm::{
    AcceptOptions, CmId, ConnectOptions, Device, Error, Event, EventChannel, Fabric, PortSpace,
    QpState, State, UdMessage, UdParam, UD_MAX_PAYLOAD, UD_RECV_QUEUE,
};
use rcm_wire::cma::RDMA_UDP_QKEY;
use rcm_wire::roce::{self, Bth, Deth, IpForIcrc, Opcode, RocePacket};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::time::Duration;

const SERVER: [u8; 4] = [127, 0, 0, 1];
const CLIENT: [u8; 4] = [127, 0, 0, 2];

/// Two devices (server 127.0.0.1, client 127.0.0.2) on UDP `port`, a UD listener on the
/// server, and `n` clients resolved by SIDR, each with its accepted server-side child.
struct Setup {
    fabric: Fabric,
    server_dev: Device,
    client_dev: Device,
    /// (client id, what its SIDR_REP said, the server's child for it)
    pairs: Vec<(CmId, UdParam, CmId)>,
    _listener: CmId,
}

fn setup(port: u16, n: usize) -> Setup {
    setup_with(config(port), n)
}

fn setup_with(cfg: rcm::FabricConfig, n: usize) -> Setup {
    let fabric = Fabric::new(cfg);
    let server_dev = fabric
        .add_device(IpAddr::from(SERVER))
        .expect("server device");
    let client_dev = fabric
        .add_device(IpAddr::from(CLIENT))
        .expect("client device");
    let sch = EventChannel::new();
    let listener = fabric.create_id_on(PortSpace::Udp, &sch);
    listener
        .bind(SocketAddr::new(IpAddr::from(SERVER), 7174))
        .expect("bind");
    listener.listen(0).expect("listen");
    let mut pairs = Vec::new();
    for i in 0..n {
        let ch = EventChannel::new();
        let c = fabric.create_id_on(PortSpace::Udp, &ch);
        c.resolve_addr(None, SocketAddr::new(IpAddr::from(SERVER), 7174))
            .expect("resolve_addr");
        expect(&ch, "ADDR_RESOLVED");
        c.resolve_route().expect("resolve_route");
        expect(&ch, "ROUTE_RESOLVED");
        c.connect(&ConnectOptions {
            private_data: vec![i as u8],
            ..ConnectOptions::default()
        })
        .expect("connect");
        let mut req = sch.get_event(Some(T)).expect("connect request");
        assert_eq!(req.event().name(), "CONNECT_REQUEST");
        let child = req.id().clone();
        drop(req.take());
        drop(req);
        child.accept(&AcceptOptions::default()).expect("accept");
        let mut ev = ch.get_event(Some(T)).expect("established");
        let ud = match ev.take() {
            Some(Event::Established { ud: Some(ud), .. }) => ud,
            other => panic!("client {i}: {other:?}"),
        };
        assert_eq!(ud.qkey, RDMA_UDP_QKEY);
        assert_eq!(
            Some(ud.qpn),
            child.qp_num(),
            "the SIDR_REP names the child's QPN"
        );
        assert_eq!(child.state(), State::Established);
        for id in [&c, &child] {
            let rts = id.init_qp_attr(QpState::Rts).expect("RTS attributes");
            assert_eq!(rts.qkey, RDMA_UDP_QKEY);
            for s in [QpState::Init, QpState::Rtr, QpState::Rts] {
                assert_eq!(
                    rts.for_state(s),
                    Some(id.init_qp_attr(s).expect("attributes"))
                );
            }
        }
        pairs.push((c, ud, child));
    }
    Setup {
        fabric,
        server_dev,
        client_dev,
        pairs,
        _listener: listener,
    }
}

fn expect(ch: &EventChannel, name: &str) {
    let e = ch.get_event(Some(T)).expect(name);
    assert_eq!(e.event().name(), name, "{:?}", e.event());
}

fn server_ip() -> IpAddr {
    IpAddr::from(SERVER)
}

fn client_ip() -> IpAddr {
    IpAddr::from(CLIENT)
}

#[test]
fn ud_datagrams_both_ways_with_and_without_immediate_data() {
    let s = setup(28100, 2);
    let (c0, ud0, child0) = &s.pairs[0];
    let (c1, ud1, child1) = &s.pairs[1];
    let q0 = c0.qp_num().expect("client QPN");
    let q1 = c1.qp_num().expect("client QPN");
    assert_ne!(q0, q1);
    assert_ne!(ud0.qpn, ud1.qpn);

    // Client → server, as udaddy's client sends: with its QPN as immediate data. Every pad
    // length, and the largest payload.
    let sizes = [0usize, 1, 2, 3, 4, 5, 100, 1021, UD_MAX_PAYLOAD];
    for (k, &n) in sizes.iter().enumerate() {
        let p: Vec<u8> = (0..n).map(|b| (b * 7 + k) as u8).collect();
        c0.send_ud_with_imm(server_ip(), *ud0, q0, &p)
            .expect("send");
        let m = child0.recv_ud(T).expect("the child receives it");
        assert_eq!(
            m,
            UdMessage {
                src: client_ip(),
                src_qpn: q0,
                imm: Some(q0),
                payload: p,
            }
        );
    }
    // Each QPN reaches its own id only.
    c1.send_ud(server_ip(), *ud1, b"for child 1").expect("send");
    let m = child1.recv_ud(T).expect("child 1 receives");
    assert_eq!(m.payload, b"for child 1");
    assert_eq!((m.src_qpn, m.imm), (q1, None));
    assert!(child0.try_recv_ud().is_none());

    // Server → client: answered to the QPN the datagram came from, with rdma_cm's Q_Key.
    let back = UdParam {
        qpn: m.src_qpn,
        qkey: RDMA_UDP_QKEY,
    };
    child1
        .send_ud_with_imm(m.src, back, ud1.qpn, b"reply")
        .expect("reply");
    let r = c1.recv_ud(T).expect("client 1 receives the reply");
    assert_eq!(r.payload, b"reply");
    assert_eq!(
        (r.src, r.src_qpn, r.imm),
        (server_ip(), ud1.qpn, Some(ud1.qpn))
    );
    assert!(c0.try_recv_ud().is_none());

    let st = s.server_dev.ud_stats();
    assert_eq!(st.delivered, sizes.len() as u64 + 1);
    assert_eq!(
        (st.no_qp, st.bad_qkey, st.queue_full, st.garbage),
        (0, 0, 0, 0)
    );
    assert_eq!(st.sent, 1);
    assert_eq!(s.client_dev.ud_stats().sent, sizes.len() as u64 + 1);
    assert_eq!(s.client_dev.ud_stats().delivered, 1);
    s.fabric.shutdown();
}

#[test]
fn wrong_qkey_and_unknown_qpn_are_dropped_and_counted() {
    let s = setup(28102, 1);
    let (c, ud, child) = &s.pairs[0];
    let bad_key = UdParam {
        qkey: 0x1111_2222,
        ..*ud
    };
    c.send_ud(server_ip(), bad_key, b"wrong key").expect("send");
    assert!(eventually(T, || s.server_dev.ud_stats().bad_qkey == 1));
    let nobody = UdParam {
        qpn: (ud.qpn + 0x1234) & 0xFF_FFFF,
        ..*ud
    };
    c.send_ud(server_ip(), nobody, b"nobody").expect("send");
    assert!(eventually(T, || s.server_dev.ud_stats().no_qp == 1));
    // What follows is delivered, and only it.
    c.send_ud(server_ip(), *ud, b"right").expect("send");
    assert_eq!(child.recv_ud(T).expect("delivered").payload, b"right");
    assert!(child.try_recv_ud().is_none());
    let st = s.server_dev.ud_stats();
    assert_eq!(
        (st.delivered, st.bad_qkey, st.no_qp, st.garbage),
        (1, 1, 1, 0)
    );
    s.fabric.shutdown();
}

/// With `ud_receive` off (as in the daemon, which serves no UD data path) nothing sent to a
/// UD id's QPN is kept: each datagram is counted as for no QP and none is queued.
#[test]
fn without_ud_receive_nothing_is_kept() {
    let s = setup_with(
        rcm::FabricConfig {
            ud_receive: false,
            ..config(28116)
        },
        1,
    );
    let (c, ud, child) = &s.pairs[0];
    for i in 0..3u8 {
        c.send_ud(server_ip(), *ud, &[i]).expect("send");
    }
    assert!(eventually(T, || s.server_dev.ud_stats().no_qp == 3));
    assert_eq!(s.server_dev.ud_stats().delivered, 0);
    assert!(child.try_recv_ud().is_none());
    s.fabric.shutdown();
}

#[test]
fn the_receive_queue_is_bounded() {
    let s = setup(28104, 1);
    let (c, ud, child) = &s.pairs[0];
    let total = UD_RECV_QUEUE + 100;
    // In chunks, each accounted for before the next, so the socket's buffer never overflows.
    let mut sent = 0usize;
    while sent < total {
        let n = (total - sent).min(64);
        for i in sent..sent + n {
            c.send_ud(server_ip(), *ud, &(i as u32).to_be_bytes())
                .expect("send");
        }
        sent += n;
        assert!(
            eventually(T, || {
                let st = s.server_dev.ud_stats();
                st.delivered + st.queue_full == sent as u64
            }),
            "{:?}",
            s.server_dev.ud_stats()
        );
    }
    let st = s.server_dev.ud_stats();
    assert_eq!(st.delivered, UD_RECV_QUEUE as u64);
    assert_eq!(st.queue_full, 100);
    // The first UD_RECV_QUEUE were kept, in order.
    for i in 0..UD_RECV_QUEUE {
        let m = child.try_recv_ud().expect("queued");
        assert_eq!(m.payload, (i as u32).to_be_bytes());
    }
    assert!(child.try_recv_ud().is_none());
    // Room again.
    c.send_ud(server_ip(), *ud, b"again").expect("send");
    assert_eq!(child.recv_ud(T).expect("delivered").payload, b"again");
    s.fabric.shutdown();
}

#[test]
fn destroy_stops_delivery_and_discards_the_queue() {
    let s = setup(28106, 1);
    let (c, ud, child) = &s.pairs[0];
    c.send_ud(server_ip(), *ud, b"queued").expect("send");
    assert!(eventually(T, || s.server_dev.ud_stats().delivered == 1));
    child.destroy().expect("destroy");
    assert!(child.try_recv_ud().is_none(), "the queue died with the id");
    assert!(child.recv_ud(Duration::from_millis(10)).is_none());
    c.send_ud(server_ip(), *ud, b"too late").expect("send");
    assert!(eventually(T, || s.server_dev.ud_stats().no_qp == 1));
    assert_eq!(s.server_dev.ud_stats().delivered, 1);
    assert!(matches!(
        child.send_ud(client_ip(), *ud, b"x"),
        Err(Error::Destroyed)
    ));
    // The client is unaffected: destroying it too stops its delivery the same way.
    c.destroy().expect("destroy");
    assert_eq!(s.fabric.live_ids(), 1, "only the listener");
    s.fabric.shutdown();
}

#[test]
fn send_ud_refuses_what_it_cannot_send() {
    let s = setup(28108, 1);
    let (c, ud, _) = &s.pairs[0];
    let too_big = vec![0u8; UD_MAX_PAYLOAD + 1];
    assert!(matches!(
        c.send_ud(server_ip(), *ud, &too_big),
        Err(Error::InvalidArgument(_))
    ));
    for qpn in [0, 1, 0x100_0000] {
        assert!(matches!(
            c.send_ud(server_ip(), UdParam { qpn, ..*ud }, b"x"),
            Err(Error::InvalidArgument(_))
        ));
    }
    // An IPv6 destination from an IPv4 device.
    assert!(matches!(
        c.send_ud("::1".parse().unwrap(), *ud, b"x"),
        Err(Error::AddrNotAvailable(_))
    ));
    // Not a UD id.
    let rc = s
        .fabric
        .create_id(PortSpace::Tcp, |_, _| rcm::Flow::Continue);
    assert!(matches!(
        rc.send_ud(server_ip(), *ud, b"x"),
        Err(Error::InvalidArgument(_))
    ));
    // A UD id before SIDR.
    let idle = s
        .fabric
        .create_id(PortSpace::Udp, |_, _| rcm::Flow::Continue);
    assert!(idle.qp_num().is_none());
    assert!(matches!(
        idle.send_ud(server_ip(), *ud, b"x"),
        Err(Error::InvalidState(State::Idle))
    ));
    assert!(idle.recv_ud(Duration::from_millis(1)).is_none());
    assert_eq!(s.client_dev.ud_stats().sent, 0, "nothing left");
    s.fabric.shutdown();
}

/// A tiny deterministic generator for the hostile datagrams.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// A UD SEND to `dst` built by hand (as another host would send it).
fn ud_packet(opcode: Opcode, dest_qp: u32, qkey: u32, imm: Option<u32>, payload: &[u8]) -> Vec<u8> {
    let bth = Bth {
        opcode,
        dest_qp,
        ..Bth::gsi(7)
    };
    let deth = Deth {
        qkey,
        reserved: 0,
        src_qp: 0x42,
    };
    let body = match imm {
        Some(i) => [i.to_be_bytes().as_slice(), payload].concat(),
        None => payload.to_vec(),
    };
    let ip = IpForIcrc::v4(Ipv4Addr::new(127, 0, 0, 3), Ipv4Addr::from(SERVER));
    roce::emit_ud(&ip, 4791, &bth, &deth, &body)
}

#[test]
fn hostile_datagrams_never_panic_and_a_foreign_sender_is_received() {
    let s = setup(28110, 1);
    let (c, ud, child) = &s.pairs[0];
    let dev_addr = SocketAddr::new(server_ip(), 28110);
    let raw = UdpSocket::bind("127.0.0.3:0").expect("raw socket");
    let good = ud_packet(
        Opcode::UD_SEND_ONLY_IMM,
        ud.qpn,
        RDMA_UDP_QKEY,
        Some(0x42),
        b"hi",
    );

    let mut hostile: Vec<Vec<u8>> = vec![
        vec![],
        vec![0],
        vec![0x64; 11],
        vec![0x64; 16],
        good[..good.len() - 5].to_vec(),     // cut inside the payload
        good[..roce::BTH_LEN + 10].to_vec(), // cut inside the ImmDt
        ud_packet(Opcode::UD_SEND_ONLY_IMM, ud.qpn, RDMA_UDP_QKEY, None, b""), // no ImmDt
        ud_packet(Opcode::RC_SEND_ONLY, ud.qpn, RDMA_UDP_QKEY, None, b"rc"),
        ud_packet(Opcode(0x66), ud.qpn, RDMA_UDP_QKEY, None, b"unknown UD op"),
    ];
    // Pad count larger than the payload.
    let mut pad = ud_packet(Opcode::UD_SEND_ONLY, ud.qpn, RDMA_UDP_QKEY, None, b"");
    pad[1] |= 0x30;
    hostile.push(pad);
    // Another partition.
    let mut pkey = good.clone();
    pkey[2] = 0x12;
    hostile.push(pkey);
    // TVer 1.
    let mut tver = good.clone();
    tver[1] |= 0x01;
    hostile.push(tver);
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for _ in 0..300 {
        let n = (rng.next() % 300) as usize;
        hostile.push((0..n).map(|_| rng.next() as u8).collect());
        // Mutations of a good datagram: a few random bytes changed.
        let mut m = good.clone();
        for _ in 0..=(rng.next() % 4) {
            let at = (rng.next() as usize) % m.len();
            m[at] = rng.next() as u8;
        }
        hostile.push(m);
    }
    // Mutations may hit nothing that matters: some are delivered. None is a CM MAD (QP1
    // would need the GSI Q_Key and a MAD), so every datagram ends in one of the counters.
    let accounted = |st: rcm::UdStats| st.garbage + st.no_qp + st.bad_qkey + st.delivered;
    for (k, chunk) in hostile.chunks(64).enumerate() {
        for h in chunk {
            raw.send_to(h, dev_addr).expect("send hostile");
        }
        // Accounted for before the next chunk (the socket's buffer never overflows).
        let want = (k * 64 + chunk.len()) as u64;
        assert!(
            eventually(T, || accounted(s.server_dev.ud_stats()) == want),
            "{:?}",
            s.server_dev.ud_stats()
        );
    }
    let st = s.server_dev.ud_stats();
    assert!(st.garbage >= 12, "{st:?}");
    assert_eq!(accounted(st), hostile.len() as u64, "{st:?}");
    while child.try_recv_ud().is_some() {}

    // A well-formed datagram from a host rcm never talked to is received.
    raw.send_to(&good, dev_addr).expect("send");
    let m = child.recv_ud(T).expect("delivered");
    assert_eq!(
        m,
        UdMessage {
            src: IpAddr::from([127, 0, 0, 3]),
            src_qpn: 0x42,
            imm: Some(0x42),
            payload: b"hi".to_vec(),
        }
    );
    // The device still runs the CM and the data path.
    let q = c.qp_num().expect("QPN");
    c.send_ud_with_imm(server_ip(), *ud, q, b"still fine")
        .expect("send");
    assert_eq!(child.recv_ud(T).expect("delivered").payload, b"still fine");
    let s2 = setup_more(&s);
    assert_eq!(s2.state(), State::Established);
    s.fabric.shutdown();
}

/// One more SIDR on the same fabric (the engine still answers).
fn setup_more(s: &Setup) -> CmId {
    let (c, ch, child, _l) = requested(s, 7175);
    child.accept(&AcceptOptions::default()).expect("accept");
    expect(&ch, "ESTABLISHED");
    c
}

/// A UD listener of its own on the server's `port`, and a client whose SIDR request for it
/// came: (client, its channel, the server's child not answered yet, the listener).
fn requested(s: &Setup, port: u16) -> (CmId, EventChannel, CmId, CmId) {
    let sch = EventChannel::new();
    let l = s.fabric.create_id_on(PortSpace::Udp, &sch);
    l.bind(SocketAddr::new(server_ip(), port)).expect("bind");
    l.listen(0).expect("listen");
    let ch = EventChannel::new();
    let c = s.fabric.create_id_on(PortSpace::Udp, &ch);
    c.resolve_addr(None, SocketAddr::new(server_ip(), port))
        .expect("resolve_addr");
    expect(&ch, "ADDR_RESOLVED");
    c.resolve_route().expect("resolve_route");
    expect(&ch, "ROUTE_RESOLVED");
    c.connect(&ConnectOptions::default()).expect("connect");
    let req = sch.get_event(Some(T)).expect("request");
    let child = req.id().clone();
    drop(req);
    (c, ch, child, l)
}

/// The IPv4 header Linux writes for the device socket's datagrams (ID 0, DF, TTL 64).
fn ipv4_header(src: [u8; 4], dst: [u8; 4], udp_len: usize) -> Vec<u8> {
    let total = (20 + udp_len) as u16;
    let mut h = vec![0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, 17, 0, 0];
    h[2..4].copy_from_slice(&total.to_be_bytes());
    h.extend_from_slice(&src);
    h.extend_from_slice(&dst);
    h
}

#[test]
fn the_bytes_on_the_wire() {
    let s = setup(28112, 1);
    let (c, _, _) = &s.pairs[0];
    let q = c.qp_num().expect("QPN");
    // A plain socket where a peer's device would be (127.0.0.3, the fabric's UDP port).
    let peer = UdpSocket::bind("127.0.0.3:28112").expect("peer socket");
    peer.set_read_timeout(Some(T)).expect("timeout");
    let target = UdParam {
        qpn: 0x00AB_CDEF,
        qkey: RDMA_UDP_QKEY,
    };
    let dst = IpAddr::from([127, 0, 0, 3]);
    c.send_ud(dst, target, b"abcde").expect("send");
    c.send_ud_with_imm(dst, target, 0x0102_0304, b"xyz")
        .expect("send");
    let mut buf = [0u8; 256];
    let mut psns = Vec::new();
    for (want_op, want_imm, want_payload) in [
        (Opcode::UD_SEND_ONLY, None, b"abcde".as_slice()),
        (
            Opcode::UD_SEND_ONLY_IMM,
            Some([1u8, 2, 3, 4]),
            b"xyz".as_slice(),
        ),
    ] {
        let (n, from) = peer.recv_from(&mut buf).expect("datagram");
        assert_eq!(
            from,
            SocketAddr::new(client_ip(), 28112),
            "from the device socket"
        );
        let pkt = &buf[..n];
        assert_eq!(n % 4, 0, "padded to 4 bytes");
        let p = RocePacket::parse(pkt).expect("parses");
        assert_eq!(p.bth.opcode, want_op);
        assert_eq!(p.bth.pkey, 0xFFFF);
        assert_eq!(p.bth.dest_qp, 0x00AB_CDEF);
        assert_eq!(
            usize::from(p.bth.pad_count),
            (4 - want_payload.len() % 4) % 4
        );
        assert!(!p.bth.ack_req && !p.bth.solicited && p.bth.tver == 0);
        let deth = p.deth.expect("DETH");
        assert_eq!((deth.qkey, deth.src_qp), (RDMA_UDP_QKEY, q));
        let imm_bytes: &[u8] = want_imm.as_ref().map_or(&[], |i| &i[..]);
        assert_eq!(p.ext_headers.get(8..), Some(imm_bytes));
        assert_eq!(p.payload, Some(want_payload));
        psns.push(p.bth.psn);
        // The ICRC is the one a receiver computes over the real headers: IPv4 with ID 0 and
        // DF, and the UDP header rcm-wire assumes (source = the device port, destination
        // 4791, as on a real network where the device port is 4791).
        let mut udp = Vec::new();
        udp.extend_from_slice(&28112u16.to_be_bytes());
        udp.extend_from_slice(&roce::ROCE_V2_UDP_PORT.to_be_bytes());
        udp.extend_from_slice(&((8 + n) as u16).to_be_bytes());
        udp.extend_from_slice(&[0, 0]);
        udp.extend_from_slice(pkt);
        roce::verify_icrc(&ipv4_header(CLIENT, [127, 0, 0, 3], udp.len()), &udp).expect("ICRC");
    }
    assert_eq!(psns[1], (psns[0] + 1) & 0xFF_FFFF, "the PSN counts up");
    s.fabric.shutdown();
}

#[test]
fn a_qpn_receives_for_one_ud_id_only() {
    let s = setup(28114, 1);
    let (_, ud, child) = &s.pairs[0];
    let taken = child.qp_num().expect("QPN");
    let (_c, ch, second, _l) = requested(&s, 7176);
    let same = AcceptOptions {
        qpn: Some(taken),
        ..AcceptOptions::default()
    };
    assert!(matches!(second.accept(&same), Err(Error::QpBusy(_))));
    assert_eq!(second.qp_num(), None, "the failed accept changed nothing");
    // The first keeps receiving; the second accepts with a QPN of its own.
    second.accept(&AcceptOptions::default()).expect("accept");
    expect(&ch, "ESTABLISHED");
    assert_ne!(second.qp_num(), Some(taken));
    s.pairs[0]
        .0
        .send_ud(server_ip(), *ud, b"first")
        .expect("send");
    assert_eq!(child.recv_ud(T).expect("delivered").payload, b"first");
    assert!(second.try_recv_ud().is_none());
    s.fabric.shutdown();
}

/// A UD id whose QP is destroyed receives nothing more on its number (Linux's destroyed QP
/// is gone: the HCA drops what comes for it), though the id lives on.
#[test]
fn a_destroyed_qp_receives_nothing() {
    let s = setup(28099, 0);
    let (c, ch, child, _l) = requested(&s, 7177);
    let qpn = child.create_qp().expect("a QP");
    child.accept(&AcceptOptions::default()).expect("accept");
    let mut ev = ch.get_event(Some(T)).expect("established");
    let ud = match ev.take() {
        Some(Event::Established { ud: Some(ud), .. }) => ud,
        other => panic!("{other:?}"),
    };
    drop(ev);
    assert_eq!(ud.qpn, qpn, "the SIDR_REP names the QP");
    c.send_ud(server_ip(), ud, b"before").expect("send");
    assert_eq!(child.recv_ud(T).expect("delivered").payload, b"before");
    child.destroy_qp().expect("destroy_qp");
    c.send_ud(server_ip(), ud, b"after").expect("send");
    assert!(eventually(T, || s.server_dev.ud_stats().no_qp == 1));
    assert!(child.try_recv_ud().is_none());
    assert_eq!(s.server_dev.ud_stats().delivered, 1);
    s.fabric.shutdown();
}

/// A peer's UD SENDs in one segmented send (`UDP_SEGMENT`, as rcm sends a batch of GSI
/// datagrams) reach the UD id one by one, each whole: a device with a UD QP has the kernel
/// cut coalesced runs, since a quiet device's receive could not tell them from one datagram.
#[test]
fn a_segmented_run_of_ud_sends_arrives_datagram_by_datagram() {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags, SockaddrStorage};
    use std::os::fd::AsRawFd;
    let s = setup(28118, 1);
    let (_, ud, child) = &s.pairs[0];
    let peer = UdpSocket::bind("127.0.0.3:0").expect("peer socket");
    let sends: Vec<Vec<u8>> = (0..3u8)
        .map(|k| ud_packet(Opcode::UD_SEND_ONLY, ud.qpn, RDMA_UDP_QKEY, None, &[k; 100]))
        .collect();
    let seg = u16::try_from(sends[0].len()).expect("size");
    let run = sends.concat();
    let to = SockaddrStorage::from(SocketAddr::new(server_ip(), 28118));
    for round in 0..2 {
        sendmsg(
            peer.as_raw_fd(),
            &[std::io::IoSlice::new(&run)],
            &[ControlMessage::UdpGsoSegments(&seg)],
            MsgFlags::empty(),
            Some(&to),
        )
        .expect("segmented send");
        for k in 0..3u8 {
            let m = child.recv_ud(T).expect("delivered");
            assert_eq!(m.payload, [k; 100], "round {round}, datagram {k}");
        }
        assert!(child.try_recv_ud().is_none(), "round {round}: nothing more");
    }
    let st = s.server_dev.ud_stats();
    assert_eq!((st.garbage, st.delivered), (0, 6), "{st:?}");
    s.fabric.shutdown();
}
