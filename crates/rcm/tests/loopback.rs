//! Two devices on loopback in one process: connect, accept, reject with private data,
//! disconnect, time out against a silent peer, device removal mid-connection, in callback
//! and channel mode.
#![cfg(not(loom))]

use rcm::{
    AcceptOptions, CmId, ConnectOptions, DestroyOutcome, Error, Event, EventChannel, Fabric,
    FabricConfig, Flow, PortSpace, QpState, State, Unreachable,
};
use rcm_proto::ib::RetryPolicy;
use rcm_wire::cm::RejReason;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod raw_peer;
use raw_peer::{raw_rep, raw_req, raw_sidr_req, raw_sidr_req_to, routed, RawPeer};

const T: Duration = Duration::from_secs(10);

/// A fabric of two loopback devices on a UDP port of its own (tests run in parallel).
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

fn addr(last: u8, port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::from([127, 0, 0, last]), port)
}

/// A server on 127.0.0.1:`port` that accepts (or rejects) with private data and reports
/// what happened on `tx`.
fn server(f: &Fabric, port: u16, reject: bool, tx: mpsc::Sender<String>) -> CmId {
    let id = f.create_id(PortSpace::Tcp, move |id, ev| {
        match ev {
            Event::ConnectRequest { private_data, .. } => {
                tx.send(format!(
                    "request {}",
                    String::from_utf8_lossy(&private_data[..5])
                ))
                .unwrap();
                if reject {
                    id.reject(b"go away").unwrap();
                } else {
                    id.accept(&AcceptOptions {
                        private_data: b"welcome".to_vec(),
                        ..AcceptOptions::default()
                    })
                    .unwrap();
                }
            }
            Event::Established { .. } => tx.send("server established".into()).unwrap(),
            Event::Disconnected => tx.send("server disconnected".into()).unwrap(),
            other => tx.send(format!("server {}", other.name())).unwrap(),
        }
        Flow::Continue
    });
    id.bind(addr(1, port)).unwrap();
    id.listen(0).unwrap();
    id
}

/// A client that resolves, connects with "hello", establishes and reports.
fn client(f: &Fabric, dst: SocketAddr, tx: mpsc::Sender<String>) -> CmId {
    let id = f.create_id(PortSpace::Tcp, move |id, ev| {
        match ev {
            Event::AddrResolved => id.resolve_route().unwrap(),
            Event::RouteResolved => {
                id.connect(&ConnectOptions {
                    private_data: b"hello".to_vec(),
                    ..ConnectOptions::default()
                })
                .unwrap();
            }
            Event::ConnectResponse { private_data, .. } => {
                tx.send(format!(
                    "response {}",
                    String::from_utf8_lossy(&private_data[..7])
                ))
                .unwrap();
                id.establish().unwrap();
            }
            Event::Established { .. } => tx.send("client established".into()).unwrap(),
            Event::Rejected {
                reason,
                private_data,
            } => {
                tx.send(format!(
                    "rejected {} {}",
                    reason.raw(),
                    String::from_utf8_lossy(&private_data[..7])
                ))
                .unwrap();
            }
            Event::Unreachable(u) => tx.send(format!("unreachable {u:?}")).unwrap(),
            Event::Disconnected => tx.send("client disconnected".into()).unwrap(),
            other => tx.send(format!("client {}", other.name())).unwrap(),
        }
        Flow::Continue
    });
    id.resolve_addr(None, dst).unwrap();
    id
}

/// Waits until every message in `want` was seen, in any order (the two sides' events are
/// not ordered with respect to each other).
fn expect_all(rx: &mpsc::Receiver<String>, want: &[&str]) {
    let mut missing: Vec<&str> = want.to_vec();
    let mut seen = Vec::new();
    while !missing.is_empty() {
        match rx.recv_timeout(T) {
            Ok(m) => {
                missing.retain(|w| *w != m);
                seen.push(m);
            }
            Err(e) => panic!("waited for {missing:?} ({e}); saw {seen:?}"),
        }
    }
}

fn expect(rx: &mpsc::Receiver<String>, want: &str) {
    let mut seen = Vec::new();
    loop {
        match rx.recv_timeout(T) {
            Ok(m) if m == want => return,
            Ok(m) => seen.push(m),
            Err(e) => panic!("waited for {want:?} ({e}); saw {seen:?}"),
        }
    }
}

/// A server on 127.0.0.1:7471 and a client from 127.0.0.`src` connect with private data
/// both ways, establish and disconnect (the client asks); both ids are returned.
fn connect_and_disconnect(f: &Fabric, src: u8) -> (CmId, CmId) {
    let (tx, rx) = mpsc::channel();
    let srv = server(f, 7471, false, tx.clone());
    let cli = client(f, addr(1, 7471), tx);
    expect(&rx, "request hello");
    expect(&rx, "response welcome");
    expect_all(&rx, &["client established", "server established"]);
    assert_eq!(cli.state(), State::Established);
    assert_eq!(
        cli.local_addr().unwrap().ip(),
        IpAddr::from([127, 0, 0, src])
    );
    assert_eq!(cli.peer_addr(), Some(addr(1, 7471)));
    cli.disconnect().unwrap();
    expect_all(&rx, &["server disconnected", "client disconnected"]);
    (srv, cli)
}

#[test]
fn connect_accept_disconnect_with_callbacks() {
    let f = fabric(24791);
    let (srv, cli) = connect_and_disconnect(&f, 2);
    assert_eq!(cli.destroy(), Ok(DestroyOutcome::Done));
    assert_eq!(srv.destroy(), Ok(DestroyOutcome::Done));
    // The child id (accepted connection) is still alive until destroyed; shutdown cleans up.
    f.shutdown();
    assert_eq!(f.live_ids(), 0);
    assert_eq!(f.bound_ports(), 0);
}

#[test]
fn reject_with_private_data_reaches_the_client() {
    let f = fabric(24792);
    let (tx, rx) = mpsc::channel();
    let _srv = server(&f, 7471, true, tx.clone());
    let _cli = client(&f, addr(1, 7471), tx);
    expect(&rx, "request hello");
    expect(&rx, "rejected 28 go away");
    f.shutdown();
}

#[test]
fn no_listener_is_rejected_invalid_service_id() {
    let f = fabric(24793);
    let (tx, rx) = mpsc::channel();
    let _cli = client(&f, addr(1, 9999), tx);
    let m = loop {
        let m = rx.recv_timeout(T).unwrap();
        if m.starts_with("rejected") {
            break m;
        }
    };
    assert!(
        m.starts_with(&format!("rejected {}", RejReason::InvalidServiceId.raw())),
        "{m}"
    );
    f.shutdown();
}

#[test]
fn silent_peer_times_out_unreachable() {
    let f = fabric(24794);
    let (tx, rx) = mpsc::channel();
    // Nobody serves 127.0.0.9: the REQ goes unanswered until the deadline.
    let _cli = client(&f, addr(9, 7471), tx);
    expect(&rx, &format!("unreachable {:?}", Unreachable::Timeout));
    f.shutdown();
}

