//! `rcm bench`: cmtime for rcm. The same steps and columns as rdma-core's cmtime (v52+), so
//! results compare directly, plus connect-latency percentiles, a TCP baseline and the
//! loopback UDP round trip measured in the same run.

use hdrhistogram::Histogram;
use rcm::{
    AcceptOptions, CmId, ConnectOptions, Event, EventChannel, Fabric, FabricConfig, Flow,
    PortSpace, QpState,
};
use serde::Serialize;
use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchOpts {
    /// Connections.
    pub connections: usize,
    /// One connection at a time instead of all in flight.
    pub serial: bool,
    /// Serve only, on `bind`: until interrupted, or until `serve` connections were served.
    pub listen: bool,
    /// With `listen`: how many connections to serve before returning.
    pub serve: Option<usize>,
    /// A `listen` server's own report as JSON (the client's report is printed by the caller).
    pub json: bool,
    /// Connect to a server elsewhere instead of running both sides here.
    pub server: Option<IpAddr>,
    /// Local addresses (client side with `server`, ids spread over them; server side with
    /// `listen`, one).
    pub bind: Vec<IpAddr>,
    /// rdma_cm port.
    pub port: u16,
    /// UDP port of the RoCEv2 devices (4791 on a real network).
    pub udp_port: u16,
    /// Callback threads.
    pub threads: usize,
    /// Also run the TCP baseline.
    pub baseline_tcp: bool,
    /// Show a progress bar.
    pub progress: bool,
    /// Give up waiting for a step after this long.
    pub step_timeout: Duration,
    /// Use the `rcm daemon` at this socket instead of devices in this process.
    pub daemon: Option<std::path::PathBuf>,
    /// iWARP devices (MPA over TCP on the rdma_cm port) instead of RoCEv2 ones.
    pub iwarp: bool,
    /// How long idle threads poll before sleeping (`FabricConfig::spin`).
    pub spin: std::time::Duration,
    /// Send datagrams together where calls come in a row (`rcm::SendBatch`), and run the
    /// server's callbacks on its device threads (`rcm::CallbackMode::Inline`).
    pub send_batch: bool,
    /// Put the fabric's threads on one CPU and this thread (the client's calls and event
    /// loop) on another (`--pin`; the embedded default only).
    pub pin: bool,
    /// The client's ids get a soft QP each (`CmId::create_qp`, as `rdma_create_qp`): rcm
    /// moves it and sends the RTU itself, so a connect ends with ESTABLISHED (`--qp
    /// attached`). Otherwise QPs are mimicked as cmtime does (`--qp mimic`).
    pub attached_qp: bool,
    /// Connections made one at a time before the measured run and not counted (cmtime's
    /// warm-up), at most `connections`.
    pub warmup: usize,
    /// Threads that make a burst step's calls, each for every `issuers`-th connection (1:
    /// one thread, as cmtime; an application with several threads calling at once, which
    /// through a daemon overlap their round trips).
    pub issuers: usize,
    /// One at a time in this process: stamp each connect's hops and report where its time
    /// goes ([`crate::breakdown`]).
    pub breakdown: bool,
}

/// One row of the table.
#[derive(Debug, Clone, Serialize)]
pub struct Step {
    /// cmtime's step name.
    pub step: &'static str,
    /// total / connections.
    pub avg_per_conn_us: f64,
    /// Wall time of the step over all connections.
    pub total_us: f64,
    /// sum / connections.
    pub us_per_conn: f64,
    /// Sum of per-connection durations.
    pub sum_us: f64,
    /// Slowest connection.
    pub max_us: f64,
    /// Fastest connection.
    pub min_us: f64,
}

/// The result of a run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Connections attempted.
    pub connections: usize,
    /// Connections established.
    pub established: usize,
    /// Connections that failed (a failed call, reject, unreachable, error, timeout) in any
    /// step, their bind and disconnect included.
    pub errors: usize,
    /// Whether connections were made one at a time.
    pub serial: bool,
    /// How the client's QPs were made: "mimic" (cmtime's: an invented QPN; the connect ends
    /// with CONNECT_RESPONSE and the tool moves the QP and calls establish) or "attached"
    /// (a soft QP on each id: rcm moves it and sends the RTU, the connect ends with
    /// ESTABLISHED; the init/rtr/rts and establish rows are then not measured).
    pub qp: &'static str,
    /// Connections made, established, disconnected and destroyed one at a time before the
    /// measured run, not counted in any figure (cmtime's warm-up).
    pub warmup: usize,
    /// Threads that made a burst step's calls (1 one at a time).
    pub issuers: usize,
    /// Connections per second: connections / wall time from first resolve to last established.
    pub conn_per_s: f64,
    /// Full cycles (connect + private-data exchange + disconnect) per second.
    pub cycle_per_s: f64,
    /// Connect latency (connect call → established), microseconds; null when no connection
    /// was established (0 would read as measured).
    pub connect_p50_us: Option<f64>,
    /// 99th percentile; null as `connect_p50_us`.
    pub connect_p99_us: Option<f64>,
    /// Loopback UDP round trip measured in the same run (median, microseconds), both ends
    /// sleeping in `recv` as ordinary programs do.
    pub udp_rtt_p50_us: f64,
    /// The same round trip with both ends polling for up to the run's spin time before they
    /// sleep, as rcm's threads do, each on a CPU of its own where there are two (the floor
    /// for rcm's own waiting; 0 when not measured).
    pub udp_rtt_poll_p50_us: f64,
    /// The CPUs the polling round trip's two ends were pinned to; absent when this process
    /// may run on one CPU only (both ends then took turns on it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub udp_rtt_poll_cpus: Option<[usize; 2]>,
    /// How many windows spread over a one-at-a-time run the polling round trip was measured
    /// in ([`RttWindows`]); 0 when it was measured once, after the run.
    pub udp_rtt_poll_windows: usize,
    /// The per-step table.
    pub steps: Vec<Step>,
    /// TCP baseline: connect + QP-info-sized exchange + close, per second.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub baseline_conn_per_s: Option<f64>,
    /// What went wrong, if anything.
    pub failures: Vec<String>,
    /// Resident memory added per established connection in this process, bytes; measured
    /// with every connection established at once. Which ends this process holds is in
    /// `rss_scope`.
    pub rss_per_conn_bytes: f64,
    /// The same once the allocator has given back the free pages the connect burst left
    /// inside its heap (glibc `malloc_trim`; 0 where not measured): what a long-lived
    /// process that trims holds.
    pub rss_after_trim_per_conn_bytes: f64,
    /// What the memory figures cover: "both ends" (server and client in this process),
    /// "client ends" (`--server`), or "client handles" (`--daemon`: the ids live there).
    pub rss_scope: String,
    /// What the client's ids ran on: "roce" or "iwarp" (devices of this process), or
    /// "daemon" (`--daemon`: the daemon's devices).
    pub transport: &'static str,
    /// Datagrams (RoCEv2), streams' readiness events (iWARP) or daemon frames (`--daemon`)
    /// the client's waiting thread received itself while it polled for its events (busy
    /// polling; see `rcm::EventChannel::set_spin`), not its device's or session's reader
    /// thread.
    pub busy_polled: u64,
    /// How many times this process's polling threads were held off polling during the run
    /// (`rcm::process_hold_offs`): another process on their CPUs that did not yield back
    /// for over a millisecond, three times within 50 ms (a CPU-bound process; through
    /// `--daemon`, the daemon's threads in a burst too), made them sleep instead, and the
    /// latencies include those sleeps. 0 on a quiet host in-process.
    pub hold_offs: u64,
    /// With `--pin`: the CPU of the calling thread and the CPU of the fabric's threads.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pinned_cpus: Option<[usize; 2]>,
    /// With `--breakdown`: where a connect's time went, segment by segment.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub breakdown: Option<crate::breakdown::Breakdown>,
    /// Connect latencies (for plots), microseconds.
    #[serde(skip)]
    pub latencies_us: Vec<f64>,
}

/// Per-connection durations of one step. Atomics, so that one thread starts connections
/// while another, handling their events, ends them (see `issue_and_wait`).
struct Timing {
    base: Instant,
    /// Nanoseconds from `base` to the start, plus one; 0: not started.
    start: Vec<AtomicU64>,
    /// The duration in nanoseconds, plus one; 0: not ended.
    dur: Vec<AtomicU64>,
}

impl Timing {
    fn new(n: usize) -> Self {
        Timing {
            base: Instant::now(),
            start: (0..n).map(|_| AtomicU64::new(0)).collect(),
            dur: (0..n).map(|_| AtomicU64::new(0)).collect(),
        }
    }
    fn now(&self) -> u64 {
        self.since_base(Instant::now())
    }
    /// `at` as this timing counts it (see `start`).
    fn since_base(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.base).as_nanos()).unwrap_or(u64::MAX - 1)
            + 1
    }
    fn begin(&self, i: usize) {
        if let Some(s) = self.start.get(i) {
            s.store(self.now(), Ordering::Release);
        }
    }
    /// Starts connection `i` at `at`: one reading of the clock for several steps that start
    /// or end at the same instant, which keeps the readings out of what they time.
    fn begin_at(&self, i: usize, at: Instant) {
        if let Some(s) = self.start.get(i) {
            s.store(self.since_base(at), Ordering::Release);
        }
    }
    /// Ends connection `i` (the first end counts).
    fn end(&self, i: usize) {
        self.end_ns(i, self.now());
    }
    /// Ends connection `i` at `at` (see `begin_at`).
    fn end_at(&self, i: usize, at: Instant) {
        self.end_ns(i, self.since_base(at));
    }
    fn end_ns(&self, i: usize, now: u64) {
        let (Some(s), Some(d)) = (self.start.get(i), self.dur.get(i)) else {
            return;
        };
        let s = s.load(Ordering::Acquire);
        if s != 0 {
            let took = now.saturating_sub(s) + 1;
            let _ = d.compare_exchange(0, took, Ordering::Relaxed, Ordering::Relaxed);
        }
    }
    fn durations(&self) -> impl Iterator<Item = Duration> + '_ {
        self.dur
            .iter()
            .map(|d| d.load(Ordering::Relaxed))
            .filter(|&d| d != 0)
            .map(|d| Duration::from_nanos(d - 1))
    }
    fn done(&self) -> usize {
        self.durations().count()
    }
}

/// Which of `devices` client devices connection `c` of `n` binds to. A burst deals them out
/// in turn. One at a time they go in blocks, so that consecutive connects use one device:
/// dealt out in turn, each connect moved the waiting thread's busy poll to another device,
/// whose own thread then came back to poll its socket beside the server's on the fabric's
/// CPU (`--serial --pin --qp attached -c 40000`, two client devices: p50 8.1 µs in two runs,
/// against 7.4-7.6 with the same connections on one).
fn client_device_of(c: usize, n: usize, devices: usize, serial: bool) -> usize {
    let devices = devices.max(1);
    if serial {
        (c.saturating_mul(devices) / n.max(1)).min(devices - 1)
    } else {
        c % devices
    }
}

/// How a step's calls are made: one at a time or in a burst, with datagrams sent together
/// or not, and by how many threads.
#[derive(Clone, Copy)]
struct Issue {
    serial: bool,
    send_batch: bool,
    issuers: usize,
}

impl Issue {
    /// The run's: one issuing thread one at a time, at least one in a burst.
    fn of(o: &BenchOpts) -> Issue {
        Issue {
            serial: o.serial,
            send_batch: o.send_batch,
            issuers: if o.serial { 1 } else { o.issuers.max(1) },
        }
    }
}

/// Starts the connections of `chunk` with `issue` and handles their events with `wait`.
/// In a burst the calls are made from helper threads while this one already handles the
/// events (as cmtime's event thread does): the first connections' events are not left
/// queued until the last call is made, and the calls' own work (sending, on loopback also
/// the peer's receive processing) is not serialised with the event handling. With several
/// issuers, thread `t` of `n` calls for connections `t`, `t + n`, ... One at a time
/// (`serial`), both run here in turn. Returns the calls' errors.
fn issue_and_wait(
    how: Issue,
    chunk: &[CmId],
    issue: impl Fn(usize, &CmId) -> Option<String> + Sync,
    wait: impl FnOnce(),
) -> Vec<String> {
    let n = if how.serial { 1 } else { how.issuers.max(1) };
    let issue = &issue;
    let run = move |t: usize| -> Vec<String> {
        // The calls' datagrams go out together, 64 at a time and when the loop ends; through
        // a daemon the calls go without waiting for its answers, which the loop's end awaits
        // (a call that fails there comes as the id's error event, which `wait` counts).
        let _batch = (how.send_batch && !how.serial).then(rcm::SendBatch::begin);
        let _pipeline = (how.send_batch && !how.serial).then(rcm::Pipeline::begin);
        chunk
            .iter()
            .enumerate()
            .skip(t)
            .step_by(n)
            .filter_map(|(k, id)| issue(k, id))
            .collect()
    };
    if how.serial {
        // One at a time nothing can join the call's datagram: it leaves within the call,
        // not when the wait begins. What the wait's event handling sends (an RTU) is held
        // by this batch until the event has been taken, as the run's batch in `run_client`
        // holds it in a burst.
        let errs = run(0);
        let _batch = how.send_batch.then(rcm::SendBatch::begin);
        wait();
        return errs;
    }
    std::thread::scope(|sc| {
        let issuers: Vec<_> = (0..n).map(|t| sc.spawn(move || run(t))).collect();
        wait();
        issuers
            .into_iter()
            .flat_map(|h| {
                h.join()
                    .unwrap_or_else(|_| vec!["an issuing thread panicked".into()])
            })
            .collect()
    })
}

