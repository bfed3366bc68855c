//! The iWARP paths of the rdma_cm layer against Linux: `cma.c` (`cma_iw_handler`,
//! `iw_conn_req_handler`, `rdma_accept`, `rdma_disconnect`), `iwcm.c` and the siw provider
//! (`siw_cm.c`). Each test's doc comment states what Linux does, on points where rcm once
//! differed (found by a review). TCP ports 29600..=29612, UDP 29690 (no RoCE device).
#![cfg(not(loom))]

mod common;

use common::{eventually, ip, next, T};
use rcm::{
    AcceptOptions, CmId, ConnectOptions, Error, Event, EventChannel, Fabric, PortSpace, State,
};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

fn addr(last: u8, port: u16) -> SocketAddr {
    SocketAddr::new(ip(last), port)
}

/// A fabric of iWARP devices on 127.0.0.`last` for each of `lasts` (default MPA settings).
fn iw_fabric(lasts: &[u8]) -> Fabric {
    let f = Fabric::new(common::config(29690));
    for &l in lasts {
        f.add_iwarp_device(ip(l)).expect("iWARP device");
    }
    f
}

/// A listener on `at`, on channel `ch`.
fn listen_on(f: &Fabric, ch: &EventChannel, at: SocketAddr) -> CmId {
    let l = f.create_id_on(PortSpace::Tcp, ch);
    l.bind(at).expect("bind");
    l.listen(4).expect("listen");
    l
}

/// A TCP id on `ch` with address and route to `dst` resolved.
fn routed(f: &Fabric, ch: &EventChannel, dst: SocketAddr) -> CmId {
    let c = f.create_id_on(PortSpace::Tcp, ch);
    route(&c, ch, dst);
    c
}

/// Resolves `c`'s address and route to `dst` (its events come to `ch`).
fn route(c: &CmId, ch: &EventChannel, dst: SocketAddr) {
    c.resolve_addr(None, dst).expect("resolve_addr");
    assert!(matches!(next(ch).1, Event::AddrResolved));
    c.resolve_route().expect("resolve_route");
    assert!(matches!(next(ch).1, Event::RouteResolved));
}

fn connect_with(c: &CmId, pd: &[u8]) -> Result<(), Error> {
    c.connect(&ConnectOptions {
        private_data: pd.to_vec(),
        ..ConnectOptions::default()
    })
}

/// The next event of `ch` within `d`, if any (acked).
fn next_within(ch: &EventChannel, d: Duration) -> Option<(CmId, Event)> {
    let mut e = ch.get_event(Some(d))?;
    let id = e.id().clone();
    let ev = e.take().expect("the event's payload");
    Some((id, ev))
}

/// Server listener on 127.0.0.1:`port` (channel `chs`) and a client on 127.0.0.2 (channel
/// `chc`) whose MPA Request has been delivered: returns (listener, client, server child).
fn pending_request(
    f: &Fabric,
    chs: &EventChannel,
    chc: &EventChannel,
    port: u16,
) -> (CmId, CmId, CmId) {
    let l = listen_on(f, chs, addr(1, port));
    let c = routed(f, chc, addr(1, port));
    connect_with(&c, b"hello").expect("connect");
    let (child, ev) = next(chs);
    assert!(
        matches!(&ev, Event::ConnectRequest { private_data, .. } if private_data == b"hello"),
        "{ev:?}"
    );
    (l, c, child)
}

fn cleanup(f: &Fabric, ids: Vec<CmId>) {
    for id in ids {
        let _ = id.destroy();
    }
    f.shutdown();
}

/// The ordinary exchange. Linux: the passive side's `iw_conn_req_handler`
/// delivers CONNECT_REQUEST with the MPA Request's private data, exactly; `rdma_accept` ->
/// `siw_accept` sends the Reply and raises IW_CM_EVENT_ESTABLISHED (RDMA_CM_EVENT_ESTABLISHED,
/// no private data); the active side's CONNECT_REPLY status 0 becomes ESTABLISHED carrying the
/// Reply's private data (`cma_iw_handler`); a peer FIN gives DISCONNECT then CLOSE, i.e.
/// DISCONNECTED.
#[test]
fn control_connect_accept_and_a_peer_disconnect() {
    let f = iw_fabric(&[1, 2]);
    let (chs, chc) = (EventChannel::new(), EventChannel::new());
    let (l, c, child) = pending_request(&f, &chs, &chc, 29600);
    child
        .accept(&AcceptOptions {
            private_data: b"welcome".to_vec(),
            ..AcceptOptions::default()
        })
        .expect("accept");
    let (_, ev) = next(&chs);
    assert!(
        matches!(&ev, Event::Established { private_data, .. } if private_data.is_empty()),
        "{ev:?}"
    );
    let (_, ev) = next(&chc);
    assert!(
        matches!(&ev, Event::Established { private_data, .. } if private_data == b"welcome"),
        "{ev:?}"
    );
    c.disconnect().expect("disconnect");
    let (who, ev) = next(&chs);
    assert_eq!((who.key(), ev.name()), (child.key(), "DISCONNECTED"));
    let (who, ev) = next(&chc);
    assert_eq!((who.key(), ev.name()), (c.key(), "DISCONNECTED"));
    cleanup(&f, vec![c, child, l]);
}

