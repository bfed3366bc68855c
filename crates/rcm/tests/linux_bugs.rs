//! Tests named after the Linux RDMA CM bugs of `linux-cm.md` §5 (1–14; the multicast ones,
//! 4, 5 and 6, excepted: rcm has no multicast). Each reproduces the race or misuse that broke
//! Linux, in rcm's terms, and checks rcm survives it: no panic, no hang, typed errors, every
//! context dropped exactly once, no id, port or engine endpoint left behind.
//!
//! Every test runs its own fabric on a UDP port of its own (25200–25399).
#![cfg(not(loom))]

use rcm::{
    any_addr, AcceptOptions, CmId, ConnectOptions, DestroyOutcome, Error, Event, EventChannel,
    Fabric, Flow, PortSpace, QpState, Removal, State, Unreachable,
};
use rcm_wire::cm::RejReason;
use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Barrier, Mutex};
use std::thread;
use std::time::{Duration, Instant};

mod common;
use common::*;
mod raw_peer;

/// Every event that arrives on `ch` within `d`, as (id key, name).
fn drain(ch: &EventChannel, d: Duration) -> Vec<(u64, &'static str)> {
    let end = Instant::now() + d;
    let mut out = Vec::new();
    loop {
        let left = end.saturating_duration_since(Instant::now());
        let Some(mut e) = ch.get_event(Some(left)) else {
            return out;
        };
        let k = e.id().key();
        if let Some(ev) = e.take() {
            out.push((k, ev.name()));
        }
    }
}

/// Drives a channel-mode client on `cli` to `Connect` (REQ sent) towards `dst`.
fn client_connect(f: &Fabric, cli: &EventChannel, ps: PortSpace, dst: SocketAddr) -> CmId {
    let client = f.create_id_on(ps, cli);
    client.resolve_addr(None, dst).unwrap();
    expect_ev(cli, &client, "ADDR_RESOLVED");
    client.resolve_route().unwrap();
    expect_ev(cli, &client, "ROUTE_RESOLVED");
    client.connect(&ConnectOptions::default()).unwrap();
    client
}

struct Pair {
    srv: EventChannel,
    cli: EventChannel,
    listener: CmId,
    client: CmId,
    child: CmId,
}

/// A channel-mode connection: listener on 127.0.0.1:`port`, client on 127.0.0.2.
fn channel_pair(f: &Fabric, port: u16) -> Pair {
    let srv = EventChannel::new();
    let cli = EventChannel::new();
    let listener = f.create_id_on(PortSpace::Tcp, &srv);
    listener.bind(addr(1, port)).unwrap();
    listener.listen(0).unwrap();
    let client = client_connect(f, &cli, PortSpace::Tcp, addr(1, port));
    let (child, ev) = next(&srv);
    assert!(matches!(ev, Event::ConnectRequest { .. }), "{ev:?}");
    child.accept(&AcceptOptions::default()).unwrap();
    expect_ev(&cli, &client, "CONNECT_RESPONSE");
    client.establish().unwrap();
    expect_ev(&cli, &client, "ESTABLISHED");
    expect_ev(&srv, &child, "ESTABLISHED");
    Pair {
        srv,
        cli,
        listener,
        client,
        child,
    }
}

/// Waits (bounded) for every engine endpoint to leave timewait.
fn assert_engines_drain(f: &Fabric) {
    assert!(
        eventually(Duration::from_secs(15), || f.engine_ceps() == 0),
        "engine endpoints left after timewait: {}",
        f.engine_ceps()
    );
}

/// A small xorshift generator (deterministic per seed, no dependency).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

// ----- Bug 1 -------------------------------------------------------------------------------

/// Linux bug 1 (CVE-2020-36385): `ucma_destroy_id` on file A raced `ucma_migrate_id(A→B)` and
/// `close(B)`; close freed the context destroy was still waiting on. Here, per round: an id
/// with queued events and one held event migrates back and forth between channels A and B
/// while another thread destroys it (blocking or not) and a third reads from both channels
/// and then drops ("closes") its handle on B. Every call returns a typed result, no event is
/// read after a destroy returned `Done`, the destroy completes once the held event is acked,
/// the context is dropped exactly once, and nothing is left behind.
#[test]
fn bug01_migrate_vs_destroy_vs_close() {
    let f = fabric(25201);
    for round in 0..150u32 {
        let a = EventChannel::new();
        let b = EventChannel::new();
        let ctx = Arc::new(AtomicUsize::new(0));
        let id = f.create_id_on(PortSpace::Tcp, &a);
        id.set_context(Tracked(ctx.clone()));
        for n in 0..8 {
            poke(&id, n);
        }
        let held = a.get_event(Some(T)).unwrap();
        let destroyed = Arc::new(AtomicBool::new(false));
        let late = Arc::new(AtomicUsize::new(0));
        let start = Arc::new(Barrier::new(4));

        let migrator = {
            let (id, a, b, start) = (id.clone(), a.clone(), b.clone(), start.clone());
            thread::spawn(move || {
                start.wait();
                for _ in 0..20 {
                    for to in [&b, &a] {
                        match id.migrate(to) {
                            Ok(()) | Err(Error::Destroyed) => {}
                            other => panic!("migrate: {other:?}"),
                        }
                    }
                }
            })
        };
        let destroyer = {
            let (id, d, start) = (id.clone(), destroyed.clone(), start.clone());
            thread::spawn(move || {
                start.wait();
                if round % 2 == 0 {
                    match id.destroy() {
                        Ok(DestroyOutcome::Done) => d.store(true, Ordering::SeqCst),
                        Err(Error::EventsOutstanding(_)) => {}
                        other => panic!("destroy: {other:?}"),
                    }
                }
                id.begin_destroy()
            })
        };
        let closer = {
            let (a, d, l, start) = (a.clone(), destroyed.clone(), late.clone(), start.clone());
            let b = b.clone();
            thread::spawn(move || {
                start.wait();
                for _ in 0..10 {
                    for ch in [&a, &b] {
                        if let Some(e) = ch.get_event(Some(Duration::ZERO)) {
                            if d.load(Ordering::SeqCst) {
                                l.fetch_add(1, Ordering::SeqCst);
                            }
                            drop(e);
                        }
                    }
                }
                drop(b);
            })
        };
        start.wait();
        drop(b);
        if round % 3 == 0 {
            thread::yield_now();
        }
        drop(held);
        migrator.join().unwrap();
        let handle = destroyer.join().unwrap();
        closer.join().unwrap();
        assert!(handle.wait_for(T), "round {round}: destroy never completed");
        assert_eq!(late.load(Ordering::SeqCst), 0, "round {round}: late event");
        assert_eq!(
            ctx.load(Ordering::SeqCst),
            1,
            "round {round}: context drops"
        );
        assert!(a.get_event(Some(Duration::ZERO)).is_none());
        assert_eq!(id.migrate(&a), Err(Error::Destroyed));
        assert_eq!(f.live_ids(), 0, "round {round}");
    }
    assert_eq!(f.bound_ports(), 0);
    f.shutdown();
}

// ----- Bug 2 -------------------------------------------------------------------------------