fn step(name: &'static str, total: Duration, t: &Timing, n: usize) -> Step {
    let ds: Vec<f64> = t.durations().map(|d| d.as_secs_f64() * 1e6).collect();
    // + 0.0: an empty float sum is -0.0, which would print as "-0".
    let sum: f64 = ds.iter().sum::<f64>() + 0.0;
    let n = n.max(1) as f64;
    Step {
        step: name,
        avg_per_conn_us: total.as_secs_f64() * 1e6 / n,
        total_us: total.as_secs_f64() * 1e6,
        us_per_conn: sum / n,
        sum_us: sum,
        max_us: ds.iter().copied().fold(0.0, f64::max),
        min_us: ds
            .iter()
            .copied()
            .fold(f64::INFINITY, f64::min)
            .min(if ds.is_empty() { 0.0 } else { f64::INFINITY }),
    }
}

/// Times a synchronous per-connection step. `pipeline`: in an `rcm::Pipeline` (through a
/// daemon, calls that can go without their answers do), whose end the step's time includes.
/// A connection whose call fails is marked in `failed`, so that `errors` counts every
/// connection the failures name, and the asynchronous steps leave it out.
fn sync_step(
    name: &'static str,
    ids: &[CmId],
    pipeline: bool,
    f: impl Fn(&CmId) -> rcm::Result<()>,
    (failures, failed): (&mut Vec<String>, &mut [bool]),
) -> Step {
    let t = Timing::new(ids.len());
    let start = Instant::now();
    let pipeline = pipeline.then(rcm::Pipeline::begin);
    for (i, id) in ids.iter().enumerate() {
        t.begin(i);
        if let Err(e) = f(id) {
            failures.push(format!("{name} #{i}: {e}"));
            if let Some(f) = failed.get_mut(i) {
                *f = true;
            }
        }
        t.end(i);
    }
    drop(pipeline);
    step(name, start.elapsed(), &t, ids.len())
}

/// What a server counted.
#[derive(Debug, Default)]
pub struct Served {
    /// Connect requests accepted.
    pub accepted: AtomicUsize,
    /// Connections that reached ESTABLISHED here. Fewer than accepted when an RTU was lost
    /// and the client disconnected before a REP retry brought another: the connection then
    /// goes down from REP_SENT without ESTABLISHED, as in Linux.
    pub established: AtomicUsize,
}

/// A server on `fabric`: accepts every request, destroys each connection when it goes down.
pub fn serve(
    fabric: &Fabric,
    bind: SocketAddr,
    backlog: usize,
    served: Arc<Served>,
) -> rcm::Result<CmId> {
    let l = fabric.create_id(PortSpace::Tcp, move |id, ev| match ev {
        Event::ConnectRequest { .. } => {
            let opts = AcceptOptions {
                private_data: b"rcm bench accept".to_vec(),
                ..AcceptOptions::default()
            };
            // Through a daemon whose session reader runs this (`CallbackMode::Inline`), the
            // accepts of the requests it read together share one wait for their answers,
            // at the end of that batch; a failure then comes as CONNECT_ERROR.
            let _pipeline = rcm::Pipeline::begin();
            if id.accept(&opts).is_err() {
                return Flow::Destroy;
            }
            served.accepted.fetch_add(1, Ordering::Relaxed);
            Flow::Continue
        }
        Event::Established { .. } => {
            served.established.fetch_add(1, Ordering::Relaxed);
            Flow::Continue
        }
        Event::Disconnected
        | Event::Rejected { .. }
        | Event::Unreachable(_)
        | Event::ConnectError(_)
        | Event::DeviceRemoval => Flow::Destroy,
        _ => Flow::Continue,
    });
    l.bind(bind)?;
    l.listen(backlog)?;
    Ok(l)
}

/// cmtime's warm-up: `k` connections made, established, disconnected and destroyed one at a
/// time before the measured run, the way the run makes them (`--qp`), so that its first
/// connections do not pay for what a first use sets up (threads that start polling, tables,
/// pages): without it the first ~50 serial connects took 0.1-4 ms against ~12 µs, and they
/// were the run's p99. The first failure, if any.
fn warm_up(
    fabric: &Fabric,
    ch: &EventChannel,
    srcs: &[IpAddr],
    dst: SocketAddr,
    k: usize,
    o: &BenchOpts,
) -> Result<(), String> {
    let take = |what: &str| -> Result<Event, String> {
        ch.get_event(Some(o.step_timeout))
            .and_then(|mut e| e.take())
            .ok_or_else(|| format!("warm-up: no {what} within {} s", o.step_timeout.as_secs()))
    };
    let next = |want: fn(&Event) -> bool, what: &str| -> Result<(), String> {
        let e = take(what)?;
        if want(&e) {
            Ok(())
        } else {
            Err(format!("warm-up: {} where {what} was due", e.name()))
        }
    };
    for c in 0..k {
        let id = fabric.create_id_on(PortSpace::Tcp, ch);
        let cycle = || -> Result<(), String> {
            let src = srcs.get(c % srcs.len().max(1)).copied();
            if let Some(src) = src {
                id.bind(SocketAddr::new(src, 0))
                    .map_err(|e| format!("warm-up: bind: {e}"))?;
            }
            id.resolve_addr(None, dst)
                .map_err(|e| format!("warm-up: resolve addr: {e}"))?;
            next(|e| matches!(e, Event::AddrResolved), "ADDR_RESOLVED")?;
            id.resolve_route()
                .map_err(|e| format!("warm-up: resolve route: {e}"))?;
            next(|e| matches!(e, Event::RouteResolved), "ROUTE_RESOLVED")?;
            if o.attached_qp {
                id.create_qp()
                    .map_err(|e| format!("warm-up: create qp: {e}"))?;
            }
            let opts = ConnectOptions {
                private_data: b"rcm bench connect".to_vec(),
                ..ConnectOptions::default()
            };
            id.connect(&opts)
                .map_err(|e| format!("warm-up: connect: {e}"))?;
            match take("answer to a connect")? {
                // iWARP, or an attached QP: rcm finished the connection.
                Event::Established { .. } => {}
                Event::ConnectResponse { .. } => {
                    let _ = id.init_qp_attr(QpState::Rtr);
                    let _ = id.init_qp_attr(QpState::Rts);
                    id.establish()
                        .map_err(|e| format!("warm-up: establish: {e}"))?;
                    next(|e| matches!(e, Event::Established { .. }), "ESTABLISHED")?;
                }
                e => return Err(format!("warm-up: {} in answer to a connect", e.name())),
            }
            id.disconnect()
                .map_err(|e| format!("warm-up: disconnect: {e}"))?;
            next(|e| matches!(e, Event::Disconnected), "DISCONNECTED")
        };
        let r = cycle();
        let _ = id.destroy();
        r?;
    }
    Ok(())
}