/// Linux `rdma_disconnect` on iWARP calls `iw_cm_disconnect(cm_id.iw, 0)` whatever the rdma_cm
/// state; in IW_CM_STATE_CONN_RECV (a CONNECT_REQUEST delivered, neither accepted nor rejected)
/// `iw_cm_disconnect` does nothing and returns 0 ("App called disconnect before/without calling
/// accept after connect_request event delivered"). The request is still pending: a later
/// `rdma_accept` establishes the connection. (rcm refused the call with InvalidState.)
#[test]
fn disconnect_on_an_unanswered_request_returns_ok() {
    let f = iw_fabric(&[1, 2]);
    let (chs, chc) = (EventChannel::new(), EventChannel::new());
    let (l, c, child) = pending_request(&f, &chs, &chc, 29601);
    let r = child.disconnect();
    assert_eq!(
        r,
        Ok(()),
        "rdma_disconnect before accept (iw_cm CONN_RECV) returns 0 on Linux"
    );
    child
        .accept(&AcceptOptions::default())
        .expect("accept after the no-op disconnect");
    let (_, ev) = next(&chc);
    assert_eq!(ev.name(), "ESTABLISHED");
    cleanup(&f, vec![c, child, l]);
}

/// Linux `rdma_disconnect` on the active side while the MPA Request is out: `iw_cm_disconnect`
/// first waits for IWCM_F_CONNECT_WAIT to clear (set by `iw_cm_connect`, cleared by
/// `cm_conn_rep_handler` when the provider's CONNECT_REPLY arrives), then, the id being
/// ESTABLISHED, moves to CLOSING and the QP to SQD (graceful close) and returns 0. The
/// application sees ESTABLISHED, then DISCONNECTED. rcm does not make the caller wait: it
/// returns at once and closes the connection once it is up. (It refused the call and left
/// the connection up.) Since rcm's disconnect does not wait, it is made here, on the test's
/// thread, with the Request delivered and not yet answered; the accept comes after it returns.
#[test]
fn disconnect_while_the_mpa_request_is_out_returns_ok() {
    let f = iw_fabric(&[1, 2]);
    let (chs, chc) = (EventChannel::new(), EventChannel::new());
    let (l, c, child) = pending_request(&f, &chs, &chc, 29602);
    // The server holds the CONNECT_REQUEST unanswered: the client's Request is out.
    assert_eq!(c.state(), State::Connect, "the client is still connecting");
    let r = c.disconnect();
    assert_eq!(
        r,
        Ok(()),
        "rdma_disconnect while connecting returns 0 on Linux (after the CONNECT_REPLY)"
    );
    assert_eq!(
        c.state(),
        State::Connect,
        "nothing is closed before the connection is up"
    );
    child.accept(&AcceptOptions::default()).expect("accept");
    let mut seen = Vec::new();
    let end = Instant::now() + T;
    while !seen.contains(&"DISCONNECTED") && Instant::now() < end {
        if let Some((who, ev)) = next_within(&chc, Duration::from_millis(200)) {
            if who.key() == c.key() {
                seen.push(ev.name());
            }
        }
    }
    assert_eq!(seen, ["ESTABLISHED", "DISCONNECTED"]);
    cleanup(&f, vec![c, child, l]);
}

