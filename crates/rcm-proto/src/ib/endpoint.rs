//! `Endpoint`: one CM port (one local address). It owns the comm-ID, remote-ID, remote-QPN and
//! listen tables, demultiplexes MADs to connection endpoints, runs their timers, and drives the
//! IBTA chapter 12 state machine. No I/O: datagrams and time in, datagrams, a deadline and
//! events out.

use super::cep::{Cep, Outstanding, State, TimerKind};
use super::peers::{PeerTable, PeerTables};
use super::timers::Timers;
use super::types::{
    ibta_time_ms, AcceptParams, CepHandle, CmError, CmEvent, ConnectParams, EndpointConfig,
    RepInfo, ReqInfo, RetryPolicy, SidrParams, SidrReplyParams, TimedOut, Transmit,
};
use crate::later;
use crate::room::{shrink_deque, shrink_map, too_roomy};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rcm_wire::cm::{
    self, CmMad, CmMessage, Drep, Dreq, Mra, MsgCode, Rej, RejReason, Rep, Req, ReqPath, Rtu,
    SidrRep, SidrReq, SidrStatus, TransportType,
};
use rcm_wire::mad;
use rcm_wire::{tid, Gid};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// Counters of what the endpoint received and did, for tests and diagnostics.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Stats {
    /// MADs that failed to parse.
    pub rx_malformed: u64,
    /// Well-formed MADs that matched no endpoint or were not valid in its state.
    pub rx_unmatched: u64,
    /// Duplicates recognised (REQ, REP, RTU, DREQ, DREP, SIDR_REQ).
    pub rx_duplicates: u64,
    /// REQs dropped because the listener's backlog was full or the endpoint table was
    /// (SIDR_REQs too, past a full endpoint table).
    pub rx_backlog_drops: u64,
    /// SIDR_REQs past a full listener backlog, answered with SIDR_REP(REJECT).
    pub sidr_backlog_rejects: u64,
    /// REQs and REPs answered with REJ(STALE_CONN).
    pub stale_rejects: u64,
    /// REQs answered with REJ(INVALID_SERVICE_ID).
    pub no_listener_rejects: u64,
    /// LAP/APR received and ignored (no path migration on RoCE).
    pub rx_lap_apr_ignored: u64,
    /// MADs queued for transmission.
    pub tx: u64,
    /// Retransmissions among them.
    pub retransmits: u64,
    /// Accepted connections still waiting for their RTU that were given up early because the
    /// half-open budget (`EndpointConfig::max_half_open`) was exceeded.
    pub half_open_evictions: u64,
    /// REQs and REPs answered with REJ(INVALID_COMM_ID): their own comm ID was 0.
    pub invalid_comm_id_rejects: u64,
    /// Walks of the half-open queue to drop the entries that left it (see
    /// `EndpointConfig::max_half_open`).
    pub half_open_compactions: u64,
    /// REQs for a transport other than RC (UC, RD, XRC), answered with
    /// REJ(CONSUMER_DEFINED) as rdma_cm makes ib_cm answer them.
    pub transport_rejects: u64,
    /// Get and Set MADs answered with GetResp, status 0x000C (no attribute is served).
    pub unsupported_get_set: u64,
}

#[derive(Debug, Clone)]
struct Listener {
    service_id: u64,
    mask: u64,
    backlog: usize,
    pending: usize,
}

/// One CM port. See the module documentation.
pub struct Endpoint {
    cfg: EndpointConfig,
    rng: StdRng,
    id_operand: u32,
    next_index: u32,
    next_handle: std::num::NonZeroU64,
    // Keyed by what this side chose (handles, local comm IDs): a fast hash. The tables a
    // peer's values are inserted into (remote IDs, QPNs) keep std's keyed SipHash.
    ceps: foldhash::HashMap<CepHandle, Cep>,
    /// Destroyed endpoints in timewait, kept small: nothing is left of them but their local
    /// comm ID (reserved until the timer ends) and their timer. See `park`.
    parked: foldhash::HashMap<CepHandle, Parked>,
    /// The private data of the DREPs sent, where not empty (rdma_cm sends none, so this is
    /// empty there and costs no endpoint a field): a repeated DREQ in timewait gets the same
    /// DREP again (`cm_dreq_handler` answers with the id's saved private data).
    drep_pd: foldhash::HashMap<CepHandle, Vec<u8>>,
    local_ids: foldhash::HashMap<u32, CepHandle>,
    /// The peer's comm ID and CA GUID, and its QPN and CA GUID, to our endpoint (see
    /// `ib/peers.rs`), and the keyed hash of both.
    remote_ids: PeerTable,
    remote_qps: PeerTable,
    peers: PeerTables,
    sidr_remote: HashMap<(u32, IpAddr), CepHandle>,
    listeners: foldhash::HashMap<CepHandle, Listener>,
    listen_exact: BTreeMap<u64, CepHandle>,
    timers: Timers,
    /// Retransmission records of answered messages, kept for reuse (one allocation per
    /// tracked message otherwise). Boxed: a `Cep` holds its record by pointer, and the
    /// boxes themselves are what is reused.
    #[allow(clippy::vec_box)]
    spare_out: Vec<Box<Outstanding>>,
    transmits: VecDeque<Transmit>,
    events: VecDeque<(CepHandle, CmEvent)>,
    stats: Stats,
    /// Accepted passive connections in order of their REP, for the half-open budget. Entries
    /// of connections that moved on are dropped lazily.
    rep_wait: VecDeque<CepHandle>,
    /// Connections in RepSent or MraRepRcvd (all of them in `rep_wait`), counted at each
    /// transition in or out, so the budget is kept without a walk.
    half_open: usize,
    conn_ceps: usize,
}

/// What is left of a destroyed endpoint in timewait (see `Endpoint::park`).
#[derive(Debug, Clone, Copy)]
struct Parked {
    local_id: u32,
    timer_gen: u32,
}

/// Whether the timer entry `(h, g)` is live: the endpoint's current timer, whether it is
/// whole or parked.
fn timer_live(
    ceps: &foldhash::HashMap<CepHandle, Cep>,
    parked: &foldhash::HashMap<CepHandle, Parked>,
    h: CepHandle,
    g: u32,
) -> bool {
    match ceps.get(&h) {
        Some(c) => c.timer_gen == g && c.timer != TimerKind::None,
        None => parked.get(&h).is_some_and(|p| p.timer_gen == g),
    }
}

/// Whether an endpoint in state `s` counts against the half-open budget.
fn is_half_open(s: State) -> bool {
    matches!(s, State::RepSent | State::MraRepRcvd)
}

/// The longest timewait: the path's ACK timeout decides it, and on the passive side that is
/// the peer's REQ's, up to 4.096 µs × 2^31 (2.4 hours) that a peer could make every
/// connection it ends hold. 30 s is longer than the ACK timeouts rdma_cm sets by default
/// (about 2 s on RoCE), not than all it may: a peer that asked for more with
/// `rdma_set_ack_timeout` (24 gives 65 s) waits longer in its timewait than we do in ours,
/// a deliberate bound (Linux's cm.c has none).
pub const MAX_TIMEWAIT: Duration = Duration::from_secs(30);

/// Retransmission records an endpoint keeps for reuse.
const SPARE_OUT: usize = 64;

/// The backlog a listener gets when the caller passes 0 (Linux's iWARP default, ucma's cap
/// is 1024).
pub const DEFAULT_BACKLOG: usize = 256;