/// Runs the client side against `dst` on `fabric`, all connections in flight at once (or one
/// at a time with `serial`).
///
/// One at a time, `rtt` (if any) measures its windows between the connections
/// ([`RttWindows::before`]), outside every step's timing.
pub fn run_client(
    fabric: &Fabric,
    srcs: &[IpAddr],
    dst: SocketAddr,
    o: &BenchOpts,
    mut rtt: Option<&mut RttWindows>,
) -> Report {
    let n = o.connections;
    let mut failures = Vec::new();
    let mut steps = Vec::new();
    let pb = progress(o, n);
    let ch = EventChannel::new();
    ch.set_spin(o.spin);
    let warmup = o.warmup.min(n);
    if let Err(e) = warm_up(fabric, &ch, srcs, dst, warmup, o) {
        failures.push(e);
    }
    // The run's own, not the warm-up's.
    let polled_before = fabric.busy_polled();
    // After the warm-up: only the run's connects are traced.
    let tracer = srcs
        .first()
        .filter(|_| o.breakdown && o.serial)
        .and_then(|&src| crate::breakdown::Tracer::new(fabric, src, dst.ip()));
    let held_before = rcm::process_hold_offs();
    // The tool's own per-connection bookkeeping is made before the memory baseline, so the
    // RSS per connection is rcm's (ids, engine state, tables), not the timing arrays'.
    let t = Timing::new(n);
    let mut ids = Vec::with_capacity(n);
    // Keyed by the ids' own keys (made by rcm, not by a peer): a fast hash, looked up for
    // every event.
    let mut index: foldhash::HashMap<u64, usize> =
        foldhash::HashMap::with_capacity_and_hasher(n, foldhash::fast::RandomState::default());
    let resolve_addr = Timing::new(n);
    let resolve_route = Timing::new(n);
    let connect = Timing::new(n);
    let establish = Timing::new(n);
    let rtr = Timing::new(n);
    let rts = Timing::new(n);
    let latency = Timing::new(n);
    // Per connection, as cmtime's row: to its connection up; from the start of its
    // resolution, where the row's total starts here (create and bind are timed apart).
    let full_conn = Timing::new(n);
    let disconnect = Timing::new(n);
    let qp_timing = Timing::new(n);
    let init_timing = Timing::new(n);
    // Per-connection flags. Made with every page written (`resident_flags`), as are the
    // id list's and index's buffers below: memory a step writes for the first time later
    // would otherwise count as rcm's.
    let mut failed = resident_flags(n);
    let mut early = resident_flags(n);
    let mut responded = resident_flags(n);
    let mut skip_est = resident_flags(n);
    let call_failed: Vec<std::sync::atomic::AtomicBool> = (0..n)
        .map(|_| std::sync::atomic::AtomicBool::new(true))
        .collect();
    for f in &call_failed {
        f.store(false, Ordering::Relaxed);
    }
    for slot in ids.spare_capacity_mut() {
        *slot = std::mem::MaybeUninit::zeroed();
    }
    index.extend((0..n as u64).map(|k| (u64::MAX - k, 0)));
    index.clear();
    let rss_before = rss_bytes();
    let mut rss_established = 0u64;
    let mut rss_trimmed = 0u64;

    let create_start = Instant::now();
    {
        // Through a daemon a burst's creates go without waiting for its answers (the client
        // names the handles); the step ends when they are all in, as the pipeline ends.
        let _pipeline = (o.send_batch && !o.serial).then(rcm::Pipeline::begin);
        for i in 0..n {
            t.begin(i);
            ids.push(fabric.create_id_on(PortSpace::Tcp, &ch));
            t.end(i);
        }
    }
    steps.push(step("create id", create_start.elapsed(), &t, n));
    index.extend(ids.iter().enumerate().map(|(i, id)| (id.key(), i)));
    // One address has ~28k ephemeral ports: the ids are spread over the client devices.
    // Each bind waits for its answer, as rdma_bind_addr does. Through a daemon a pipelined
    // bind takes 0.9-1.3 µs a connection against 5.6-7.3, but in bursts whose binds were
    // pipelined the later steps ran slower when the threads were not pinned (median 42.7k
    // conn/s against 50.7k, 10 interleaved pairs; pinned the same), for a cause not found
    // (docs/performance.md, twenty-eighth session).
    let next = AtomicUsize::new(0);
    steps.push(sync_step(
        "bind addr",
        &ids,
        false,
        |id| {
            let c = next.fetch_add(1, Ordering::Relaxed);
            let k = client_device_of(c, n, srcs.len(), o.serial);
            id.bind(SocketAddr::new(
                srcs.get(k).copied().unwrap_or(IpAddr::from([127, 0, 0, 2])),
                0,
            ))
        },
        (&mut failures, &mut failed),
    ));

    let batch = if o.serial { 1 } else { n };
    let (mut t_addr, mut t_route, mut t_conn, mut t_est, mut t_disc) = (
        Duration::ZERO,
        Duration::ZERO,
        Duration::ZERO,
        Duration::ZERO,
        Duration::ZERO,
    );
    let mut qp_create = Duration::ZERO;
    let mut init_attr = Duration::ZERO;
    let mut full = Duration::ZERO;
    let mut cycle = Duration::ZERO;
    let call_failures = AtomicUsize::new(0);
    let late = std::sync::Mutex::new(Vec::new());
    let events = Events {
        ch: &ch,
        index: &index,
        timeout: o.step_timeout,
        how: Issue::of(o),
        call_failed: &call_failed,
        call_failures: &call_failures,
        late: &late,
    };
    // Per connection, made once (a per-connection step must not cost the whole run's
    // size, or one-at-a-time timings would grow with -c).

    // What this thread sends (calls made here, the RTUs its event handling sends) goes out
    // together when it is about to wait for an event and none is queued: get_event sends
    // it first (see rcm::SendBatch). The issuing thread of a burst has its own batch. One at
    // a time there is none here: `issue_and_wait` holds only around each wait.
    let sends = (o.send_batch && !o.serial).then(rcm::SendBatch::begin);
    // Likewise its calls to a daemon (`establish` at each CONNECT_RESPONSE) go without
    // waiting for their answers, which are awaited before it waits for an event.
    let pipeline = (o.send_batch && !o.serial).then(rcm::Pipeline::begin);
    for chunk_start in (0..n).step_by(batch) {
        let range = chunk_start..(chunk_start + batch).min(n);
        let chunk_ids = &ids[range.clone()];
        if o.serial && RttWindows::before(chunk_start, n) {
            if let Some(w) = rtt.as_deref_mut() {
                w.window();
            }
        }
        let full_start = Instant::now();
        for i in range.clone() {
            full_conn.begin(i);
        }
        // The resolve steps: each connection ends with one event.
        let mut one_event_step = |timing: &Timing,
                                  what: &str,
                                  call: &(dyn Fn(&CmId) -> rcm::Result<()> + Sync),
                                  want: fn(&Event) -> bool| {
            run_step(
                what,
                &events,
                chunk_ids,
                &range,
                (&mut failures, &mut failed),
                |k, id| {
                    timing.begin(chunk_start + k);
                    call(id).err().map(|e| format!("{what}: {e}"))
                },
                |i, ev, _| {
                    let hit = want(ev);
                    if hit {
                        timing.end(i);
                    }
                    hit
                },
            );
        };
        let s = Instant::now();
        one_event_step(
            &resolve_addr,
            "resolve addr",
            &|id| id.resolve_addr(None, dst),
            |e| matches!(e, Event::AddrResolved),
        );
        t_addr += s.elapsed();
        let s = Instant::now();
        one_event_step(
            &resolve_route,
            "resolve route",
            &|id| id.resolve_route(),
            |e| matches!(e, Event::RouteResolved),
        );
        t_route += s.elapsed();
        // create qp: as cmtime -m, QPs are mimicked: a QPN is invented, no QP is attached, so
        // the active side gets CONNECT_RESPONSE and finishes with RTR/RTS + establish.
        // With --qp attached each id gets a soft QP here, which rcm moves to INIT itself.
        let s = Instant::now();
        for (k, id) in chunk_ids.iter().enumerate() {
            let i = chunk_start + k;
            qp_timing.begin(i);
            if o.attached_qp && !failed[i] {
                if let Err(e) = id.create_qp() {
                    failures.push(format!("create qp #{i}: {e}"));
                    failed[i] = true;
                }
            }
            qp_timing.end(i);
        }
        qp_create += s.elapsed();
        let s = Instant::now();
        if !o.attached_qp {
            for (k, id) in chunk_ids.iter().enumerate() {
                init_timing.begin(chunk_start + k);
                let _ = id.init_qp_attr(QpState::Init);
                init_timing.end(chunk_start + k);
            }
        }
        init_attr += s.elapsed();
        // cm connect: REQ out, REP back (CONNECT_RESPONSE).
        let s = Instant::now();
        // One at a time with mimicked QPs, the RTU that `establish` makes at the
        // CONNECT_RESPONSE is held until the establish step has taken its ESTABLISHED, as a
        // soft QP's RTU is held until its wait has (`issue_and_wait`): not part of the
        // latency, which ends at the event. Its `sendto` came between the two before (test:
        // `one_at_a_time_the_rtu_of_establish_waits_for_its_established_event`).
        let rtu_held = (o.serial && o.send_batch && !o.attached_qp).then(rcm::SendBatch::begin);
        // The connection answered: connect ends, the QP goes to RTR and RTS (mimicked, as
        // cmtime -m), and establish starts. An attached QP rcm moved itself.
        // One reading of the clock where one step ends and the next starts.
        let qp_steps = |i: usize, id: &CmId, at: Instant| {
            connect.end_at(i, at);
            if o.attached_qp {
                establish.begin_at(i, at);
                return;
            }
            rtr.begin_at(i, at);
            let _ = id.init_qp_attr(QpState::Rtr);
            let at = Instant::now();
            rtr.end_at(i, at);
            rts.begin_at(i, at);
            let _ = id.init_qp_attr(QpState::Rts);
            let at = Instant::now();
            rts.end_at(i, at);
            establish.begin_at(i, at);
        };
        let issue = |k: usize, id: &CmId| {
            let i = chunk_start + k;
            // A fresh soft QPN each (not a fixed range): a second run against the same
            // long-lived server would otherwise reuse QPNs still in timewait there and be
            // rejected as stale connections (IBTA 12.9.8.3.1), as happened through a daemon.
            // Made before the clock starts: the call is what is timed.
            let opts = ConnectOptions {
                private_data: b"rcm bench connect".to_vec(),
                ..ConnectOptions::default()
            };
            let at = Instant::now();
            connect.begin_at(i, at);
            latency.begin_at(i, at);
            if let Some(t) = &tracer {
                t.begin();
            }
            let r = id.connect(&opts).err().map(|e| format!("connect: {e}"));
            if o.serial {
                // One at a time there is nothing to send with the REQ: out now, not when
                // the wait for its answer begins.
                rcm::SendBatch::flush();
            }
            r
        };
        run_step(
            "cm connect",
            &events,
            chunk_ids,
            &range,
            (&mut failures, &mut failed),
            issue,
            |i, ev, id| match ev {
                // iWARP has no CONNECT_RESPONSE: the MPA Reply is ESTABLISHED (iw_cm's
                // CONNECT_REPLY), so connect ends here and the QP steps and establish are
                // the same instant (what cmtime shows on siw). Told apart by the missing
                // response, so it also works through a daemon whose transport we don't know.
                Event::Established { .. } if !responded[i] => {
                    let at = Instant::now();
                    if let Some(t) = &tracer {
                        t.end();
                    }
                    qp_steps(i, id, at);
                    establish.end_at(i, at);
                    latency.end_at(i, at);
                    full_conn.end_at(i, at);
                    early[i] = true;
                    true
                }
                // The RTU goes out inside establish(), so ESTABLISHED can overtake other
                // connections' responses: note it for the next step.
                Event::Established { .. } => {
                    let at = Instant::now();
                    if let Some(t) = &tracer {
                        t.end();
                    }
                    establish.end_at(i, at);
                    latency.end_at(i, at);
                    full_conn.end_at(i, at);
                    early[i] = true;
                    false
                }
                Event::ConnectResponse { .. } => {
                    responded[i] = true;
                    qp_steps(i, id, Instant::now());
                    if let Err(e) = id.establish() {
                        events.call_failed(i, format!("connection {i}: establish: {e}"));
                        return false;
                    }
                    true
                }
                _ => false,
            },
        );
        t_conn += s.elapsed();
        // establish: RTU out, ESTABLISHED reported.
        let est_start = Instant::now();
        for i in range.clone() {
            if early[i] {
                if let Some(pb) = &pb {
                    pb.inc(1);
                }
            }
        }
        // Connections that failed to connect have nothing to establish either.
        for i in range.clone() {
            skip_est[i] = early[i] || failed[i];
        }
        wait(
            "establish",
            &events,
            &range,
            &mut failures,
            &mut skip_est,
            |i, ev, _| match ev {
                Event::Established { .. } => {
                    let at = Instant::now();
                    if let Some(t) = &tracer {
                        t.end();
                    }
                    establish.end_at(i, at);
                    latency.end_at(i, at);
                    full_conn.end_at(i, at);
                    if let Some(pb) = &pb {
                        pb.inc(1);
                    }
                    true
                }
                _ => false,
            },
        );
        t_est += est_start.elapsed();
        drop(rtu_held);
        // The memory readings (and the trim) are not the connections' time.
        let mut reading = Duration::ZERO;
        if range.end == n {
            let r0 = Instant::now();
            rss_established = rss_bytes();
            if trim_heap() {
                rss_trimmed = rss_bytes();
            }
            reading = r0.elapsed();
        }
        for i in range.clone() {
            if skip_est[i] && !early[i] {
                failed[i] = true;
            }
        }
        full += full_start.elapsed().saturating_sub(reading);
        // disconnect
        let s = Instant::now();
        let issue = |k: usize, id: &CmId| {
            let i = chunk_start + k;
            disconnect.begin(i);
            id.disconnect().err().map(|e| format!("disconnect: {e}"))
        };
        run_step(
            "disconnect",
            &events,
            chunk_ids,
            &range,
            (&mut failures, &mut failed),
            issue,
            |i, ev, _| match ev {
                Event::Disconnected => {
                    disconnect.end(i);
                    true
                }
                _ => false,
            },
        );
        t_disc += s.elapsed();
        cycle += full_start.elapsed().saturating_sub(reading);
    }
    drop(pipeline);
    drop(sends);
    if o.serial {
        if let Some(w) = rtt {
            w.window();
        }
    }
    failures.extend(
        late.into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    );
    if let Some(pb) = &pb {
        pb.finish_and_clear();
    }
    steps.push(step("resolve addr", t_addr, &resolve_addr, n));
    steps.push(step("resolve route", t_route, &resolve_route, n));
    steps.push(step("create qp", qp_create, &qp_timing, n));
    steps.push(step("init qp attr", init_attr, &init_timing, n));
    steps.push(step("cm connect", t_conn, &connect, n));
    // As cmtime: these steps are parts of each connection's connect, with no wall-clock
    // span of their own (their total is not the connect step's again).
    steps.push(step("rtr qp attr", Duration::ZERO, &rtr, n));
    steps.push(step("rts qp attr", Duration::ZERO, &rts, n));
    steps.push(step("establish", t_est, &establish, n));
    steps.push(step("disconnect", t_disc, &disconnect, n));
    // A burst's destroys, which wait for no callback, go without the daemon's answers.
    steps.push(sync_step(
        "destroy id",
        &ids,
        o.send_batch && !o.serial,
        |id| id.destroy().map(|_| ()),
        (&mut failures, &mut failed),
    ));
    // As cmtime: max and min per connection, no sum ("meaningless" for overlapping ones).
    let mut full_step = step("full connect", full, &full_conn, n);
    full_step.sum_us = 0.0;
    full_step.us_per_conn = 0.0;
    steps.insert(0, full_step);

    let established = latency.done();
    let lat: Vec<f64> = latency.durations().map(|d| d.as_secs_f64() * 1e6).collect();
    let p = percentiles(&lat);
    Report {
        connections: n,
        established,
        errors: failed.iter().filter(|f| **f).count().max(n - established),
        serial: o.serial,
        qp: if o.attached_qp { "attached" } else { "mimic" },
        warmup,
        issuers: Issue::of(o).issuers,
        conn_per_s: if full.is_zero() {
            0.0
        } else {
            established as f64 / full.as_secs_f64()
        },
        cycle_per_s: if cycle.is_zero() {
            0.0
        } else {
            established as f64 / cycle.as_secs_f64()
        },
        connect_p50_us: p.map(|p| p.0),
        connect_p99_us: p.map(|p| p.1),
        udp_rtt_p50_us: 0.0,
        udp_rtt_poll_p50_us: 0.0,
        udp_rtt_poll_cpus: None,
        udp_rtt_poll_windows: 0,
        rss_per_conn_bytes: if o.serial || established == 0 {
            0.0
        } else {
            rss_established.saturating_sub(rss_before) as f64 / established as f64
        },
        rss_after_trim_per_conn_bytes: if o.serial || established == 0 || rss_trimmed == 0 {
            0.0
        } else {
            rss_trimmed.saturating_sub(rss_before) as f64 / established as f64
        },
        rss_scope: if o.daemon.is_some() {
            "client handles"
        } else if o.server.is_some() {
            "client ends"
        } else {
            "both ends"
        }
        .into(),
        steps,
        baseline_conn_per_s: None,
        failures,
        transport: if o.daemon.is_some() {
            "daemon"
        } else if srcs
            .first()
            .and_then(|ip| fabric.device(*ip))
            .is_some_and(|d| d.is_iwarp())
        {
            "iwarp"
        } else {
            "roce"
        },
        busy_polled: fabric.busy_polled().saturating_sub(polled_before),
        hold_offs: rcm::process_hold_offs().saturating_sub(held_before),
        pinned_cpus: None,
        breakdown: tracer.map(|t| t.breakdown()),
        latencies_us: lat,
    }
}

