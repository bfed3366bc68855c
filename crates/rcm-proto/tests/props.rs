//! Property runs of the IB CM engine ([`rcm_proto::ib::Endpoint`]) in the deterministic network
//! simulator ([`rcm_proto::sim::Sim`]).
//!
//! Every seed builds a network of 2–4 nodes (198.18.0.1 …) with a random [`NetConfig`] (loss
//! 0–30 %, duplication 0–10 %, reordering 0–20 % held back up to 300 ms, latency 10 µs–5 ms,
//! jitter), a random retry policy (Backoff with small values, or Classic), random path timing,
//! backlog, endpoint cap and per-seed behaviour weights, and drives a random workload: connects
//! (some to a service nobody listens on), lazy and eager MRAs, accepts that come at once or late
//! (after the active side gave up), user rejects with ARI and private data (from REQ_RCVD,
//! REP_SENT, REP_RCVD and REQ_SENT), RTUs, disconnects (including crossing DREQs and late DREP
//! replies), destroys at random moments (mid-handshake, established, in DREQ_RCVD, in timewait,
//! listeners with pending requests), listener churn, SIDR exchanges, QPN reuse (in some seeds:
//! stale-connection paths), link partitions and node crashes with restart. Every
//! REQ/REP/REJ/DREQ/SIDR private-data area carries a token naming the driver's record of the
//! sender, which is how the two ends of a connection are paired.
//!
//! Properties asserted for every seed (a violation fails the test and names the seed; rerun one
//! seed with `RCM_SIM_SEED=<n> RCM_SIM_VERBOSE=1 cargo test -p rcm-proto --test props one_seed
//! -- --nocapture` to print its whole script and every MAD on the wire):
//!
//! * **P1 event grammar** — every event a handle gets is legal in the phase its previous events
//!   and its user's commands put it in (e.g. `RepReceived` only while connecting, `Established`
//!   on the active side only right after `establish`, `TimewaitExit` only in timewait), after
//!   every simulation step the engine's `state(h)` is the state those events imply, and every
//!   command the phase allows succeeds.
//! * **P2 exactly one terminal outcome** — once the network is quiet, every connect handle not
//!   destroyed by its user has exactly one setup outcome: `Established` (REP → `establish` →
//!   `Established`), `Rejected{reason}`, `TimedOut(Req)`, or its own user's reject; every
//!   passive child: `Established`, `Rejected`, `TimedOut(Rep)`, its user's reject, or a
//!   `DreqReceived` while still in REP_SENT (the peer established, its RTU was lost and it
//!   disconnected: IBTA REP_SENT →DREQ→ DREQ_RCVD); every SIDR request: `SidrRepReceived` or
//!   `TimedOut(SidrReq)`. A second setup outcome is a violation; after `Established` only
//!   teardown events may follow (DREQ/DREP/`TimedOut(Dreq)`, a REJ — see P4d — and
//!   `TimewaitExit`), and every handle that entered timewait leaves it exactly once.
//!   **P2b**: a REQ (retry or duplicate) never creates a second child while an earlier child of
//!   the same connect on that node still remembers it: neither Idle nor in timewait (a
//!   child entering timewait forgets the peer's comm ID and QPN, as Linux's
//!   `cm_enter_timewait` does, and a destroyed one is in timewait or gone).
//! * **P3 silence after destroy** — no event is ever reported for a destroyed handle (nor a
//!   `ReqReceived` for a destroyed listener); `state`/`local_comm_id` answer `None` and a second
//!   `destroy` answers `UnknownHandle`.
//! * **P4 agreement** (A = active handle, P = the passive child created by A's REQ):
//!   * a. P reports `Established` ⇒ A called `establish` after a REP from this very P, and the
//!     QPNs match crosswise (A's REP said P's QPN, P's REQ said A's QPN). Hence at most one
//!     child of a connect is ever established, and never one of a connect that was rejected,
//!     timed out or destroyed before its RTU.
//!   * b. A established with P ⇒ P never reports a peer REJ; P's outcome, if any, is
//!     `Established`, `TimedOut(Rep)` (all RTUs lost — IBTA allows this half-open end), a
//!     `DreqReceived` in REP_SENT, or its own user's reject in REP_SENT.
//!   * c. A REJ with a user token reaches only the rejecter's peer and carries the reason, ARI
//!     and private data that user passed; a REJ without one has an engine reason (Timeout with
//!     the peer's CA GUID as ARI, ConsumerDefined, StaleConn, or InvalidServiceId to a
//!     connect). Same for SIDR replies (status/QPN/Q_Key as replied, or
//!     UnsupportedServiceId/Rejected from the engine).
//!   * d. A REJ after `Established` comes only from a peer that never reported `Established`
//!     and was rejected or destroyed by its user while in REP_SENT.
//!   * e. A user DREQ (token) is received only by the sender's peer; `DrepReceived` only on a
//!     handle that sent a DREQ, and only when the peer got that DREQ, or itself left the
//!     connection (timewait), or was destroyed/crashed.
//!   * f. On the wire: every REP carries (its sender's comm ID, its requester's comm ID, the
//!     QPN the user accepted with); every RTU names the comm IDs of an active handle and the
//!     very child whose REP it established; every DREQ names its peer's comm ID and QPN.
//!
//!   No exception: the engine remembers a REP it rejected as stale (its QPN collided with one
//!   still held) and drops later copies of it, so a retransmitted stale REP can no longer
//!   half-open a connection whose passive side the REJ already sent to timewait (Linux's
//!   `cm_rep_handler` would accept that copy). Seeds 980, 2631, 3326 and 5401 reproduced the
//!   race before the fix. `RCM_SIM_LENIENT_STALE=1` restores the old exemption.
//! * **P5 no leaks** — when the workload is quiet: `cep_count()` = live (not destroyed) handles,
//!   local-ID entries = live non-SIDR-passive handles, remote-ID and remote-QP entries = live
//!   established handles, no SIDR entries, no timers. On a then lossless network, a probe
//!   connect to every node is answered (listener backlogs hold no leaked slots), or rejected
//!   with InvalidServiceId when its listener is gone, or dropped only at `max_ceps`; a connect
//!   fails with `NoResources` only at `max_ceps`. After disconnecting everything and running
//!   past timewait: all handles Idle, no remote entries. After destroying every handle and
//!   listener: all counts 0 and `poll_timeout()` is `None`.
//! * **P6 liveness and determinism** — every phase goes quiet within a bound of virtual time,
//!   and a seed replays identically.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rcm_proto::ib::{
    cm_ack_timeout, ibta_time_ms, AcceptParams, CepHandle, CmError, CmEvent, ConnectParams,
    EndpointConfig, RetryPolicy, SidrParams, SidrReplyParams, State, TimedOut,
};
use rcm_proto::sim::{NetConfig, Sim};
use rcm_wire::cm::{CmMad, CmMessage, RejReason, SidrStatus};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

type Res<T = ()> = Result<T, String>;

macro_rules! ensure {
    ($cond:expr, $($arg:tt)+) => {
        if !$cond {
            return Err(format!($($arg)+));
        }
    };
}

/// The service everybody listens on (RDMA_PS_TCP port 0x4e20).
const SVC: u64 = 0x0000_0000_0106_4e20;
/// A masked listener covers every port of the TCP port space.
const SVC_MASK: u64 = 0xFFFF_FFFF_FFFF_0000;
/// Nobody listens here (RDMA_PS_UDP).
const SVC_NONE: u64 = 0x0000_0000_0111_0007;

const TOK_REQ: [u8; 4] = *b"tREQ";
const TOK_REP: [u8; 4] = *b"tREP";
const TOK_REJ: [u8; 4] = *b"tREJ";
const TOK_DREQ: [u8; 4] = *b"tDRQ";
const TOK_SIDR: [u8; 4] = *b"tSRQ";
const TOK_SIDR_REP: [u8; 4] = *b"tSRP";

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

fn addr(n: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(198, 18, 0, n as u8 + 1))
}

fn node_of(a: IpAddr) -> usize {
    match a {
        IpAddr::V4(v) => usize::from(v.octets()[3]) - 1,
        IpAddr::V6(_) => usize::MAX,
    }
}

fn guid(n: usize) -> u64 {
    0x0002_c903_00ab_0000 + n as u64
}

fn token(magic: [u8; 4], id: usize, extra: usize) -> Vec<u8> {
    let mut v = magic.to_vec();
    v.extend_from_slice(&(id as u64).to_be_bytes());
    // Some filler so private data of several lengths crosses the wire.
    v.extend((0..extra).map(|i| (i as u8).wrapping_mul(37) | 1));
    v
}

fn parse_token(pd: &[u8]) -> Option<([u8; 4], usize)> {
    let magic: [u8; 4] = pd.get(..4)?.try_into().ok()?;
    if magic[0] != b't' {
        return None;
    }
    let id = u64::from_be_bytes(pd.get(4..12)?.try_into().ok()?);
    Some((magic, usize::try_from(id).ok()?))
}

/// What the user of a handle can know from its events and commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Phase {
    Listening,
    Connecting,
    GotRep,
    Requested,
    Accepted,
    Up,
    DreqSent,
    DreqRcvd,
    Timewait,
    Idle,
    SidrSent,
    SidrRcvd,
}

impl Phase {
    fn states(self) -> &'static [State] {
        match self {
            Phase::Listening => &[State::Listen],
            Phase::Connecting => &[State::ReqSent, State::MraReqRcvd],
            Phase::GotRep => &[State::RepRcvd, State::MraRepSent],
            Phase::Requested => &[State::ReqRcvd, State::MraReqSent],
            Phase::Accepted => &[State::RepSent, State::MraRepRcvd],
            Phase::Up => &[State::Established],
            Phase::DreqSent => &[State::DreqSent],
            Phase::DreqRcvd => &[State::DreqRcvd],
            Phase::Timewait => &[State::Timewait],
            Phase::Idle => &[State::Idle],
            Phase::SidrSent => &[State::SidrReqSent],
            Phase::SidrRcvd => &[State::SidrReqRcvd],
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Listener,
    Active,
    Passive,
    SidrActive,
    SidrPassive,
}

/// How the connection setup ended for one handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Established,
    Rejected(RejReason),
    TimedOutReq,
    TimedOutRep,
    UserRejected,
    DreqBeforeRtu,
    SidrRep,
    SidrTimedOut,
    SidrReplied,
}

