//! Stress: worker threads race create, listen, connect, accept, reject, disconnect, blocking
//! destroy, non-blocking destroy, destroy from inside callbacks (own and other ids'),
//! `Flow::Destroy`, channel-mode ids with a consumer, and device removal (devices are removed
//! and new ones added all along). Checked throughout and at the end:
//! - no callback (or channel event) after a destroy returned, after `Flow::Destroy`, or after
//!   the id's context was dropped; never two callbacks of one id at once; at most one
//!   `DeviceRemoval` per id and nothing after it;
//! - a blocking destroy outside callbacks returns `Done` (or `EventsOutstanding` for a held
//!   channel event), with the context already dropped; from inside a callback it never
//!   blocks;
//! - every context is dropped exactly once;
//! - no event is lost: after the run and 2.5 s of quiet, no callback-mode client is still in
//!   `Connect` (its ConnectResponse / Rejected / Unreachable went missing);
//! - nothing is left: `live_ids() == 0`, `bound_ports() == 0`, and `engine_ceps() == 0`
//!   once timewait is over;
//! - no hang: a watchdog exits the process with a report of what every thread is doing,
//!   which destroys and removals are pending and which callbacks are in flight when no
//!   progress is made for 30 s.
//!
//! `RCM_STRESS_SECS` (default 15) sets the duration, `RCM_STRESS_THREADS` (default 4) the
//! number of worker threads; with `RCM_STRESS_GDB` set, the watchdog also prints every
//! thread's stack (via gdb) before exiting. UDP port 25900.
#![cfg(not(loom))]

use rcm::{
    any_addr, AcceptOptions, CallbackMode, CmId, ConnectOptions, DestroyHandle, DestroyOutcome,
    Error, Event, EventChannel, Fabric, FabricConfig, Flow, PortSpace, State,
};
use rcm_proto::ib::RetryPolicy;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread;
use std::time::{Duration, Instant};

const UDP_PORT: u16 = 25900;
const LISTEN_PORTS: u16 = 6;
const FIRST_PORT: u16 = 7000;
const MAX_LIVE: usize = 96;
const STALL: Duration = Duration::from_secs(30);

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// xorshift64*: deterministic per seed, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn pick<'a, T>(&mut self, v: &'a [T]) -> Option<&'a T> {
        if v.is_empty() {
            None
        } else {
            v.get(self.below(v.len() as u64) as usize)
        }
    }
}

fn thread_rng() -> Rng {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let id = format!("{:?}", thread::current().id());
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ t;
    for b in id.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    Rng(h | 1)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Listener,
    Client,
    ChannelClient,
    Child,
}

/// What the test knows about one id.
struct Rec {
    id: CmId,
    role: Role,
    in_cb: AtomicBool,
    /// A destroy returned `Done`, or a `DestroyHandle` reported done.
    destroyed: AtomicBool,
    /// A callback returned `Flow::Destroy` (or asked for a deferred destroy).
    flow_destroy: AtomicBool,
    ctx_dropped: AtomicBool,
    ctx_drops: AtomicUsize,
    removals: AtomicUsize,
    callbacks: AtomicUsize,
    listener: Mutex<Option<u64>>,
}

impl Rec {
    fn gone(&self) -> bool {
        self.destroyed.load(Ordering::SeqCst) || self.flow_destroy.load(Ordering::SeqCst)
    }
}

/// The context attached to every id: checks it is dropped once, never during a callback.
struct Ctx(Weak<Rec>);

impl Drop for Ctx {
    fn drop(&mut self) {
        if let Some(r) = self.0.upgrade() {
            r.ctx_drops.fetch_add(1, Ordering::SeqCst);
            if r.in_cb.load(Ordering::SeqCst) {
                violation(format!(
                    "context of id {} dropped while its callback ran",
                    r.id.key()
                ));
            }
            r.ctx_dropped.store(true, Ordering::SeqCst);
        }
    }
}

static VIOLATIONS: Mutex<Vec<String>> = Mutex::new(Vec::new());

fn violation(s: String) {
    let mut v = VIOLATIONS.lock().unwrap();
    if v.len() < 1000 {
        v.push(s);
    }
}

