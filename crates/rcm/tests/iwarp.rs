//! iWARP devices under the rdma_cm API: connect, accept, reject, disconnect and messages over
//! real TCP on loopback, and the iw_cm races Linux got wrong, made deterministic with gates in
//! callbacks. TCP ports 27901..=27960 (one per test, and 27961 in a network namespace of its
//! own), RoCE UDP port 27990.
#![cfg(not(loom))]

mod common;

use common::{eventually, ip, Gate, Tracked, T};
use rcm::{
    AcceptOptions, CmId, ConnectOptions, DestroyOutcome, Error, Event, Fabric, FabricConfig, Flow,
    PortSpace, QpState, State, IWARP_PRIVATE_DATA_MAX,
};
use rcm_wire::cm::RejReason;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A fabric of iWARP devices on 127.0.0.`last` for each of `lasts`.
fn iw_fabric(lasts: &[u8]) -> Fabric {
    iw_fabric_with(common::config(27990), lasts)
}

/// [`iw_fabric`] with the configuration `cfg`.
fn iw_fabric_with(cfg: FabricConfig, lasts: &[u8]) -> Fabric {
    let f = Fabric::new(cfg);
    for &l in lasts {
        f.add_iwarp_device(ip(l)).expect("iWARP device");
    }
    f
}

fn addr(last: u8, port: u16) -> SocketAddr {
    SocketAddr::new(ip(last), port)
}

/// What every id saw, in order: (id key, event description).
#[derive(Default)]
struct Log {
    ev: Mutex<Vec<(u64, String)>>,
    cv: Condvar,
}

impl Log {
    fn new() -> Arc<Self> {
        Arc::new(Log::default())
    }

    fn push(&self, id: &CmId, what: String) {
        self.ev.lock().unwrap().push((id.key(), what));
        self.cv.notify_all();
    }

    /// Waits (up to the hang guard) until `n` entries equal to `what` are in.
    fn wait_n(&self, what: &str, n: usize) {
        let end = Instant::now() + T;
        let mut g = self.ev.lock().unwrap();
        while g.iter().filter(|(_, w)| w == what).count() < n {
            assert!(
                Instant::now() < end,
                "timed out waiting for {n} x {what:?}: {g:?}"
            );
            g = self
                .cv
                .wait_timeout(g, Duration::from_millis(50))
                .unwrap()
                .0;
        }
    }

    fn count(&self, what: &str) -> usize {
        self.ev
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, w)| w == what)
            .count()
    }

    fn of(&self, key: u64) -> Vec<String> {
        self.ev
            .lock()
            .unwrap()
            .iter()
            .filter(|(k, _)| *k == key)
            .map(|(_, w)| w.clone())
            .collect()
    }
}

fn describe(ev: &Event) -> String {
    match ev {
        Event::ConnectRequest { private_data, .. } => {
            format!("request {}", String::from_utf8_lossy(private_data))
        }
        Event::Established { private_data, .. } if !private_data.is_empty() => {
            format!("established {}", String::from_utf8_lossy(private_data))
        }
        Event::Rejected {
            reason,
            private_data,
        } => format!(
            "rejected {} {}",
            reason.raw(),
            String::from_utf8_lossy(private_data)
        ),
        other => other.name().to_lowercase(),
    }
}

/// A listener whose handler logs, then runs `on` (which may accept, reject, block, …).
fn listener(
    f: &Fabric,
    at: SocketAddr,
    log: &Arc<Log>,
    on: impl Fn(&CmId, &Event) -> Flow + Send + Sync + 'static,
) -> CmId {
    listener_with_backlog(f, at, 0, log, on)
}

/// [`listener`] listening with `backlog`.
fn listener_with_backlog(
    f: &Fabric,
    at: SocketAddr,
    backlog: usize,
    log: &Arc<Log>,
    on: impl Fn(&CmId, &Event) -> Flow + Send + Sync + 'static,
) -> CmId {
    let log = log.clone();
    let id = f.create_id(PortSpace::Tcp, move |id, ev| {
        log.push(id, describe(&ev));
        on(id, &ev)
    });
    id.bind(at).unwrap();
    id.listen(backlog).unwrap();
    id
}

