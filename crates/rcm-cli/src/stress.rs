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
use std::sync::{Arc, Mutex};
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
    /// Callbacks run.
    pub callbacks: u64,
    /// Channel-mode clients created (among `created`).
    pub channel_ids: u64,
    /// Events the channel consumers took.
    pub channel_events: u64,
    /// Blocking destroys of channel ids refused while a consumer held one of their events
    /// (`EventsOutstanding`); each was then destroyed without blocking.
    pub refused_while_held: u64,
    /// Contexts created / dropped.
    pub contexts: (u64, u64),
    /// Invariant violations found (empty when all held).
    pub violations: Vec<String>,
    /// The invariants checked.
    pub invariants: Vec<&'static str>,
}

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
}

/// The context every client id carries: it checks no callback runs after destroy returned
/// `Done`, and counts its own drop.
struct Ctx {
    shared: Arc<Shared>,
    destroyed: Arc<AtomicBool>,
    in_cb: AtomicBool,
    dropped: AtomicBool,
}

impl Drop for Ctx {
    fn drop(&mut self) {
        if self.dropped.swap(true, Ordering::SeqCst) {
            self.shared
                .violations
                .lock()
                .map(|mut v| v.push("context dropped twice".into()))
                .ok();
        }
        self.shared.ctx_dropped.fetch_add(1, Ordering::SeqCst);
    }
}

fn violation(s: &Shared, msg: String) {
    if let Ok(mut v) = s.violations.lock() {
        if v.len() < 100 {
            v.push(msg);
        }
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
    let shared = Arc::new(Shared {
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
    });
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
            let mut live: Vec<(CmId, Arc<AtomicBool>)> = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                shared.progress.fetch_add(1, Ordering::Relaxed);
                let _pipeline = rng.gen_bool(0.5).then(rcm::Pipeline::begin);
                match rng.gen_range(0..10) {
                    0..=4 => {
                        let (id, flag) = if rng.gen_bool(0.3) {
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
                        live.push((id, flag));
                    }
                    5..=7 if !live.is_empty() => {
                        let (id, flag) = live.swap_remove(rng.gen_range(0..live.len()));
                        match id.destroy() {
                            Ok(DestroyOutcome::Done) => destroyed(&shared, &id, &flag),
                            Ok(DestroyOutcome::Deferred) => {
                                counts.2.fetch_add(1, Ordering::Relaxed);
                            }
                            // A consumer holds one of its events: a blocking destroy would
                            // wait on it, so it is refused; this one does not block.
                            Err(Error::EventsOutstanding(_)) => {
                                shared.refused_while_held.fetch_add(1, Ordering::Relaxed);
                                destroy_without_blocking(&shared, &id, &flag);
                            }
                            Err(e) => violation(&shared, format!("destroy failed: {e}")),
                        }
                        counts.1.fetch_add(1, Ordering::Relaxed);
                    }
                    8 if !live.is_empty() => {
                        let (id, flag) = live.swap_remove(rng.gen_range(0..live.len()));
                        destroy_without_blocking(&shared, &id, &flag);
                        counts.3.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => std::thread::sleep(Duration::from_micros(rng.gen_range(0..500))),
                }
                if live.len() > 200 {
                    let (id, flag) = live.swap_remove(0);
                    destroy_any(&shared, &id, &flag);
                    counts.1.fetch_add(1, Ordering::Relaxed);
                }
            }
            for (id, flag) in live {
                destroy_any(&shared, &id, &flag);
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
    let iwarp = o.iwarp;
    let remover = {
        let (fabric, stop, counts, shared) =
            (fabric.clone(), stop.clone(), counts.clone(), shared.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) && !through_daemon {
                std::thread::sleep(Duration::from_millis(300));
                if let Ok(r) = fabric.remove_device(removable) {
                    if let Err(held) = r.wait(Duration::from_secs(10)) {
                        violation(
                            &shared,
                            format!("device removal held for 10 s by ids {held:?}"),
                        );
                        r.wait_reporting();
                    }
                    counts.4.fetch_add(1, Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(50));
                    let _ = crate::add_device(&fabric, removable, iwarp);
                }
            }
        })
    };
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
            let _ = w.join();
        } else {
            violation(&shared, "a worker did not stop within 30 s (hang)".into());
        }
    }
    let _ = remover.join();
    for c in consumers {
        let _ = c.join();
    }
    // What the consumers left (events of ids destroyed since) is dropped unseen.
    while ch.get_event(Some(Duration::ZERO)).is_some() {}
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
        established: shared.established.load(Ordering::Relaxed),
        rejected: shared.rejected.load(Ordering::Relaxed),
        disconnected: shared.disconnected.load(Ordering::Relaxed),
        callbacks: shared.callbacks.load(Ordering::Relaxed),
        channel_ids: shared.channel_made.load(Ordering::Relaxed),
        channel_events: shared.channel_events.load(Ordering::Relaxed),
        refused_while_held: shared.refused_while_held.load(Ordering::Relaxed),
        contexts: (
            shared.ctx_made.load(Ordering::SeqCst),
            shared.ctx_dropped.load(Ordering::SeqCst),
        ),
        violations: shared
            .violations
            .lock()
            .map(|v| v.clone())
            .unwrap_or_default(),
        invariants: vec![
            "no callback runs after destroy() returned Done",
            "callbacks of one id never overlap",
            "a destroy inside the id's own callback answers Deferred (never waits)",
            "every context is dropped exactly once",
            "no channel event is handed out for an id after its destroy returned Done",
            "a blocking destroy of an id whose event a consumer holds is refused, never waits",
            "device removal completes within 10 s of its ids' destruction",
            "no worker hangs (watchdog: progress every 20 s; stop within 30 s)",
            "no id, port binding or engine endpoint is left at the end",
        ],
    };
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