#[derive(Default)]
struct Counters {
    callbacks: AtomicU64,
    channel_events: AtomicU64,
    listeners: AtomicU64,
    clients: AtomicU64,
    connects: AtomicU64,
    accepts: AtomicU64,
    rejects: AtomicU64,
    established: AtomicU64,
    disconnects: AtomicU64,
    destroys: AtomicU64,
    begin_destroys: AtomicU64,
    flow_destroys: AtomicU64,
    destroys_in_callbacks: AtomicU64,
    events_outstanding: AtomicU64,
    device_removals: AtomicU64,
    removal_events: AtomicU64,
    typed_errors: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

struct World {
    f: Fabric,
    recs: Mutex<HashMap<u64, Arc<Rec>>>,
    live: Mutex<Vec<Arc<Rec>>>,
    listeners: Mutex<Vec<(SocketAddr, Arc<Rec>)>>,
    devices: Mutex<Vec<IpAddr>>,
    pending: Mutex<Vec<(Arc<Rec>, DestroyHandle, Instant)>>,
    removal: Mutex<Option<(IpAddr, rcm::Removal, Instant)>>,
    /// Ids that got their `DeviceRemoval` and are left alive a little while (anything
    /// arriving for them meanwhile is a violation); the device remover destroys them.
    doomed: Mutex<Vec<(Arc<Rec>, Instant)>>,
    ch: EventChannel,
    stop: AtomicBool,
    progress: AtomicU64,
    doing: Vec<Mutex<(String, Instant)>>,
    c: Counters,
}

impl World {
    fn progress(&self) {
        self.progress.fetch_add(1, Ordering::Relaxed);
    }

    fn set_doing(&self, slot: usize, what: String) {
        *self.doing[slot].lock().unwrap() = (what, Instant::now());
    }

    fn track(&self, id: &CmId, role: Role) -> Arc<Rec> {
        let rec = Arc::new(Rec {
            id: id.clone(),
            role,
            in_cb: AtomicBool::new(false),
            destroyed: AtomicBool::new(false),
            flow_destroy: AtomicBool::new(false),
            ctx_dropped: AtomicBool::new(false),
            ctx_drops: AtomicUsize::new(0),
            removals: AtomicUsize::new(0),
            callbacks: AtomicUsize::new(0),
            listener: Mutex::new(None),
        });
        id.set_context(Ctx(Arc::downgrade(&rec)));
        self.recs.lock().unwrap().insert(id.key(), rec.clone());
        self.live.lock().unwrap().push(rec.clone());
        rec
    }

    fn rec(&self, key: u64) -> Option<Arc<Rec>> {
        self.recs.lock().unwrap().get(&key).cloned()
    }

    fn random_live(&self, rng: &mut Rng) -> Option<Arc<Rec>> {
        let live = self.live.lock().unwrap();
        for _ in 0..4 {
            let r = rng.pick(&live)?;
            if !r.gone() && !r.ctx_dropped.load(Ordering::SeqCst) {
                return Some(r.clone());
            }
        }
        None
    }

    /// A blocking destroy from a thread that is not in a callback.
    fn destroy_blocking(&self, rec: &Arc<Rec>) {
        match rec.id.destroy() {
            Ok(DestroyOutcome::Done) => {
                bump(&self.c.destroys);
                rec.destroyed.store(true, Ordering::SeqCst);
                if rec.ctx_drops.load(Ordering::SeqCst) != 1 {
                    violation(format!(
                        "destroy of id {} returned Done with its context dropped {} times",
                        rec.id.key(),
                        rec.ctx_drops.load(Ordering::SeqCst)
                    ));
                }
            }
            Ok(DestroyOutcome::Deferred) => violation(format!(
                "a blocking destroy of id {} outside callbacks returned Deferred",
                rec.id.key()
            )),
            Err(Error::EventsOutstanding(_)) => {
                bump(&self.c.events_outstanding);
                self.begin_destroy(rec);
            }
            Err(e) => violation(format!("destroy of id {}: {e:?}", rec.id.key())),
        }
    }

    fn begin_destroy(&self, rec: &Arc<Rec>) {
        bump(&self.c.begin_destroys);
        let h = rec.id.begin_destroy();
        self.pending
            .lock()
            .unwrap()
            .push((rec.clone(), h, Instant::now()));
    }

    /// Destroy from inside a callback (of `me`): must not block.
    fn destroy_in_callback(&self, me: &Rec, target: &Arc<Rec>) {
        bump(&self.c.destroys_in_callbacks);
        let t0 = Instant::now();
        let r = target.id.destroy();
        if t0.elapsed() > Duration::from_secs(2) {
            violation(format!(
                "destroy of id {} from id {}'s callback blocked {:?}",
                target.id.key(),
                me.id.key(),
                t0.elapsed()
            ));
        }
        match r {
            Ok(DestroyOutcome::Done) => {
                target.destroyed.store(true, Ordering::SeqCst);
            }
            Ok(DestroyOutcome::Deferred) | Err(Error::EventsOutstanding(_)) => {
                self.begin_destroy(target);
            }
            Err(e) => violation(format!("destroy in callback: {e:?}")),
        }
    }