impl Endpoint {
    /// A new endpoint.
    pub fn new(cfg: EndpointConfig) -> Self {
        let mut rng = StdRng::seed_from_u64(cfg.seed);
        let id_operand = rng.gen();
        let next_index = rng.gen();
        Endpoint {
            cfg,
            rng,
            id_operand,
            next_index,
            next_handle: std::num::NonZeroU64::MIN,
            ceps: foldhash::HashMap::default(),
            parked: foldhash::HashMap::default(),
            drep_pd: foldhash::HashMap::default(),
            local_ids: foldhash::HashMap::default(),
            remote_ids: PeerTable::default(),
            remote_qps: PeerTable::default(),
            peers: PeerTables::default(),
            sidr_remote: HashMap::new(),
            listeners: foldhash::HashMap::default(),
            listen_exact: BTreeMap::new(),
            timers: Timers::default(),
            spare_out: Vec::new(),
            transmits: VecDeque::new(),
            events: VecDeque::new(),
            stats: Stats::default(),
            rep_wait: VecDeque::new(),
            half_open: 0,
            conn_ceps: 0,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &EndpointConfig {
        &self.cfg
    }

    /// Counters.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// The state of a handle's endpoint (`None` once destroyed).
    pub fn state(&self, h: CepHandle) -> Option<State> {
        self.ceps.get(&h).filter(|c| !c.orphan).map(|c| c.state)
    }

    /// The local communication ID of a handle's endpoint.
    pub fn local_comm_id(&self, h: CepHandle) -> Option<u32> {
        self.ceps.get(&h).filter(|c| !c.orphan).map(|c| c.local_id)
    }

    /// Connection endpoints held, including destroyed ones still in timewait (listeners
    /// excluded).
    pub fn cep_count(&self) -> usize {
        self.conn_ceps
    }

    /// Bytes the endpoint's tables have room for (their capacity, not what they hold): what a
    /// flood of connections leaves behind. A table with more than 16 KiB of room gives most
    /// of it back once it is a quarter full (timer expiries and removals look; see
    /// [`crate::room`]).
    pub fn table_bytes(&self) -> usize {
        use crate::room::map_bytes as map;
        use std::mem::size_of;
        let peer = PeerTable::ENTRY + 1;
        map(&self.ceps)
            + map(&self.parked)
            + map(&self.drep_pd)
            + map(&self.local_ids)
            + map(&self.sidr_remote)
            + map(&self.listeners)
            + (self.remote_ids.capacity() + self.remote_qps.capacity()) * peer
            + self.transmits.capacity() * size_of::<Transmit>()
            + self.events.capacity() * size_of::<(CepHandle, CmEvent)>()
            + self.rep_wait.capacity() * size_of::<CepHandle>()
            + self.timers.bytes()
    }

    /// Gives back the room of tables a flood left mostly empty (see [`crate::room`]).
    fn shrink_tables(&mut self) {
        shrink_map(&mut self.ceps);
        shrink_map(&mut self.parked);
        shrink_map(&mut self.drep_pd);
        shrink_map(&mut self.local_ids);
        shrink_map(&mut self.sidr_remote);
        shrink_map(&mut self.listeners);
        for t in [&mut self.remote_ids, &mut self.remote_qps] {
            if too_roomy(t.capacity(), t.len(), PeerTable::ENTRY) {
                self.peers.shrink_to(t, 2 * t.len());
            }
        }
        shrink_deque(&mut self.transmits);
        shrink_deque(&mut self.events);
        if self.half_open == 0 {
            // Only entries of connections that moved on, dropped lazily: none is needed.
            self.rep_wait.clear();
        }
        shrink_deque(&mut self.rep_wait);
        self.timers.shrink();
    }

    /// How many connection endpoints are in each state (by the state's name), for
    /// diagnosing a connection that does not end.
    pub fn cep_states(&self) -> std::collections::BTreeMap<String, usize> {
        let mut m = std::collections::BTreeMap::new();
        for c in self.ceps.values().filter(|c| c.state != State::Listen) {
            let name = if c.orphan {
                format!("{:?} (orphan)", c.state)
            } else {
                format!("{:?}", c.state)
            };
            *m.entry(name).or_default() += 1;
        }
        if !self.parked.is_empty() {
            *m.entry(format!("{:?} (orphan)", State::Timewait))
                .or_default() += self.parked.len();
        }
        m
    }

    /// Entries in the lookup tables and timer heap, for leak checks.
    pub fn table_sizes(&self) -> (usize, usize, usize, usize, usize) {
        (
            self.local_ids.len(),
            self.remote_ids.len(),
            self.remote_qps.len(),
            self.sidr_remote.len(),
            self.timers.len(),
        )
    }

    // ----- outputs -----------------------------------------------------------------------

    /// The next MAD to send.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        let t = self.transmits.pop_front();
        if t.is_none() {
            // Emptied: a burst's queue gives its room back.
            shrink_deque(&mut self.transmits);
        }
        t
    }

    /// The next event.
    pub fn poll_event(&mut self) -> Option<(CepHandle, CmEvent)> {
        let e = self.events.pop_front();
        if e.is_none() {
            shrink_deque(&mut self.events);
        }
        e
    }

    /// Moves every queued MAD to the end of `out`, in order ([`Endpoint::poll_transmit`]
    /// for all of them at once; into an empty `out` the lists trade places, nothing is
    /// copied).
    pub fn take_transmits(&mut self, out: &mut Vec<Transmit>) {
        if self.transmits.is_empty() {
            return;
        }
        if out.is_empty() {
            let mine = std::mem::replace(&mut self.transmits, VecDeque::from(std::mem::take(out)));
            *out = Vec::from(mine);
        } else {
            out.extend(self.transmits.drain(..));
        }
    }

    /// Moves every queued event to the end of `out`, in order ([`Endpoint::poll_event`]
    /// for all of them at once).
    pub fn take_events(&mut self, out: &mut VecDeque<(CepHandle, CmEvent)>) {
        if self.events.is_empty() {
            return;
        }
        if out.is_empty() {
            std::mem::swap(&mut self.events, out);
        } else {
            out.append(&mut self.events);
        }
    }

    /// When `handle_timeout` must next be called.
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        let (ceps, parked) = (&self.ceps, &self.parked);
        self.timers.prune(|h, g| timer_live(ceps, parked, h, g));
        self.timers.peek()
    }

    /// The earliest deadline a timer was armed for since the last call (none: no timer
    /// was). For a driver that sleeps until [`Endpoint::poll_timeout`] and, after each
    /// command, only needs to know whether that sleep must end sooner: this looks at no
    /// timer, where `poll_timeout` first skips the ones gone stale. A timer cancelled
    /// meanwhile at most wakes the driver early; `handle_timeout` then finds nothing due.
    pub fn poll_armed(&mut self) -> Option<Instant> {
        self.timers.take_armed()
    }

    // ----- helpers -----------------------------------------------------------------------

    fn new_handle(&mut self) -> CepHandle {
        let h = CepHandle(self.next_handle);
        self.next_handle = self.next_handle.saturating_add(1);
        h
    }

    /// Local comm IDs are a cyclic index XOR a random operand, as Linux builds them: unique,
    /// unpredictable on the wire, and never one still held (timewait included).
    fn alloc_local_id(&mut self) -> u32 {
        loop {
            let id = self.next_index ^ self.id_operand;
            self.next_index = self.next_index.wrapping_add(1);
            if id != 0 && !self.local_ids.contains_key(&id) {
                return id;
            }
        }
    }

    fn random_psn(&mut self) -> u32 {
        self.rng.gen::<u32>() & 0xFF_FFFF
    }

    fn emit(&mut self, h: CepHandle, ev: CmEvent) {
        if self.ceps.get(&h).is_some_and(|c| !c.orphan) {
            self.events.push_back((h, ev));
        }
    }

    /// Queues `msg` for `dst`; whether it could be encoded (then it is the last of
    /// `transmits`, for a tracked send to keep).
    fn send(&mut self, dst: IpAddr, tid: u64, msg: CmMessage) -> bool {
        // Encoded where it waits to be sent: a MAD is 256 bytes, each copy shows.
        self.transmits.push_back(Transmit { dst, mad: [0; 256] });
        let encoded = match self.transmits.back_mut() {
            Some(t) => CmMad::send(tid, msg).emit_into(&mut t.mad).is_ok(),
            None => false,
        };
        if encoded {
            self.stats.tx += 1;
        } else {
            // Only caller-supplied data can fail to encode, and commands check it first.
            self.transmits.pop_back();
        }
        encoded
    }

    fn arm(&mut self, h: CepHandle, at: Instant, kind: TimerKind) {
        if let Some(c) = self.ceps.get_mut(&h) {
            let replaced = c.timer != TimerKind::None;
            c.timer_gen = c.timer_gen.wrapping_add(1);
            c.timer = kind;
            // Timewaits in a lane of their own: they last a path's ACK timeout, the other
            // timers a message's wait (see `timers`).
            let lane = usize::from(kind == TimerKind::Timewait);
            self.timers.arm(at, h, c.timer_gen, lane);
            if replaced {
                self.timer_went_stale();
            }
        }
    }

    fn cancel_timer(&mut self, h: CepHandle) {
        if let Some(c) = self.ceps.get_mut(&h) {
            let had = c.timer != TimerKind::None;
            c.timer_gen = c.timer_gen.wrapping_add(1);
            c.timer = TimerKind::None;
            let out = c.out.take();
            if had {
                self.timer_went_stale();
            }
            self.recycle_out(out);
        }
    }

    /// Keeps an answered message's retransmission record for the next tracked send.
    fn recycle_out(&mut self, out: Option<Box<Outstanding>>) {
        if let Some(b) = out {
            if self.spare_out.len() < SPARE_OUT {
                self.spare_out.push(b);
            }
        }
    }

    /// Drops the timer entries no endpoint's timer is any more and gives back their room
    /// now, rather than once they are half of all entries (see `Timers::note_stale`): up to
    /// a thousand or so per engine otherwise stay until then, 32 bytes each. For
    /// measurements of what connections hold.
    pub fn sweep_timers(&mut self) {
        let (ceps, parked) = (&self.ceps, &self.parked);
        self.timers.sweep(|h, g| timer_live(ceps, parked, h, g));
    }

    /// A heap entry no longer names a live timer (see `Timers::note_stale`).
    fn timer_went_stale(&mut self) {
        let (ceps, parked) = (&self.ceps, &self.parked);
        self.timers
            .note_stale(|h, g| timer_live(ceps, parked, h, g));
    }

    /// The first wait and deadline for a message with classic interval `timeout_ms`.
    fn first_wait(&self, now: Instant, timeout_ms: u32) -> (Duration, Option<Instant>) {
        match self.cfg.retry {
            RetryPolicy::Classic => (Duration::from_millis(timeout_ms.into()), None),
            RetryPolicy::Backoff {
                initial,
                max_wait,
                deadline,
            } => (initial.min(max_wait), Some(later(now, deadline))),
        }
    }

    /// Sends `msg` and keeps it for retransmission until answered.
    fn send_tracked(&mut self, now: Instant, h: CepHandle, msg: CmMessage) {
        let Some(c) = self.ceps.get(&h) else { return };
        let (dst, tid, timeout_ms) = (c.peer, c.tid, c.timeout_ms);
        // `send` leaves the MAD it queued last in `transmits`.
        let Some(sent) = self
            .send(dst, tid, msg)
            .then(|| self.transmits.back())
            .flatten()
        else {
            return;
        };
        let (wait, deadline) = self.first_wait(now, timeout_ms);
        let out = Outstanding {
            mad: sent.mad,
            retries_done: 0,
            next_wait: wait,
            deadline,
            stretched: false,
        };
        let out = match self.spare_out.pop() {
            Some(mut b) => {
                *b = out;
                b
            }
            None => Box::new(out),
        };
        if let Some(c) = self.ceps.get_mut(&h) {
            c.out = Some(out);
        }
        // Not past the deadline, as no later wait is: a first wait longer than the whole
        // exchange would end it without a single retry.
        let at = later(now, wait);
        self.arm(h, deadline.map_or(at, |d| at.min(d)), TimerKind::Retransmit);
    }

    fn insert_cep(&mut self, c: Cep) -> CepHandle {
        let h = self.new_handle();
        if c.state != State::Listen {
            self.conn_ceps += 1;
        }
        self.local_ids.insert(c.local_id, h);
        self.ceps.insert(h, c);
        h
    }

