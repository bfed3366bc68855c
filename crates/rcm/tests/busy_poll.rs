//! A thread waiting in `get_event` receives the answers of the device it last called
//! (busy polling): the answer is received, handled and taken by that one thread.
#![cfg(not(loom))]

mod common;

use rcm::{
    AcceptOptions, CmId, ConnectOptions, Event, EventChannel, Fabric, FabricConfig, Flow, PortSpace,
};
use std::net::{IpAddr, SocketAddr};
use std::sync::mpsc;
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

/// Two loopback devices whose own threads sleep at once when idle (no spinning), so that a
/// datagram a waiter polls for is not raced for by a polling device thread.
fn fabric(port: u16) -> Fabric {
    let cfg = FabricConfig {
        udp_port: port,
        spin: Duration::ZERO,
        ..FabricConfig::default()
    };
    Fabric::loopback_with(2, cfg).expect("loopback devices")
}

fn addr(last: u8, port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::from([127, 0, 0, last]), port)
}

/// A server on 127.0.0.1:7471 that accepts each request when `go` says so (after the
/// client has begun to wait).
fn server(f: &Fabric, go: mpsc::Receiver<()>) -> CmId {
    let go = std::sync::Mutex::new(go);
    let id = f.create_id(PortSpace::Tcp, move |id, ev| {
        if let Event::ConnectRequest { .. } = ev {
            let _ = go.lock().map(|g| g.recv_timeout(T));
            id.accept(&AcceptOptions::default()).expect("accept");
        }
        Flow::Continue
    });
    id.bind(addr(1, 7471)).expect("bind");
    id.listen(0).expect("listen");
    id
}

fn next(ch: &EventChannel) -> Event {
    let mut e = ch.get_event(Some(T)).expect("an event in time");
    e.take().expect("the event")
}

/// Connects a client on `ch` from 127.0.0.2 and waits for its connect response; the server
/// is told to answer 200 ms after the client began waiting. Returns the client.
fn connect(f: &Fabric, ch: &EventChannel, go: &mpsc::Sender<()>) -> CmId {
    let cli = f.create_id_on(PortSpace::Tcp, ch);
    cli.resolve_addr(None, addr(1, 7471)).expect("resolve");
    assert!(matches!(next(ch), Event::AddrResolved));
    cli.resolve_route().expect("route");
    assert!(matches!(next(ch), Event::RouteResolved));
    cli.connect(&ConnectOptions::default()).expect("connect");
    let go = go.clone();
    let answer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        let _ = go.send(());
    });
    let ev = next(ch);
    assert!(
        matches!(ev, Event::ConnectResponse { .. }),
        "unexpected {ev:?}"
    );
    answer.join().expect("answer thread");
    cli
}

/// Runs `attempt` (which has this thread wait on a channel that polls) until one ran with
/// this thread allowed to poll throughout, up to five times; its result, or `None` when
/// every attempt was held off. Beside a CPU-bound process a poller's yields are stolen and
/// rcm holds it off polling by design (`rcm::spin`), so a test whose premise is that the
/// waiter polls cannot hold then: the hold-off count tells such an attempt from a waiter
/// that could poll and did not.
fn while_polling<R>(mut attempt: impl FnMut() -> R) -> Option<R> {
    for n in 1..=5 {
        // A hold-off lasts 1.6 s at most.
        common::eventually(Duration::from_secs(4), rcm::spin_allowed);
        let held = rcm::hold_offs();
        let r = attempt();
        if rcm::hold_offs() == held {
            return Some(r);
        }
        eprintln!("attempt {n}: this thread was held off polling (a CPU-bound neighbour)");
    }
    eprintln!("skipped: every attempt was held off polling; this host is too busy to test it");
    None
}

/// Connects once with the client's channel polling for `spin`; returns how many datagrams
/// the client's device received, and how many of them the waiting thread received itself.
fn connect_polling_for(port: u16, spin: Duration) -> (u64, u64) {
    let f = fabric(port);
    let (go, went) = mpsc::channel();
    let _srv = server(&f, went);
    let ch = EventChannel::new();
    ch.set_spin(spin);
    let cli = connect(&f, &ch, &go);
    let dev = f
        .device(IpAddr::from([127, 0, 0, 2]))
        .expect("client device");
    // The device's thread counts a batch once the engine has handled it, which is after the
    // event it made is in the channel: the waiter may look first.
    let until = std::time::Instant::now() + T;
    while dev.traffic().0 == 0 && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(1));
    }
    let counts = (dev.traffic().0, dev.busy_polled());
    cli.establish().expect("establish");
    f.shutdown();
    counts
}