    fn typed(&self, r: Result<(), Error>) -> bool {
        match r {
            Ok(()) => true,
            Err(Error::Io(e)) => {
                violation(format!("I/O error from an id operation: {e}"));
                false
            }
            Err(_) => {
                bump(&self.c.typed_errors);
                false
            }
        }
    }
}

/// Entry checks shared by callbacks and channel events.
fn on_entry(rec: &Rec, ev: &Event, what: &str) {
    let k = rec.id.key();
    if rec.destroyed.load(Ordering::SeqCst) {
        violation(format!(
            "{what} {} for id {k} after its destroy returned",
            ev.name()
        ));
    }
    if rec.flow_destroy.load(Ordering::SeqCst) {
        violation(format!(
            "{what} {} for id {k} after Flow::Destroy",
            ev.name()
        ));
    }
    if rec.ctx_dropped.load(Ordering::SeqCst) {
        violation(format!(
            "{what} {} for id {k} after its context was dropped",
            ev.name()
        ));
    }
    if rec.removals.load(Ordering::SeqCst) > 0 {
        violation(format!(
            "{what} {} for id {k} after its DeviceRemoval",
            ev.name()
        ));
    }
    rec.callbacks.fetch_add(1, Ordering::Relaxed);
}

fn handler(w: &Weak<World>, id: &CmId, ev: Event) -> Flow {
    let Some(w) = w.upgrade() else {
        return Flow::Continue;
    };
    let rec = match w.rec(id.key()) {
        Some(r) => r,
        None => w.track(id, Role::Child),
    };
    if rec.in_cb.swap(true, Ordering::SeqCst) {
        violation(format!("two callbacks at once for id {}", id.key()));
    }
    on_entry(&rec, &ev, "callback");
    bump(&w.c.callbacks);
    w.progress();
    let mut rng = thread_rng();
    let flow = react(&w, &rec, ev, &mut rng);
    if flow == Flow::Destroy {
        bump(&w.c.flow_destroys);
        rec.flow_destroy.store(true, Ordering::SeqCst);
    }
    rec.in_cb.store(false, Ordering::SeqCst);
    flow
}

fn react(w: &Arc<World>, rec: &Arc<Rec>, ev: Event, rng: &mut Rng) -> Flow {
    let id = &rec.id;
    match ev {
        Event::AddrResolved => {
            w.typed(id.resolve_route());
        }
        Event::RouteResolved => {
            let pd = vec![7u8; rng.below(57) as usize];
            if w.typed(id.connect(&ConnectOptions {
                private_data: pd,
                ..ConnectOptions::default()
            })) {
                bump(&w.c.connects);
            }
        }
        Event::ConnectRequest { listener, .. } => {
            if let Some(l) = w.rec(listener.key()) {
                if l.destroyed.load(Ordering::SeqCst) {
                    violation(format!(
                        "ConnectRequest (child {}) after its listener {}'s destroy returned",
                        id.key(),
                        listener.key()
                    ));
                }
            }
            *rec.listener.lock().unwrap() = Some(listener.key());
            match rng.below(100) {
                0..=49 => {
                    if w.typed(id.accept(&AcceptOptions::default())) {
                        bump(&w.c.accepts);
                    }
                }
                50..=69 => {
                    if w.typed(id.reject(b"no")) {
                        bump(&w.c.rejects);
                    }
                }
                70..=79 => return Flow::Destroy,
                80..=89 => {
                    if id.destroy() != Ok(DestroyOutcome::Deferred) {
                        violation(format!(
                            "destroy from id {}'s own callback was not Deferred",
                            id.key()
                        ));
                    }
                    rec.flow_destroy.store(true, Ordering::SeqCst);
                    w.begin_destroy(rec);
                }
                _ => {
                    if let Some(other) = w.random_live(rng) {
                        if Arc::ptr_eq(&other, rec) {
                            rec.flow_destroy.store(true, Ordering::SeqCst);
                        }
                        w.destroy_in_callback(rec, &other);
                    }
                    let _ = id.accept(&AcceptOptions::default());
                }
            }
        }
        Event::ConnectResponse { .. } => {
            w.typed(id.establish());
        }
        Event::Established { .. } => {
            bump(&w.c.established);
            if rng.below(10) == 0 && w.typed(id.disconnect()) {
                bump(&w.c.disconnects);
            }
        }
        Event::Disconnected
        | Event::Rejected { .. }
        | Event::Unreachable(_)
        | Event::ConnectError(_) => {
            if rng.below(2) == 0 {
                return Flow::Destroy;
            }
        }
        Event::DeviceRemoval => {
            bump(&w.c.removal_events);
            if rec.removals.fetch_add(1, Ordering::SeqCst) > 0 {
                violation(format!("a second DeviceRemoval for id {}", id.key()));
            }
            // Refused as removed, or as destroyed: another thread (or another id's callback)
            // may be destroying this id while its DeviceRemoval callback runs, and then
            // `Destroyed` is the truthful answer (seen once in CI: the oracle demanded
            // `DeviceRemoved` only).
            let (disc, lis) = (id.disconnect(), id.listen(0));
            let refused =
                |r: &rcm::Result<()>| matches!(r, Err(Error::DeviceRemoved | Error::Destroyed));
            if !refused(&disc) || !refused(&lis) {
                violation(format!(
                    "id {} accepted an operation after DeviceRemoval: disconnect {disc:?}, listen {lis:?}",
                    id.key()
                ));
            }
            match rng.below(10) {
                0..=5 => return Flow::Destroy,
                6 | 7 => {
                    // Destroy from the own callback: deferred, teardown after return.
                    if id.destroy() != Ok(DestroyOutcome::Deferred) {
                        violation(format!(
                            "destroy from id {}'s own callback was not Deferred",
                            id.key()
                        ));
                    }
                    rec.flow_destroy.store(true, Ordering::SeqCst);
                    w.begin_destroy(rec);
                }
                _ => w.doomed.lock().unwrap().push((rec.clone(), Instant::now())),
            }
        }
        Event::AddrError(_) | Event::RouteError(_) | Event::TimewaitExit => {}
    }
    Flow::Continue
}

/// Takes the shared channel's events and handles them like the callbacks do.
fn consume(w: &Arc<World>, slot: usize) {
    let mut rng = thread_rng();
    while !w.stop.load(Ordering::SeqCst) {
        w.set_doing(slot, "get_event".into());
        let Some(mut e) = w.ch.get_event(Some(Duration::from_millis(20))) else {
            continue;
        };
        let key = e.id().key();
        let Some(rec) = w.rec(key) else {
            violation(format!("channel event for unknown id {key}"));
            continue;
        };
        let Some(ev) = e.take() else { continue };
        on_entry(&rec, &ev, "channel event");
        bump(&w.c.channel_events);
        w.progress();
        w.set_doing(slot, format!("handling {} of id {key}", ev.name()));
        let id = rec.id.clone();
        let end = match ev {
            Event::AddrResolved => {
                w.typed(id.resolve_route());
                false
            }
            Event::RouteResolved => {
                if w.typed(id.connect(&ConnectOptions::default())) {
                    bump(&w.c.connects);
                }
                false
            }
            Event::ConnectResponse { .. } => {
                w.typed(id.establish());
                false
            }
            Event::Established { .. } => {
                bump(&w.c.established);
                false
            }
            Event::DeviceRemoval => {
                bump(&w.c.removal_events);
                if rec.removals.fetch_add(1, Ordering::SeqCst) > 0 {
                    violation(format!("a second DeviceRemoval for id {key}"));
                }
                if rng.below(2) == 0 {
                    w.doomed.lock().unwrap().push((rec.clone(), Instant::now()));
                    false
                } else {
                    true
                }
            }
            Event::Disconnected
            | Event::Rejected { .. }
            | Event::Unreachable(_)
            | Event::ConnectError(_) => rng.below(2) == 0,
            _ => false,
        };
        drop(e);
        if end && !rec.gone() {
            w.set_doing(slot, format!("destroy(id {key}) after its last event"));
            w.destroy_blocking(&rec);
        }
    }
}

fn live_devices(w: &World) -> Vec<IpAddr> {
    w.devices.lock().unwrap().clone()
}

fn work(w: &Arc<World>, slot: usize) {
    let mut rng = thread_rng();
    let weak = Arc::downgrade(w);
    while !w.stop.load(Ordering::SeqCst) {
        let live = w
            .live
            .lock()
            .unwrap()
            .iter()
            .filter(|r| !r.gone() && !r.ctx_dropped.load(Ordering::SeqCst))
            .count();
        // Keep a population of ids around (so removals find some), churning it.
        let roll = if live > MAX_LIVE {
            45 + rng.below(35)
        } else if live < MAX_LIVE / 2 {
            rng.below(45)
        } else {
            rng.below(100)
        };
        match roll {
            // A listener, on a device or wildcard.
            0..=9 => {
                if w.listeners.lock().unwrap().len() >= 8 {
                    continue;
                }
                w.set_doing(slot, "create listener".into());
                let wk = weak.clone();
                let id =
                    w.f.create_id(PortSpace::Tcp, move |id, ev| handler(&wk, id, ev));
                let rec = w.track(&id, Role::Listener);
                bump(&w.c.listeners);
                let port = FIRST_PORT + rng.below(u64::from(LISTEN_PORTS)) as u16;
                let a = if rng.below(5) == 0 {
                    any_addr(false, port)
                } else {
                    match rng.pick(&live_devices(w)) {
                        Some(ip) => SocketAddr::new(*ip, port),
                        None => continue,
                    }
                };
                w.set_doing(slot, format!("bind+listen id {} on {a}", id.key()));
                if w.typed(id.bind(a)) && w.typed(id.listen(0)) {
                    let targets: Vec<SocketAddr> = if a.ip().is_unspecified() {
                        live_devices(w)
                            .into_iter()
                            .map(|ip| SocketAddr::new(ip, port))
                            .collect()
                    } else {
                        vec![a]
                    };
                    let mut ls = w.listeners.lock().unwrap();
                    ls.extend(targets.into_iter().map(|t| (t, rec.clone())));
                } else {
                    w.set_doing(slot, format!("destroy failed listener {}", id.key()));
                    w.destroy_blocking(&rec);
                }
            }
            // A client (callback or channel mode).
            10..=44 => {
                let channel = rng.below(10) < 3;
                let id = if channel {
                    w.f.create_id_on(PortSpace::Tcp, &w.ch)
                } else {
                    let wk = weak.clone();
                    w.f.create_id(PortSpace::Tcp, move |id, ev| handler(&wk, id, ev))
                };
                let rec = w.track(
                    &id,
                    if channel {
                        Role::ChannelClient
                    } else {
                        Role::Client
                    },
                );
                bump(&w.c.clients);
                let dst = match rng.below(10) {
                    0 => SocketAddr::new(IpAddr::from([127, 0, 0, 250]), FIRST_PORT),
                    1 => match rng.pick(&live_devices(w)) {
                        Some(ip) => SocketAddr::new(*ip, FIRST_PORT + 50),
                        None => continue,
                    },
                    _ => {
                        let ls = w.listeners.lock().unwrap();
                        match rng.pick(&ls) {
                            Some((a, _)) => *a,
                            None => SocketAddr::new(IpAddr::from([127, 0, 0, 1]), FIRST_PORT),
                        }
                    }
                };
                // A third from the destination's own device, when it has one: the two ids
                // then talk through its loopback (`FabricConfig::loopback`), in the calling
                // threads rather than the receive loops.
                let src =
                    (rng.below(3) == 0 && live_devices(w).contains(&dst.ip())).then_some(dst.ip());
                w.set_doing(
                    slot,
                    format!("resolve_addr id {} to {dst} from {src:?}", id.key()),
                );
                if !w.typed(id.resolve_addr(src, dst)) {
                    w.destroy_blocking(&rec);
                }
            }
            // Blocking destroy of a random id.
            45..=64 => {
                if let Some(rec) = w.random_live(&mut rng) {
                    if rec.gone() {
                        continue;
                    }
                    w.set_doing(slot, format!("destroy(id {})", rec.id.key()));
                    w.destroy_blocking(&rec);
                }
            }
            // Non-blocking destroy.
            65..=79 => {
                if let Some(rec) = w.random_live(&mut rng) {
                    if rec.gone() {
                        continue;
                    }
                    w.set_doing(slot, format!("begin_destroy(id {})", rec.id.key()));
                    w.begin_destroy(&rec);
                    if rng.below(4) == 0 {
                        let h = rec.id.begin_destroy();
                        w.set_doing(slot, format!("wait_for(id {})", rec.id.key()));
                        if !h.wait_for(Duration::from_secs(10)) {
                            violation(format!(
                                "non-blocking destroy of id {} ({:?}) not done in 10 s",
                                rec.id.key(),
                                rec.role
                            ));
                        }
                    }
                }
            }
            // Disconnect an established connection.
            80..=89 => {
                if let Some(rec) = w.random_live(&mut rng) {
                    if rec.id.state() == State::Established {
                        w.set_doing(slot, format!("disconnect(id {})", rec.id.key()));
                        if w.typed(rec.id.disconnect()) {
                            bump(&w.c.disconnects);
                        }
                    }
                }
            }
            _ => {
                w.set_doing(slot, "sleep".into());
                thread::sleep(Duration::from_millis(1));
            }
        }
        w.progress();
        if rng.below(4) == 0 {
            thread::sleep(Duration::from_micros(rng.below(1500)));
        }
    }
}

/// Marks finished non-blocking destroys and prunes the live list.
fn reap(w: &World) {
    let mut pending = w.pending.lock().unwrap();
    pending.retain(|(rec, h, since)| {
        if h.is_done() {
            rec.destroyed.store(true, Ordering::SeqCst);
            false
        } else {
            if since.elapsed() > Duration::from_secs(20) {
                violation(format!(
                    "non-blocking destroy of id {} ({:?}, {:?}) pending for {:?}",
                    rec.id.key(),
                    rec.role,
                    rec.id.state(),
                    since.elapsed()
                ));
                return false;
            }
            true
        }
    });
    drop(pending);
    w.live
        .lock()
        .unwrap()
        .retain(|r| !(r.destroyed.load(Ordering::SeqCst) || r.ctx_dropped.load(Ordering::SeqCst)));
    w.listeners
        .lock()
        .unwrap()
        .retain(|(_, r)| !r.gone() && r.removals.load(Ordering::SeqCst) == 0);
}

fn remove_devices(w: &Arc<World>, slot: usize) {
    let mut rng = thread_rng();
    let mut next: u32 = 0;
    while !w.stop.load(Ordering::SeqCst) {
        w.set_doing(slot, "sleep".into());
        thread::sleep(Duration::from_millis(300 + rng.below(500)));
        if w.stop.load(Ordering::SeqCst) {
            break;
        }
        let devs = live_devices(w);
        if devs.len() < 3 {
            continue;
        }
        let Some(ip) = rng.pick(&devs).copied() else {
            continue;
        };
        w.devices.lock().unwrap().retain(|d| *d != ip);
        w.set_doing(slot, format!("remove_device({ip})"));
        let removal = match w.f.remove_device(ip) {
            Ok(r) => r,
            Err(e) => {
                violation(format!("remove_device({ip}): {e:?}"));
                continue;
            }
        };
        bump(&w.c.device_removals);
        w.progress();
        let holders = removal.holding();
        *w.removal.lock().unwrap() = Some((ip, removal, Instant::now()));
        w.set_doing(
            slot,
            format!("Removal::wait({ip}), held by {} ids", holders.len()),
        );
        let mut waited = Duration::ZERO;
        loop {
            let r = {
                let g = w.removal.lock().unwrap();
                g.as_ref().map(|(_, r, _)| r.wait(Duration::ZERO))
            };
            match r {
                Some(Ok(())) | None => break,
                Some(Err(keys)) => {
                    let due: Vec<Arc<Rec>> = {
                        let mut d = w.doomed.lock().unwrap();
                        let (due, keep) = d
                            .drain(..)
                            .partition(|(_, t)| t.elapsed() > Duration::from_millis(100));
                        *d = keep;
                        due.into_iter().map(|(r, _)| r).collect()
                    };
                    for r in due {
                        w.set_doing(slot, format!("destroy(id {}) after removal", r.id.key()));
                        w.destroy_blocking(&r);
                    }
                    if waited > Duration::from_secs(10) {
                        let detail: Vec<String> = keys
                            .iter()
                            .map(|k| match w.rec(*k) {
                                Some(r) => format!(
                                    "{k} ({:?}, {:?}, in callback: {})",
                                    r.role,
                                    r.id.state(),
                                    r.in_cb.load(Ordering::SeqCst)
                                ),
                                None => format!("{k} (unknown to the test)"),
                            })
                            .collect();
                        violation(format!(
                            "removal of {ip} still held after 10 s by {}",
                            detail.join(", ")
                        ));
                        // Release them so the run goes on.
                        for k in keys {
                            if let Some(r) = w.rec(k) {
                                w.begin_destroy(&r);
                            }
                        }
                        waited = Duration::ZERO;
                    }
                    thread::sleep(Duration::from_millis(10));
                    waited += Duration::from_millis(10);
                }
            }
        }
        *w.removal.lock().unwrap() = None;
        w.progress();
        // A fresh device keeps the count up.
        next += 1;
        let fresh = IpAddr::from([127, 0, 3 + (next / 250) as u8, (next % 250 + 1) as u8]);
        w.set_doing(slot, format!("add_device({fresh})"));
        match w.f.add_device(fresh) {
            Ok(_) => w.devices.lock().unwrap().push(fresh),
            Err(e) => violation(format!("add_device({fresh}): {e:?}")),
        }
    }
}

/// What everything is doing, for the watchdog.
fn report(w: &World) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "threads:");
    for (i, d) in w.doing.iter().enumerate() {
        if let Ok(d) = d.try_lock() {
            let _ = writeln!(s, "  slot {i}: {} (for {:?})", d.0, d.1.elapsed());
        } else {
            let _ = writeln!(s, "  slot {i}: <busy>");
        }
    }
    if let Ok(p) = w.pending.try_lock() {
        let _ = writeln!(s, "pending non-blocking destroys: {}", p.len());
        for (rec, _, since) in p.iter().filter(|(_, h, _)| !h.is_done()).take(30) {
            let _ = writeln!(
                s,
                "  id {} ({:?}, {:?}) waiting {:?}, in callback: {}",
                rec.id.key(),
                rec.role,
                rec.id.state(),
                since.elapsed(),
                rec.in_cb.load(Ordering::SeqCst)
            );
        }
    }
    if let Ok(r) = w.removal.try_lock() {
        if let Some((ip, removal, since)) = r.as_ref() {
            let _ = writeln!(
                s,
                "removal of {ip} for {:?}, held by {:?}",
                since.elapsed(),
                removal.holding()
            );
        }
    }
    if let Ok(recs) = w.recs.try_lock() {
        let busy: Vec<_> = recs
            .values()
            .filter(|r| r.in_cb.load(Ordering::SeqCst))
            .map(|r| format!("{} ({:?})", r.id.key(), r.role))
            .collect();
        let _ = writeln!(s, "callbacks in flight: {busy:?}");
    }
    let _ = writeln!(s, "live ids: {}", w.f.live_ids());
    s
}