    /// Removes the endpoint and every table entry naming it.
    fn remove_cep(&mut self, h: CepHandle) {
        let Some(c) = self.ceps.remove(&h) else {
            return;
        };
        self.forget_drep_pd(h);
        if c.timer != TimerKind::None {
            self.timer_went_stale();
        }
        if c.state != State::Listen {
            self.conn_ceps -= 1;
        }
        if is_half_open(c.state) {
            self.left_half_open();
        }
        if self.local_ids.get(&c.local_id) == Some(&h) {
            self.local_ids.remove(&c.local_id);
        }
        self.unlink_remote(&c, h);
        if let Some(l) = c.listener.and_then(|l| self.listeners.get_mut(&l)) {
            l.pending = l.pending.saturating_sub(1);
        }
        // Endpoints that end without a timer (rejected, destroyed before an answer) leave
        // no expiry to look at the tables: the biggest one's removals do.
        if too_roomy(
            self.ceps.capacity(),
            self.ceps.len(),
            std::mem::size_of::<(CepHandle, Cep)>(),
        ) {
            self.shrink_tables();
        }
    }

    fn unlink_remote(&mut self, c: &Cep, h: CepHandle) {
        self.unlink_remote_keys(h, c.remote_id, c.remote_guid, c.remote_qpn, c.peer);
    }

    fn unlink_remote_keys(
        &mut self,
        h: CepHandle,
        remote_id: u32,
        remote_guid: u64,
        remote_qpn: u32,
        peer: IpAddr,
    ) {
        // One hash per table (these are keyed by the peer's values, with SipHash), and
        // none for a table that is empty (no SIDR traffic, say).
        fn unlink<K: std::hash::Hash + Eq>(m: &mut HashMap<K, CepHandle>, k: K, h: CepHandle) {
            if m.is_empty() {
                return;
            }
            if let std::collections::hash_map::Entry::Occupied(e) = m.entry(k) {
                if *e.get() == h {
                    e.remove();
                }
            }
        }
        for (t, id) in [
            (&mut self.remote_ids, remote_id),
            (&mut self.remote_qps, remote_qpn),
        ] {
            if !t.is_empty() {
                t.remove_if(self.peers.key(id, remote_guid), h);
            }
        }
        unlink(&mut self.sidr_remote, (remote_id, peer), h);
    }

    /// Leaves the listener's backlog (the request was answered one way or another).
    fn unlink_listener(&mut self, h: CepHandle) {
        let l = self.ceps.get_mut(&h).and_then(|c| c.listener.take());
        if let Some(l) = l.and_then(|l| self.listeners.get_mut(&l)) {
            l.pending = l.pending.saturating_sub(1);
        }
    }

    /// Moves to Idle and drops the remote tables (Linux `cm_reset_to_idle`).
    fn reset_to_idle(&mut self, h: CepHandle) {
        self.cancel_timer(h);
        self.unlink_listener(h);
        let Some(c) = self.ceps.get(&h) else { return };
        if c.orphan {
            self.remove_cep(h);
            return;
        }
        let c = c.clone();
        self.unlink_remote(&c, h);
        if is_half_open(c.state) {
            self.left_half_open();
        }
        if let Some(c) = self.ceps.get_mut(&h) {
            c.state = State::Idle;
        }
    }

    /// Enters timewait for the path's ACK timeout. The local comm ID stays reserved; the
    /// peer's comm ID and QPN are released at once, as Linux's `cm_enter_timewait` does
    /// (`cm_remove_remote`): a new REQ or REP from the peer reusing its QPN (cmtime's
    /// invented QPNs repeat, drivers hand out the lowest free one) is a new connection, not
    /// a stale one, and a Linux peer would be refused where a Linux CM accepts.
    fn enter_timewait(&mut self, now: Instant, h: CepHandle) {
        self.cancel_timer(h);
        self.unlink_listener(h);
        let Some(c) = self.ceps.get_mut(&h) else {
            return;
        };
        let was_half_open = is_half_open(c.state);
        c.state = State::Timewait;
        let wait = Duration::from_millis(ibta_time_ms(c.ack_timeout))
            .min(MAX_TIMEWAIT)
            .max(self.cfg.min_timewait);
        let (remote_id, remote_guid, remote_qpn, peer) =
            (c.remote_id, c.remote_guid, c.remote_qpn, c.peer);
        self.unlink_remote_keys(h, remote_id, remote_guid, remote_qpn, peer);
        if was_half_open {
            self.left_half_open();
        }
        self.arm(h, later(now, wait), TimerKind::Timewait);
        self.park(h);
    }

    fn find_listener(&self, service_id: u64) -> Option<CepHandle> {
        if let Some(h) = self.listen_exact.get(&service_id) {
            return Some(*h);
        }
        self.listeners
            .iter()
            .filter(|(_, l)| l.mask != u64::MAX && service_id & l.mask == l.service_id & l.mask)
            .min_by_key(|(h, _)| **h)
            .map(|(h, _)| *h)
    }

    /// The endpoint a message names: our comm ID, from the peer we talk to, and its comm ID
    /// if we learned it. Before we did (ReqSent, MraReqRcvd) any comm ID of the peer's
    /// matches: a REJ(OTHER) the peer sends after its REP was lost ends our attempt at once.
    /// (Linux's `cm_acquire_rejected_id` looks such a REJ up by both IDs, finds nothing, and
    /// goes on retrying the REQ, which the peer, past it, takes as a new request.)
    fn lookup(&self, local_id: u32, remote_id: u32, from: IpAddr) -> Option<CepHandle> {
        let h = *self.local_ids.get(&local_id)?;
        let c = self.ceps.get(&h)?;
        (c.peer == from
            && (c.remote_id == remote_id || c.remote_id == 0)
            && c.state != State::Listen)
            .then_some(h)
    }

    /// Drops `h`'s saved DREP private data. The table is empty unless someone disconnects
    /// with private data (rdma_cm never does), and then costs no hashing.
    fn forget_drep_pd(&mut self, h: CepHandle) {
        if !self.drep_pd.is_empty() {
            self.drep_pd.remove(&h);
        }
    }

    // ----- commands ----------------------------------------------------------------------

    /// Listens on `service_id` (exact match when `mask` is all ones; else every service ID
    /// equal under `mask`, as rdma_cm's port-space ranges). `backlog` bounds the requests
    /// received but not yet answered (0 means [`DEFAULT_BACKLOG`]); beyond it new REQs are
    /// dropped so the peer retries, and new SIDR_REQs are answered with SIDR_REP(REJECT), as
    /// Linux does.
    pub fn listen(
        &mut self,
        service_id: u64,
        mask: u64,
        backlog: usize,
    ) -> Result<CepHandle, CmError> {
        let clash = self.listeners.values().any(|l| {
            let m = l.mask & mask;
            l.service_id & m == service_id & m
        });
        if clash {
            return Err(CmError::AddressInUse(service_id));
        }
        let h = self.new_handle();
        let mut c = Cep::new(State::Listen, 0, self.cfg.local_addr);
        c.service_id = service_id;
        self.ceps.insert(h, c);
        let backlog = if backlog == 0 {
            DEFAULT_BACKLOG
        } else {
            backlog
        };
        self.listeners.insert(
            h,
            Listener {
                service_id,
                mask,
                backlog,
                pending: 0,
            },
        );
        if mask == u64::MAX {
            self.listen_exact.insert(service_id, h);
        }
        Ok(h)
    }

    /// Sends a REQ (active side). The new endpoint is in ReqSent.
    pub fn connect(&mut self, now: Instant, p: &ConnectParams) -> Result<CepHandle, CmError> {
        check_pd("REQ", &p.private_data, cm::pd_size::REQ)?;
        if self.conn_ceps >= self.cfg.max_ceps {
            return Err(CmError::NoResources);
        }
        let local_id = self.alloc_local_id();
        let psn = p.starting_psn.unwrap_or_else(|| self.random_psn());
        let ack_timeout =
            super::types::cm_ack_timeout(self.cfg.ca_ack_delay, p.path.packet_life_time);
        let req = Req {
            local_comm_id: local_id,
            service_id: p.service_id,
            local_ca_guid: self.cfg.ca_guid,
            local_qpn: p.qpn & 0xFF_FFFF,
            responder_resources: p.responder_resources,
            initiator_depth: p.initiator_depth,
            remote_cm_response_timeout: p.cm_response_timeout.min(31),
            transport_type: TransportType::Rc,
            starting_psn: psn & 0xFF_FFFF,
            local_cm_response_timeout: p.cm_response_timeout.min(31),
            retry_count: p.retry_count.min(7),
            pkey: 0xFFFF,
            path_mtu: p.path.mtu & 0xF,
            rnr_retry_count: p.rnr_retry_count.min(7),
            max_cm_retries: p.max_cm_retries.min(15),
            srq: p.srq,
            primary_path: ReqPath {
                local_lid: if p.path.hop_limit > 1 { 0xFFFF } else { 0 },
                remote_lid: if p.path.hop_limit > 1 { 0xFFFF } else { 0 },
                local_gid: Gid::from_ip(self.cfg.local_addr),
                remote_gid: Gid::from_ip(p.dst),
                flow_label: p.path.flow_label & 0xF_FFFF,
                packet_rate: p.path.rate & 0x3F,
                traffic_class: p.path.traffic_class,
                hop_limit: p.path.hop_limit,
                sl: p.path.sl & 0xF,
                subnet_local: p.path.hop_limit <= 1,
                local_ack_timeout: ack_timeout,
                ..ReqPath::default()
            },
            private_data: p.private_data.clone(),
            ..Req::default()
        };
        let mut c = Cep::new(State::ReqSent, local_id, p.dst);
        c.local_qpn = req.local_qpn;
        c.service_id = p.service_id;
        c.tid = tid::linux_tid(self.cfg.agent_id, local_id);
        c.req_tid = c.tid;
        c.timeout_ms = (2 * ibta_time_ms(p.path.packet_life_time)
            + ibta_time_ms(p.cm_response_timeout)) as u32;
        c.max_retries = req.max_cm_retries;
        // Until the REP, Linux's av.timeout is the path's packet lifetime + 1
        // (cm_init_av_by_path); only the REQ's field is cm_ack_timeout. An MRA's wait and a
        // timewait entered before the REP use it.
        c.ack_timeout = p.path.packet_life_time.saturating_add(1).min(31);
        c.packet_life_time = p.path.packet_life_time;
        c.establish_on_rep = p.establish_on_rep;
        let h = self.insert_cep(c);
        self.send_tracked(now, h, CmMessage::Req(req));
        Ok(h)
    }