fn accept_with(pd: &'static [u8]) -> impl Fn(&CmId, &Event) -> Flow + Send + Sync + 'static {
    move |id, ev| {
        if let Event::ConnectRequest { .. } = ev {
            id.accept(&AcceptOptions {
                private_data: pd.to_vec(),
                ..AcceptOptions::default()
            })
            .unwrap();
        }
        Flow::Continue
    }
}

/// A client that resolves, connects to `dst` with `pd`, logs, then runs `on`.
fn client(
    f: &Fabric,
    dst: SocketAddr,
    pd: &[u8],
    log: &Arc<Log>,
    on: impl Fn(&CmId, &Event) -> Flow + Send + Sync + 'static,
) -> CmId {
    let log = log.clone();
    let pd = pd.to_vec();
    let id = f.create_id(PortSpace::Tcp, move |id, ev| {
        log.push(id, describe(&ev));
        match &ev {
            Event::AddrResolved => id.resolve_route().unwrap(),
            Event::RouteResolved => id
                .connect(&ConnectOptions {
                    private_data: pd.clone(),
                    ..ConnectOptions::default()
                })
                .unwrap(),
            _ => {}
        }
        on(id, &ev)
    });
    id.resolve_addr(None, dst).unwrap();
    id
}

fn cont(_: &CmId, _: &Event) -> Flow {
    Flow::Continue
}

/// Every id, port and stream is gone once everything was destroyed.
fn assert_clean(f: &Fabric) {
    assert!(
        eventually(T, || f.live_ids() == 0),
        "ids leaked: {}",
        f.live_ids()
    );
    assert!(eventually(T, || f.bound_ports() == 0), "ports leaked");
    assert!(
        eventually(T, || f.engine_ceps() == 0),
        "streams leaked: {}",
        f.engine_ceps()
    );
}

#[test]
fn connect_accept_messages_disconnect() {
    let f = iw_fabric(&[1, 2]);
    let log = Log::new();
    let children = Arc::new(Mutex::new(Vec::new()));
    let ch = children.clone();
    let l = listener(&f, addr(1, 27901), &log, move |id, ev| {
        if let Event::ConnectRequest { param, .. } = ev {
            // MPA revision 2 carries the initiator's IRD/ORD.
            assert_eq!((param.responder_resources, param.initiator_depth), (1, 1));
            ch.lock().unwrap().push(id.clone());
            id.accept(&AcceptOptions {
                private_data: b"welcome".to_vec(),
                ..AcceptOptions::default()
            })
            .unwrap();
        }
        Flow::Continue
    });
    let c = client(&f, addr(1, 27901), b"hello", &log, cont);
    // Private data arrives exactly, both ways (no cma_hdr, no padding on iWARP).
    log.wait_n("request hello", 1);
    log.wait_n("established welcome", 1);
    log.wait_n("established", 1);
    let s = children.lock().unwrap()[0].clone();
    assert_eq!(s.state(), State::Established);
    assert_eq!(c.state(), State::Established);
    assert_eq!(s.device_addr(), Some(ip(1)));
    assert_eq!(c.device_addr(), Some(ip(2)));
    assert_eq!(s.peer_addr().map(|a| a.ip()), Some(ip(2)));
    assert_eq!(s.local_addr(), Some(addr(1, 27901)));
    // iw_cm hands out only access flags: no QPN, PSN or path.
    let a = c.init_qp_attr(QpState::Rtr).unwrap();
    assert_eq!((a.dest_qp_num, a.rq_psn), (0, 0));
    let rts = c.init_qp_attr(QpState::Rts).unwrap();
    for st in [QpState::Init, QpState::Rtr, QpState::Rts] {
        assert_eq!(rts.for_state(st), Some(c.init_qp_attr(st).unwrap()));
    }
    assert_eq!(c.establish(), Err(Error::InvalidState(State::Established)));

    // Messages over the stream, both ways, including one longer than an FPDU.
    c.send(b"ping").unwrap();
    assert_eq!(s.recv_message(T).as_deref(), Some(&b"ping"[..]));
    let big: Vec<u8> = (0..5000u32).map(|i| i as u8).collect();
    s.send(&big).unwrap();
    s.send(b"pong").unwrap();
    assert_eq!(c.recv_message(T), Some(big));
    assert_eq!(c.recv_message(T).as_deref(), Some(&b"pong"[..]));

    c.disconnect().unwrap();
    log.wait_n("disconnected", 2);
    assert_eq!(
        log.of(c.key()).last().map(String::as_str),
        Some("disconnected")
    );
    assert_eq!(
        log.of(s.key()),
        ["request hello", "established", "disconnected"]
    );
    assert_eq!(c.send(b"late"), Err(Error::InvalidState(State::Disconnect)));
    // Disconnecting what is already down is no error (iw_cm_disconnect returns 0 there).
    assert_eq!(s.disconnect(), Ok(()));
    assert_eq!(c.disconnect(), Ok(()));
    for id in [c, s, l] {
        assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
    }
    assert_clean(&f);
    f.shutdown();
}

#[test]
fn reject_with_private_data() {
    let f = iw_fabric(&[1, 2]);
    let log = Log::new();
    let l = listener(&f, addr(1, 27902), &log, |id, ev| {
        if let Event::ConnectRequest { .. } = ev {
            id.reject(b"go away").unwrap();
            // Linux's consumers destroy a rejected child at once (`rdma_reject` + destroy).
            return Flow::Destroy;
        }
        Flow::Continue
    });
    let c = client(&f, addr(1, 27902), b"knock", &log, cont);
    log.wait_n("rejected 28 go away", 1);
    assert_eq!(c.state(), State::Disconnect);
    assert_eq!(log.count("request knock"), 1);
    c.destroy().unwrap();
    l.destroy().unwrap();
    assert_clean(&f);
    f.shutdown();
}

#[test]
fn connection_refused_is_rejected_invalid_service_id() {
    let f = iw_fabric(&[1, 2]);
    let log = Log::new();
    // Nobody listens on TCP 127.0.0.1:27903: the RST is reported as IB's "invalid service
    // ID" reject, what a RoCE peer without a listener answers.
    let c = client(&f, addr(1, 27903), b"anyone?", &log, cont);
    log.wait_n(
        &format!("rejected {} ", RejReason::InvalidServiceId.raw()),
        1,
    );
    assert_eq!(c.state(), State::Disconnect);
    c.destroy().unwrap();
    assert_clean(&f);
    f.shutdown();
}

#[test]
fn private_data_limits() {
    let f = iw_fabric(&[1, 2]);
    let log = Log::new();
    let l = listener(&f, addr(1, 27904), &log, move |id, ev| {
        if let Event::ConnectRequest { private_data, .. } = ev {
            assert_eq!(private_data.len(), IWARP_PRIVATE_DATA_MAX);
            let too_long = vec![1u8; IWARP_PRIVATE_DATA_MAX + 1];
            assert_eq!(
                id.accept(&AcceptOptions {
                    private_data: too_long,
                    ..AcceptOptions::default()
                }),
                Err(Error::PrivateDataTooLong { len: 253, max: 252 })
            );
            id.accept(&AcceptOptions {
                private_data: vec![2u8; IWARP_PRIVATE_DATA_MAX],
                ..AcceptOptions::default()
            })
            .unwrap();
        }
        // The child goes with the connection.
        if let Event::Disconnected = ev {
            return Flow::Destroy;
        }
        Flow::Continue
    });
    let (tx, rx) = std::sync::mpsc::channel();
    let tx = Mutex::new(tx);
    let c = f.create_id(PortSpace::Tcp, move |id, ev| {
        match ev {
            Event::AddrResolved => id.resolve_route().unwrap(),
            Event::RouteResolved => {
                let long = ConnectOptions {
                    private_data: vec![1u8; 253],
                    ..ConnectOptions::default()
                };
                tx.lock().unwrap().send(id.connect(&long)).unwrap();
                id.connect(&ConnectOptions {
                    private_data: vec![1u8; 252],
                    ..ConnectOptions::default()
                })
                .unwrap();
            }
            Event::Established { private_data, .. } => {
                tx.lock().unwrap().send(Ok(())).unwrap();
                assert_eq!(private_data, vec![2u8; 252]);
            }
            _ => {}
        }
        Flow::Continue
    });
    c.resolve_addr(None, addr(1, 27904)).unwrap();
    assert_eq!(
        rx.recv_timeout(T).unwrap(),
        Err(Error::PrivateDataTooLong { len: 253, max: 252 })
    );
    assert_eq!(rx.recv_timeout(T).unwrap(), Ok(()));
    // Destroying an established id resets the stream: the child sees DISCONNECTED.
    c.destroy().unwrap();
    log.wait_n("disconnected", 1);
    l.destroy().unwrap();
    assert_clean(&f);
    f.shutdown();
}

#[test]
fn five_hundred_connections_at_once() {
    const N: usize = 500;
    let f = iw_fabric(&[1, 2]);
    let log = Log::new();
    let accept = accept_with(b"ok");
    // The children go when their connection does.
    let l = listener(&f, addr(1, 27905), &log, move |id, ev| match ev {
        Event::Disconnected => Flow::Destroy,
        _ => accept(id, ev),
    });
    let clients: Vec<CmId> = (0..N)
        .map(|_| client(&f, addr(1, 27905), b"hi", &log, cont))
        .collect();
    log.wait_n("established ok", N);
    log.wait_n("established", N);
    assert_eq!(log.count("request hi"), N);
    let peak = f.table_bytes();
    for c in &clients {
        c.disconnect().unwrap();
    }
    log.wait_n("disconnected", 2 * N);
    for c in clients {
        assert_eq!(c.destroy(), Ok(DestroyOutcome::Done));
    }
    // The tables give back the room the 1,000 streams and their ids took (`rcm_proto::room`).
    assert!(
        eventually(T, || f.engine_ceps() == 0 && f.live_ids() == 1),
        "streams left: {}, ids: {}",
        f.engine_ceps(),
        f.live_ids()
    );
    let left = f.table_bytes();
    assert!(
        left * 8 < peak,
        "table room {left} bytes with the streams gone, {peak} at the peak"
    );
    l.destroy().unwrap();
    f.shutdown();
}

#[test]
fn wildcard_listen_spans_iwarp_and_roce() {
    let cfg = FabricConfig {
        udp_port: 27990,
        ..common::config(27990)
    };
    let server = Fabric::new(cfg.clone());
    server.add_device(ip(1)).unwrap();
    server.add_iwarp_device(ip(2)).unwrap();
    let cl = Fabric::new(cfg);
    cl.add_device(ip(3)).unwrap();
    cl.add_iwarp_device(ip(4)).unwrap();
    let log = Log::new();
    let devs = Arc::new(Mutex::new(Vec::new()));
    let d2 = devs.clone();
    let l = server.create_id(PortSpace::Tcp, {
        let log = log.clone();
        move |id, ev| {
            log.push(id, describe(&ev));
            if let Event::ConnectRequest { .. } = ev {
                d2.lock().unwrap().push(id.device_addr());
                id.accept(&AcceptOptions::default()).unwrap();
            }
            Flow::Continue
        }
    });
    l.bind(rcm::any_addr(false, 27906)).unwrap();
    l.listen(0).unwrap();
    let mk = |src: u8, dst: u8| {
        let log = log.clone();
        let id = cl.create_id(PortSpace::Tcp, move |id, ev| {
            log.push(id, describe(&ev));
            match ev {
                Event::AddrResolved => id.resolve_route().unwrap(),
                Event::RouteResolved => id
                    .connect(&ConnectOptions {
                        private_data: b"x".to_vec(),
                        ..ConnectOptions::default()
                    })
                    .unwrap(),
                // RoCE without a QP: the REP comes as a response, the RTU on establish.
                Event::ConnectResponse { .. } => id.establish().unwrap(),
                _ => {}
            }
            Flow::Continue
        });
        id.resolve_addr(Some(ip(src)), addr(dst, 27906)).unwrap();
        id
    };
    let roce = mk(3, 1);
    let iwarp = mk(4, 2);
    log.wait_n("established", 4);
    let mut seen = devs.lock().unwrap().clone();
    seen.sort();
    assert_eq!(seen, vec![Some(ip(1)), Some(ip(2))]);
    // The iWARP request carries the private data exactly; RoCE's is the padded REQ area.
    assert_eq!(log.count("request x"), 1);
    assert_eq!(roce.state(), State::Established);
    assert_eq!(iwarp.state(), State::Established);
    assert!(matches!(roce.send(b"no"), Err(Error::InvalidArgument(_))));
    iwarp.send(b"yes").unwrap();
    roce.destroy().unwrap();
    iwarp.destroy().unwrap();
    l.destroy().unwrap();
    server.shutdown();
    cl.shutdown();
}

#[test]
fn device_removal_with_established_connections() {
    let f = iw_fabric(&[2]);
    let server = iw_fabric(&[1]);
    let log = Log::new();
    let removed = Arc::new(AtomicUsize::new(0));
    let r2 = removed.clone();
    let l = listener(&server, addr(1, 27907), &log, move |id, ev| match ev {
        Event::ConnectRequest { .. } => {
            id.accept(&AcceptOptions::default()).unwrap();
            Flow::Continue
        }
        Event::DeviceRemoval => {
            r2.fetch_add(1, Ordering::SeqCst);
            Flow::Destroy
        }
        _ => Flow::Continue,
    });
    let clients: Vec<CmId> = (0..3)
        .map(|_| client(&f, addr(1, 27907), b"r", &log, cont))
        .collect();
    log.wait_n("established", 6);
    let removal = server.remove_device(ip(1)).unwrap();
    removal.wait(T).expect("every id on the device destroyed");
    // The listener and the three children, once each.
    assert_eq!(removed.load(Ordering::SeqCst), 4);
    assert_eq!(log.count("device_removal"), 4);
    // The children were destroyed established: their streams were reset.
    log.wait_n("disconnected", 3);
    assert_eq!(l.state(), State::Destroying);
    for c in clients {
        c.destroy().unwrap();
    }
    assert_clean(&f);
    assert_clean(&server);
    f.shutdown();
    server.shutdown();
}

// ---------------------------------------------------------------------------------------
// The races of the issue.

/// The peer's FIN (DISCONNECT, then CLOSE) arrives between `accept()` and the delivery of
/// ESTABLISHED: the child still sees ESTABLISHED first, then one DISCONNECTED.
#[test]
fn close_between_accept_and_established() {
    let f = iw_fabric(&[1, 2]);
    let log = Log::new();
    let gate = Gate::new();
    let g2 = gate.clone();
    let child = Arc::new(Mutex::new(None));
    let c2 = child.clone();
    let l = listener(&f, addr(1, 27908), &log, move |id, ev| {
        if let Event::ConnectRequest { .. } = ev {
            // Published before `accept`: the client can be established, and the test
            // read this, before `accept` returns here.
            *c2.lock().unwrap() = Some(id.clone());
            id.accept(&AcceptOptions::default()).unwrap();
            g2.wait();
        }
        Flow::Continue
    });
    let c = client(&f, addr(1, 27908), b"a", &log, cont);
    log.wait_n("established", 1);
    c.disconnect().unwrap();
    // The server's FIN came back: its Cep saw ours, DISCONNECT and CLOSE are routed.
    log.wait_n("disconnected", 1);
    let s = child.lock().unwrap().clone().unwrap();
    assert!(eventually(T, || s.state() == State::Disconnect));
    assert_eq!(log.of(s.key()), ["request a"]);
    gate.open();
    log.wait_n("disconnected", 2);
    assert_eq!(
        log.of(s.key()),
        ["request a", "established", "disconnected"]
    );
    for id in [c, s, l] {
        id.destroy().unwrap();
    }
    assert_clean(&f);
    f.shutdown();
}

/// The initiator gives up while the request waits for the user: CLOSE before `accept()`.
/// The child gets one DISCONNECTED and `accept` fails cleanly.
#[test]
fn close_before_accept() {
    let f = iw_fabric(&[1, 2]);
    let log = Log::new();
    let gate = Gate::new();
    let g2 = gate.clone();
    let child = Arc::new(Mutex::new(None));
    let c2 = child.clone();
    let accepted = Arc::new(Mutex::new(None));
    let a2 = accepted.clone();
    let l = listener(&f, addr(1, 27909), &log, move |id, ev| {
        if let Event::ConnectRequest { .. } = ev {
            *c2.lock().unwrap() = Some(id.clone());
            g2.wait();
            *a2.lock().unwrap() = Some(id.accept(&AcceptOptions::default()));
        }
        Flow::Continue
    });
    let c = client(&f, addr(1, 27909), b"b", &log, cont);
    assert!(eventually(T, || child.lock().unwrap().is_some()));
    // Destroying the connecting client resets its stream.
    c.destroy().unwrap();
    let s = child.lock().unwrap().clone().unwrap();
    assert!(eventually(T, || s.state() == State::Disconnect));
    gate.open();
    log.wait_n("disconnected", 1);
    assert_eq!(
        *accepted.lock().unwrap(),
        Some(Err(Error::InvalidState(State::Disconnect)))
    );
    assert_eq!(log.of(s.key()), ["request b", "disconnected"]);
    s.destroy().unwrap();
    l.destroy().unwrap();
    assert_clean(&f);
    f.shutdown();
}

/// Linux's iwcm use-after-free (aee2424246f9, CVE-2025-38211): destroy while provider
/// events (ESTABLISHED, DISCONNECT, CLOSE) are queued for the id. They are discarded, no
/// callback runs after destroy returned, and the context is dropped once.
#[test]
fn destroy_with_passive_events_queued() {
    let f = iw_fabric(&[1, 2]);
    let log = Log::new();
    let gate = Gate::new();
    let g2 = gate.clone();
    let child = Arc::new(Mutex::new(None));
    let c2 = child.clone();
    let drops = Arc::new(AtomicUsize::new(0));
    let d2 = drops.clone();
    let l = listener(&f, addr(1, 27910), &log, move |id, ev| {
        if let Event::ConnectRequest { .. } = ev {
            id.set_context(Tracked(d2.clone()));
            // Published before `accept`: the client can be established, and the test
            // read this, before `accept` returns here.
            *c2.lock().unwrap() = Some(id.clone());
            id.accept(&AcceptOptions::default()).unwrap();
            g2.wait();
        }
        Flow::Continue
    });
    let c = client(&f, addr(1, 27910), b"c", &log, cont);
    log.wait_n("established", 1);
    c.disconnect().unwrap();
    log.wait_n("disconnected", 1);
    let s = child.lock().unwrap().clone().unwrap();
    assert!(eventually(T, || s.state() == State::Disconnect));
    // ESTABLISHED and DISCONNECTED wait behind the blocked callback.
    let h = s.begin_destroy();
    gate.open();
    assert!(h.wait_for(T));
    let after = log.of(s.key());
    assert_eq!(after, ["request c"]);
    assert_eq!(drops.load(Ordering::SeqCst), 1);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        log.of(s.key()),
        after,
        "a callback ran after destroy completed"
    );
    c.destroy().unwrap();
    l.destroy().unwrap();
    assert_clean(&f);
    f.shutdown();
}