/// Linux bug 2 (7c11910783a1): ucma let several threads call into the CM on one id at once
/// (resolve_route vs connect vs destroy …) and the CM broke. Here six threads fire random
/// operations at one channel-mode id (every one of the API) while a consumer takes and acks
/// its events and a listener accepts whatever arrives; a random thread destroys it at the
/// end. Every result is `Ok` or a typed error, the one-shot transitions succeed at most once,
/// every context set is dropped exactly once, and nothing is left behind.
#[test]
fn bug02_concurrent_calls_on_one_id() {
    let f = fabric(25202);
    let children = Arc::new(Mutex::new(Vec::new()));
    let kids = children.clone();
    let listener = f.create_id(PortSpace::Tcp, move |id, ev| {
        match ev {
            Event::ConnectRequest { .. } => {
                kids.lock().unwrap().push(id.clone());
                let _ = id.accept(&AcceptOptions::default());
            }
            Event::Disconnected
            | Event::Rejected { .. }
            | Event::Unreachable(_)
            | Event::ConnectError(_) => return Flow::Destroy,
            _ => {}
        }
        Flow::Continue
    });
    listener.bind(addr(1, 7000)).unwrap();
    listener.listen(0).unwrap();
    let set = Arc::new(AtomicUsize::new(0));
    let drops = Arc::new(AtomicUsize::new(0));
    for round in 0..60u64 {
        let chans = [EventChannel::new(), EventChannel::new()];
        let id = f.create_id_on(PortSpace::Tcp, &chans[0]);
        let stop = Arc::new(AtomicBool::new(false));
        let consumer = {
            let (chans, stop) = (chans.clone(), stop.clone());
            thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    for ch in &chans {
                        if let Some(e) = ch.get_event(Some(Duration::from_millis(2))) {
                            if e.id().key() % 2 == 0 {
                                thread::yield_now();
                            }
                            drop(e);
                        }
                    }
                }
            })
        };
        let oks: Arc<Mutex<HashMap<&'static str, usize>>> = Arc::default();
        let start = Arc::new(Barrier::new(6));
        let killer = round % 6;
        let hs: Vec<_> = (0..6u64)
            .map(|t| {
                let (id, chans, oks, start) =
                    (id.clone(), chans.clone(), oks.clone(), start.clone());
                let (set, drops) = (set.clone(), drops.clone());
                thread::spawn(move || {
                    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (round << 8) ^ (t + 1));
                    start.wait();
                    for step in 0..40 {
                        let (name, r): (&'static str, Result<(), Error>) = match rng.below(17) {
                            0 => ("resolve_addr", id.resolve_addr(None, addr(1, 7000))),
                            1 => (
                                "resolve_addr_bad",
                                id.resolve_addr(None, unreachable_dst(1)),
                            ),
                            2 => ("resolve_route", id.resolve_route()),
                            3 => ("connect", id.connect(&ConnectOptions::default())),
                            4 => ("establish", id.establish()),
                            5 => ("disconnect", id.disconnect()),
                            6 => ("bind", id.bind(addr(2, 0))),
                            7 => ("listen", id.listen(0)),
                            8 => ("init_qp_attr", id.init_qp_attr(QpState::Rtr).map(|_| ())),
                            9 => ("create_qp", id.create_qp().map(|_| ())),
                            10 => ("destroy_qp", id.destroy_qp()),
                            11 => {
                                id.set_context(Tracked(drops.clone()));
                                set.fetch_add(1, Ordering::SeqCst);
                                ("set_context", Ok(()))
                            }
                            12 => ("migrate", id.migrate(&chans[rng.below(2) as usize])),
                            13 => {
                                let _ = (id.state(), id.local_addr(), id.peer_addr());
                                ("query", Ok(()))
                            }
                            14 => ("accept", id.accept(&AcceptOptions::default())),
                            15 => ("reject", id.reject(&[])),
                            _ => ("state", Ok(())),
                        };
                        if let Err(e) = &r {
                            // A typed error, consistent with the id being alive or not.
                            assert!(!matches!(e, Error::Io(_) | Error::NoPorts), "{name}: {e:?}");
                        } else {
                            *oks.lock().unwrap().entry(name).or_default() += 1;
                        }
                        if t == killer && step == 30 {
                            match id.destroy() {
                                Ok(_) | Err(Error::EventsOutstanding(_)) => {}
                                Err(e) => panic!("destroy: {e:?}"),
                            }
                            drop(id.begin_destroy());
                        }
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        stop.store(true, Ordering::SeqCst);
        consumer.join().unwrap();
        assert!(
            id.begin_destroy().wait_for(T),
            "round {round}: the id was never destroyed"
        );
        // A context set after the destroy lives as long as the last handle.
        drop(id);
        let oks = oks.lock().unwrap();
        for once in ["bind", "listen", "connect", "resolve_route"] {
            assert!(
                oks.get(once).copied().unwrap_or(0) <= 1,
                "round {round}: {once} succeeded {:?} times",
                oks.get(once)
            );
        }
        assert!(
            !(oks.contains_key("listen") && oks.contains_key("connect")),
            "round {round}: both listen and connect succeeded"
        );
        assert_eq!(
            drops.load(Ordering::SeqCst),
            set.load(Ordering::SeqCst),
            "round {round}: every context set was dropped exactly once"
        );
    }
    listener.destroy().unwrap();
    for c in children.lock().unwrap().drain(..) {
        assert!(c.begin_destroy().wait_for(T));
    }
    assert_eq!(f.live_ids(), 0);
    assert_eq!(f.bound_ports(), 0);
    assert_engines_drain(&f);
    f.shutdown();
}

// ----- Bug 3 -------------------------------------------------------------------------------

fn wait_pending(ch: &EventChannel, n: usize) {
    assert!(
        eventually(T, || ch.pending() >= n),
        "only {} of {n} events queued",
        ch.pending()
    );
}

/// Linux bug 3: child ids of connect requests were half-created until user space read the
/// CONNECT_REQUEST, and destroying the listener with unread requests raced with GET_EVENT.
/// Here a channel-mode listener with four unread requests is destroyed: it completes at
/// once, the unread requests die with it (their clients are rejected), none of them is ever
/// delivered, and no id is left but the clients.
#[test]
fn bug03_destroy_listener_with_unread_requests() {
    let f = fabric(25203);
    let srv = EventChannel::new();
    let listener = f.create_id_on(PortSpace::Tcp, &srv);
    listener.bind(addr(1, 7000)).unwrap();
    listener.listen(0).unwrap();
    let cli = EventChannel::new();
    let clients: Vec<CmId> = (0..4)
        .map(|_| client_connect(&f, &cli, PortSpace::Tcp, addr(1, 7000)))
        .collect();
    wait_pending(&srv, 4);
    assert_eq!(f.live_ids(), 9, "listener, 4 clients, 4 children");
    let r = within(T, move || listener.destroy()).expect("listener destroy hung");
    assert_eq!(r, Ok(DestroyOutcome::Done));
    assert_eq!(
        f.live_ids(),
        4,
        "the unread children died with their listener"
    );
    assert!(srv.get_event(Some(Duration::from_millis(200))).is_none());
    let mut outcomes: Vec<_> = (0..4)
        .map(|_| {
            let (who, ev) = next(&cli);
            assert!(clients.contains(&who));
            match ev {
                Event::Rejected { reason, .. } => reason,
                other => panic!("client got {other:?}"),
            }
        })
        .collect();
    outcomes.dedup();
    assert_eq!(outcomes, vec![RejReason::ConsumerDefined]);
    for c in clients {
        c.destroy().unwrap();
    }
    assert_eq!(f.live_ids(), 0);
    assert_eq!(f.bound_ports(), 0);
    f.shutdown();
}

/// Linux bug 3, device-removal half: the listener's device goes away with unread requests.
/// Every event on the listener's channel is then a `DeviceRemoval` (the unread
/// CONNECT_REQUESTs are replaced, never delivered), one per id, the listener's among them; a
/// child whose `DeviceRemoval` is still unread when the listener is destroyed dies with it
/// (its request was never seen). Destroying them completes the removal; only the clients
/// remain.
#[test]
fn bug03_device_removal_with_unread_requests() {
    let f = fabric(25204);
    let srv = EventChannel::new();
    let listener = f.create_id_on(PortSpace::Tcp, &srv);
    listener.bind(addr(1, 7000)).unwrap();
    listener.listen(0).unwrap();
    let cli = EventChannel::new();
    let clients: Vec<CmId> = (0..4)
        .map(|_| client_connect(&f, &cli, PortSpace::Tcp, addr(1, 7000)))
        .collect();
    wait_pending(&srv, 4);
    let removal = f.remove_device(ip(1)).unwrap();
    assert_eq!(removal.holding().len(), 5);
    let mut seen = Vec::new();
    while let Some(e) = srv.get_event(Some(Duration::from_millis(300))) {
        assert!(
            matches!(e.event(), Event::DeviceRemoval),
            "{:?} delivered after the removal",
            e.event()
        );
        let id = e.id().clone();
        drop(e);
        assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
        seen.push(id.key());
    }
    let n = seen.len();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen.len(), n, "one DeviceRemoval per id");
    assert!(seen.contains(&listener.key()));
    removal.wait(T).expect("removal completes");
    assert_eq!(f.live_ids(), 4, "only the clients remain");
    for _ in &clients {
        let (who, ev) = next(&cli);
        assert!(clients.contains(&who));
        assert!(
            matches!(ev, Event::Rejected { .. } | Event::Unreachable(_)),
            "{ev:?}"
        );
    }
    for c in clients {
        c.destroy().unwrap();
    }
    assert_eq!(f.live_ids(), 0);
    f.shutdown();
}

/// Linux bug 3, callback mode: the connect requests are queued behind a busy dispatcher when
/// the listener is destroyed: the handler is never called for them and their clients are
/// rejected.
#[test]
fn bug03_callback_listener_destroyed_with_queued_requests() {
    let mut cfg = config(25205);
    cfg.dispatcher_threads = 1;
    let f = Fabric::loopback_with(2, cfg).unwrap();
    let (blocker, gate) = busy_callback(&f);
    let calls = Arc::new(AtomicUsize::new(0));
    let ctx = Arc::new(AtomicUsize::new(0));
    let (c, keep) = (calls.clone(), Tracked(ctx.clone()));
    let listener = f.create_id(PortSpace::Tcp, move |_, _| {
        let _ = &keep;
        c.fetch_add(1, Ordering::SeqCst);
        Flow::Continue
    });
    listener.bind(addr(1, 7000)).unwrap();
    listener.listen(0).unwrap();
    let cli = EventChannel::new();
    let clients: Vec<CmId> = (0..4)
        .map(|_| client_connect(&f, &cli, PortSpace::Tcp, addr(1, 7000)))
        .collect();
    assert!(
        eventually(T, || f.live_ids() == 10),
        "children not built: {} ids",
        f.live_ids()
    );
    assert_eq!(listener.destroy(), Ok(DestroyOutcome::Done));
    assert_eq!(f.live_ids(), 5, "blocker and clients remain");
    assert_eq!(ctx.load(Ordering::SeqCst), 1, "the handler's captures");
    gate.open();
    for _ in 0..4 {
        let (who, ev) = next(&cli);
        assert!(clients.contains(&who));
        assert!(matches!(ev, Event::Rejected { .. }), "{ev:?}");
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        0,
        "a queued request was delivered"
    );
    for c in clients {
        c.destroy().unwrap();
    }
    blocker.destroy().unwrap();
    assert_eq!(f.live_ids(), 0);
    f.shutdown();
}

// ----- Bug 7 -------------------------------------------------------------------------------

/// Linux bug 7 (CVE-2021-47391): after an ADDR_ERROR a second `rdma_resolve_addr` re-armed
/// the resolver while the first request was still queued. rcm resolves synchronously and
/// delivers the result as an event, so the analogue is: resolve to an unreachable address,
/// resolve again at once (before or after the error event is read), in a loop. Each call's
/// event arrives exactly once and in order, a failed resolution changes nothing (state,
/// address, port), and destroying right after a resolution discards its pending event.
#[test]
fn bug07_resolve_again_after_addr_error() {
    let f = fabric(25207);
    let ch = EventChannel::new();
    for round in 0..300u32 {
        let id = f.create_id_on(PortSpace::Tcp, &ch);
        if round % 3 == 1 {
            id.bind(addr(2, 0)).unwrap();
        }
        let (state0, src0, ports0) = (id.state(), id.local_addr(), f.bound_ports());
        poke(&id, round);
        assert_eq!(
            (id.state(), id.local_addr(), f.bound_ports()),
            (state0, src0, ports0),
            "a failed resolution changed the id"
        );
        if round % 2 == 0 {
            let ev = expect_ev(&ch, &id, "ADDR_ERROR");
            assert_eq!(seq_of(&ev), Some(round));
        }
        id.resolve_addr(None, addr(1, 7000)).unwrap();
        assert_eq!(id.state(), State::AddrResolved);
        if round % 5 == 4 {
            // Destroy with the results still queued: never delivered.
            assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
            assert!(ch.get_event(Some(Duration::ZERO)).is_none());
            continue;
        }
        if round % 2 == 1 {
            let ev = expect_ev(&ch, &id, "ADDR_ERROR");
            assert_eq!(seq_of(&ev), Some(round));
        }
        expect_ev(&ch, &id, "ADDR_RESOLVED");
        assert_eq!(
            id.resolve_addr(None, addr(1, 7000)),
            Err(Error::InvalidState(State::AddrResolved))
        );
        id.resolve_route().unwrap();
        assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
        assert!(
            ch.get_event(Some(Duration::ZERO)).is_none(),
            "a destroyed id's route result was delivered"
        );
    }
    // Callback mode: the next resolution is issued from inside the error callback.
    let (tx, rx) = mpsc::channel();
    let tx = Mutex::new(tx);
    let id = f.create_id(PortSpace::Tcp, move |id, ev| {
        tx.lock().unwrap().send(ev.name()).unwrap();
        if let Some(n) = seq_of(&ev) {
            if n < 50 {
                poke(id, n + 1);
            } else {
                id.resolve_addr(None, addr(1, 7000)).unwrap();
            }
        }
        Flow::Continue
    });
    poke(&id, 0);
    let names: Vec<_> = (0..52).map(|_| rx.recv_timeout(T).unwrap()).collect();
    assert!(names[..51].iter().all(|n| *n == "ADDR_ERROR"));
    assert_eq!(names[51], "ADDR_RESOLVED");
    assert!(rx.recv_timeout(Duration::from_millis(100)).is_err());
    id.destroy().unwrap();
    assert_eq!(f.live_ids(), 0);
    assert_eq!(f.bound_ports(), 0);
    f.shutdown();
}

// ----- Bug 8 -------------------------------------------------------------------------------

/// What a failed call must leave as it was.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Snap {
    state: State,
    local: Option<SocketAddr>,
    peer: Option<SocketAddr>,
    device: Option<IpAddr>,
    ctx: Option<u32>,
    ports: usize,
    ids: usize,
}