    fn cep_mut(&mut self, h: CepHandle) -> Result<&mut Cep, CmError> {
        self.ceps
            .get_mut(&h)
            .filter(|c| !c.orphan)
            .ok_or(CmError::UnknownHandle)
    }

    /// Answers a received REQ with a REP (passive side): ReqRcvd/MraReqSent → RepSent.
    pub fn accept(&mut self, now: Instant, h: CepHandle, p: &AcceptParams) -> Result<(), CmError> {
        check_pd("REP", &p.private_data, cm::pd_size::REP)?;
        let state = self.cep_mut(h)?.state;
        if !matches!(state, State::ReqRcvd | State::MraReqSent) {
            return Err(CmError::InvalidState(state));
        }
        let psn = p.starting_psn.unwrap_or_else(|| self.random_psn());
        let ack_delay = self.cfg.ca_ack_delay;
        let guid = self.cfg.ca_guid;
        let c = self.cep_mut(h)?;
        c.local_qpn = p.qpn & 0xFF_FFFF;
        c.state = State::RepSent;
        let rep = Rep {
            local_comm_id: c.local_id,
            remote_comm_id: c.remote_id,
            local_qpn: c.local_qpn,
            starting_psn: psn & 0xFF_FFFF,
            responder_resources: p.responder_resources,
            initiator_depth: p.initiator_depth,
            target_ack_delay: ack_delay.min(31),
            rnr_retry_count: p.rnr_retry_count.min(7),
            srq: p.srq,
            local_ca_guid: guid,
            private_data: p.private_data.clone(),
            ..Rep::default()
        };
        self.unlink_listener(h);
        self.cancel_timer(h);
        self.send_tracked(now, h, CmMessage::Rep(rep));
        self.note_half_open(h);
        Ok(())
    }

    /// Keeps accepted-but-unconfirmed connections within `max_half_open`. A REQ flood from
    /// spoofed addresses that a server accepts leaves connections waiting for RTUs that never
    /// come, each with REP retransmissions; past the budget the oldest of them are given up
    /// (as a REP timeout, without a REJ towards the spoofed address). Legitimate connections
    /// confirm within a round trip, so under a flood the oldest entries are the flood's.
    /// The count is kept at each transition, so only a connection over the budget is given
    /// up; entries of connections that moved on are skipped when met at the front, and the
    /// queue is walked to drop them once they could be half of it, so a walk's cost is
    /// spread over as many accepts. (Walking it whenever it outgrew the budget meant a full
    /// walk every few accepts when it hovered just under it, entries leaving as fast as
    /// they came.)
    fn note_half_open(&mut self, h: CepHandle) {
        let max = self.cfg.max_half_open.max(1);
        self.half_open += 1;
        self.rep_wait.push_back(h);
        // The count against the states, in the tests' builds (small tables only: a walk).
        #[cfg(debug_assertions)]
        if self.ceps.len() <= 4096 {
            let walked = self.ceps.values().filter(|c| is_half_open(c.state)).count();
            debug_assert_eq!(walked, self.half_open, "half-open count");
        }
        while self.half_open > max {
            let Some(old) = self.rep_wait.pop_front() else {
                break;
            };
            if self.ceps.get(&old).is_some_and(|c| is_half_open(c.state)) {
                self.stats.half_open_evictions += 1;
                self.reset_to_idle(old);
                self.emit(old, CmEvent::TimedOut(TimedOut::Rep));
            }
        }
        if self.rep_wait.len() > 2 * self.half_open + 64 {
            self.stats.half_open_compactions += 1;
            let ceps = &self.ceps;
            self.rep_wait
                .retain(|h| ceps.get(h).is_some_and(|c| is_half_open(c.state)));
            debug_assert_eq!(self.rep_wait.len(), self.half_open, "half-open count");
        }
    }

    /// One connection left RepSent/MraRepRcvd.
    fn left_half_open(&mut self) {
        debug_assert!(self.half_open > 0, "half-open count");
        self.half_open = self.half_open.saturating_sub(1);
    }

    /// Undoes [`ConnectParams::establish_on_rep`] for a connect whose REP has not come: the
    /// QP it was for is gone (Linux's `cma_rep_recv` moves a QP and sends the RTU only for
    /// an id that still has one), so the REP is reported without the RTU and
    /// [`Endpoint::establish`] sends it. After the REP it changes nothing.
    pub fn leave_rtu_to_caller(&mut self, h: CepHandle) -> Result<(), CmError> {
        self.cep_mut(h)?.establish_on_rep = false;
        Ok(())
    }

    /// Sends the RTU after a REP (active side): RepRcvd/MraRepSent → Established.
    pub fn establish(&mut self, h: CepHandle) -> Result<(), CmError> {
        let c = self.cep_mut(h)?;
        if !matches!(c.state, State::RepRcvd | State::MraRepSent) {
            return Err(CmError::InvalidState(c.state));
        }
        c.state = State::Established;
        let (peer, tid, rtu) = (c.peer, c.req_tid, rtu_of(c));
        self.cancel_timer(h);
        self.send(peer, tid, CmMessage::Rtu(rtu));
        self.emit(h, CmEvent::Established);
        Ok(())
    }

    /// The QP saw the peer's data before the RTU (its `COMM_EST` async event): the passive
    /// side is established without it, as `ib_cm_notify(IB_EVENT_COMM_EST)` makes it in
    /// Linux (cm.c `cm_establish`): RepSent/MraRepRcvd → Established, the REP is no longer
    /// retried, and `Established` is emitted. An RTU that comes later is a duplicate.
    /// Already established, or any other state: `InvalidState` (Linux: -EISCONN, -EINVAL).
    pub fn notify_established(&mut self, h: CepHandle) -> Result<(), CmError> {
        let c = self.cep_mut(h)?;
        if !matches!(c.state, State::RepSent | State::MraRepRcvd) {
            return Err(CmError::InvalidState(c.state));
        }
        c.state = State::Established;
        self.left_half_open();
        self.cancel_timer(h);
        self.emit(h, CmEvent::Established);
        Ok(())
    }

    /// Tells the peer we need more time (`service_timeout`, IBTA time value). With `lazy`
    /// the MRA is only sent when a duplicate REQ/REP shows the peer is retrying, as rdma_cm
    /// does. ReqRcvd → MraReqSent; RepRcvd → MraRepSent. Once only, as cm.c's
    /// `ib_send_cm_mra`: an MRA state refuses a second call.
    pub fn mra(&mut self, h: CepHandle, service_timeout: u8, lazy: bool) -> Result<(), CmError> {
        let c = self.cep_mut(h)?;
        c.state = match c.state {
            State::ReqRcvd => State::MraReqSent,
            State::RepRcvd => State::MraRepSent,
            s => return Err(CmError::InvalidState(s)),
        };
        c.mra_timeout = service_timeout.min(31);
        c.mra_sent = !lazy;
        if !lazy {
            let (peer, tid, mra) = (c.peer, c.req_tid, mra_of(c));
            self.send(peer, tid, CmMessage::Mra(mra));
        }
        Ok(())
    }

    /// Rejects (IBTA 12.6.7): from a request/reply phase state the endpoint goes Idle (or to
    /// timewait when a QP may already be live: RepSent, MraRepRcvd).
    pub fn reject(
        &mut self,
        now: Instant,
        h: CepHandle,
        reason: RejReason,
        ari: &[u8],
        private_data: &[u8],
    ) -> Result<(), CmError> {
        check_pd("REJ", private_data, cm::pd_size::REJ)?;
        check_pd("REJ ARI", ari, cm::pd_size::REJ_ARI)?;
        let state = self.cep_mut(h)?.state;
        let msg = match state {
            State::ReqRcvd | State::MraReqSent => MsgCode::Req,
            State::RepRcvd | State::MraRepSent => MsgCode::Rep,
            State::ReqSent | State::MraReqRcvd | State::RepSent | State::MraRepRcvd => {
                MsgCode::Other
            }
            s => return Err(CmError::InvalidState(s)),
        };
        self.send_rej(h, msg, reason, ari, private_data);
        if matches!(state, State::RepSent | State::MraRepRcvd) {
            self.enter_timewait(now, h);
        } else {
            self.reset_to_idle(h);
        }
        Ok(())
    }

    fn send_rej(&mut self, h: CepHandle, msg: MsgCode, reason: RejReason, ari: &[u8], pd: &[u8]) {
        let Some(c) = self.ceps.get(&h) else { return };
        // Linux `cm_format_rej`: rejecting from REQ_RCVD, the peer has not learned our comm
        // ID yet and the field is 0; from MRA_REQ_SENT on (an MRA carried it) it is ours.
        let local_comm_id = if c.state == State::ReqRcvd {
            0
        } else {
            c.local_id
        };
        let rej = Rej {
            local_comm_id,
            remote_comm_id: c.remote_id,
            message_rejected: msg,
            reject_info_length: ari.len() as u8,
            reason,
            ari: ari.to_vec(),
            private_data: pd.to_vec(),
            ..Rej::default()
        };
        let (peer, tid) = (c.peer, c.req_tid);
        self.send(peer, tid, CmMessage::Rej(rej));
    }

    /// Disconnects: from Established sends a DREQ (→ DreqSent, retried); from DreqRcvd sends
    /// the DREP (→ Timewait).
    pub fn disconnect(
        &mut self,
        now: Instant,
        h: CepHandle,
        private_data: &[u8],
    ) -> Result<(), CmError> {
        let agent = self.cfg.agent_id;
        let c = self.cep_mut(h)?;
        // The limit of the message this sends: DREQ (220) or DREP (224).
        match c.state {
            State::DreqRcvd => check_pd("DREP", private_data, cm::pd_size::DREP)?,
            _ => check_pd("DREQ", private_data, cm::pd_size::DREQ)?,
        }
        let c = self.cep_mut(h)?;
        match c.state {
            State::Established => {
                c.state = State::DreqSent;
                c.tid = tid::linux_tid(agent, c.local_id);
                let dreq = Dreq {
                    local_comm_id: c.local_id,
                    remote_comm_id: c.remote_id,
                    remote_qpn: c.remote_qpn,
                    private_data: private_data.to_vec(),
                    ..Dreq::default()
                };
                self.cancel_timer(h);
                self.send_tracked(now, h, CmMessage::Dreq(dreq));
            }
            State::DreqRcvd => {
                let (peer, tid) = (c.peer, c.tid);
                let drep = Drep {
                    local_comm_id: c.local_id,
                    remote_comm_id: c.remote_id,
                    private_data: private_data.to_vec(),
                };
                if !private_data.is_empty() {
                    self.drep_pd.insert(h, private_data.to_vec());
                }
                // Timewait first, so a failed send still lands there (as Linux does).
                self.enter_timewait(now, h);
                self.send(peer, tid, CmMessage::Drep(drep));
            }
            s => return Err(CmError::InvalidState(s)),
        }
        Ok(())
    }

