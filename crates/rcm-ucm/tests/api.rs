//! The rcm API through the daemon: the same calls and events as in-process, with the ids in
//! the daemon.

use rcm::{
    AcceptOptions, AccessFlags, ConnectOptions, DestroyOutcome, Event, EventChannel, Fabric,
    FabricConfig, Flow, PortSpace, QpAttrMask, State,
};
use rcm_proto::ib::RetryPolicy;
use rcm_ucm::{Daemon, DaemonConfig};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(10);

fn sock(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("rcm-ucm-api-{}-{name}.sock", std::process::id()))
}

fn ip(last: u8) -> IpAddr {
    IpAddr::from([127, 0, 0, last])
}

fn daemon(name: &str, port: u16, binds: &[u8]) -> Daemon {
    let mut cfg = DaemonConfig::new(sock(name), binds.iter().map(|b| ip(*b)).collect());
    cfg.fabric = FabricConfig {
        udp_port: port,
        retry: RetryPolicy::Backoff {
            initial: Duration::from_millis(50),
            max_wait: Duration::from_millis(200),
            deadline: Duration::from_secs(1),
        },
        dispatcher_threads: 4,
        ..FabricConfig::default()
    };
    Daemon::start(cfg).expect("daemon starts")
}

fn next(ch: &EventChannel) -> rcm::ChannelEvent {
    ch.get_event(Some(T)).expect("an event within 10 s")
}

/// Listener on `addr` in one session, returns (listener, channel).
fn listen(f: &Fabric, addr: SocketAddr) -> (rcm::CmId, EventChannel) {
    let ch = EventChannel::new();
    let l = f.try_create_id_on(PortSpace::Tcp, &ch).expect("create");
    l.bind(addr).expect("bind");
    l.listen(16).expect("listen");
    (l, ch)
}

/// Active side up to a sent REQ.
fn dial(f: &Fabric, ch: &EventChannel, dst: SocketAddr, pd: &[u8]) -> rcm::CmId {
    let c = f.try_create_id_on(PortSpace::Tcp, ch).expect("create");
    c.resolve_addr(None, dst).expect("resolve_addr");
    assert!(matches!(next(ch).event(), Event::AddrResolved));
    c.resolve_route().expect("resolve_route");
    assert!(matches!(next(ch).event(), Event::RouteResolved));
    c.connect(&ConnectOptions {
        private_data: pd.to_vec(),
        ..ConnectOptions::default()
    })
    .expect("connect");
    c
}