fn snap(f: &Fabric, id: &CmId) -> Snap {
    Snap {
        state: id.state(),
        local: id.local_addr(),
        peer: id.peer_addr(),
        device: id.device_addr(),
        ctx: id.with_context(|c: &u32| *c),
        ports: f.bound_ports(),
        ids: f.live_ids(),
    }
}

/// One id in a known state, with what was needed to get it there.
struct Case {
    id: CmId,
    /// The channel the id's events go to (`None`: callback mode).
    ch: Option<EventChannel>,
    /// Whether no event for the id can arrive on its own while an operation runs.
    quiet: bool,
    others: Vec<CmId>,
    removal: Option<Removal>,
}

struct Lab {
    f: Fabric,
    port: AtomicU32,
    extra: AtomicU32,
}

impl Lab {
    fn port(&self) -> u16 {
        self.port.fetch_add(1, Ordering::SeqCst) as u16
    }

    fn case(id: CmId, ch: Option<EventChannel>, quiet: bool, others: Vec<CmId>) -> Case {
        Case {
            id,
            ch,
            quiet,
            others,
            removal: None,
        }
    }

    fn idle(&self, ps: PortSpace) -> Case {
        let ch = EventChannel::new();
        let id = self.f.create_id_on(ps, &ch);
        Self::case(id, Some(ch), true, vec![])
    }

    fn resolved(&self, route: bool) -> Case {
        let c = self.idle(PortSpace::Tcp);
        let ch = c.ch.clone().unwrap();
        c.id.resolve_addr(None, addr(1, self.port())).unwrap();
        expect_ev(&ch, &c.id, "ADDR_RESOLVED");
        if route {
            c.id.resolve_route().unwrap();
            expect_ev(&ch, &c.id, "ROUTE_RESOLVED");
        }
        c
    }

    fn listening(&self, wildcard: bool) -> Case {
        let c = self.idle(PortSpace::Tcp);
        let a = if wildcard {
            any_addr(false, self.port())
        } else {
            addr(1, self.port())
        };
        c.id.bind(a).unwrap();
        c.id.listen(0).unwrap();
        c
    }

    /// Listener (channel `srv`) and a client that sent its REQ (channel `cli`).
    fn requested(&self, ps: PortSpace) -> (CmId, EventChannel, CmId, EventChannel, CmId) {
        let srv = EventChannel::new();
        let cli = EventChannel::new();
        let port = self.port();
        let listener = self.f.create_id_on(ps, &srv);
        listener.bind(addr(1, port)).unwrap();
        listener.listen(0).unwrap();
        let client = client_connect(&self.f, &cli, ps, addr(1, port));
        let (child, ev) = next(&srv);
        assert!(matches!(ev, Event::ConnectRequest { .. }), "{ev:?}");
        (listener, srv, client, cli, child)
    }

    fn build(&self, name: &str) -> Case {
        match name {
            "idle" => self.idle(PortSpace::Tcp),
            "idle_udp" => self.idle(PortSpace::Udp),
            "idle_callback" => {
                let id = self.f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
                Self::case(id, None, true, vec![])
            }
            "addr_bound" => {
                let c = self.idle(PortSpace::Tcp);
                c.id.bind(addr(2, 0)).unwrap();
                c
            }
            "addr_bound_wildcard" => {
                let c = self.idle(PortSpace::Tcp);
                c.id.bind(any_addr(false, 0)).unwrap();
                c
            }
            "addr_resolved" => self.resolved(false),
            "route_resolved" => self.resolved(true),
            "listen" => self.listening(false),
            "listen_wildcard" => self.listening(true),
            "connect_active" => {
                let (l, _, client, cli, child) = self.requested(PortSpace::Tcp);
                Self::case(client, Some(cli), false, vec![l, child])
            }
            "connect_active_rep" => {
                let (l, _, client, cli, child) = self.requested(PortSpace::Tcp);
                child.accept(&AcceptOptions::default()).unwrap();
                expect_ev(&cli, &client, "CONNECT_RESPONSE");
                Self::case(client, Some(cli), false, vec![l, child])
            }
            "connect_passive" => {
                let (l, srv, client, _, child) = self.requested(PortSpace::Tcp);
                Self::case(child, Some(srv), false, vec![l, client])
            }
            "connect_passive_accepted" => {
                let (l, srv, client, cli, child) = self.requested(PortSpace::Tcp);
                child.accept(&AcceptOptions::default()).unwrap();
                expect_ev(&cli, &client, "CONNECT_RESPONSE");
                Self::case(child, Some(srv), false, vec![l, client])
            }
            "established_active"
            | "established_passive"
            | "disconnect_active"
            | "disconnect_passive" => {
                let p = channel_pair(&self.f, self.port());
                if name.starts_with("disconnect") {
                    p.client.disconnect().unwrap();
                    expect_ev(&p.srv, &p.child, "DISCONNECTED");
                    expect_ev(&p.cli, &p.client, "DISCONNECTED");
                }
                let quiet = name.starts_with("established");
                if name.ends_with("active") && !name.ends_with("passive") {
                    Self::case(p.client, Some(p.cli), quiet, vec![p.listener, p.child])
                } else {
                    Self::case(p.child, Some(p.srv), quiet, vec![p.listener, p.client])
                }
            }
            "established_ud_active" | "established_ud_passive" => {
                let (l, srv, client, cli, child) = self.requested(PortSpace::Udp);
                child.accept(&AcceptOptions::default()).unwrap();
                expect_ev(&cli, &client, "ESTABLISHED");
                if name.ends_with("active") {
                    Self::case(client, Some(cli), true, vec![l, child])
                } else {
                    Self::case(child, Some(srv), true, vec![l, client])
                }
            }
            "rejected_active" => {
                let (l, _, client, cli, child) = self.requested(PortSpace::Tcp);
                child.reject(b"no").unwrap();
                expect_ev(&cli, &client, "REJECTED");
                Self::case(client, Some(cli), false, vec![l, child])
            }
            "device_removal" => {
                let n = self.extra.fetch_add(1, Ordering::SeqCst);
                let dev = IpAddr::from([127, 0, 1, (n + 1) as u8]);
                self.f.add_device(dev).unwrap();
                let c = self.idle(PortSpace::Tcp);
                c.id.bind(SocketAddr::new(dev, 0)).unwrap();
                let removal = self.f.remove_device(dev).unwrap();
                expect_ev(c.ch.as_ref().unwrap(), &c.id, "DEVICE_REMOVAL");
                Case {
                    removal: Some(removal),
                    ..c
                }
            }
            "destroying" => {
                let c = self.idle(PortSpace::Tcp);
                c.id.destroy().unwrap();
                c
            }
            other => panic!("no state {other}"),
        }
    }
}