    /// Sends a SIDR_REQ (UD service resolution). The endpoint ends Idle when answered.
    pub fn sidr_request(&mut self, now: Instant, p: &SidrParams) -> Result<CepHandle, CmError> {
        check_pd("SIDR_REQ", &p.private_data, cm::pd_size::SIDR_REQ)?;
        if self.conn_ceps >= self.cfg.max_ceps {
            return Err(CmError::NoResources);
        }
        let local_id = self.alloc_local_id();
        let mut c = Cep::new(State::SidrReqSent, local_id, p.dst);
        c.service_id = p.service_id;
        c.tid = tid::linux_tid(self.cfg.agent_id, local_id);
        c.req_tid = c.tid;
        c.timeout_ms = ibta_time_ms(p.timeout) as u32;
        c.max_retries = p.max_retries;
        let req = SidrReq {
            request_id: local_id,
            pkey: 0xFFFF,
            service_id: p.service_id,
            private_data: p.private_data.clone(),
            ..SidrReq::default()
        };
        let h = self.insert_cep(c);
        self.send_tracked(now, h, CmMessage::SidrReq(req));
        Ok(h)
    }

    /// Answers a SIDR_REQ; the endpoint is done (Idle) afterwards.
    pub fn sidr_reply(&mut self, h: CepHandle, p: &SidrReplyParams) -> Result<(), CmError> {
        check_pd("SIDR_REP", &p.private_data, cm::pd_size::SIDR_REP)?;
        let c = self.cep_mut(h)?;
        if c.state != State::SidrReqRcvd {
            return Err(CmError::InvalidState(c.state));
        }
        let rep = SidrRep {
            request_id: c.remote_id,
            status: p.status,
            qpn: p.qpn & 0xFF_FFFF,
            service_id: c.service_id,
            qkey: p.qkey,
            private_data: p.private_data.clone(),
            ..SidrRep::default()
        };
        let (peer, tid) = (c.peer, c.tid);
        self.send(peer, tid, CmMessage::SidrRep(rep));
        self.reset_to_idle(h);
        Ok(())
    }

    /// Destroys a handle (Linux `cm_destroy_id`): the protocol is driven to a clean end
    /// (REJ, DREQ or DREP as the state requires), no event is ever reported for the handle
    /// again, and events still queued for it are discarded. An endpoint that must still sit
    /// out timewait does so invisibly. Destroying a listener rejects the requests it received
    /// whose events were not yet taken.
    pub fn destroy(&mut self, now: Instant, h: CepHandle) -> Result<(), CmError> {
        let state = self.cep_mut(h)?.state;
        // Events not yet taken die with the handle; children nobody has seen die too.
        let mut orphans = Vec::new();
        self.events.retain(|(eh, ev)| match ev {
            CmEvent::ReqReceived { listener, cep, .. }
            | CmEvent::SidrReqReceived { listener, cep, .. }
                if *listener == h =>
            {
                orphans.push(*cep);
                false
            }
            _ => *eh != h,
        });
        for child in orphans {
            let _ = self.destroy(now, child);
        }
        let guid = self.cfg.ca_guid;
        match state {
            State::Listen => {
                if let Some(l) = self.listeners.remove(&h) {
                    if self.listen_exact.get(&l.service_id) == Some(&h) {
                        self.listen_exact.remove(&l.service_id);
                    }
                }
                for c in self.ceps.values_mut() {
                    if c.listener == Some(h) {
                        c.listener = None;
                    }
                }
                self.ceps.remove(&h);
                return Ok(());
            }
            State::ReqSent | State::MraReqRcvd => {
                self.send_rej(
                    h,
                    MsgCode::Other,
                    RejReason::Timeout,
                    &guid.to_be_bytes(),
                    &[],
                );
            }
            State::ReqRcvd | State::MraReqSent => {
                self.send_rej(h, MsgCode::Req, RejReason::ConsumerDefined, &[], &[]);
            }
            State::RepRcvd | State::MraRepSent => {
                self.send_rej(h, MsgCode::Rep, RejReason::ConsumerDefined, &[], &[]);
            }
            State::RepSent | State::MraRepRcvd => {
                self.send_rej(h, MsgCode::Other, RejReason::ConsumerDefined, &[], &[]);
                self.orphan_into_timewait(now, h);
                return Ok(());
            }
            State::Established => {
                // Fire and forget (Linux cm_issue_dreq): nobody is left to wait for the DREP.
                if let Some(c) = self.ceps.get(&h) {
                    let dreq = Dreq {
                        local_comm_id: c.local_id,
                        remote_comm_id: c.remote_id,
                        remote_qpn: c.remote_qpn,
                        ..Dreq::default()
                    };
                    let (peer, tid) = (c.peer, tid::linux_tid(self.cfg.agent_id, c.local_id));
                    self.send(peer, tid, CmMessage::Dreq(dreq));
                }
                self.orphan_into_timewait(now, h);
                return Ok(());
            }
            State::DreqSent => {
                self.orphan_into_timewait(now, h);
                return Ok(());
            }
            State::DreqRcvd => {
                if let Some(c) = self.ceps.get(&h) {
                    let drep = Drep {
                        local_comm_id: c.local_id,
                        remote_comm_id: c.remote_id,
                        ..Drep::default()
                    };
                    let (peer, tid) = (c.peer, c.tid);
                    self.send(peer, tid, CmMessage::Drep(drep));
                }
                self.orphan_into_timewait(now, h);
                return Ok(());
            }
            State::Timewait => {
                if let Some(c) = self.ceps.get_mut(&h) {
                    c.orphan = true;
                }
                self.park(h);
                return Ok(());
            }
            State::SidrReqRcvd => {
                if let Some(c) = self.ceps.get(&h) {
                    let rep = SidrRep {
                        request_id: c.remote_id,
                        status: SidrStatus::Rejected,
                        service_id: c.service_id,
                        ..SidrRep::default()
                    };
                    let (peer, tid) = (c.peer, c.tid);
                    self.send(peer, tid, CmMessage::SidrRep(rep));
                }
            }
            State::SidrReqSent | State::Idle => {}
        }
        self.remove_cep(h);
        Ok(())
    }

    /// Forgets a REQ received and not answered yet, sending nothing, so that the peer's
    /// retry may find room (Linux `cm_destroy_id` with -ENOMEM from REQ_RCVD, which ucma's
    /// full backlog gives: "do not reject to allow future retries"). Any other state is
    /// an ordinary [`Endpoint::destroy`] (a SIDR request is answered REJECT, as cm.c does
    /// whatever the error).
    pub fn drop_request(&mut self, now: Instant, h: CepHandle) -> Result<(), CmError> {
        if self.cep_mut(h)?.state != State::ReqRcvd {
            return self.destroy(now, h);
        }
        self.events.retain(|(eh, _)| *eh != h);
        self.stats.rx_backlog_drops += 1;
        self.remove_cep(h);
        Ok(())
    }

    fn orphan_into_timewait(&mut self, now: Instant, h: CepHandle) {
        if let Some(c) = self.ceps.get_mut(&h) {
            c.orphan = true;
        }
        self.enter_timewait(now, h);
    }

    /// Keeps only what a destroyed endpoint in timewait still needs: its local comm ID
    /// (held in `local_ids` until the timer ends, so no new connection reuses it) and its
    /// timer. A burst leaves hundreds of thousands of them behind for the path's ACK
    /// timeout (seconds on loopback); whole, each kept a full endpoint in the table every
    /// message is looked up in. Nothing else reaches them: their peer's keys went when
    /// timewait began (`enter_timewait`), and a message naming one finds no endpoint, as
    /// after the timewait (a repeated DREQ still gets its DREP: see `on_dreq`).
    fn park(&mut self, h: CepHandle) {
        let Some(c) = self.ceps.get(&h) else { return };
        if !(c.orphan && c.state == State::Timewait && c.timer == TimerKind::Timewait) {
            return;
        }
        let Some(c) = self.ceps.remove(&h) else {
            return;
        };
        // A parked endpoint answers a repeated DREQ as after its destroy (cm_issue_drep):
        // with no private data.
        self.forget_drep_pd(h);
        self.recycle_out(c.out);
        self.parked.insert(
            h,
            Parked {
                local_id: c.local_id,
                timer_gen: c.timer_gen,
            },
        );
    }

    /// A parked endpoint's timewait ended: its local comm ID is free again.
    fn unpark(&mut self, h: CepHandle) {
        let Some(p) = self.parked.remove(&h) else {
            return;
        };
        if self.local_ids.get(&p.local_id) == Some(&h) {
            self.local_ids.remove(&p.local_id);
        }
        self.conn_ceps -= 1;
    }

    // ----- input: time -------------------------------------------------------------------

    /// Runs every timer due at `now`: retransmissions, give-ups, timewait exits.
    pub fn handle_timeout(&mut self, now: Instant) {
        while let Some((h, gen)) = self.timers.pop_due(now) {
            let Some(c) = self.ceps.get(&h) else {
                if self.parked.get(&h).is_some_and(|p| p.timer_gen == gen) {
                    self.unpark(h);
                }
                continue;
            };
            if c.timer_gen != gen {
                continue;
            }
            match c.timer {
                TimerKind::None => {}
                TimerKind::Timewait => self.timewait_expired(h),
                TimerKind::Retransmit => self.retransmit_due(now, h),
            }
        }
        // Timewait's ends empty the tables after a flood's disconnects.
        self.shrink_tables();
    }