/// Where a run's events come from: its channel, which connection each id is, how long a
/// step may wait, and whether connections go one at a time.
struct Events<'a> {
    ch: &'a EventChannel,
    index: &'a foldhash::HashMap<u64, usize>,
    timeout: Duration,
    how: Issue,
    /// Connections whose call failed (no event will come for them), set by the issuing
    /// thread or an event handler while the step waits, and how many have been set.
    call_failed: &'a [std::sync::atomic::AtomicBool],
    call_failures: &'a AtomicUsize,
    /// The reasons of failures found by event handlers (which cannot reach `failures`).
    late: &'a std::sync::Mutex<Vec<String>>,
}

impl Events<'_> {
    /// Connection `i` failed in a call: the step stops waiting for it.
    fn call_failed(&self, i: usize, why: String) {
        if let Some(f) = self.call_failed.get(i) {
            f.store(true, Ordering::SeqCst);
            self.call_failures.fetch_add(1, Ordering::SeqCst);
        }
        self.late
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(why);
    }
}

/// One asynchronous step for the connections of `range`: `issue` starts each (see
/// `issue_and_wait`), `on` sees their events until each is done (see `wait`); the calls'
/// errors join the failures.
fn run_step(
    step: &str,
    from: &Events<'_>,
    chunk: &[CmId],
    range: &std::ops::Range<usize>,
    (failures, failed): (&mut Vec<String>, &mut [bool]),
    issue: impl Fn(usize, &CmId) -> Option<String> + Sync,
    on: impl FnMut(usize, &Event, &CmId) -> bool,
) {
    if !from.how.serial {
        // What this thread holds (the last RTUs of the step before) goes out before the
        // issuing thread's datagrams (DREQs, say) for the same connections.
        rcm::SendBatch::flush();
    }
    // A connection that failed in an earlier step is not called again (its calls would
    // only fail for its state); one whose call fails now is not waited for.
    let before: Vec<bool> = failed[range.clone()].to_vec();
    let start = range.start;
    let issue = |k: usize, id: &CmId| {
        if before.get(k).copied().unwrap_or(true) {
            return None;
        }
        let e = issue(k, id)?;
        from.call_failed(start + k, format!("connection {}: {e}", start + k));
        None
    };
    let errs = issue_and_wait(from.how, chunk, issue, || {
        wait(step, from, range, failures, failed, on);
    });
    failures.extend(errs);
}

/// Takes events until every live connection in `range` satisfied `on` (or failed).
fn wait(
    step: &str,
    from: &Events<'_>,
    range: &std::ops::Range<usize>,
    failures: &mut Vec<String>,
    failed: &mut [bool],
    mut on: impl FnMut(usize, &Event, &CmId) -> bool,
) {
    let (ch, index, timeout) = (from.ch, from.index, from.timeout);
    let mut pending: usize = range.clone().filter(|i| !failed[*i]).count();
    let end = Instant::now() + timeout;
    let mut done: Vec<bool> = failed[range.clone()].to_vec();
    let mut seen_call_failures = usize::MAX;
    loop {
        // Calls that failed (on the issuing thread, or in a handler) end their connections.
        let now_failures = from.call_failures.load(Ordering::SeqCst);
        if now_failures != seen_call_failures {
            seen_call_failures = now_failures;
            for (k, d) in done.iter_mut().enumerate() {
                let i = range.start + k;
                if !*d
                    && from
                        .call_failed
                        .get(i)
                        .is_some_and(|f| f.load(Ordering::SeqCst))
                {
                    *d = true;
                    failed[i] = true;
                    pending -= 1;
                }
            }
        }
        if pending == 0 {
            break;
        }
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            // A step's own timeout (`--timeout`) ends it while connections still wait for
            // their event: say which step, and what a user usually has to check.
            failures.push(format!(
                "{step}: timed out after {} s with {pending} connection(s) still waiting \
                 (no answer from the peer: is the server running and reachable? --timeout \
                 waits longer)",
                timeout.as_secs_f64()
            ));
            for (k, d) in done.iter().enumerate() {
                if !d {
                    failed[range.start + k] = true;
                }
            }
            break;
        }
        // Looked at again at least every 20 ms, for calls failing meanwhile.
        let Some(e) = ch.get_event(Some(left.min(Duration::from_millis(20)))) else {
            continue;
        };
        let Some(&i) = index.get(&e.id().key()) else {
            continue;
        };
        if !range.contains(&i) || failed[i] {
            continue;
        }
        // Every event goes to `on`, even for connections this step is done with: a later
        // step's event can arrive early and must not be lost.
        let hit = on(i, e.event(), e.id());
        if done[i - range.start] {
            continue;
        }
        if hit {
            done[i - range.start] = true;
            pending -= 1;
        } else if matches!(
            e.event(),
            Event::Rejected { .. }
                | Event::Unreachable(_)
                | Event::ConnectError(_)
                | Event::AddrError(_)
                | Event::RouteError(_)
                // The device (or the daemon) is gone: nothing more comes for this id.
                | Event::DeviceRemoval
        ) {
            failures.push(format!("connection {i}: {}", failure(e.event())));
            failed[i] = true;
            done[i - range.start] = true;
            pending -= 1;
        }
    }
}

/// An event that ends a connection, with what it carries: the error, the reject reason, or
/// why the peer is unreachable.
fn failure(ev: &Event) -> String {
    match ev {
        Event::AddrError(e) | Event::RouteError(e) | Event::ConnectError(e) => {
            format!("{}: {e}", ev.name())
        }
        Event::Rejected { reason, .. } => format!("{} ({reason:?})", ev.name()),
        Event::Unreachable(u) => format!("{}: {u}", ev.name()),
        _ => ev.name().to_string(),
    }
}

fn progress(o: &BenchOpts, n: usize) -> Option<indicatif::ProgressBar> {
    if !o.progress || n < 2000 {
        return None;
    }
    let pb = indicatif::ProgressBar::new(n as u64);
    pb.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} connecting [{bar:40}] {pos}/{len} {per_sec}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    Some(pb)
}

/// Asks the allocator to give back the free pages inside its heap; whether it could be
/// asked (glibc only).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn trim_heap() -> bool {
    extern "C" {
        fn malloc_trim(pad: usize) -> std::ffi::c_int;
    }
    // SAFETY: glibc's malloc_trim takes a byte count and only releases free memory of the
    // allocator's own arenas (under their locks); it touches no memory this program holds.
    unsafe { malloc_trim(0) };
    true
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim_heap() -> bool {
    false
}

/// Resident set size of this process, from /proc/self/statm (0 where unavailable).
/// `n` false flags, every page of them already written (not calloc's untouched zero pages).
fn resident_flags(n: usize) -> Vec<bool> {
    let mut v = vec![true; n];
    v.fill(false);
    v
}

/// The process's resident set, from `VmRSS` of `/proc/self/status` (0 if unreadable). Not
/// `statm` times `rustix::param::page_size`: rustix reads the page size from the auxiliary
/// vector, whose vDSO entry it checks by reading a page valgrind leaves unmapped, so the bench
/// crashed under valgrind (rustix issue 1559).
fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| vm_rss_bytes(&s))
        .unwrap_or(0)
}

/// `VmRSS` of a `/proc/PID/status` text, in bytes.
fn vm_rss_bytes(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let mut f = line.split_whitespace().skip(1);
    let n: u64 = f.next()?.parse().ok()?;
    (f.next() == Some("kB")).then_some(n * 1024)
}

/// The median and 99th percentile of latencies in microseconds (none for none), kept in
/// nanoseconds to 3 significant digits (10 ns at 15 µs): whole microseconds would cut a
/// 15.9 µs median to 15.
fn percentiles(lat: &[f64]) -> Option<(f64, f64)> {
    if lat.is_empty() {
        return None;
    }
    let mut h = Histogram::<u64>::new(3).unwrap_or_else(|_| Histogram::new(2).expect("histogram"));
    for v in lat {
        let _ = h.record((v * 1e3).max(1.0) as u64);
    }
    let pct = |q: f64| h.value_at_quantile(q) as f64 / 1e3;
    Some((pct(0.5), pct(0.99)))
}

/// A latency of the text report: "n/a" where none was measured.
fn us(v: Option<f64>) -> String {
    v.map_or_else(|| "n/a".into(), |v| format!("{v:.1} us"))
}

/// The `--breakdown` lines of the text report.
fn print_breakdown(b: &crate::breakdown::Breakdown, rtt_poll_us: f64) {
    if b.connections == 0 {
        println!(
            "breakdown: no connect had all its stamps ({} left out)",
            b.left_out
        );
        return;
    }
    let left = if b.left_out > 0 {
        format!(", {} left out", b.left_out)
    } else {
        String::new()
    };
    println!(
        "where a connect's time goes ({}; medians of {} connects{left}; µs):",
        b.ends, b.connections
    );
    for s in &b.segments {
        println!("  {:>7.2}  {}", s.p50_us, s.segment);
    }
    let rtt = if rtt_poll_us > 0.0 {
        format!(" (the polling round trip: {rtt_poll_us:.2})")
    } else {
        String::new()
    };
    if b.both_ends() {
        println!(
            "  the two trips {:.2}{rtt}; the rest, rcm's work at the ends, {:.2}",
            b.away_us(),
            b.work_us()
        );
    } else {
        println!(
            "  from the REQ to the REP {:.2}{rtt}; the rest, the client's work, {:.2}",
            b.away_us(),
            b.work_us()
        );
    }
}

/// `--pin` places the threads of the embedded default, whose server and client share a
/// process; elsewhere the other side's threads are not this process's to place.
fn refuse_pin(o: &BenchOpts) -> Result<(), String> {
    if o.pin {
        return Err(
            "--pin applies to the embedded default (server and client in this \
                    process), not to --daemon, --server or --listen: run those under \
                    taskset instead"
                .into(),
        );
    }
    Ok(())
}

/// Two CPUs this process may run on, for the ends of a polling round trip.
fn two_cpus() -> Option<(usize, usize)> {
    let set = rustix::thread::sched_getaffinity(None).ok()?;
    let mut cpus = (0..rustix::thread::CpuSet::MAX_CPU).filter(|&c| set.is_set(c));
    Some((cpus.next()?, cpus.next()?))
}

/// Runs the calling thread on `cpu` alone until the guard drops (then where it ran before).
struct OnCpu(Option<rustix::thread::CpuSet>);

impl OnCpu {
    fn pin(cpu: Option<usize>) -> OnCpu {
        let Some(cpu) = cpu else { return OnCpu(None) };
        let Ok(before) = rustix::thread::sched_getaffinity(None) else {
            return OnCpu(None);
        };
        let mut one = rustix::thread::CpuSet::new();
        one.set(cpu);
        match rustix::thread::sched_setaffinity(None, &one) {
            Ok(()) => OnCpu(Some(before)),
            Err(_) => OnCpu(None),
        }
    }
}

impl Drop for OnCpu {
    fn drop(&mut self) {
        if let Some(before) = &self.0 {
            let _ = rustix::thread::sched_setaffinity(None, before);
        }
    }
}

/// Median loopback UDP round trip between two sockets, in microseconds. With a nonzero
/// `spin`, each end polls its socket for up to `spin` before it sleeps in `recv`, and the
/// two ends run on two different CPUs where the process has two: two polling ends that the
/// scheduler happens to put on one CPU take turns through `sched_yield` at every hop, which
/// on the 2-core VMs made the median 11-15 µs instead of 7-9, at random from run to run
/// (so the connect latency's ratio to it swung between 1.4 and 2.7 for the same p50).
/// Returns the median and the two CPUs the ends were pinned to (none without `spin`, or
/// where the process may use one CPU only).
pub fn udp_rtt(
    a: IpAddr,
    b: IpAddr,
    rounds: usize,
    spin: Duration,
) -> std::io::Result<(f64, Option<[usize; 2]>)> {
    let cpus = if spin.is_zero() { None } else { two_cpus() };
    let mut v = udp_rtt_rounds(a, b, rounds, spin, cpus)?;
    Ok((median(&mut v), cpus.map(|(a, b)| [a, b])))
}