#[test]
fn channel_mode_connect_and_held_events() {
    let f = fabric(24795);
    let ch = EventChannel::new();
    let srv = f.create_id_on(PortSpace::Tcp, &ch);
    srv.bind(addr(1, 7472)).unwrap();
    srv.listen(4).unwrap();
    let cli = f.create_id_on(PortSpace::Tcp, &ch);
    cli.resolve_addr(None, addr(1, 7472)).unwrap();
    let mut child = None;
    let mut established = 0;
    while established < 2 {
        let mut e = ch.get_event(Some(T)).expect("event");
        let id = e.id().clone();
        match e.take().unwrap() {
            Event::AddrResolved => id.resolve_route().unwrap(),
            Event::RouteResolved => id.connect(&ConnectOptions::default()).unwrap(),
            Event::ConnectRequest { listener, .. } => {
                assert_eq!(listener, srv);
                assert_ne!(id, srv);
                id.accept(&AcceptOptions::default()).unwrap();
                child = Some(id);
            }
            Event::ConnectResponse { .. } => {
                // Holding this event: a blocking destroy must refuse, not hang.
                assert_eq!(id.destroy(), Err(Error::EventsOutstanding(1)));
                assert_eq!(
                    id.state(),
                    State::Connect,
                    "the failed destroy changed nothing"
                );
                id.establish().unwrap();
            }
            Event::Established { .. } => established += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(cli.state(), State::Established);
    let child = child.unwrap();
    // What a daemon client derives from the RTS attributes is what init_qp_attr gives.
    for id in [&cli, &child] {
        let rts = id.init_qp_attr(QpState::Rts).unwrap();
        assert_ne!(rts.sq_psn, 0, "RC: RTS has a send PSN");
        let rtr = id.init_qp_attr(QpState::Rtr).unwrap();
        assert_eq!(
            (
                rtr.sq_psn,
                rtr.timeout,
                rtr.retry_cnt,
                rtr.rnr_retry,
                rtr.max_rd_atomic
            ),
            (0, 0, 0, 0, 0),
            "RTR carries no send-side fields"
        );
        assert_eq!((rtr.dest_qp_num, rtr.rq_psn), (rts.dest_qp_num, rts.rq_psn));
        for s in [QpState::Init, QpState::Rtr, QpState::Rts] {
            assert_eq!(rts.for_state(s), Some(id.init_qp_attr(s).unwrap()), "{s:?}");
        }
        let init = id.init_qp_attr(QpState::Init).unwrap();
        assert_eq!(
            init.for_state(QpState::Rtr),
            None,
            "no later state from INIT"
        );
    }
    child.disconnect().unwrap();
    let mut disc = 0;
    while disc < 2 {
        let e = ch.get_event(Some(T)).expect("event");
        if matches!(e.event(), Event::Disconnected) {
            disc += 1;
        }
    }
    // Disconnecting what is already down is no error, as rdma_disconnect returns 0 there
    // (applications call it on DISCONNECTED): the side the peer disconnected, and again.
    assert_eq!(cli.disconnect(), Ok(()));
    assert_eq!(child.disconnect(), Ok(()));
    for id in [cli, child, srv] {
        assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
    }
    assert_eq!(f.live_ids(), 0);
    f.shutdown();
}

/// With a QP attached the client sees ESTABLISHED, never CONNECT_RESPONSE, and the server
/// gets the RTU: whether the QP was attached before `connect` (the engine answers the REP
/// with the RTU itself) or only after it, while the REQ was out (the id's REP handling
/// sends the RTU). The client's ESTABLISHED carries the REP's private data, as Linux's
/// (cma_ib_handler sets the REP's event data on it).
#[test]
fn an_attached_qp_is_established_on_the_rep_whenever_it_was_attached() {
    let f = fabric(24817);
    let ch = EventChannel::new();
    let srv = f.create_id_on(PortSpace::Tcp, &ch);
    srv.bind(addr(1, 7473)).unwrap();
    srv.listen(4).unwrap();
    for qp_before_connect in [true, false] {
        let cli = f.create_id_on(PortSpace::Tcp, &ch);
        if qp_before_connect {
            cli.create_qp().unwrap();
        }
        cli.resolve_addr(None, addr(1, 7473)).unwrap();
        let (mut child, mut client_up, mut server_up) = (None, false, false);
        while !(client_up && server_up) {
            let mut e = ch.get_event(Some(T)).expect("event");
            let id = e.id().clone();
            match e.take().unwrap() {
                Event::AddrResolved => id.resolve_route().unwrap(),
                Event::RouteResolved => {
                    id.connect(&ConnectOptions::default()).unwrap();
                    if !qp_before_connect {
                        // The REP cannot come before this thread accepts, below.
                        id.create_qp().unwrap();
                    }
                }
                Event::ConnectRequest { .. } => {
                    id.accept(&AcceptOptions {
                        private_data: b"from the REP".to_vec(),
                        ..AcceptOptions::default()
                    })
                    .unwrap();
                    child = Some(id);
                }
                Event::Established { private_data, .. } if id == cli => {
                    assert_eq!(
                        private_data.get(..12),
                        Some(&b"from the REP"[..]),
                        "qp before connect {qp_before_connect}"
                    );
                    client_up = true;
                }
                Event::Established { private_data, .. } => {
                    assert_eq!(Some(&id), child.as_ref());
                    assert!(private_data.is_empty(), "the RTU carries none here");
                    server_up = true;
                }
                other => panic!("qp before connect {qp_before_connect}: unexpected {other:?}"),
            }
        }
        assert_eq!(cli.state(), State::Established);
        let child = child.unwrap();
        let (c, s) = (
            cli.init_qp_attr(QpState::Rts).unwrap(),
            child.init_qp_attr(QpState::Rts).unwrap(),
        );
        assert_eq!(
            (c.rq_psn, s.rq_psn),
            (s.sq_psn, c.sq_psn),
            "each side receives from the PSN the other sends from"
        );
        assert_eq!(
            cli.establish(),
            Err(Error::InvalidState(State::Established)),
            "nothing left to establish"
        );
        for id in [cli, child] {
            assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
        }
    }
    assert_eq!(srv.destroy(), Ok(DestroyOutcome::Done));
    f.shutdown();
}

#[test]
fn device_removal_mid_connection() {
    let f = fabric(24796);
    let (tx, rx) = mpsc::channel();
    let removal_seen = Arc::new(AtomicUsize::new(0));
    let seen = removal_seen.clone();
    let children = Arc::new(Mutex::new(Vec::new()));
    let kids = children.clone();
    let tx2 = tx.clone();
    let srv = f.create_id(PortSpace::Tcp, move |id, ev| {
        match ev {
            Event::ConnectRequest { .. } => {
                kids.lock().unwrap().push(id.clone());
                id.accept(&AcceptOptions::default()).unwrap();
            }
            Event::Established { .. } => tx2.send("server established".into()).unwrap(),
            Event::DeviceRemoval => {
                seen.fetch_add(1, Ordering::SeqCst);
                // After removal only destroy is valid.
                assert_eq!(id.disconnect(), Err(Error::DeviceRemoved));
                return Flow::Destroy;
            }
            _ => {}
        }
        Flow::Continue
    });
    srv.bind(addr(1, 7473)).unwrap();
    srv.listen(0).unwrap();
    let _cli = client(&f, addr(1, 7473), tx);
    expect(&rx, "server established");
    let removal = f.remove_device(IpAddr::from([127, 0, 0, 1])).unwrap();
    // The listener (bound to the device) and the child both get exactly one DeviceRemoval,
    // and both destroy themselves by returning Flow::Destroy.
    removal
        .wait(T)
        .expect("removal completes once every id is destroyed");
    assert_eq!(removal_seen.load(Ordering::SeqCst), 2);
    assert_eq!(children.lock().unwrap()[0].state(), State::Destroying);
    assert_eq!(srv.state(), State::Destroying);
    f.shutdown();
}

#[test]
fn removal_reports_who_holds_the_device() {
    let f = fabric(24797);
    let ch = EventChannel::new();
    let srv = f.create_id_on(PortSpace::Tcp, &ch);
    srv.bind(addr(1, 7474)).unwrap();
    srv.listen(0).unwrap();
    let removal = f.remove_device(IpAddr::from([127, 0, 0, 1])).unwrap();
    assert_eq!(
        removal.wait(Duration::from_millis(200)),
        Err(vec![srv.key()])
    );
    let e = ch.get_event(Some(T)).unwrap();
    assert!(matches!(e.event(), Event::DeviceRemoval));
    drop(e);
    assert_eq!(srv.listen(0), Err(Error::DeviceRemoved));
    srv.destroy().unwrap();
    removal.wait(T).unwrap();
    f.shutdown();
}

#[test]
fn reuseaddr_shares_a_port_until_someone_listens() {
    let f = fabric(24798);
    let mk = || f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
    let (a, b, c) = (mk(), mk(), mk());
    a.bind(addr(2, 5000)).unwrap();
    assert_eq!(
        b.bind(addr(2, 5000)),
        Err(Error::AddrInUse(addr(2, 5000))),
        "no reuse: refused"
    );
    assert_eq!(b.state(), State::Idle, "a failed bind changes nothing");
    let (d, e) = (mk(), mk());
    d.set_reuseaddr(true).unwrap();
    e.set_reuseaddr(true).unwrap();
    d.bind(addr(2, 6000)).unwrap();
    e.bind(addr(2, 6000)).unwrap();
    // Two ids share the port: neither may listen on it.
    assert_eq!(e.listen(0), Err(Error::AddrInUse(addr(2, 6000))));
    assert_eq!(e.state(), State::AddrBound);
    e.destroy().unwrap();
    d.listen(0).unwrap();
    // A listener shares with nobody, reuse or not.
    c.set_reuseaddr(true).unwrap();
    assert_eq!(c.bind(addr(2, 6000)), Err(Error::AddrInUse(addr(2, 6000))));
    // Linux's rdma_set_reuseaddr: on in any state but Listen, off only while idle.
    assert_eq!(
        d.set_reuseaddr(true),
        Err(Error::InvalidState(State::Listen))
    );
    assert_eq!(
        a.set_reuseaddr(false),
        Err(Error::InvalidState(State::AddrBound))
    );
    f.shutdown();
    assert_eq!(f.bound_ports(), 0);
}

/// An id bound to the wildcard with reuse keeps its reuse when `resolve_addr` moves its port
/// to the chosen device's address, and holds the port there afterwards. Before, the move was
/// made without reuse, failed against another reusing wildcard id, and the failure was
/// ignored: the id went on as bound while holding no port at all.
#[test]
fn resolve_addr_moves_a_reusing_wildcard_binding_with_its_reuse() {
    let f = fabric(24799);
    let mk = || f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
    let any = SocketAddr::new(IpAddr::from([0, 0, 0, 0]), 6100);
    let (x, y) = (mk(), mk());
    x.set_reuseaddr(true).unwrap();
    y.set_reuseaddr(true).unwrap();
    x.bind(any).unwrap();
    y.bind(any).unwrap();
    x.resolve_addr(Some(IpAddr::from([127, 0, 0, 2])), addr(1, 7000))
        .unwrap();
    assert_eq!(x.local_addr(), Some(addr(2, 6100)));
    y.destroy().unwrap();
    // Only x holds 127.0.0.2:6100 now: an id without reuse is refused it.
    let z = mk();
    assert_eq!(z.bind(addr(2, 6100)), Err(Error::AddrInUse(addr(2, 6100))));
    // The ephemeral port resolve_addr binds for an unbound id keeps its reuse as well
    // (Linux's cma_alloc_any_port keeps the id's reuseaddr): another reusing id shares it.
    let (e1, e2) = (mk(), mk());
    e1.set_reuseaddr(true).unwrap();
    e2.set_reuseaddr(true).unwrap();
    e1.resolve_addr(Some(IpAddr::from([127, 0, 0, 2])), addr(1, 7000))
        .unwrap();
    let port = e1.local_addr().expect("an ephemeral port");
    assert_eq!(e2.bind(port), Ok(()));
    for id in [x, z, e1, e2] {
        id.destroy().unwrap();
    }
    f.shutdown();
    assert_eq!(f.bound_ports(), 0);
}

/// A QPN given by the caller goes on the wire in 24 bits and names the id's UD receive
/// queue: 0, 1 (the special QPs) and anything wider are refused before anything is sent
/// (a wider one was announced truncated, another id's QPN, for RC and UD alike).
#[test]
fn a_callers_qpn_must_be_an_ordinary_24_bit_qpn() {
    let f = fabric(24800);
    for ps in [PortSpace::Tcp, PortSpace::Udp] {
        let ch = EventChannel::new();
        let id = f.create_id_on(ps, &ch);
        id.resolve_addr(None, addr(1, 7000)).unwrap();
        let e = ch.get_event(Some(T)).expect("event");
        assert!(matches!(e.event(), Event::AddrResolved), "{e:?}");
        drop(e);
        id.resolve_route().unwrap();
        let e = ch.get_event(Some(T)).expect("event");
        assert!(matches!(e.event(), Event::RouteResolved), "{e:?}");
        drop(e);
        for qpn in [0, 1, 0x0100_0100] {
            let r = id.connect(&ConnectOptions {
                qpn: Some(qpn),
                ..ConnectOptions::default()
            });
            assert!(
                matches!(r, Err(Error::InvalidArgument(_))),
                "{ps:?} QPN {qpn:#x}: {r:?}"
            );
            assert_eq!(id.state(), State::RouteResolved, "nothing changed");
        }
        assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
    }
    f.shutdown();
}

/// With polling off (`spin` zero) every thread sleeps at once: the device thread waits in
/// poll(2) up to its next timer, so connections, disconnects and retransmission timeouts
/// still work; and an event channel with polling off still delivers.
#[test]
fn threads_that_never_poll_still_connect_and_time_out() {
    let mut cfg = FabricConfig {
        udp_port: 24801,
        retry: RetryPolicy::Backoff {
            initial: Duration::from_millis(100),
            max_wait: Duration::from_millis(400),
            deadline: Duration::from_millis(1500),
        },
        ..FabricConfig::default()
    };
    cfg.spin = Duration::ZERO;
    let f = Fabric::loopback_with(2, cfg).expect("loopback devices");
    let (tx, rx) = mpsc::channel();
    let srv = server(&f, 7471, false, tx.clone());
    let cli = client(&f, addr(1, 7471), tx.clone());
    expect(&rx, "request hello");
    expect(&rx, "response welcome");
    expect_all(&rx, &["client established", "server established"]);
    cli.disconnect().unwrap();
    expect_all(&rx, &["server disconnected", "client disconnected"]);
    // Timers fire while the device thread sleeps: a silent peer ends in a timeout.
    let _lost = client(&f, addr(9, 7471), tx);
    expect(&rx, &format!("unreachable {:?}", Unreachable::Timeout));
    // A channel that never polls.
    let ch = EventChannel::new();
    ch.set_spin(Duration::ZERO);
    let id = f.create_id_on(PortSpace::Tcp, &ch);
    id.resolve_addr(None, addr(1, 7471)).unwrap();
    let e = ch
        .get_event(Some(T))
        .expect("an event on a non-polling channel");
    assert!(matches!(e.event(), Event::AddrResolved), "{:?}", e.event());
    drop(e);
    for id in [cli, srv, id] {
        assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
    }
    f.shutdown();
}

/// A channel's polling never outlasts the caller's timeout: with a 30 s poll time, an
/// empty channel asked to wait 20 ms answers "nothing" long before the poll would end.
#[test]
fn get_event_timeout_bounds_the_poll() {
    let ch = EventChannel::new();
    ch.set_spin(Duration::from_secs(30));
    let t = std::time::Instant::now();
    assert!(ch.get_event(Some(Duration::from_millis(20))).is_none());
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "get_event(20 ms) polled for {:?}",
        t.elapsed()
    );
    assert!(ch.get_event(Some(Duration::ZERO)).is_none());
}

/// The RDMA read resources of CONNECT_REQUEST and CONNECT_RESPONSE are given from the
/// receiver's side, as rdma_cm gives them (cm.c's `cm_format_req_event` and
/// `cm_format_rep_event` swap the wire's two fields): what the peer sent as its initiator
/// depth is what the receiver must have as responder resources, and the other way round.
/// Asymmetric values, so a missed swap shows.
#[test]
fn conn_params_are_given_from_the_receivers_side() {
    let f = fabric(24802);
    let ch = EventChannel::new();
    let srv = f.create_id_on(PortSpace::Tcp, &ch);
    srv.bind(addr(1, 7473)).unwrap();
    srv.listen(4).unwrap();
    let cli = f.create_id_on(PortSpace::Tcp, &ch);
    cli.resolve_addr(None, addr(1, 7473)).unwrap();
    let (mut request, mut response) = (None, None);
    while response.is_none() {
        let mut e = ch.get_event(Some(T)).expect("event");
        let id = e.id().clone();
        match e.take().unwrap() {
            Event::AddrResolved => id.resolve_route().unwrap(),
            Event::RouteResolved => id
                .connect(&ConnectOptions {
                    responder_resources: 3,
                    initiator_depth: 5,
                    ..ConnectOptions::default()
                })
                .unwrap(),
            Event::ConnectRequest { param, .. } => {
                request = Some(param);
                id.accept(&AcceptOptions {
                    responder_resources: 2,
                    initiator_depth: 4,
                    ..AcceptOptions::default()
                })
                .unwrap();
            }
            Event::ConnectResponse { param, .. } => response = Some(param),
            other => panic!("unexpected {other:?}"),
        }
    }
    let request = request.expect("CONNECT_REQUEST came first");
    let response = response.expect("CONNECT_RESPONSE");
    assert_eq!(
        (request.responder_resources, request.initiator_depth),
        (5, 3),
        "CONNECT_REQUEST: the client's initiator depth 5 and responder resources 3"
    );
    assert_eq!(
        (response.responder_resources, response.initiator_depth),
        (4, 2),
        "CONNECT_RESPONSE: the server's initiator depth 4 and responder resources 2"
    );
    cli.destroy().unwrap();
    srv.destroy().unwrap();
    f.shutdown();
}

/// `notify_established` (`rdma_notify` with `COMM_EST`): a passive id whose RTU has not come
/// is established by it, once; the RTU that follows changes nothing. Here the client holds
/// the RTU back (it does not call `establish` until after the notify).
#[test]
fn notify_established_stands_in_for_the_rtu() {
    let f = fabric(24803);
    let ch = EventChannel::new();
    let srv = f.create_id_on(PortSpace::Tcp, &ch);
    srv.bind(addr(1, 7474)).unwrap();
    srv.listen(4).unwrap();
    let cli = f.create_id_on(PortSpace::Tcp, &ch);
    cli.resolve_addr(None, addr(1, 7474)).unwrap();
    let mut child = None;
    let mut responded = false;
    while !(responded && child.is_some()) {
        let mut e = ch.get_event(Some(T)).expect("event");
        let id = e.id().clone();
        match e.take().unwrap() {
            Event::AddrResolved => id.resolve_route().unwrap(),
            Event::RouteResolved => id.connect(&ConnectOptions::default()).unwrap(),
            Event::ConnectRequest { .. } => {
                assert_eq!(
                    id.notify_established(),
                    Err(Error::InvalidState(State::Connect)),
                    "not accepted yet"
                );
                id.accept(&AcceptOptions::default()).unwrap();
                child = Some(id);
            }
            Event::ConnectResponse { .. } => responded = true,
            other => panic!("unexpected {other:?}"),
        }
    }
    let child = child.unwrap();
    assert_eq!(child.state(), State::Connect, "no RTU was sent");
    assert_eq!(
        cli.notify_established(),
        Err(Error::InvalidState(State::Connect)),
        "the active side sends the RTU instead"
    );
    child.notify_established().unwrap();
    let e = ch.get_event(Some(T)).expect("ESTABLISHED");
    assert_eq!(e.id(), &child);
    assert!(matches!(e.event(), Event::Established { .. }), "{e:?}");
    drop(e);
    assert_eq!(child.state(), State::Established);
    assert_eq!(
        child.notify_established(),
        Err(Error::InvalidState(State::Established))
    );
    // The RTU now: the client is established, the server sees no second ESTABLISHED.
    cli.establish().unwrap();
    let e = ch.get_event(Some(T)).expect("client ESTABLISHED");
    assert_eq!(e.id(), &cli);
    assert!(matches!(e.event(), Event::Established { .. }), "{e:?}");
    drop(e);
    assert!(
        ch.get_event(Some(Duration::from_millis(300))).is_none(),
        "nothing more"
    );
    // And the connection works: a disconnect reaches both sides.
    child.disconnect().unwrap();
    for _ in 0..2 {
        let e = ch.get_event(Some(T)).expect("DISCONNECTED");
        assert!(matches!(e.event(), Event::Disconnected), "{e:?}");
    }
    for id in [cli, child, srv] {
        assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
    }
    f.shutdown();
}

/// A fabric with one device, 127.0.0.1, on UDP port `port` (a raw peer takes 127.0.0.2).
fn one_device(port: u16) -> Fabric {
    let f = Fabric::new(FabricConfig {
        udp_port: port,
        ..FabricConfig::default()
    });
    f.add_device(IpAddr::from([127, 0, 0, 1])).unwrap();
    f
}

/// Two ids of one device talk without the kernel's UDP (`FabricConfig::loopback`, as rxe
/// loops back a packet to its own address): every datagram of a connect, establish and
/// disconnect goes straight to the device's engine. With it off they all go through the
/// socket, and the connection is the same.
#[test]
fn a_device_talking_to_itself_loops_back() {
    for (port, loopback) in [(24810, true), (24811, false)] {
        let f = Fabric::new(FabricConfig {
            udp_port: port,
            loopback,
            ..FabricConfig::default()
        });
        let dev = f.add_device(IpAddr::from([127, 0, 0, 1])).unwrap();
        let (srv, cli) = connect_and_disconnect(&f, 1);
        // REQ, REP, RTU, DREQ, DREP: each counted once sent and once received (the DREP
        // may still be on its way: the disconnecting side reports at once).
        let t0 = std::time::Instant::now();
        while dev.traffic().0 < dev.traffic().1 && t0.elapsed() < T {
            std::thread::sleep(Duration::from_millis(1));
        }
        let (received, sent) = dev.traffic();
        assert!(
            sent >= 5 && received >= 5,
            "{received} received, {sent} sent"
        );
        assert_eq!(received, sent, "loopback {loopback}: each received once");
        if loopback {
            // Nothing through the socket: every datagram sent was looped back.
            assert_eq!(dev.looped(), sent, "loopback {loopback}");
        } else {
            assert_eq!(dev.looped(), 0, "loopback {loopback}");
        }
        assert_eq!(dev.engine_stats().rx_malformed, 0);
        assert_eq!(cli.destroy(), Ok(DestroyOutcome::Done));
        assert_eq!(srv.destroy(), Ok(DestroyOutcome::Done));
        f.shutdown();
        assert_eq!(f.live_ids(), 0);
    }
}

/// A connection between two devices of one fabric is not looped back: it crosses UDP.
#[test]
fn two_devices_of_one_fabric_talk_through_udp() {
    let f = fabric(24812);
    let (tx, rx) = mpsc::channel();
    let srv = server(&f, 7471, false, tx.clone());
    let cli = client(&f, addr(1, 7471), tx);
    expect_all(&rx, &["client established", "server established"]);
    for last in [1, 2] {
        let d = f.device(IpAddr::from([127, 0, 0, last])).expect("device");
        assert_eq!(d.looped(), 0);
        assert!(d.traffic().1 > 0);
    }
    assert!(f.device(IpAddr::from([127, 0, 0, 3])).is_none());
    assert_eq!(cli.destroy(), Ok(DestroyOutcome::Done));
    assert_eq!(srv.destroy(), Ok(DestroyOutcome::Done));
    f.shutdown();
}

/// A device's UDP port held by another socket (another process's device, say) is a typed
/// `AddrInUse` naming the address and port, and nothing is left half-open: once the port is
/// free the same fabric opens the device. An address the host lacks is `AddrNotAvailable`.
#[test]
fn a_device_port_held_elsewhere_is_addr_in_use() {
    let at = addr(1, 24808);
    let holder = std::net::UdpSocket::bind(at).unwrap();
    let f = Fabric::new(FabricConfig {
        udp_port: at.port(),
        ..FabricConfig::default()
    });
    assert_eq!(f.add_device(at.ip()).err(), Some(Error::AddrInUse(at)));
    assert!(f.device_addrs().is_empty());
    drop(holder);
    f.add_device(at.ip()).unwrap();
    assert_eq!(f.device_addrs(), vec![at.ip()]);
    // An address this host does not have (nothing is sent: the bind fails).
    let absent = IpAddr::from([198, 18, 0, 77]);
    assert_eq!(
        f.add_device(absent).err(),
        Some(Error::AddrNotAvailable(absent))
    );
    assert_eq!(f.device_addrs(), vec![at.ip()]);
}

/// A device needs one unicast address: the wildcard (which a listener uses to take every
/// device), a multicast or the broadcast address is refused before any socket is opened,
/// for RoCEv2 and iWARP devices alike (a RoCEv2 device "on 0.0.0.0" took every address's
/// traffic and computed its ICRCs for source 0.0.0.0). So are an IPv4-mapped IPv6 address
/// (its socket sent IPv4 with an ICRC and an rdma_cm header for IPv6, which rxe drops; Linux
/// finds no device for one) and a link-local one (it needs an interface scope).
#[test]
fn a_device_address_must_be_unicast() {
    let f = Fabric::new(FabricConfig {
        udp_port: 24809,
        ..FabricConfig::default()
    });
    for ip in [
        "0.0.0.0",
        "::",
        "224.0.0.1",
        "ff02::1",
        "255.255.255.255",
        "::ffff:127.0.0.1",
        "::ffff:0.0.0.0",
        "fe80::1",
    ] {
        let ip: IpAddr = ip.parse().unwrap();
        for r in [f.add_device(ip), f.add_iwarp_device(ip)] {
            match r {
                Err(Error::InvalidArgument(why)) => {
                    assert!(why.contains("unicast address"), "{ip}: {why}");
                }
                other => panic!("{ip}: {:?}", other.map(|_| ())),
            }
        }
    }
    assert!(f.device_addrs().is_empty());
    f.add_device(IpAddr::from([127, 0, 0, 1])).unwrap();
}

/// A destination written as an IPv4-mapped IPv6 address does not resolve (ADDR_ERROR): no
/// IPv6 route leads there, and a REQ to it left as IPv4 with an ICRC and an rdma_cm header
/// for IPv6. The IPv4 address itself resolves.
#[test]
fn an_ipv4_mapped_destination_does_not_resolve() {
    let f = Fabric::new(FabricConfig {
        udp_port: 24823,
        ..FabricConfig::default()
    });
    f.add_device("::1".parse().unwrap()).unwrap();
    f.add_device(IpAddr::from([127, 0, 0, 1])).unwrap();
    let ch = EventChannel::new();
    let id = f.create_id_on(PortSpace::Tcp, &ch);
    let mapped: IpAddr = "::ffff:127.0.0.1".parse().unwrap();
    id.resolve_addr(None, SocketAddr::new(mapped, 7480))
        .unwrap();
    let e = ch.get_event(Some(T)).expect("an event");
    assert!(
        matches!(e.event(), Event::AddrError(Error::AddrNotAvailable(ip)) if *ip == mapped),
        "{e:?}"
    );
    drop(e);
    id.resolve_addr(None, addr(1, 7480)).unwrap();
    let e = ch.get_event(Some(T)).expect("an event");
    assert!(matches!(e.event(), Event::AddrResolved), "{e:?}");
    drop(e);
    f.shutdown();
}

/// Over IPv6 every received datagram's ICRC is checked, as rxe checks it: rxe sends IPv6
/// with a zero UDP checksum, which a device takes, so the ICRC is the only check. A REQ with
/// one byte changed after its ICRC was computed is dropped and counted; the same REQ intact
/// reaches the listener.
#[test]
fn an_ipv6_datagram_with_a_bad_icrc_is_dropped() {
    use rcm_wire::cm::{CmMad, CmMessage, Req, ReqPath};
    use rcm_wire::cma::{self, CmaHdr};
    use rcm_wire::roce::{emit_gsi, IpForIcrc};
    use std::net::Ipv6Addr;
    let f = Fabric::new(FabricConfig {
        udp_port: 24824,
        ..FabricConfig::default()
    });
    let me = Ipv6Addr::LOCALHOST;
    let d = f.add_device(IpAddr::V6(me)).unwrap();
    let ch = EventChannel::new();
    let l = f.create_id_on(PortSpace::Tcp, &ch);
    l.bind(SocketAddr::new(IpAddr::V6(me), 7481)).unwrap();
    l.listen(4).unwrap();
    let peer = std::net::UdpSocket::bind((me, 0)).unwrap();
    let sport = peer.local_addr().unwrap().port();
    let req = Req {
        primary_path: ReqPath {
            local_gid: rcm_wire::Gid::from_ip(IpAddr::V6(me)),
            remote_gid: rcm_wire::Gid::from_ip(IpAddr::V6(me)),
            ..raw_req(7481, IpAddr::from([127, 0, 0, 1]), 1).primary_path
        },
        private_data: CmaHdr {
            src_port: 40002,
            src: IpAddr::V6(me),
            dst: IpAddr::V6(me),
        }
        .with_user_data(b"", cma::limits::CONNECT)
        .unwrap(),
        ..raw_req(7481, IpAddr::from([127, 0, 0, 1]), 1)
    };
    let mad = CmMad::send(0x61, CmMessage::Req(req)).emit().unwrap();
    let good = emit_gsi(&IpForIcrc::V6 { src: me, dst: me }, sport, 0, &mad);
    let mut bad = good.clone();
    bad[100] ^= 0x01;
    peer.send_to(&bad, (me, 24824)).unwrap();
    assert!(
        ch.get_event(Some(Duration::from_millis(300))).is_none(),
        "a REQ whose ICRC does not match was taken"
    );
    assert_eq!(d.icrc_drops(), 1);
    peer.send_to(&good, (me, 24824)).unwrap();
    let e = ch
        .get_event(Some(T))
        .expect("the intact REQ's CONNECT_REQUEST");
    assert!(matches!(e.event(), Event::ConnectRequest { .. }), "{e:?}");
    drop(e);
    assert_eq!(d.icrc_drops(), 1);
    f.shutdown();
}

/// PSNs and RDMA read resources as the wire and Linux have them, checked against a raw peer
/// on 127.0.0.2 that plays the other side. A REQ's or REP's starting PSN is the PSN its
/// sender receives from (cm.c keeps it as the sender's rq_psn and the receiver's sq_psn), so
/// RTR's `rq_psn` is the PSN this side announced and RTS's `sq_psn` the one the peer
/// announced. On the passive side both are known before `accept` (librdmacm's rdma_accept
/// moves the QP to RTR and RTS first), and RTR/RTS carry the read resources the REP
/// announced.
#[test]
fn psns_and_read_resources_follow_the_wire() {
    use rcm_wire::cm::{CmMessage, Rep};
    let f = one_device(24804);
    let peer = RawPeer::new(24804);

    // Passive: the raw peer's REQ announces PSN 0x123456 and asks for 16/16.
    let ch = EventChannel::new();
    let l = f.create_id_on(PortSpace::Tcp, &ch);
    l.bind(addr(1, 7475)).unwrap();
    l.listen(4).unwrap();
    peer.send(
        CmMessage::Req(raw_req(7475, IpAddr::from([127, 0, 0, 1]), 0x12_3456)),
        0x5151,
    );
    let e = ch.get_event(Some(T)).expect("CONNECT_REQUEST");
    assert!(matches!(e.event(), Event::ConnectRequest { .. }), "{e:?}");
    let child = e.id().clone();
    drop(e);
    let rts = child.init_qp_attr(QpState::Rts).unwrap();
    assert_eq!(
        rts.sq_psn, 0x12_3456,
        "sends from the REQ's PSN, before accept"
    );
    let announced = child.init_qp_attr(QpState::Rtr).unwrap().rq_psn;
    child
        .accept(&AcceptOptions {
            responder_resources: 2,
            initiator_depth: 3,
            ..AcceptOptions::default()
        })
        .unwrap();
    let CmMessage::Rep(rep) = peer.recv() else {
        panic!("expected a REP")
    };
    assert_eq!(
        rep.starting_psn, announced,
        "the REP announces the RTR's PSN"
    );
    assert_eq!((rep.responder_resources, rep.initiator_depth), (2, 3));
    let rtr = child.init_qp_attr(QpState::Rtr).unwrap();
    let rts = child.init_qp_attr(QpState::Rts).unwrap();
    assert_eq!((rtr.rq_psn, rts.sq_psn), (announced, 0x12_3456));
    assert_eq!(
        (rtr.max_dest_rd_atomic, rts.max_rd_atomic),
        (2, 3),
        "what the REP announced, not the REQ's 16/16"
    );

    // Active: our REQ announces a PSN, the raw peer's REP announces 0x654321.
    let c = routed(&f, &ch, addr(2, 7476));
    c.connect(&ConnectOptions::default()).unwrap();
    let req = peer.recv_req();
    peer.send(
        CmMessage::Rep(Rep {
            responder_resources: 1,
            initiator_depth: 1,
            ..raw_rep(req.local_comm_id)
        }),
        0x6161,
    );
    loop {
        let e = ch.get_event(Some(T)).expect("CONNECT_RESPONSE");
        if e.id() == &c {
            assert!(matches!(e.event(), Event::ConnectResponse { .. }), "{e:?}");
            break;
        }
    }
    let rtr = c.init_qp_attr(QpState::Rtr).unwrap();
    let rts = c.init_qp_attr(QpState::Rts).unwrap();
    assert_eq!(
        rtr.rq_psn, req.starting_psn,
        "receives from the PSN its REQ announced"
    );
    assert_eq!(rts.sq_psn, 0x65_4321, "sends from the REP's PSN");
    f.shutdown();
}

/// A CM MAD of another partition than the default one (the BTH's P_Key) is dropped, as
/// rxe's `check_keys` drops it for QP1 too: no REP answers it. Limited membership of the
/// default partition (0x7FFF) is the default partition.
#[test]
fn a_mad_of_another_partition_is_not_answered() {
    use rcm_wire::roce::{emit_gsi, IpForIcrc};
    let f = one_device(24821);
    let peer = RawPeer::new(24821);
    let ch = EventChannel::new();
    let l = f.create_id_on(PortSpace::Tcp, &ch);
    l.bind(addr(1, 7478)).unwrap();
    l.listen(4).unwrap();
    let ip = IpForIcrc::v4(
        std::net::Ipv4Addr::new(127, 0, 0, 2),
        std::net::Ipv4Addr::LOCALHOST,
    );
    let send = |pkey: u16, comm_id: u32| {
        let req = rcm_wire::cm::Req {
            local_comm_id: comm_id,
            ..raw_req(7478, IpAddr::from([127, 0, 0, 1]), 1)
        };
        let mad = rcm_wire::cm::CmMad::send(u64::from(comm_id), rcm_wire::cm::CmMessage::Req(req))
            .emit()
            .expect("encodes");
        let mut udp = emit_gsi(&ip, 24821, 0, &mad);
        udp[2..4].copy_from_slice(&pkey.to_be_bytes());
        peer.sock.send_to(&udp, ("127.0.0.1", 24821)).unwrap();
    };
    send(0x1234, 1);
    send(0x8000, 2);
    assert!(
        ch.get_event(Some(Duration::from_millis(300))).is_none(),
        "a REQ of another partition was taken"
    );
    send(0x7FFF, 3);
    let e = ch.get_event(Some(T)).expect("CONNECT_REQUEST");
    assert!(matches!(e.event(), Event::ConnectRequest { .. }), "{e:?}");
    drop(e);
    f.shutdown();
}

/// A peer that sends a REQ and then withdraws it (REJ with reason Timeout, what an active
/// side's destroy in REQ_SENT sends) frees the engine's backlog place, but the child and its
/// CONNECT_REQUEST stay for the application: repeated, that piled up children without
/// bound behind a listener nobody reads. The backlog counts requests not delivered, as
/// ucma's does: past it a REQ is dropped unanswered (the peer's retry may find room), and
/// once the application takes the requests new ones come in again.
#[test]
fn withdrawn_requests_do_not_pile_up_behind_an_unread_listener() {
    use rcm_wire::cm::{CmMessage, Rej, RejReason};
    let f = one_device(24822);
    let peer = RawPeer::new(24822);
    let ch = EventChannel::new();
    let l = f.create_id_on(PortSpace::Tcp, &ch);
    l.bind(addr(1, 7479)).unwrap();
    l.listen(4).unwrap();
    let (base, ceps) = (f.live_ids(), f.engine_ceps());
    let dst = IpAddr::from([127, 0, 0, 1]);
    let withdraw = |comm_id: u32| {
        let req = rcm_wire::cm::Req {
            local_comm_id: comm_id,
            ..raw_req(7479, dst, 1)
        };
        let guid = req.local_ca_guid;
        peer.send(CmMessage::Req(req), u64::from(comm_id));
        peer.send(
            CmMessage::Rej(Rej {
                local_comm_id: comm_id,
                reason: RejReason::Timeout,
                reject_info_length: 8,
                ari: guid.to_be_bytes().to_vec(),
                ..Rej::default()
            }),
            u64::from(comm_id),
        );
    };
    for i in 1..=40 {
        withdraw(0x1000 + i);
    }
    // The device takes datagrams in order: the DREP to a DREQ for no connection (answered
    // without state) means every pair before it was handled, and nothing came before it:
    // a request past the backlog is dropped unanswered (the peer may send it again).
    peer.send(
        CmMessage::Dreq(rcm_wire::cm::Dreq {
            local_comm_id: 0x9999,
            remote_comm_id: 0x7654_3210,
            ..rcm_wire::cm::Dreq::default()
        }),
        0x9999,
    );
    let first = peer.recv();
    assert!(
        matches!(first, CmMessage::Drep(_)),
        "the first answer is the DREP: {first:?}"
    );
    // The engine answered; its events may still be on their way to the ids.
    let t0 = std::time::Instant::now();
    while f.live_ids() - base < 4 && t0.elapsed() < T {
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        f.live_ids() - base,
        4,
        "children held for requests not delivered: the backlog's 4"
    );
    assert!(
        f.engine_ceps() - ceps <= 4,
        "engine endpoints held past the backlog: {}",
        f.engine_ceps() - ceps
    );
    // The application reads: each request taken frees its place (the child then goes).
    let mut taken = 0;
    while let Some(mut e) = ch.get_event(Some(Duration::from_millis(200))) {
        if let Some(Event::ConnectRequest { .. }) = e.take() {
            taken += 1;
            drop(e.id().destroy());
        }
    }
    assert_eq!(taken, 4, "the four requests in the backlog were delivered");
    let req = rcm_wire::cm::Req {
        local_comm_id: 0x2000,
        ..raw_req(7479, dst, 1)
    };
    peer.send(CmMessage::Req(req), 0x2000);
    let e = ch.get_event(Some(T)).expect("a new request gets in");
    assert!(matches!(e.event(), Event::ConnectRequest { .. }), "{e:?}");
    drop(e);
    f.shutdown();
}

/// A wildcard UD listener's backlog counts SIDR requests not delivered over all its devices
/// (each device's engine counts only its own): with the backlog filled at one device, a
/// request at the other reaches the listener and is answered REJECT there, as cm.c answers
/// a SIDR request its consumer refused, rather than dropped unanswered like a REQ.
#[test]
fn a_sidr_request_past_a_wildcard_listeners_backlog_is_rejected() {
    use rcm_wire::cm::{CmMessage, SidrStatus};
    let f = one_device(24825);
    let second = IpAddr::from([127, 0, 0, 3]);
    f.add_device(second).unwrap();
    let peer = RawPeer::new(24825);
    let ch = EventChannel::new();
    let l = f.create_id_on(PortSpace::Udp, &ch);
    l.bind(SocketAddr::new(IpAddr::from([0, 0, 0, 0]), 7482))
        .unwrap();
    l.listen(2).unwrap();
    let base = f.live_ids();
    for i in 0..2 {
        peer.send(
            CmMessage::SidrReq(raw_sidr_req(PortSpace::Udp, 7482, 0x100 + i)),
            0x100 + u64::from(i),
        );
    }
    let t0 = std::time::Instant::now();
    while f.live_ids() - base < 2 && t0.elapsed() < T {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(f.live_ids() - base, 2, "two children wait in the backlog");
    let sidr = raw_sidr_req_to(second, PortSpace::Udp, 7482, 0x200);
    peer.send_to(
        std::net::Ipv4Addr::new(127, 0, 0, 3),
        CmMessage::SidrReq(sidr),
        0x200,
    );
    match peer.recv() {
        CmMessage::SidrRep(rep) => assert_eq!(
            (rep.request_id, rep.status),
            (0x200, SidrStatus::Rejected),
            "the request past the backlog is answered REJECT"
        ),
        other => panic!("expected a SIDR_REP, got {other:?}"),
    }
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        f.live_ids() - base,
        2,
        "no child kept for the refused request"
    );
    let mut taken = 0;
    while let Some(mut e) = ch.get_event(Some(Duration::from_millis(200))) {
        if let Some(Event::ConnectRequest { .. }) = e.take() {
            taken += 1;
            drop(e.id().destroy());
        }
    }
    assert_eq!(taken, 2, "the two requests in the backlog were delivered");
    f.shutdown();
}

/// `destroy_qp` leaves the id without a QP, as Linux's `rdma_destroy_qp` sets `id->qp` to
/// NULL: a REP that comes after it is reported as CONNECT_RESPONSE and no RTU goes until
/// `establish` (the QP's connect would have had the engine send it at once; Linux's
/// `cma_rep_recv` runs only for an id with a QP), and a new QP may be attached. Destroyed
/// before the connect, the REQ goes out with a fresh QPN, not refused.
#[test]
fn a_destroyed_qp_leaves_the_id_without_one() {
    use rcm_wire::cm::CmMessage;
    let f = one_device(24826);
    let peer = RawPeer::new(24826);
    let ch = EventChannel::new();
    let c = routed(&f, &ch, addr(2, 7483));
    let qpn = c.create_qp().unwrap();
    c.connect(&ConnectOptions::default()).unwrap();
    let req = peer.recv_req();
    assert_eq!(req.local_qpn, qpn, "the REQ announces the QP's number");
    c.destroy_qp().unwrap();
    peer.send(CmMessage::Rep(raw_rep(req.local_comm_id)), 0x7171);
    let e = ch.get_event(Some(T)).expect("CONNECT_RESPONSE");
    assert!(matches!(e.event(), Event::ConnectResponse { .. }), "{e:?}");
    drop(e);
    peer.sock
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let mut buf = [0u8; 4096];
    assert!(
        peer.sock.recv_from(&mut buf).is_err(),
        "nothing (no RTU) before establish"
    );
    peer.sock.set_read_timeout(Some(T)).unwrap();
    c.establish().unwrap();
    assert!(matches!(peer.recv(), CmMessage::Rtu(_)));
    let e = ch.get_event(Some(T)).expect("ESTABLISHED");
    assert!(matches!(e.event(), Event::Established { .. }), "{e:?}");
    drop(e);
    let again = c.create_qp().expect("a new QP may be attached");
    assert_ne!(again, qpn);
    drop(c.destroy());

    let c = routed(&f, &ch, addr(2, 7483));
    let qpn = c.create_qp().unwrap();
    c.destroy_qp().unwrap();
    assert!(
        matches!(c.destroy_qp(), Err(rcm::Error::QpBusy(_))),
        "no QP left to destroy"
    );
    c.connect(&ConnectOptions::default())
        .expect("a connect without a QP");
    let req = peer.recv_req();
    assert_ne!(req.local_qpn, qpn, "not the destroyed QP's number");
    peer.send(
        CmMessage::Rep(rcm_wire::cm::Rep {
            local_comm_id: 0xBEF0,
            ..raw_rep(req.local_comm_id)
        }),
        0x7172,
    );
    let e = ch.get_event(Some(T)).expect("CONNECT_RESPONSE");
    assert!(matches!(e.event(), Event::ConnectResponse { .. }), "{e:?}");
    drop(e);
    drop(c.destroy());
    f.shutdown();
}

/// Every QP number the fabric hands out is held while an id may go by it and comes back
/// when the id goes: a connect or accept without a QP holds the number it announced, a QP
/// its own, and a QP destroyed while its connection goes by its number passes it to the id
/// (one destroyed before any connect gives it back at once). A counter alone handed a
/// number out again after 16.7 million QPs, live or not (see `qpns.rs`'s unit tests for
/// the wrap).
#[test]
fn qp_numbers_are_held_while_used_and_come_back() {
    let f = fabric(24827);
    let accepted = Arc::new(AtomicUsize::new(0));
    let a = accepted.clone();
    let l = f.create_id(PortSpace::Tcp, move |id, ev| match ev {
        Event::ConnectRequest { .. } => {
            // Every other child with a QP of its own.
            if a.fetch_add(1, Ordering::SeqCst) % 2 == 1 {
                id.create_qp().unwrap();
            }
            id.accept(&AcceptOptions::default()).unwrap();
            Flow::Continue
        }
        Event::Disconnected => Flow::Destroy,
        _ => Flow::Continue,
    });
    l.bind(addr(1, 7484)).unwrap();
    l.listen(16).unwrap();
    assert_eq!(f.qpns_in_use(), 0);
    let ch = EventChannel::new();
    let mut ids = Vec::new();
    for i in 0..8 {
        let c = raw_peer::routed(&f, &ch, addr(1, 7484));
        if i % 4 != 0 {
            c.create_qp().unwrap();
        }
        if i % 4 == 2 {
            c.destroy_qp().unwrap();
        }
        c.connect(&ConnectOptions::default()).unwrap();
        loop {
            let mut e = ch.get_event(Some(T)).expect("an event");
            match e.take() {
                Some(Event::ConnectResponse { .. }) => c.establish().unwrap(),
                Some(Event::Established { .. }) => break,
                other => panic!("connection {i}: {other:?}"),
            }
        }
        if i % 4 == 3 {
            c.destroy_qp().unwrap();
        }
        ids.push(c);
    }
    assert!(eventually_true(|| accepted.load(Ordering::SeqCst) == 8));
    assert_eq!(
        f.qpns_in_use(),
        16,
        "one number each end of each connection"
    );
    for c in &ids {
        c.disconnect().unwrap();
        let mut e = ch.get_event(Some(T)).expect("DISCONNECTED");
        assert!(matches!(e.take(), Some(Event::Disconnected)));
    }
    for c in ids {
        assert_eq!(c.destroy(), Ok(DestroyOutcome::Done));
    }
    // The children go on their DISCONNECTED.
    assert!(
        eventually_true(|| f.live_ids() == 1),
        "ids left: {}",
        f.live_ids()
    );
    assert_eq!(f.qpns_in_use(), 0, "every number came back");
    l.destroy().unwrap();
    f.shutdown();
}

/// Whether `cond` holds within the test's timeout.
fn eventually_true(mut cond: impl FnMut() -> bool) -> bool {
    let end = std::time::Instant::now() + T;
    while !cond() {
        if std::time::Instant::now() > end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    true
}

/// The QP's ACK timeout on the active side follows the REP's target ACK delay (Linux's
/// cm_rep_handler recomputes it, and RTS takes it): a peer with ACK delay 20 makes it 21,
/// where the REQ announced 19 from our own delay.
#[test]
fn the_rts_timeout_follows_the_peers_ack_delay() {
    use rcm_wire::cm::{CmMessage, Rep};
    let f = one_device(24806);
    let peer = RawPeer::new(24806);
    let ch = EventChannel::new();
    let c = routed(&f, &ch, addr(2, 7478));
    c.connect(&ConnectOptions::default()).unwrap();
    let CmMessage::Req(req) = peer.recv() else {
        panic!("expected a REQ")
    };
    assert_eq!(req.primary_path.local_ack_timeout, 19);
    peer.send(
        CmMessage::Rep(Rep {
            target_ack_delay: 20,
            ..raw_rep(req.local_comm_id)
        }),
        0x6262,
    );
    let e = ch.get_event(Some(T)).expect("CONNECT_RESPONSE");
    assert!(matches!(e.event(), Event::ConnectResponse { .. }), "{e:?}");
    drop(e);
    assert_eq!(c.init_qp_attr(QpState::Rts).unwrap().timeout, 21);
    f.shutdown();
}

/// Requests rdma_cm turns away before any listener sees them: a REQ whose rdma_cm header
/// names another host than the device it reached (cma.c validate_net_dev) is rejected,
/// even by a wildcard listener, whose child took that foreign address as its own; and a
/// SIDR_REQ for a TCP-port-space listener (cma_ib_check_req_qp_type) gets a rejecting
/// SIDR_REP, where the child could neither accept nor reject it. No CONNECT_REQUEST either
/// way; a proper REQ after them still gets through.
#[test]
fn requests_for_another_host_or_the_wrong_qp_type_are_turned_away() {
    use rcm_wire::cm::{CmMessage, SidrStatus};
    let f = one_device(24805);
    let peer = RawPeer::new(24805);
    let ch = EventChannel::new();
    let l = f.create_id_on(PortSpace::Tcp, &ch);
    l.bind(SocketAddr::new(IpAddr::from([0, 0, 0, 0]), 7477))
        .unwrap();
    l.listen(4).unwrap();

    peer.send(
        CmMessage::Req(raw_req(7477, IpAddr::from([127, 0, 0, 9]), 1)),
        0x71,
    );
    assert!(
        matches!(peer.recv(), CmMessage::Rej(_)),
        "a REQ for 127.0.0.9 is rejected"
    );
    let sidr = raw_sidr_req(PortSpace::Tcp, 7477, 0x4242);
    peer.send(CmMessage::SidrReq(sidr), 0x72);
    match peer.recv() {
        CmMessage::SidrRep(rep) => assert_ne!(rep.status, SidrStatus::Success),
        other => panic!("expected a SIDR_REP, got {other:?}"),
    }
    assert!(
        ch.get_event(Some(Duration::from_millis(200))).is_none(),
        "no CONNECT_REQUEST for either"
    );
    peer.send(
        CmMessage::Req(raw_req(7477, IpAddr::from([127, 0, 0, 1]), 1)),
        0x73,
    );
    let e = ch
        .get_event(Some(T))
        .expect("the proper REQ's CONNECT_REQUEST");
    assert!(matches!(e.event(), Event::ConnectRequest { .. }), "{e:?}");
    assert_eq!(
        e.id().local_addr(),
        Some(addr(1, 7477)),
        "the child's address is the device's"
    );
    drop(e);
    f.shutdown();
}

/// [`raw_peer::chaos`] at a device in this process.
#[test]
fn a_peer_sending_cm_messages_in_any_order_breaks_no_id() {
    let f = one_device(24807);
    let peer = RawPeer::new(24807);
    raw_peer::chaos(&f, &peer, 0x2545_F491_4F6C_DD1D, 160);
    f.shutdown();
}

/// A disconnect the peer never answers (Linux's `cm_dreq_handler` side gone silent): the DREQ
/// is retried, then the id reports DISCONNECTED once, as rdma_cm does when its DREQ times
/// out (`IB_CM_DREQ_ERROR`), and TIMEWAIT_EXIT after; nothing else, and no DREQ after the
/// give-up.
#[test]
fn a_dreq_the_peer_never_answers_ends_in_one_disconnected() {
    use rcm_wire::cm::CmMessage;
    let f = Fabric::new(FabricConfig {
        udp_port: 24818,
        retry: RetryPolicy::Backoff {
            initial: Duration::from_millis(50),
            max_wait: Duration::from_millis(200),
            deadline: Duration::from_secs(1),
        },
        min_timewait: Duration::ZERO,
        ..FabricConfig::default()
    });
    f.add_device(IpAddr::from([127, 0, 0, 1])).unwrap();
    let peer = RawPeer::new(24818);
    let ch = EventChannel::new();
    let c = routed(&f, &ch, addr(2, 7478));
    c.connect(&ConnectOptions::default()).unwrap();
    let req = peer.recv_req();
    peer.send(CmMessage::Rep(raw_rep(req.local_comm_id)), 0x7171);
    let e = ch.get_event(Some(T)).expect("CONNECT_RESPONSE");
    assert!(matches!(e.event(), Event::ConnectResponse { .. }), "{e:?}");
    drop(e);
    c.establish().unwrap();
    assert!(matches!(peer.recv(), CmMessage::Rtu(_)));
    let e = ch.get_event(Some(T)).expect("ESTABLISHED");
    assert!(matches!(e.event(), Event::Established { .. }), "{e:?}");
    drop(e);

    c.disconnect().unwrap();
    let e = ch
        .get_event(Some(T))
        .expect("DISCONNECTED after the DREQ's retries");
    assert!(matches!(e.event(), Event::Disconnected), "{e:?}");
    drop(e);
    // What came until then: DREQs only, more than one (retried), for this connection.
    peer.sock.set_nonblocking(true).unwrap();
    let drain = || {
        let mut dreqs = 0;
        let mut buf = [0u8; 4096];
        while let Ok((n, _)) = peer.sock.recv_from(&mut buf) {
            let d = rcm_wire::roce::GsiDatagram::parse(&buf[..n]).expect("a GSI datagram");
            match rcm_wire::cm::CmMad::parse(d.mad).expect("a CM MAD").msg {
                CmMessage::Dreq(q) => {
                    assert_eq!(
                        (q.local_comm_id, q.remote_comm_id),
                        (req.local_comm_id, 0xBEEF)
                    );
                    dreqs += 1;
                }
                m => panic!("unexpected {}", m.name()),
            }
        }
        dreqs
    };
    let dreqs = drain();
    assert!(dreqs > 1, "the DREQ was retried ({dreqs} sent)");
    let e = ch.get_event(Some(T)).expect("TIMEWAIT_EXIT");
    assert!(matches!(e.event(), Event::TimewaitExit), "{e:?}");
    drop(e);
    assert!(
        ch.get_event(Some(Duration::from_millis(300))).is_none(),
        "one DISCONNECTED, one TIMEWAIT_EXIT"
    );
    assert_eq!(drain(), 0, "a DREQ after the give-up");
    assert_eq!(c.state(), State::Disconnect);
    f.shutdown();
}

/// `r` is the refusal of `len` bytes of private data where `max` fit.
fn too_long(r: rcm::Result<()>, len: usize, max: usize) {
    match r {
        Err(Error::PrivateDataTooLong { len: l, max: m }) => assert_eq!((l, m), (len, max)),
        r => panic!("{len} bytes where {max} fit: {r:?}"),
    }
}

/// The next event of a channel, with its id.
fn next(ch: &EventChannel) -> (CmId, Event) {
    let mut e = ch.get_event(Some(T)).expect("an event");
    let id = e.id().clone();
    (id, e.take().expect("the event"))
}

/// rdma_cm's private-data limits on RoCE (an RC port space): connect 56 bytes (the REQ's
/// 92 less the 36-byte cma header), accept 196 (the REP's), reject 148 (the REJ's). One byte
/// more is `PrivateDataTooLong` naming both numbers, and the refused call changes nothing:
/// the id connects, accepts or rejects with the largest allowed next, and every byte of it
/// reaches the peer.
#[test]
fn private_data_limits_are_rdma_cms_and_a_refused_call_changes_nothing() {
    let f = fabric(24819);
    let pattern = |n: usize, k: u8| {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(7) ^ k)
            .collect::<Vec<u8>>()
    };
    let (sch, cch) = (EventChannel::new(), EventChannel::new());
    let l = f.create_id_on(PortSpace::Tcp, &sch);
    l.bind(addr(1, 7479)).unwrap();
    l.listen(4).unwrap();

    // Accepted, at the limits.
    let c = routed(&f, &cch, addr(1, 7479));
    too_long(
        c.connect(&ConnectOptions {
            private_data: vec![1; 57],
            ..ConnectOptions::default()
        }),
        57,
        56,
    );
    assert_eq!(
        c.state(),
        State::RouteResolved,
        "the refused connect changed the id"
    );
    let req_pd = pattern(56, 0x11);
    c.connect(&ConnectOptions {
        private_data: req_pd.clone(),
        ..ConnectOptions::default()
    })
    .unwrap();
    let (child, ev) = next(&sch);
    let Event::ConnectRequest { private_data, .. } = ev else {
        panic!("{ev:?}")
    };
    assert_eq!(private_data, req_pd, "all 56 bytes of the REQ's");
    too_long(
        child.accept(&AcceptOptions {
            private_data: vec![2; 197],
            ..AcceptOptions::default()
        }),
        197,
        196,
    );
    too_long(child.reject(&[3; 149]), 149, 148);
    assert_eq!(
        child.state(),
        State::Connect,
        "the refused calls changed the child"
    );
    let rep_pd = pattern(196, 0x22);
    child
        .accept(&AcceptOptions {
            private_data: rep_pd.clone(),
            ..AcceptOptions::default()
        })
        .unwrap();
    let (_, ev) = next(&cch);
    let Event::ConnectResponse { private_data, .. } = ev else {
        panic!("{ev:?}")
    };
    assert_eq!(private_data, rep_pd, "all 196 bytes of the REP's");
    c.establish().unwrap();
    let (id, ev) = next(&cch);
    assert!(id == c && matches!(ev, Event::Established { .. }), "{ev:?}");

    // Rejected, at the limit.
    let c2 = routed(&f, &cch, addr(1, 7479));
    c2.connect(&ConnectOptions::default()).unwrap();
    let child2 = loop {
        let (id, ev) = next(&sch);
        if matches!(ev, Event::ConnectRequest { .. }) {
            break id;
        }
    };
    let rej_pd = pattern(148, 0x33);
    child2.reject(&rej_pd).unwrap();
    let ev = loop {
        let (id, ev) = next(&cch);
        if id == c2 {
            break ev;
        }
    };
    let Event::Rejected {
        reason,
        private_data,
    } = ev
    else {
        panic!("{ev:?}")
    };
    assert_eq!(reason, RejReason::ConsumerDefined);
    assert_eq!(private_data, rej_pd, "all 148 bytes of the REJ's");
    f.shutdown();
}

/// The same on UD (SIDR): connect 180 bytes (the SIDR_REQ's 216 less the cma header), accept
/// and reject 136 (the SIDR_REP's). A rejected SIDR request reaches the client as
/// UNREACHABLE with the SIDR status (2, rejected) and the SIDR_REP's private data, as Linux's
/// `cma_sidr_rep_handler` reports every SIDR_REP whose status is not success (never as
/// REJECTED).
#[test]
fn ud_private_data_limits_and_a_rejected_sidr_request() {
    let f = fabric(24820);
    let pattern = |n: usize, k: u8| {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(13) ^ k)
            .collect::<Vec<u8>>()
    };
    let (sch, cch) = (EventChannel::new(), EventChannel::new());
    let l = f.create_id_on(PortSpace::Udp, &sch);
    l.bind(addr(1, 7480)).unwrap();
    l.listen(4).unwrap();
    let ud_routed = || {
        let c = f.create_id_on(PortSpace::Udp, &cch);
        c.resolve_addr(None, addr(1, 7480)).unwrap();
        assert!(matches!(next(&cch).1, Event::AddrResolved));
        c.resolve_route().unwrap();
        assert!(matches!(next(&cch).1, Event::RouteResolved));
        c
    };

    let c = ud_routed();
    too_long(
        c.connect(&ConnectOptions {
            private_data: vec![1; 181],
            ..ConnectOptions::default()
        }),
        181,
        180,
    );
    assert_eq!(c.state(), State::RouteResolved);
    let req_pd = pattern(180, 0x44);
    c.connect(&ConnectOptions {
        private_data: req_pd.clone(),
        ..ConnectOptions::default()
    })
    .unwrap();
    let (child, ev) = next(&sch);
    let Event::ConnectRequest {
        private_data, ud, ..
    } = ev
    else {
        panic!("{ev:?}")
    };
    assert!(ud);
    assert_eq!(private_data, req_pd, "all 180 bytes of the SIDR_REQ's");
    too_long(
        child.accept(&AcceptOptions {
            private_data: vec![2; 137],
            ..AcceptOptions::default()
        }),
        137,
        136,
    );
    too_long(child.reject(&[3; 137]), 137, 136);
    let rep_pd = pattern(136, 0x55);
    child
        .accept(&AcceptOptions {
            private_data: rep_pd.clone(),
            ..AcceptOptions::default()
        })
        .unwrap();
    let (id, ev) = next(&cch);
    assert!(id == c);
    let Event::Established {
        ud: Some(_),
        private_data,
    } = ev
    else {
        panic!("{ev:?}")
    };
    assert_eq!(private_data, rep_pd, "all 136 bytes of the SIDR_REP's");

    let c2 = ud_routed();
    c2.connect(&ConnectOptions::default()).unwrap();
    let (child2, ev) = next(&sch);
    assert!(
        matches!(ev, Event::ConnectRequest { ud: true, .. }),
        "{ev:?}"
    );
    let rej_pd = pattern(136, 0x66);
    child2.reject(&rej_pd).unwrap();
    let (id, ev) = next(&cch);
    assert!(id == c2);
    let Event::Unreachable(Unreachable::Sidr {
        status,
        private_data,
    }) = ev
    else {
        panic!("{ev:?}")
    };
    assert_eq!(status, rcm_wire::cm::SidrStatus::Rejected);
    assert_eq!(private_data, rej_pd, "all 136 bytes of the SIDR_REP's");
    assert_eq!(c2.state(), State::Disconnect);
    f.shutdown();
}