    fn timewait_expired(&mut self, h: CepHandle) {
        let Some(c) = self.ceps.get(&h) else { return };
        if c.orphan {
            self.remove_cep(h);
            return;
        }
        let c = c.clone();
        self.unlink_remote(&c, h);
        if let Some(c) = self.ceps.get_mut(&h) {
            c.state = State::Idle;
            c.timer = TimerKind::None;
            c.remote_id = 0;
            c.remote_qpn = 0;
        }
        self.emit(h, CmEvent::TimewaitExit);
    }

    fn retransmit_due(&mut self, now: Instant, h: CepHandle) {
        let policy = self.cfg.retry;
        let Some(c) = self.ceps.get_mut(&h) else {
            return;
        };
        let max_retries = c.max_retries;
        let Some(out) = c.out.as_mut() else { return };
        let expired = out.retries_done >= max_retries || out.deadline.is_some_and(|d| now >= d);
        if !expired {
            out.retries_done += 1;
            let mad = out.mad;
            let wait = match policy {
                RetryPolicy::Classic => out.next_wait,
                // The MRA's time was for this wait only: the backoff starts again (Linux
                // since 6.14: the MRA's timeout applies to the next retry, and the backoff
                // restarts after it).
                RetryPolicy::Backoff {
                    initial, max_wait, ..
                } if out.stretched => {
                    out.stretched = false;
                    out.next_wait = initial.min(max_wait);
                    out.next_wait
                }
                RetryPolicy::Backoff { max_wait, .. } => {
                    out.next_wait = out.next_wait.saturating_mul(2).min(max_wait);
                    out.next_wait
                }
            };
            let mut at = later(now, wait);
            if let Some(d) = out.deadline {
                at = at.min(d);
            }
            let dst = c.peer;
            self.stats.tx += 1;
            self.stats.retransmits += 1;
            self.transmits.push_back(Transmit { dst, mad });
            self.arm(h, at, TimerKind::Retransmit);
            return;
        }
        let state = c.state;
        match state {
            State::ReqSent | State::MraReqRcvd => {
                // Silently, as Linux's `cm_process_send_error` resets REQ_SENT/MRA_REQ_RCVD to
                // IDLE before IB_CM_REQ_ERROR: the id is idle by the time rdma_cm's user
                // destroys it, so no REJ(TIMEOUT) follows. A passive side that did see the REQ
                // ends by its own REP retries.
                self.reset_to_idle(h);
                self.emit(h, CmEvent::TimedOut(TimedOut::Req));
            }
            State::RepSent | State::MraRepRcvd => {
                self.reset_to_idle(h);
                self.emit(h, CmEvent::TimedOut(TimedOut::Rep));
            }
            State::DreqSent => {
                self.enter_timewait(now, h);
                self.emit(h, CmEvent::TimedOut(TimedOut::Dreq));
            }
            State::SidrReqSent => {
                self.reset_to_idle(h);
                self.emit(h, CmEvent::TimedOut(TimedOut::SidrReq));
            }
            _ => self.cancel_timer(h),
        }
    }

    // ----- input: datagrams --------------------------------------------------------------

    /// Feeds one received MAD (the 256 bytes after BTH and DETH) from `from`.
    pub fn handle_datagram(&mut self, now: Instant, from: IpAddr, mad: &[u8]) {
        if let Some(reply) = unsupported_get_set(mad) {
            self.stats.unsupported_get_set += 1;
            self.stats.tx += 1;
            self.transmits.push_back(Transmit {
                dst: from,
                mad: reply,
            });
            return;
        }
        let Ok(parsed) = CmMad::parse(mad) else {
            self.stats.rx_malformed += 1;
            return;
        };
        let tid = parsed.header.tid;
        match parsed.msg {
            CmMessage::Req(m) => self.on_req(now, from, tid, m),
            CmMessage::Mra(m) => self.on_mra(now, from, &m),
            CmMessage::Rej(m) => self.on_rej(now, from, m),
            CmMessage::Rep(m) => self.on_rep(now, from, tid, m),
            CmMessage::Rtu(m) => self.on_rtu(from, &m),
            CmMessage::Dreq(m) => self.on_dreq(from, tid, m),
            CmMessage::Drep(m) => self.on_drep(now, from, &m),
            CmMessage::SidrReq(m) => self.on_sidr_req(from, tid, m),
            CmMessage::SidrRep(m) => self.on_sidr_rep(from, m),
            CmMessage::Lap(_) | CmMessage::Apr(_) => self.stats.rx_lap_apr_ignored += 1,
            // A GetResp: nothing here asked (Get and Set were answered above).
            CmMessage::ClassPortInfo(_) => self.unmatched(),
        }
    }

    fn unmatched(&mut self) {
        self.stats.rx_unmatched += 1;
    }

    /// A REJ built from a received REQ, with no endpoint behind it (Linux `cm_issue_rej`).
    fn issue_rej(&mut self, from: IpAddr, tid: u64, req: &Req, reason: RejReason, msg: MsgCode) {
        let rej = Rej {
            local_comm_id: (u32::from(req.reserved0) << 24) | req.vendor_id,
            remote_comm_id: req.local_comm_id,
            message_rejected: msg,
            reason,
            ..Rej::default()
        };
        self.send(from, tid, CmMessage::Rej(rej));
    }

    fn on_req(&mut self, now: Instant, from: IpAddr, tid: u64, mut req: Req) {
        // Comm ID 0 is how this engine marks a peer it does not know yet (and never hands
        // out itself): a connection under it could not be told from one whose REP is still
        // to come, and the peer's DREQ would not end it. Refused at the door instead, with
        // the REJ reason the spec has for it (6, Invalid Communication ID; Linux's
        // IB_CM_REJ_INVALID_COMM_ID). Linux makes a comm ID 0 once in 2^32.
        if req.local_comm_id == 0 {
            self.issue_rej(from, tid, &req, RejReason::InvalidCommId, MsgCode::Req);
            self.stats.invalid_comm_id_rejects += 1;
            return;
        }
        let guid = req.local_ca_guid;
        let (rid, rqp) = (
            self.peers.key(req.local_comm_id, guid),
            self.peers.key(req.local_qpn, guid),
        );
        // A REQ we already know: answer from the state it reached (IBTA 12.9.8.1; Linux
        // cm_dup_req_handler, plus resending the REP, which recovers a lost REP at once).
        if let Some(h) = self.remote_ids.get(rid) {
            self.stats.rx_duplicates += 1;
            let Some(c) = self.ceps.get_mut(&h) else {
                return;
            };
            if c.peer != from {
                return;
            }
            match c.state {
                State::MraReqSent => {
                    c.mra_sent = true;
                    let (peer, tid, mra) = (c.peer, c.req_tid, mra_of(c));
                    self.send(peer, tid, CmMessage::Mra(mra));
                }
                State::RepSent | State::MraRepRcvd => {
                    if let Some(out) = c.out.as_ref() {
                        let (dst, mad) = (c.peer, out.mad);
                        self.stats.tx += 1;
                        self.transmits.push_back(Transmit { dst, mad });
                    }
                }
                State::Timewait => {
                    self.issue_rej(from, tid, &req, RejReason::StaleConn, MsgCode::Req);
                    self.stats.stale_rejects += 1;
                }
                _ => {}
            }
            return;
        }
        // The peer reuses a QPN we still consider connected: stale (IBTA 12.9.8.3.3). The
        // connection it names is ended (Linux cm_req_handler sends it a DREQ) only when the
        // REQ comes from that connection's peer: the QPN and CA GUID travel in the clear,
        // and from anyone else this would let any host end anyone's connection.
        if let Some(old) = self.remote_qps.get(rqp) {
            self.issue_rej(from, tid, &req, RejReason::StaleConn, MsgCode::Req);
            self.stats.stale_rejects += 1;
            if self
                .ceps
                .get(&old)
                .is_some_and(|c| c.state == State::Established && !c.orphan && c.peer == from)
            {
                let _ = self.disconnect(now, old, &[]);
            }
            return;
        }
        let Some(lh) = self.find_listener(req.service_id) else {
            self.issue_rej(from, tid, &req, RejReason::InvalidServiceId, MsgCode::Req);
            self.stats.no_listener_rejects += 1;
            return;
        };
        // Only RC connections are made here. Linux's ib_cm hands the transport to its
        // consumer, and rdma_cm refuses a REQ whose QP type is not its listener's
        // (`cma_ib_check_req_qp_type`); the handler's error makes ib_cm destroy the new id
        // from REQ_RCVD, which sends REJ(CONSUMER_DEFINED) with local comm ID 0 and keeps
        // nothing. IBTA's own reason for it, 9 (Invalid Transport Service Type), is not
        // what a Linux peer sees, so it is not what it gets here.
        if req.transport_type != TransportType::Rc {
            let rej = Rej {
                local_comm_id: 0,
                remote_comm_id: req.local_comm_id,
                message_rejected: MsgCode::Req,
                reason: RejReason::ConsumerDefined,
                ..Rej::default()
            };
            self.send(from, tid, CmMessage::Rej(rej));
            self.stats.transport_rejects += 1;
            return;
        }
        let full = self
            .listeners
            .get(&lh)
            .is_some_and(|l| l.pending >= l.backlog);
        if full || self.conn_ceps >= self.cfg.max_ceps {
            // Dropped, not rejected: the peer's retry may find room.
            self.stats.rx_backlog_drops += 1;
            return;
        }
        let local_id = self.alloc_local_id();
        let mut c = Cep::new(State::ReqRcvd, local_id, from);
        c.remote_id = req.local_comm_id;
        c.remote_guid = guid;
        c.remote_qpn = req.local_qpn;
        c.service_id = req.service_id;
        c.tid = tid;
        c.req_tid = tid;
        c.listener = Some(lh);
        // The REP's retry interval is the peer's own response timeout alone, with its retry
        // count, as Linux's `cm_req_handler` sets them (only the active side adds twice the
        // packet lifetime).
        c.timeout_ms = ibta_time_ms(req.local_cm_response_timeout) as u32;
        c.max_retries = req.max_cm_retries;
        // What the QP's ACK timeout and the timewait are made of: as Linux, which takes the
        // field less one for a packet lifetime (cm_format_paths_from_req: `packet_life_time
        // -= (packet_life_time > 0)`) and adds one back (cm_init_av_by_path): the same value,
        // but 0 (no timeout at all, a QP that never retransmits) becomes 1.
        let c_ack_timeout = req.primary_path.local_ack_timeout.max(1);
        c.ack_timeout = c_ack_timeout;
        let h = self.insert_cep(c);
        self.peers.insert(&mut self.remote_ids, rid, h);
        self.peers.insert(&mut self.remote_qps, rqp, h);
        if let Some(l) = self.listeners.get_mut(&lh) {
            l.pending += 1;
        }
        let info = ReqInfo {
            peer: from,
            service_id: req.service_id,
            remote_qpn: req.local_qpn,
            starting_psn: req.starting_psn,
            remote_ca_guid: guid,
            responder_resources: req.responder_resources,
            initiator_depth: req.initiator_depth,
            retry_count: req.retry_count,
            rnr_retry_count: req.rnr_retry_count,
            mtu: req.path_mtu,
            flow_label: req.primary_path.flow_label,
            traffic_class: req.primary_path.traffic_class,
            hop_limit: req.primary_path.hop_limit,
            local_ack_timeout: c_ack_timeout,
            srq: req.srq,
            private_data: std::mem::take(&mut req.private_data),
        };
        self.events.push_back((
            lh,
            CmEvent::ReqReceived {
                listener: lh,
                cep: h,
                info: Box::new(info),
            },
        ));
    }

