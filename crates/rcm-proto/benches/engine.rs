//! Engine-only benchmarks of the IB CM (`rcm_proto::ib::Endpoint`), two endpoints wired
//! together in memory (MADs moved from one to the other by hand, no simulator):
//!
//! * `handshake/connect_establish_disconnect`: one full cycle per iteration — REQ, REP, RTU,
//!   DREQ, DREP — then virtual time jumps past timewait and both handles are destroyed, so
//!   nothing accumulates; criterion reports the cycles (handshakes) per second.
//! * heap state per established connection: a counting global allocator attributes every
//!   allocation and free to the endpoint whose call made it (events are dropped under their
//!   endpoint's attribution too), 10,000 connections are established, and the net bytes each
//!   side holds are printed divided by the number of connections.
#![allow(missing_docs)]

use criterion::{criterion_group, Criterion, Throughput};
use rcm_proto::ib::{
    cm_ack_timeout, ibta_time_ms, AcceptParams, CepHandle, CmEvent, ConnectParams, Endpoint,
    EndpointConfig, State,
};
use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

// ----- a counting allocator -----------------------------------------------------------------

/// Whose behalf allocations are made on: 0 = the bench itself, 1 = active, 2 = passive.
static SIDE: AtomicUsize = AtomicUsize::new(0);
/// Net bytes allocated, per side.
static NET: [AtomicI64; 3] = [AtomicI64::new(0), AtomicI64::new(0), AtomicI64::new(0)];

struct Counting;

fn account(bytes: usize, sign: i64) {
    let side = SIDE.load(Ordering::Relaxed);
    NET[side].fetch_add(
        sign * i64::try_from(bytes).unwrap_or(i64::MAX),
        Ordering::Relaxed,
    );
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so `System`'s
// guarantees are ours; the bookkeeping only touches atomics and never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwards to System.alloc with the caller's layout (non-zero size per the
        // GlobalAlloc contract the caller upholds).
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            account(layout.size(), 1);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwards to System.alloc_zeroed with the caller's layout.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            account(layout.size(), 1);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwards to System.dealloc; the caller guarantees `ptr` came from this
        // allocator (hence from System) with this layout.
        unsafe { System.dealloc(ptr, layout) };
        account(layout.size(), -1);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwards to System.realloc; the caller guarantees `ptr`/`layout` came from
        // this allocator (hence from System) and that `new_size` is valid for `layout`.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            account(layout.size(), -1);
            account(new_size, 1);
        }
        p
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Runs `f` with its allocations attributed to `side`.
fn on<R>(side: usize, f: impl FnOnce() -> R) -> R {
    let prev = SIDE.swap(side, Ordering::Relaxed);
    let r = f();
    SIDE.store(prev, Ordering::Relaxed);
    r
}

// ----- two endpoints in memory --------------------------------------------------------------

const ACTIVE: usize = 1;
const PASSIVE: usize = 2;
const SVC: u64 = 0x0000_0000_0106_4e20;

fn ip(last: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(198, 18, 0, last))
}

struct Pair {
    a: Endpoint,
    p: Endpoint,
    a_addr: IpAddr,
    p_addr: IpAddr,
    now: Instant,
    /// Longer than timewait and the first retransmission wait.
    jump: Duration,
    next_qpn: u32,
}

/// rdma_cm's packet lifetime on RoCE.
const PLT: u8 = 16;

impl Pair {
    fn new() -> Self {
        let (a_addr, p_addr) = (ip(1), ip(2));
        let a = Endpoint::new(EndpointConfig::new(a_addr, 0x0002_c903_0000_0001, 1));
        let mut p = Endpoint::new(EndpointConfig::new(p_addr, 0x0002_c903_0000_0002, 2));
        p.listen(SVC, u64::MAX, 0).expect("listen");
        Pair {
            a,
            p,
            a_addr,
            p_addr,
            now: Instant::now(),
            jump: Duration::from_millis(2 * ibta_time_ms(cm_ack_timeout(15, PLT)).max(1000)),
            next_qpn: 0x100,
        }
    }

    fn qpn(&mut self) -> u32 {
        self.next_qpn = (self.next_qpn + 1) & 0xFF_FFFF;
        self.next_qpn
    }

    /// Moves everything the active side sent to the passive side.
    fn a_to_p(&mut self) {
        let now = self.now;
        while let Some(t) = on(ACTIVE, || self.a.poll_transmit()) {
            debug_assert_eq!(t.dst, self.p_addr);
            let from = self.a_addr;
            on(PASSIVE, || self.p.handle_datagram(now, from, &t.mad));
        }
    }

    fn p_to_a(&mut self) {
        let now = self.now;
        while let Some(t) = on(PASSIVE, || self.p.poll_transmit()) {
            let from = self.p_addr;
            on(ACTIVE, || self.a.handle_datagram(now, from, &t.mad));
        }
    }

    /// The next event of one side, dropped under that side's attribution.
    fn a_event(&mut self) -> Option<(CepHandle, CmEvent)> {
        on(ACTIVE, || self.a.poll_event())
    }

    fn p_event(&mut self) -> Option<(CepHandle, CmEvent)> {
        on(PASSIVE, || self.p.poll_event())
    }

