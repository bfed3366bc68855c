//! Busy polling on iWARP devices: a thread waiting in `get_event` looks at the streams of
//! the iWARP device it last called and handles their readiness itself, while the device's
//! own thread stands aside; what comes when nobody waits, the device's timers, and its
//! removal are still the device thread's. TCP ports 27961..=27967.
#![cfg(not(loom))]

mod common;

use common::{eventually, ip, T};
use rcm::{
    AcceptOptions, CmId, ConnectOptions, Event, EventChannel, Fabric, FabricConfig, Flow, PortSpace,
};
use std::net::SocketAddr;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// iWARP devices on 127.0.0.1 (the server's) and 127.0.0.2 (the client's) whose own threads
/// sleep at once when idle: a waiter that polls is not raced by a polling device thread,
/// and must be able to look while that thread sleeps.
fn fabric(cep: &rcm_proto::iw::CepConfig) -> Fabric {
    let f = Fabric::new(FabricConfig {
        spin: Duration::ZERO,
        ..common::config(27991)
    });
    for l in [1, 2] {
        f.add_iwarp_device_with(ip(l), cep.clone())
            .expect("iWARP device");
    }
    f
}

fn addr(last: u8, port: u16) -> SocketAddr {
    SocketAddr::new(ip(last), port)
}

fn next(ch: &EventChannel) -> Event {
    let mut e = ch.get_event(Some(T)).expect("an event in time");
    e.take().expect("the event")
}

/// A listener on 127.0.0.1:`port` that accepts each request once `go` says so, and keeps
/// the children it saw established.
fn server(f: &Fabric, port: u16, go: mpsc::Receiver<()>) -> (CmId, Arc<Mutex<Vec<CmId>>>) {
    let go = Mutex::new(go);
    let children = Arc::new(Mutex::new(Vec::new()));
    let seen = children.clone();
    let id = f.create_id(PortSpace::Tcp, move |id, ev| {
        match ev {
            Event::ConnectRequest { .. } => {
                let _ = go.lock().map(|g| g.recv_timeout(T));
                id.accept(&AcceptOptions::default()).expect("accept");
            }
            Event::Established { .. } => seen.lock().expect("lock").push(id.clone()),
            _ => {}
        }
        Flow::Continue
    });
    id.bind(addr(1, port)).expect("bind");
    id.listen(0).expect("listen");
    (id, children)
}

/// A client on `ch` from 127.0.0.2, resolved towards 127.0.0.1:`port` and connecting.
fn connecting(f: &Fabric, ch: &EventChannel, port: u16) -> CmId {
    let cli = f.create_id_on(PortSpace::Tcp, ch);
    cli.bind(addr(2, 0)).expect("bind");
    cli.resolve_addr(None, addr(1, port)).expect("resolve");
    assert!(matches!(next(ch), Event::AddrResolved));
    cli.resolve_route().expect("route");
    assert!(matches!(next(ch), Event::RouteResolved));
    cli.connect(&ConnectOptions::default()).expect("connect");
    cli
}

/// A connection established at once on 127.0.0.1:`port`, its client's events on a new
/// channel that polls for `spin`: the client, the server's child, and the channel.
fn established(f: &Fabric, port: u16, spin: Duration) -> (CmId, CmId, EventChannel, CmId) {
    let (go, went) = mpsc::channel();
    let (srv, children) = server(f, port, went);
    go.send(()).expect("the server answers at once");
    let ch = EventChannel::new();
    ch.set_spin(spin);
    let cli = connecting(f, &ch, port);
    assert!(matches!(next(&ch), Event::Established { .. }));
    assert!(eventually(T, || !children.lock().expect("lock").is_empty()));
    let child = children.lock().expect("lock")[0].clone();
    (cli, child, ch, srv)
}