/// The driver's record of one handle.
#[derive(Debug, Clone)]
struct Conn {
    node: usize,
    gen: u16,
    h: CepHandle,
    role: Role,
    phase: Phase,
    comm_id: u32,
    /// Our QPN (active: connect; passive: accept).
    qpn: u32,
    /// The peer's QPN as the REQ/REP told us.
    peer_qpn: Option<u32>,
    /// Active: the child whose REP we got; passive: the connect whose REQ created us.
    partner: Option<usize>,
    outcome: Option<Outcome>,
    established: bool,
    establish_called: bool,
    /// Connected with `establish_on_rep`: the engine answers the REP itself.
    establish_on_rep: bool,
    mra_called: bool,
    destroyed: bool,
    destroyed_in: Option<Phase>,
    lost: bool,
    user_rej: Option<(RejReason, Vec<u8>, Phase)>,
    disconnect_called: bool,
    stale_teardown: bool,
    saw_dreq: bool,
    entered_timewait: bool,
    timewait_exits: u32,
    teardown_rej: Option<RejReason>,
    /// When the engine's timewait for it ends (its local comm ID stays reserved until then).
    tw_end: Option<Instant>,
    children: u32,
    qpn_released: bool,
    sidr_reply: Option<(SidrStatus, u32, u32)>,
    /// What happened to it, for the failure report: (virtual µs, what).
    hist: Vec<(u64, String)>,
}

impl Conn {
    fn new(node: usize, gen: u16, h: CepHandle, role: Role, phase: Phase) -> Self {
        Conn {
            node,
            gen,
            h,
            role,
            phase,
            comm_id: 0,
            qpn: 0,
            peer_qpn: None,
            partner: None,
            outcome: None,
            established: false,
            establish_called: false,
            establish_on_rep: false,
            mra_called: false,
            destroyed: false,
            destroyed_in: None,
            lost: false,
            user_rej: None,
            disconnect_called: false,
            stale_teardown: false,
            saw_dreq: false,
            entered_timewait: false,
            timewait_exits: 0,
            teardown_rej: None,
            tw_end: None,
            children: 0,
            qpn_released: false,
            sidr_reply: None,
            hist: Vec::new(),
        }
    }

    fn live(&self) -> bool {
        !self.destroyed && !self.lost
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Action {
    Connect { from: usize, to: usize, svc: u64 },
    Sidr { from: usize, to: usize, svc: u64 },
    Accept(usize),
    Reject(usize),
    Mra(usize, u8, bool),
    Establish(usize),
    Disconnect(usize),
    Destroy(usize),
    SidrReply(usize),
    DestroyRandom,
    Listen(usize),
    DestroyListener(usize),
    Crash(usize),
    Restart(usize),
    Cut(usize, usize, bool),
}

/// Per-seed knobs: network, timing policy and behaviour weights.
#[derive(Debug, Clone)]
struct Opts {
    nodes: usize,
    net: NetConfig,
    retry: RetryPolicy,
    min_timewait: Duration,
    plt: u8,
    cm_response_timeout: u8,
    max_cm_retries: u8,
    backlog: usize,
    max_ceps: usize,
    masked_listen: bool,
    connects: usize,
    sidrs: usize,
    span: u64,
    p_accept: f64,
    p_reject: f64,
    p_destroy_req: f64,
    p_mra_req: f64,
    p_establish: f64,
    p_reject_rep: f64,
    p_destroy_rep: f64,
    p_disc: f64,
    p_destroy_up: f64,
    p_destroy_connecting: f64,
    p_cancel_reject: f64,
    p_reject_after_accept: f64,
    p_dreq_delay: f64,
    p_dreq_destroy: f64,
    p_tw_destroy: f64,
    p_unlistened: f64,
    random_destroys: usize,
    listener_churn: bool,
    qpn_reuse: bool,
    crash: bool,
    partitions: usize,
}

impl Opts {
    fn random(rng: &mut StdRng) -> Self {
        let net = NetConfig {
            latency: Duration::from_micros(rng.gen_range(10..=5000)),
            jitter: Duration::from_micros(if rng.gen_bool(0.7) {
                rng.gen_range(0..=3000)
            } else {
                0
            }),
            loss: if rng.gen_bool(0.1) {
                0.0
            } else {
                rng.gen_range(0.0..=0.3)
            },
            duplicate: if rng.gen_bool(0.3) {
                0.0
            } else {
                rng.gen_range(0.0..=0.1)
            },
            reorder: if rng.gen_bool(0.3) {
                0.0
            } else {
                rng.gen_range(0.0..=0.2)
            },
            reorder_delay: ms(rng.gen_range(0..=300)),
        };
        let retry = if rng.gen_bool(0.1) {
            RetryPolicy::Classic
        } else {
            let initial = ms(rng.gen_range(5..=200));
            RetryPolicy::Backoff {
                initial,
                max_wait: initial * rng.gen_range(1..=8),
                deadline: ms(rng.gen_range(300..=4000)),
            }
        };
        let w = |rng: &mut StdRng, lo: f64, hi: f64| rng.gen_range(lo..=hi);
        Opts {
            nodes: rng.gen_range(2..=4),
            net,
            retry,
            min_timewait: if rng.gen_bool(0.5) {
                Duration::ZERO
            } else {
                ms(rng.gen_range(0..=200))
            },
            plt: rng.gen_range(12..=16),
            cm_response_timeout: rng.gen_range(12..=20),
            max_cm_retries: rng.gen_range(1..=15),
            backlog: if rng.gen_bool(0.2) {
                rng.gen_range(1..=3)
            } else {
                0
            },
            max_ceps: if rng.gen_bool(0.15) {
                rng.gen_range(4..=24)
            } else {
                1 << 20
            },
            masked_listen: rng.gen_bool(0.3),
            connects: rng.gen_range(1..=60),
            sidrs: if rng.gen_bool(0.3) {
                rng.gen_range(1..=4)
            } else {
                0
            },
            span: rng.gen_range(50..=5000),
            p_accept: w(rng, 0.3, 0.9),
            p_reject: w(rng, 0.0, 0.3),
            p_destroy_req: w(rng, 0.0, 0.2),
            p_mra_req: w(rng, 0.0, 0.4),
            p_establish: w(rng, 0.5, 1.0),
            p_reject_rep: w(rng, 0.0, 0.2),
            p_destroy_rep: w(rng, 0.0, 0.2),
            p_disc: w(rng, 0.0, 0.9),
            p_destroy_up: w(rng, 0.0, 0.3),
            p_destroy_connecting: w(rng, 0.0, 0.2),
            p_cancel_reject: w(rng, 0.0, 0.1),
            p_reject_after_accept: w(rng, 0.0, 0.1),
            p_dreq_delay: w(rng, 0.0, 0.5),
            p_dreq_destroy: w(rng, 0.0, 0.2),
            p_tw_destroy: w(rng, 0.0, 0.3),
            p_unlistened: w(rng, 0.0, 0.1),
            random_destroys: if rng.gen_bool(0.5) {
                rng.gen_range(0..=8)
            } else {
                0
            },
            listener_churn: rng.gen_bool(0.2),
            qpn_reuse: rng.gen_bool(0.2),
            crash: rng.gen_bool(0.1),
            partitions: if rng.gen_bool(0.2) {
                rng.gen_range(1..=3)
            } else {
                0
            },
        }
    }
}

/// Aggregates over seeds, to show what the workloads exercised.
#[derive(Debug, Default, Clone)]
struct Counters {
    seeds: u64,
    connects: u64,
    established_pairs: u64,
    half_open: u64,
    active_established: u64,
    active_rejected: u64,
    active_timed_out: u64,
    active_user_rejected: u64,
    passive_children: u64,
    ghost_children: u64,
    passive_rejected: u64,
    passive_timed_out: u64,
    passive_user_rejected: u64,
    dreq_before_rtu: u64,
    teardown_rejects: u64,
    stale_teardown_rejects: u64,
    dreq_timeouts: u64,
    destroys: u64,
    destroys_mid_handshake: u64,
    destroys_established: u64,
    destroys_timewait: u64,
    destroys_listener: u64,
    sidr: u64,
    crashes: u64,
    mra_received: u64,
    crossing_dreqs: u64,
    listener_destroyed_with_pending: u64,
    backlog_drops: u64,
    duplicates: u64,
    no_listener_rejects: u64,
    no_resources: u64,
    probes: u64,
    stale_rejects: u64,
    retransmits: u64,
    delivered: u64,
    dropped: u64,
    virtual_ms: u64,
    max_virtual_ms: u64,
}

impl Counters {
    fn add(&mut self, o: &Counters) {
        macro_rules! sum {
            ($($f:ident),*) => { $( self.$f += o.$f; )* };
        }
        sum!(
            seeds,
            connects,
            established_pairs,
            half_open,
            active_established,
            active_rejected,
            active_timed_out,
            active_user_rejected,
            passive_children,
            ghost_children,
            passive_rejected,
            passive_timed_out,
            passive_user_rejected,
            dreq_before_rtu,
            teardown_rejects,
            stale_teardown_rejects,
            dreq_timeouts,
            destroys,
            destroys_mid_handshake,
            destroys_established,
            destroys_timewait,
            destroys_listener,
            sidr,
            crashes,
            mra_received,
            crossing_dreqs,
            listener_destroyed_with_pending,
            backlog_drops,
            duplicates,
            no_listener_rejects,
            no_resources,
            probes,
            stale_rejects,
            retransmits,
            delivered,
            dropped,
            virtual_ms
        );
        self.max_virtual_ms = self.max_virtual_ms.max(o.max_virtual_ms);
    }
}

/// What a probe connect after the workload must end with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ProbeExpect {
    /// The listener got it and its user rejected it.
    UserReject,
    /// Nobody listens: REJ(InvalidServiceId).
    NoListener,
    /// The target is at `max_ceps`: the REQ is dropped and the connect times out.
    Dropped,
}

struct NodeState {
    gen: u16,
    up: bool,
    listener: Option<usize>,
    free_qpns: Vec<u32>,
}

struct World {
    seed: u64,
    o: Opts,
    sim: Sim,
    rng: StdRng,
    start: Instant,
    nodes: Vec<NodeState>,
    conns: Vec<Conn>,
    index: HashMap<(usize, u16, CepHandle), usize>,
    agenda: BinaryHeap<Reverse<(Instant, u64, Action)>>,
    seq: u64,
    next_qpn: u32,
    touched: Vec<usize>,
    teardown: bool,
    /// Probe connects after the workload: answered by a plain reject.
    probing: bool,
    probes: Vec<(usize, ProbeExpect)>,
    verbose: bool,
    c: Counters,
    /// Every command and event, for the determinism check.
    digest: u64,
}

fn mix(h: u64, v: u64) -> u64 {
    (h ^ v).wrapping_mul(0x0100_0000_01b3).rotate_left(17)
}

/// Virtual bound per run phase; generous (the slowest exchange, Classic with 15 retries and an
/// MRA, takes about two minutes).
const PHASE_BOUND: Duration = Duration::from_secs(3600);

impl World {
    fn new(seed: u64, verbose: bool) -> Self {
        let mut rng = StdRng::seed_from_u64(seed ^ 0x5EED_5EED_5EED_5EED);
        let o = Opts::random(&mut rng);
        let mut sim = Sim::new(seed, o.net);
        sim.trace = Some(Vec::new());
        let mut nodes = Vec::new();
        for n in 0..o.nodes {
            let mut cfg = EndpointConfig::new(
                addr(n),
                guid(n),
                seed.wrapping_mul(16).wrapping_add(n as u64),
            );
            cfg.retry = o.retry;
            cfg.min_timewait = o.min_timewait;
            cfg.max_ceps = o.max_ceps;
            sim.add_node(cfg);
            nodes.push(NodeState {
                gen: 0,
                up: true,
                listener: None,
                free_qpns: Vec::new(),
            });
        }
        let start = sim.now();
        let next_qpn = rng.gen_range(0x100..0x80_0000);
        World {
            seed,
            o,
            sim,
            rng,
            start,
            nodes,
            conns: Vec::new(),
            index: HashMap::new(),
            agenda: BinaryHeap::new(),
            seq: 0,
            next_qpn,
            touched: Vec::new(),
            teardown: false,
            probing: false,
            probes: Vec::new(),
            verbose,
            c: Counters::default(),
            digest: 0,
        }
    }

