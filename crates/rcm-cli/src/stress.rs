//! `rcm stress`: threads racing create, connect, accept, reject, disconnect, destroy,
//! non-blocking destroy and device removal against one in-process fabric, checking the
//! lifecycle invariants as they go and at the end. Some clients are channel-mode ids, whose
//! events consumer threads take from a shared `EventChannel` (busy polling included) while
//! workers destroy them. Half of the workers' rounds and of the clients' callbacks make their
//! calls in an `rcm::Pipeline` (through `--daemon` those return before the daemon answers,
//! and a refused one comes back as an error event that must obey the same invariants).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rcm::{
    AcceptOptions, CmId, ConnectOptions, DestroyOutcome, Error, Event, EventChannel, Fabric,
    FabricConfig, Flow, PortSpace,
};
use rcm_proto::ib::RetryPolicy;
use serde::Serialize;
use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How to stress.
#[derive(Debug, Clone)]
pub struct StressOpts {
    /// How long.
    pub duration: Duration,
    /// Worker threads.
    pub threads: usize,
    /// Seed (runs with the same seed make the same choices; thread timing still varies).
    pub seed: u64,
    /// UDP port of the loopback devices.
    pub udp_port: u16,
    /// Stress the `rcm daemon` at this socket instead of devices in this process (device
    /// removal is then not exercised: the devices are the daemon's).
    pub daemon: Option<std::path::PathBuf>,
    /// Where the fabric's callbacks run (`rcm::CallbackMode`); the stress callbacks never
    /// block, so every mode applies.
    pub callbacks: rcm::CallbackMode,
    /// iWARP devices (MPA over TCP) instead of RoCEv2 ones; not with `daemon`.
    pub iwarp: bool,
}

/// Counts and verdicts.
#[derive(Debug, Default, Serialize)]
pub struct StressReport {
    /// What the ids ran on: "roce" or "iwarp" (the in-process devices, as opened), or
    /// "daemon".
    pub transport: &'static str,
    /// The seed of the random choices (`--seed` repeats the run's choices).
    pub seed: u64,
    /// Worker threads.
    pub threads: usize,
    /// How long it ran, in seconds (as asked).
    pub duration_s: u64,
    /// Ids created.
    pub created: u64,
    /// Connections established (client side).
    pub established: u64,
    /// Requests the server rejected.
    pub rejected: u64,
    /// Connections torn down by disconnect.
    pub disconnected: u64,
    /// Blocking destroys.
    pub destroys: u64,
    /// Non-blocking destroys.
    pub begin_destroys: u64,
    /// Destroys that returned `Deferred`: those made inside the id's own callback (each must)
    /// and those of worker threads that met a callback in flight.
    pub deferred: u64,
    /// Device removals (and re-adds).
    pub removals: u64,
    /// Device removals or re-adds that failed (each also a violation; removal is not
    /// exercised after one, as the device may be gone).
    pub removal_failures: u64,
    /// Callbacks run.
    pub callbacks: u64,
    /// Channel-mode clients created (among `created`).
    pub channel_ids: u64,
    /// Events the channel consumers took.
    pub channel_events: u64,
    /// Events the channel still handed out once the consumers had stopped, checked as
    /// theirs are (events of ids whose destroy never returned `Done` may be among them).
    pub channel_events_at_end: u64,
    /// Blocking destroys of channel ids refused while a consumer held one of their events
    /// (`EventsOutstanding`); each was then destroyed without blocking.
    pub refused_while_held: u64,
    /// Contexts created / dropped.
    pub contexts: (u64, u64),
    /// Threads of the run and client callbacks that panicked (each also a violation).
    pub panics: u64,
    /// Invariant violations found (empty when all held).
    pub violations: Vec<String>,
    /// The invariants checked.
    pub invariants: Vec<&'static str>,
    /// Invariants the run did not exercise (so not among `invariants`): device removal
    /// through a daemon (its devices are not this process's), or when no removal completed.
    pub not_checked: Vec<&'static str>,
}

/// What a device removal was checked against; only listed as checked when one completed.
const REMOVAL_INVARIANT: &str = "device removal completes within 10 s of its ids' destruction";

struct Shared {
    callbacks: AtomicU64,
    established: AtomicU64,
    rejected: AtomicU64,
    disconnected: AtomicU64,
    ctx_made: AtomicU64,
    ctx_dropped: AtomicU64,
    violations: Mutex<Vec<String>>,
    progress: AtomicU64,
    /// Destroys from inside the id's own callback (each must answer `Deferred`).
    deferred: AtomicU64,
    /// Channel-mode clients not yet destroyed, by key: an event for one that is not here
    /// came after its destroy returned `Done` (or for an id never made).
    channel_ids: Mutex<HashSet<u64>>,
    channel_made: AtomicU64,
    channel_events: AtomicU64,
    refused_while_held: AtomicU64,
    panics: AtomicU64,
    removal_failures: AtomicU64,
}