/// The median of `v` (sorted in place); 0 for none.
pub(crate) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// `rounds` round trips of a 280-byte datagram (a GSI datagram's size) between a socket on
/// `a` and an echo on `b`, each in microseconds; the calling thread's end on the first of
/// `cpus`, the echo's on the second.
fn udp_rtt_rounds(
    a: IpAddr,
    b: IpAddr,
    rounds: usize,
    spin: Duration,
    cpus: Option<(usize, usize)>,
) -> std::io::Result<Vec<f64>> {
    let s1 = UdpSocket::bind(SocketAddr::new(a, 0))?;
    let s2 = UdpSocket::bind(SocketAddr::new(b, 0))?;
    s1.set_read_timeout(Some(Duration::from_secs(1)))?;
    s2.set_read_timeout(Some(Duration::from_secs(1)))?;
    let b2 = s2.local_addr()?;
    let a1 = s1.local_addr()?;
    let stop = Arc::new(AtomicBool::new(false));
    let st = stop.clone();
    let echo = std::thread::spawn(move || {
        let _on = OnCpu::pin(cpus.map(|c| c.1));
        let mut buf = [0u8; 512];
        while !st.load(Ordering::Relaxed) {
            if let Ok(n) = recv_polling(&s2, &mut buf, spin) {
                let _ = s2.send_to(&buf[..n], a1);
            }
        }
    });
    let on = OnCpu::pin(cpus.map(|c| c.0));
    let msg = [0u8; 280];
    let mut buf = [0u8; 512];
    let mut v = Vec::with_capacity(rounds);
    let mut pings = || -> std::io::Result<()> {
        for _ in 0..rounds {
            let t = Instant::now();
            s1.send_to(&msg, b2)?;
            recv_polling(&s1, &mut buf, spin)?;
            v.push(t.elapsed().as_secs_f64() * 1e6);
        }
        Ok(())
    };
    let done = pings();
    drop(on);
    // The echo thread ends on a failed round too (it would otherwise poll forever).
    stop.store(true, Ordering::Relaxed);
    let _ = UdpSocket::bind(SocketAddr::new(a, 0)).and_then(|s| s.send_to(&[0], b2));
    let _ = echo.join();
    done?;
    Ok(v)
}

/// The polling round trip of a one-at-a-time run, measured in windows spread over the run
/// (before its first connection, after every tenth of them, and after the last) instead of
/// once after it. This host's speed changes from one fraction of a second to the next (a
/// loopback `sendto` took 3.0 or 3.9 µs for stretches of ~0.2 s on the 2-vCPU VM), and a
/// round trip measured after the connections often fell in another stretch than most of
/// them: the ratio of the same build's p50 to it went 1.20 to 1.84 from run to run. In
/// windows the round trip has the connections' mixture of stretches.
pub struct RttWindows {
    a: IpAddr,
    b: IpAddr,
    spin: Duration,
    cpus: Option<(usize, usize)>,
    rounds: Vec<f64>,
    windows: usize,
}

impl RttWindows {
    /// Round trips in each window.
    pub const ROUNDS: usize = 200;

    /// Windows between `a` and `b` polling for `spin` each look, on two CPUs of the process
    /// (taken now: the caller may be pinned to one of them later).
    pub fn new(a: IpAddr, b: IpAddr, spin: Duration) -> RttWindows {
        RttWindows {
            a,
            b,
            spin,
            cpus: two_cpus(),
            rounds: Vec::new(),
            windows: 0,
        }
    }

    /// Measures one window; a window that fails (a lost datagram) adds nothing.
    pub fn window(&mut self) {
        if let Ok(v) = udp_rtt_rounds(self.a, self.b, Self::ROUNDS, self.spin, self.cpus) {
            self.rounds.extend(v);
            self.windows += 1;
        }
    }

    /// Windows measured.
    pub fn windows(&self) -> usize {
        self.windows
    }

    /// Whether window `k` (of connections `0..n`, one at a time) comes before connection
    /// `k`: at the first, at every tenth, and after the last (`k == n`).
    pub fn before(k: usize, n: usize) -> bool {
        k == n || k % n.div_ceil(10).max(1) == 0
    }

    /// The median of every window's rounds and the two CPUs, if any window was measured.
    fn result(mut self) -> Option<(f64, Option<[usize; 2]>)> {
        (!self.rounds.is_empty())
            .then(|| (median(&mut self.rounds), self.cpus.map(|(a, b)| [a, b])))
    }
}

/// `recv`, polling for up to `spin` first with the loop rcm's own threads use
/// ([`rcm::spin_until`] over a `MSG_DONTWAIT` receive), so the "polling" round trip is
/// measured the way rcm waits: the socket stays blocking, no mode switch per receive.
fn recv_polling(s: &UdpSocket, buf: &mut [u8], spin: Duration) -> std::io::Result<usize> {
    use rustix::io::Errno;
    use rustix::net::{recv, RecvFlags};
    if !spin.is_zero() {
        let mut got = None;
        rcm::spin_until(spin, || match recv(s, &mut *buf, RecvFlags::DONTWAIT) {
            Ok((n, _)) => {
                got = Some(Ok(n));
                true
            }
            Err(Errno::AGAIN | Errno::INTR) => false,
            Err(e) => {
                got = Some(Err(e.into()));
                true
            }
        });
        if let Some(r) = got {
            return r;
        }
    }
    s.recv(buf)
}

/// Both round trips of the report (sleeping, and polling as the run's threads did). The
/// polling one from `windows` when the run measured it in windows, else measured now.
fn measure_rtt(r: &mut Report, a: IpAddr, b: IpAddr, spin: Duration, windows: Option<RttWindows>) {
    r.udp_rtt_p50_us = udp_rtt(a, b, 2000, Duration::ZERO).map_or(0.0, |(p50, _)| p50);
    if spin.is_zero() {
        return;
    }
    r.udp_rtt_poll_windows = windows.as_ref().map_or(0, RttWindows::windows);
    let got = match windows.and_then(RttWindows::result) {
        Some(got) => Some(got),
        None => udp_rtt(a, b, 2000, spin).ok(),
    };
    if let Some((p50, cpus)) = got {
        r.udp_rtt_poll_p50_us = p50;
        r.udp_rtt_poll_cpus = cpus;
    }
}

/// The TCP baseline: `n` × (connect + 56-byte exchange each way + close), from two threads,
/// on loopback only: a listener on 127.0.0.1, its clients bound to 127.0.x.y, so that the
/// connections' 4-tuples differ and TIME_WAIT, which holds each for a minute, does not cap
/// it. Returns connections per second.
pub fn tcp_baseline(n: usize) -> std::io::Result<f64> {
    let listener = TcpListener::bind(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0))?;
    let dst = listener.local_addr()?;
    baseline_over(n, listener, dst)
}

/// [`tcp_baseline`] with `listener` serving and the clients connecting to `dst` (a test
/// points them elsewhere to make them fail). Whatever happens, the server's thread has
/// ended, and `listener` is closed, when this returns.
fn baseline_over(n: usize, listener: TcpListener, dst: SocketAddr) -> std::io::Result<f64> {
    let at = listener.local_addr()?;
    let served = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let (sv, st) = (served.clone(), stop.clone());
    let total = n;
    let server = std::thread::spawn(move || {
        let mut buf = [0u8; 56];
        while sv.load(Ordering::Relaxed) < total {
            let mut s = match listener.accept() {
                Ok((s, _)) => s,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::Interrupted | std::io::ErrorKind::ConnectionAborted
                    ) =>
                {
                    continue
                }
                // Its clients' connects are refused once the listener is closed: they fail
                // rather than wait.
                Err(_) => break,
            };
            if st.load(Ordering::SeqCst) {
                break;
            }
            if s.read_exact(&mut buf).is_ok() {
                let _ = s.write_all(&buf);
            }
            sv.fetch_add(1, Ordering::Relaxed);
        }
    });
    let threads = 2;
    let start = Instant::now();
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let stop = stop.clone();
            std::thread::spawn(move || -> std::io::Result<()> {
                let mut buf = [0u8; 56];
                for i in (t..n).step_by(threads) {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let host = 1 + (i % 250) as u8;
                    let net = (i / 250 % 250) as u8;
                    let src = IpAddr::V4(Ipv4Addr::new(127, 0, net, host));
                    if let Err(e) = exchange(src, dst, &mut buf) {
                        // The other thread stops too: the run failed.
                        stop.store(true, Ordering::SeqCst);
                        return Err(e);
                    }
                }
                Ok(())
            })
        })
        .collect();
    let mut failed = None;
    for w in workers {
        let r = w
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("baseline thread panicked")));
        if let Err(e) = r {
            failed.get_or_insert(e);
        }
    }
    let el = start.elapsed();
    if let Some(e) = failed {
        stop.store(true, Ordering::SeqCst);
        // The server may be blocked in accept, for connections that will not come: one
        // more wakes it, and it stops. Refused, the listener is closed already. Any other
        // error leaves it blocked, and joining it would hang the run.
        let woken = match TcpStream::connect(at) {
            Ok(_) => true,
            Err(e) => e.kind() == std::io::ErrorKind::ConnectionRefused,
        };
        if woken {
            let _ = server.join();
        }
        return Err(e);
    }
    let _ = server.join();
    Ok(n as f64 / el.as_secs_f64())
}

/// One connection of the TCP baseline: from `src` to `dst`, `buf`'s 56 bytes each way.
fn exchange(src: IpAddr, dst: SocketAddr, buf: &mut [u8; 56]) -> std::io::Result<()> {
    let mut s = connect_from(src, dst)?;
    s.set_nodelay(true)?;
    s.write_all(&[7u8; 56])?;
    s.read_exact(buf)
}

/// A TCP connection to `dst` from `src` (a port the kernel picks).
fn connect_from(src: IpAddr, dst: SocketAddr) -> std::io::Result<TcpStream> {
    use rustix::net::{bind, connect, socket_with, AddressFamily, SocketFlags, SocketType};
    let family = if src.is_ipv4() {
        AddressFamily::INET
    } else {
        AddressFamily::INET6
    };
    let fd = socket_with(family, SocketType::STREAM, SocketFlags::CLOEXEC, None)?;
    bind(&fd, &SocketAddr::new(src, 0))?;
    connect(&fd, &dst)?;
    Ok(TcpStream::from(fd))
}

/// The fabric of one side: the daemon's (a session of it), or a fresh one with a device
/// on each of `binds`; the addresses its ids use.
fn side_fabric(o: &BenchOpts, binds: &[IpAddr]) -> Result<(Fabric, Vec<IpAddr>), String> {
    let cfg = FabricConfig {
        udp_port: o.udp_port,
        dispatcher_threads: o.threads,
        spin: o.spin,
        // The bench's callbacks never block.
        callbacks: if o.send_batch {
            rcm::CallbackMode::Inline
        } else {
            rcm::CallbackMode::Threads
        },
        ..FabricConfig::default()
    };
    if let Some(path) = &o.daemon {
        let f = rcm_ucm::fabric_with(path, cfg)
            .map_err(|e| format!("daemon {}: {e}", path.display()))?;
        let devs = f.device_addrs();
        if let Some(b) = binds.iter().find(|b| !devs.contains(b)) {
            return Err(format!("the daemon has no device on {b} (it has {devs:?})"));
        }
        let ips = if binds.is_empty() {
            vec![*devs.first().ok_or("the daemon has no devices")?]
        } else {
            binds.to_vec()
        };
        return Ok((f, ips));
    }
    if binds.is_empty() {
        return Err("--bind is required with --listen or --server".into());
    }
    let f = Fabric::new(cfg);
    for &bind in binds {
        let what = if o.iwarp { "iWARP device" } else { "device" };
        crate::add_device(&f, bind, o.iwarp)
            .map_err(|e| crate::device_error(&format!("{what} on {bind}"), &e))?;
    }
    Ok((f, binds.to_vec()))
}

/// What a bench run made: the client's report, or, for a `--listen` server (whose report
/// it printed itself), whether every connection it served went down (none still open when
/// it stopped waiting).
pub enum Ran {
    /// The client's measurements.
    Client(Box<Report>),
    /// A server's end.
    Served {
        /// No connection was still open at the end.
        clean: bool,
    },
}

/// What a `--listen` server that served its `-c` connections reports.
#[derive(Debug, Clone, Serialize)]
pub struct ServeReport {
    /// "server".
    pub role: &'static str,
    /// Connections it was to serve: it stops once it accepted that many.
    pub connections: usize,
    /// Connect requests accepted.
    pub accepted: usize,
    /// Connections established here (counted at their ESTABLISHED; see [`Served`]).
    pub established: usize,
    /// Connections still up when it stopped waiting for their disconnects (10 s after the
    /// last was accepted). The rates are the client's to measure.
    pub open_at_end: usize,
}