    fn us(&self) -> u64 {
        (self.sim.now() - self.start).as_micros() as u64
    }

    fn note(&mut self, i: usize, what: String) {
        let t = self.us();
        self.digest = mix(self.digest, t ^ (i as u64) << 40 ^ what.len() as u64);
        if self.verbose {
            let c = &self.conns[i];
            println!(
                "{:>12.3} ms  n{}.{}#{} [{i}] {what}",
                Duration::from_micros(t).as_secs_f64() * 1000.0,
                c.node,
                c.gen,
                c.h.0
            );
        }
        self.conns[i].hist.push((t, what));
    }

    fn describe(&self, i: usize) -> String {
        let c = &self.conns[i];
        let mut s = format!(
            "[{i}] n{}.{}#{} {:?} phase {:?} comm {:#x} qpn {:#x} partner {:?} outcome {:?}{}",
            c.node,
            c.gen,
            c.h.0,
            c.role,
            c.phase,
            c.comm_id,
            c.qpn,
            c.partner,
            c.outcome,
            if c.destroyed { " (destroyed)" } else { "" }
        );
        for (t, w) in &c.hist {
            let _ = write!(
                s,
                "\n      {:>10.3} ms {w}",
                Duration::from_micros(*t).as_secs_f64() * 1000.0
            );
        }
        s
    }

    fn schedule(&mut self, after: Duration, a: Action) {
        self.seq += 1;
        let at = self.sim.now() + after;
        self.agenda.push(Reverse((at, self.seq, a)));
    }

    /// 0 half the time, else up to `max_ms`.
    fn delay(&mut self, max_ms: u64) -> Duration {
        if self.rng.gen_bool(0.5) {
            Duration::ZERO
        } else {
            Duration::from_micros(self.rng.gen_range(0..=max_ms * 1000))
        }
    }

    fn alloc_qpn(&mut self, n: usize) -> u32 {
        if self.o.qpn_reuse
            && !self.probing
            && !self.nodes[n].free_qpns.is_empty()
            && self.rng.gen_bool(0.7)
        {
            let k = self.rng.gen_range(0..self.nodes[n].free_qpns.len());
            return self.nodes[n].free_qpns.swap_remove(k);
        }
        self.next_qpn = (self.next_qpn + 1) & 0xFF_FFFF;
        self.next_qpn
    }

    /// The user is done with the handle's QP: in QPN-reuse seeds a later connect or accept on
    /// the node may take it (while the peer may still hold it in timewait: a stale connection).
    fn release_qpn(&mut self, i: usize) {
        let c = &self.conns[i];
        if c.qpn != 0 && !c.qpn_released && matches!(c.role, Role::Active | Role::Passive) {
            let (n, q) = (c.node, c.qpn);
            self.nodes[n].free_qpns.push(q);
            self.conns[i].qpn_released = true;
        }
    }

    fn key_of(&self, n: usize, h: CepHandle) -> Option<usize> {
        self.index.get(&(n, self.nodes[n].gen, h)).copied()
    }

    fn add_conn(&mut self, c: Conn) -> usize {
        let i = self.conns.len();
        self.index.insert((c.node, c.gen, c.h), i);
        self.conns.push(c);
        i
    }

    fn fail(&self, i: usize, msg: &str) -> String {
        let mut s = format!("{msg}\n  {}", self.describe(i));
        if let Some(p) = self.conns[i].partner {
            if p < self.conns.len() {
                let _ = write!(s, "\n  partner {}", self.describe(p));
            }
        }
        s
    }

    // ----- the run loop ------------------------------------------------------------------

    /// Runs until the agenda is empty and the network quiet (or the bound). Returns whether it
    /// went quiet.
    fn run(&mut self, max: Duration) -> Res<bool> {
        let hard = self.sim.now() + max;
        loop {
            let limit = self
                .agenda
                .peek()
                .map_or(hard, |Reverse((t, _, _))| (*t).min(hard));
            if self.sim.step(limit) {
                self.after_step()?;
                continue;
            }
            let Some(&Reverse((t, _, _))) = self.agenda.peek() else {
                break;
            };
            if t > hard {
                break;
            }
            let now = self.sim.now();
            if t > now {
                self.sim.run_for(t - now);
            }
            while let Some(&Reverse((t2, _, a))) = self.agenda.peek() {
                if t2 > self.sim.now() {
                    break;
                }
                self.agenda.pop();
                self.exec(a)?;
            }
        }
        Ok(self.agenda.is_empty() && self.sim.next_deadline().is_none())
    }

    fn after_step(&mut self) -> Res {
        if self.o.qpn_reuse {
            // A REQ or REP reusing a QPN we still hold tears the old connection down without an
            // event (IBTA 12.9.8.3.3: the CM sends a DREQ on it).
            for i in 0..self.conns.len() {
                let c = &self.conns[i];
                if c.live() && c.phase == Phase::Up {
                    let (n, h) = (c.node, c.h);
                    if self.sim.ep(n).state(h) == Some(State::DreqSent) {
                        self.conns[i].phase = Phase::DreqSent;
                        self.conns[i].stale_teardown = true;
                        self.note(i, "stale QPN: engine sent a DREQ on its own".into());
                    }
                }
            }
        }
        self.drain_events()
    }

    fn drain_events(&mut self) -> Res {
        for n in 0..self.nodes.len() {
            for (h, ev) in self.sim.take_events(n) {
                self.on_event(n, h, ev)?;
            }
        }
        let touched = std::mem::take(&mut self.touched);
        for i in touched {
            self.check_state(i)?;
        }
        Ok(())
    }

    /// P1/P3: the engine's state is the one the handle's events imply.
    fn check_state(&mut self, i: usize) -> Res {
        let c = &self.conns[i];
        if c.lost {
            return Ok(());
        }
        let (n, h) = (c.node, c.h);
        let st = self.sim.ep(n).state(h);
        if c.destroyed {
            ensure!(
                st.is_none(),
                "{}",
                self.fail(i, &format!("destroyed handle still has state {st:?}"))
            );
            return Ok(());
        }
        let ok = st.is_some_and(|s| c.phase.states().contains(&s));
        ensure!(
            ok,
            "{}",
            self.fail(
                i,
                &format!("engine state {st:?} but events imply {:?}", c.phase)
            )
        );
        Ok(())
    }

    // ----- events ------------------------------------------------------------------------

    fn on_event(&mut self, n: usize, h: CepHandle, ev: CmEvent) -> Res {
        let Some(i) = self.key_of(n, h) else {
            return Err(format!(
                "event {ev:?} on node {n} for handle {h:?} the user never saw created"
            ));
        };
        self.touched.push(i);
        self.note(i, format!("event {}", brief(&ev)));
        // P3.
        ensure!(
            !self.conns[i].destroyed,
            "{}",
            self.fail(i, &format!("event {ev:?} after destroy"))
        );
        ensure!(
            !self.conns[i].lost,
            "{}",
            self.fail(i, "event on a crashed node's handle")
        );
        match ev {
            CmEvent::ReqReceived {
                listener,
                cep,
                info,
            } => {
                ensure!(
                    listener == h,
                    "ReqReceived for listener {listener:?} delivered on {h:?}"
                );
                ensure!(
                    self.conns[i].role == Role::Listener,
                    "{}",
                    self.fail(i, "ReqReceived on a non-listener")
                );
                self.on_req_received(n, cep, &info)
            }
            CmEvent::SidrReqReceived {
                listener,
                cep,
                peer,
                service_id,
                private_data,
            } => {
                ensure!(
                    listener == h,
                    "SidrReqReceived for listener {listener:?} delivered on {h:?}"
                );
                ensure!(
                    self.conns[i].role == Role::Listener,
                    "{}",
                    self.fail(i, "SidrReqReceived on a non-listener")
                );
                self.on_sidr_req_received(n, cep, peer, service_id, &private_data)
            }
            other => self.on_conn_event(i, &other),
        }
    }

