//! Two IB CM engines ([`Endpoint`]) driven by a byte string: every byte chooses the next
//! thing to happen (a user's call on one host, a datagram delivered, dropped, duplicated,
//! reordered, altered or made up, time passing) and the bytes after it its arguments. The
//! same bytes always make the same run, so a failing input is its own reproduction.
//!
//! Shared by the seeded test `tests/engine_bytes.rs` (stable, in CI) and the coverage-guided
//! fuzz target `fuzz/fuzz_targets/ib_engine.rs` (nightly, by hand), which includes this file
//! by path. The random tests beside it (`props.rs`, `hostile.rs`) choose among plausible
//! moves; here a coverage-guided fuzzer chooses, and keeps what reaches new code.
//!
//! What [`run`] checks, for any input:
//! * no panic, the engine's debug-build checks included (the half-open count);
//! * everything an engine sends is a CM MAD our own decoder accepts;
//! * every event names a handle its user holds; a connect request names the listener it
//!   came to and a handle never seen before;
//! * once both users destroy everything they hold and the network delivers what is in
//!   flight, the engines go quiet within two days of virtual time and are empty: no
//!   endpoint, no table entry, no timer.

use rcm_proto::ib::{
    AcceptParams, CepHandle, CmEvent, ConnectParams, Endpoint, EndpointConfig, RetryPolicy,
    SidrParams, SidrReplyParams,
};
use rcm_wire::cm::{CmMad, RejReason, SidrStatus};
use rcm_wire::cma::{self, PortSpace};
use rcm_wire::mad;
use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::{Duration, Instant};

#[path = "../support/byte_input.rs"]
mod byte_input;
use byte_input::Bytes;

const SVC: u64 = cma::service_id(PortSpace::Tcp, 7471);
const SIDR_SVC: u64 = cma::service_id(PortSpace::Udp, 7174);
/// Datagrams kept in flight at most (more are lost, as a full queue loses them).
const WIRE_MAX: usize = 256;
/// Datagrams kept as material for altered ones.
const SEEN_MAX: usize = 64;
/// How long the engines may take to go quiet once everything is destroyed: a forged MRA may
/// stretch an exchange's waits to ~37 h (see `hostile.rs`).
const SETTLE: Duration = Duration::from_secs(2 * 24 * 3600);
/// Datagrams the settling network may carry at one instant: more means two engines answer
/// each other for ever.
const STORM: usize = 10_000;

/// A host's address (198.18.0.0/15: these never leave this process).
fn addr(k: usize) -> IpAddr {
    IpAddr::from([198, 18, 0, 1 + k as u8])
}

/// Not a host: what is sent there is lost.
fn stranger() -> IpAddr {
    IpAddr::from([198, 18, 0, 9])
}

/// What one host's user holds and has done.
#[derive(Default)]
struct Host {
    live: BTreeSet<CepHandle>,
    listeners: BTreeSet<CepHandle>,
    destroyed: BTreeSet<CepHandle>,
    /// Connect requests (RC and SIDR) not yet answered by this driver.
    requests: Vec<CepHandle>,
}

/// A datagram in flight: to which host, from which address, the MAD.
type Flight = (usize, IpAddr, [u8; 256]);

struct Run {
    eps: [Endpoint; 2],
    hosts: [Host; 2],
    now: Instant,
    wire: Vec<Flight>,
    seen: Vec<[u8; 256]>,
    next_qpn: u32,
    steps: usize,
}

/// What a run did, for the seeded test to check that it reached the state machine.
#[derive(Debug, Default, Clone, Copy)]
pub struct Counts {
    pub steps: usize,
    pub delivered: usize,
    pub events: usize,
    pub established: usize,
}

/// Runs the input (see the module's doc); `Err` says which promise broke.
pub fn run(data: &[u8]) -> Result<Counts, String> {
    let mut b = Bytes::new(data);
    let mut r = Run::new(&mut b);
    let mut counts = Counts::default();
    while b.more() {
        r.step(&mut b, &mut counts)?;
        r.collect(&mut counts)?;
        r.steps += 1;
    }
    counts.steps = r.steps;
    r.settle(&mut counts)?;
    Ok(counts)
}