impl Shared {
    fn new() -> Self {
        Shared {
            callbacks: AtomicU64::new(0),
            established: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            disconnected: AtomicU64::new(0),
            ctx_made: AtomicU64::new(0),
            ctx_dropped: AtomicU64::new(0),
            violations: Mutex::new(Vec::new()),
            progress: AtomicU64::new(0),
            deferred: AtomicU64::new(0),
            channel_ids: Mutex::new(HashSet::new()),
            channel_made: AtomicU64::new(0),
            channel_events: AtomicU64::new(0),
            refused_while_held: AtomicU64::new(0),
            panics: AtomicU64::new(0),
            removal_failures: AtomicU64::new(0),
        }
    }
}

/// What a client's callbacks and the thread destroying it share, to tell whether a
/// callback ran after its destroy returned `Done`: one starting after that, or one still
/// running then.
#[derive(Default)]
struct Watch {
    /// Set the moment a destroy of the id returned `Done`.
    destroyed: AtomicBool,
    /// Set while a callback of the id runs.
    in_cb: AtomicBool,
}

/// The context every client id carries: it checks no callback runs after destroy returned
/// `Done`, and counts its own drop.
struct Ctx {
    shared: Arc<Shared>,
    watch: Arc<Watch>,
    dropped: AtomicBool,
}

impl Drop for Ctx {
    fn drop(&mut self) {
        if self.dropped.swap(true, Ordering::SeqCst) {
            violation(&self.shared, "context dropped twice".into());
        }
        self.shared.ctx_dropped.fetch_add(1, Ordering::SeqCst);
    }
}

fn violation(s: &Shared, msg: String) {
    // A panic elsewhere must not hide this (nor the run's verdict); the list stays whole,
    // as a push is all that is done under the lock.
    let mut v = s.violations.lock().unwrap_or_else(PoisonError::into_inner);
    if v.len() < 100 {
        v.push(msg);
    }
}

/// A thread of the run or a client callback panicked: the run fails.
fn panicked(s: &Shared, msg: String) {
    s.panics.fetch_add(1, Ordering::SeqCst);
    violation(s, msg);
}

/// Joins a thread of the run that has finished (or will: joining blocks), counting a panic
/// in it; `what` names it in the violation.
fn joined(s: &Shared, what: &str, t: JoinHandle<()>) {
    if let Err(p) = t.join() {
        let why = p
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| p.downcast_ref::<String>().map(String::as_str))
            .unwrap_or("a panic without a message");
        panicked(s, format!("{what} panicked: {why}"));
    }
}

/// A client callback from its entry until it returns or unwinds.
struct InCallback<'a> {
    shared: &'a Shared,
    watch: &'a Watch,
}

impl<'a> InCallback<'a> {
    /// Enters a callback of `id` for event `ev`, counting one that overlaps another of the
    /// same id or that runs after the id's destroy returned `Done`.
    fn enter(shared: &'a Shared, watch: &'a Watch, id: &dyn std::fmt::Debug, ev: &str) -> Self {
        // Marked before `destroyed` is read, as `destroyed()` sets that before reading this
        // (all SeqCst): a callback running at or after the moment destroy returned is seen
        // by one side or the other.
        if watch.in_cb.swap(true, Ordering::SeqCst) {
            violation(shared, format!("overlapping callbacks on {id:?}"));
        }
        if watch.destroyed.load(Ordering::SeqCst) {
            violation(
                shared,
                format!("callback {ev} on {id:?} after destroy returned Done"),
            );
        }
        InCallback { shared, watch }
    }
}

impl Drop for InCallback<'_> {
    fn drop(&mut self) {
        // rcm catches a callback's panic (and destroys the id), so only here is it seen.
        if std::thread::panicking() {
            panicked(self.shared, "a client callback panicked".into());
        }
        self.watch.in_cb.store(false, Ordering::SeqCst);
    }
}