/// With MPA revision 1 there are no IRD/ORD words in the private data: `siw_connect` takes up to
/// MPA_MAX_PRIVDATA (256) bytes and `siw_accept` checks against 256, subtracting the 4 bytes of
/// `struct mpa_v2_data` only when `cep->enhanced_rdma_conn_est`; rdma_cm passes the user's bytes
/// unchanged (`cma_connect_iw`, `cma_accept_iw`), whose length is a u8 (`rdma_conn_param`). So
/// 255 bytes go through both ways between revision-1 ends. (rcm capped iWARP private data at
/// 252 whatever the revision.)
#[test]
fn revision_1_carries_255_bytes_of_private_data() {
    let f = Fabric::new(common::config(29690));
    f.add_iwarp_device(ip(1)).expect("server device");
    f.add_iwarp_device_with(
        ip(2),
        rcm_proto::iw::CepConfig {
            max_revision: 1,
            ..rcm_proto::iw::CepConfig::default()
        },
    )
    .expect("revision-1 client device");
    let (chs, chc) = (EventChannel::new(), EventChannel::new());
    let l = listen_on(&f, &chs, addr(1, 29606));
    let c = routed(&f, &chc, addr(1, 29606));
    let r = connect_with(&c, &[1u8; 255]);
    assert_eq!(r, Ok(()), "rdma_connect with 255 bytes over MPA revision 1");
    let (child, ev) = next(&chs);
    assert!(
        matches!(&ev, Event::ConnectRequest { private_data, .. } if private_data.len() == 255),
        "{ev:?}"
    );
    child
        .accept(&AcceptOptions {
            private_data: vec![2u8; 255],
            ..AcceptOptions::default()
        })
        .expect("rdma_accept with 255 bytes on a revision-1 request");
    let (_, ev) = next(&chc);
    assert!(
        matches!(&ev, Event::Established { private_data, .. } if private_data.len() == 255),
        "{ev:?}"
    );
    cleanup(&f, vec![c, child, l]);
}

/// Linux `cma_connect_iw` copies the id's source address into `cm_id->local_addr`, and siw's
/// `siw_connect` binds the TCP socket to it (`kernel_bindconnect`: SO_REUSEADDR, bind, connect)
/// before connecting: the TCP source port is the rdma_cm port of the active id. The passive
/// side's `iw_conn_req_handler` takes its destination address from the stream's peer
/// (`getname_peer`), and `cma_iw_handler` sets the active id's addresses from the CONNECT_REPLY.
/// So `rdma_get_local_addr` on the client equals `rdma_get_peer_addr` on the server's child.
/// (rcm connected from a kernel-chosen ephemeral TCP port, so the two differed.)
#[test]
fn the_server_sees_the_clients_rdma_cm_address() {
    let f = iw_fabric(&[1, 2]);
    let (chs, chc) = (EventChannel::new(), EventChannel::new());
    let (l, c, child) = pending_request(&f, &chs, &chc, 29607);
    child.accept(&AcceptOptions::default()).expect("accept");
    let (_, ev) = next(&chc);
    assert_eq!(ev.name(), "ESTABLISHED");
    assert!(eventually(T, || child.state() == State::Established));
    assert_eq!(
        child.peer_addr(),
        c.local_addr(),
        "the child's peer address is not the client's local address"
    );
    cleanup(&f, vec![c, child, l]);
}

/// Linux `cma_connect_iw` passes `responder_resources` and `initiator_depth` as the iw_cm's
/// IRD and ORD, and `siw_connect` refuses values beyond the device (`params->ird >
/// sdev->attrs.max_ird || params->ord > sdev->attrs.max_ord`: -ENOMEM), so `rdma_connect`
/// fails and the id stays ROUTE_RESOLVED (librdmacm's `ucma_valid_param` already answers
/// EINVAL for such values, unless they are RDMA_MAX_RESP_RES / RDMA_MAX_INIT_DEPTH, 0xFF,
/// which it replaces by the device maxima). (rcm lowered them silently to the device's 128
/// and connected, while its `accept` refused the same values.)
#[test]
fn connect_with_an_ird_beyond_the_device_fails() {
    let f = iw_fabric(&[1, 2]);
    let (chs, chc) = (EventChannel::new(), EventChannel::new());
    let l = listen_on(&f, &chs, addr(1, 29609));
    let c = routed(&f, &chc, addr(1, 29609));
    let r = c.connect(&ConnectOptions {
        responder_resources: 200,
        ..ConnectOptions::default()
    });
    assert!(
        r.is_err(),
        "rdma_connect with responder_resources 200 (device max 128) was taken: {r:?}"
    );
    assert_eq!(c.state(), State::RouteResolved);
    cleanup(&f, vec![c, l]);
}