/// The same on the active side: CONNECT_REPLY (→ ESTABLISHED) and CLOSE queued behind a
/// blocked callback when destroy comes.
#[test]
fn destroy_with_active_events_queued() {
    let f = iw_fabric(&[1, 2]);
    let log = Log::new();
    let l = listener(&f, addr(1, 27911), &log, |id, ev| {
        if let Event::ConnectRequest { .. } = ev {
            id.accept(&AcceptOptions::default()).unwrap();
        }
        if let Event::Established { .. } = ev {
            // Reset at once: the client gets its CONNECT_REPLY and CLOSE back to back.
            return Flow::Destroy;
        }
        Flow::Continue
    });
    let gate = Gate::new();
    let g2 = gate.clone();
    let drops = Arc::new(AtomicUsize::new(0));
    let c = client(&f, addr(1, 27911), b"d", &log, move |_, ev| {
        if let Event::RouteResolved = ev {
            // connect() already ran (the client helper does it before this hook).
            g2.wait();
        }
        Flow::Continue
    });
    c.set_context(Tracked(drops.clone()));
    // The server's child saw ESTABLISHED and reset the stream.
    log.wait_n("established", 1);
    assert!(eventually(T, || c.state() == State::Disconnect));
    let h = c.begin_destroy();
    gate.open();
    assert!(h.wait_for(T));
    assert_eq!(log.of(c.key()), ["addr_resolved", "route_resolved"]);
    assert_eq!(drops.load(Ordering::SeqCst), 1);
    l.destroy().unwrap();
    assert_clean(&f);
    f.shutdown();
}