    fn on_rep(&mut self, now: Instant, from: IpAddr, tid: u64, mut rep: Rep) {
        let Some(h) = self.lookup(rep.remote_comm_id, rep.local_comm_id, from) else {
            return self.unmatched();
        };
        let Some(c) = self.ceps.get(&h) else { return };
        match c.state {
            State::ReqSent | State::MraReqRcvd if c.stale_rep == Some(rep.local_comm_id) => {
                // A copy of the REP already refused as stale: the peer, still in REP_SENT,
                // did not get our REJ. Refused again (Linux's `cm_rep_handler` finds the
                // QPN held again and issues the same REJ), so it stops at once instead of
                // at the end of its retries; without a second DREQ to the old connection,
                // and even once that is gone (where Linux would take the copy: the REJ
                // already sent may have put the peer's side in timewait).
                self.stats.rx_duplicates += 1;
                self.stats.stale_rejects += 1;
                let rej = stale_rep_rej(&rep);
                self.send(from, tid, CmMessage::Rej(rej));
                return;
            }
            State::ReqSent | State::MraReqRcvd => {}
            State::Established => {
                // Our RTU was lost: send it again (Linux cm_dup_rep_handler).
                self.stats.rx_duplicates += 1;
                let (peer, tid, rtu) = (c.peer, c.req_tid, rtu_of(c));
                self.send(peer, tid, CmMessage::Rtu(rtu));
                return;
            }
            State::MraRepSent => {
                self.stats.rx_duplicates += 1;
                let Some(c) = self.ceps.get_mut(&h) else {
                    return;
                };
                c.mra_sent = true;
                let (peer, tid, mra) = (c.peer, c.req_tid, mra_of(c));
                self.send(peer, tid, CmMessage::Mra(mra));
                return;
            }
            State::RepRcvd => return self.stats.rx_duplicates += 1,
            _ => return self.unmatched(),
        }
        if rep.local_comm_id == 0 {
            // As for a REQ (see `on_req`): refused, and this attempt ends as if rejected.
            let rej = Rej {
                local_comm_id: rep.remote_comm_id,
                remote_comm_id: 0,
                message_rejected: MsgCode::Rep,
                reason: RejReason::InvalidCommId,
                ..Rej::default()
            };
            self.send(from, tid, CmMessage::Rej(rej));
            self.stats.invalid_comm_id_rejects += 1;
            self.reset_to_idle(h);
            self.emit(
                h,
                CmEvent::Rejected {
                    reason: RejReason::InvalidCommId,
                    ari: Vec::new(),
                    private_data: Vec::new(),
                },
            );
            return;
        }
        let guid = rep.local_ca_guid;
        let (rid, rqp) = (
            self.peers.key(rep.local_comm_id, guid),
            self.peers.key(rep.local_qpn, guid),
        );
        // Linux's `cm_rep_handler` inserts the remote comm ID before the remote QPN: a REP
        // naming a connection we already have is a duplicate, dropped without a word,
        // before any stale-QPN REJ or DREQ.
        if self.remote_ids.get(rid).is_some_and(|o| o != h) {
            return self.stats.rx_duplicates += 1;
        }
        if let Some(other) = self.remote_qps.get(rqp) {
            if other != h {
                // Stale: reject this REP, tear the old connection down, keep waiting. As
                // for a stale REQ, the old connection is ended only when the REP comes from
                // its peer: the QPN and CA GUID travel in the clear, and a host we connect
                // to could otherwise end our connection to any other.
                let rej = stale_rep_rej(&rep);
                self.send(from, tid, CmMessage::Rej(rej));
                self.stats.stale_rejects += 1;
                if let Some(c) = self.ceps.get_mut(&h) {
                    c.stale_rep = Some(rep.local_comm_id);
                }
                if self
                    .ceps
                    .get(&other)
                    .is_some_and(|c| c.state == State::Established && !c.orphan && c.peer == from)
                {
                    let _ = self.disconnect(now, other, &[]);
                }
                return;
            }
        }
        self.cancel_timer(h);
        let Some(c) = self.ceps.get_mut(&h) else {
            return;
        };
        c.state = State::RepRcvd;
        // The ACK timeout now follows the peer's ACK delay, not ours (Linux cm_rep_handler
        // recomputes av.timeout from the REP's target ACK delay): timewait and the QP's
        // timeout use it.
        c.ack_timeout = super::types::cm_ack_timeout(rep.target_ack_delay, c.packet_life_time);
        c.remote_id = rep.local_comm_id;
        c.remote_guid = guid;
        c.remote_qpn = rep.local_qpn;
        let establish = c.establish_on_rep;
        self.peers.insert(&mut self.remote_ids, rid, h);
        self.peers.insert(&mut self.remote_qps, rqp, h);
        let info = RepInfo {
            remote_qpn: rep.local_qpn,
            starting_psn: rep.starting_psn,
            responder_resources: rep.responder_resources,
            initiator_depth: rep.initiator_depth,
            target_ack_delay: rep.target_ack_delay,
            rnr_retry_count: rep.rnr_retry_count,
            srq: rep.srq,
            private_data: std::mem::take(&mut rep.private_data),
            established: establish,
        };
        self.emit(h, CmEvent::RepReceived(Box::new(info)));
        if establish {
            // RepRcvd → Established, the RTU queued, `Established` emitted (cannot fail:
            // the endpoint is in RepRcvd).
            let _ = self.establish(h);
        }
    }

    fn on_mra(&mut self, now: Instant, from: IpAddr, mra: &Mra) {
        let Some(h) = self.lookup(mra.remote_comm_id, mra.local_comm_id, from) else {
            return self.unmatched();
        };
        let Some(c) = self.ceps.get_mut(&h) else {
            return;
        };
        let next = match (c.state, mra.message_mraed) {
            (State::ReqSent, MsgCode::Req) => State::MraReqRcvd,
            (State::RepSent, MsgCode::Rep) => State::MraRepRcvd,
            _ => return self.unmatched(),
        };
        c.state = next;
        // The MRA's sender is not taken as the peer (cm_mra_handler records no remote ID): a
        // REP from another of its ids (the MRA's one destroyed and its REJ lost, our REQ
        // retried) must still be matched, as must a listener-less REJ with comm ID 0.
        // Honoured once: a peer cannot keep us waiting forever with repeated MRAs.
        if !c.mra_honoured {
            c.mra_honoured = true;
            let extra = Duration::from_millis(
                ibta_time_ms(mra.service_timeout) + ibta_time_ms(c.ack_timeout),
            );
            if let Some(out) = c.out.as_mut() {
                // The next retry waits the asked-for time (see `Outstanding::stretched`). A
                // deadline moves by that time (Linux since 6.14 extends the MAD's deadline
                // by it), and leaves room at least for one retry after the stretched wait
                // and its answer (it ended the exchange when the stretched wait did: a REP
                // lost after the peer's long work failed the connect).
                out.next_wait = extra;
                out.stretched = true;
                out.deadline = out
                    .deadline
                    .map(|d| later(d, extra).max(later(now, extra.saturating_mul(2))));
                let at = later(now, extra);
                self.arm(h, at, TimerKind::Retransmit);
            }
        }
        self.emit(
            h,
            CmEvent::MraReceived {
                service_timeout: mra.service_timeout,
            },
        );
    }

    fn on_rej(&mut self, now: Instant, from: IpAddr, mut rej: Rej) {
        let h = if rej.reason == RejReason::Timeout {
            // Linux's `cm_acquire_rejected_id` finds a REJ(TIMEOUT) only by the sender's comm
            // ID and the CA GUID in the first 8 bytes of its ARI (whatever the ARI length
            // and the remote comm ID say; the active side that sends it may not know ours):
            // a connection whose peer is known, never an active side still in REQ_SENT.
            let guid = rej
                .ari
                .get(..8)
                .and_then(|a| a.try_into().ok())
                .map_or(0, u64::from_be_bytes);
            self.remote_ids
                .get(self.peers.key(rej.local_comm_id, guid))
                .filter(|h| self.ceps.get(h).is_some_and(|c| c.peer == from))
        } else if rej.remote_comm_id != 0 {
            // A REJ of a REQ can only be for an attempt that has not learned the peer's comm
            // ID (Linux's `cm_acquire_rejected_id` looks it up with remote ID 0): it does
            // not end a connection past the REP, nor a passive one.
            self.lookup(rej.remote_comm_id, rej.local_comm_id, from)
                .filter(|h| {
                    rej.message_rejected != MsgCode::Req
                        || self.ceps.get(h).is_some_and(|c| c.remote_id == 0)
                })
        } else {
            None
        };
        let Some(h) = h else { return self.unmatched() };
        let Some(c) = self.ceps.get(&h) else { return };
        let state = c.state;
        let stale = rej.reason == RejReason::StaleConn;
        match state {
            State::ReqSent
            | State::MraReqRcvd
            | State::ReqRcvd
            | State::MraReqSent
            | State::RepSent
            | State::MraRepRcvd => {
                if stale {
                    self.enter_timewait(now, h);
                } else {
                    self.reset_to_idle(h);
                }
            }
            State::RepRcvd | State::MraRepSent | State::Established | State::DreqSent => {
                self.enter_timewait(now, h);
            }
            _ => return self.unmatched(),
        }
        self.emit(
            h,
            CmEvent::Rejected {
                reason: rej.reason,
                ari: rej.ari_bytes().to_vec(),
                private_data: std::mem::take(&mut rej.private_data),
            },
        );
    }

