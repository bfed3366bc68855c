//! ICRC verification on receive (`FabricConfig::verify_icrc`, IPv4, needs CAP_NET_RAW): rcm's
//! own traffic passes (its ICRCs are right for the real IP header, ID 0 and DF), a datagram
//! with a corrupted ICRC is dropped and counted, the same datagram with a correct one is not.
//! UDP port 28300. Without the privilege the test says so and passes only when
//! RCM_REQUIRE_ROOT is unset.
#![cfg(not(loom))]

mod common;

use rcm::{AcceptOptions, ConnectOptions, Event, EventChannel, Fabric, PortSpace};
use rcm_wire::cm::{CmMad, CmMessage, Dreq};
use rcm_wire::roce::{emit_gsi, icrc_for_raw_ip, IpForIcrc};
use std::net::{Ipv4Addr, SocketAddr};

const PORT: u16 = 28300;
/// REQs in the segmented run another fabric sends.
const RUN: usize = 40;

fn next(ch: &EventChannel) -> Event {
    let mut e = ch.get_event(Some(common::T)).expect("an event within 10 s");
    e.take().expect("event")
}

/// A fabric verifying ICRCs with a device on 127.0.0.1 at `port`; `None` (the test is
/// skipped, said on stderr) without the privilege a raw socket needs, unless
/// RCM_REQUIRE_ROOT is set.
fn verifying_fabric(port: u16) -> Option<(Fabric, rcm::Device)> {
    let f = Fabric::new(rcm::FabricConfig {
        verify_icrc: true,
        ..common::config(port)
    });
    match f.add_device(common::ip(1)) {
        Ok(d) => Some((f, d)),
        Err(e) if std::env::var_os("RCM_REQUIRE_ROOT").is_none() => {
            eprintln!("SKIPPED: ICRC verification needs a raw socket (root): {e}");
            None
        }
        Err(e) => panic!("ICRC verification needs a raw socket: {e}"),
    }
}

/// A connection from `src` (or the device resolution picks) to the listener on
/// 127.0.0.1:`port` whose requests come on `sch`, up to both ends established: the client,
/// its channel and the server's child.
fn establish(
    f: &Fabric,
    sch: &EventChannel,
    src: Option<std::net::IpAddr>,
    port: u16,
) -> (rcm::CmId, EventChannel, rcm::CmId) {
    let cch = EventChannel::new();
    let c = f.create_id_on(PortSpace::Tcp, &cch);
    c.resolve_addr(src, SocketAddr::new(common::ip(1), port))
        .expect("resolve");
    assert!(matches!(next(&cch), Event::AddrResolved));
    c.resolve_route().expect("route");
    assert!(matches!(next(&cch), Event::RouteResolved));
    c.connect(&ConnectOptions::default()).expect("connect");
    let req = sch.get_event(Some(common::T)).expect("a connect request");
    let child = req.id().clone();
    drop(req);
    child.accept(&AcceptOptions::default()).expect("accept");
    assert!(matches!(next(&cch), Event::ConnectResponse { .. }));
    c.establish().expect("establish");
    assert!(matches!(next(&cch), Event::Established { .. }));
    (c, cch, child)
}