/// The last reference to an id goes inside its own callback (the user keeps no handle and
/// returns `Flow::Destroy`, or destroys from the callback): the teardown runs after the
/// callback, once, and frees everything (CVE-2025-38211's shape: never free under a running
/// event).
#[test]
fn last_reference_dropped_in_callback() {
    let f = iw_fabric(&[1, 2]);
    let log = Log::new();
    let l = listener(&f, addr(1, 27912), &log, |id, ev| match ev {
        Event::ConnectRequest { .. } => {
            id.accept(&AcceptOptions::default()).unwrap();
            Flow::Continue
        }
        Event::Established { .. } => {
            id.disconnect().unwrap();
            Flow::Continue
        }
        // The child's last handle is the callback's.
        Event::Disconnected => Flow::Destroy,
        _ => Flow::Continue,
    });
    let drops = Arc::new(AtomicUsize::new(0));
    let deferred = Arc::new(Mutex::new(Vec::new()));
    for i in 0..2 {
        let d = deferred.clone();
        let c = client(&f, addr(1, 27912), b"e", &log, move |id, ev| {
            if let Event::Disconnected = ev {
                if i == 0 {
                    return Flow::Destroy;
                }
                d.lock().unwrap().push(id.destroy());
            }
            Flow::Continue
        });
        c.set_context(Tracked(drops.clone()));
        drop(c);
    }
    log.wait_n("disconnected", 4);
    assert!(eventually(T, || drops.load(Ordering::SeqCst) == 2));
    assert_eq!(*deferred.lock().unwrap(), [Ok(DestroyOutcome::Deferred)]);
    l.destroy().unwrap();
    assert_clean(&f);
    f.shutdown();
}

/// Connect requests racing the listener's destroy: one delivered and blocked in its
/// callback, one queued behind it when the listener goes (rejected, never seen), one after
/// the listener is gone (TCP refused).
#[test]
fn connect_request_while_listener_destroyed() {
    let f = iw_fabric(&[1, 2]);
    let log = Log::new();
    let gate = Gate::new();
    let g2 = gate.clone();
    let l = listener(&f, addr(1, 27913), &log, move |id, ev| {
        if let Event::ConnectRequest { .. } = ev {
            g2.wait();
            id.accept(&AcceptOptions::default()).unwrap();
        }
        Flow::Continue
    });
    let c1 = client(&f, addr(1, 27913), b"one", &log, cont);
    log.wait_n("request one", 1);
    // Ids now: listener, c1, its child. The second request's child makes 5 with c2.
    let c2 = client(&f, addr(1, 27913), b"two", &log, cont);
    assert!(eventually(T, || f.live_ids() == 5));
    let h = l.begin_destroy();
    gate.open();
    assert!(h.wait_for(T));
    log.wait_n("rejected 28 ", 1);
    assert_eq!(c2.state(), State::Disconnect);
    assert_eq!(
        log.count("request two"),
        0,
        "a request was delivered after its listener died"
    );
    // The request delivered before the destroy stands.
    log.wait_n("established", 2);
    let c3 = client(&f, addr(1, 27913), b"three", &log, cont);
    log.wait_n(
        &format!("rejected {} ", RejReason::InvalidServiceId.raw()),
        1,
    );
    for c in [c1, c2, c3] {
        c.destroy().unwrap();
    }
    f.shutdown();
}