/// Runs the stress test.
pub fn run(o: &StressOpts) -> Result<StressReport, String> {
    let cfg = FabricConfig {
        udp_port: o.udp_port,
        retry: RetryPolicy::Backoff {
            initial: Duration::from_millis(50),
            max_wait: Duration::from_millis(200),
            deadline: Duration::from_secs(1),
        },
        min_timewait: Duration::ZERO,
        dispatcher_threads: 2,
        seed: Some(o.seed),
        callbacks: o.callbacks,
        ..FabricConfig::default()
    };
    let (fabric, client, primary, removable) = if let Some(p) = &o.daemon {
        let c = rcm_ucm::Client::connect_for(p, &cfg)
            .map_err(|e| format!("daemon {}: {e}", p.display()))?;
        let f = Fabric::with_provider(Arc::new(c.clone()), cfg);
        let devs = f.device_addrs();
        let first = *devs.first().ok_or("the daemon has no devices")?;
        let last = devs.iter().rev().find(|d| d.is_ipv4() == first.is_ipv4());
        (f, Some(c), first, *last.unwrap_or(&first))
    } else {
        let f = if o.iwarp {
            Fabric::loopback_iwarp(2, cfg)
        } else {
            Fabric::loopback_with(2, cfg)
        }
        .map_err(|e| crate::device_error("loopback devices", &e))?;
        let removable = IpAddr::from([127, 0, 0, 3]);
        crate::add_device(&f, removable, o.iwarp)
            .map_err(|e| crate::device_error(&format!("device {removable}"), &e))?;
        (f, None, IpAddr::from([127, 0, 0, 1]), removable)
    };
    let through_daemon = client.is_some();
    let transport = match fabric.device(primary) {
        _ if through_daemon => "daemon",
        Some(d) if d.is_iwarp() => "iwarp",
        _ => "roce",
    };
    let shared = Arc::new(Shared::new());
    let ch = EventChannel::new();
    // The server: a wildcard listener; rejects one request in four, accepts the rest,
    // disconnects some established connections itself.
    let seed = o.seed;
    let sh = shared.clone();
    // The accepted children still up, by key: each leaves at the event that destroys it.
    // (Pruning by `state()` cost a call per child through a daemon, at every request: the
    // server fell behind and the clients' connects timed out.)
    let children: Arc<Mutex<HashMap<u64, CmId>>> = Arc::new(Mutex::new(HashMap::new()));
    let kids = children.clone();
    let server = fabric.create_id(PortSpace::Tcp, move |id, ev| {
        sh.callbacks.fetch_add(1, Ordering::Relaxed);
        match ev {
            Event::ConnectRequest { .. } => {
                if (id.key() ^ seed) % 4 == 0 {
                    let _ = id.reject(b"stress reject");
                    sh.rejected.fetch_add(1, Ordering::Relaxed);
                    Flow::Destroy
                } else if id.accept(&AcceptOptions::default()).is_err() {
                    Flow::Destroy
                } else {
                    if let Ok(mut k) = kids.lock() {
                        k.insert(id.key(), id.clone());
                    }
                    Flow::Continue
                }
            }
            Event::Established { .. } => {
                if (id.key() ^ seed) % 3 == 0 {
                    let _ = id.disconnect();
                }
                Flow::Continue
            }
            Event::Disconnected
            | Event::Rejected { .. }
            | Event::Unreachable(_)
            | Event::DeviceRemoval => {
                if let Ok(mut k) = kids.lock() {
                    k.remove(&id.key());
                }
                Flow::Destroy
            }
            _ => Flow::Continue,
        }
    });
    server
        .bind(rcm::any_addr(false, 7471))
        .map_err(|e| format!("bind: {e}"))?;
    server.listen(65536).map_err(|e| format!("listen: {e}"))?;

    let stop = Arc::new(AtomicBool::new(false));
    let counts = Arc::new((
        AtomicU64::new(0),
        AtomicU64::new(0),
        AtomicU64::new(0),
        AtomicU64::new(0),
        AtomicU64::new(0),
    ));
    let mut workers = Vec::new();
    for t in 0..o.threads.max(1) {
        let (fabric, shared, stop, counts, ch) = (
            fabric.clone(),
            shared.clone(),
            stop.clone(),
            counts.clone(),
            ch.clone(),
        );
        let mut rng =
            StdRng::seed_from_u64(o.seed ^ (t as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        workers.push(std::thread::spawn(move || {
            let mut live: Vec<(CmId, Arc<Watch>)> = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                shared.progress.fetch_add(1, Ordering::Relaxed);
                let _pipeline = rng.gen_bool(0.5).then(rcm::Pipeline::begin);
                match rng.gen_range(0..10) {
                    0..=4 => {
                        let (id, watch) = if rng.gen_bool(0.3) {
                            new_channel_client(&fabric, &shared, &ch)
                        } else {
                            new_client(&fabric, &shared, &mut rng)
                        };
                        counts.0.fetch_add(1, Ordering::Relaxed);
                        let dst = if rng.gen_bool(0.2) {
                            removable
                        } else {
                            primary
                        };
                        // Some from the server's own device: two ids of one device talk
                        // through its loopback (rcm::FabricConfig::loopback), in the
                        // calling threads, not the receive loop.
                        let src = rng.gen_bool(0.3).then_some(dst);
                        // Some bind first, a few of them to an address no device has (in
                        // a pipeline through a daemon such a bind returns at once, and its
                        // refusal seals the id: the resolve_addr behind it is refused too).
                        if rng.gen_bool(0.2) {
                            let ip = if rng.gen_bool(0.25) {
                                IpAddr::from([127, 0, 0, 254])
                            } else {
                                src.unwrap_or(dst)
                            };
                            let _ = id.bind(SocketAddr::new(ip, 0));
                        }
                        let _ = id.resolve_addr(src, SocketAddr::new(dst, 7471));
                        live.push((id, watch));
                    }
                    5..=7 if !live.is_empty() => {
                        let (id, watch) = live.swap_remove(rng.gen_range(0..live.len()));
                        match id.destroy() {
                            Ok(DestroyOutcome::Done) => destroyed(&shared, &id, &watch),
                            Ok(DestroyOutcome::Deferred) => {
                                counts.2.fetch_add(1, Ordering::Relaxed);
                            }
                            // A consumer holds one of its events: a blocking destroy would
                            // wait on it, so it is refused; this one does not block.
                            Err(Error::EventsOutstanding(_)) => {
                                shared.refused_while_held.fetch_add(1, Ordering::Relaxed);
                                destroy_without_blocking(&shared, &id, &watch);
                            }
                            Err(e) => violation(&shared, format!("destroy failed: {e}")),
                        }
                        counts.1.fetch_add(1, Ordering::Relaxed);
                    }
                    8 if !live.is_empty() => {
                        let (id, watch) = live.swap_remove(rng.gen_range(0..live.len()));
                        destroy_without_blocking(&shared, &id, &watch);
                        counts.3.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => std::thread::sleep(Duration::from_micros(rng.gen_range(0..500))),
                }
                if live.len() > 200 {
                    let (id, watch) = live.swap_remove(0);
                    destroy_any(&shared, &id, &watch);
                    counts.1.fetch_add(1, Ordering::Relaxed);
                }
            }
            for (id, watch) in live {
                destroy_any(&shared, &id, &watch);
                counts.1.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    // The channel's consumers: they drive their ids' connections as the callbacks do,
    // while workers destroy those ids under them.
    let consumers: Vec<_> = (0..o.threads.div_ceil(3).max(1))
        .map(|_| {
            let (ch, shared, stop) = (ch.clone(), shared.clone(), stop.clone());
            std::thread::spawn(move || consume(&ch, &shared, &stop))
        })
        .collect();
    // Device removal racing everything: remove 127.0.0.3 now and then, wait, add it back.
    // (Through a daemon the devices are the daemon's: nothing to remove here.)
    let iwarp = o.iwarp;
    let remover = (!through_daemon).then(|| {
        let (fabric, stop, counts, shared) =
            (fabric.clone(), stop.clone(), counts.clone(), shared.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(300));
                let readd = || crate::add_device(&fabric, removable, iwarp).map(drop);
                if !removal_round(&fabric, removable, &shared, &counts.4, readd) {
                    break;
                }
            }
        })
    });
    // Watchdog: progress must continue.
    let start = Instant::now();
    let mut last = (0, Instant::now());
    while start.elapsed() < o.duration {
        std::thread::sleep(Duration::from_millis(200));
        let p = shared.progress.load(Ordering::Relaxed);
        if p != last.0 {
            last = (p, Instant::now());
        } else if last.1.elapsed() > Duration::from_secs(20) {
            violation(
                &shared,
                "no progress for 20 s: a worker is stuck (destroy or removal waiting)".into(),
            );
            break;
        }
    }
    stop.store(true, Ordering::SeqCst);
    let deadline = Instant::now() + Duration::from_secs(30);
    for w in workers {
        while !w.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        if w.is_finished() {
            joined(&shared, "a worker", w);
        } else {
            violation(&shared, "a worker did not stop within 30 s (hang)".into());
        }
    }
    if let Some(r) = remover {
        joined(&shared, "the device remover", r);
    }
    for c in consumers {
        joined(&shared, "a channel consumer", c);
    }
    let channel_events_at_end = drain_channel(&ch, &shared);
    let _ = server.destroy();
    let kids: HashMap<u64, CmId> = children
        .lock()
        .map(|mut k| std::mem::take(&mut *k))
        .unwrap_or_default();
    for k in kids.into_values() {
        let _ = k.destroy();
    }
    // Everything is destroyed; endpoints in timewait leave within the path's ACK timeout.
    let settle = Instant::now() + Duration::from_secs(15);
    while (fabric.engine_ceps() > 0 || fabric.live_ids() > 0) && Instant::now() < settle {
        std::thread::sleep(Duration::from_millis(100));
    }
    let (left_ids, mut left_ceps, left_ports) = (
        fabric.live_ids(),
        fabric.engine_ceps(),
        fabric.bound_ports(),
    );
    // Through a daemon, what matters is what the daemon still holds for this session.
    if let Some(c) = &client {
        while c.stats().is_ok_and(|s| s.ids > 0) && Instant::now() < settle {
            std::thread::sleep(Duration::from_millis(100));
        }
        left_ceps += c.stats().map_or(0, |s| s.ids as usize);
    }
    fabric.shutdown();
    let c = &*counts;
    let mut r = StressReport {
        transport,
        seed: o.seed,
        threads: o.threads,
        duration_s: o.duration.as_secs(),
        created: c.0.load(Ordering::Relaxed),
        destroys: c.1.load(Ordering::Relaxed),
        deferred: c.2.load(Ordering::Relaxed) + shared.deferred.load(Ordering::Relaxed),
        begin_destroys: c.3.load(Ordering::Relaxed),
        removals: c.4.load(Ordering::Relaxed),
        removal_failures: shared.removal_failures.load(Ordering::SeqCst),
        established: shared.established.load(Ordering::Relaxed),
        rejected: shared.rejected.load(Ordering::Relaxed),
        disconnected: shared.disconnected.load(Ordering::Relaxed),
        callbacks: shared.callbacks.load(Ordering::Relaxed),
        channel_ids: shared.channel_made.load(Ordering::Relaxed),
        channel_events: shared.channel_events.load(Ordering::Relaxed),
        channel_events_at_end,
        refused_while_held: shared.refused_while_held.load(Ordering::Relaxed),
        contexts: (
            shared.ctx_made.load(Ordering::SeqCst),
            shared.ctx_dropped.load(Ordering::SeqCst),
        ),
        panics: shared.panics.load(Ordering::SeqCst),
        violations: shared
            .violations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone(),
        invariants: Vec::new(),
        not_checked: Vec::new(),
    };
    (r.invariants, r.not_checked) = invariants(r.removals > 0);
    if r.contexts.0 != r.contexts.1 {
        r.violations.push(format!(
            "{} contexts created, {} dropped",
            r.contexts.0, r.contexts.1
        ));
    }
    if left_ids != 0 || left_ceps != 0 || left_ports != 0 {
        r.violations.push(format!(
            "left at the end: {left_ids} ids, {left_ceps} engine endpoints or daemon-held ids, {left_ports} port bindings"
        ));
    }
    Ok(r)
}

/// The invariants a run checked, and those it did not exercise: device removal only counts
/// as checked when one completed (none does through a daemon, or after a failed re-add).
fn invariants(removal_exercised: bool) -> (Vec<&'static str>, Vec<&'static str>) {
    let mut checked = vec![
        "no callback runs after destroy() returned Done",
        "callbacks of one id never overlap",
        "a destroy inside the id's own callback answers Deferred (never waits)",
        "every context is dropped exactly once",
        "no channel event is handed out for an id after its destroy returned Done",
        "a blocking destroy of an id whose event a consumer holds is refused, never waits",
        REMOVAL_INVARIANT,
        "no worker hangs (watchdog: progress every 20 s; stop within 30 s)",
        "no id, port binding or engine endpoint is left at the end",
        "no thread of the run and no client callback panics",
    ];
    let mut not_checked = Vec::new();
    if !removal_exercised {
        checked.retain(|i| *i != REMOVAL_INVARIANT);
        not_checked.push(REMOVAL_INVARIANT);
    }
    (checked, not_checked)
}

/// One round of the device remover: removes `removable`, waits for its ids to go, and adds
/// it back with `readd`; `removed` counts the removals. False when the removal or the
/// re-add failed (a violation): the device may be gone for good, so later rounds could only
/// fail too, and removal would no longer be exercised.
fn removal_round(
    fabric: &Fabric,
    removable: IpAddr,
    shared: &Shared,
    removed: &AtomicU64,
    readd: impl FnOnce() -> rcm::Result<()>,
) -> bool {
    let failed = |what: String| {
        shared.removal_failures.fetch_add(1, Ordering::SeqCst);
        violation(shared, what);
        false
    };
    let r = match fabric.remove_device(removable) {
        Ok(r) => r,
        Err(e) => return failed(format!("removing device {removable} failed: {e}")),
    };
    if let Err(held) = r.wait(Duration::from_secs(10)) {
        violation(
            shared,
            format!("device removal held for 10 s by ids {held:?}"),
        );
        r.wait_reporting();
    }
    removed.fetch_add(1, Ordering::Relaxed);
    std::thread::sleep(Duration::from_millis(50));
    match readd() {
        Ok(()) => true,
        Err(e) => failed(format!(
            "re-adding device {removable} after its removal failed: {e}"
        )),
    }
}

fn new_client(fabric: &Fabric, shared: &Arc<Shared>, rng: &mut StdRng) -> (CmId, Arc<Watch>) {
    let watch = Arc::new(Watch::default());
    let ctx = Arc::new(Ctx {
        shared: shared.clone(),
        watch: watch.clone(),
        dropped: AtomicBool::new(false),
    });
    shared.ctx_made.fetch_add(1, Ordering::SeqCst);
    let destroy_at = rng.gen_range(0..8u8);
    let pipelined = rng.gen_bool(0.5);
    let id = fabric.create_id(PortSpace::Tcp, move |id, ev| {
        let _pipeline = pipelined.then(rcm::Pipeline::begin);
        let c = &ctx;
        c.shared.callbacks.fetch_add(1, Ordering::Relaxed);
        let _in_cb = InCallback::enter(&c.shared, &c.watch, id, ev.name());
        let step = match &ev {
            Event::AddrResolved => 1,
            Event::RouteResolved => 2,
            Event::ConnectResponse { .. } => 3,
            Event::Established { .. } => 4,
            _ => 5,
        };
        let flow = if step == destroy_at {
            // Destroy from inside the own callback, or by return value.
            if destroy_at % 2 == 0 {
                match id.destroy() {
                    Ok(DestroyOutcome::Deferred) => {
                        c.shared.deferred.fetch_add(1, Ordering::Relaxed);
                    }
                    other => violation(
                        &c.shared,
                        format!("destroy inside its own callback answered {other:?}"),
                    ),
                }
                Flow::Continue
            } else {
                Flow::Destroy
            }
        } else {
            match ev {
                Event::AddrResolved => {
                    let _ = id.resolve_route();
                    Flow::Continue
                }
                Event::RouteResolved => {
                    let _ = id.connect(&ConnectOptions::default());
                    Flow::Continue
                }
                Event::ConnectResponse { .. } => {
                    let _ = id.establish();
                    Flow::Continue
                }
                Event::Established { .. } => {
                    c.shared.established.fetch_add(1, Ordering::Relaxed);
                    if destroy_at > 5 {
                        let _ = id.disconnect();
                    }
                    Flow::Continue
                }
                Event::Disconnected => {
                    c.shared.disconnected.fetch_add(1, Ordering::Relaxed);
                    Flow::Continue
                }
                _ => Flow::Continue,
            }
        };
        flow
    });
    (id, watch)
}

/// A channel-mode client: its events go to `ch`, for the consumers.
fn new_channel_client(
    fabric: &Fabric,
    shared: &Arc<Shared>,
    ch: &EventChannel,
) -> (CmId, Arc<Watch>) {
    let id = fabric.create_id_on(PortSpace::Tcp, ch);
    shared.channel_made.fetch_add(1, Ordering::Relaxed);
    if let Ok(mut m) = shared.channel_ids.lock() {
        // Filed before its first call: no event can come for it before that.
        m.insert(id.key());
    }
    (id, Arc::new(Watch::default()))
}

/// `id`'s destroy returned `Done` (or its non-blocking destroy completed): no callback may
/// run from now on, nor channel event be handed out. Called at once on that return.
fn destroyed(shared: &Shared, id: &CmId, watch: &Watch) {
    // Set before `in_cb` is read, as a callback marks `in_cb` before reading this (see
    // `InCallback::enter`).
    watch.destroyed.store(true, Ordering::SeqCst);
    if watch.in_cb.load(Ordering::SeqCst) {
        violation(
            shared,
            format!("a callback on {id:?} was still running when its destroy returned Done"),
        );
    }
    if let Ok(mut m) = shared.channel_ids.lock() {
        m.remove(&id.key());
    }
}

/// A non-blocking destroy, waited for (10 s at most: it ends once the callback in flight
/// returns or the event a consumer holds is dropped).
fn destroy_without_blocking(shared: &Shared, id: &CmId, watch: &Watch) {
    if id.begin_destroy().wait_for(Duration::from_secs(10)) {
        destroyed(shared, id, watch);
    } else {
        violation(shared, format!("begin_destroy of {id:?} not done in 10 s"));
    }
}

/// A destroy at the end of a worker's life or to trim its population: blocking, or without
/// blocking when a consumer holds one of the id's events.
fn destroy_any(shared: &Shared, id: &CmId, watch: &Watch) {
    match id.destroy() {
        Ok(DestroyOutcome::Done) => destroyed(shared, id, watch),
        Err(Error::EventsOutstanding(_)) => {
            shared.refused_while_held.fetch_add(1, Ordering::Relaxed);
            destroy_without_blocking(shared, id, watch);
        }
        _ => {}
    }
}

/// Takes the channel's events and drives their ids' connections as the callbacks do.
fn consume(ch: &EventChannel, shared: &Shared, stop: &AtomicBool) {
    while !stop.load(Ordering::SeqCst) {
        let Some(mut e) = ch.get_event(Some(Duration::from_millis(20))) else {
            continue;
        };
        shared.progress.fetch_add(1, Ordering::Relaxed);
        shared.channel_events.fetch_add(1, Ordering::Relaxed);
        let key = e.id().key();
        if late_channel_event(shared, key, e.event().name()) {
            continue;
        }
        let Some(ev) = e.take() else { continue };
        let id = e.id().clone();
        match ev {
            Event::AddrResolved => {
                let _ = id.resolve_route();
            }
            Event::RouteResolved => {
                let _ = id.connect(&ConnectOptions::default());
            }
            Event::ConnectResponse { .. } => {
                let _ = id.establish();
            }
            Event::Established { .. } => {
                shared.established.fetch_add(1, Ordering::Relaxed);
                if key % 2 == 0 {
                    let _ = id.disconnect();
                }
            }
            Event::Disconnected => {
                shared.disconnected.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
    }
}

/// Whether a channel event handed out for id `key` came after that id's destroy returned
/// `Done`, counted as a violation if so. Called while the event is held, when that destroy
/// cannot return `Done`: an id still filed in `channel_ids` is live, or its destroy was
/// refused, deferred or is pending, none of which the invariant forbids events for.
fn late_channel_event(shared: &Shared, key: u64, ev: &str) -> bool {
    // A poisoned lock means a worker or consumer panicked holding it, which `joined` reports.
    let known = match shared.channel_ids.lock() {
        Ok(m) => m.contains(&key),
        Err(_) => true,
    };
    if !known {
        violation(
            shared,
            format!("channel event {ev} for id {key} after its destroy returned Done"),
        );
    }
    !known
}

/// Takes what the channel still hands out once the consumers stopped, checking each event as
/// they do (every worker's destroy has returned by then); how many it took.
fn drain_channel(ch: &EventChannel, shared: &Shared) -> u64 {
    let mut n = 0;
    while let Some(e) = ch.get_event(Some(Duration::ZERO)) {
        n += 1;
        late_channel_event(shared, e.id().key(), e.event().name());
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_devices() -> Fabric {
        Fabric::new(FabricConfig::default())
    }

    fn violations(s: &Shared) -> Vec<String> {
        s.violations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// One event for `id`, queued on its channel: with no device, resolving pushes an
    /// `AddrError` at once.
    fn queue_event(id: &CmId) {
        id.resolve_addr(None, SocketAddr::from(([127, 0, 0, 1], 7471)))
            .expect("resolve_addr queues AddrError");
    }

    /// The end-of-run drain checks what it takes: an event for an id marked destroyed with
    /// `Done` is the violation; one for a live id or for one whose destroy was refused is
    /// not (before, the drain dropped all of them unseen).
    #[test]
    fn drained_channel_events_are_checked() {
        let (f, ch, shared) = (no_devices(), EventChannel::new(), Arc::new(Shared::new()));
        let (refused, _) = new_channel_client(&f, &shared, &ch);
        let (live, _) = new_channel_client(&f, &shared, &ch);
        let (late, late_watch) = new_channel_client(&f, &shared, &ch);
        queue_event(&refused);
        queue_event(&refused);
        let held = ch
            .get_event(Some(Duration::from_secs(5)))
            .expect("an event");
        assert_eq!(held.id().key(), refused.key());
        assert!(matches!(
            refused.destroy(),
            Err(Error::EventsOutstanding(_))
        ));
        queue_event(&live);
        assert_eq!(drain_channel(&ch, &shared), 2);
        assert!(violations(&shared).is_empty(), "{:?}", violations(&shared));

        queue_event(&late);
        // As if `late`'s destroy had returned Done and rcm still handed out its event.
        destroyed(&shared, &late, &late_watch);
        assert_eq!(drain_channel(&ch, &shared), 1);
        let v = violations(&shared);
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(
            v[0].contains(&format!(
                "for id {} after its destroy returned Done",
                late.key()
            )),
            "{v:?}"
        );
        drop(held);
        for id in [live, late, refused] {
            assert!(matches!(id.destroy(), Ok(DestroyOutcome::Done)));
        }
        f.shutdown();
    }

    /// A real destroy with `Done` takes the id's queued events with it: nothing for the
    /// drain to flag.
    #[test]
    fn drain_after_a_real_destroy_finds_nothing() {
        let (f, ch, shared) = (no_devices(), EventChannel::new(), Shared::new());
        let shared = Arc::new(shared);
        let (id, watch) = new_channel_client(&f, &shared, &ch);
        queue_event(&id);
        destroy_any(&shared, &id, &watch);
        assert!(watch.destroyed.load(Ordering::SeqCst));
        assert_eq!(drain_channel(&ch, &shared), 0);
        assert!(violations(&shared).is_empty(), "{:?}", violations(&shared));
        f.shutdown();
    }

    /// A callback still running when destroy returned `Done`, and one starting after it,
    /// are violations; the flag set after the return used to miss the first, and the second
    /// when it began before the flag was set.
    #[test]
    fn callbacks_around_done_are_checked() {
        let shared = Shared::new();
        let f = no_devices();
        let (id, _) = new_channel_client(&f, &Arc::new(Shared::new()), &EventChannel::new());

        let running = Watch::default();
        let cb = InCallback::enter(&shared, &running, &id, "AddrError");
        destroyed(&shared, &id, &running);
        drop(cb);
        let v = violations(&shared);
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(
            v[0].contains("still running when its destroy returned Done"),
            "{v:?}"
        );

        let after = Watch::default();
        destroyed(&shared, &id, &after);
        drop(InCallback::enter(&shared, &after, &id, "AddrError"));
        let v = violations(&shared);
        assert_eq!(v.len(), 2, "{v:?}");
        assert!(v[1].contains("callback AddrError on CmId("), "{v:?}");
        assert!(v[1].contains("after destroy returned Done"), "{v:?}");

        // A callback that returned before the destroy did is none.
        let before = Watch::default();
        drop(InCallback::enter(&shared, &before, &id, "AddrError"));
        destroyed(&shared, &id, &before);
        assert_eq!(violations(&shared).len(), 2);
        assert!(id.destroy().is_ok());
        f.shutdown();
    }

    /// With rcm's own semantics, a destroy from inside the id's callback (Deferred) and a
    /// blocking one after the callback returned (Done) raise nothing.
    #[test]
    fn destroy_in_own_callback_then_done_is_no_violation() {
        let f = no_devices();
        let shared = Arc::new(Shared::new());
        let watch = Arc::new(Watch::default());
        let (tx, rx) = std::sync::mpsc::channel();
        let tx = Mutex::new(tx);
        let (sh, w) = (shared.clone(), watch.clone());
        let id = f.create_id(PortSpace::Tcp, move |id, ev| {
            let _in_cb = InCallback::enter(&sh, &w, id, ev.name());
            let r = id.destroy();
            if let Ok(t) = tx.lock() {
                let _ = t.send(r.map_err(|e| e.to_string()));
            }
            Flow::Continue
        });
        queue_event(&id);
        let inside = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("callback ran");
        assert_eq!(inside, Ok(DestroyOutcome::Deferred));
        destroy_any(&shared, &id, &watch);
        assert!(watch.destroyed.load(Ordering::SeqCst));
        assert!(violations(&shared).is_empty(), "{:?}", violations(&shared));
        f.shutdown();
    }

    /// A thread of the run that panicked, and a client callback that did, fail the run;
    /// they used to be joined with `let _` (and rcm swallows a callback's panic).
    #[test]
    fn panics_are_counted() {
        let shared = Arc::new(Shared::new());
        joined(&shared, "a worker", std::thread::spawn(|| {}));
        assert_eq!(shared.panics.load(Ordering::SeqCst), 0);
        let sh = shared.clone();
        let t = std::thread::spawn(move || {
            let w = Watch::default();
            let _in_cb = InCallback::enter(&sh, &w, &"id", "AddrError");
            // Poisons the violations lock too: what follows must still be recorded.
            let _held = sh.violations.lock();
            panic!("boom");
        });
        while !t.is_finished() {
            std::thread::sleep(Duration::from_millis(5));
        }
        joined(&shared, "a worker", t);
        assert_eq!(shared.panics.load(Ordering::SeqCst), 2);
        let v = violations(&shared);
        assert!(v.iter().any(|m| m == "a worker panicked: boom"), "{v:?}");
        assert!(v.iter().any(|m| m == "a client callback panicked"), "{v:?}");
    }

    /// A removal that fails, and a re-add that fails, are counted and stop the remover;
    /// they used to be ignored (and later removals then silently did nothing).
    #[test]
    fn removal_failures_are_counted() {
        let shared = Shared::new();
        let removed = AtomicU64::new(0);
        let ip = IpAddr::from([127, 0, 0, 3]);
        let f = no_devices();
        assert!(!removal_round(&f, ip, &shared, &removed, || Ok(())));
        assert_eq!(removed.load(Ordering::SeqCst), 0);
        assert_eq!(shared.removal_failures.load(Ordering::SeqCst), 1);
        assert!(violations(&shared)[0].starts_with("removing device 127.0.0.3 failed"));
        f.shutdown();

        let f = Fabric::new(FabricConfig {
            udp_port: 41000,
            ..FabricConfig::default()
        });
        f.add_device(ip).expect("device 127.0.0.3");
        let readd = || crate::add_device(&f, ip, false).map(drop);
        assert!(removal_round(&f, ip, &shared, &removed, readd));
        assert_eq!(removed.load(Ordering::SeqCst), 1);
        assert_eq!(shared.removal_failures.load(Ordering::SeqCst), 1);
        let refuse = || Err(Error::AddrNotAvailable(ip));
        assert!(!removal_round(&f, ip, &shared, &removed, refuse));
        assert_eq!(removed.load(Ordering::SeqCst), 2);
        assert_eq!(shared.removal_failures.load(Ordering::SeqCst), 2);
        let v = violations(&shared);
        assert!(
            v[1].starts_with("re-adding device 127.0.0.3 after its removal failed"),
            "{v:?}"
        );
        f.shutdown();
    }

    /// Device removal is listed as checked only when one completed.
    #[test]
    fn removal_invariant_only_when_exercised() {
        let (checked, not_checked) = invariants(true);
        assert!(checked.contains(&REMOVAL_INVARIANT));
        assert!(not_checked.is_empty());
        let (checked, not_checked) = invariants(false);
        assert!(!checked.contains(&REMOVAL_INVARIANT));
        assert_eq!(not_checked, [REMOVAL_INVARIANT]);
    }
}