impl Run {
    fn new(b: &mut Bytes) -> Self {
        let flags = b.u8();
        let eps = [0, 1].map(|k| {
            let mut cfg = EndpointConfig::new(addr(k), 0x100 + k as u64, 7 + k as u64);
            if flags & (1 << k) != 0 {
                cfg.retry = RetryPolicy::Classic;
            }
            // Small budgets, so that a short input reaches them.
            cfg.max_half_open = 1 + usize::from(flags >> 4 & 3);
            cfg.max_ceps = 8 + usize::from(flags >> 6) * 8;
            Endpoint::new(cfg)
        });
        Run {
            eps,
            hosts: [Host::default(), Host::default()],
            now: Instant::now(),
            wire: Vec::new(),
            seen: Vec::new(),
            next_qpn: 0x100,
            steps: 0,
        }
    }

    fn qpn(&mut self) -> u32 {
        self.next_qpn = (self.next_qpn + 1) & 0xFF_FFFF;
        self.next_qpn
    }

    fn service(b: &mut Bytes) -> u64 {
        match b.u8() % 4 {
            0 | 1 => SVC,
            2 => SIDR_SVC,
            _ => b.u64(),
        }
    }

    /// A handle `k`'s user holds (listeners too when `listeners`).
    fn held(&self, b: &mut Bytes, k: usize, listeners: bool) -> Option<CepHandle> {
        let h = &self.hosts[k];
        let v: Vec<CepHandle> = h
            .live
            .iter()
            .filter(|c| listeners || !h.listeners.contains(c))
            .copied()
            .collect();
        let i = b.pick(v.len());
        v.get(i).copied()
    }

    fn adopt(&mut self, k: usize, h: CepHandle) -> Result<(), String> {
        let host = &mut self.hosts[k];
        // Handles are never reused: one this user held or destroyed is not new.
        if host.live.contains(&h) || host.destroyed.contains(&h) {
            return Err(format!(
                "step {}: host {k} was given handle {h:?} again",
                self.steps
            ));
        }
        host.live.insert(h);
        Ok(())
    }

    fn destroy(&mut self, k: usize, h: CepHandle) {
        let _ = self.eps[k].destroy(self.now, h);
        let host = &mut self.hosts[k];
        host.live.remove(&h);
        host.listeners.remove(&h);
        host.requests.retain(|c| *c != h);
        host.destroyed.insert(h);
    }

    fn deliver(&mut self, to: usize, from: IpAddr, mad: &[u8], counts: &mut Counts) {
        counts.delivered += 1;
        self.eps[to].handle_datagram(self.now, from, mad);
    }

    /// Runs both engines' timers up to `self.now`.
    fn run_timers(&mut self) {
        for ep in &mut self.eps {
            // Bounded: each call handles everything due, and a timer it re-arms is later.
            for _ in 0..64 {
                match ep.poll_timeout() {
                    Some(t) if t <= self.now => ep.handle_timeout(self.now),
                    _ => break,
                }
            }
        }
    }

    fn next_deadline(&mut self) -> Option<Instant> {
        let [a, b] = &mut self.eps;
        match (a.poll_timeout(), b.poll_timeout()) {
            (Some(x), Some(y)) => Some(x.min(y)),
            (x, y) => x.or(y),
        }
    }