#[test]
fn udp_port_space_is_refused_on_iwarp() {
    let f = iw_fabric(&[1, 2]);
    let id = f.create_id(PortSpace::Udp, |_, _| Flow::Continue);
    id.bind(addr(1, 27914)).unwrap();
    assert!(matches!(id.listen(0), Err(Error::InvalidArgument(_))));
    id.destroy().unwrap();
    f.shutdown();
}

/// An MPA v2 request's IRD and ORD are given from the listener's side, as siw and cma.c
/// give them: the initiator's ORD is what the listener must answer (its responder
/// resources), the initiator's IRD what the listener may ask for (its initiator depth).
#[test]
fn request_ird_ord_are_given_from_the_listeners_side() {
    let f = iw_fabric(&[1, 2]);
    let ch = rcm::EventChannel::new();
    let l = f.create_id_on(PortSpace::Tcp, &ch);
    l.bind(addr(1, 27915)).unwrap();
    l.listen(4).unwrap();
    let c = f.create_id_on(PortSpace::Tcp, &ch);
    c.resolve_addr(None, addr(1, 27915)).unwrap();
    let param = loop {
        let mut e = ch.get_event(Some(T)).expect("event");
        let id = e.id().clone();
        match e.take().unwrap() {
            Event::AddrResolved => id.resolve_route().unwrap(),
            // IRD 3, ORD 5.
            Event::RouteResolved => id
                .connect(&ConnectOptions {
                    responder_resources: 3,
                    initiator_depth: 5,
                    ..ConnectOptions::default()
                })
                .unwrap(),
            Event::ConnectRequest { param, .. } => break param,
            other => panic!("unexpected {other:?}"),
        }
    };
    assert_eq!((param.responder_resources, param.initiator_depth), (5, 3));
    c.destroy().unwrap();
    l.destroy().unwrap();
    f.shutdown();
}

#[test]
fn a_peer_cannot_make_an_id_hold_more_messages_than_its_receive_buffers() {
    // Four receive buffers on the server's device; the client's device has the default.
    let f = Fabric::new(common::config(27990));
    f.add_iwarp_device_with(
        ip(1),
        rcm_proto::iw::CepConfig {
            recv_queue: 4,
            ..rcm_proto::iw::CepConfig::default()
        },
    )
    .expect("iWARP device");
    f.add_iwarp_device(ip(2)).expect("iWARP device");
    let log = Log::new();
    let children = Arc::new(Mutex::new(Vec::new()));
    let ch = children.clone();
    let l = listener(&f, addr(1, 27916), &log, move |id, ev| {
        if let Event::ConnectRequest { .. } = ev {
            ch.lock().unwrap().push(id.clone());
        }
        accept_with(b"")(id, ev)
    });

    // Taken as they come, any number passes.
    let c = client(&f, addr(1, 27916), b"", &log, cont);
    log.wait_n("established", 2);
    let s = children.lock().unwrap()[0].clone();
    for i in 0..20u8 {
        c.send(&[i]).unwrap();
        let end = Instant::now() + T;
        let got = loop {
            if let Some(m) = s.try_recv_message() {
                break m;
            }
            assert!(Instant::now() < end, "message {i} never came");
            std::thread::sleep(Duration::from_millis(1));
        };
        assert_eq!(got, [i]);
    }
    assert_eq!(s.state(), State::Established);

    // Never taken: the fifth Send finds no buffer, and the server ends the stream with a
    // Terminate (DDP, untagged buffer, "no buffer available") as siw does; it keeps the four.
    for i in 0..5u8 {
        c.send(&[i]).unwrap();
    }
    log.wait_n("disconnected", 2);
    let kept: Vec<Vec<u8>> = std::iter::from_fn(|| s.recv_message(Duration::ZERO)).collect();
    assert_eq!(kept, [[0u8], [1], [2], [3]]);
    for id in [c, s, l] {
        assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
    }
    assert_clean(&f);
    f.shutdown();
}

/// A peer made of a sans-IO `Cep` over a blocking socket: accepts one stream on `lst` and
/// the MPA Request on it, and returns both once established.
fn raw_passive_peer(lst: &std::net::TcpListener) -> (std::net::TcpStream, rcm_proto::iw::Cep) {
    use rcm_proto::iw::{AcceptParams, Cep, CepConfig};
    use std::io::{Read, Write};
    let (mut s, _) = lst.accept().expect("accept");
    // Driven by hand, with no timers: its FPDUs go out at once rather than wait for ours
    // (`responder_hold`).
    let cfg = CepConfig {
        responder_hold: std::time::Duration::ZERO,
        ..CepConfig::default()
    };
    let mut cep = Cep::passive(Instant::now(), cfg);
    let mut buf = [0u8; 4096];
    while cep.state() != rcm_proto::iw::State::Established {
        let n = s.read(&mut buf).expect("read");
        assert!(n > 0, "the initiator hung up");
        cep.on_bytes(Instant::now(), &buf[..n]);
        while let Some(e) = cep.poll_event() {
            if let rcm_proto::iw::Event::ConnectRequest(_) = e {
                cep.accept(Instant::now(), &AcceptParams::default())
                    .expect("accept");
            }
        }
        while let Some(t) = cep.poll_transmit() {
            cep.transmitted(t.len());
            s.write_all(&t).expect("write");
        }
    }
    (s, cep)
}

#[test]
fn a_peer_that_stops_reading_fills_the_send_buffer_and_no_more() {
    let f = iw_fabric(&[2]);
    // The peer: MPA by a sans-IO Cep over a blocking socket, which reads nothing more once
    // the connection is up, until told to go.
    let lst = std::net::TcpListener::bind(addr(1, 27917)).expect("listen");
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let peer = std::thread::spawn(move || {
        let (s, _cep) = raw_passive_peer(&lst);
        let _ = go_rx.recv();
        drop(s);
    });
    let log = Log::new();
    let c = client(&f, addr(1, 27917), b"", &log, cont);
    log.wait_n("established", 1);
    // The kernel's socket buffers take their share; then rcm holds up to IW_SEND_BUFFER and
    // refuses the next message.
    let msg = vec![0x5au8; 64 << 10];
    let mut sent = 0usize;
    let refused = loop {
        match c.send(&msg) {
            Ok(()) => sent += msg.len(),
            Err(e) => break e,
        }
        assert!(
            sent < 256 << 20,
            "{sent} bytes taken for a peer that reads nothing"
        );
    };
    assert_eq!(
        refused,
        Error::LimitExceeded(rcm::remote::Limit::SendBuffer),
        "after {sent} bytes"
    );
    assert!(sent >= rcm::IW_SEND_BUFFER, "refused after {sent} bytes");
    assert_eq!(c.state(), State::Established);
    // Refused again, not queued.
    assert_eq!(
        c.send(&msg),
        Err(Error::LimitExceeded(rcm::remote::Limit::SendBuffer))
    );
    let _ = go_tx.send(());
    peer.join().expect("peer");
    log.wait_n("disconnected", 1);
    assert_eq!(c.destroy(), Ok(DestroyOutcome::Done));
    assert_clean(&f);
    f.shutdown();
}