/// The waiter polls the client's device for as long as its channel polls: the REP, the
/// client device's one datagram, reaches the engine through it.
#[test]
fn a_waiter_receives_the_answer_to_its_call() {
    let Some((rx, polled)) = while_polling(|| connect_polling_for(24813, Duration::from_secs(5)))
    else {
        return;
    };
    assert_eq!(rx, 1, "the REP is the client device's one datagram");
    assert_eq!(polled, 1, "the REP was not received by the waiter");
}

/// A channel that does not poll (spin 0) sleeps at once: the device's thread receives.
#[test]
fn a_waiter_that_does_not_poll_leaves_the_device_alone() {
    let (rx, polled) = connect_polling_for(24814, Duration::ZERO);
    assert_eq!(rx, 1, "the REP arrived");
    assert_eq!(polled, 0);
}

/// A waiter that got its event and stopped waiting leaves nothing stranded: the peer's
/// DREQ, sent while nobody waits on the channel, is received by the device's thread once
/// the waiter's poll is over, and its DISCONNECTED event waits in the channel.
#[test]
fn what_arrives_after_the_waiter_left_is_received_all_the_same() {
    let f = fabric(24815);
    let (go, went) = mpsc::channel();
    let srv_events = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = srv_events.clone();
    let go_rx = std::sync::Mutex::new(went);
    let srv = f.create_id(PortSpace::Tcp, move |id, ev| {
        match ev {
            Event::ConnectRequest { .. } => {
                let _ = go_rx.lock().map(|g| g.recv_timeout(T));
                id.accept(&AcceptOptions::default()).expect("accept");
            }
            Event::Established { .. } => {
                seen.lock().expect("lock").push(id.clone());
            }
            _ => {}
        }
        Flow::Continue
    });
    srv.bind(addr(1, 7471)).expect("bind");
    srv.listen(0).expect("listen");
    let ch = EventChannel::new();
    ch.set_spin(Duration::from_millis(50));
    let cli = connect(&f, &ch, &go);
    cli.establish().expect("establish");
    assert!(matches!(next(&ch), Event::Established { .. }));
    let child = {
        let until = std::time::Instant::now() + T;
        loop {
            if let Some(c) = srv_events.lock().expect("lock").first().cloned() {
                break c;
            }
            assert!(std::time::Instant::now() < until, "server not established");
            std::thread::sleep(Duration::from_millis(2));
        }
    };
    child.disconnect().expect("server disconnects");
    let until = std::time::Instant::now() + T;
    while ch.pending() == 0 {
        assert!(
            std::time::Instant::now() < until,
            "the DREQ was not handled while nobody waited"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(matches!(next(&ch), Event::Disconnected));
    f.shutdown();
}

/// A waiter that got its event early in a long poll (a minute, cut to its wait of 10 s)
/// gives the device back as it stops polling: the next connection's REP, which only the device's thread receives (its
/// client's channel does not poll), comes long before that minute is over. The thread
/// stood aside until the poll's deadline before (a thread that polled one device, then
/// waited without polling for another datagram of it, waited out the rest of the spin).
#[test]
fn a_waiter_that_got_its_event_gives_the_device_back_at_once() {
    let Some((f, go, _srv, first, dev)) = while_polling(|| {
        let f = fabric(24816);
        let (go, went) = mpsc::channel();
        let srv = server(&f, went);
        let ch = EventChannel::new();
        ch.set_spin(Duration::from_secs(60));
        let first = connect(&f, &ch, &go);
        let dev = f
            .device(IpAddr::from([127, 0, 0, 2]))
            .expect("client device");
        (f, go, srv, first, dev)
    }) else {
        return;
    };
    assert_eq!(dev.busy_polled(), 1, "the first REP went to the waiter");
    let ch2 = EventChannel::new();
    ch2.set_spin(Duration::ZERO);
    let second = f.create_id_on(PortSpace::Tcp, &ch2);
    second.resolve_addr(None, addr(1, 7471)).expect("resolve");
    assert!(matches!(next(&ch2), Event::AddrResolved));
    second.resolve_route().expect("route");
    assert!(matches!(next(&ch2), Event::RouteResolved));
    go.send(()).expect("the server answers at once");
    second.connect(&ConnectOptions::default()).expect("connect");
    // Half the first poll's deadline (its spin was cut to its wait, `T`).
    let ev = ch2
        .get_event(Some(T / 2))
        .expect("the REP, received by the device's thread, before the poll's deadline")
        .take();
    assert!(
        matches!(ev, Some(Event::ConnectResponse { .. })),
        "unexpected {ev:?}"
    );
    assert_eq!(dev.busy_polled(), 1, "nobody polled for the second REP");
    drop((first, second));
    f.shutdown();
}