    fn step(&mut self, b: &mut Bytes, counts: &mut Counts) -> Result<(), String> {
        let op = b.u8();
        let k = usize::from(op >> 7);
        let now = self.now;
        match op & 0x7F {
            0..=7 => {
                let mut p = ConnectParams::new(addr(1 - k), Self::service(b), self.qpn());
                p.private_data = b.pd(96);
                p.establish_on_rep = b.bit();
                p.cm_response_timeout = b.u8() % 32;
                p.max_cm_retries = b.u8() % 16;
                if let Ok(h) = self.eps[k].connect(now, &p) {
                    self.adopt(k, h)?;
                }
            }
            8..=11 => {
                let svc = Self::service(b);
                let mask = if b.bit() { u64::MAX } else { !0xFFFF };
                let backlog = usize::from(b.u8() % 8);
                if let Ok(h) = self.eps[k].listen(svc, mask, backlog) {
                    self.adopt(k, h)?;
                    self.hosts[k].listeners.insert(h);
                }
            }
            12..=19 => {
                let n = self.hosts[k].requests.len();
                if n > 0 {
                    let h = self.hosts[k].requests.swap_remove(b.pick(n));
                    if b.u8() % 4 == 0 {
                        let _ = self.eps[k].mra(h, b.u8() % 32, b.bit());
                    }
                    let qpn = self.qpn();
                    let _ = self.eps[k].accept(
                        now,
                        h,
                        &AcceptParams {
                            qpn,
                            private_data: b.pd(200),
                            ..AcceptParams::default()
                        },
                    );
                    let p = SidrReplyParams {
                        status: SidrStatus::from_raw_value(b.u8() % 8),
                        qpn,
                        qkey: 0x1234,
                        private_data: b.pd(140),
                    };
                    let _ = self.eps[k].sidr_reply(h, &p);
                }
            }
            20..=23 => {
                if let Some(h) = self.held(b, k, false) {
                    let reason = RejReason::from_raw_value(b.u16() % 40);
                    let ari = b.pd(76);
                    let pd = b.pd(150);
                    let _ = self.eps[k].reject(now, h, reason, &ari, &pd);
                }
            }
            24..=29 => {
                if let Some(h) = self.held(b, k, false) {
                    let pd = b.pd(230);
                    let _ = self.eps[k].disconnect(now, h, &pd);
                }
            }
            30..=33 => {
                if let Some(h) = self.held(b, k, true) {
                    self.destroy(k, h);
                }
            }
            34..=36 => {
                if let Some(h) = self.held(b, k, false) {
                    let _ = if b.bit() {
                        self.eps[k].establish(h)
                    } else {
                        self.eps[k].notify_established(h)
                    };
                }
            }
            37..=38 => {
                if let Some(h) = self.held(b, k, false) {
                    let _ = self.eps[k].mra(h, b.u8() % 32, b.bit());
                }
            }
            39..=41 => {
                let p = SidrParams {
                    dst: addr(1 - k),
                    service_id: Self::service(b),
                    private_data: b.pd(140),
                    timeout: b.u8() % 32,
                    max_retries: b.u8() % 16,
                };
                if let Ok(h) = self.eps[k].sidr_request(now, &p) {
                    self.adopt(k, h)?;
                }
            }
            // The network: deliver (most often), drop, duplicate, reorder.
            42..=69 => {
                if !self.wire.is_empty() {
                    let (to, from, mad) = self.wire.remove(b.pick(self.wire.len()));
                    self.deliver(to, from, &mad, counts);
                }
            }
            70..=73 => {
                if !self.wire.is_empty() {
                    self.wire.remove(b.pick(self.wire.len()));
                }
            }
            74..=77 => {
                if !self.wire.is_empty() {
                    let (to, from, mad) = self.wire[b.pick(self.wire.len())];
                    self.deliver(to, from, &mad, counts);
                }
            }
            78..=81 => {
                let n = self.wire.len();
                if n > 1 {
                    let (i, j) = (b.pick(n), b.pick(n));
                    self.wire.swap(i, j);
                }
            }
            82..=85 => {
                let wire = std::mem::take(&mut self.wire);
                for (to, from, mad) in wire {
                    self.deliver(to, from, &mad, counts);
                }
            }
            // A datagram that is not what a host sent: an earlier one altered, or bytes of
            // the input, from a host, itself or a stranger.
            86..=97 => {
                let mut mad = if self.seen.is_empty() {
                    [0u8; 256]
                } else {
                    self.seen[b.pick(self.seen.len())]
                };
                for _ in 0..=b.u8() % 4 {
                    match b.u8() % 4 {
                        // A comm ID field, from another datagram or made up.
                        0 => {
                            let off = if b.bit() { 24 } else { 28 };
                            let id = if self.seen.is_empty() || b.bit() {
                                b.u16().into()
                            } else {
                                let other = self.seen[b.pick(self.seen.len())];
                                u32::from_be_bytes([other[24], other[25], other[26], other[27]])
                            };
                            mad[off..off + 4].copy_from_slice(&id.to_be_bytes());
                        }
                        // The attribute ID: another CM message's.
                        1 => mad[17] = 0x10 + b.u8() % 0x0A,
                        _ => {
                            let i = usize::from(b.u8());
                            mad[i] ^= b.u8() | 1;
                        }
                    }
                }
                let to = usize::from(b.bit());
                let from = [addr(1 - to), addr(to), stranger()][usize::from(b.u8() % 3)];
                self.deliver(to, from, &mad, counts);
            }
            98..=101 => {
                let len = usize::from(b.u16() % 300);
                let raw = b.take(len).to_vec();
                let to = usize::from(b.bit());
                let from = if b.bit() { addr(1 - to) } else { stranger() };
                self.deliver(to, from, &raw, counts);
            }
            // Time: a step of 1 µs to 2^35 µs (~9.5 h), or straight to the next timer.
            102..=115 => {
                self.now += Duration::from_micros(1 << (b.u8() % 36));
                self.run_timers();
            }
            _ => {
                if let Some(t) = self.next_deadline() {
                    self.now = self.now.max(t);
                    self.run_timers();
                }
            }
        }
        Ok(())
    }