    fn on_req_received(&mut self, n: usize, cep: CepHandle, info: &rcm_proto::ib::ReqInfo) -> Res {
        let gen = self.nodes[n].gen;
        ensure!(
            !self.index.contains_key(&(n, gen, cep)),
            "ReqReceived names existing handle {cep:?} on node {n}"
        );
        let Some((TOK_REQ, a)) = parse_token(&info.private_data) else {
            return Err(format!(
                "ReqReceived with a private-data area we never sent: {:?}",
                &info.private_data[..16]
            ));
        };
        ensure!(a < self.conns.len(), "REQ token {a} unknown");
        let ac = &self.conns[a];
        ensure!(
            ac.role == Role::Active
                && node_of(info.peer) == ac.node
                && ac.qpn == info.remote_qpn
                && info.remote_ca_guid == guid(ac.node),
            "{}",
            self.fail(
                a,
                &format!("ReqReceived on node {n} does not match its connect: {info:?}")
            )
        );
        // P2b: a REQ of a connect whose earlier child here still remembers it (neither Idle
        // nor in timewait, where the peer's IDs are released) is a duplicate, not a new request.
        for (q, qc) in self.conns.iter().enumerate() {
            if qc.role != Role::Passive
                || qc.partner != Some(a)
                || qc.node != n
                || qc.gen != gen
                || qc.lost
            {
                continue;
            }
            // A destroyed child went to timewait (from Accepted, Up, DREQ sent or received) or
            // was removed; either way the peer's IDs are released.
            let forgotten = qc.destroyed || matches!(qc.phase, Phase::Idle | Phase::Timewait);
            ensure!(
                forgotten,
                "{}",
                self.fail(
                    q,
                    &format!("P2b: a duplicate REQ of [{a}] created a second child {cep:?}")
                )
            );
        }
        let comm = self.sim.ep(n).local_comm_id(cep);
        let mut c = Conn::new(n, gen, cep, Role::Passive, Phase::Requested);
        c.comm_id = comm.ok_or("new child has no comm ID")?;
        c.partner = Some(a);
        c.peer_qpn = Some(info.remote_qpn);
        let i = self.add_conn(c);
        self.touched.push(i);
        self.conns[a].children += 1;
        self.c.passive_children += 1;
        if self.conns[a].children > 1 {
            self.c.ghost_children += 1;
        }
        self.note(
            i,
            format!("created by REQ of [{a}] (qpn {:#x})", info.remote_qpn),
        );
        if self.probing {
            self.schedule(Duration::ZERO, Action::Reject(i));
            return Ok(());
        }
        // Policy.
        let r: f64 = self.rng.gen();
        let o = self.o.clone();
        let d = self.delay(300);
        if r < o.p_accept {
            if self.rng.gen_bool(o.p_mra_req) {
                let st = self.rng.gen_range(8..=18);
                let lazy = self.rng.gen_bool(0.5);
                self.schedule(Duration::ZERO, Action::Mra(i, st, lazy));
                let later = d + ms(self.rng.gen_range(0..=1500));
                self.schedule(later, Action::Accept(i));
            } else {
                self.schedule(d, Action::Accept(i));
            }
            if self.rng.gen_bool(o.p_reject_after_accept) {
                let later = d + ms(self.rng.gen_range(0..=500));
                self.schedule(later, Action::Reject(i));
            }
        } else if r < o.p_accept + o.p_reject {
            self.schedule(d, Action::Reject(i));
        } else if r < o.p_accept + o.p_reject + o.p_destroy_req {
            self.schedule(d, Action::Destroy(i));
        } else {
            // Slow: quite possibly after the active side gave up.
            let later = ms(self.rng.gen_range(300..=5000));
            self.schedule(later, Action::Accept(i));
        }
        Ok(())
    }

    fn on_sidr_req_received(
        &mut self,
        n: usize,
        cep: CepHandle,
        peer: IpAddr,
        svc: u64,
        pd: &[u8],
    ) -> Res {
        let gen = self.nodes[n].gen;
        ensure!(
            !self.index.contains_key(&(n, gen, cep)),
            "SidrReqReceived names existing handle {cep:?}"
        );
        let Some((TOK_SIDR, a)) = parse_token(pd) else {
            return Err("SidrReqReceived with a private-data area we never sent".into());
        };
        ensure!(
            a < self.conns.len()
                && self.conns[a].role == Role::SidrActive
                && self.conns[a].node == node_of(peer),
            "SidrReqReceived token/peer mismatch"
        );
        ensure!(
            svc & SVC_MASK == SVC & SVC_MASK,
            "SidrReqReceived for service {svc:#x}"
        );
        let mut c = Conn::new(n, gen, cep, Role::SidrPassive, Phase::SidrRcvd);
        c.partner = Some(a);
        let i = self.add_conn(c);
        self.touched.push(i);
        self.note(i, format!("created by SIDR_REQ of [{a}]"));
        let d = self.delay(300);
        if self.rng.gen_bool(0.9) {
            self.schedule(d, Action::SidrReply(i));
        } else {
            self.schedule(d, Action::Destroy(i));
        }
        Ok(())
    }

    fn on_conn_event(&mut self, i: usize, ev: &CmEvent) -> Res {
        let phase = self.conns[i].phase;
        let role = self.conns[i].role;
        let bad = |w: &World| {
            w.fail(
                i,
                &format!("event {} illegal in phase {phase:?}", brief(ev)),
            )
        };
        match ev {
            CmEvent::MraReceived { .. } => {
                ensure!(
                    matches!(phase, Phase::Connecting | Phase::Accepted),
                    "{}",
                    bad(self)
                );
                self.c.mra_received += 1;
            }
            CmEvent::RepReceived(info) => {
                ensure!(
                    phase == Phase::Connecting && role == Role::Active,
                    "{}",
                    bad(self)
                );
                let Some((TOK_REP, p)) = parse_token(&info.private_data) else {
                    return Err(self.fail(i, "REP without our token"));
                };
                ensure!(p < self.conns.len(), "REP token {p} unknown");
                let pc = &self.conns[p];
                ensure!(
                    pc.role == Role::Passive && pc.partner == Some(i) && pc.qpn == info.remote_qpn,
                    "{}",
                    self.fail(
                        i,
                        &format!(
                            "P4f: REP from [{p}] (qpn {:#x}) is not from a child of ours",
                            info.remote_qpn
                        )
                    )
                );
                ensure!(
                    info.established == self.conns[i].establish_on_rep,
                    "{}",
                    self.fail(
                        i,
                        "RepReceived's `established` is not what the connect asked"
                    )
                );
                let c = &mut self.conns[i];
                c.phase = Phase::GotRep;
                c.partner = Some(p);
                c.peer_qpn = Some(info.remote_qpn);
                if c.establish_on_rep {
                    // The RTU went out with this event; `Established` comes next.
                    c.establish_called = true;
                    return Ok(());
                }
                let o = self.o.clone();
                let r: f64 = self.rng.gen();
                let d = self.delay(200);
                if r < o.p_establish {
                    self.schedule(d, Action::Establish(i));
                } else if r < o.p_establish + o.p_reject_rep {
                    self.schedule(d, Action::Reject(i));
                } else if r < o.p_establish + o.p_reject_rep + o.p_destroy_rep {
                    self.schedule(d, Action::Destroy(i));
                } else {
                    let st = self.rng.gen_range(8..=18);
                    let lazy = self.rng.gen_bool(0.5);
                    self.schedule(Duration::ZERO, Action::Mra(i, st, lazy));
                    let later = ms(self.rng.gen_range(0..=1500));
                    self.schedule(later, Action::Establish(i));
                }
            }
            CmEvent::Established => {
                let ok = match phase {
                    Phase::GotRep => self.conns[i].establish_called,
                    Phase::Accepted => role == Role::Passive,
                    _ => false,
                };
                ensure!(ok && self.conns[i].outcome.is_none(), "{}", bad(self));
                if role == Role::Passive {
                    // P4a.
                    let a = self.conns[i].partner.ok_or("child without partner")?;
                    let ac = &self.conns[a];
                    let c = &self.conns[i];
                    ensure!(
                        ac.established
                            && ac.partner == Some(i)
                            && ac.peer_qpn == Some(c.qpn)
                            && c.peer_qpn == Some(ac.qpn),
                        "{}",
                        self.fail(
                            i,
                            "P4a: passive Established but its connect did not establish with it"
                        )
                    );
                }
                let c = &mut self.conns[i];
                c.phase = Phase::Up;
                c.established = true;
                c.outcome = Some(Outcome::Established);
                if !self.teardown {
                    let o = self.o.clone();
                    let r: f64 = self.rng.gen();
                    let at = ms(self.rng.gen_range(0..=o.span.max(1)));
                    if r < o.p_disc {
                        self.schedule(at, Action::Disconnect(i));
                    } else if r < o.p_disc + o.p_destroy_up {
                        self.schedule(at, Action::Destroy(i));
                    }
                }
            }
            CmEvent::Rejected {
                reason,
                ari,
                private_data,
            } => {
                let stale = *reason == RejReason::StaleConn;
                let next = match phase {
                    Phase::Connecting | Phase::Requested | Phase::Accepted if stale => {
                        Phase::Timewait
                    }
                    Phase::Connecting | Phase::Requested | Phase::Accepted => Phase::Idle,
                    Phase::GotRep | Phase::Up | Phase::DreqSent => Phase::Timewait,
                    _ => return Err(bad(self)),
                };
                self.check_rej(i, *reason, ari, private_data)?;
                let c = &mut self.conns[i];
                if matches!(phase, Phase::Up | Phase::DreqSent) {
                    ensure!(c.outcome == Some(Outcome::Established), "{}", bad(self));
                    c.teardown_rej = Some(*reason);
                } else {
                    ensure!(c.outcome.is_none(), "{}", bad(self));
                    c.outcome = Some(Outcome::Rejected(*reason));
                }
                self.set_phase(i, next);
            }
            CmEvent::TimedOut(t) => {
                let (next, outcome) = match (phase, t) {
                    (Phase::Connecting, TimedOut::Req) => (Phase::Idle, Some(Outcome::TimedOutReq)),
                    (Phase::Accepted, TimedOut::Rep) => (Phase::Idle, Some(Outcome::TimedOutRep)),
                    (Phase::DreqSent, TimedOut::Dreq) => (Phase::Timewait, None),
                    (Phase::SidrSent, TimedOut::SidrReq) => {
                        (Phase::Idle, Some(Outcome::SidrTimedOut))
                    }
                    _ => return Err(bad(self)),
                };
                if let Some(o) = outcome {
                    ensure!(self.conns[i].outcome.is_none(), "{}", bad(self));
                    self.conns[i].outcome = Some(o);
                } else {
                    self.c.dreq_timeouts += 1;
                }
                self.set_phase(i, next);
            }
            CmEvent::DreqReceived { private_data } => {
                match phase {
                    Phase::Up => {}
                    Phase::DreqSent => self.c.crossing_dreqs += 1,
                    Phase::Accepted => {
                        ensure!(self.conns[i].outcome.is_none(), "{}", bad(self));
                        self.conns[i].outcome = Some(Outcome::DreqBeforeRtu);
                    }
                    _ => return Err(bad(self)),
                }
                // P4e.
                if let Some((magic, s)) = parse_token(private_data) {
                    ensure!(
                        magic == TOK_DREQ && s < self.conns.len(),
                        "DREQ with a foreign token"
                    );
                    let sc = &self.conns[s];
                    let c = &self.conns[i];
                    ensure!(
                        sc.disconnect_called && (sc.partner == Some(i) || c.partner == Some(s)),
                        "{}",
                        self.fail(
                            i,
                            &format!(
                                "P4e: DREQ from [{s}], which is not our peer or never disconnected"
                            )
                        )
                    );
                }
                self.conns[i].saw_dreq = true;
                self.set_phase(i, Phase::DreqRcvd);
                let o = self.o.clone();
                if self.teardown {
                    self.schedule(Duration::ZERO, Action::Disconnect(i));
                } else if self.rng.gen_bool(o.p_dreq_destroy) {
                    let d = self.delay(300);
                    self.schedule(d, Action::Destroy(i));
                } else if self.rng.gen_bool(o.p_dreq_delay) {
                    let d = ms(self.rng.gen_range(0..=500));
                    self.schedule(d, Action::Disconnect(i));
                } else {
                    self.schedule(Duration::ZERO, Action::Disconnect(i));
                }
            }
            CmEvent::DrepReceived => {
                ensure!(
                    matches!(phase, Phase::DreqSent | Phase::DreqRcvd),
                    "{}",
                    bad(self)
                );
                let c = &self.conns[i];
                ensure!(
                    c.disconnect_called || c.stale_teardown,
                    "{}",
                    self.fail(i, "DREP without having sent a DREQ")
                );
                // P4e: the peer got the DREQ or had left already.
                if !c.stale_teardown {
                    let p = c.partner.ok_or("established handle without partner")?;
                    let pc = &self.conns[p];
                    ensure!(
                        pc.saw_dreq || pc.entered_timewait || pc.destroyed || pc.lost || pc.stale_teardown,
                        "{}",
                        self.fail(i, "P4e: DREP received but the peer never got our DREQ and is still connected")
                    );
                }
                self.set_phase(i, Phase::Timewait);
            }
            CmEvent::TimewaitExit => {
                ensure!(phase == Phase::Timewait, "{}", bad(self));
                self.conns[i].timewait_exits += 1;
                self.set_phase(i, Phase::Idle);
            }
            CmEvent::SidrRepReceived {
                status,
                qpn,
                qkey,
                private_data,
            } => {
                ensure!(phase == Phase::SidrSent, "{}", bad(self));
                match parse_token(private_data) {
                    Some((TOK_SIDR_REP, p)) => {
                        ensure!(p < self.conns.len(), "SIDR_REP token unknown");
                        let pc = &self.conns[p];
                        ensure!(
                            pc.partner == Some(i) && pc.sidr_reply == Some((*status, *qpn, *qkey)),
                            "{}",
                            self.fail(i, "P4c: SIDR_REP does not carry what the replier sent")
                        );
                    }
                    None => ensure!(
                        matches!(
                            status,
                            SidrStatus::UnsupportedServiceId | SidrStatus::Rejected
                        ),
                        "{}",
                        self.fail(i, &format!("P4c: engine SIDR_REP with status {status:?}"))
                    ),
                    Some(_) => return Err(self.fail(i, "SIDR_REP with a foreign token")),
                }
                self.conns[i].outcome = Some(Outcome::SidrRep);
                self.set_phase(i, Phase::Idle);
            }
            CmEvent::ReqReceived { .. } | CmEvent::SidrReqReceived { .. } => {
                return Err(bad(self));
            }
        }
        Ok(())
    }