/// Where the kernel has the id's rdma_cm port taken as a TCP port on the device's address
/// (here a listening socket of another program), siw's `kernel_bindconnect` fails and so
/// does `rdma_connect`; rcm connects from a port the kernel picks instead (a documented
/// difference: the rdma_cm port space is rcm's own, so the clash is not the caller's doing).
/// The connection comes up, and the server's child sees the kernel-chosen port.
#[test]
fn a_taken_tcp_port_falls_back_to_one_the_kernel_picks() {
    let f = iw_fabric(&[1, 2]);
    let (chs, chc) = (EventChannel::new(), EventChannel::new());
    let l = listen_on(&f, &chs, addr(1, 29610));
    let held = addr(2, 29611);
    let holder = std::net::TcpListener::bind(held).expect("hold TCP port 29611 on 127.0.0.2");
    let c = f.create_id_on(PortSpace::Tcp, &chc);
    c.bind(held)
        .expect("bind the id to the rdma_cm port the kernel holds for TCP");
    route(&c, &chc, addr(1, 29610));
    connect_with(&c, b"fallback").expect("connect from a taken TCP port");
    let (child, ev) = next(&chs);
    assert!(
        matches!(&ev, Event::ConnectRequest { private_data, .. } if private_data == b"fallback"),
        "{ev:?}"
    );
    child.accept(&AcceptOptions::default()).expect("accept");
    let (_, ev) = next(&chc);
    assert_eq!(ev.name(), "ESTABLISHED");
    assert_eq!(
        c.local_addr(),
        Some(held),
        "the id keeps its rdma_cm address"
    );
    let peer = child.peer_addr().expect("the child's peer address");
    assert_eq!(peer.ip(), held.ip());
    assert_ne!(
        peer.port(),
        held.port(),
        "the stream cannot come from the port another socket listens on"
    );
    // The other program's socket is untouched.
    assert_eq!(holder.local_addr().expect("holder address"), held);
    cleanup(&f, vec![c, child, l]);
}

/// `rdma_disconnect` on an accepted passive child that is not up yet (peer-to-peer mode: the
/// Reply is out, the initiator's RTR frame is not in): Linux's `iw_cm_disconnect` succeeds,
/// and the connection is closed once it is up. rcm returns Ok and sends its FIN when the RTR
/// makes the child ESTABLISHED, which the child still reports, then DISCONNECTED at the
/// initiator's FIN.
#[test]
fn disconnect_of_an_accepted_child_waiting_for_its_rtr_closes_it_once_up() {
    use rcm_proto::iw::{Cep, CepConfig, ConnectParams, RtrModes};
    use std::io::{Read, Write};
    let f = iw_fabric(&[1]);
    let chs = EventChannel::new();
    let l = listen_on(&f, &chs, addr(1, 29612));
    // A raw initiator asking for peer-to-peer mode, as siw's `peer_to_peer` does.
    let mut cep = Cep::active(CepConfig::default());
    cep.connect(
        Instant::now(),
        &ConnectParams {
            p2p: Some(RtrModes::SIW),
            private_data: b"p2p".to_vec(),
            ..ConnectParams::default()
        },
    )
    .expect("an MPA Request");
    let mut tcp = std::net::TcpStream::connect(addr(1, 29612)).expect("TCP connect");
    tcp.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("read timeout");
    while let Some(b) = cep.poll_transmit() {
        tcp.write_all(&b).expect("the MPA Request");
    }
    let (child, ev) = next(&chs);
    assert!(
        matches!(&ev, Event::ConnectRequest { private_data, .. } if private_data == b"p2p"),
        "{ev:?}"
    );
    child.accept(&AcceptOptions::default()).expect("accept");
    // The Reply comes; the RTR it makes our Cep want to send is held back.
    let mut buf = [0u8; 4096];
    let t0 = Instant::now();
    while cep.negotiated().is_none() {
        assert!(t0.elapsed() < T, "no MPA Reply");
        let n = tcp.read(&mut buf).expect("the MPA Reply");
        assert!(n > 0, "the stream closed before the Reply");
        cep.on_bytes(Instant::now(), &buf[..n]);
    }
    let rtr: Vec<u8> = std::iter::from_fn(|| cep.poll_transmit())
        .flatten()
        .collect();
    assert!(!rtr.is_empty(), "the initiator has an RTR frame to send");
    assert_eq!(child.state(), State::Connect, "up before its RTR");
    child
        .disconnect()
        .expect("disconnect of an accepted child not up yet");
    assert_eq!(
        next_within(&chs, Duration::from_millis(100)).map(|(_, e)| e.name()),
        None,
        "nothing happens before the RTR"
    );
    tcp.write_all(&rtr).expect("the RTR frame");
    let (_, ev) = next(&chs);
    assert_eq!(ev.name(), "ESTABLISHED");
    // Its FIN follows at once: the initiator reads the end of the stream.
    // Anything before the FIN is read past; a read timing out means no FIN.
    let fin = loop {
        match tcp.read(&mut buf) {
            Ok(0) => break true,
            Ok(_) => {}
            Err(_) => break false,
        }
    };
    assert!(fin, "the child's FIN never came after it was up");
    drop(tcp);
    let (_, ev) = next(&chs);
    assert_eq!(ev.name(), "DISCONNECTED");
    cleanup(&f, vec![child, l]);
}