    fn on_rtu(&mut self, from: IpAddr, rtu: &Rtu) {
        let Some(h) = self.lookup(rtu.remote_comm_id, rtu.local_comm_id, from) else {
            return self.unmatched();
        };
        let Some(c) = self.ceps.get_mut(&h) else {
            return;
        };
        if !matches!(c.state, State::RepSent | State::MraRepRcvd) {
            return self.stats.rx_duplicates += 1;
        }
        c.state = State::Established;
        self.left_half_open();
        self.cancel_timer(h);
        self.emit(h, CmEvent::Established);
    }

    fn on_dreq(&mut self, from: IpAddr, tid: u64, mut dreq: Dreq) {
        let found = self
            .lookup(dreq.remote_comm_id, dreq.local_comm_id, from)
            .filter(|h| self.ceps.get(h).is_some_and(|c| c.remote_id != 0));
        let Some(h) = found else {
            // Late DREQ after our timewait: answer so the peer stops retrying; it changes no
            // state, so a forged one does no harm. (Linux's cm_issue_drep answers only once
            // the id is destroyed; while its user still holds an id gone idle after
            // timewait, cm_dreq_handler matches it and sends nothing.)
            self.stats.rx_duplicates += 1;
            let drep = Drep {
                local_comm_id: dreq.remote_comm_id,
                remote_comm_id: dreq.local_comm_id,
                ..Drep::default()
            };
            self.send(from, tid, CmMessage::Drep(drep));
            return;
        };
        let Some(c) = self.ceps.get_mut(&h) else {
            return;
        };
        if dreq.remote_qpn != c.local_qpn {
            return self.unmatched();
        }
        match c.state {
            State::RepSent | State::MraRepRcvd | State::Established | State::DreqSent => {
                let was_half_open = is_half_open(c.state);
                c.state = State::DreqRcvd;
                c.tid = tid;
                if was_half_open {
                    self.left_half_open();
                }
                self.cancel_timer(h);
                self.unlink_listener(h);
                let pd = std::mem::take(&mut dreq.private_data);
                if self.ceps.get(&h).is_some_and(|c| c.orphan) {
                    // Nobody to ask: answer at once.
                    let _ = self.orphan_drep(h);
                } else {
                    self.emit(h, CmEvent::DreqReceived { private_data: pd });
                }
            }
            State::Timewait => {
                self.stats.rx_duplicates += 1;
                let drep = Drep {
                    local_comm_id: c.local_id,
                    remote_comm_id: c.remote_id,
                    private_data: self.drep_pd.get(&h).cloned().unwrap_or_default(),
                };
                let peer = c.peer;
                self.send(peer, tid, CmMessage::Drep(drep));
            }
            State::DreqRcvd => self.stats.rx_duplicates += 1,
            _ => self.unmatched(),
        }
    }

    fn orphan_drep(&mut self, h: CepHandle) -> Option<()> {
        let c = self.ceps.get(&h)?;
        let drep = Drep {
            local_comm_id: c.local_id,
            remote_comm_id: c.remote_id,
            ..Drep::default()
        };
        let (peer, tid) = (c.peer, c.tid);
        self.send(peer, tid, CmMessage::Drep(drep));
        Some(())
    }

    fn on_drep(&mut self, now: Instant, from: IpAddr, drep: &Drep) {
        let Some(h) = self.lookup(drep.remote_comm_id, drep.local_comm_id, from) else {
            return self.unmatched();
        };
        let Some(c) = self.ceps.get(&h) else { return };
        match c.state {
            State::DreqSent | State::DreqRcvd => {
                self.enter_timewait(now, h);
                self.emit(h, CmEvent::DrepReceived);
            }
            State::Timewait => self.stats.rx_duplicates += 1,
            _ => self.unmatched(),
        }
    }

    fn on_sidr_req(&mut self, from: IpAddr, tid: u64, mut req: SidrReq) {
        if self.sidr_remote.contains_key(&(req.request_id, from)) {
            return self.stats.rx_duplicates += 1;
        }
        let reply = |status| SidrRep {
            request_id: req.request_id,
            status,
            service_id: req.service_id,
            ..SidrRep::default()
        };
        let Some(lh) = self.find_listener(req.service_id) else {
            self.send(
                from,
                tid,
                CmMessage::SidrRep(reply(SidrStatus::UnsupportedServiceId)),
            );
            self.stats.no_listener_rejects += 1;
            return;
        };
        let full = self
            .listeners
            .get(&lh)
            .is_some_and(|l| l.pending >= l.backlog);
        if full {
            // Unlike a REQ, which is dropped for the peer to retry: rdma_cm's handler fails
            // the request (ucma's backlog, -ENOMEM), and cm.c's `cm_destroy_id` answers a
            // SIDR request it destroys with REJECT whatever the error (it spares only a
            // REQ), so the peer learns at once instead of after its 15 retries.
            self.send(from, tid, CmMessage::SidrRep(reply(SidrStatus::Rejected)));
            self.stats.sidr_backlog_rejects += 1;
            return;
        }
        if self.conn_ceps >= self.cfg.max_ceps {
            self.stats.rx_backlog_drops += 1;
            return;
        }
        // SIDR endpoints get no comm ID of their own: nothing is addressed to them.
        let mut c = Cep::new(State::SidrReqRcvd, 0, from);
        c.remote_id = req.request_id;
        c.service_id = req.service_id;
        c.tid = tid;
        c.listener = Some(lh);
        let h = self.new_handle();
        self.conn_ceps += 1;
        self.ceps.insert(h, c);
        self.sidr_remote.insert((req.request_id, from), h);
        if let Some(l) = self.listeners.get_mut(&lh) {
            l.pending += 1;
        }
        self.events.push_back((
            lh,
            CmEvent::SidrReqReceived {
                listener: lh,
                cep: h,
                peer: from,
                service_id: req.service_id,
                private_data: std::mem::take(&mut req.private_data),
            },
        ));
    }

    fn on_sidr_rep(&mut self, from: IpAddr, mut rep: SidrRep) {
        let h = self.local_ids.get(&rep.request_id).copied();
        let Some(h) = h.filter(|h| {
            self.ceps
                .get(h)
                .is_some_and(|c| c.state == State::SidrReqSent && c.peer == from)
        }) else {
            return self.unmatched();
        };
        self.reset_to_idle(h);
        self.emit(
            h,
            CmEvent::SidrRepReceived {
                status: rep.status,
                qpn: rep.qpn,
                qkey: rep.qkey,
                private_data: std::mem::take(&mut rep.private_data),
            },
        );
    }
}

/// Refuses private data longer than the message's area, before anything changes.
fn check_pd(what: &'static str, pd: &[u8], max: usize) -> Result<(), CmError> {
    if pd.len() > max {
        return Err(rcm_wire::WireError::PrivateDataTooLong {
            what,
            len: pd.len(),
            max,
        }
        .into());
    }
    Ok(())
}

/// The answer to a Get or Set MAD: nothing here serves one (the CM's messages are Sends,
/// and the Linux CM has no ClassPortInfo handler either), so it gets what Linux's MAD layer
/// gives a Get or Set no agent took (`generate_unmatched_resp`): the MAD echoed whole as
/// GetResp with status 0x000C, method/attribute combination not supported. A MAD of another
/// base version, a subnet management class (never valid on QP1), any other method, or a
/// CM-class one of another attribute than ClassPortInfo gets nothing: mad.c's
/// `validate_mad` drops those first ("CM attributes other than ClassPortInfo only use Send
/// method").
fn unsupported_get_set(mad: &[u8]) -> Option<[u8; rcm_wire::roce::MAD_LEN]> {
    /// Subnet management, LID-routed and directed-route: refused on the GSI QP.
    const SMP_CLASSES: [u8; 2] = [0x01, 0x81];
    let m: &[u8; rcm_wire::roce::MAD_LEN] = mad.try_into().ok()?;
    let (base, class, method) = (m[0], m[1], m[3]);
    let attr = u16::from_be_bytes([m[16], m[17]]);
    if base != mad::BASE_VERSION
        || SMP_CLASSES.contains(&class)
        || !matches!(method, mad::method::GET | mad::method::SET)
        || (class == mad::MGMT_CLASS_CM && attr != rcm_wire::cm::attr::CLASS_PORT_INFO)
    {
        return None;
    }
    let mut r = *m;
    r[3] = mad::method::GET_RESP;
    r[4..6].copy_from_slice(&mad::status::METHOD_ATTR_UNSUPPORTED.to_be_bytes());
    Some(r)
}

/// The REJ(STALE_CONN) answering a REP whose QPN another connection holds (Linux
/// `cm_issue_rej` from `cm_rep_handler`: built from the REP's comm IDs).
fn stale_rep_rej(rep: &Rep) -> Rej {
    Rej {
        local_comm_id: rep.remote_comm_id,
        remote_comm_id: rep.local_comm_id,
        message_rejected: MsgCode::Rep,
        reason: RejReason::StaleConn,
        ..Rej::default()
    }
}

fn rtu_of(c: &Cep) -> Rtu {
    Rtu {
        local_comm_id: c.local_id,
        remote_comm_id: c.remote_id,
        ..Rtu::default()
    }
}

fn mra_of(c: &Cep) -> Mra {
    Mra {
        local_comm_id: c.local_id,
        remote_comm_id: c.remote_id,
        message_mraed: if matches!(c.state, State::MraRepSent) {
            MsgCode::Rep
        } else {
            MsgCode::Req
        },
        service_timeout: c.mra_timeout,
        ..Mra::default()
    }
}