    /// P4c: where a REJ came from and what it carries.
    fn check_rej(&self, i: usize, reason: RejReason, ari: &[u8], pd: &[u8]) -> Res {
        match parse_token(pd) {
            Some((TOK_REJ, r)) => {
                ensure!(r < self.conns.len(), "REJ token unknown");
                let rc = &self.conns[r];
                let c = &self.conns[i];
                ensure!(
                    rc.partner == Some(i) || c.partner == Some(r),
                    "{}",
                    self.fail(
                        i,
                        &format!("P4c: user REJ from [{r}], which is not our peer")
                    )
                );
                let Some((ur, uari, _)) = &rc.user_rej else {
                    return Err(self.fail(
                        i,
                        &format!("P4c: REJ with the token of [{r}], whose user never rejected"),
                    ));
                };
                ensure!(
                    *ur == reason && uari.as_slice() == ari,
                    "{}",
                    self.fail(
                        i,
                        &format!("P4c: REJ says {reason:?}/{ari:?}, its user sent {ur:?}/{uari:?}")
                    )
                );
            }
            Some(_) => return Err(self.fail(i, "REJ with a foreign token")),
            None => {
                let c = &self.conns[i];
                let ok = match reason {
                    // Only an active side destroyed in REQ_SENT sends it (retries running
                    // out end the exchange silently), naming its CA GUID.
                    RejReason::Timeout => c.partner.is_some_and(|p| {
                        c.role == Role::Passive && ari == guid(self.conns[p].node).to_be_bytes()
                    }),
                    RejReason::ConsumerDefined | RejReason::StaleConn => ari.is_empty(),
                    RejReason::InvalidServiceId => {
                        c.role == Role::Active && c.phase == Phase::Connecting
                    }
                    _ => false,
                };
                ensure!(
                    ok,
                    "{}",
                    self.fail(
                        i,
                        &format!("P4c: engine REJ {reason:?} ari {ari:?} unexpected here")
                    )
                );
            }
        }
        Ok(())
    }

    /// The timewait both ends use: the path's ACK timeout (the active side computes it from
    /// the packet lifetime and CA ACK delay 15, the passive side takes it from the REQ), but
    /// at least `min_timewait`.
    fn timewait_len(&self) -> Duration {
        let ack = cm_ack_timeout(15, self.o.plt);
        ms(ibta_time_ms(ack)).max(self.o.min_timewait)
    }

    fn set_phase(&mut self, i: usize, p: Phase) {
        let prev = self.conns[i].phase;
        self.conns[i].phase = p;
        if p == Phase::Timewait && prev != Phase::Timewait {
            self.conns[i].entered_timewait = true;
            self.conns[i].tw_end = Some(self.sim.now() + self.timewait_len());
            if !self.teardown && self.conns[i].live() && self.rng.gen_bool(self.o.p_tw_destroy) {
                let d = ms(self.rng.gen_range(0..=300));
                self.schedule(d, Action::Destroy(i));
            }
        }
        if p == Phase::Idle && prev != Phase::Idle {
            self.release_qpn(i);
        }
    }

    // ----- commands ----------------------------------------------------------------------