type Op = fn(&CmId) -> Result<(), Error>;

fn ops() -> Vec<(&'static str, Op)> {
    vec![
        ("bind", |id| id.bind(addr(2, 0))),
        ("bind_wildcard", |id| id.bind(any_addr(false, 0))),
        ("bind_absent_addr", |id| id.bind(addr(99, 0))),
        ("resolve_addr", |id| id.resolve_addr(None, addr(1, 9))),
        ("resolve_addr_unreachable", |id| {
            id.resolve_addr(None, unreachable_dst(9))
        }),
        ("resolve_addr_absent_src", |id| {
            id.resolve_addr(Some(ip(99)), addr(1, 9))
        }),
        ("resolve_route", CmId::resolve_route),
        ("listen", |id| id.listen(0)),
        ("connect", |id| id.connect(&ConnectOptions::default())),
        ("connect_pd_too_long", |id| {
            id.connect(&ConnectOptions {
                private_data: vec![0; 200],
                ..ConnectOptions::default()
            })
        }),
        ("accept", |id| id.accept(&AcceptOptions::default())),
        ("accept_pd_too_long", |id| {
            id.accept(&AcceptOptions {
                private_data: vec![0; 197],
                ..AcceptOptions::default()
            })
        }),
        ("reject", |id| id.reject(b"x")),
        ("reject_pd_too_long", |id| id.reject(&[0; 149])),
        ("establish", CmId::establish),
        ("disconnect", CmId::disconnect),
        ("init_qp_attr_init", |id| {
            id.init_qp_attr(QpState::Init).map(|_| ())
        }),
        ("init_qp_attr_rtr", |id| {
            id.init_qp_attr(QpState::Rtr).map(|_| ())
        }),
        ("init_qp_attr_rts", |id| {
            id.init_qp_attr(QpState::Rts).map(|_| ())
        }),
        ("create_qp", |id| id.create_qp().map(|_| ())),
        ("destroy_qp", CmId::destroy_qp),
        ("migrate", |id| id.migrate(&EventChannel::new())),
        ("destroy", |id| id.destroy().map(|_| ())),
        ("begin_destroy", |id| {
            if id.begin_destroy().wait_for(T) {
                Ok(())
            } else {
                Err(Error::InvalidArgument(
                    "begin_destroy never completed".into(),
                ))
            }
        }),
    ]
}

