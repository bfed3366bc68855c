//! Helpers shared by the lifecycle and Linux-bug tests.
#![allow(dead_code)] // each test file uses its own subset

use rcm::{CmId, Error, Event, Fabric, FabricConfig};
use rcm_proto::ib::RetryPolicy;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

pub const T: Duration = Duration::from_secs(10);

pub fn config(port: u16) -> FabricConfig {
    FabricConfig {
        udp_port: port,
        retry: RetryPolicy::Backoff {
            initial: Duration::from_millis(50),
            max_wait: Duration::from_millis(200),
            deadline: Duration::from_secs(1),
        },
        min_timewait: Duration::ZERO,
        dispatcher_threads: 4,
        ..FabricConfig::default()
    }
}

/// Two loopback devices, 127.0.0.1 and 127.0.0.2, on UDP port `port`.
pub fn fabric(port: u16) -> Fabric {
    Fabric::loopback_with(2, config(port)).expect("loopback devices")
}

pub fn ip(last: u8) -> IpAddr {
    IpAddr::from([127, 0, 0, last])
}

pub fn addr(last: u8, port: u16) -> SocketAddr {
    SocketAddr::new(ip(last), port)
}

/// A destination off this host (in 198.18.0.0/15, the test range) that a loopback device
/// cannot reach: `resolve_addr` to it succeeds as a call and queues
/// `AddrError(AddrNotAvailable(dst))` at once, sending nothing and changing nothing else.
/// It makes an event on demand, carrying `seq` (below 2^17), for any idle or bound id.
pub fn unreachable_dst(seq: u32) -> SocketAddr {
    assert!(seq < 1 << 17, "seq {seq} does not fit 198.18.0.0/15");
    let [_, b, c, d] = seq.to_be_bytes();
    SocketAddr::new(IpAddr::from([198, 18 + b, c, d]), 1)
}

/// The `seq` of an event made by [`unreachable_dst`].
pub fn seq_of(ev: &Event) -> Option<u32> {
    match ev {
        Event::AddrError(Error::AddrNotAvailable(IpAddr::V4(a))) => match a.octets() {
            [198, b @ 18..=19, c, d] => Some(u32::from_be_bytes([0, b - 18, c, d])),
            _ => None,
        },
        _ => None,
    }
}

/// Queues one `AddrError` event carrying `seq` on `id`.
pub fn poke(id: &CmId, seq: u32) {
    id.resolve_addr(None, unreachable_dst(seq))
        .expect("resolve_addr to an unreachable address is accepted (the error is an event)");
}

/// An id of `f` whose callback is running and blocked on the returned gate: with one
/// dispatcher thread, the events queued meanwhile wait behind it until the gate opens.
pub fn busy_callback(f: &Fabric) -> (CmId, Arc<Gate>) {
    let gate = Gate::new();
    let (entered_tx, entered_rx) = std::sync::mpsc::channel();
    let (g, etx) = (gate.clone(), Mutex::new(entered_tx));
    let id = f.create_id(rcm::PortSpace::Tcp, move |_, _| {
        etx.lock().unwrap().send(()).unwrap();
        g.wait();
        rcm::Flow::Continue
    });
    poke(&id, 0);
    entered_rx.recv_timeout(T).expect("the callback entered");
    (id, gate)
}

/// A latch a callback can block on.
pub struct Gate {
    open: Mutex<bool>,
    cv: Condvar,
}

impl Gate {
    pub fn new() -> Arc<Self> {
        Arc::new(Gate {
            open: Mutex::new(false),
            cv: Condvar::new(),
        })
    }

    pub fn wait(&self) {
        let mut g = self.open.lock().unwrap();
        let end = Instant::now() + T;
        while !*g {
            assert!(Instant::now() < end, "gate never opened");
            g = self
                .cv
                .wait_timeout(g, Duration::from_millis(50))
                .unwrap()
                .0;
        }
    }

    pub fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.cv.notify_all();
    }
}

/// Counts its drops (a user context).
pub struct Tracked(pub Arc<AtomicUsize>);

impl Drop for Tracked {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// Polls `cond` until it holds or `d` passes.
pub fn eventually(d: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + d;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        thread::sleep(Duration::from_millis(5));
    }
}

/// Waits until the peer closed `s` (FIN or RST); returns how long that took.
pub fn closed_within(mut s: std::net::TcpStream, limit: Duration) -> Option<Duration> {
    use std::io::Read;
    let t0 = Instant::now();
    s.set_read_timeout(Some(Duration::from_millis(200))).ok()?;
    let mut buf = [0u8; 512];
    while t0.elapsed() < limit {
        match s.read(&mut buf) {
            Ok(0) => return Some(t0.elapsed()),
            // Whatever rcm answers (a reject or a Terminate) before it closes is fine.
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return Some(t0.elapsed()),
        }
    }
    None
}

/// A listener on `at` that accepts every connect request, counting them (the count is
/// returned), and destroys each connection when it goes down.
pub fn counting_listener(f: &Fabric, at: SocketAddr, backlog: usize) -> (CmId, Arc<AtomicUsize>) {
    let requests = Arc::new(AtomicUsize::new(0));
    let r = requests.clone();
    let l = f.create_id(rcm::PortSpace::Tcp, move |id, ev| {
        if let Event::ConnectRequest { .. } = ev {
            r.fetch_add(1, Ordering::SeqCst);
            if id.accept(&rcm::AcceptOptions::default()).is_err() {
                return rcm::Flow::Destroy;
            }
        }
        if matches!(ev, Event::Disconnected) {
            return rcm::Flow::Destroy;
        }
        rcm::Flow::Continue
    });
    l.bind(at).expect("bind");
    l.listen(backlog).expect("listen");
    (l, requests)
}

/// Runs `f` on a thread and gives up after `d` (the thread is left behind if it hangs).
pub fn within<R: Send + 'static>(d: Duration, f: impl FnOnce() -> R + Send + 'static) -> Option<R> {
    let (tx, rx) = std::sync::mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(d).ok()
}

/// The next event of a channel, with its id (the event is acked when this returns).
pub fn next(ch: &rcm::EventChannel) -> (CmId, Event) {
    let mut e = ch.get_event(Some(T)).expect("an event within the timeout");
    let id = e.id().clone();
    let ev = e.take().expect("the event's payload");
    (id, ev)
}

/// The next event of `ch`, which must be `name` for `id`.
pub fn expect_ev(ch: &rcm::EventChannel, id: &CmId, name: &str) -> Event {
    let (who, ev) = next(ch);
    assert_eq!(
        (who.key(), ev.name()),
        (id.key(), name),
        "unexpected event {ev:?}"
    );
    ev
}

/// After a quiet period (200 ms), asserts that no round's callback ran after its destroy
/// returned: `lates` counts each round's late calls.
pub fn assert_no_late_callbacks(lates: &[Arc<AtomicUsize>]) {
    thread::sleep(Duration::from_millis(200));
    let late: Vec<(usize, usize)> = lates
        .iter()
        .map(|l| l.load(Ordering::SeqCst))
        .enumerate()
        .filter(|(_, n)| *n > 0)
        .collect();
    assert!(
        late.is_empty(),
        "callbacks after destroy returned (round, calls): {late:?}"
    );
}