    fn exec(&mut self, a: Action) -> Res {
        let now = self.sim.now();
        self.digest = mix(self.digest, self.us());
        match a {
            Action::Connect { from, to, svc } => {
                if !self.nodes[from].up {
                    return Ok(());
                }
                let qpn = self.alloc_qpn(from);
                let id = self.conns.len();
                let mut p = ConnectParams::new(addr(to), svc, qpn);
                p.path.packet_life_time = self.o.plt;
                p.cm_response_timeout = self.o.cm_response_timeout;
                p.max_cm_retries = self.o.max_cm_retries;
                let extra = self.rng.gen_range(0..=80);
                p.private_data = token(TOK_REQ, id, extra);
                // Some connects as rdma_cm makes them for an id with a QP: the engine answers
                // the REP with the RTU itself.
                p.establish_on_rep = self.rng.gen_bool(0.25);
                let h = match self.sim.ep(from).connect(now, &p) {
                    Ok(h) => h,
                    Err(CmError::NoResources) => return self.no_resources(from),
                    Err(e) => return Err(format!("connect failed: {e}")),
                };
                let mut c = Conn::new(
                    from,
                    self.nodes[from].gen,
                    h,
                    Role::Active,
                    Phase::Connecting,
                );
                c.comm_id = self
                    .sim
                    .ep(from)
                    .local_comm_id(h)
                    .ok_or("connect handle without comm ID")?;
                c.qpn = qpn;
                c.establish_on_rep = p.establish_on_rep;
                let i = self.add_conn(c);
                self.touched.push(i);
                self.c.connects += 1;
                self.note(i, format!("cmd connect to n{to} svc {svc:#x} qpn {qpn:#x}"));
                if self.probing {
                    let expect = if self.nodes[to].listener.is_none() {
                        ProbeExpect::NoListener
                    } else if self.sim.ep(to).cep_count() >= self.o.max_ceps {
                        ProbeExpect::Dropped
                    } else {
                        ProbeExpect::UserReject
                    };
                    self.probes.push((i, expect));
                    return self.after_command();
                }
                let o = self.o.clone();
                if self.rng.gen_bool(o.p_destroy_connecting) {
                    let d = ms(self.rng.gen_range(0..=1000));
                    self.schedule(d, Action::Destroy(i));
                }
                if self.rng.gen_bool(o.p_cancel_reject) {
                    let d = ms(self.rng.gen_range(0..=500));
                    self.schedule(d, Action::Reject(i));
                }
            }
            Action::Sidr { from, to, svc } => {
                if !self.nodes[from].up {
                    return Ok(());
                }
                let id = self.conns.len();
                let p = SidrParams {
                    dst: addr(to),
                    service_id: svc,
                    private_data: token(TOK_SIDR, id, 0),
                    timeout: self.rng.gen_range(12..=18),
                    max_retries: self.rng.gen_range(1..=6),
                };
                let h = match self.sim.ep(from).sidr_request(now, &p) {
                    Ok(h) => h,
                    Err(CmError::NoResources) => return self.no_resources(from),
                    Err(e) => return Err(format!("sidr_request failed: {e}")),
                };
                let mut c = Conn::new(
                    from,
                    self.nodes[from].gen,
                    h,
                    Role::SidrActive,
                    Phase::SidrSent,
                );
                c.comm_id = self
                    .sim
                    .ep(from)
                    .local_comm_id(h)
                    .ok_or("SIDR handle without comm ID")?;
                let i = self.add_conn(c);
                self.touched.push(i);
                self.c.sidr += 1;
                self.note(i, format!("cmd sidr_request to n{to}"));
            }
            Action::Accept(i) => {
                if !self.conns[i].live() || self.conns[i].phase != Phase::Requested {
                    return Ok(());
                }
                let n = self.conns[i].node;
                let qpn = self.alloc_qpn(n);
                let extra = self.rng.gen_range(0..=150);
                let p = AcceptParams {
                    qpn,
                    responder_resources: self.rng.gen_range(0..=16),
                    initiator_depth: self.rng.gen_range(0..=16),
                    rnr_retry_count: 7,
                    private_data: token(TOK_REP, i, extra),
                    ..AcceptParams::default()
                };
                let h = self.conns[i].h;
                let r = self.sim.ep(n).accept(now, h, &p);
                self.cmd_result(i, "accept", r)?;
                self.conns[i].qpn = qpn;
                self.set_phase(i, Phase::Accepted);
            }
            Action::Mra(i, st, lazy) => {
                let c = &self.conns[i];
                if !c.live() || c.mra_called || !matches!(c.phase, Phase::Requested | Phase::GotRep)
                {
                    return Ok(());
                }
                let (n, h) = (c.node, c.h);
                let r = self.sim.ep(n).mra(h, st, lazy);
                self.cmd_result(i, &format!("mra({st}, lazy={lazy})"), r)?;
                self.conns[i].mra_called = true;
            }
            Action::Establish(i) => {
                let c = &self.conns[i];
                if !c.live() || c.phase != Phase::GotRep {
                    return Ok(());
                }
                let (n, h) = (c.node, c.h);
                self.conns[i].establish_called = true;
                let r = self.sim.ep(n).establish(h);
                self.cmd_result(i, "establish", r)?;
            }
            Action::Reject(i) => {
                let c = &self.conns[i];
                let phase = c.phase;
                if !c.live()
                    || !matches!(
                        phase,
                        Phase::Connecting | Phase::Requested | Phase::Accepted | Phase::GotRep
                    )
                {
                    return Ok(());
                }
                let (n, h) = (c.node, c.h);
                let reason = [
                    RejReason::ConsumerDefined,
                    RejReason::NoQp,
                    RejReason::NoResources,
                    RejReason::UnsupportedReq,
                ][self.rng.gen_range(0..4)];
                let ari: Vec<u8> = (0..self.rng.gen_range(0..=8))
                    .map(|_| self.rng.gen())
                    .collect();
                let extra = self.rng.gen_range(0..=100);
                let pd = token(TOK_REJ, i, extra);
                let r = self.sim.ep(n).reject(now, h, reason, &ari, &pd);
                self.cmd_result(i, &format!("reject {reason:?}"), r)?;
                self.conns[i].user_rej = Some((reason, ari, phase));
                if self.conns[i].outcome.is_none() {
                    self.conns[i].outcome = Some(Outcome::UserRejected);
                }
                self.set_phase(
                    i,
                    if phase == Phase::Accepted {
                        Phase::Timewait
                    } else {
                        Phase::Idle
                    },
                );
            }
            Action::Disconnect(i) => {
                let c = &self.conns[i];
                if !c.live() || !matches!(c.phase, Phase::Up | Phase::DreqRcvd) {
                    return Ok(());
                }
                let (n, h, phase) = (c.node, c.h, c.phase);
                let pd = if phase == Phase::Up {
                    token(TOK_DREQ, i, 0)
                } else {
                    Vec::new()
                };
                let r = self.sim.ep(n).disconnect(now, h, &pd);
                self.cmd_result(i, "disconnect", r)?;
                if phase == Phase::Up {
                    self.conns[i].disconnect_called = true;
                    self.set_phase(i, Phase::DreqSent);
                } else {
                    self.set_phase(i, Phase::Timewait);
                }
            }
            Action::SidrReply(i) => {
                let c = &self.conns[i];
                if !c.live() || c.phase != Phase::SidrRcvd {
                    return Ok(());
                }
                let (n, h) = (c.node, c.h);
                let status = if self.rng.gen_bool(0.8) {
                    SidrStatus::Success
                } else {
                    SidrStatus::NoQp
                };
                let qpn = self.alloc_qpn(n);
                let p = SidrReplyParams {
                    status,
                    qpn,
                    qkey: 0x0123_4567,
                    private_data: token(TOK_SIDR_REP, i, 0),
                };
                let r = self.sim.ep(n).sidr_reply(h, &p);
                self.cmd_result(i, "sidr_reply", r)?;
                self.conns[i].sidr_reply = Some((status, qpn, 0x0123_4567));
                self.conns[i].outcome = Some(Outcome::SidrReplied);
                self.set_phase(i, Phase::Idle);
            }
            Action::Destroy(i) => {
                let c = &self.conns[i];
                if !c.live() {
                    return Ok(());
                }
                let (n, h, phase, role) = (c.node, c.h, c.phase, c.role);
                let r = self.sim.ep(n).destroy(now, h);
                self.cmd_result(i, "destroy", r)?;
                let ep = self.sim.ep(n);
                ensure!(
                    ep.state(h).is_none() && ep.local_comm_id(h).is_none(),
                    "{}",
                    self.fail(i, "P3: destroyed handle still visible")
                );
                let again = self.sim.ep(n).destroy(now, h);
                ensure!(
                    again == Err(CmError::UnknownHandle),
                    "P3: second destroy answered {again:?}"
                );
                self.conns[i].destroyed = true;
                self.conns[i].destroyed_in = Some(phase);
                if matches!(
                    phase,
                    Phase::Accepted | Phase::Up | Phase::DreqSent | Phase::DreqRcvd
                ) {
                    // It sits out timewait invisibly.
                    self.conns[i].tw_end = Some(now + self.timewait_len());
                }
                let counted = !self.teardown;
                if counted {
                    self.c.destroys += 1;
                }
                match phase {
                    _ if !counted => {}
                    Phase::Listening => {
                        self.c.destroys_listener += 1;
                        let pending = self.conns.iter().any(|c| {
                            c.node == n
                                && c.live()
                                && c.gen == self.nodes[n].gen
                                && c.phase == Phase::Requested
                        });
                        if pending {
                            self.c.listener_destroyed_with_pending += 1;
                        }
                    }
                    Phase::Connecting | Phase::GotRep | Phase::Requested | Phase::Accepted => {
                        self.c.destroys_mid_handshake += 1;
                    }
                    Phase::Up => self.c.destroys_established += 1,
                    Phase::Timewait => self.c.destroys_timewait += 1,
                    _ => {}
                }
                if role == Role::Listener {
                    self.nodes[n].listener = None;
                } else {
                    self.release_qpn(i);
                }
            }
            Action::DestroyRandom => {
                let live: Vec<usize> = (0..self.conns.len())
                    .filter(|&i| self.conns[i].live() && self.conns[i].role != Role::Listener)
                    .collect();
                if !live.is_empty() {
                    let i = live[self.rng.gen_range(0..live.len())];
                    return self.exec(Action::Destroy(i));
                }
            }
            Action::Listen(n) => {
                if !self.nodes[n].up || self.nodes[n].listener.is_some() {
                    return Ok(());
                }
                let (svc, mask) = if self.o.masked_listen {
                    (SVC & SVC_MASK, SVC_MASK)
                } else {
                    (SVC, u64::MAX)
                };
                let h = self
                    .sim
                    .ep(n)
                    .listen(svc, mask, self.o.backlog)
                    .map_err(|e| format!("listen failed: {e}"))?;
                let c = Conn::new(n, self.nodes[n].gen, h, Role::Listener, Phase::Listening);
                let i = self.add_conn(c);
                self.touched.push(i);
                self.nodes[n].listener = Some(i);
                self.note(i, "cmd listen".into());
                // The service is taken now.
                let clash = self.sim.ep(n).listen(SVC, u64::MAX, 0);
                ensure!(
                    clash == Err(CmError::AddressInUse(SVC)),
                    "second listen answered {clash:?}"
                );
            }
            Action::DestroyListener(n) => {
                if let Some(i) = self.nodes[n].listener {
                    return self.exec(Action::Destroy(i));
                }
            }
            Action::Crash(n) => {
                if !self.nodes[n].up {
                    return Ok(());
                }
                self.sim.crash(n);
                self.c.crashes += 1;
                let gen = self.nodes[n].gen;
                for i in 0..self.conns.len() {
                    if self.conns[i].node == n
                        && self.conns[i].gen == gen
                        && !self.conns[i].destroyed
                    {
                        self.conns[i].lost = true;
                        self.note(i, "lost in crash".into());
                        self.release_qpn(i);
                    }
                }
                self.nodes[n].up = false;
                self.nodes[n].listener = None;
            }
            Action::Restart(n) => {
                if self.nodes[n].up {
                    return Ok(());
                }
                self.nodes[n].gen += 1;
                let s = self.seed.wrapping_mul(16).wrapping_add(n as u64)
                    ^ (u64::from(self.nodes[n].gen) << 56);
                self.sim.restart(n, s);
                self.nodes[n].up = true;
                return self.exec(Action::Listen(n));
            }
            Action::Cut(x, y, cut) => self.sim.partition(x, y, cut),
        }
        self.after_command()
    }

    fn after_command(&mut self) -> Res {
        self.sim.flush();
        self.drain_events()
    }

    /// P5: `NoResources` only at the configured cap.
    fn no_resources(&mut self, n: usize) -> Res {
        let count = self.sim.ep(n).cep_count();
        ensure!(
            count >= self.o.max_ceps,
            "P5: node {n} refused a connect with NoResources at cep_count {count} < max_ceps {}",
            self.o.max_ceps
        );
        self.c.no_resources += 1;
        Ok(())
    }

    fn cmd_result(&mut self, i: usize, what: &str, r: Result<(), CmError>) -> Res {
        self.note(i, format!("cmd {what} -> {r:?}"));
        r.map_err(|e| {
            self.fail(
                i,
                &format!("P1: {what} refused ({e}) in a phase that allows it"),
            )
        })
    }

    // ----- the workload and the checks ------------------------------------------------------

    fn plan(&mut self) {
        let o = self.o.clone();
        for n in 0..o.nodes {
            self.schedule(Duration::ZERO, Action::Listen(n));
        }
        let span = |w: &mut World| Duration::from_micros(w.rng.gen_range(0..=o.span * 1000));
        for _ in 0..o.connects {
            let from = self.rng.gen_range(0..o.nodes);
            let to = (from + self.rng.gen_range(1..o.nodes)) % o.nodes;
            let svc = if self.rng.gen_bool(o.p_unlistened) {
                SVC_NONE
            } else if o.masked_listen {
                (SVC & SVC_MASK) | self.rng.gen_range(1..=0xFFFF)
            } else {
                SVC
            };
            let at = span(self);
            self.schedule(at, Action::Connect { from, to, svc });
        }
        for _ in 0..o.sidrs {
            let from = self.rng.gen_range(0..o.nodes);
            let to = (from + self.rng.gen_range(1..o.nodes)) % o.nodes;
            let svc = if self.rng.gen_bool(0.2) {
                SVC_NONE
            } else {
                SVC
            };
            let at = span(self);
            self.schedule(at, Action::Sidr { from, to, svc });
        }
        for _ in 0..o.random_destroys {
            let at = span(self) + ms(self.rng.gen_range(0..=1000));
            self.schedule(at, Action::DestroyRandom);
        }
        if o.listener_churn {
            let n = self.rng.gen_range(0..o.nodes);
            let at = span(self);
            self.schedule(at, Action::DestroyListener(n));
            if self.rng.gen_bool(0.6) {
                let again = at + ms(self.rng.gen_range(0..=2000));
                self.schedule(again, Action::Listen(n));
            }
        }
        if o.crash {
            let n = self.rng.gen_range(0..o.nodes);
            let at = span(self);
            self.schedule(at, Action::Crash(n));
            let back = at + ms(self.rng.gen_range(0..=2000));
            self.schedule(back, Action::Restart(n));
        }
        for _ in 0..o.partitions {
            let x = self.rng.gen_range(0..o.nodes);
            let y = (x + self.rng.gen_range(1..o.nodes)) % o.nodes;
            let at = span(self);
            self.schedule(at, Action::Cut(x, y, true));
            let back = at + ms(self.rng.gen_range(0..=1500));
            self.schedule(back, Action::Cut(x, y, false));
        }
    }