#[test]
fn connect_accept_disconnect_between_two_clients() {
    let d = daemon("basic", 47101, &[1, 2]);
    let server = rcm_ucm::fabric(d.socket()).expect("server session");
    let client = rcm_ucm::fabric(d.socket()).expect("client session");
    assert!(server.is_remote());
    let mut devs = client.device_addrs();
    devs.sort();
    assert_eq!(devs, vec![ip(1), ip(2)]);
    assert!(
        client.add_device(ip(3)).is_err(),
        "a daemon fabric has no local devices"
    );

    let (l, sch) = listen(&server, SocketAddr::new(ip(1), 7000));
    assert_eq!(l.state(), State::Listen);
    assert_eq!(l.local_addr(), Some(SocketAddr::new(ip(1), 7000)));
    let cch = EventChannel::new();
    let c = dial(&client, &cch, SocketAddr::new(ip(1), 7000), b"hello");
    assert_eq!(c.state(), State::Connect);

    let mut req = next(&sch);
    let child = req.id().clone();
    let Some(Event::ConnectRequest {
        listener,
        private_data,
        ..
    }) = req.take()
    else {
        panic!("expected a connect request, got {req:?}")
    };
    drop(req);
    assert_eq!(listener, l);
    assert_eq!(&private_data[..5], b"hello");
    assert_eq!(child.state(), State::Connect);
    assert_eq!(child.peer_addr(), c.local_addr());
    child
        .accept(&AcceptOptions {
            private_data: b"welcome".to_vec(),
            ..AcceptOptions::default()
        })
        .expect("accept");

    let mut rep = next(&cch);
    match rep.take() {
        Some(Event::ConnectResponse { private_data, .. }) => {
            assert_eq!(&private_data[..7], b"welcome");
            drop(rep);
            c.establish().expect("establish");
        }
        other => panic!("expected ConnectResponse, got {other:?}"),
    }
    assert!(matches!(next(&sch).event(), Event::Established { .. }));
    assert!(matches!(next(&cch).event(), Event::Established { .. }));
    assert_eq!(c.state(), State::Established);
    let attr = c.init_qp_attr(rcm::QpState::Rtr).expect("qp attr");
    assert_eq!(attr.dgid, rcm_wire::Gid::from_ip(ip(1)));

    c.disconnect().expect("disconnect");
    assert!(matches!(next(&cch).event(), Event::Disconnected));
    assert!(matches!(next(&sch).event(), Event::Disconnected));
    assert_eq!(c.destroy(), Ok(DestroyOutcome::Done));
    assert_eq!(child.destroy(), Ok(DestroyOutcome::Done));
    assert_eq!(l.destroy(), Ok(DestroyOutcome::Done));
    assert_eq!(c.state(), State::Destroying);
    assert!(matches!(
        c.bind(SocketAddr::new(ip(1), 0)),
        Err(rcm::Error::Destroyed)
    ));

    let t0 = Instant::now();
    while d.held_ids() != 0 || d.fabric().live_ids() != 0 {
        assert!(t0.elapsed() < T, "daemon still holds {} ids", d.held_ids());
        std::thread::sleep(Duration::from_millis(10));
    }
    server.shutdown();
    client.shutdown();
    d.shutdown();
}

#[test]
fn handlers_flow_destroy_and_destroy_inside_callback() {
    let threads = handlers_case("handlers", 47102, rcm::CallbackMode::Threads);
    assert!(
        threads.iter().all(|t| t.starts_with("rcm-cb-")),
        "callbacks ran on {threads:?}"
    );
}

#[test]
fn inline_handlers_run_on_the_sessions_reader_with_every_guarantee() {
    // The same story with the callbacks on each session's reader (CallbackMode::Inline):
    // their calls (accept, connect, establish, disconnect, destroy from inside) go on
    // command channels, which never need the reader.
    let threads = handlers_case("handlers-inline", 47108, rcm::CallbackMode::Inline);
    assert!(
        threads.iter().all(|t| t == "rcm-ucm-client"),
        "callbacks ran on {threads:?}"
    );
}