#[test]
fn a_peer_that_asks_for_more_reads_than_the_ird_is_terminated() {
    use rcm_proto::iw::{Cep, CepConfig, ConnectParams};
    use rcm_wire::mpa::{self, emit_fpdu, DdpRdmapHeader, RdmapOpcode};
    use std::io::{ErrorKind, Read, Write};
    let f = iw_fabric(&[1]);
    let log = Log::new();
    // The server answers up to one RDMA Read at a time (IRD 1, the default).
    let l = listener(&f, addr(1, 27918), &log, accept_with(b""));
    // The peer: an initiator by a sans-IO Cep over a socket, which once up only writes
    // zero-length RDMA Read Requests and never reads the Read Responses.
    let mut s = std::net::TcpStream::connect(addr(1, 27918)).expect("connect");
    let mut cep = Cep::active(CepConfig::default());
    cep.connect(Instant::now(), &ConnectParams::default())
        .expect("connect");
    let mut buf = [0u8; 4096];
    while cep.state() != rcm_proto::iw::State::Established {
        while let Some(t) = cep.poll_transmit() {
            s.write_all(&t).expect("write");
        }
        if cep.state() == rcm_proto::iw::State::Established {
            break;
        }
        let n = s.read(&mut buf).expect("read");
        assert!(n > 0, "the server hung up");
        cep.on_bytes(Instant::now(), &buf[..n]);
    }
    while let Some(t) = cep.poll_transmit() {
        s.write_all(&t).expect("write");
    }
    log.wait_n("established", 1);
    s.set_nonblocking(true).expect("nonblocking");
    let request = |msn: u32| {
        let mut u =
            DdpRdmapHeader::untagged(RdmapOpcode::RdmaReadRequest, mpa::QN_READ_REQUEST, msn, 0)
                .to_vec()
                .expect("header");
        u.extend_from_slice(
            &mpa::ReadRequest {
                sink_stag: 9,
                sink_to: 0,
                size: 0,
                source_stag: 3,
                source_to: 0,
            }
            .to_bytes(),
        );
        let mut out = Vec::new();
        emit_fpdu(&u, false, &mut out).expect("fpdu");
        out
    };
    // Each Request costs the server a 20-byte Response. Once the kernel's buffers are full,
    // the Responses wait in rcm; a Request while IRD (1) of them are unwritten is a peer
    // beyond its ORD, and the server ends the stream (as siw does with its inbound read
    // queue full). Before, it stopped reading such a stream instead (which wedged two rcm
    // ends sending to each other), and before that it answered into memory without end.
    let (mut written, mut msn, mut pending) = (0usize, 1u32, Vec::new());
    let t0 = Instant::now();
    let ended = loop {
        if pending.is_empty() {
            for _ in 0..1000 {
                pending.extend_from_slice(&request(msn));
                msn += 1;
            }
        }
        match s.write(&pending) {
            Ok(n) => {
                written += n;
                pending.drain(..n);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => break e,
        }
        assert!(
            written < 160 << 20,
            "{written} bytes of requests taken from a peer that reads no answer"
        );
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the stream still open after {written} bytes"
        );
    };
    assert!(
        matches!(
            ended.kind(),
            ErrorKind::ConnectionReset | ErrorKind::BrokenPipe
        ),
        "{ended}"
    );
    log.wait_n("disconnected", 1);
    drop(s);
    let child = f.live_ids();
    assert_eq!(child, 2, "listener and child");
    assert_eq!(l.destroy(), Ok(DestroyOutcome::Done));
    assert!(eventually(T, || f.live_ids() <= 1));
    f.shutdown();
}

/// The device reads a stream whatever its own send queue holds. It used to stop reading
/// while IW_SEND_BUFFER bytes waited: two rcm ends with full queues then waited on each
/// other for good (neither read, so neither queue drained). Here the queue is held past the
/// bound by one long message (taken since nothing waited) that a peer does not read, and
/// the peer's Sends must still arrive.
#[test]
fn messages_arrive_while_the_send_queue_is_full() {
    use std::io::Write;
    let f = iw_fabric(&[2]);
    let lst = std::net::TcpListener::bind(addr(1, 27919)).expect("listen");
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let peer = std::thread::spawn(move || {
        let (mut s, mut cep) = raw_passive_peer(&lst);
        // Reads nothing from here; waits for the word, then sends three messages.
        let _ = go_rx.recv();
        for m in [&b"one"[..], b"two", b"three"] {
            cep.send(Instant::now(), m).expect("send");
        }
        while let Some(t) = cep.poll_transmit() {
            s.write_all(&t).expect("write");
        }
        let _ = go_rx.recv();
        drop(s);
    });
    let log = Log::new();
    let c = client(&f, addr(1, 27919), b"", &log, cont);
    log.wait_n("established", 1);
    // More than the kernel's buffers and IW_SEND_BUFFER together: most of it stays queued.
    c.send(&vec![0x3cu8; 64 << 20])
        .expect("a long message into an empty queue");
    assert_eq!(
        c.send(b"more"),
        Err(Error::LimitExceeded(rcm::remote::Limit::SendBuffer))
    );
    go_tx.send(()).expect("go");
    for want in [&b"one"[..], b"two", b"three"] {
        assert_eq!(c.recv_message(T).as_deref(), Some(want));
    }
    let _ = go_tx.send(());
    peer.join().expect("peer");
    log.wait_n("disconnected", 1);
    assert_eq!(c.destroy(), Ok(DestroyOutcome::Done));
    assert_clean(&f);
    f.shutdown();
}