    fn live_conns(&self, n: usize) -> impl Iterator<Item = &Conn> + '_ {
        let gen = self.nodes[n].gen;
        self.conns
            .iter()
            .filter(move |c| c.node == n && c.gen == gen && c.live() && c.role != Role::Listener)
    }

    /// P5: tables against the driver's live handles.
    fn check_tables(&mut self, when: &str) -> Res {
        for n in 0..self.nodes.len() {
            let live = self.live_conns(n).count();
            let ids = self
                .live_conns(n)
                .filter(|c| c.role != Role::SidrPassive)
                .count();
            let up = self.live_conns(n).filter(|c| c.phase == Phase::Up).count();
            let ep = self.sim.ep(n);
            ensure!(
                ep.poll_timeout().is_none(),
                "P5 ({when}): node {n} still has a timer"
            );
            let got = (ep.cep_count(), ep.table_sizes());
            let want = (live, (ids, up, up, 0, 0));
            ensure!(got == want, "P5 ({when}): node {n} (cep_count, (local, remote_id, remote_qp, sidr, timers)) = {got:?}, live handles imply {want:?}");
        }
        Ok(())
    }

    /// P5: after the workload, on a clean network, every node still takes a new REQ: its
    /// listener's backlog has no leaked slots (or, with the listener gone, it answers
    /// InvalidServiceId; at `max_ceps`, it drops the REQ).
    fn probe(&mut self) -> Res {
        self.probing = true;
        self.sim.net = NetConfig::default();
        // One at a time, so a probe's own endpoint does not count against the next target.
        for to in 0..self.nodes.len() {
            let from = (to + 1) % self.nodes.len();
            self.schedule(Duration::ZERO, Action::Connect { from, to, svc: SVC });
            ensure!(self.run(PHASE_BOUND)?, "P6: probes not quiet");
        }
        for &(i, expect) in &self.probes {
            let c = &self.conns[i];
            let ok = match expect {
                ProbeExpect::UserReject => {
                    c.outcome.is_some_and(|o| matches!(o, Outcome::Rejected(_))) && c.children == 1
                }
                ProbeExpect::NoListener => {
                    c.outcome == Some(Outcome::Rejected(RejReason::InvalidServiceId))
                }
                ProbeExpect::Dropped => c.outcome == Some(Outcome::TimedOutReq) && c.children == 0,
            };
            ensure!(
                ok,
                "{}",
                self.fail(i, &format!("P5: probe connect expected {expect:?}"))
            );
        }
        self.probing = false;
        // Teardown runs on the seed's network again.
        self.sim.net = self.o.net;
        self.check_tables("after probes")
    }

    fn finish(&mut self) -> Res {
        // Workload: run until everything happened and the network is quiet.
        ensure!(
            self.run(PHASE_BOUND)?,
            "P6: workload not quiet after {PHASE_BOUND:?} of virtual time"
        );
        for i in 0..self.conns.len() {
            let c = &self.conns[i];
            if !c.live() {
                continue;
            }
            let ok = match c.role {
                Role::Listener => c.phase == Phase::Listening,
                _ => c.phase == Phase::Idle || (c.phase == Phase::Up && c.teardown_rej.is_none()),
            };
            ensure!(
                ok,
                "{}",
                self.fail(i, "P2: handle stuck when the network went quiet")
            );
            ensure!(
                c.outcome.is_some() || c.role == Role::Listener,
                "{}",
                self.fail(i, "P2: no terminal outcome")
            );
        }
        self.check_tables("workload quiet")?;
        self.probe()?;
        // Teardown: disconnect everything still up, answer every DREQ, sit out timewait.
        self.teardown = true;
        for i in 0..self.conns.len() {
            if self.conns[i].live() && self.conns[i].phase == Phase::Up {
                self.schedule(Duration::ZERO, Action::Disconnect(i));
            }
        }
        ensure!(
            self.run(PHASE_BOUND)?,
            "P6: teardown not quiet after {PHASE_BOUND:?} of virtual time"
        );
        for i in 0..self.conns.len() {
            let c = &self.conns[i];
            if c.live() && c.role != Role::Listener {
                ensure!(
                    c.phase == Phase::Idle,
                    "{}",
                    self.fail(i, "P5: not idle after teardown and timewait")
                );
                ensure!(
                    c.timewait_exits == u32::from(c.entered_timewait),
                    "{}",
                    self.fail(i, "P2: timewait exits")
                );
            }
        }
        self.check_tables("after teardown")?;
        // Destroy everything.
        for i in 0..self.conns.len() {
            if self.conns[i].live() {
                self.schedule(Duration::ZERO, Action::Destroy(i));
            }
        }
        ensure!(
            self.run(PHASE_BOUND)?,
            "P6: not quiet after destroying everything"
        );
        for n in 0..self.nodes.len() {
            let ep = self.sim.ep(n);
            let got = (ep.cep_count(), ep.table_sizes(), ep.poll_timeout());
            ensure!(
                got == (0, (0, 0, 0, 0, 0), None),
                "P5: node {n} after destroying everything: {got:?}"
            );
        }
        self.check_pairs()?;
        self.check_wire()?;
        self.tally();
        Ok(())
    }

    /// Whether the stale-REJ/REP-retransmission race (module docs, P4) is tolerated: only with
    /// `RCM_SIM_LENIENT_STALE=1`, since the engine drops copies of a REP it rejected as stale.
    fn stale_race_allowed(&self) -> bool {
        (self.o.qpn_reuse || self.o.crash) && std::env::var_os("RCM_SIM_LENIENT_STALE").is_some()
    }

    /// P4a/b/d, over the whole history.
    fn check_pairs(&self) -> Res {
        for (i, c) in self.conns.iter().enumerate() {
            match c.role {
                Role::Active if c.established => {
                    let p = c.partner.ok_or("established without partner")?;
                    let pc = &self.conns[p];
                    // P4b.
                    let ok = match pc.outcome {
                        None
                        | Some(
                            Outcome::Established | Outcome::TimedOutRep | Outcome::DreqBeforeRtu,
                        ) => true,
                        Some(Outcome::UserRejected) => {
                            pc.user_rej.as_ref().is_some_and(|u| u.2 == Phase::Accepted)
                        }
                        // See P4d: a REJ(StaleConn) overtaken by a REP retransmission.
                        Some(Outcome::Rejected(RejReason::StaleConn)) => self.stale_race_allowed(),
                        _ => false,
                    };
                    ensure!(
                        ok,
                        "{}",
                        self.fail(i, "P4b: established, but the peer's setup ended otherwise")
                    );
                    if pc.outcome.is_none() {
                        ensure!(
                            pc.destroyed || pc.lost,
                            "{}",
                            self.fail(p, "P2: no outcome")
                        );
                    }
                }
                Role::Passive if c.established => {
                    let a = c.partner.ok_or("child without partner")?;
                    ensure!(
                        self.conns[a].established && self.conns[a].partner == Some(i),
                        "{}",
                        self.fail(i, "P4a")
                    );
                }
                _ => {}
            }
            // P4d. A REJ(StaleConn) answering a REP whose QPN collided with one still held can
            // be overtaken by a retransmitted REP that is accepted once the old entry is gone
            // (reordering longer than the retransmit interval): it then tears down the
            // connection on one side only, in Linux as here. Only QPN reuse or a crash makes
            // such a REJ at all.
            if c.teardown_rej == Some(RejReason::StaleConn) {
                ensure!(
                    self.stale_race_allowed(),
                    "{}",
                    self.fail(i, "P4d: REJ(StaleConn) without QPN reuse")
                );
            } else if c.teardown_rej.is_some() {
                let p = c.partner.ok_or("teardown REJ without partner")?;
                let pc = &self.conns[p];
                let rejected_in_rep_sent =
                    pc.user_rej.as_ref().is_some_and(|u| u.2 == Phase::Accepted);
                let destroyed_in_rep_sent = pc.destroyed_in == Some(Phase::Accepted);
                ensure!(
                    !pc.established && (rejected_in_rep_sent || destroyed_in_rep_sent),
                    "{}",
                    self.fail(
                        i,
                        "P4d: REJ after Established from a peer that was not leaving REP_SENT"
                    )
                );
            }
        }
        Ok(())
    }

    /// P4f: comm IDs and QPNs on the wire agree crosswise.
    fn check_wire(&mut self) -> Res {
        let trace = self.sim.trace.take().unwrap_or_default();
        let r = self.check_trace(&trace);
        self.sim.trace = Some(trace);
        r
    }

    fn dump_wire(&self) {
        for pkt in self.sim.trace.iter().flatten() {
            if let Ok(m) = CmMad::parse(&pkt.mad) {
                println!(
                    "{:>12.3} ms  wire n{} -> n{}: {}",
                    pkt.at.as_secs_f64() * 1000.0,
                    node_of(pkt.from),
                    node_of(pkt.to),
                    wire_brief(&m.msg)
                );
            }
        }
    }

    fn check_trace(&self, trace: &[rcm_proto::sim::Packet]) -> Res {
        let mut by_comm: HashMap<(usize, u32), Option<usize>> = HashMap::new();
        for (i, c) in self.conns.iter().enumerate() {
            if matches!(c.role, Role::Active | Role::Passive) {
                by_comm
                    .entry((c.node, c.comm_id))
                    .and_modify(|e| *e = None)
                    .or_insert(Some(i));
            }
        }
        for pkt in trace {
            let (from, to) = (node_of(pkt.from), node_of(pkt.to));
            let Ok(m) = CmMad::parse(&pkt.mad) else {
                return Err(format!("unparseable MAD on the wire at {:?}", pkt.at));
            };
            match m.msg {
                CmMessage::Rep(rep) => {
                    let Some((TOK_REP, p)) = parse_token(&rep.private_data) else {
                        return Err("REP without token on the wire".into());
                    };
                    let pc = &self.conns[p];
                    let a = pc.partner.ok_or("REP from a child without partner")?;
                    let ac = &self.conns[a];
                    ensure!(
                        pc.node == from
                            && ac.node == to
                            && pc.comm_id == rep.local_comm_id
                            && ac.comm_id == rep.remote_comm_id
                            && pc.qpn == rep.local_qpn,
                        "{}",
                        self.fail(p, &format!("P4f: REP on the wire {rep:?} disagrees"))
                    );
                }
                CmMessage::Rtu(rtu) => {
                    let Some(&Some(a)) = by_comm.get(&(from, rtu.local_comm_id)) else {
                        continue;
                    };
                    let ac = &self.conns[a];
                    let p = ac.partner.ok_or("RTU from a handle without partner")?;
                    let pc = &self.conns[p];
                    ensure!(
                        ac.role == Role::Active
                            && ac.establish_called
                            && pc.node == to
                            && pc.comm_id == rtu.remote_comm_id,
                        "{}",
                        self.fail(a, &format!("P4f: RTU on the wire {rtu:?} disagrees"))
                    );
                }
                CmMessage::Dreq(dreq) => {
                    let Some(&Some(x)) = by_comm.get(&(from, dreq.local_comm_id)) else {
                        continue;
                    };
                    let xc = &self.conns[x];
                    let y = xc.partner.ok_or("DREQ from a handle without partner")?;
                    let yc = &self.conns[y];
                    ensure!(
                        xc.established
                            && yc.node == to
                            && yc.comm_id == dreq.remote_comm_id
                            && yc.qpn == dreq.remote_qpn,
                        "{}",
                        self.fail(x, &format!("P4f: DREQ on the wire {dreq:?} disagrees"))
                    );
                }
                _ => {}
            }
        }
        Ok(())
    }