/// Linux bug 8 (22e9f71072fa and friends, CVE-2023-2176): `rdma_resolve_addr` /
/// `rdma_bind_addr` on a LISTENing id overwrote its source address before failing the state
/// check, and the listener's teardown then took the wrong branch. The fix's test, as the
/// reference suggests: call every operation in every state; a failed call changes nothing
/// observable (state, addresses, device, context, ports, ids, no event), `InvalidState`
/// names the id's actual state, after `DeviceRemoval` everything but destroy fails with
/// `DeviceRemoved`, after destroy everything fails with `Destroyed` / `InvalidState(Destroying)`.
/// Nothing panics.
#[test]
fn bug08_failed_call_mutates_nothing() {
    let lab = Lab {
        f: fabric(25208),
        port: AtomicU32::new(10000),
        extra: AtomicU32::new(0),
    };
    // The Linux scenario itself: a listener asked to resolve / bind elsewhere.
    let l = lab.listening(false);
    let before = snap(&lab.f, &l.id);
    assert_eq!(
        l.id.resolve_addr(None, unreachable_dst(1)),
        Err(Error::InvalidState(State::Listen))
    );
    assert_eq!(
        l.id.bind(SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0)),
        Err(Error::InvalidState(State::Listen))
    );
    assert_eq!(snap(&lab.f, &l.id), before);
    let port = before.local.unwrap().port();
    let cli = EventChannel::new();
    let c = client_connect(&lab.f, &cli, PortSpace::Tcp, addr(1, port));
    let (child, ev) = next(l.ch.as_ref().unwrap());
    assert!(
        matches!(ev, Event::ConnectRequest { .. }),
        "still listening: {ev:?}"
    );
    for id in [&child, &c, &l.id] {
        id.destroy().unwrap();
    }
    let again = lab.f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
    again
        .bind(addr(1, port))
        .expect("the listener's port was released");
    again.destroy().unwrap();

    let states = [
        "idle",
        "idle_udp",
        "idle_callback",
        "addr_bound",
        "addr_bound_wildcard",
        "addr_resolved",
        "route_resolved",
        "listen",
        "listen_wildcard",
        "connect_active",
        "connect_active_rep",
        "connect_passive",
        "connect_passive_accepted",
        "established_active",
        "established_passive",
        "established_ud_active",
        "established_ud_passive",
        "disconnect_active",
        "disconnect_passive",
        "rejected_active",
        "device_removal",
        "destroying",
    ];
    let mut problems = Vec::new();
    let mut table = Vec::new();
    for state in states {
        for (op, call) in ops() {
            let case = lab.build(state);
            case.id.set_context(7u32);
            let id = case.id.clone();
            let before = snap(&lab.f, &id);
            let pending = case.ch.as_ref().map(EventChannel::pending);
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| call(&id)));
            let after = snap(&lab.f, &id);
            let Ok(result) = r else {
                problems.push(format!("{state}/{op}: panicked"));
                continue;
            };
            table.push(format!("{state:>26} {op:<24} {result:?}"));
            // Destroy is valid in every state; so is destroy_qp (QpBusy when there is none).
            let special = matches!(op, "destroy" | "begin_destroy" | "destroy_qp");
            if before.state == State::DeviceRemoval && !special && result.is_ok() {
                problems.push(format!("{state}/{op}: succeeded after DeviceRemoval"));
            }
            if before.state == State::Destroying && !special && result.is_ok() {
                problems.push(format!("{state}/{op}: succeeded on a destroyed id"));
            }
            if let Err(e) = &result {
                if after != before {
                    problems.push(format!(
                        "{state}/{op}: failed with {e:?} but changed {before:?} -> {after:?}"
                    ));
                }
                if let Error::InvalidState(s) = e {
                    if *s != before.state {
                        problems.push(format!(
                            "{state}/{op}: InvalidState({s:?}) but the id is {:?}",
                            before.state
                        ));
                    }
                }
                if before.state == State::DeviceRemoval && !special && *e != Error::DeviceRemoved {
                    problems.push(format!("{state}/{op}: {e:?} instead of DeviceRemoved"));
                }
                if before.state == State::Destroying
                    && !special
                    && !matches!(e, Error::Destroyed | Error::InvalidState(State::Destroying))
                {
                    problems.push(format!("{state}/{op}: {e:?} on a destroyed id"));
                }
                if case.quiet && case.ch.as_ref().map(EventChannel::pending) != pending {
                    problems.push(format!(
                        "{state}/{op}: failed with {e:?} but queued an event"
                    ));
                }
            }
            // Clean up the case.
            for x in std::iter::once(&case.id).chain(case.others.iter()) {
                if !x.begin_destroy().wait_for(T) {
                    problems.push(format!("{state}/{op}: cleanup destroy hung"));
                }
            }
            if let Some(rm) = &case.removal {
                if let Err(ids) = rm.wait(T) {
                    problems.push(format!("{state}/{op}: removal held by {ids:?}"));
                }
            }
            if lab.f.live_ids() != 0 || lab.f.bound_ports() != 0 {
                problems.push(format!(
                    "{state}/{op}: left {} ids, {} ports",
                    lab.f.live_ids(),
                    lab.f.bound_ports()
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{} problems:\n{}\n\nall results:\n{}",
        problems.len(),
        problems.join("\n"),
        table.join("\n")
    );
    assert_engines_drain(&lab.f);
    lab.f.shutdown();
}

// ----- Bug 9 -------------------------------------------------------------------------------

/// Connects a fresh client to `dst` and reports whether a listener took the request (the
/// request shows up on `srv`) or the port had no listener there (REJ, invalid service ID).
fn probe(f: &Fabric, srv: Option<&EventChannel>, dst: SocketAddr) -> bool {
    let cli = EventChannel::new();
    let client = client_connect(f, &cli, PortSpace::Tcp, dst);
    let end = Instant::now() + T;
    let taken = loop {
        assert!(Instant::now() < end, "probe of {dst}: no outcome");
        if let Some(srv) = srv {
            if let Some(mut e) = srv.get_event(Some(Duration::from_millis(5))) {
                if let Some(Event::ConnectRequest { .. }) = e.take() {
                    let child = e.id().clone();
                    drop(e);
                    child.destroy().unwrap();
                    break true;
                }
            }
        }
        if let Some(mut e) = cli.get_event(Some(Duration::from_millis(5))) {
            match e.take() {
                Some(Event::Rejected {
                    reason: RejReason::InvalidServiceId,
                    ..
                }) => break false,
                Some(Event::Rejected { .. }) => {}
                other => panic!("probe of {dst}: {other:?}"),
            }
        }
    };
    client.destroy().unwrap();
    taken
}

/// Linux bug 9: a wildcard listen creates one listen per device; when the k-th failed, the
/// ones before it leaked (or the unwind deadlocked). rcm's per-device listen cannot be made
/// to fail through the public API (the port-space check comes before any device is
/// touched), so this is the nearest real analogue: the per-device listen bookkeeping. Failed
/// listen calls leave nothing; destroying a wildcard listener removes its listen from every
/// device (later requests are rejected with "invalid service ID" and the port is free on
/// each); devices removed and added while it listens are followed; and a wildcard listen
/// racing `add_device`, or a destroy racing it, neither misses the new device nor leaks a
/// listen on it.
#[test]
fn bug09_wildcard_listen_unwind() {
    let f = Fabric::loopback_with(3, config(25209)).unwrap();
    let srv = EventChannel::new();
    let w = f.create_id_on(PortSpace::Tcp, &srv);
    w.bind(any_addr(false, 7000)).unwrap();
    w.listen(0).unwrap();
    for d in 1..=3 {
        assert!(probe(&f, Some(&srv), addr(d, 7000)), "device {d}");
    }
    // Failures leave nothing behind.
    let ports = f.bound_ports();
    let s = f.create_id_on(PortSpace::Tcp, &srv);
    assert_eq!(s.bind(addr(1, 7000)), Err(Error::AddrNotAvailable(ip(1))));
    assert_eq!(s.state(), State::Idle);
    assert_eq!(w.listen(0), Err(Error::InvalidState(State::Listen)));
    assert_eq!(f.bound_ports(), ports);
    s.destroy().unwrap();
    // Devices come and go.
    let removal = f.remove_device(ip(3)).unwrap();
    assert!(
        removal.holding().is_empty(),
        "a wildcard listener holds no device"
    );
    removal.wait(T).unwrap();
    f.add_device(ip(4)).unwrap();
    assert!(probe(&f, Some(&srv), addr(4, 7000)), "the added device");
    assert!(srv.get_event(Some(Duration::from_millis(50))).is_none());
    // Teardown removes every per-device listen.
    w.destroy().unwrap();
    for d in [1, 2, 4] {
        assert!(!probe(&f, None, addr(d, 7000)), "device {d} still listens");
    }
    assert_eq!(f.bound_ports(), 0);
    let specific: Vec<CmId> = [1, 2, 4]
        .iter()
        .map(|d| {
            let id = f.create_id_on(PortSpace::Tcp, &srv);
            id.bind(addr(*d, 7000)).unwrap();
            id.listen(0).unwrap();
            id
        })
        .collect();
    for id in specific {
        id.destroy().unwrap();
    }

    // Listen (or destroy) racing add_device. More devices make a wildcard listen take longer
    // (one registration per device), which widens the race.
    for d in 0..30u8 {
        f.add_device(IpAddr::from([127, 0, 5, d + 1])).unwrap();
    }
    let mut missed = Vec::new();
    let mut leaked = Vec::new();
    for round in 0..160u8 {
        let dev = IpAddr::from([127, 0, 2, round + 1]);
        let port = 7100 + u16::from(round);
        let ch = EventChannel::new();
        let w = f.create_id_on(PortSpace::Tcp, &ch);
        w.bind(any_addr(false, port)).unwrap();
        let destroy_race = round % 2 == 1;
        if destroy_race {
            w.listen(0).unwrap();
        }
        let ready = Arc::new(AtomicBool::new(false));
        let go = Arc::new(AtomicBool::new(false));
        let (w2, ready2, go2) = (w.clone(), ready.clone(), go.clone());
        let racer = thread::spawn(move || {
            ready2.store(true, Ordering::SeqCst);
            while !go2.load(Ordering::SeqCst) {
                std::hint::spin_loop();
            }
            if destroy_race {
                w2.destroy().map(|_| ())
            } else {
                w2.listen(0)
            }
        });
        while !ready.load(Ordering::SeqCst) {
            std::hint::spin_loop();
        }
        go.store(true, Ordering::SeqCst);
        // Sweep the relative timing across rounds (0 to some tens of microseconds).
        for _ in 0..(u32::from(round) % 10) * 150 {
            std::hint::spin_loop();
        }
        f.add_device(dev).unwrap();
        racer.join().unwrap().unwrap();
        let dst = SocketAddr::new(dev, port);
        if destroy_race {
            if probe(&f, None, dst) {
                leaked.push(dst);
            }
        } else {
            if !probe(&f, Some(&ch), dst) {
                missed.push(dst);
            }
            w.destroy().unwrap();
        }
    }
    assert!(
        missed.is_empty() && leaked.is_empty(),
        "a wildcard listen racing add_device missed the new device in {} of 80 rounds \
         (first: {:?}); a destroy racing it leaked a listen at {leaked:?}",
        missed.len(),
        &missed[..missed.len().min(5)]
    );
    assert_eq!(f.live_ids(), 0);
    assert_eq!(f.bound_ports(), 0);
    f.shutdown();
}

// ----- Bug 10 ------------------------------------------------------------------------------

/// Collects the events of `id` on `ch` for `d` (acking them), ignoring other ids.
fn events_of(ch: &EventChannel, id: &CmId, d: Duration) -> Vec<&'static str> {
    drain(ch, d)
        .into_iter()
        .filter(|(k, _)| *k == id.key())
        .map(|(_, n)| n)
        .collect()
}