/// Runs one side for a benchmark across hosts: `--listen` serves on `--bind` until
/// interrupted, or with `serve` until that many were served (then prints its own report and
/// returns `None`); `--server` runs the client from `--bind`.
pub fn run_remote(o: &BenchOpts) -> Result<Ran, String> {
    refuse_pin(o)?;
    if o.listen && o.bind.len() > 1 {
        return Err("--listen serves on one --bind address".into());
    }
    if o.baseline_tcp {
        // The baseline runs over loopback: beside a run to another host it would compare
        // that network with this machine's loopback.
        return Err(
            "--baseline tcp runs on loopback only: with the embedded default or --daemon, \
             not with --server/--listen"
                .into(),
        );
    }
    let (fabric, binds) = side_fabric(o, &o.bind)?;
    if o.listen {
        let bind = *binds.first().ok_or("no address to serve on")?;
        let served = Arc::new(Served::default());
        let _srv = serve(
            &fabric,
            SocketAddr::new(bind, o.port),
            65536,
            served.clone(),
        )
        .map_err(|e| format!("listen: {e}"))?;
        let Some(want) = o.serve else {
            eprintln!(
                "rcm bench: serving on {bind}:{} (UDP {}); Ctrl-C to stop",
                o.port, o.udp_port
            );
            loop {
                std::thread::sleep(Duration::from_secs(5));
                eprintln!(
                    "rcm bench: {} connections accepted",
                    served.accepted.load(Ordering::Relaxed)
                );
            }
        };
        eprintln!(
            "rcm bench: serving {want} connections on {bind}:{} (UDP {})",
            o.port, o.udp_port
        );
        // Served once accepted: a connection whose RTU was lost may go down without ever
        // being ESTABLISHED here, and counting those would wait for good.
        let mut report_at = Instant::now();
        loop {
            std::thread::sleep(Duration::from_millis(1));
            let n = served.accepted.load(Ordering::Relaxed);
            if n >= want {
                break;
            }
            if report_at.elapsed() >= Duration::from_secs(5) {
                eprintln!("rcm bench: {n} of {want} connections accepted");
                report_at = Instant::now();
            }
        }
        // The client disconnects; each child is destroyed at its DISCONNECTED.
        let waited = Instant::now();
        while fabric.live_ids() > 1 && waited.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
        let r = ServeReport {
            role: "server",
            connections: want,
            accepted: served.accepted.load(Ordering::Relaxed),
            established: served.established.load(Ordering::Relaxed),
            open_at_end: fabric.live_ids().saturating_sub(1),
        };
        fabric.shutdown();
        if o.json {
            println!("{}", serde_json::to_string_pretty(&r).unwrap_or_default());
        } else {
            println!(
                "rcm bench: served {} connections ({} accepted, {} established, {} still open)",
                r.connections, r.accepted, r.established, r.open_at_end
            );
        }
        if r.open_at_end > 0 {
            eprintln!(
                "rcm bench: {} connection(s) still open 10 s after the last was accepted: \
                 their clients did not disconnect",
                r.open_at_end
            );
        }
        return Ok(Ran::Served {
            clean: r.open_at_end == 0,
        });
    }
    let server = o.server.ok_or("--server is required")?;
    if let Some(w) = too_few_ports(o.connections, &binds) {
        eprintln!("rcm bench: {w}; add client addresses with --bind");
    }
    let r = run_client(&fabric, &binds, SocketAddr::new(server, o.port), o, None);
    fabric.shutdown();
    Ok(Ran::Client(Box::new(r)))
}

/// The default benchmark through a daemon: the server and the client are two sessions of
/// it (as two processes would be); the server listens on the daemon's first device and the
/// client connects from the others (or the same one, when it has only one).
pub fn run_daemon(o: &BenchOpts) -> Result<Ran, String> {
    refuse_pin(o)?;
    let (sf, server_ips) = side_fabric(o, &o.bind)?;
    let server_ip = *server_ips.first().ok_or("the daemon has no devices")?;
    let (cf, _) = side_fabric(o, &[])?;
    let mut srcs: Vec<IpAddr> = cf
        .device_addrs()
        .into_iter()
        .filter(|d| *d != server_ip && d.is_ipv4() == server_ip.is_ipv4())
        .collect();
    if srcs.is_empty() {
        srcs.push(server_ip);
    }
    if let Some(w) = too_few_ports(o.connections, &srcs) {
        eprintln!("rcm bench: {w}; add addresses with the daemon's --bind");
    }
    let served = Arc::new(Served::default());
    let srv = serve(
        &sf,
        SocketAddr::new(server_ip, o.port),
        o.connections.max(1024),
        served,
    )
    .map_err(|e| format!("listen: {e}"))?;
    let mut windows = (o.serial && server_ip.is_loopback() && !o.spin.is_zero())
        .then(|| RttWindows::new(srcs[0], server_ip, o.spin));
    let mut r = run_client(
        &cf,
        &srcs,
        SocketAddr::new(server_ip, o.port),
        o,
        windows.as_mut(),
    );
    let _ = srv.destroy();
    cf.shutdown();
    sf.shutdown();
    if server_ip.is_loopback() {
        measure_rtt(&mut r, srcs[0], server_ip, o.spin, windows);
    }
    // The baseline is this host's loopback TCP, whatever the daemon serves.
    add_baseline(&mut r, o);
    Ok(Ran::Client(Box::new(r)))
}

/// A warning when `sockets` sockets (with a margin for the process's own) may not fit in
/// the open-file limit `limit`.
fn too_few_fds(sockets: usize, limit: Option<u64>) -> Option<String> {
    let limit = limit?;
    let need = sockets as u64 + 64;
    (need > limit).then(|| {
        format!(
            "about {need} open files are needed and the limit is {limit}: connections past it \
             fail, with 'Too many open files' at connect, or unanswered until the MPA timeout \
             (10 s, and the run lasts that long) where the server could not accept them; \
             raise the hard limit (ulimit -Hn)"
        )
    })
}

/// A warning when `n` connections cannot all get a port on `srcs`: an id binds an
/// ephemeral port of its client address, and each address has one range of them, so the
/// connections past the range fail with "no free port" (run_client binds round-robin).
fn too_few_ports(n: usize, srcs: &[IpAddr]) -> Option<String> {
    let per = usize::from(rcm::EPHEMERAL.1 - rcm::EPHEMERAL.0) + 1;
    let have = srcs.len().max(1);
    let need = n.div_ceil(per);
    (need > have).then(|| {
        format!(
            "{n} connections need {need} client addresses ({per} ports each) and {have} \
             {} given: {} of them will fail with no free port",
            if have == 1 { "is" } else { "are" },
            n - have * per
        )
    })
}

/// With `--baseline tcp`: the TCP baseline beside the run. A baseline that fails is one
/// failure of the report (exit 1), which keeps the run's own results.
fn add_baseline(r: &mut Report, o: &BenchOpts) {
    if o.baseline_tcp {
        match tcp_baseline(o.connections) {
            Ok(b) => r.baseline_conn_per_s = Some(b),
            Err(e) => r.failures.push(format!("TCP baseline: {e}")),
        }
    }
}

/// Runs the default benchmark: server and client in this process on two loopback devices.
pub fn run_local(o: &BenchOpts) -> Result<Ran, String> {
    let cfg = FabricConfig {
        udp_port: o.udp_port,
        dispatcher_threads: o.threads,
        spin: o.spin,
        // The bench's callbacks never block.
        callbacks: if o.send_batch {
            rcm::CallbackMode::Inline
        } else {
            rcm::CallbackMode::Threads
        },
        ..FabricConfig::default()
    };
    // One client device per 25,000 connections (an address has ~28k ephemeral ports).
    let client_devices = o.connections.div_ceil(25_000).clamp(1, 200) as u8;
    let (client_ip, server_ip) = (IpAddr::from([127, 0, 0, 2]), IpAddr::from([127, 0, 0, 1]));
    // Made before this thread is pinned: it takes two CPUs of the process.
    let mut windows =
        (o.serial && !o.spin.is_zero()).then(|| RttWindows::new(client_ip, server_ip, o.spin));
    // `--pin`: the fabric's threads inherit the CPU this thread is on while it opens the
    // devices (they are all started then); then this thread moves to the other CPU.
    let cpus = if o.pin {
        Some(two_cpus().ok_or("--pin needs two CPUs this process may run on")?)
    } else {
        None
    };
    let on_fabric_cpu = OnCpu::pin(cpus.map(|c| c.1));
    let fabric = if o.iwarp {
        Fabric::loopback_iwarp(1 + client_devices, cfg)
            .map_err(|e| format!("cannot open loopback iWARP devices: {e}"))?
    } else {
        Fabric::loopback_with(1 + client_devices, cfg)
            .map_err(|e| crate::device_error("cannot open the loopback devices", &e))?
    };
    drop(on_fabric_cpu);
    let on_client_cpu = OnCpu::pin(cpus.map(|c| c.0));
    if o.iwarp {
        // A TCP socket at each end of every connection.
        // `main` raised the limit already: only read it.
        let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile).current;
        if let Some(w) = too_few_fds(2 * o.connections, limit) {
            eprintln!("rcm bench: {w}");
        }
    }
    let served = Arc::new(Served::default());
    // A burst is accepted as fast as callbacks run; the backlog must hold all of it or the
    // excess is dropped and retried a second later.
    let backlog = o.connections.max(1024);
    let srv = serve(
        &fabric,
        SocketAddr::new(IpAddr::from([127, 0, 0, 1]), o.port),
        backlog,
        served,
    )
    .map_err(|e| format!("listen: {e}"))?;
    let srcs: Vec<IpAddr> = (0..client_devices)
        .map(|k| IpAddr::from([127, 0, 0, 2 + k]))
        .collect();
    let mut r = run_client(
        &fabric,
        &srcs,
        SocketAddr::new(IpAddr::from([127, 0, 0, 1]), o.port),
        o,
        windows.as_mut(),
    );
    let _ = srv.destroy();
    fabric.shutdown();
    drop(on_client_cpu);
    r.pinned_cpus = cpus.map(|(a, b)| [a, b]);
    measure_rtt(&mut r, client_ip, server_ip, o.spin, windows);
    add_baseline(&mut r, o);
    Ok(Ran::Client(Box::new(r)))
}