    /// REQ → REP → RTU. Returns (active handle, passive handle).
    fn establish(&mut self) -> (CepHandle, CepHandle) {
        let now = self.now;
        let mut params = ConnectParams::new(self.p_addr, SVC, self.qpn());
        params.path.packet_life_time = PLT;
        let h = on(ACTIVE, || self.a.connect(now, &params)).expect("connect");
        self.a_to_p();
        let child = match self.p_event() {
            Some((_, CmEvent::ReqReceived { cep, info, .. })) => {
                on(PASSIVE, || drop(info));
                cep
            }
            other => panic!("expected ReqReceived, got {other:?}"),
        };
        let acc = AcceptParams {
            qpn: self.qpn(),
            ..AcceptParams::default()
        };
        on(PASSIVE, || self.p.accept(now, child, &acc)).expect("accept");
        self.p_to_a();
        match self.a_event() {
            Some((eh, CmEvent::RepReceived(info))) if eh == h => on(ACTIVE, || drop(info)),
            other => panic!("expected RepReceived, got {other:?}"),
        }
        on(ACTIVE, || self.a.establish(h)).expect("establish");
        assert!(matches!(self.a_event(), Some((_, CmEvent::Established))));
        self.a_to_p();
        assert!(matches!(self.p_event(), Some((_, CmEvent::Established))));
        (h, child)
    }

    /// DREQ → DREP; both sides end in timewait.
    fn disconnect(&mut self, h: CepHandle, child: CepHandle) {
        let now = self.now;
        on(ACTIVE, || self.a.disconnect(now, h, &[])).expect("disconnect");
        self.a_to_p();
        match self.p_event() {
            Some((_, CmEvent::DreqReceived { private_data })) => on(PASSIVE, || drop(private_data)),
            other => panic!("expected DreqReceived, got {other:?}"),
        }
        on(PASSIVE, || self.p.disconnect(now, child, &[])).expect("drep");
        self.p_to_a();
        assert!(matches!(self.a_event(), Some((_, CmEvent::DrepReceived))));
    }

    /// Jumps past timewait (and every stale retransmission deadline), then destroys both.
    fn expire_and_destroy(&mut self, h: CepHandle, child: CepHandle) {
        self.now += self.jump;
        let now = self.now;
        on(ACTIVE, || self.a.handle_timeout(now));
        on(PASSIVE, || self.p.handle_timeout(now));
        assert!(matches!(self.a_event(), Some((_, CmEvent::TimewaitExit))));
        assert!(matches!(self.p_event(), Some((_, CmEvent::TimewaitExit))));
        on(ACTIVE, || self.a.destroy(now, h)).expect("destroy");
        on(PASSIVE, || self.p.destroy(now, child)).expect("destroy");
    }

    fn cycle(&mut self) {
        let (h, child) = self.establish();
        self.disconnect(h, child);
        self.expire_and_destroy(h, child);
    }
}

fn handshake(c: &mut Criterion) {
    let mut pair = Pair::new();
    // Warm up and check nothing accumulates.
    for _ in 0..1000 {
        pair.cycle();
    }
    assert_eq!(pair.a.cep_count(), 0);
    assert_eq!(pair.p.cep_count(), 0);
    assert_eq!(pair.a.table_sizes(), (0, 0, 0, 0, 0));
    assert_eq!(pair.p.table_sizes(), (0, 0, 0, 0, 0));
    let mut g = c.benchmark_group("handshake");
    g.throughput(Throughput::Elements(1));
    g.bench_function("connect_establish_disconnect", |b| {
        b.iter(|| black_box(&mut pair).cycle());
    });
    g.finish();
    assert_eq!(pair.a.table_sizes(), (0, 0, 0, 0, 0));
    assert_eq!(pair.p.table_sizes(), (0, 0, 0, 0, 0));
}

/// Heap bytes per established connection, per side, printed (not timed). `RCM_BENCH_CONNS`
/// overrides the number of connections (10,000); hash tables grow in powers of two, so the
/// figure includes their slack at that size.
#[allow(clippy::cast_precision_loss)] // byte counts far below 2^52
fn state_per_connection() {
    let n: usize = std::env::var("RCM_BENCH_CONNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let mut pair = Pair::new();
    let mut handles = Vec::with_capacity(n);
    // One connection first so lazily allocated buffers (queues, the listener) are not counted.
    let first = pair.establish();
    let base = [0, ACTIVE, PASSIVE].map(|s| NET[s].load(Ordering::Relaxed));
    for _ in 0..n {
        handles.push(pair.establish());
    }
    for (a, p) in &handles {
        assert_eq!(pair.a.state(*a), Some(State::Established));
        assert_eq!(pair.p.state(*p), Some(State::Established));
    }
    // Established connections have no timers; pop the cancelled retransmission entries so only
    // what the connections hold remains (container capacities are kept, and counted).
    pair.now += Duration::from_secs(120);
    let now = pair.now;
    on(ACTIVE, || pair.a.handle_timeout(now));
    on(PASSIVE, || pair.p.handle_timeout(now));
    assert!(pair.a.poll_timeout().is_none() && pair.p.poll_timeout().is_none());
    let per = |s: usize| (NET[s].load(Ordering::Relaxed) - base[s]) as f64 / n as f64;
    println!(
        "state per established connection (N = {n}): active {:.1} B, passive {:.1} B; \
         cep_count {} / {}, tables active {:?} passive {:?}",
        per(ACTIVE),
        per(PASSIVE),
        pair.a.cep_count(),
        pair.p.cep_count(),
        pair.a.table_sizes(),
        pair.p.table_sizes(),
    );
    black_box(first);
}

criterion_group!(benches, handshake);

fn main() {
    state_per_connection();
    benches();
    Criterion::default().configure_from_args().final_summary();
}
