//! The rdma_cm layer against Linux's `drivers/infiniband/core/cma.c` (and the ib_cm it
//! drives, `cm.c`): each test states what Linux does, on points where rcm once differed in
//! a way an application would notice (found by a review).
#![cfg(not(loom))]

use rcm::{
    AcceptOptions, CmId, ConnectOptions, Error, Event, EventChannel, Fabric, FabricConfig,
    PortSpace, QpState, State,
};
use rcm_proto::ib::RetryPolicy;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

mod common;
use common::{ip, next};

mod raw_peer;
use raw_peer::{raw_sidr_req, routed, RawPeer};

/// Two loopback devices (127.0.0.1, 127.0.0.2) on UDP port `port`.
fn fabric(port: u16) -> Fabric {
    let cfg = FabricConfig {
        udp_port: port,
        retry: RetryPolicy::Backoff {
            initial: Duration::from_millis(100),
            max_wait: Duration::from_millis(400),
            deadline: Duration::from_millis(1500),
        },
        min_timewait: Duration::ZERO,
        ..FabricConfig::default()
    };
    Fabric::loopback_with(2, cfg).expect("loopback devices")
}

/// One device on 127.0.0.1 (a `RawPeer` takes 127.0.0.2).
fn one_device(port: u16) -> Fabric {
    let f = Fabric::new(FabricConfig {
        udp_port: port,
        ..FabricConfig::default()
    });
    f.add_device(IpAddr::from([127, 0, 0, 1])).unwrap();
    f
}

fn addr(last: u8, port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::from([127, 0, 0, last]), port)
}

/// An id of `ps` on `ch` with address and route to `dst` resolved.
fn routed_ps(f: &Fabric, ch: &EventChannel, ps: PortSpace, dst: SocketAddr) -> CmId {
    let c = f.create_id_on(ps, ch);
    c.resolve_addr(None, dst).unwrap();
    assert!(matches!(next(ch).1, Event::AddrResolved));
    c.resolve_route().unwrap();
    assert!(matches!(next(ch).1, Event::RouteResolved));
    c
}