/// Runs `attempt` (a scenario whose waiter polls; true when the waiter handled what it
/// waited for itself) up to five times, until one is. Beside a CPU-bound process rcm holds
/// a poller off by design (`rcm::spin`), and then the device's thread handles the waiter's
/// readiness, rightly: the test fails only when no attempt was handled by its waiter and
/// none was held off, and is skipped when this host was too busy to tell.
fn some_attempt_polled(what: &str, mut attempt: impl FnMut() -> bool) {
    let mut held = false;
    for n in 1..=5 {
        // A hold-off lasts 1.6 s at most.
        eventually(Duration::from_secs(4), rcm::spin_allowed);
        let before = rcm::hold_offs();
        if attempt() {
            return;
        }
        if rcm::hold_offs() != before {
            held = true;
            eprintln!("attempt {n}: this thread was held off polling (a CPU-bound neighbour)");
        }
    }
    assert!(held, "{what}");
    eprintln!("skipped: every attempt that did not poll was held off; this host is too busy");
}

/// Connects with the client's channel polling for `spin`, the server answering 200 ms after
/// the client began to wait; returns the client device's readiness events that the waiting
/// thread handled itself.
fn connect_polling_for(port: u16, spin: Duration) -> u64 {
    let f = fabric(&rcm_proto::iw::CepConfig::default());
    let (go, went) = mpsc::channel();
    let (_srv, _children) = server(&f, port, went);
    let ch = EventChannel::new();
    ch.set_spin(spin);
    let cli = connecting(&f, &ch, port);
    let answer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        let _ = go.send(());
    });
    let ev = next(&ch);
    assert!(matches!(ev, Event::Established { .. }), "unexpected {ev:?}");
    answer.join().expect("answer thread");
    let polled = f.device(ip(2)).expect("client device").busy_polled();
    drop(cli);
    f.shutdown();
    polled
}

/// The waiter looks at the client device's streams for as long as its channel polls, with
/// the device's thread asleep: the MPA Reply (and the TCP connect's completion before it)
/// reach the engine through it.
#[test]
fn a_waiter_handles_its_iwarp_connects_readiness_itself() {
    some_attempt_polled("the waiter handled none of the connect's readiness", || {
        connect_polling_for(27961, Duration::from_secs(5)) > 0
    });
}

/// A channel that does not poll (spin 0) sleeps at once: the device's thread handles all.
#[test]
fn a_waiter_that_does_not_poll_leaves_the_iwarp_device_alone() {
    assert_eq!(connect_polling_for(27962, Duration::ZERO), 0);
}

/// What arrives once the waiter has its event and stopped waiting is the device thread's:
/// the server's disconnect, made while nobody waits on the client's channel, becomes a
/// DISCONNECTED event waiting there.
#[test]
fn what_arrives_after_the_waiter_left_is_handled_by_the_device_thread() {
    let f = fabric(&rcm_proto::iw::CepConfig::default());
    let (cli, child, ch, _srv) = established(&f, 27963, Duration::from_millis(50));
    let polled = f.device(ip(2)).expect("client device").busy_polled();
    child.disconnect().expect("server disconnects");
    assert!(
        eventually(T, || ch.pending() > 0),
        "the peer's disconnect was not handled while nobody waited"
    );
    assert_eq!(
        f.device(ip(2)).expect("client device").busy_polled(),
        polled,
        "nobody waited, yet a waiter handled it"
    );
    assert!(matches!(next(&ch), Event::Disconnected));
    drop((cli, child));
    f.shutdown();
}

/// A waiter looks at the streams while the device's thread sleeps, and what then arrives is
/// the waiter's: the thread sleeps on the poll's readiness without holding it, and leaves
/// what woke it to a waiter polling. The peer's disconnect comes while the client's device
/// thread is asleep (spin 0, nothing due for 500 ms) and its id's channel waits polling.
#[test]
fn a_waiter_looks_while_the_iwarp_device_thread_sleeps() {
    some_attempt_polled(
        "the peer's disconnect was handled by the device's thread, not by the waiter",
        disconnect_seen_by_a_polling_waiter,
    );
}