    /// Moves what the engines sent onto the wire and checks what they reported.
    fn collect(&mut self, counts: &mut Counts) -> Result<(), String> {
        for k in 0..2 {
            while let Some(t) = self.eps[k].poll_transmit() {
                // What is not a CM message must be the MAD layer's refusal of a Get or Set:
                // a GetResp with status 0x000C (method/attribute combination not supported).
                let refusal = t.mad[0] == mad::BASE_VERSION
                    && t.mad[3] == mad::method::GET_RESP
                    && t.mad[4..6] == mad::status::METHOD_ATTR_UNSUPPORTED.to_be_bytes();
                match CmMad::parse(&t.mad) {
                    Err(e) if !refusal => {
                        return Err(format!(
                            "step {}: host {k} sent a MAD its own decoder refuses ({e}): {:02x?}",
                            self.steps, t.mad
                        ));
                    }
                    _ => {}
                }
                if self.seen.len() < SEEN_MAX {
                    self.seen.push(t.mad);
                } else {
                    let i = self.steps % SEEN_MAX;
                    self.seen[i] = t.mad;
                }
                let to = (0..2).find(|&j| addr(j) == t.dst);
                if let Some(to) = to {
                    if self.wire.len() < WIRE_MAX {
                        self.wire.push((to, addr(k), t.mad));
                    }
                }
            }
            while let Some((h, ev)) = self.eps[k].poll_event() {
                counts.events += 1;
                self.check_event(k, h, &ev)?;
                if matches!(ev, CmEvent::Established) {
                    counts.established += 1;
                }
            }
        }
        Ok(())
    }

    fn check_event(&mut self, k: usize, h: CepHandle, ev: &CmEvent) -> Result<(), String> {
        let step = self.steps;
        if self.hosts[k].destroyed.contains(&h) {
            return Err(format!("step {step}: host {k}: {ev:?} for destroyed {h:?}"));
        }
        if !self.hosts[k].live.contains(&h) {
            return Err(format!("step {step}: host {k}: {ev:?} for unknown {h:?}"));
        }
        if let &(CmEvent::ReqReceived { listener, cep, .. }
        | CmEvent::SidrReqReceived { listener, cep, .. }) = ev
        {
            if listener != h || !self.hosts[k].listeners.contains(&listener) {
                return Err(format!(
                    "step {step}: host {k}: request on {h:?} names {listener:?}"
                ));
            }
            self.adopt(k, cep)?;
            self.hosts[k].requests.push(cep);
        }
        Ok(())
    }

    /// Both users destroy everything; the network delivers what is in flight and whatever
    /// the engines still send; then both engines must be empty.
    fn settle(&mut self, counts: &mut Counts) -> Result<(), String> {
        for k in 0..2 {
            let all: Vec<CepHandle> = self.hosts[k].live.iter().copied().collect();
            for h in all {
                self.destroy(k, h);
            }
        }
        let end = self.now + SETTLE;
        let mut at_once = 0;
        loop {
            self.collect(counts)?;
            if !self.wire.is_empty() {
                at_once += self.wire.len();
                if at_once > STORM {
                    return Err(format!(
                        "after everything was destroyed, {at_once} datagrams went back and \
                         forth without time passing: {:02x?}",
                        self.wire.first().map(|f| f.2)
                    ));
                }
                let wire = std::mem::take(&mut self.wire);
                for (to, from, mad) in wire {
                    self.deliver(to, from, &mad, counts);
                }
                continue;
            }
            match self.next_deadline() {
                Some(t) if t <= end => {
                    self.now = self.now.max(t);
                    self.run_timers();
                    at_once = 0;
                }
                Some(t) => {
                    let states = [self.eps[0].cep_states(), self.eps[1].cep_states()];
                    return Err(format!(
                        "not quiet two days after everything was destroyed (next timer in \
                         {:?}): {states:?}",
                        t - self.now
                    ));
                }
                None => break,
            }
        }
        for (k, ep) in self.eps.iter_mut().enumerate() {
            let (count, tables, timer) = (ep.cep_count(), ep.table_sizes(), ep.poll_timeout());
            if count != 0 || tables != (0, 0, 0, 0, 0) || timer.is_some() {
                return Err(format!(
                    "host {k} not empty after everything was destroyed: {count} endpoints {:?}, \
                     tables {tables:?}, timer {timer:?}",
                    ep.cep_states()
                ));
            }
        }
        Ok(())
    }
}