/// A TCP connection 127.0.0.2 -> 127.0.0.1:`port`, the client without a QP (it sees
/// CONNECT_RESPONSE and calls `establish`). Returns (client, server child).
fn connected(
    f: &Fabric,
    ch: &EventChannel,
    port: u16,
    copts: &ConnectOptions,
    aopts: &AcceptOptions,
) -> (CmId, CmId) {
    let l = f.create_id_on(PortSpace::Tcp, ch);
    l.bind(addr(1, port)).unwrap();
    l.listen(4).unwrap();
    let c = routed_ps(f, ch, PortSpace::Tcp, addr(1, port));
    c.connect(copts).unwrap();
    let mut child = None;
    let mut up = 0;
    while up < 2 {
        let (id, ev) = next(ch);
        match ev {
            Event::ConnectRequest { .. } => {
                id.accept(aopts).unwrap();
                child = Some(id);
            }
            Event::ConnectResponse { .. } => id.establish().unwrap(),
            Event::Established { .. } => up += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    (c, child.unwrap())
}

/// A TCP connect 127.0.0.2 -> 127.0.0.1:`port` that the server's child accepted and the
/// client (no QP) has the REP of, not established. Returns (client, child, listener).
fn accepted_until_response(f: &Fabric, ch: &EventChannel, port: u16) -> (CmId, CmId, CmId) {
    let l = f.create_id_on(PortSpace::Tcp, ch);
    l.bind(addr(1, port)).unwrap();
    l.listen(4).unwrap();
    let c = routed_ps(f, ch, PortSpace::Tcp, addr(1, port));
    c.connect(&ConnectOptions::default()).unwrap();
    let mut child = None;
    loop {
        let (id, ev) = next(ch);
        match ev {
            Event::ConnectRequest { .. } => {
                id.accept(&AcceptOptions::default()).unwrap();
                child = Some(id);
            }
            Event::ConnectResponse { .. } => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    (c, child.expect("the request came before the REP"), l)
}

// ---------------------------------------------------------------------------------------
// Events

/// Linux `rdma_reject` needs only an ib_cm id, not a passive one: on the active side
/// after CONNECT_RESPONSE (ib_cm REP_RCVD) it sends a REJ (msg REP, reason 28), and
/// librdmacm itself does exactly that when it cannot move the QP after a REP
/// (`ucma_process_conn_resp`). The server's child then gets REJECTED.
#[test]
fn the_active_side_may_reject_a_rep() {
    let f = fabric(26612);
    let ch = EventChannel::new();
    let (c, child, _l) = accepted_until_response(&f, &ch, 7612);
    assert_eq!(
        c.reject(b"refused"),
        Ok(()),
        "rdma_reject after CONNECT_RESPONSE sends a REJ in Linux"
    );
    loop {
        let (id, ev) = next(&ch);
        if id == child {
            assert!(matches!(ev, Event::Rejected { .. }), "{ev:?}");
            break;
        }
    }
    f.shutdown();
}

/// The passive side may take back its accept until the RTU comes: Linux's `rdma_reject`
/// sends a REJ from ib_cm's REP_SENT (`cm_send_rej_locked`, then timewait), and the active
/// side, which has the REP and has not established, gets REJECTED with the private data.
/// (`disconnect` refuses there and points to `reject`.)
#[test]
fn the_passive_side_may_reject_after_accepting() {
    let f = fabric(26631);
    let ch = EventChannel::new();
    let (c, child, _l) = accepted_until_response(&f, &ch, 7631);
    assert!(matches!(
        child.disconnect(),
        Err(rcm::Error::InvalidState(rcm::State::Connect))
    ));
    assert_eq!(
        child.reject(b"changed my mind"),
        Ok(()),
        "rdma_reject after accept, before the RTU, sends a REJ in Linux"
    );
    assert_eq!(child.state(), rcm::State::Disconnect);
    let (id, ev) = next(&ch);
    assert_eq!(id, c, "{ev:?}");
    match ev {
        Event::Rejected {
            reason,
            private_data,
        } => {
            assert_eq!(reason, rcm_wire::cm::RejReason::ConsumerDefined);
            assert!(private_data.starts_with(b"changed my mind"));
        }
        other => panic!("expected REJECTED, got {other:?}"),
    }
    // The client's late establish finds nothing to establish.
    assert!(c.establish().is_err());
    assert!(
        ch.get_event(Some(Duration::from_millis(300))).is_none(),
        "no event after the child's own reject"
    );
    f.shutdown();
}

/// Before any answer (ib_cm REQ_SENT) `rdma_reject` on the active side withdraws the REQ:
/// ib_cm sends a REJ naming no message (`cm_format_rej`: "other") with the consumer reason
/// and goes back to idle; the id reports nothing more.
#[test]
fn the_active_side_may_withdraw_its_req() {
    use rcm_wire::cm::{CmMessage, MsgCode, RejReason};
    let f = one_device(26624);
    let peer = RawPeer::new(26624);
    let ch = EventChannel::new();
    let c = routed(&f, &ch, addr(2, 7624));
    c.connect(&ConnectOptions::default()).unwrap();
    let req = peer.recv_req();
    c.reject(b"changed my mind").unwrap();
    assert_eq!(c.state(), State::Disconnect);
    let rej = loop {
        match peer.recv() {
            CmMessage::Rej(r) => break r,
            CmMessage::Req(_) => {} // a retry sent before the reject
            other => panic!("expected a REJ, got {other:?}"),
        }
    };
    assert_eq!(rej.local_comm_id, req.local_comm_id);
    assert_eq!(rej.message_rejected, MsgCode::Other);
    assert_eq!(rej.reason, RejReason::ConsumerDefined);
    assert!(rej.private_data.starts_with(b"changed my mind"));
    assert!(
        ch.get_event(Some(Duration::from_millis(300))).is_none(),
        "no event after the id's own reject"
    );
    f.shutdown();
}

/// Linux `rdma_disconnect` returns 0 whenever the id has an ib_cm id: on an id still
/// connecting (REQ out, no answer yet) `ib_send_cm_dreq` and `ib_send_cm_drep` both fail
/// and are ignored, the QP goes to ERR, and the call returns 0; the attempt goes on and no
/// DISCONNECTED follows. rcm refuses the call instead (InvalidState), deliberately: an `Ok`
/// that does nothing left `rcm bench` waiting for a DISCONNECTED across a lossy link (the
/// fault test `lossy_link_1000_connections_bench_client` caught it), and the connection
/// then came up with nobody to close it. The attempt is not disturbed.
#[test]
fn disconnect_while_connecting_is_refused_and_changes_nothing() {
    use rcm_wire::cm::CmMessage;
    let f = one_device(26613);
    let peer = RawPeer::new(26613); // never answers
    let ch = EventChannel::new();
    let c = routed(&f, &ch, addr(2, 7613));
    c.connect(&ConnectOptions::default()).unwrap();
    let _ = peer.recv_req();
    assert_eq!(c.disconnect(), Err(Error::InvalidState(State::Connect)));
    assert_eq!(c.state(), State::Connect);
    // The REQ is still retried: the attempt goes on.
    assert!(matches!(peer.recv(), CmMessage::Req(_)));
    f.shutdown();
}

// ---------------------------------------------------------------------------------------
// Requests a listener must turn away

/// Linux `cma_ib_req_handler` -> `cma_ib_check_req_qp_type`: a SIDR_REQ for an RC id (an
/// RDMA_PS_IB id is RC unless created UD; librdmacm's `rdma_create_id` makes it RC) is
/// refused with -EINVAL before any CONNECT_REQUEST, and ib_cm answers IB_SIDR_REJECT.
/// (rcm once delivered CONNECT_REQUEST{ud:true} on an IB-port-space child, which could then
/// neither accept, sending a REP, nor reject, sending a REJ, the SIDR request.)
#[test]
fn a_sidr_request_for_an_ib_port_space_listener_is_turned_away() {
    use rcm_wire::cm::{CmMessage, SidrStatus};
    let f = one_device(26614);
    let peer = RawPeer::new(26614);
    let ch = EventChannel::new();
    let l = f.create_id_on(PortSpace::Ib, &ch);
    l.bind(addr(1, 7614)).unwrap();
    l.listen(4).unwrap();
    let sidr = raw_sidr_req(PortSpace::Ib, 7614, 0x4343);
    peer.send(CmMessage::SidrReq(sidr), 0x74);
    if let Some(mut e) = ch.get_event(Some(Duration::from_millis(500))) {
        let child = e.id().clone();
        let ev = e.take().unwrap();
        drop(e);
        let ev = match ev {
            Event::ConnectRequest { ud, .. } => format!("CONNECT_REQUEST {{ ud: {ud} }}"),
            other => other.name().to_string(),
        };
        let accept = child.accept(&AcceptOptions::default());
        let reject = child.reject(b"");
        panic!(
            "Linux never delivers this SIDR_REQ to an RC listener; rcm delivered {ev}, \
             then accept -> {accept:?}, reject -> {reject:?}"
        );
    }
    match peer.recv() {
        CmMessage::SidrRep(rep) => assert_ne!(rep.status, SidrStatus::Success),
        other => panic!("expected a SIDR_REP, got {other:?}"),
    }
    f.shutdown();
}

// ---------------------------------------------------------------------------------------
// QP attributes

/// Linux `cm_init_qp_rtr_attr` (what `rdma_init_qp_attr` returns for RTR on an RC id)
/// sets `min_rnr_timer = 0`; rdma_cm only changes it after `rdma_set_min_rnr_timer`,
/// which rcm does not have.
#[test]
fn rtr_min_rnr_timer_is_zero() {
    let f = fabric(26615);
    let ch = EventChannel::new();
    let (c, s) = connected(
        &f,
        &ch,
        7615,
        &ConnectOptions::default(),
        &AcceptOptions::default(),
    );
    for id in [&c, &s] {
        let rtr = id.init_qp_attr(QpState::Rtr).unwrap();
        assert_eq!(
            rtr.min_rnr_timer, 0,
            "cm_init_qp_rtr_attr gives min_rnr_timer 0"
        );
    }
    f.shutdown();
}

/// Linux `cm_rep_handler` takes the active side's `rnr_retry_count` from the REP
/// (`CM_REP_RNR_RETRY_COUNT`: how often the REP's sender wants the REQ's sender to retry
/// RNR NAKs), and `cm_init_qp_rts_attr` gives it as RTS `rnr_retry`. rcm keeps the
/// client's own `ConnectOptions::rnr_retry_count`.
#[test]
fn active_rts_rnr_retry_comes_from_the_rep() {
    let f = fabric(26616);
    let ch = EventChannel::new();
    let (c, _s) = connected(
        &f,
        &ch,
        7616,
        &ConnectOptions {
            rnr_retry_count: 7,
            ..ConnectOptions::default()
        },
        &AcceptOptions {
            rnr_retry_count: 3,
            ..AcceptOptions::default()
        },
    );
    let rts = c.init_qp_attr(QpState::Rts).unwrap();
    assert_eq!(
        rts.rnr_retry, 3,
        "the client's RTS rnr_retry is the REP's RNR retry count"
    );
    f.shutdown();
}

// ---------------------------------------------------------------------------------------
// Address resolution

/// Linux `resolve_prepare_src`: on a bound id whose family differs from the destination's,
/// `rdma_resolve_addr` fails at once with -EINVAL (no ADDR_ERROR event); a wildcard binding
/// has a family too. Unbound, a source of another family than the destination fails alike.
#[test]
fn resolve_addr_with_a_family_other_than_the_bound_one_fails_at_once() {
    let f = fabric(26617);
    let ch = EventChannel::new();
    let dst: SocketAddr = "[::1]:7617".parse().unwrap();
    for bound in [addr(1, 0), SocketAddr::new(IpAddr::from([0, 0, 0, 0]), 0)] {
        let c = f.create_id_on(PortSpace::Tcp, &ch);
        c.bind(bound).unwrap();
        let local = c.local_addr();
        assert!(
            matches!(c.resolve_addr(None, dst), Err(Error::InvalidArgument(_))),
            "bound to {bound}"
        );
        assert_eq!((c.state(), c.local_addr()), (State::AddrBound, local));
    }
    let c = f.create_id_on(PortSpace::Tcp, &ch);
    assert!(matches!(
        c.resolve_addr(Some(IpAddr::from([127, 0, 0, 2])), dst),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!((c.state(), c.local_addr()), (State::Idle, None));
    assert!(
        ch.get_event(Some(Duration::from_millis(200))).is_none(),
        "no ADDR_ERROR"
    );
    f.shutdown();
}

/// Linux's `resolve_prepare_src` binds only an idle id: on one already bound (here to the
/// wildcard) the source `rdma_resolve_addr` is given is ignored, and the route to the
/// destination picks the device. rcm used it: a source no device had was an ADDR_ERROR, and
/// another device's address rebound the id to it.
#[test]
fn resolve_addr_on_a_bound_id_ignores_its_source() {
    let f = fabric(26630);
    let ch = EventChannel::new();
    let dst = addr(1, 7630);
    let resolved_from = |src: Option<IpAddr>| {
        let c = f.create_id_on(PortSpace::Tcp, &ch);
        c.bind(SocketAddr::new(IpAddr::from([0, 0, 0, 0]), 0))
            .unwrap();
        c.resolve_addr(src, dst).unwrap();
        let (_, ev) = next(&ch);
        assert!(matches!(ev, Event::AddrResolved), "{src:?}: {ev:?}");
        c.local_addr().map(|a| a.ip())
    };
    let routed = resolved_from(None);
    assert!(routed.is_some());
    assert_eq!(resolved_from(Some(IpAddr::from([127, 0, 0, 77]))), routed);
    assert_eq!(resolved_from(Some(ip(1))), routed);
    assert_eq!(resolved_from(Some(ip(2))), routed);
    f.shutdown();
}

/// Linux `rdma_resolve_addr` with a source address binds it first (`cma_bind_addr` ->
/// `rdma_bind_addr_dst` -> `cma_translate_addr`/`cma_acquire_dev_by_src_ip`): a source
/// no RDMA device has fails at once (-EADDRNOTAVAIL or -ENODEV), as `rdma_bind_addr` to it
/// does (and as rcm's own `bind` does), with no ADDR_ERROR event. An unspecified source is
/// no source: the id is resolved as without one.
#[test]
fn resolve_addr_with_a_source_no_device_has_fails_at_once() {
    let f = fabric(26618);
    let ch = EventChannel::new();
    let c = f.create_id_on(PortSpace::Tcp, &ch);
    let src = IpAddr::from([127, 0, 0, 77]);
    assert_eq!(
        c.bind(SocketAddr::new(src, 0)),
        Err(Error::AddrNotAvailable(src))
    );
    assert_eq!(
        c.resolve_addr(Some(src), addr(1, 7618)),
        Err(Error::AddrNotAvailable(src))
    );
    assert_eq!((c.state(), c.local_addr()), (State::Idle, None));
    assert!(
        ch.get_event(Some(Duration::from_millis(200))).is_none(),
        "no ADDR_ERROR"
    );
    c.resolve_addr(Some(IpAddr::from([0, 0, 0, 0])), addr(1, 7618))
        .unwrap();
    assert!(matches!(next(&ch).1, Event::AddrResolved));
    f.shutdown();
}

/// A loopback address reaches only loopback addresses: Linux's routing refuses a packet
/// from 127.0.0.1 to another host (a martian source), so `rdma_resolve_addr` from an id
/// bound to a loopback device to such a destination ends in ADDR_ERROR, and nothing is
/// sent. The id stays bound and can resolve a loopback destination next.
#[test]
fn a_loopback_device_does_not_reach_another_host() {
    let f = fabric(26623);
    let ch = EventChannel::new();
    let c = f.create_id_on(PortSpace::Tcp, &ch);
    c.bind(addr(1, 0)).unwrap();
    let far = SocketAddr::new(IpAddr::from([198, 18, 0, 1]), 7623);
    c.resolve_addr(None, far).unwrap();
    match next(&ch).1 {
        Event::AddrError(Error::AddrNotAvailable(ip)) => assert_eq!(ip, far.ip()),
        other => panic!("expected ADDR_ERROR, got {other:?}"),
    }
    assert_eq!(c.state(), State::AddrBound);
    // Unbound, no device is chosen for it either.
    let u = f.create_id_on(PortSpace::Tcp, &ch);
    u.resolve_addr(None, far).unwrap();
    assert!(matches!(next(&ch).1, Event::AddrError(_)));
    assert_eq!((u.state(), u.local_addr()), (State::Idle, None));
    c.resolve_addr(None, addr(2, 7623)).unwrap();
    assert!(matches!(next(&ch).1, Event::AddrResolved));
    f.shutdown();
}

// ---------------------------------------------------------------------------------------
// Port spaces and bind

/// Linux `rdma_set_reuseaddr` accepts `reuse = 1` in any state but LISTEN (only turning it
/// off needs IDLE): an application may bind and then set SO_REUSEADDR-like sharing, after
/// which another reusing id may bind the same address and port (`cma_check_port`).
#[test]
fn reuseaddr_may_be_set_after_bind() {
    let f = fabric(26619);
    let a = f.create_id(PortSpace::Tcp, |_, _| rcm::Flow::Continue);
    a.bind(addr(1, 7619)).unwrap();
    assert_eq!(
        a.set_reuseaddr(true),
        Ok(()),
        "rdma_set_reuseaddr(id, 1) on a bound id succeeds in Linux"
    );
    let b = f.create_id(PortSpace::Tcp, |_, _| rcm::Flow::Continue);
    b.set_reuseaddr(true).unwrap();
    assert_eq!(
        b.bind(addr(1, 7619)),
        Ok(()),
        "both reuse: the port is shared"
    );
    f.shutdown();
}

/// Linux `cma_check_port`: a conflict with a wildcard (either side unspecified) is
/// -EADDRNOTAVAIL; only the same specific address is -EADDRINUSE. A listen on a shared
/// port (`cma_bind_listen` checks it the same way) answers alike.
#[test]
fn a_wildcard_port_conflict_is_addr_not_available() {
    let f = fabric(26620);
    let mk = || f.create_id(PortSpace::Tcp, |_, _| rcm::Flow::Continue);
    let any = |port| SocketAddr::new(IpAddr::from([0, 0, 0, 0]), port);
    let a = mk();
    a.bind(any(7620)).unwrap();
    let b = mk();
    assert_eq!(b.bind(addr(1, 7620)), Err(Error::AddrNotAvailable(ip(1))));
    let c = mk();
    c.bind(addr(1, 7624)).unwrap();
    assert_eq!(b.bind(any(7624)), Err(Error::AddrNotAvailable(any(0).ip())));
    assert_eq!(b.bind(addr(1, 7624)), Err(Error::AddrInUse(addr(1, 7624))));
    // Two reusing ids share a wildcard port; neither may then listen on it.
    let (d, e) = (mk(), mk());
    for id in [&d, &e] {
        id.set_reuseaddr(true).unwrap();
        id.bind(any(7625)).unwrap();
    }
    assert_eq!(d.listen(0), Err(Error::AddrNotAvailable(any(0).ip())));
    f.shutdown();
}

/// Linux `cma_acquire_dev_by_src_ip` (and `cma_ib_acquire_dev`): an RDMA_PS_IPOIB id on a
/// device that is not InfiniBand (RoCE, iWARP) gets -EINVAL: `rdma_bind_addr` to a RoCE
/// device's address fails, as does `rdma_resolve_addr` with such a source (it binds it
/// first); without one, the resolution finds no InfiniBand device: ADDR_ERROR.
#[test]
fn the_ipoib_port_space_is_refused_on_roce() {
    let f = fabric(26621);
    let ch = EventChannel::new();
    let a = f.create_id_on(PortSpace::Ipoib, &ch);
    assert!(matches!(
        a.bind(addr(1, 7621)),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        a.resolve_addr(Some(ip(2)), addr(1, 7621)),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!((a.state(), a.local_addr()), (State::Idle, None));
    a.resolve_addr(None, addr(1, 7621)).unwrap();
    assert!(matches!(
        next(&ch).1,
        Event::AddrError(Error::InvalidArgument(_))
    ));
    assert_eq!(f.bound_ports(), 0);
    f.shutdown();
}

/// Linux `cma_ib_handler` delivers IB_CM_TIMEWAIT_EXIT only while the rdma_cm id is in
/// RDMA_CM_DISCONNECT, which only DREQ/DREP/DREQ_ERROR lead to; REJ_RECEIVED leaves the id
/// in RDMA_CM_CONNECT. A REJ that reaches the active side after the REP (ib_cm REP_RCVD,
/// `cm_rej_handler` enters timewait) thus gives REJECTED and never TIMEWAIT_EXIT (rcm passed
/// every TimewaitExit on).
#[test]
fn no_timewait_exit_after_rejected() {
    use rcm_wire::cm::{CmMessage, MsgCode, Rej, RejReason};
    let f = one_device(26622);
    let peer = RawPeer::new(26622);
    let ch = EventChannel::new();
    let c = routed(&f, &ch, addr(2, 7622));
    c.connect(&ConnectOptions::default()).unwrap();
    let req = peer.recv_req();
    peer.send(CmMessage::Rep(raw_peer::raw_rep(req.local_comm_id)), 0x7171);
    let (_, ev) = next(&ch);
    assert!(matches!(ev, Event::ConnectResponse { .. }), "{ev:?}");
    peer.send(
        CmMessage::Rej(Rej {
            local_comm_id: 0xBEEF,
            remote_comm_id: req.local_comm_id,
            message_rejected: MsgCode::Other,
            reason: RejReason::ConsumerDefined,
            ..Rej::default()
        }),
        0x7172,
    );
    let (_, ev) = next(&ch);
    assert!(matches!(ev, Event::Rejected { .. }), "{ev:?}");
    let later = ch
        .get_event(Some(Duration::from_secs(8)))
        .map(|e| e.event().name());
    assert!(
        later.is_none(),
        "Linux drops TIMEWAIT_EXIT for an id that was REJECTED (still RDMA_CM_CONNECT); rcm \
         delivered {later:?}"
    );
    f.shutdown();
}