fn new_client(fabric: &Fabric, shared: &Arc<Shared>, rng: &mut StdRng) -> (CmId, Arc<AtomicBool>) {
    let destroyed = Arc::new(AtomicBool::new(false));
    let ctx = Arc::new(Ctx {
        shared: shared.clone(),
        destroyed: destroyed.clone(),
        in_cb: AtomicBool::new(false),
        dropped: AtomicBool::new(false),
    });
    shared.ctx_made.fetch_add(1, Ordering::SeqCst);
    let destroy_at = rng.gen_range(0..8u8);
    let pipelined = rng.gen_bool(0.5);
    let id = fabric.create_id(PortSpace::Tcp, move |id, ev| {
        let _pipeline = pipelined.then(rcm::Pipeline::begin);
        let c = &ctx;
        c.shared.callbacks.fetch_add(1, Ordering::Relaxed);
        if c.destroyed.load(Ordering::SeqCst) {
            violation(
                &c.shared,
                format!(
                    "callback {} on {id:?} after destroy returned Done",
                    ev.name()
                ),
            );
        }
        if c.in_cb.swap(true, Ordering::SeqCst) {
            violation(&c.shared, format!("overlapping callbacks on {id:?}"));
        }
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
        c.in_cb.store(false, Ordering::SeqCst);
        flow
    });
    (id, destroyed)
}

/// A channel-mode client: its events go to `ch`, for the consumers.
fn new_channel_client(
    fabric: &Fabric,
    shared: &Arc<Shared>,
    ch: &EventChannel,
) -> (CmId, Arc<AtomicBool>) {
    let id = fabric.create_id_on(PortSpace::Tcp, ch);
    shared.channel_made.fetch_add(1, Ordering::Relaxed);
    if let Ok(mut m) = shared.channel_ids.lock() {
        // Filed before its first call: no event can come for it before that.
        m.insert(id.key());
    }
    (id, Arc::new(AtomicBool::new(false)))
}

/// `id`'s destroy returned `Done`: no callback or channel event may follow.
fn destroyed(shared: &Shared, id: &CmId, flag: &AtomicBool) {
    flag.store(true, Ordering::SeqCst);
    if let Ok(mut m) = shared.channel_ids.lock() {
        m.remove(&id.key());
    }
}

/// A non-blocking destroy, waited for (10 s at most: it ends once the callback in flight
/// returns or the event a consumer holds is dropped).
fn destroy_without_blocking(shared: &Shared, id: &CmId, flag: &AtomicBool) {
    if id.begin_destroy().wait_for(Duration::from_secs(10)) {
        destroyed(shared, id, flag);
    } else {
        violation(shared, format!("begin_destroy of {id:?} not done in 10 s"));
    }
}

/// A destroy at the end of a worker's life or to trim its population: blocking, or without
/// blocking when a consumer holds one of the id's events.
fn destroy_any(shared: &Shared, id: &CmId, flag: &AtomicBool) {
    match id.destroy() {
        Ok(DestroyOutcome::Done) => destroyed(shared, id, flag),
        Err(Error::EventsOutstanding(_)) => {
            shared.refused_while_held.fetch_add(1, Ordering::Relaxed);
            destroy_without_blocking(shared, id, flag);
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
        // Checked while the event is held: its id's destroy cannot return Done meanwhile.
        // (A poisoned lock means a thread panicked, which the run reports anyway.)
        let known = match shared.channel_ids.lock() {
            Ok(m) => m.contains(&key),
            Err(_) => true,
        };
        let Some(ev) = e.take() else { continue };
        if !known {
            violation(
                shared,
                format!(
                    "channel event {} for id {key} after its destroy returned Done",
                    ev.name()
                ),
            );
            continue;
        }
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