/// Prints the cmtime-style table and the summary.
pub fn print_table(r: &Report) {
    println!("cm_conn {}", r.connections);
    if r.serial {
        println!("mode serial");
    } else if r.issuers > 1 {
        println!("mode burst, calls from {} threads", r.issuers);
    } else {
        println!("mode burst");
    }
    println!("qp {}", r.qp);
    println!("warmup {}", r.warmup);
    println!(
        "{:<14} {:>10} {:>12} {:>10} {:>12} {:>10} {:>10}",
        "step", "avg/conn", "total(us)", "us/conn", "sum(us)", "max(us)", "min(us)"
    );
    for s in &r.steps {
        println!(
            "{:<14} {:>10.2} {:>12.0} {:>10.2} {:>12.0} {:>10.0} {:>10.0}",
            s.step, s.avg_per_conn_us, s.total_us, s.us_per_conn, s.sum_us, s.max_us, s.min_us
        );
    }
    println!();
    println!(
        "established {}/{}  errors {}  {:.0} conn/s  {:.0} cycles/s (connect+exchange+disconnect)",
        r.established, r.connections, r.errors, r.conn_per_s, r.cycle_per_s
    );
    let (p50, p99) = (us(r.connect_p50_us), us(r.connect_p99_us));
    if r.udp_rtt_p50_us > 0.0 {
        println!(
            "connect latency p50 {p50}  p99 {p99}   loopback UDP RTT p50 {:.1} us",
            r.udp_rtt_p50_us
        );
    } else {
        // Across hosts (--server) no loopback round trip is measured.
        println!("connect latency p50 {p50}  p99 {p99}");
    }
    if r.udp_rtt_poll_p50_us > 0.0 {
        // One at a time, the connect is the round trip and rcm's own work: how many round
        // trips it takes says what rcm adds. In a burst the latency is queueing.
        let ratio = match r.connect_p50_us {
            Some(p50) if r.serial => {
                format!("; connect p50 = {:.2}x that", p50 / r.udp_rtt_poll_p50_us)
            }
            _ => String::new(),
        };
        let cpus = if r.udp_rtt_poll_cpus.is_some() {
            "on two CPUs"
        } else {
            "taking turns on the one CPU this process may use"
        };
        let when = if r.udp_rtt_poll_windows > 0 {
            format!(
                ", in {} windows between the connections",
                r.udp_rtt_poll_windows
            )
        } else {
            String::new()
        };
        println!(
            "  (UDP RTT p50 {:.1} us when both ends poll as rcm's threads do, {cpus}{when}, see --spin-us{ratio})",
            r.udp_rtt_poll_p50_us
        );
    }
    if let Some(b) = &r.breakdown {
        print_breakdown(b, r.udp_rtt_poll_p50_us);
    }
    if let Some([a, b]) = r.pinned_cpus {
        println!(
            "pinned: the client's calls and event loop on CPU {a}, the fabric's threads on CPU {b}"
        );
    }
    if r.busy_polled > 0 {
        let what = match r.transport {
            "daemon" => "daemon frames",
            "iwarp" => "streams' readiness events",
            _ => "datagrams",
        };
        println!(
            "busy polling: {} {what} received by the waiting thread itself",
            r.busy_polled
        );
    }
    if r.hold_offs > 0 {
        println!(
            "contention: this process's polling threads were held off polling {} times (another process, a CPU-bound one or the daemon in a burst, kept their CPU for over a millisecond at a time): the latencies include sleeps",
            r.hold_offs
        );
    }
    if r.rss_per_conn_bytes > 0.0 {
        let trimmed = if r.rss_after_trim_per_conn_bytes > 0.0 {
            format!(
                "; {:.0} once the allocator returns the burst's free pages",
                r.rss_after_trim_per_conn_bytes
            )
        } else {
            String::new()
        };
        // The process's fixed cost (threads' stacks, first table sizes) is in the
        // difference too, spread over the connections: a few thousand hide it.
        let small = if r.established < 10_000 {
            " (under 10,000 connections the process's fixed cost dominates this figure)"
        } else {
            ""
        };
        println!(
            "memory: {:.0} bytes of RSS per established connection ({}, all {} up at once){trimmed}{small}",
            r.rss_per_conn_bytes, r.rss_scope, r.established
        );
    }
    if let Some(b) = r.baseline_conn_per_s {
        // The baseline always runs its connections two threads at a time, so the ratio
        // compares concurrencies as well as stacks, in a burst (the headline) as one at a
        // time.
        let rcm = if r.serial {
            "one at a time".to_string()
        } else {
            format!("all {} in flight", r.connections)
        };
        println!(
            "TCP baseline {b:.0} conn/s (connect + 56-byte exchange + close); rcm/TCP = {:.2}x (rcm {rcm} here, the baseline two at a time)",
            r.cycle_per_s / b
        );
    }
    for f in r.failures.iter().take(10) {
        println!("failure: {f}");
    }
}

/// Writes the connect-latency distribution (a CDF) as a small SVG.
pub fn write_plot(r: &Report, mut out: impl std::io::Write) -> std::io::Result<()> {
    let mut v = r.latencies_us.clone();
    v.sort_by(f64::total_cmp);
    let (w, h, m) = (640.0, 400.0, 50.0);
    let max = v.last().copied().unwrap_or(1.0).max(1.0);
    let mut pts = String::new();
    let step = (v.len() / 500).max(1);
    let px = |x: f64| m + x / max * (w - 2.0 * m);
    // The CDF rises from 0 at the fastest connection: one connection is then a step up,
    // where a lone point drew nothing.
    if let Some(&x) = v.first() {
        let _ = write!(pts, "{:.1},{:.1} ", px(x), h - m);
    }
    // Thinned to about 500 points, the slowest always among them: without it the curve
    // stopped short of 1.0 when the count was no multiple of the step.
    let last = v.len().saturating_sub(1);
    let kept = (0..v.len())
        .step_by(step)
        .chain((last % step != 0).then_some(last));
    for i in kept {
        let py = h - m - (i as f64 + 1.0) / v.len() as f64 * (h - 2.0 * m);
        let _ = write!(pts, "{:.1},{py:.1} ", px(v[i]));
    }
    let svg = format!(
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{tx}" y="20" text-anchor="middle" font-size="14">rcm bench: connect latency CDF ({n} connections, p50 {p50}, p99 {p99})</text>
<line x1="{m}" y1="{yb}" x2="{xr}" y2="{yb}" stroke="black"/><line x1="{m}" y1="{m}" x2="{m}" y2="{yb}" stroke="black"/>
<text x="{tx}" y="{xl}" text-anchor="middle">latency (us), 0 .. {max:.0}</text>
<text x="15" y="{ty}" transform="rotate(-90 15 {ty})" text-anchor="middle">fraction of connections</text>
<text x="{m}" y="{yt}" text-anchor="end">0</text><text x="{xr}" y="{yt}" text-anchor="end">{max:.0}</text>
<text x="{ml}" y="{m}" text-anchor="end">1.0</text><text x="{ml}" y="{yb}" text-anchor="end">0</text>
<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{pts}"/>
</svg>
"##,
        tx = w / 2.0,
        n = v.len(),
        p50 = us(r.connect_p50_us),
        p99 = us(r.connect_p99_us),
        yb = h - m,
        xr = w - m,
        xl = h - 10.0,
        ty = h / 2.0,
        yt = h - m + 15.0,
        ml = m - 5.0,
    );
    out.write_all(svg.as_bytes())
}

#[cfg(test)]
mod tests {
    /// A connection's failure line says what its event carried, not only its name.
    #[test]
    fn a_failure_line_carries_the_events_error() {
        use rcm::{Error, Event};
        use std::net::IpAddr;
        let ip = IpAddr::from([127, 0, 0, 254]);
        let line = super::failure(&Event::AddrError(Error::AddrNotAvailable(ip)));
        assert!(
            line.starts_with("ADDR_ERROR: ") && line.contains("127.0.0.254"),
            "{line}"
        );
        let line = super::failure(&Event::Rejected {
            reason: rcm_wire::cm::RejReason::ConsumerDefined,
            private_data: Vec::new(),
        });
        assert!(
            line.starts_with("REJECTED (") && line.contains("Consumer"),
            "{line}"
        );
        assert_eq!(super::failure(&Event::DeviceRemoval), "DEVICE_REMOVAL");
    }

    /// The resident set is read from `VmRSS`, in kB; a status without it, or in another
    /// unit, gives nothing rather than a wrong number.
    #[test]
    fn rss_comes_from_vm_rss_in_kilobytes() {
        let status = "Name:\trcm\nVmPeak:\t  9000 kB\nVmRSS:\t    1234 kB\nThreads:\t3\n";
        assert_eq!(super::vm_rss_bytes(status), Some(1234 * 1024));
        assert_eq!(super::vm_rss_bytes("Name:\trcm\n"), None);
        assert_eq!(super::vm_rss_bytes("VmRSS:\t12 MB\n"), None);
        assert_eq!(super::vm_rss_bytes("VmRSS:\t\n"), None);
        // This process's own figure is there and plausible (more than a page).
        assert!(super::rss_bytes() > 4096);
    }

    /// A pinned thread runs on its one CPU, and where it ran before once the guard drops.
    #[test]
    fn a_pinned_thread_runs_on_one_cpu_and_goes_back_after() {
        let before = rustix::thread::sched_getaffinity(None).expect("affinity");
        let Some((a, b)) = super::two_cpus() else {
            eprintln!("one CPU here: nothing to pin apart");
            return;
        };
        assert_ne!(a, b);
        for cpu in [a, b] {
            let on = super::OnCpu::pin(Some(cpu));
            let now = rustix::thread::sched_getaffinity(None).expect("affinity");
            assert_eq!(now.count(), 1);
            assert!(now.is_set(cpu));
            drop(on);
            assert_eq!(
                rustix::thread::sched_getaffinity(None).expect("affinity"),
                before
            );
        }
        // No CPU asked: nothing changes.
        drop(super::OnCpu::pin(None));
        assert_eq!(
            rustix::thread::sched_getaffinity(None).expect("affinity"),
            before
        );
    }

    /// A burst deals the client devices out in turn; one at a time takes them in blocks
    /// of consecutive connections; either way no device gets more than its share (its
    /// ephemeral ports are what the spreading is for).
    #[test]
    fn client_devices_are_dealt_in_turn_in_a_burst_and_in_blocks_one_at_a_time() {
        let burst: Vec<usize> = (0..6).map(|c| client_device_of(c, 6, 3, false)).collect();
        assert_eq!(burst, [0, 1, 2, 0, 1, 2]);
        let serial: Vec<usize> = (0..6).map(|c| client_device_of(c, 6, 3, true)).collect();
        assert_eq!(serial, [0, 0, 1, 1, 2, 2]);
        for (n, d) in [(100_000, 4), (40_000, 2), (7, 3), (1, 1), (5, 8)] {
            for serial in [false, true] {
                let mut per = vec![0usize; d];
                for c in 0..n {
                    let k = client_device_of(c, n, d, serial);
                    assert!(k < d, "device {k} of {d}");
                    per[k] += 1;
                }
                let most = per.iter().copied().max().unwrap_or(0);
                assert!(
                    most <= n.div_ceil(d),
                    "{n} over {d} (serial {serial}): {per:?}"
                );
                if serial {
                    let blocks = (1..n)
                        .filter(|&c| {
                            client_device_of(c, n, d, true) != client_device_of(c - 1, n, d, true)
                        })
                        .count();
                    assert!(
                        blocks < d,
                        "{n} over {d}: the device changed {blocks} times"
                    );
                }
            }
        }
        assert_eq!(
            client_device_of(3, 10, 0, true),
            0,
            "no client devices: the one default"
        );
    }

    #[test]
    fn round_trip_windows_come_before_the_first_every_tenth_and_after_the_last() {
        let at =
            |n: usize| -> Vec<usize> { (0..=n).filter(|&k| RttWindows::before(k, n)).collect() };
        assert_eq!(
            at(3000),
            [0, 300, 600, 900, 1200, 1500, 1800, 2100, 2400, 2700, 3000]
        );
        // Fewer than ten connections: a window between every two of them.
        assert_eq!(at(3), [0, 1, 2, 3]);
        assert_eq!(at(1), [0, 1]);
        // Not a multiple of ten: tenths rounded up, the last one shorter.
        assert_eq!(at(25), [0, 3, 6, 9, 12, 15, 18, 21, 24, 25]);
    }

    #[test]
    fn percentiles_keep_fractions_of_a_microsecond() {
        let lat: Vec<f64> = (0..100).map(|k| 15.9 + f64::from(k) * 0.01).collect();
        let (p50, p99) = super::percentiles(&lat).expect("latencies");
        assert!((p50 - 16.39).abs() < 0.03, "p50 {p50}");
        assert!((p99 - 16.88).abs() < 0.03, "p99 {p99}");
        assert_eq!(super::percentiles(&[]), None);
    }

    #[test]
    fn a_run_past_the_open_file_limit_is_announced() {
        assert_eq!(super::too_few_fds(1000, Some(1064)), None);
        let w = super::too_few_fds(1001, Some(1064)).expect("a warning");
        assert!(
            w.contains("about 1065 open files")
                && w.contains("limit is 1064")
                && w.contains("MPA timeout"),
            "{w}"
        );
        assert_eq!(super::too_few_fds(usize::MAX / 2, None), None);
    }

    #[test]
    fn connections_past_the_ports_of_the_client_addresses_are_announced() {
        let one = [std::net::IpAddr::from([127, 0, 0, 2])];
        let two = [one[0], std::net::IpAddr::from([127, 0, 0, 3])];
        assert_eq!(super::too_few_ports(28_232, &one), None);
        let w = super::too_few_ports(35_000, &one).expect("a warning");
        assert!(w.contains("need 2 client addresses"), "{w}");
        assert!(w.contains("6768 of them will fail"), "{w}");
        assert_eq!(super::too_few_ports(35_000, &two), None);
        assert!(super::too_few_ports(60_000, &two).is_some());
    }

    use super::*;