/// Linux bug 10 (45f5dcdd0497, 92a251c3df8e): two neighbour-change notifications for one id
/// re-initialised its pending UNREACHABLE work, and a failed re-queue leaked a reference
/// that hung destroy. rcm has no neighbour events (routes are built locally and never
/// change), so the bug itself cannot occur; this tests the nearest real analogue — the
/// CM's own paths that could notify one id twice — and that destroy then never hangs:
/// (1) a REQ nobody answers: exactly one `Unreachable(Timeout)`; (2) a REP the client never
/// confirms: exactly one `Unreachable(RepTimeout)` on the passive side, however many REP
/// retries and the client's later REJ; (3) both sides disconnect at once (DREQs cross):
/// exactly one `Disconnected` each. After each, destroy completes at once.
#[test]
fn bug10_double_unreachable_notifications() {
    let f = fabric(25210);
    // (1) Silent peer: 127.0.0.9 has no device.
    let cli = EventChannel::new();
    let lost = client_connect(&f, &cli, PortSpace::Tcp, addr(9, 7000));
    let evs = events_of(&cli, &lost, Duration::from_millis(2500));
    assert_eq!(evs, vec!["UNREACHABLE"], "silent peer");
    let r = within(Duration::from_secs(2), move || lost.destroy());
    assert_eq!(r, Some(Ok(DestroyOutcome::Done)));

    // (2) REP never confirmed: a raw peer (127.0.0.2, beside a fabric of its own) reads the
    // REP and its retries and never answers, nor sends anything (a peer that has the REP
    // may answer its retries with an MRA, as Linux's rdma_cm does, which would stretch
    // the wait).
    {
        use rcm_wire::cm::{CmMessage, MsgCode, Rej};
        let g = Fabric::new(config(25217));
        g.add_device(ip(1)).unwrap();
        let peer = raw_peer::RawPeer::new(25217);
        let srv = EventChannel::new();
        let listener = g.create_id_on(PortSpace::Tcp, &srv);
        listener.bind(addr(1, 7000)).unwrap();
        listener.listen(0).unwrap();
        let req = raw_peer::raw_req(7000, ip(1), 1);
        let peer_id = req.local_comm_id;
        peer.send(CmMessage::Req(req), 0x51);
        let (child, _) = next(&srv);
        child.accept(&AcceptOptions::default()).unwrap();
        let CmMessage::Rep(rep) = peer.recv() else {
            panic!("expected the REP")
        };
        let mut got = Vec::new();
        let end = Instant::now() + Duration::from_secs(3);
        while Instant::now() < end {
            if let Some(mut e) = srv.get_event(Some(Duration::from_millis(50))) {
                assert_eq!(e.id(), &child);
                got.push(e.take().unwrap());
            }
        }
        assert_eq!(got.len(), 1, "passive side: {got:?}");
        assert!(
            matches!(got[0], Event::Unreachable(Unreachable::RepTimeout)),
            "{got:?}"
        );
        // The peer's late REJ of the REP changes nothing.
        peer.send(
            CmMessage::Rej(Rej {
                local_comm_id: peer_id,
                remote_comm_id: rep.local_comm_id,
                message_rejected: MsgCode::Rep,
                reason: RejReason::ConsumerDefined,
                ..Rej::default()
            }),
            0x52,
        );
        assert!(
            srv.get_event(Some(Duration::from_millis(300))).is_none(),
            "an event after the REP's timeout"
        );
        for id in [child, listener] {
            let r = within(Duration::from_secs(2), move || id.destroy());
            assert_eq!(r, Some(Ok(DestroyOutcome::Done)));
        }
        g.shutdown();
    }

    // (3) Crossing DREQs.
    for round in 0..10u16 {
        let p = channel_pair(&f, 7100 + round);
        let go = Arc::new(Barrier::new(2));
        let (c, g) = (p.client.clone(), go.clone());
        let t = thread::spawn(move || {
            g.wait();
            c.disconnect()
        });
        go.wait();
        let r_child = p.child.disconnect();
        let r_client = t.join().unwrap();
        for r in [r_child, r_client] {
            assert!(
                matches!(r, Ok(()) | Err(Error::InvalidState(State::Disconnect))),
                "{r:?}"
            );
        }
        let c_evs = events_of(&p.cli, &p.client, Duration::from_millis(400));
        let s_evs = events_of(&p.srv, &p.child, Duration::from_millis(100));
        for (who, evs) in [("client", &c_evs), ("child", &s_evs)] {
            assert_eq!(
                evs.iter().filter(|n| **n == "DISCONNECTED").count(),
                1,
                "round {round}: {who} got {evs:?}"
            );
            assert!(
                evs.iter()
                    .all(|n| matches!(*n, "DISCONNECTED" | "TIMEWAIT_EXIT")),
                "round {round}: {who} got {evs:?}"
            );
        }
        for id in [p.child, p.client, p.listener] {
            let r = within(Duration::from_secs(2), move || id.destroy());
            assert_eq!(r, Some(Ok(DestroyOutcome::Done)), "round {round}");
        }
    }
    assert_eq!(f.live_ids(), 0);
    assert_engines_drain(&f);
    f.shutdown();
}

// ----- Bug 11 ------------------------------------------------------------------------------

/// Linux bug 11 (aee2424246f9, CVE-2025-38211): `rdma_destroy_id` freed the id while the
/// iWARP CM still had event work for it queued. Here a burst of provider events (address,
/// route, REP, established, DREQ) is queued for a callback-mode id behind a busy dispatcher,
/// then the id is destroyed: destroy completes at once, none of the events is ever
/// delivered, the context goes exactly once. Then the same with the id's own callback in
/// flight (destroy waits for it, the rest is discarded), in channel mode (the queued events
/// are purged), and destroys at random moments of connections churning (no callback after
/// destroy returned).
#[test]
fn bug11_destroy_with_queued_provider_events() {
    let mut cfg = config(25211);
    cfg.dispatcher_threads = 1;
    let f = Fabric::loopback_with(2, cfg).unwrap();
    let srv = EventChannel::new();
    let listener = f.create_id_on(PortSpace::Tcp, &srv);
    listener.bind(addr(1, 7000)).unwrap();
    listener.listen(0).unwrap();

    // Burst queued behind a blocked dispatcher.
    let (blocker, gate) = busy_callback(&f);
    let calls = Arc::new(AtomicUsize::new(0));
    let ctx = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let client = f.create_id(PortSpace::Tcp, move |_, _| {
        c.fetch_add(1, Ordering::SeqCst);
        Flow::Continue
    });
    client.set_context(Tracked(ctx.clone()));
    client.resolve_addr(None, addr(1, 7000)).unwrap();
    client.resolve_route().unwrap();
    client.connect(&ConnectOptions::default()).unwrap();
    let (child, _) = next(&srv);
    child.accept(&AcceptOptions::default()).unwrap();
    assert!(
        eventually(T, || client.init_qp_attr(QpState::Rtr).is_ok()),
        "no REP"
    );
    client.establish().unwrap();
    expect_ev(&srv, &child, "ESTABLISHED");
    child.disconnect().unwrap();
    assert!(eventually(T, || client.state() == State::Disconnect));
    let r = within(Duration::from_secs(2), {
        let client = client.clone();
        move || client.destroy()
    });
    assert_eq!(r, Some(Ok(DestroyOutcome::Done)));
    assert_eq!(ctx.load(Ordering::SeqCst), 1);
    gate.open();
    thread::sleep(Duration::from_millis(200));
    assert_eq!(
        calls.load(Ordering::SeqCst),
        0,
        "a discarded event was delivered"
    );
    expect_ev(&srv, &child, "DISCONNECTED");
    child.destroy().unwrap();
    blocker.destroy().unwrap();

    // The id's own callback in flight, the burst behind it.
    let gate = Gate::new();
    let calls = Arc::new(AtomicUsize::new(0));
    let (entered_tx, entered_rx) = mpsc::channel();
    let (g, c, etx) = (gate.clone(), calls.clone(), Mutex::new(entered_tx));
    let id = f.create_id(PortSpace::Tcp, move |_, _| {
        c.fetch_add(1, Ordering::SeqCst);
        etx.lock().unwrap().send(()).unwrap();
        g.wait();
        Flow::Continue
    });
    poke(&id, 0);
    entered_rx.recv_timeout(T).unwrap();
    for n in 1..20 {
        poke(&id, n);
    }
    let (done_tx, done_rx) = mpsc::channel();
    let id2 = id.clone();
    thread::spawn(move || done_tx.send(id2.destroy()).unwrap());
    assert!(
        done_rx.recv_timeout(Duration::from_millis(150)).is_err(),
        "destroy returned while the callback ran"
    );
    gate.open();
    assert_eq!(done_rx.recv_timeout(T), Ok(Ok(DestroyOutcome::Done)));
    thread::sleep(Duration::from_millis(100));
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    // Channel mode: a burst queued, never taken.
    let ch = EventChannel::new();
    let p = f.create_id_on(PortSpace::Tcp, &ch);
    for n in 0..50 {
        poke(&p, n);
    }
    assert_eq!(ch.pending(), 50);
    assert_eq!(p.destroy(), Ok(DestroyOutcome::Done));
    assert_eq!(
        ch.pending(),
        0,
        "queued events of a destroyed id left on its channel"
    );
    assert!(ch.get_event(Some(Duration::ZERO)).is_none());
    listener.destroy().unwrap();
    f.shutdown();

    // Churn: destroy a connecting/connected/disconnecting id at random moments.
    let f = fabric(25212);
    let accepted = Arc::new(Mutex::new(Vec::new()));
    let acc = accepted.clone();
    let server = f.create_id(PortSpace::Tcp, move |id, ev| {
        match ev {
            Event::ConnectRequest { .. } => {
                acc.lock().unwrap().push(id.clone());
                let _ = id.accept(&AcceptOptions::default());
            }
            Event::Established { .. } => {
                let _ = id.disconnect();
            }
            _ => {}
        }
        Flow::Continue
    });
    server.bind(addr(1, 7000)).unwrap();
    server.listen(0).unwrap();
    let mut rng = Rng(0xDEAD_BEEF);
    // Each round's count of callbacks after its destroy returned, checked after all rounds
    // and a quiet period: a late one may come well after its round.
    let mut lates = Vec::new();
    for _ in 0..60 {
        let destroyed = Arc::new(AtomicBool::new(false));
        let late = Arc::new(AtomicUsize::new(0));
        lates.push(late.clone());
        let (d, l) = (destroyed.clone(), late.clone());
        let id = f.create_id(PortSpace::Tcp, move |id, ev| {
            if d.load(Ordering::SeqCst) {
                l.fetch_add(1, Ordering::SeqCst);
            }
            let _ = match ev {
                Event::AddrResolved => id.resolve_route(),
                Event::RouteResolved => id.connect(&ConnectOptions::default()),
                Event::ConnectResponse { .. } => id.establish(),
                _ => Ok(()),
            };
            Flow::Continue
        });
        id.resolve_addr(None, addr(1, 7000)).unwrap();
        thread::sleep(Duration::from_micros(rng.below(3000)));
        assert_eq!(id.destroy(), Ok(DestroyOutcome::Done));
        destroyed.store(true, Ordering::SeqCst);
    }
    assert_no_late_callbacks(&lates);
    server.destroy().unwrap();
    for c in accepted.lock().unwrap().drain(..) {
        c.destroy().unwrap();
    }
    assert_eq!(f.live_ids(), 0);
    assert_eq!(f.bound_ports(), 0);
    assert_engines_drain(&f);
    f.shutdown();
}