fn counts(w: &World) -> String {
    let c = &w.c;
    let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
    format!(
        "callbacks {}, channel events {}, listeners {}, clients {}, connects {}, accepts {}, \
         rejects {}, established {}, disconnects {}, destroys {}, begin_destroys {}, \
         Flow::Destroy {}, destroys in callbacks {}, EventsOutstanding {}, device removals {}, \
         DeviceRemoval events {}, typed errors {}, looped back by the live devices {}, \
         received by a waiting consumer on them (busy polling) {}",
        l(&c.callbacks),
        l(&c.channel_events),
        l(&c.listeners),
        l(&c.clients),
        l(&c.connects),
        l(&c.accepts),
        l(&c.rejects),
        l(&c.established),
        l(&c.disconnects),
        l(&c.destroys),
        l(&c.begin_destroys),
        l(&c.flow_destroys),
        l(&c.destroys_in_callbacks),
        l(&c.events_outstanding),
        l(&c.device_removals),
        l(&c.removal_events),
        l(&c.typed_errors),
        live_devices(w)
            .iter()
            .filter_map(|ip| w.f.device(*ip))
            .map(|d| d.looped())
            .sum::<u64>(),
        live_devices(w)
            .iter()
            .filter_map(|ip| w.f.device(*ip))
            .map(|d| d.busy_polled())
            .sum::<u64>()
    )
}