/// A thread waiting in `recv_message` returns when the id is destroyed (it waited out its
/// whole timeout: the teardown emptied the queue without waking it).
#[test]
fn a_waiting_recv_message_returns_when_the_id_is_destroyed() {
    let f = iw_fabric(&[1, 2]);
    let log = Log::new();
    let l = listener(&f, addr(1, 27920), &log, accept_with(b""));
    let c = client(&f, addr(1, 27920), b"", &log, cont);
    log.wait_n("established", 2);
    let waiter = {
        let c = c.clone();
        std::thread::spawn(move || {
            let t0 = Instant::now();
            (c.recv_message(Duration::from_secs(120)), t0.elapsed())
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(c.destroy(), Ok(DestroyOutcome::Done));
    let (got, waited) = waiter.join().expect("waiter");
    assert_eq!(got, None);
    assert!(
        waited < Duration::from_secs(60),
        "recv_message waited {waited:?} for a destroyed id"
    );
    assert_eq!(l.destroy(), Ok(DestroyOutcome::Done));
    f.shutdown();
}

/// The listen backlog bounds the connect requests not delivered to the application yet (as
/// ucma's): with the listener's callback busy, requests wait undelivered, and one beyond
/// the backlog is rejected; delivered ones free their places. (It was ignored on iWARP: a
/// listener whose callbacks were slow could be made to hold any number of children and
/// streams.)
#[test]
fn the_listen_backlog_bounds_undelivered_requests() {
    let f = iw_fabric(&[1, 2]);
    let log = Log::new();
    let gate = Gate::new();
    let g = gate.clone();
    let l = listener_with_backlog(&f, addr(1, 27921), 2, &log, move |id, ev| {
        if let Event::ConnectRequest { private_data, .. } = ev {
            // The first request holds the listener's callbacks (requests are delivered
            // one at a time with them) until the gate opens.
            if private_data == b"a" {
                g.wait();
            }
            id.accept(&AcceptOptions::default()).unwrap();
        }
        Flow::Continue
    });
    let dst = addr(1, 27921);
    let a = client(&f, dst, b"a", &log, cont);
    log.wait_n("request a", 1);
    // Two wait undelivered; a third is one beyond.
    let b = client(&f, dst, b"b", &log, cont);
    let c = client(&f, dst, b"c", &log, cont);
    assert!(
        eventually(T, || f.engine_ceps() == 6),
        "{}",
        f.engine_ceps()
    );
    let d = client(&f, dst, b"d", &log, cont);
    assert!(
        eventually(T, || log
            .of(d.key())
            .iter()
            .any(|e| e.starts_with("rejected"))),
        "{:?}",
        log.of(d.key())
    );
    gate.open();
    log.wait_n("request c", 1);
    let e = client(&f, dst, b"e", &log, cont);
    log.wait_n("request e", 1);
    log.wait_n("established", 8);
    assert_eq!(log.count("request b"), 1);
    assert_eq!(log.count("request d"), 0);
    for id in [a, b, c, d, e, l] {
        assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
    }
    // The children were never destroyed by their user: shutdown ends them.
    f.shutdown();
}

/// Streams accepted that never send their MPA Request are bounded per device
/// (`FabricConfig::max_half_open`): past it the oldest is reset (as the RoCE engine gives up
/// its oldest half-open connection), and a client connects as usual.
#[test]
fn streams_that_never_send_their_request_are_bounded() {
    use std::io::{ErrorKind, Read};
    let f = Fabric::new(FabricConfig {
        max_half_open: 4,
        ..common::config(27992)
    });
    f.add_iwarp_device(ip(1)).expect("iWARP device");
    f.add_iwarp_device(ip(2)).expect("iWARP device");
    let log = Log::new();
    let children = Arc::new(Mutex::new(Vec::new()));
    let ch = children.clone();
    let l = listener(&f, addr(1, 27922), &log, move |id, ev| {
        if let Event::ConnectRequest { .. } = ev {
            ch.lock().unwrap().push(id.clone());
        }
        accept_with(b"")(id, ev)
    });
    let mut silent: Vec<std::net::TcpStream> = (0..4)
        .map(|_| std::net::TcpStream::connect(addr(1, 27922)).expect("connect"))
        .collect();
    assert!(
        eventually(T, || f.engine_ceps() == 4),
        "{}",
        f.engine_ceps()
    );
    silent.push(std::net::TcpStream::connect(addr(1, 27922)).expect("connect"));
    let mut oldest = silent.remove(0);
    oldest.set_read_timeout(Some(T)).expect("timeout");
    let mut b = [0u8; 1];
    match oldest.read(&mut b) {
        Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
        other => panic!("the oldest silent stream was kept: {other:?}"),
    }
    assert!(
        eventually(T, || f.engine_ceps() == 4),
        "{}",
        f.engine_ceps()
    );
    drop(silent);
    assert!(
        eventually(T, || f.engine_ceps() == 0),
        "{}",
        f.engine_ceps()
    );
    let c = client(&f, addr(1, 27922), b"", &log, cont);
    log.wait_n("established", 2);
    let s = children.lock().unwrap()[0].clone();
    for id in [c, s, l] {
        assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
    }
    assert_clean(&f);
    f.shutdown();
}

/// A callback waiting in its own id's `recv_message` while another thread destroys the id:
/// the destroy waits for the callback, so the wait must end by itself once the id is no
/// longer live (the teardown that wakes it comes only after the callback).
#[test]
fn a_destroy_does_not_wait_out_a_callbacks_recv_message() {
    let f = iw_fabric(&[1, 2]);
    let log = Log::new();
    let l = listener(&f, addr(1, 27923), &log, accept_with(b""));
    let waiting = Gate::new();
    let w = waiting.clone();
    let c = client(&f, addr(1, 27923), b"", &log, move |id, ev| {
        if let Event::Established { .. } = ev {
            w.open();
            let _ = id.recv_message(Duration::from_secs(120));
        }
        Flow::Continue
    });
    waiting.wait();
    let (tx, rx) = std::sync::mpsc::channel();
    let cc = c.clone();
    std::thread::spawn(move || {
        let _ = tx.send(cc.destroy());
    });
    let r = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("destroy waited on the callback's recv_message");
    assert_eq!(r, Ok(DestroyOutcome::Done));
    assert_eq!(l.destroy(), Ok(DestroyOutcome::Done));
    f.shutdown();
}

/// Connects `n` times, one at a time, from 127.0.0.2 to a listener on 127.0.0.1:`port` of a
/// fabric whose threads poll for `spin` after each stretch of work, each connection
/// established at both ends, then disconnected and destroyed; returns how many times the
/// listener device's own thread went to sleep meanwhile.
fn server_sleeps_over_connects(port: u16, spin: Duration, n: usize) -> u64 {
    let f = iw_fabric_with(
        FabricConfig {
            spin,
            ..common::config(27990)
        },
        &[1, 2],
    );
    let server = f.device(ip(1)).expect("the listener's device");
    let log = Log::new();
    let l = listener(&f, addr(1, port), &log, |id, ev| match ev {
        Event::ConnectRequest { .. } => {
            id.accept(&AcceptOptions::default()).unwrap();
            Flow::Continue
        }
        Event::Disconnected => Flow::Destroy,
        _ => Flow::Continue,
    });
    let before = server.sleeps();
    for k in 1..=n {
        let c = client(&f, addr(1, port), b"", &log, cont);
        log.wait_n("established", 2 * k);
        c.disconnect().unwrap();
        log.wait_n("disconnected", 2 * k);
        assert_eq!(c.destroy(), Ok(DestroyOutcome::Done));
    }
    let slept = server.sleeps() - before;
    assert_eq!(l.destroy(), Ok(DestroyOutcome::Done));
    assert_clean(&f);
    f.shutdown();
    slept
}

/// An iWARP device's thread polls for `FabricConfig::spin` after it has worked before it
/// sleeps in epoll, as a RoCEv2 device's does: each step of a connection (the TCP connect,
/// the MPA Request, the Reply, the FIN) then finds it awake, instead of waking it (tens of
/// µs on a VM: serial connects on the 2-CPU VM, p50 ~114 µs -> ~72). Twenty connections
/// one at a time: resting at once, the listener's thread sleeps at least once each; polling
/// for longer than the test, a small fraction of that. Not always none: a poll whose yield
/// another process took ends at once (see `rcm::spin_until`), so on a host made busy by
/// others the comparison is made up to three times; without the polling every one fails
/// (about as many sleeps either way).
#[test]
fn an_iwarp_device_polls_between_the_steps_of_a_connection() {
    let n = 20;
    let mut seen = Vec::new();
    for port in [27924, 27926, 27928] {
        let resting = server_sleeps_over_connects(port, Duration::ZERO, n);
        let polling = server_sleeps_over_connects(port + 1, Duration::from_secs(60), n);
        assert!(
            resting >= n as u64,
            "resting: {resting} sleeps for {n} connections"
        );
        if polling * 4 <= resting {
            return;
        }
        seen.push((polling, resting));
    }
    panic!("(polling, resting) sleeps for {n} connections, three times: {seen:?}");
}

/// `CallbackMode::Inline` on iWARP devices: the callbacks of what a device's I/O thread
/// receives (a connect request, the MPA Reply, the peer's close) run on that thread, so an
/// accept writes its MPA Reply there instead of waking a callback thread; the connection
/// goes through, messages and all, and nothing is left. (iWARP devices ran every callback
/// on the callback threads: a serial connect woke one on each side, ~35 context switches a
/// connection in `rcm bench --transport iwarp --serial`, against ~8 now.)
#[test]
fn inline_callbacks_run_on_the_iwarp_device_thread_that_received_their_event() {
    type Ran = Arc<Mutex<Vec<(String, String)>>>;
    let f = iw_fabric_with(
        FabricConfig {
            callbacks: rcm::CallbackMode::Inline,
            ..common::config(27990)
        },
        &[1, 2],
    );
    let ran: Ran = Arc::default();
    let note = |ran: &Ran, ev: &Event| {
        let me = std::thread::current().name().unwrap_or("").to_owned();
        ran.lock().unwrap().push((describe(ev), me));
    };
    let log = Log::new();
    let children = Arc::new(Mutex::new(Vec::new()));
    let (r, ch) = (ran.clone(), children.clone());
    let accept = accept_with(b"inline");
    let l = listener(&f, addr(1, 27930), &log, move |id, ev| {
        note(&r, ev);
        if let Event::ConnectRequest { .. } = ev {
            ch.lock().unwrap().push(id.clone());
        }
        accept(id, ev)
    });
    let r = ran.clone();
    let c = client(&f, addr(1, 27930), b"hello", &log, move |_, ev| {
        note(&r, ev);
        Flow::Continue
    });
    log.wait_n("established inline", 1);
    log.wait_n("established", 1);
    let s = children.lock().unwrap()[0].clone();
    c.send(b"ping").unwrap();
    assert_eq!(s.recv_message(T).as_deref(), Some(&b"ping"[..]));
    c.disconnect().unwrap();
    log.wait_n("disconnected", 2);
    let thread_of = |what: &str| -> Vec<String> {
        let ran = ran.lock().unwrap();
        ran.iter()
            .filter(|(e, _)| e == what)
            .map(|(_, t)| t.clone())
            .collect()
    };
    // Logged before it is noted here: the last note may still be on its way.
    assert!(eventually(T, || thread_of("disconnected").len() == 2));
    let all = ran.lock().unwrap().clone();
    assert_eq!(thread_of("request hello"), ["rcm-iw-127.0.0.1"], "{all:?}");
    assert_eq!(
        thread_of("established inline"),
        ["rcm-iw-127.0.0.2"],
        "{all:?}"
    );
    // The server's DISCONNECTED comes from the client's close, read on the server's thread.
    assert!(
        thread_of("disconnected").contains(&"rcm-iw-127.0.0.1".to_string()),
        "{all:?}"
    );
    for id in [c, s, l] {
        assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
    }
    assert_clean(&f);
    f.shutdown();
}

/// An iWARP device opens on an address whose every ephemeral port is held, as thousands of
/// short connections on loopback leave them in TIME_WAIT for a minute: opening one asks
/// only whether the address is this host's, and takes no port ("Address already in use"
/// before, from a bind to port 0). Runs [`zz_full_port_range`] in a network namespace of
/// its own (`unshare --net`, root), where the ephemeral range can be narrowed to two ports.
#[test]
fn an_iwarp_device_opens_when_every_ephemeral_port_is_held() {
    let can = std::process::Command::new("unshare")
        .args(["--net", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !can {
        assert!(
            std::env::var_os("RCM_REQUIRE_ROOT").is_none(),
            "`unshare --net` failed: this test needs root"
        );
        eprintln!("skipped: `unshare --net` failed (this test needs root)");
        return;
    }
    let exe = std::env::current_exe().expect("the test binary");
    let out = std::process::Command::new("unshare")
        .arg("--net")
        .arg(exe)
        .args(["--exact", "zz_full_port_range", "--ignored", "--nocapture"])
        .env("RCM_IW_FULL_RANGE", "1")
        .output()
        .expect("unshare runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(text.contains("1 passed"), "the helper did not run: {text}");
}

/// Not a test on its own: run by [`an_iwarp_device_opens_when_every_ephemeral_port_is_held`]
/// inside a network namespace of its own.
#[test]
#[ignore = "helper: run by an_iwarp_device_opens_when_every_ephemeral_port_is_held in a network namespace"]
fn zz_full_port_range() {
    assert!(
        std::env::var_os("RCM_IW_FULL_RANGE").is_some(),
        "run by an_iwarp_device_opens_when_every_ephemeral_port_is_held inside `unshare --net`"
    );
    let up = std::process::Command::new("ip")
        .args(["link", "set", "lo", "up"])
        .status()
        .expect("ip (iproute2)");
    assert!(up.success(), "lo up");
    std::fs::write("/proc/sys/net/ipv4/ip_local_port_range", "40000 40001")
        .expect("the namespace's ephemeral range");
    let _held: Vec<std::net::TcpListener> = [40000, 40001]
        .into_iter()
        .map(|p| std::net::TcpListener::bind(addr(1, p)).expect("a port of the range held"))
        .collect();
    let e = std::net::TcpListener::bind(addr(1, 0)).expect_err("no ephemeral port is free");
    assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse);
    let f = iw_fabric(&[1]);
    let l = f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
    l.bind(addr(1, 27961)).expect("bind");
    l.listen(0).expect("the device listens");
    assert_eq!(l.destroy(), Ok(DestroyOutcome::Done));
    f.shutdown();
}