// ----- Bug 12 ------------------------------------------------------------------------------

/// Linux bug 12: a leaked reference made `ib_destroy_cm_id` wait forever, silently (fixed by
/// a timeout that reports). rcm's rule: a destroy never waits for something the caller
/// controls without saying so. A blocking destroy with the id's events held fails with
/// `EventsOutstanding`; a removal reports the ids holding it; a destroy with a callback in
/// flight completes as soon as it returns; a bounded `wait_for` reports rather than hangs;
/// and once destroyed, no reference is left (`live_ids` back to 0).
#[test]
fn bug12_destroy_never_hangs_silently() {
    let f = fabric(25213);
    let ch = EventChannel::new();
    let id = f.create_id_on(PortSpace::Tcp, &ch);
    id.bind(addr(1, 0)).unwrap();
    poke(&id, 0);
    let held = ch.get_event(Some(T)).unwrap();
    let r = within(Duration::from_secs(2), {
        let id = id.clone();
        move || id.destroy()
    });
    assert_eq!(r, Some(Err(Error::EventsOutstanding(1))));
    let removal = f.remove_device(ip(1)).unwrap();
    let t0 = Instant::now();
    assert_eq!(
        removal.wait(Duration::from_millis(200)),
        Err(vec![id.key()]),
        "the removal names its holder"
    );
    assert!(t0.elapsed() < Duration::from_secs(2));
    let h = id.begin_destroy();
    assert!(!h.wait_for(Duration::from_millis(100)));
    drop(held);
    assert!(h.wait_for(T));
    // The removal's DeviceRemoval for the destroyed id was discarded.
    assert!(ch.get_event(Some(Duration::from_millis(100))).is_none());
    removal.wait(T).unwrap();

    let (cb, gate) = busy_callback(&f);
    let g2 = gate.clone();
    let opener = thread::spawn(move || {
        thread::sleep(Duration::from_millis(200));
        g2.open();
    });
    let r = within(Duration::from_secs(3), move || cb.destroy());
    assert_eq!(r, Some(Ok(DestroyOutcome::Done)));
    opener.join().unwrap();
    assert_eq!(f.live_ids(), 0, "a reference outlived destroy");
    f.shutdown();
}

/// Linux bug 12, the case rcm's rule must cover too: a non-blocking destroy was already
/// started (by the user, or by `Fabric::shutdown`) while the caller holds one of the id's
/// events, and then the caller destroys it blocking. It would wait for an ack only the
/// caller can give: it must fail with `EventsOutstanding` (or otherwise return), not hang.
#[test]
fn bug12_blocking_destroy_after_begin_destroy_with_held_event() {
    let f = fabric(25214);
    let ch = EventChannel::new();
    let id = f.create_id_on(PortSpace::Tcp, &ch);
    poke(&id, 0);
    let held = ch.get_event(Some(T)).unwrap();
    let h = id.begin_destroy();
    assert!(!h.is_done());
    let r = within(Duration::from_secs(3), {
        let id = id.clone();
        move || id.destroy()
    });
    assert_eq!(
        r,
        Some(Err(Error::EventsOutstanding(1))),
        "blocking destroy after begin_destroy, event held: None = hung"
    );
    drop(held);
    assert!(h.wait_for(T));

    // Through Fabric::shutdown, which tears such an id down at once (its peer must hear of
    // it while the devices run): the blocking destroy after it has nothing to wait for.
    let id = f.create_id_on(PortSpace::Tcp, &ch);
    poke(&id, 1);
    let held = ch.get_event(Some(T)).unwrap();
    f.shutdown();
    let r = within(Duration::from_secs(3), {
        let id = id.clone();
        move || id.destroy()
    });
    assert_eq!(
        r,
        Some(Ok(DestroyOutcome::Done)),
        "blocking destroy after shutdown, event held: None = hung"
    );
    drop(held);
}

// ----- Bug 13 ------------------------------------------------------------------------------

/// Linux bug 13 ("Fix ordering of xa_alloc_cyclic() in ib_create_cm_id()"): an id was
/// visible in the global table before it was initialised. In rcm a connect request's child
/// is built, registered and handed to the user; this checks (1) the child is complete when
/// its `ConnectRequest` runs (state, addresses, device, QP attributes, listener), for many
/// concurrent requests, and (2) what walks the id table concurrently — a device removal
/// racing a stream of incoming requests, round after round on fresh devices — treats every
/// child consistently: a child created on the device as it goes gets its `DeviceRemoval`
/// (here: destroys itself on it) or is refused; the removal completes; none is left alive,
/// unnoticed, on the removed device.
#[test]
fn bug13_id_not_visible_before_built() {
    let f = fabric(25215);
    let problems = Arc::new(Mutex::new(Vec::new()));
    let accepted = Arc::new(AtomicUsize::new(0));
    let (p, a) = (problems.clone(), accepted.clone());
    let listener_key = Arc::new(AtomicU32::new(0));
    let lk = listener_key.clone();
    let listener = f.create_id(PortSpace::Tcp, move |id, ev| {
        if let Event::ConnectRequest { listener, .. } = &ev {
            let mut bad = Vec::new();
            if id.state() != State::Connect {
                bad.push(format!("state {:?}", id.state()));
            }
            if id.local_addr() != Some(addr(1, 7000)) {
                bad.push(format!("local {:?}", id.local_addr()));
            }
            if id.peer_addr().map(|a| a.ip()) != Some(ip(2)) {
                bad.push(format!("peer {:?}", id.peer_addr()));
            }
            if id.device_addr() != Some(ip(1)) {
                bad.push(format!("device {:?}", id.device_addr()));
            }
            if id.init_qp_attr(QpState::Rtr).is_err() {
                bad.push("no QP attributes".into());
            }
            if listener.key() != u64::from(lk.load(Ordering::SeqCst)) {
                bad.push("wrong listener".into());
            }
            if bad.is_empty() {
                id.accept(&AcceptOptions::default()).unwrap();
                a.fetch_add(1, Ordering::SeqCst);
            } else {
                p.lock().unwrap().push(bad.join(", "));
                return Flow::Destroy;
            }
        }
        if matches!(ev, Event::Disconnected) {
            return Flow::Destroy;
        }
        Flow::Continue
    });
    listener_key.store(listener.key() as u32, Ordering::SeqCst);
    listener.bind(addr(1, 7000)).unwrap();
    listener.listen(0).unwrap();
    let cli = EventChannel::new();
    let clients: Vec<CmId> = (0..20)
        .map(|_| f.create_id_on(PortSpace::Tcp, &cli))
        .collect();
    for c in &clients {
        c.resolve_addr(None, addr(1, 7000)).unwrap();
    }
    let mut established = 0;
    while established < clients.len() {
        let Some(mut e) = cli.get_event(Some(T)) else {
            let states: Vec<_> = clients.iter().map(CmId::state).collect();
            panic!(
                "no event for {T:?} with {established} of 20 established; client states \
                 {states:?}; {} accepted (an event router or callback thread is stuck?)",
                accepted.load(Ordering::SeqCst)
            );
        };
        let id = e.id().clone();
        let ev = e.take().unwrap();
        drop(e);
        match ev {
            Event::AddrResolved => id.resolve_route().unwrap(),
            Event::RouteResolved => id.connect(&ConnectOptions::default()).unwrap(),
            Event::ConnectResponse { .. } => id.establish().unwrap(),
            Event::Established { .. } => established += 1,
            other => panic!("client got {other:?}"),
        }
    }
    assert!(problems.lock().unwrap().is_empty(), "{problems:?}");
    assert!(eventually(T, || accepted.load(Ordering::SeqCst) == 20));
    for c in clients {
        c.destroy().unwrap();
    }
    listener.destroy().unwrap();
    assert!(eventually(T, || f.live_ids() == 0), "children left");

    // Removal racing incoming requests, on a fresh device each round.
    let mut stranded = Vec::new();
    let mut total = 0;
    for round in 0..12u8 {
        let dev = IpAddr::from([127, 0, 4, round + 1]);
        f.add_device(dev).unwrap();
        let children = Arc::new(Mutex::new(Vec::new()));
        let kids = children.clone();
        let lkey = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let lk = lkey.clone();
        let listener = f.create_id(PortSpace::Tcp, move |id, ev| match ev {
            Event::ConnectRequest { .. } => {
                kids.lock().unwrap().push(id.clone());
                Flow::Continue
            }
            Event::DeviceRemoval => {
                if id.key() == lk.load(Ordering::SeqCst) {
                    // The listener does some cleanup first; requests keep arriving.
                    thread::sleep(Duration::from_millis(20));
                }
                Flow::Destroy
            }
            _ => Flow::Continue,
        });
        lkey.store(listener.key(), Ordering::SeqCst);
        let dst = SocketAddr::new(dev, 7001);
        listener.bind(dst).unwrap();
        listener.listen(0).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let floods: Vec<_> = (0..2)
            .map(|_| {
                let (f, stop) = (f.clone(), stop.clone());
                thread::spawn(move || {
                    let cli = EventChannel::new();
                    let mut ids = std::collections::VecDeque::new();
                    while !stop.load(Ordering::SeqCst) {
                        let c = f.create_id_on(PortSpace::Tcp, &cli);
                        let _ = c.resolve_addr(None, dst);
                        ids.push_back(c);
                        while let Some(mut e) = cli.get_event(Some(Duration::ZERO)) {
                            let id = e.id().clone();
                            let _ = match e.take() {
                                Some(Event::AddrResolved) => id.resolve_route(),
                                Some(Event::RouteResolved) => {
                                    id.connect(&ConnectOptions::default())
                                }
                                _ => Ok(()),
                            };
                        }
                        if ids.len() > 32 {
                            if let Some(old) = ids.pop_front() {
                                assert!(old.begin_destroy().wait_for(T));
                            }
                        }
                    }
                    for c in ids {
                        assert!(c.begin_destroy().wait_for(T));
                    }
                })
            })
            .collect();
        thread::sleep(Duration::from_millis(60));
        // Ids are numbered in creation order: these two bracket the removal call.
        let before = f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
        let removal = f.remove_device(dev).unwrap();
        let after = f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
        let window = (before.key(), after.key());
        before.destroy().unwrap();
        after.destroy().unwrap();
        let waited = removal.wait(T);
        thread::sleep(Duration::from_millis(30));
        stop.store(true, Ordering::SeqCst);
        for h in floods {
            h.join().unwrap();
        }
        assert_eq!(waited, Ok(()), "round {round}: removal held");
        let kids = children.lock().unwrap().clone();
        total += kids.len();
        stranded.extend(
            kids.iter()
                .filter(|c| c.state() != State::Destroying)
                .map(|c| {
                    let when = match c.key() {
                        k if k < window.0 => "before remove_device",
                        k if k > window.1 => "after remove_device",
                        _ => "during remove_device",
                    };
                    (round, c.key(), c.state(), c.device_addr(), when)
                }),
        );
        for c in kids {
            c.destroy().unwrap();
        }
        assert!(listener.begin_destroy().wait_for(T));
    }
    assert!(total > 0, "no request reached a listener");
    assert!(
        stranded.is_empty(),
        "{} of {total} children created on a device being removed never got DeviceRemoval \
         and outlived the removal; created during remove_device: {}, after: {}, before: {} \
         (round, key, state, device, when; first 10): {:?}",
        stranded.len(),
        stranded
            .iter()
            .filter(|s| s.4 == "during remove_device")
            .count(),
        stranded
            .iter()
            .filter(|s| s.4 == "after remove_device")
            .count(),
        stranded
            .iter()
            .filter(|s| s.4 == "before remove_device")
            .count(),
        &stranded[..stranded.len().min(10)]
    );
    assert!(
        eventually(T, || f.live_ids() == 0),
        "ids left: {}",
        f.live_ids()
    );
    f.shutdown();
}