/// [`a_waiter_looks_while_the_iwarp_device_thread_sleeps`] once: whether the waiter handled
/// the peer's disconnect itself.
fn disconnect_seen_by_a_polling_waiter() -> bool {
    let f = fabric(&rcm_proto::iw::CepConfig::default());
    let (cli, child, ch, _srv) = established(&f, 27966, Duration::ZERO);
    let dev = f.device(ip(2)).expect("client device");
    let polled = dev.busy_polled();
    std::thread::sleep(Duration::from_millis(20));
    let peer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        child.disconnect().expect("server disconnects");
        child
    });
    ch.set_spin(Duration::from_secs(5));
    assert!(matches!(next(&ch), Event::Disconnected));
    let by_waiter = dev.busy_polled() > polled;
    drop((cli, peer.join().expect("peer")));
    f.shutdown();
    by_waiter
}

/// A message longer than a turn's read (256 KiB) comes whole while the waiter polls, and
/// the disconnect behind it comes after it: the waiter's passes and the device thread's
/// share the stream's reads, left unread between turns, in order.
#[test]
fn a_long_message_read_in_turns_while_a_waiter_polls_comes_whole() {
    let f = fabric(&rcm_proto::iw::CepConfig::default());
    let (cli, child, ch, _srv) = established(&f, 27967, Duration::from_secs(5));
    // Under the largest message received (1 MiB), four turns' worth.
    let msg: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
    child.send(&msg).expect("a long message");
    child.disconnect().expect("server disconnects");
    assert!(matches!(next(&ch), Event::Disconnected));
    let got = cli.recv_message(T).expect("the message");
    assert!(
        got == msg,
        "{} bytes came, not the {} sent",
        got.len(),
        msg.len()
    );
    drop((cli, child));
    f.shutdown();
}

/// The device's timers run while a waiter polls its streams for a minute: a Reply that never
/// comes (the peer is a bare TCP listener) ends the connect when `mpa_reply_timeout` says.
#[test]
fn timers_run_while_a_waiter_polls_the_iwarp_device() {
    let f = fabric(&rcm_proto::iw::CepConfig {
        mpa_reply_timeout: Duration::from_millis(300),
        ..rcm_proto::iw::CepConfig::default()
    });
    let silent = std::net::TcpListener::bind(addr(1, 27964)).expect("silent peer");
    let taker = std::thread::spawn(move || silent.accept().map(|(s, _)| s));
    let ch = EventChannel::new();
    ch.set_spin(Duration::from_secs(60));
    let cli = connecting(&f, &ch, 27964);
    let start = Instant::now();
    let ev = next(&ch);
    let took = start.elapsed();
    assert!(
        !matches!(
            ev,
            Event::ConnectResponse { .. } | Event::Established { .. }
        ),
        "unexpected {ev:?}"
    );
    assert!(
        took < Duration::from_secs(5),
        "the timeout came after {took:?}"
    );
    let _stream = taker.join().expect("taker").expect("accepted");
    drop(cli);
    f.shutdown();
}

/// A device removed while a waiter polls it goes at once: its thread, standing aside, is
/// woken for it, and the waiter's id hears of the removal.
#[test]
fn an_iwarp_device_removed_while_a_waiter_polls_it_goes_at_once() {
    let f = fabric(&rcm_proto::iw::CepConfig::default());
    // A listener that leaves its requests unanswered.
    let srv = f.create_id(PortSpace::Tcp, |_, _| Flow::Continue);
    srv.bind(addr(1, 27965)).expect("bind");
    srv.listen(0).expect("listen");
    let ch = EventChannel::new();
    ch.set_spin(Duration::from_secs(60));
    let cli = connecting(&f, &ch, 27965);
    let waiter = {
        let ch = ch.clone();
        std::thread::spawn(move || {
            let mut e = ch.get_event(Some(T)).expect("an event in time");
            e.take().expect("the event")
        })
    };
    // The waiter is polling (the connect waits for the server, which does not answer).
    std::thread::sleep(Duration::from_millis(100));
    let start = Instant::now();
    let removal = f.remove_device(ip(2)).expect("remove");
    let ev = waiter.join().expect("waiter");
    assert!(matches!(ev, Event::DeviceRemoval), "unexpected {ev:?}");
    cli.destroy().expect("destroy");
    removal.wait(T).expect("every id on the device destroyed");
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "removal took {:?}",
        start.elapsed()
    );
    f.shutdown();
}