    fn tally(&mut self) {
        let mut t = Counters {
            seeds: 1,
            ..Counters::default()
        };
        for c in &self.conns {
            match (c.role, c.outcome) {
                (Role::Active, Some(Outcome::Established)) => {
                    t.active_established += 1;
                    if let Some(p) = c.partner {
                        match self.conns[p].outcome {
                            Some(Outcome::Established) => t.established_pairs += 1,
                            Some(Outcome::TimedOutRep) => t.half_open += 1,
                            _ => {}
                        }
                    }
                }
                (Role::Active, Some(Outcome::Rejected(_))) => t.active_rejected += 1,
                (Role::Active, Some(Outcome::TimedOutReq)) => t.active_timed_out += 1,
                (Role::Active, Some(Outcome::UserRejected)) => t.active_user_rejected += 1,
                (Role::Passive, Some(Outcome::Rejected(_))) => t.passive_rejected += 1,
                (Role::Passive, Some(Outcome::TimedOutRep)) => t.passive_timed_out += 1,
                (Role::Passive, Some(Outcome::UserRejected)) => t.passive_user_rejected += 1,
                (Role::Passive, Some(Outcome::DreqBeforeRtu)) => t.dreq_before_rtu += 1,
                _ => {}
            }
            match c.teardown_rej {
                Some(RejReason::StaleConn) => t.stale_teardown_rejects += 1,
                Some(_) => t.teardown_rejects += 1,
                None => {}
            }
        }
        for n in 0..self.nodes.len() {
            let s = self.sim.ep(n).stats().clone();
            t.stale_rejects += s.stale_rejects;
            t.retransmits += s.retransmits;
            t.backlog_drops += s.rx_backlog_drops;
            t.duplicates += s.rx_duplicates;
            t.no_listener_rejects += s.no_listener_rejects;
        }
        t.delivered = self.sim.delivered;
        t.dropped = self.sim.dropped;
        let v = self.sim.elapsed().as_millis() as u64;
        t.virtual_ms = v;
        t.max_virtual_ms = v;
        let c = std::mem::take(&mut self.c);
        t.connects = c.connects;
        t.passive_children = c.passive_children;
        t.ghost_children = c.ghost_children;
        t.dreq_timeouts = c.dreq_timeouts;
        t.destroys = c.destroys;
        t.destroys_mid_handshake = c.destroys_mid_handshake;
        t.destroys_established = c.destroys_established;
        t.destroys_timewait = c.destroys_timewait;
        t.destroys_listener = c.destroys_listener;
        t.sidr = c.sidr;
        t.crashes = c.crashes;
        t.no_resources = c.no_resources;
        t.probes = self.probes.len() as u64;
        t.mra_received = c.mra_received;
        t.crossing_dreqs = c.crossing_dreqs;
        t.listener_destroyed_with_pending = c.listener_destroyed_with_pending;
        self.c = t;
    }
}

fn wire_brief(m: &CmMessage) -> String {
    match m {
        CmMessage::Req(r) => format!(
            "REQ comm {:#x} qpn {:#x} token {:?}",
            r.local_comm_id,
            r.local_qpn,
            parse_token(&r.private_data)
        ),
        CmMessage::Rep(r) => format!(
            "REP comm {:#x}->{:#x} qpn {:#x}",
            r.local_comm_id, r.remote_comm_id, r.local_qpn
        ),
        CmMessage::Rtu(r) => format!("RTU comm {:#x}->{:#x}", r.local_comm_id, r.remote_comm_id),
        CmMessage::Rej(r) => format!(
            "REJ comm {:#x}->{:#x} {:?} of {:?}",
            r.local_comm_id, r.remote_comm_id, r.reason, r.message_rejected
        ),
        CmMessage::Mra(r) => format!(
            "MRA comm {:#x}->{:#x} of {:?}",
            r.local_comm_id, r.remote_comm_id, r.message_mraed
        ),
        CmMessage::Dreq(r) => format!(
            "DREQ comm {:#x}->{:#x} qpn {:#x}",
            r.local_comm_id, r.remote_comm_id, r.remote_qpn
        ),
        CmMessage::Drep(r) => format!("DREP comm {:#x}->{:#x}", r.local_comm_id, r.remote_comm_id),
        other => format!("{other:?}").chars().take(60).collect(),
    }
}

fn brief(ev: &CmEvent) -> String {
    match ev {
        CmEvent::ReqReceived { cep, info, .. } => {
            format!("ReqReceived(cep {}, qpn {:#x})", cep.0, info.remote_qpn)
        }
        CmEvent::RepReceived(i) => format!("RepReceived(qpn {:#x})", i.remote_qpn),
        CmEvent::Rejected {
            reason,
            ari,
            private_data,
        } => {
            format!(
                "Rejected({reason:?}, ari {ari:?}, token {:?})",
                parse_token(private_data)
            )
        }
        CmEvent::DreqReceived { private_data } => {
            format!("DreqReceived(token {:?})", parse_token(private_data))
        }
        CmEvent::SidrReqReceived { cep, .. } => format!("SidrReqReceived(cep {})", cep.0),
        CmEvent::SidrRepReceived { status, .. } => format!("SidrRepReceived({status:?})"),
        other => format!("{other:?}"),
    }
}

/// Runs one seed; `Ok` carries its counters and a digest of everything that happened.
fn run_seed(seed: u64, verbose: bool) -> Result<(Counters, u64), String> {
    let mut w = World::new(seed, verbose);
    if verbose {
        println!("seed {seed}: {:#?}", w.o);
    }
    w.plan();
    let r = w.finish();
    if verbose {
        w.dump_wire();
    }
    match r {
        Ok(()) => Ok((w.c.clone(), w.digest)),
        Err(e) => Err(format!("seed {seed} (opts {:?}): {e}", w.o)),
    }
}

/// Runs `seeds` on all cores; returns counters and the failures (seed, message).
fn run_seeds(seeds: std::ops::Range<u64>) -> (Counters, Vec<(u64, String)>) {
    let next = AtomicU64::new(seeds.start);
    let total = Mutex::new(Counters::default());
    let failures = Mutex::new(Vec::new());
    let threads = std::thread::available_parallelism().map_or(2, std::num::NonZeroUsize::get);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let mut mine = Counters::default();
                loop {
                    let seed = next.fetch_add(1, Ordering::Relaxed);
                    if seed >= seeds.end {
                        break;
                    }
                    let r = std::panic::catch_unwind(|| run_seed(seed, false));
                    match r {
                        Ok(Ok((c, _))) => mine.add(&c),
                        Ok(Err(e)) => failures.lock().unwrap().push((seed, e)),
                        Err(p) => {
                            let msg = p
                                .downcast_ref::<String>()
                                .cloned()
                                .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_string()))
                                .unwrap_or_default();
                            failures
                                .lock()
                                .unwrap()
                                .push((seed, format!("seed {seed}: panic: {msg}")));
                        }
                    }
                }
                total.lock().unwrap().add(&mine);
            });
        }
    });
    let mut f = failures.into_inner().unwrap();
    f.sort_by_key(|x| x.0);
    (total.into_inner().unwrap(), f)
}

fn report(
    label: &str,
    seeds: std::ops::Range<u64>,
    elapsed: Duration,
    c: &Counters,
    failures: &[(u64, String)],
) {
    println!(
        "{label}: seeds {}..{} in {:.2} s ({:.3} ms/seed); {} failing",
        seeds.start,
        seeds.end,
        elapsed.as_secs_f64(),
        elapsed.as_secs_f64() * 1000.0
            / f64::from(
                u32::try_from(seeds.end - seeds.start)
                    .unwrap_or(u32::MAX)
                    .max(1)
            ),
        failures.len()
    );
    println!("{c:#?}");
    if !failures.is_empty() {
        let seeds: Vec<u64> = failures.iter().map(|f| f.0).take(50).collect();
        println!("failing seeds (first 50): {seeds:?}");
    }
}

fn check(label: &str, seeds: std::ops::Range<u64>) {
    let t0 = Instant::now();
    let (c, failures) = run_seeds(seeds.clone());
    report(label, seeds, t0.elapsed(), &c, &failures);
    if let Some((_, first)) = failures.first() {
        panic!(
            "{} of the seeds violate a property; first:\n{first}",
            failures.len()
        );
    }
}

/// The default run: 2,000 seeds.
#[test]
fn random_workloads_2000_seeds() {
    check("props", 0..2000);
}

/// 100,000 seeds (or `RCM_SIM_SEEDS`, starting at `RCM_SIM_SEED_START`); meant for `--release`.
#[test]
#[ignore = "long: run with --release -- --ignored --nocapture"]
fn random_workloads_100k_seeds() {
    let n: u64 = std::env::var("RCM_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000);
    let start: u64 = std::env::var("RCM_SIM_SEED_START")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    check("props-long", start..start + n);
}

/// Replays one seed (`RCM_SIM_SEED`, default 0) with its script printed when
/// `RCM_SIM_VERBOSE` is set, and checks it replays identically.
#[test]
fn one_seed_replays_identically() {
    let seed: u64 = std::env::var("RCM_SIM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(7);
    let verbose = std::env::var_os("RCM_SIM_VERBOSE").is_some();
    let a = run_seed(seed, verbose);
    let b = run_seed(seed, false);
    match (a, b) {
        (Ok((_, da)), Ok((_, db))) => assert_eq!(da, db, "seed {seed} did not replay identically"),
        (Err(e), _) | (_, Err(e)) => panic!("{e}"),
    }
}