// ----- Bug 14 ------------------------------------------------------------------------------

/// Linux bug 14: rdma-core's "forgot to ack an event → `rdma_destroy_id` hangs", and
/// `rdma_destroy_qp` in one thread racing `rdma_get_cm_event` (which moves the QP) in
/// another. Holding unacked events of *other* ids never blocks destroying an id; holding its
/// own fails typed, per id; and `destroy_qp` racing event processing of a connection that
/// uses the QP ends typed, without a hang.
#[test]
fn bug14_destroy_with_unacked_events_of_other_ids() {
    let f = fabric(25216);
    let ch = EventChannel::new();
    let other_ch = EventChannel::new();
    let a = f.create_id_on(PortSpace::Tcp, &ch);
    let b = f.create_id_on(PortSpace::Tcp, &ch);
    let c = f.create_id_on(PortSpace::Tcp, &ch);
    let d = f.create_id_on(PortSpace::Tcp, &other_ch);
    let cb = f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
    for (n, id) in [&a, &b, &c, &d].into_iter().enumerate() {
        poke(id, n as u32);
    }
    let ea = ch.get_event(Some(T)).unwrap();
    let eb = ch.get_event(Some(T)).unwrap();
    let ed = other_ch.get_event(Some(T)).unwrap();
    assert_eq!((ea.id(), eb.id(), ed.id()), (&a, &b, &d));
    for id in [c.clone(), cb.clone()] {
        let r = within(Duration::from_secs(2), move || id.destroy());
        assert_eq!(r, Some(Ok(DestroyOutcome::Done)), "others' events held");
    }
    assert_eq!(a.destroy(), Err(Error::EventsOutstanding(1)));
    assert_eq!(b.destroy(), Err(Error::EventsOutstanding(1)));
    drop(ea);
    assert_eq!(a.destroy(), Ok(DestroyOutcome::Done));
    assert_eq!(b.destroy(), Err(Error::EventsOutstanding(1)));
    drop(eb);
    assert_eq!(b.destroy(), Ok(DestroyOutcome::Done));
    drop(ed);
    assert_eq!(d.destroy(), Ok(DestroyOutcome::Done));

    // destroy_qp racing the event processing of a connection that uses the QP.
    let srv = f.create_id(PortSpace::Tcp, |id, ev| {
        if let Event::ConnectRequest { .. } = ev {
            let _ = id.accept(&AcceptOptions::default());
        }
        match ev {
            Event::Disconnected | Event::Rejected { .. } | Event::Unreachable(_) => Flow::Destroy,
            _ => Flow::Continue,
        }
    });
    srv.bind(addr(1, 7000)).unwrap();
    srv.listen(0).unwrap();
    let mut rng = Rng(0x1234_5678);
    for round in 0..30 {
        let cli = EventChannel::new();
        let id = f.create_id_on(PortSpace::Tcp, &cli);
        id.create_qp().unwrap();
        // Drives the connection; returns what the connect returned and the events that
        // followed. It stops 20 ms after the outcome (the connect refused, or an event
        // after it), so an event that should not come has time to show.
        let consumer = {
            let cli = cli.clone();
            thread::spawn(move || {
                let (mut connect, mut seen) = (None, Vec::new());
                let give_up = Instant::now() + T;
                let mut stop_at = None;
                while Instant::now() < stop_at.unwrap_or(give_up) {
                    if let Some(mut e) = cli.get_event(Some(Duration::from_millis(5))) {
                        let id = e.id().clone();
                        let r = match e.take() {
                            Some(Event::AddrResolved) => id.resolve_route(),
                            Some(Event::RouteResolved) => {
                                let r = id.connect(&ConnectOptions::default());
                                connect = Some(r.clone());
                                r
                            }
                            Some(ev) => {
                                seen.push(ev.name());
                                Ok(())
                            }
                            None => Ok(()),
                        };
                        assert!(
                            matches!(r, Ok(()) | Err(Error::QpBusy(_) | Error::InvalidState(_))),
                            "{r:?}"
                        );
                        if r.is_err() || !seen.is_empty() {
                            stop_at.get_or_insert(Instant::now() + Duration::from_millis(20));
                        }
                    }
                }
                (connect, seen)
            })
        };
        id.resolve_addr(None, addr(1, 7000)).unwrap();
        thread::sleep(Duration::from_micros(rng.below(2000)));
        id.destroy_qp().unwrap();
        let (connect, seen) = consumer.join().unwrap();
        // The connect goes out whenever the QP went (Linux's `rdma_destroy_qp` leaves the id
        // without one, and a connect without one is valid), and one outcome follows, typed:
        // ESTABLISHED when the QP was still there as the REP came (or its RTU had gone
        // out), CONNECT_RESPONSE when it was gone by then, waiting for `establish`.
        assert_eq!(connect, Some(Ok(())), "round {round}: then {seen:?}");
        assert!(
            matches!(
                seen.as_slice(),
                ["ESTABLISHED" | "CONNECT_RESPONSE" | "CONNECT_ERROR"]
            ),
            "round {round}: {seen:?}"
        );
        let r = within(Duration::from_secs(2), move || id.destroy());
        assert_eq!(r, Some(Ok(DestroyOutcome::Done)), "round {round}");
    }
    srv.destroy().unwrap();
    assert!(
        eventually(T, || f.live_ids() == 0),
        "ids left: {}",
        f.live_ids()
    );
    f.shutdown();
}