/// A server accepting from its handler and a client driving its connection from its own,
/// through the daemon, with fabrics in `mode`; returns the names of the threads the
/// callbacks ran on.
fn handlers_case(name: &str, port: u16, mode: rcm::CallbackMode) -> Vec<String> {
    let d = daemon(name, port, &[1]);
    let cfg = FabricConfig {
        callbacks: mode,
        ..FabricConfig::default()
    };
    let server = rcm_ucm::fabric_with(d.socket(), cfg.clone()).expect("server");
    let client = rcm_ucm::fabric_with(d.socket(), cfg).expect("client");
    let (tx, rx) = mpsc::channel::<String>();
    let inside = Arc::new(AtomicUsize::new(0));
    let ins = inside.clone();
    let names = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let (snames, cnames) = (names.clone(), names.clone());
    let here = |names: &std::sync::Mutex<Vec<String>>| {
        let t = std::thread::current().name().unwrap_or("?").to_string();
        names.lock().expect("names").push(t);
    };
    // The server accepts every request from its handler; the child destroys itself from
    // inside its own callback on Disconnected (Deferred), the listener is destroyed last.
    let stx = tx.clone();
    let l = server
        .try_create_id(PortSpace::Tcp, move |id, ev| {
            here(&snames);
            let _ = stx.send(format!("server {}", ev.name()));
            match ev {
                Event::ConnectRequest { .. } => {
                    id.accept(&AcceptOptions::default())
                        .expect("accept in callback");
                    Flow::Continue
                }
                Event::Disconnected => {
                    let r = id.destroy();
                    if r == Ok(DestroyOutcome::Deferred) {
                        ins.fetch_add(1, Ordering::SeqCst);
                    }
                    Flow::Continue
                }
                _ => Flow::Continue,
            }
        })
        .expect("create listener");
    l.bind(SocketAddr::new(ip(1), port - 40100)).expect("bind");
    l.listen(4).expect("listen");
    let ctx = tx.clone();
    let c = client
        .try_create_id(PortSpace::Tcp, move |id, ev| {
            here(&cnames);
            let _ = ctx.send(format!("client {}", ev.name()));
            match ev {
                Event::AddrResolved => {
                    id.resolve_route().expect("route");
                    Flow::Continue
                }
                Event::RouteResolved => {
                    id.connect(&ConnectOptions::default()).expect("connect");
                    Flow::Continue
                }
                Event::ConnectResponse { .. } => {
                    id.establish().expect("establish");
                    Flow::Continue
                }
                Event::Established { .. } => {
                    id.disconnect().expect("disconnect");
                    Flow::Continue
                }
                // Returning Destroy ends the id with no further callback.
                Event::Disconnected => Flow::Destroy,
                _ => Flow::Continue,
            }
        })
        .expect("create client");
    c.resolve_addr(None, SocketAddr::new(ip(1), port - 40100))
        .expect("resolve");
    let mut seen = Vec::new();
    let t0 = Instant::now();
    while !(seen.contains(&"client DISCONNECTED".to_string())
        && seen.contains(&"server DISCONNECTED".to_string()))
    {
        assert!(t0.elapsed() < T, "saw only {seen:?}");
        if let Ok(s) = rx.recv_timeout(Duration::from_millis(100)) {
            seen.push(s);
        }
    }
    let t0 = Instant::now();
    while c.state() != State::Destroying || inside.load(Ordering::SeqCst) != 1 {
        assert!(t0.elapsed() < T);
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(l.destroy(), Ok(DestroyOutcome::Done));
    std::thread::sleep(Duration::from_millis(100));
    // Nothing after Flow::Destroy or the deferred destroy.
    let late: Vec<String> = rx.try_iter().collect();
    assert!(
        late.iter().all(|s| !s.ends_with("DISCONNECTED")),
        "late callbacks: {late:?}"
    );
    let t0 = Instant::now();
    while d.held_ids() != 0 {
        assert!(t0.elapsed() < T, "daemon holds {} ids", d.held_ids());
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(server);
    drop(client);
    let n = names.lock().expect("names").clone();
    assert!(!n.is_empty());
    n
}

/// Commands the daemon has read from `c`'s session, counting this one (the `Stats` asking):
/// between two calls the count grows by one, plus one for each command sent meanwhile.
fn commands(c: &rcm_ucm::Client) -> u64 {
    c.stats().expect("stats").commands
}

#[test]
fn qp_attributes_come_with_the_events_and_go_stale_with_the_connection() {
    use rcm::QpState::{Init, Rtr, Rts};
    let d = daemon("qpattr", 47106, &[1, 2]);
    let server_session = rcm_ucm::Client::connect(d.socket()).expect("server session");
    let server = Fabric::with_provider(Arc::new(server_session.clone()), FabricConfig::default());
    let session = rcm_ucm::Client::connect(d.socket()).expect("client session");
    let client = Fabric::with_provider(Arc::new(session.clone()), FabricConfig::default());
    let (_l, sch) = listen(&server, SocketAddr::new(ip(1), 7005));
    let cch = EventChannel::new();

    let c = client
        .try_create_id_on(PortSpace::Tcp, &cch)
        .expect("create");
    c.resolve_addr(None, SocketAddr::new(ip(1), 7005))
        .expect("resolve_addr");
    assert!(matches!(next(&cch).event(), Event::AddrResolved));
    // Addresses known: INIT is answered here, no command goes to the daemon.
    let before = commands(&session);
    let init = c.init_qp_attr(Init).expect("INIT attributes");
    assert_eq!((init.qp_state, init.port_num), (Some(Init), 1));
    // No CM connection yet: INIT's access flags are none (rdma_cm's "default values").
    assert_eq!(
        (init.attr_mask, init.qp_access_flags),
        (
            QpAttrMask::STATE
                | QpAttrMask::ACCESS_FLAGS
                | QpAttrMask::PKEY_INDEX
                | QpAttrMask::PORT,
            AccessFlags::empty()
        )
    );
    assert_eq!(
        commands(&session),
        before + 1,
        "INIT was answered without the daemon (only the next Stats came)"
    );
    // RTR is not valid yet: the daemon says so.
    assert!(matches!(
        c.init_qp_attr(Rtr),
        Err(rcm::Error::InvalidState(State::AddrResolved))
    ));
    assert_eq!(
        commands(&session),
        before + 3,
        "one Stats, one INIT_QP_ATTR, one Stats"
    );

    c.resolve_route().expect("resolve_route");
    assert!(matches!(next(&cch).event(), Event::RouteResolved));
    c.connect(&ConnectOptions::default()).expect("connect");
    // The connect made the CM connection INIT's access flags come from: the attributes
    // the route's event brought are out of date, and the daemon answers.
    let before = commands(&session);
    let rc_flags =
        AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC;
    let init_connected = c.init_qp_attr(Init).expect("INIT after connect");
    assert_eq!(init_connected.qp_access_flags, rc_flags);
    assert_eq!(init_connected.attr_mask, init.attr_mask);
    assert_eq!(
        commands(&session),
        before + 2,
        "INIT after connect asked the daemon"
    );
    let child = next(&sch).id().clone();
    // A connect request brings the child's INIT attributes only: its own PSN is chosen at
    // accept, so RTR/RTS before that are the daemon's to answer.
    let before = commands(&server_session);
    assert_eq!(
        child.init_qp_attr(Init).expect("child INIT").qp_state,
        Some(Init)
    );
    assert_eq!(
        commands(&server_session),
        before + 1,
        "the child's INIT was answered without the daemon (only the next Stats came)"
    );
    let child_rtr = child
        .init_qp_attr(Rtr)
        .expect("the child's RTR before accept, from the daemon");
    assert_eq!(
        commands(&server_session),
        before + 3,
        "the child's RTR before accept asked the daemon (one Stats, one INIT_QP_ATTR, one Stats)"
    );
    child.accept(&AcceptOptions::default()).expect("accept");
    assert!(matches!(next(&cch).event(), Event::ConnectResponse { .. }));
    let before = commands(&session);
    let rtr = c.init_qp_attr(Rtr).expect("RTR attributes");
    let rts = c.init_qp_attr(Rts).expect("RTS attributes");
    assert_eq!(c.init_qp_attr(Init).expect("INIT"), init_connected);
    assert_eq!(
        commands(&session),
        before + 1,
        "RTR/RTS/INIT were answered without the daemon (only the next Stats came)"
    );
    assert_eq!(
        rtr.attr_mask,
        QpAttrMask::STATE
            | QpAttrMask::AV
            | QpAttrMask::PATH_MTU
            | QpAttrMask::DEST_QPN
            | QpAttrMask::RQ_PSN
            | QpAttrMask::MAX_DEST_RD_ATOMIC
            | QpAttrMask::MIN_RNR_TIMER
    );
    assert_eq!(
        rts.attr_mask,
        QpAttrMask::STATE
            | QpAttrMask::SQ_PSN
            | QpAttrMask::TIMEOUT
            | QpAttrMask::RETRY_CNT
            | QpAttrMask::RNR_RETRY
            | QpAttrMask::MAX_QP_RD_ATOMIC
    );
    c.establish().expect("establish");
    assert!(matches!(next(&sch).event(), Event::Established { .. }));
    assert!(matches!(next(&cch).event(), Event::Established { .. }));
    assert_eq!(c.init_qp_attr(Rts).expect("RTS attributes"), rts);
    assert_eq!(rtr.for_state(Rtr), Some(rtr.clone()));
    assert_eq!(rts.for_state(Rtr), Some(rtr.clone()));

    // The passive side got its RTS attributes with ESTABLISHED; the two ends agree.
    let before = commands(&server_session);
    let srts = child.init_qp_attr(Rts).expect("child RTS attributes");
    assert_eq!(
        commands(&server_session),
        before + 1,
        "the child's RTS was answered without the daemon (only the next Stats came)"
    );
    assert_eq!((srts.rq_psn, rts.rq_psn), (rts.sq_psn, srts.sq_psn));
    // What the daemon answered for the child's RTR before accept is what the connection has:
    // the client's starting PSN (its REQ's) as the RQ PSN, its QPN, the path.
    assert_eq!(
        child_rtr.rq_psn, rts.sq_psn,
        "the child's RQ PSN before accept"
    );
    assert_eq!(child_rtr.dest_qp_num, srts.dest_qp_num);
    assert_eq!(srts.for_state(Rtr), Some(child_rtr));
    assert_eq!((srts.dgid, srts.sgid), (rts.sgid, rts.dgid));
    assert_ne!(srts.dest_qp_num, 0);
    assert_ne!(rts.dest_qp_num, 0);

    // Disconnecting makes them stale at once: the daemon answers, as in-process.
    c.disconnect().expect("disconnect");
    assert!(matches!(
        c.init_qp_attr(Rtr),
        Err(rcm::Error::InvalidState(State::Disconnect))
    ));
    // The peer's DISCONNECTED does the same on its side.
    assert!(matches!(next(&cch).event(), Event::Disconnected));
    assert!(matches!(next(&sch).event(), Event::Disconnected));
    let before = commands(&server_session);
    assert!(matches!(
        child.init_qp_attr(Rts),
        Err(rcm::Error::InvalidState(State::Disconnect))
    ));
    assert_eq!(commands(&server_session), before + 2, "asked the daemon");
    assert_eq!(c.destroy(), Ok(DestroyOutcome::Done));
    assert_eq!(child.destroy(), Ok(DestroyOutcome::Done));
    server.shutdown();
    client.shutdown();
    d.shutdown();
}

/// `notify_established` through the daemon (`NOTIFY`): the passive id whose RTU has not come
/// is established by it, and the RTU that follows brings no second ESTABLISHED.
#[test]
fn notify_established_through_the_daemon() {
    let d = daemon("notify", 47107, &[1, 2]);
    let server = rcm_ucm::fabric(d.socket()).expect("server session");
    let client = rcm_ucm::fabric(d.socket()).expect("client session");
    let dst = SocketAddr::new(ip(1), 7475);
    let (l, sch) = listen(&server, dst);
    let cch = EventChannel::new();
    let c = dial(&client, &cch, dst, b"hello");
    let req = next(&sch);
    assert!(
        matches!(req.event(), Event::ConnectRequest { .. }),
        "{req:?}"
    );
    let child = req.id().clone();
    drop(req);
    child.accept(&AcceptOptions::default()).expect("accept");
    let rep = next(&cch);
    assert!(
        matches!(rep.event(), Event::ConnectResponse { .. }),
        "{rep:?}"
    );
    drop(rep);
    // No RTU yet: the client has not called establish.
    child.notify_established().expect("notify");
    let e = next(&sch);
    assert_eq!(e.id(), &child);
    assert!(matches!(e.event(), Event::Established { .. }), "{e:?}");
    drop(e);
    assert_eq!(child.state(), State::Established);
    assert_eq!(
        child.notify_established(),
        Err(rcm::Error::InvalidState(State::Established))
    );
    c.establish().expect("establish");
    assert!(matches!(next(&cch).event(), Event::Established { .. }));
    assert!(
        sch.get_event(Some(Duration::from_millis(300))).is_none(),
        "no second ESTABLISHED"
    );
    c.disconnect().expect("disconnect");
    assert!(matches!(next(&cch).event(), Event::Disconnected));
    assert!(matches!(next(&sch).event(), Event::Disconnected));
    for id in [c, child, l] {
        assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
    }
    client.shutdown();
    server.shutdown();
}