#[test]
fn stress_lifecycle_races() {
    let secs = env_num("RCM_STRESS_SECS", 15);
    let threads = env_num("RCM_STRESS_THREADS", 4).max(1) as usize;
    // A third with the default polling, a third with callbacks run on the device threads
    // (`CallbackMode::Inline`: the events a receive loop produces run there, with their
    // sends batched), then a third with every thread sleeping at once (`spin` zero), where a
    // missed wake-up would show as a hang.
    let sleeping = secs / 3;
    let inline = secs / 3;
    stress(
        secs - sleeping - inline,
        threads,
        rcm::DEFAULT_SPIN,
        CallbackMode::Threads,
    );
    if inline > 0 {
        stress(inline, threads, rcm::DEFAULT_SPIN, CallbackMode::Inline);
    }
    if sleeping > 0 {
        stress(sleeping, threads, Duration::ZERO, CallbackMode::Threads);
    }
}

fn stress(secs: u64, threads: usize, spin: Duration, callbacks: CallbackMode) {
    eprintln!(
        "stress: {secs} s, {threads} threads, threads poll {spin:?} before sleeping, callbacks {callbacks:?}"
    );
    let cfg = FabricConfig {
        udp_port: UDP_PORT,
        retry: RetryPolicy::Backoff {
            initial: Duration::from_millis(50),
            max_wait: Duration::from_millis(200),
            deadline: Duration::from_secs(1),
        },
        min_timewait: Duration::ZERO,
        dispatcher_threads: 4,
        spin,
        callbacks,
        ..FabricConfig::default()
    };
    let f = Fabric::loopback_with(4, cfg).expect("loopback devices");
    // Slots: workers, then the consumer, the device remover and the main thread.
    let slots = threads + 3;
    let w = Arc::new(World {
        devices: Mutex::new(f.device_addrs()),
        f,
        recs: Mutex::default(),
        live: Mutex::default(),
        listeners: Mutex::default(),
        pending: Mutex::default(),
        removal: Mutex::new(None),
        doomed: Mutex::default(),
        ch: {
            let ch = EventChannel::new();
            ch.set_spin(spin);
            ch
        },
        stop: AtomicBool::new(false),
        progress: AtomicU64::new(0),
        doing: (0..slots)
            .map(|_| Mutex::new((String::from("starting"), Instant::now())))
            .collect(),
        c: Counters::default(),
    });
    let finished = Arc::new(AtomicBool::new(false));
    let watchdog = {
        let (w, finished) = (Arc::downgrade(&w), finished.clone());
        thread::spawn(move || {
            let mut last = 0;
            let mut since = Instant::now();
            while !finished.load(Ordering::SeqCst) {
                thread::sleep(Duration::from_millis(50));
                let Some(w) = w.upgrade() else { return };
                reap(&w);
                let p = w.progress.load(Ordering::Relaxed);
                if p != last {
                    last = p;
                    since = Instant::now();
                } else if since.elapsed() > STALL {
                    eprintln!(
                        "WATCHDOG: no progress for {:?}\n{}\ncounts: {}\nviolations so far: {:?}",
                        since.elapsed(),
                        report(&w),
                        counts(&w),
                        VIOLATIONS.lock().unwrap()
                    );
                    if std::env::var_os("RCM_STRESS_GDB").is_some() {
                        // Every thread's stack: who waits on which lock.
                        let _ = std::process::Command::new("gdb")
                            .args(["-p", &std::process::id().to_string(), "-batch"])
                            .args(["-ex", "thread apply all bt 25"])
                            .status();
                    }
                    std::process::exit(101);
                }
            }
        })
    };
    let started = Instant::now();
    let mut hs = Vec::new();
    for slot in 0..threads {
        let w = w.clone();
        hs.push(thread::spawn(move || work(&w, slot)));
    }
    {
        let w = w.clone();
        hs.push(thread::spawn(move || consume(&w, threads)));
    }
    {
        let w = w.clone();
        hs.push(thread::spawn(move || remove_devices(&w, threads + 1)));
    }
    thread::sleep(Duration::from_secs(secs));
    w.stop.store(true, Ordering::SeqCst);
    let main_slot = threads + 2;
    w.set_doing(main_slot, "joining threads".into());
    for h in hs {
        h.join().expect("a stress thread panicked");
    }
    let ran = started.elapsed();

    // Quiet for longer than any exchange takes (REQ deadline 1 s): a callback-mode client
    // still in Connect then lost the event that should have moved it on.
    w.set_doing(main_slot, "quiescence".into());
    for _ in 0..25 {
        thread::sleep(Duration::from_millis(100));
        w.progress();
    }
    let stuck: Vec<u64> = w
        .recs
        .lock()
        .unwrap()
        .values()
        .filter(|r| r.role == Role::Client && !r.gone() && r.removals.load(Ordering::SeqCst) == 0)
        .filter(|r| r.id.state() == State::Connect)
        .map(|r| r.id.key())
        .collect();
    if !stuck.is_empty() {
        violation(format!(
            "{} clients still in Connect 2.5 s after the run (lost ConnectResponse / \
             Rejected / Unreachable): {:?}",
            stuck.len(),
            &stuck[..stuck.len().min(20)]
        ));
    }

    // Everything the test knows of goes now; then nothing may be left.
    w.set_doing(main_slot, "final destroys".into());
    let all: Vec<Arc<Rec>> = w.recs.lock().unwrap().values().cloned().collect();
    for rec in &all {
        let h = rec.id.begin_destroy();
        w.set_doing(main_slot, format!("final wait for id {}", rec.id.key()));
        if !h.wait_for(Duration::from_secs(10)) {
            violation(format!(
                "final destroy of id {} ({:?}, {:?}) not done in 10 s",
                rec.id.key(),
                rec.role,
                rec.id.state()
            ));
        }
        w.progress();
    }
    // Drop anything still queued on the shared channel (events of destroyed ids).
    while w.ch.get_event(Some(Duration::ZERO)).is_some() {}
    for rec in &all {
        let n = rec.ctx_drops.load(Ordering::SeqCst);
        if n != 1 {
            violation(format!(
                "context of id {} ({:?}) dropped {n} times",
                rec.id.key(),
                rec.role
            ));
        }
    }
    let live = w.f.live_ids();
    if live != 0 {
        violation(format!(
            "{live} ids alive after every id the user knows was destroyed (ids the user \
             never saw)"
        ));
    }
    let ports = w.f.bound_ports();
    if ports != 0 {
        violation(format!("{ports} port bindings left"));
    }
    w.set_doing(main_slot, "waiting for timewait".into());
    let t0 = Instant::now();
    while w.f.engine_ceps() != 0 && t0.elapsed() < Duration::from_secs(15) {
        thread::sleep(Duration::from_millis(50));
        w.progress();
    }
    let ceps = w.f.engine_ceps();
    if ceps != 0 {
        violation(format!("{ceps} engine endpoints left after timewait"));
    }
    println!(
        "stress: {threads} threads for {ran:?} ({} ids), cleanup {:?}\n{}",
        all.len(),
        t0.elapsed(),
        counts(&w)
    );
    finished.store(true, Ordering::SeqCst);
    watchdog.join().unwrap();
    w.f.shutdown();
    let v = VIOLATIONS.lock().unwrap();
    let mut kinds: HashMap<String, usize> = HashMap::new();
    for s in v.iter() {
        // The message with its numbers blanked out names the kind.
        let mut kind = String::new();
        for c in s.chars().take(90) {
            if c.is_ascii_digit() {
                if !kind.ends_with('#') {
                    kind.push('#');
                }
            } else {
                kind.push(c);
            }
        }
        *kinds.entry(kind).or_default() += 1;
    }
    assert!(
        v.is_empty(),
        "{} violations; by kind: {kinds:#?}\nfirst ones:\n{}",
        v.len(),
        v.iter().take(40).cloned().collect::<Vec<_>>().join("\n")
    );
    let c = &w.c;
    assert!(
        c.callbacks.load(Ordering::Relaxed) > 0 && c.connects.load(Ordering::Relaxed) > 0,
        "the stress did no work: {}",
        counts(&w)
    );
}