    #[test]
    fn a_timing_counts_the_first_end_after_its_start_from_any_thread() {
        let t = Timing::new(3);
        t.end(0); // never started: not counted
        t.begin(1);
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(2));
                t.end(1);
            });
        });
        let first = t.durations().next().unwrap();
        std::thread::sleep(Duration::from_millis(2));
        t.end(1); // a second end changes nothing
        t.end(7); // out of range: ignored
        assert_eq!(t.done(), 1);
        assert_eq!(t.durations().next(), Some(first));
        assert!(first >= Duration::from_millis(2), "{first:?}");
    }

    /// A fabric without devices and `n` ids on it, for the issuing tests.
    fn fabric_with_ids(n: usize) -> (Fabric, Vec<CmId>) {
        let f = Fabric::new(FabricConfig::default());
        let ids = (0..n)
            .map(|_| f.create_id_on(PortSpace::Tcp, &EventChannel::new()))
            .collect();
        (f, ids)
    }

    #[test]
    fn issuing_and_waiting_run_concurrently_in_a_burst_and_in_turn_one_at_a_time() {
        let (f, ids) = fabric_with_ids(4);
        for serial in [false, true] {
            let issued = AtomicUsize::new(0);
            let seen_by_wait = AtomicUsize::new(usize::MAX);
            let how = Issue {
                serial,
                send_batch: true,
                issuers: 1,
            };
            let errs = issue_and_wait(
                how,
                &ids,
                |k, _| {
                    if serial {
                        issued.fetch_add(1, Ordering::SeqCst);
                    } else {
                        // The burst's waiter runs meanwhile: wait (boundedly, so that a
                        // sequential version fails instead of hanging) for it to start.
                        let end = Instant::now() + Duration::from_secs(5);
                        while seen_by_wait.load(Ordering::SeqCst) == usize::MAX
                            && Instant::now() < end
                        {
                            std::thread::yield_now();
                        }
                        issued.fetch_add(1, Ordering::SeqCst);
                    }
                    (k == 2).then(|| "third failed".to_string())
                },
                || seen_by_wait.store(issued.load(Ordering::SeqCst), Ordering::SeqCst),
            );
            assert_eq!(errs, vec!["third failed".to_string()]);
            assert_eq!(issued.load(Ordering::SeqCst), 4);
            let seen = seen_by_wait.load(Ordering::SeqCst);
            if serial {
                assert_eq!(seen, 4, "one at a time, the wait comes after every call");
            } else {
                assert_eq!(seen, 0, "in a burst, the wait starts before the calls");
            }
        }
        f.shutdown();
    }

    /// How `rcm bench --serial` issues (one issuer, its batch held around each wait).
    const ONE_AT_A_TIME: Issue = Issue {
        serial: true,
        send_batch: true,
        issuers: 1,
    };

    /// The next event of `ch`, waiting up to 5 s.
    fn next_event(ch: &EventChannel) -> Option<Event> {
        ch.get_event(Some(Duration::from_secs(5)))
            .and_then(|mut e| e.take())
    }

    /// Devices on 127.0.0.1 and 127.0.0.2 (UDP port `port`) and a listener on
    /// 127.0.0.1:7471 that accepts every request: the fabric, the client's device, the
    /// listener and its address.
    fn accepting_pair(port: u16) -> (Fabric, rcm::Device, CmId, SocketAddr) {
        let f = Fabric::new(FabricConfig {
            udp_port: port,
            ..FabricConfig::default()
        });
        let ip = |n: u8| IpAddr::from([127, 0, 0, n]);
        f.add_device(ip(1)).expect("device 1");
        let d2 = f.add_device(ip(2)).expect("device 2");
        let l = f.create_id(PortSpace::Tcp, |id, ev| {
            if let Event::ConnectRequest { .. } = ev {
                let _ = id.accept(&rcm::AcceptOptions::default());
            }
            rcm::Flow::Continue
        });
        let dst = SocketAddr::new(ip(1), 7471);
        l.bind(dst).expect("bind");
        l.listen(16).expect("listen");
        (f, d2, l, dst)
    }

    /// One at a time, a call's datagram leaves within the call (nothing could join it), while
    /// what the wait's event handling makes (the RTU a soft QP's REP brings, here made by the
    /// waiter's own poll) is held until the wait has taken its event: it is not part of the
    /// connect latency the bench reports.
    #[test]
    fn one_at_a_time_the_request_leaves_within_its_call_and_the_rtu_after_the_wait() {
        use std::sync::atomic::AtomicU64;
        let (f, d2, _l, dst) = accepting_pair(28440);
        let ip = |n: u8| IpAddr::from([127, 0, 0, n]);
        let ch = EventChannel::new();
        ch.set_spin(Duration::from_secs(2));
        let next = || next_event(&ch);
        let how = ONE_AT_A_TIME;
        // The REP's event can be routed by the device's own thread a little after the
        // waiter's poll (its timers): the waiter then waits on, sending what it holds first.
        // And the device's thread may take the REP, and send the RTU, before the caller
        // counts what left in its call (preempted after it: once in a CI run on 2 CPUs).
        // Up to twenty connections; one must show the RTU held.
        let mut held = false;
        for _ in 0..20 {
            let id = f.create_id_on(PortSpace::Tcp, &ch);
            id.resolve_addr(Some(ip(2)), dst).expect("resolve");
            assert!(matches!(next(), Some(Event::AddrResolved)));
            id.resolve_route().expect("route");
            assert!(matches!(next(), Some(Event::RouteResolved)));
            id.create_qp().expect("a soft QP");
            let tx0 = d2.traffic().1;
            let (in_call, at_event) = (AtomicU64::new(0), AtomicU64::new(0));
            let errs = issue_and_wait(
                how,
                std::slice::from_ref(&id),
                |_, id| {
                    let r = id.connect(&rcm::ConnectOptions::default());
                    in_call.store(d2.traffic().1 - tx0, Ordering::SeqCst);
                    r.err().map(|e| e.to_string())
                },
                || {
                    let ev = next();
                    assert!(matches!(ev, Some(Event::Established { .. })), "{ev:?}");
                    at_event.store(d2.traffic().1 - tx0, Ordering::SeqCst);
                },
            );
            assert!(errs.is_empty(), "{errs:?}");
            let in_call = in_call.load(Ordering::SeqCst);
            assert!(in_call >= 1, "the REQ left within connect");
            // Once the wait is over, the RTU has left.
            assert_eq!(d2.traffic().1 - tx0, 2, "the REQ and the RTU");
            if in_call == 1 && at_event.load(Ordering::SeqCst) == 1 {
                held = true;
                break;
            }
        }
        assert!(
            held,
            "in twenty connections the RTU never waited for the event"
        );
        f.shutdown();
    }

    /// One at a time with a mimicked QP (no soft QP: the connect ends with
    /// CONNECT_RESPONSE, and `establish` sends the RTU), the batch `run_client` opens
    /// around the connect step and the establish step holds the RTU that `establish`
    /// makes in the connect step's wait until the establish step has taken ESTABLISHED:
    /// the inner batch of `issue_and_wait` does not send it when its wait ends, and the
    /// RTU leaves when the outer one drops.
    #[test]
    fn one_at_a_time_the_rtu_of_establish_waits_for_its_established_event() {
        use std::sync::atomic::AtomicU64;
        let (f, d2, _l, dst) = accepting_pair(28441);
        let ip = |n: u8| IpAddr::from([127, 0, 0, n]);
        let ch = EventChannel::new();
        let next = || next_event(&ch);
        let how = ONE_AT_A_TIME;
        let id = f.create_id_on(PortSpace::Tcp, &ch);
        id.resolve_addr(Some(ip(2)), dst).expect("resolve");
        assert!(matches!(next(), Some(Event::AddrResolved)));
        id.resolve_route().expect("route");
        assert!(matches!(next(), Some(Event::RouteResolved)));
        let tx0 = d2.traffic().1;
        let sent = || d2.traffic().1 - tx0;
        let at_response = AtomicU64::new(u64::MAX);
        let rtu_held = rcm::SendBatch::begin();
        let errs = issue_and_wait(
            how,
            std::slice::from_ref(&id),
            |_, id| {
                id.connect(&rcm::ConnectOptions::default())
                    .err()
                    .map(|e| e.to_string())
            },
            || {
                let ev = next();
                assert!(matches!(ev, Some(Event::ConnectResponse { .. })), "{ev:?}");
                id.establish().expect("establish");
                at_response.store(sent(), Ordering::SeqCst);
            },
        );
        assert!(errs.is_empty(), "{errs:?}");
        assert_eq!(
            at_response.load(Ordering::SeqCst),
            1,
            "the REQ alone had left"
        );
        assert_eq!(sent(), 1, "the RTU left when the connect step's wait ended");
        // ESTABLISHED may be routed by another thread (the device's, routing events of its
        // own then): waiting for it would send the held RTU first, as every wait in rcm
        // does, so this waits for it to be queued without a wait of the channel's.
        let until = std::time::Instant::now() + Duration::from_secs(5);
        while ch.pending() == 0 && std::time::Instant::now() < until {
            std::thread::yield_now();
        }
        assert!(matches!(next(), Some(Event::Established { .. })));
        assert_eq!(sent(), 1, "the RTU left before ESTABLISHED was taken");
        drop(rtu_held);
        assert_eq!(sent(), 2, "the RTU left with the batch");
        f.shutdown();
    }

    /// With several issuers each connection is called once, thread `t` of `n` taking
    /// connections `t`, `t + n`, ..., and every thread's errors come back.
    #[test]
    fn issuers_share_a_burst_each_connection_called_once() {
        let (f, ids) = fabric_with_ids(10);
        let by = std::sync::Mutex::new(Vec::new());
        let how = Issue {
            serial: false,
            send_batch: true,
            issuers: 3,
        };
        let mut errs = issue_and_wait(
            how,
            &ids,
            |k, _| {
                by.lock().unwrap().push((k, std::thread::current().id()));
                (k == 2 || k == 7).then(|| format!("{k} failed"))
            },
            || {},
        );
        errs.sort();
        assert_eq!(errs, vec!["2 failed".to_string(), "7 failed".to_string()]);
        let mut by = by.into_inner().unwrap();
        by.sort_by_key(|(k, _)| *k);
        assert_eq!(
            by.iter().map(|(k, _)| *k).collect::<Vec<_>>(),
            (0..10).collect::<Vec<_>>()
        );
        for (k, t) in &by {
            assert_eq!(*t, by[k % 3].1, "connection {k} on its thread");
        }
        assert_ne!(by[0].1, by[1].1);
        assert_ne!(by[1].1, by[2].1);
        assert_ne!(by[0].1, by[2].1);
        // One at a time there is one issuer, whatever was asked.
        let one = Issue {
            serial: true,
            send_batch: true,
            issuers: 3,
        };
        let here = std::thread::current().id();
        let others = AtomicUsize::new(0);
        issue_and_wait(
            one,
            &ids,
            |_, _| {
                if std::thread::current().id() != here {
                    others.fetch_add(1, Ordering::SeqCst);
                }
                None
            },
            || {},
        );
        assert_eq!(others.load(Ordering::SeqCst), 0);
        f.shutdown();
    }

    /// A bench run's options for a unit test: `n` connections in a burst on UDP `udp_port`.
    fn burst_opts(n: usize, udp_port: u16) -> BenchOpts {
        BenchOpts {
            connections: n,
            serial: false,
            listen: false,
            serve: None,
            json: false,
            server: None,
            bind: Vec::new(),
            port: 7471,
            udp_port,
            threads: 1,
            baseline_tcp: false,
            progress: false,
            step_timeout: Duration::from_secs(5),
            daemon: None,
            iwarp: false,
            spin: Duration::ZERO,
            send_batch: false,
            pin: false,
            attached_qp: false,
            warmup: 0,
            issuers: 1,
            breakdown: false,
        }
    }

    /// A connection whose bind fails is an error of the run, as a failure in any other
    /// step is (the failures listed it while `errors` said 0), and is not made after it.
    #[test]
    fn a_failed_bind_counts_as_an_error() {
        let (f, _d2, _l, dst) = accepting_pair(41105);
        // No device has 127.0.0.77: the binds of connections 1 and 3 fail.
        let srcs = [IpAddr::from([127, 0, 0, 2]), IpAddr::from([127, 0, 0, 77])];
        let r = run_client(&f, &srcs, dst, &burst_opts(4, 41105), None);
        f.shutdown();
        let binds = r.failures.iter().filter(|l| l.starts_with("bind addr #"));
        assert_eq!(binds.count(), 2, "{:?}", r.failures);
        assert_eq!(r.failures.len(), 2, "{:?}", r.failures);
        assert_eq!(r.established, 2, "{:?}", r.failures);
        assert_eq!(r.errors, 2, "{:?}", r.failures);
    }

    /// A baseline whose connects fail returns the error with its server's thread ended and
    /// its listener closed (the thread stayed blocked in accept, the port open).
    #[test]
    fn a_tcp_baseline_whose_connects_fail_ends_its_server() {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("listener");
        let at = listener.local_addr().expect("address");
        // A port nobody listens on: every connect is refused.
        let closed = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .and_then(|l| l.local_addr())
            .expect("a free port");
        let e = baseline_over(10, listener, closed).expect_err("connects to a closed port");
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused, "{e}");
        let e = TcpStream::connect(at).expect_err("the listener is closed");
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused, "{e}");
        // And one that works serves every connection.
        assert!(tcp_baseline(20).expect("baseline") > 0.0);
    }
}