#[test]
fn icrc_is_verified_on_receive() {
    let Some((f, d1)) = verifying_fabric(PORT) else {
        return;
    };
    f.add_device(common::ip(2)).expect("device 2");

    // rcm to rcm, every datagram verified.
    let sch = EventChannel::new();
    let l = f.create_id_on(PortSpace::Tcp, &sch);
    l.bind(SocketAddr::new(common::ip(1), 7800)).expect("bind");
    l.listen(64).expect("listen");
    let (c, cch, child) = establish(&f, &sch, Some(common::ip(2)), 7800);
    assert_eq!(d1.icrc_drops(), 0, "rcm's own ICRCs are right");

    // A DREQ nobody expects, sent raw from 127.0.0.3 with a nonzero IPv4 Identification (as
    // rxe sends), its ICRC computed over that real header: it passes; the same with one bit
    // of the ICRC flipped is dropped and counted.
    let send = |icrc_flip: u8| {
        let mad = CmMad::send(
            0x77,
            CmMessage::Dreq(Dreq {
                local_comm_id: 0x1234,
                remote_comm_id: 0x5678,
                ..Dreq::default()
            }),
        )
        .emit()
        .expect("a DREQ");
        let ip0 = IpForIcrc::v4(Ipv4Addr::new(127, 0, 0, 3), Ipv4Addr::LOCALHOST);
        // emit_gsi gives the UDP payload (BTH, DETH, MAD, ICRC); put a UDP header in front.
        let mut payload = emit_gsi(&ip0, 40000, 1, &mad);
        payload.truncate(payload.len() - 4);
        let udp_len = (8 + payload.len() + 4) as u16;
        let mut udp = Vec::with_capacity(usize::from(udp_len));
        udp.extend_from_slice(&40000u16.to_be_bytes());
        udp.extend_from_slice(&4791u16.to_be_bytes());
        udp.extend_from_slice(&udp_len.to_be_bytes());
        udp.extend_from_slice(&[0, 0]);
        udp.extend_from_slice(&payload);
        let total = 20 + udp_len;
        let mut hdr = [0u8; 20];
        hdr[0] = 0x45;
        hdr[2..4].copy_from_slice(&total.to_be_bytes());
        hdr[4..6].copy_from_slice(&0x4242u16.to_be_bytes());
        hdr[6] = 0x40; // DF
        hdr[8] = 64;
        hdr[9] = 17;
        hdr[12..16].copy_from_slice(&[127, 0, 0, 3]);
        hdr[16..20].copy_from_slice(&[127, 0, 0, 1]);
        // The ICRC as over the standard port (the device's port stands for 4791), then the
        // datagram goes to the device's real port.
        let icrc = icrc_for_raw_ip(&hdr, &udp).expect("icrc") ^ u32::from(icrc_flip);
        udp.extend_from_slice(&icrc.to_le_bytes());
        udp[2..4].copy_from_slice(&PORT.to_be_bytes());
        let mut pkt = hdr.to_vec();
        pkt.extend_from_slice(&udp);
        let raw = socket2::Socket::new(
            socket2::Domain::IPV4,
            socket2::Type::RAW,
            Some(socket2::Protocol::UDP),
        )
        .expect("raw socket");
        raw.set_header_included_v4(true).expect("IP_HDRINCL");
        let dst: SocketAddr = SocketAddr::new(common::ip(1), 0);
        raw.send_to(&pkt, &dst.into()).expect("send");
    };
    let (rx0, _) = d1.traffic();
    send(0);
    assert!(
        common::eventually(common::T, || d1.traffic().0 > rx0),
        "the good datagram was received"
    );
    assert_eq!(
        d1.icrc_drops(),
        0,
        "a correct ICRC over a nonzero IP ID passes"
    );
    send(1);
    assert!(
        common::eventually(common::T, || d1.icrc_drops() == 1),
        "the corrupted ICRC is counted"
    );
    // And nothing of it reached the connection: still up.
    c.disconnect().expect("disconnect");
    assert!(matches!(next(&cch), Event::Disconnected));
    drop(c.destroy());
    drop(child.destroy());

    // Another fabric on this host (no verification) sends 40 REQs in one segmented send
    // (11 KiB in one IP packet on loopback, more than one datagram's buffer): the raw socket
    // sees the run whole, cuts it and verifies each piece against the header the kernel gave
    // it; all 40 arrive, nothing counted bad.
    let other = Fabric::new(common::config(PORT));
    let d3 = other.add_device(common::ip(3)).expect("device 3");
    let och = EventChannel::new();
    let ids: Vec<_> = (0..RUN)
        .map(|_| other.create_id_on(PortSpace::Tcp, &och))
        .collect();
    for id in &ids {
        id.resolve_addr(Some(common::ip(3)), SocketAddr::new(common::ip(1), 7800))
            .expect("resolve");
        assert!(matches!(next(&och), Event::AddrResolved));
        id.resolve_route().expect("route");
        assert!(matches!(next(&och), Event::RouteResolved));
    }
    let (seg0, _) = d3.batched_io();
    {
        let _b = rcm::SendBatch::begin();
        for id in &ids {
            id.connect(&ConnectOptions::default()).expect("connect");
        }
    }
    assert_eq!(d3.batched_io().0, seg0 + 1, "one segmented send");
    for k in 0..RUN {
        let req = sch
            .get_event(Some(common::T))
            .unwrap_or_else(|| panic!("connect request {k} of the run"));
        let child = req.id().clone();
        drop(req);
        drop(child.destroy());
    }
    assert_eq!(d1.icrc_drops(), 1, "only the corrupted one of before");
    drop(l.destroy());
    other.shutdown();
    f.shutdown();
}

/// With verification on, a device still receives its own datagrams: a connection from a
/// device to a listener on that same device (the only IPv4 device) sends its REQ, REP and
/// RTU to its own address and port, which only the one-byte wake-up datagram may be
/// mistaken for. UDP port 28301.
#[test]
fn a_verifying_device_connects_to_itself() {
    let Some((f, d1)) = verifying_fabric(28301) else {
        return;
    };
    let sch = EventChannel::new();
    let l = f.create_id_on(PortSpace::Tcp, &sch);
    l.bind(SocketAddr::new(common::ip(1), 7801)).expect("bind");
    l.listen(4).expect("listen");
    let (c, _cch, _child) = establish(&f, &sch, None, 7801);
    assert_eq!(c.device_addr(), Some(common::ip(1)));
    assert_eq!(d1.icrc_drops(), 0);
    f.shutdown();
}
