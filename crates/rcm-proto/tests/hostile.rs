//! Hostile CM traffic at live IB CM engines ([`rcm_proto::ib::Endpoint`]) in the deterministic
//! simulator: two hosts connect, accept, reject, disconnect and destroy at random while a third
//! party (and spoofed copies of the hosts themselves) feeds them well-formed but wrong MADs:
//! copies of the real traffic with their attribute, comm IDs, transaction ID, method or any
//! body byte changed, aimed at the connections that exist. The wire decoders' robustness is
//! tested elsewhere (rcm-wire's robustness.rs, the fuzz targets); this is what the state
//! machine does with what parses.
//!
//! Checked for every seed (a failure names it; `RCM_HOSTILE_SEED=<n>` runs one, with
//! `RCM_HOSTILE_VERBOSE=1` printing what the users saw after the attack;
//! `RCM_HOSTILE_SEEDS=<n>` runs seeds 1 to n, 200 by default; `RCM_HOSTILE_ROUNDS` sets the
//! attack steps per seed, 400 by default):
//! * no panic, including the engine's debug-build checks (the half-open count against the
//!   states, at every accept);
//! * no event for a handle its user destroyed, and every event names a handle the user
//!   holds (or, for a request, creates one under a live listener);
//! * once the attack stops, the network goes quiet within a bound of virtual time: hostile
//!   MRAs and REJs cannot leave a timer running for ever;
//! * afterwards a new connection between the two hosts is established at both ends: no
//!   listener backlog place or half-open budget place is lost to the attack;
//! * after every handle is destroyed both engines are empty: no comm ID, remote ID, remote
//!   QPN or SIDR entry and no timer is left (nothing hostile traffic created outlives it).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rcm_proto::ib::{
    AcceptParams, CepHandle, CmEvent, ConnectParams, EndpointConfig, RetryPolicy, SidrParams,
    SidrReplyParams,
};
use rcm_proto::sim::{NetConfig, NodeId, Sim};
use rcm_wire::cm::{attr, RejReason};
use rcm_wire::cma::{self, PortSpace};
use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

const SVC: u64 = cma::service_id(PortSpace::Tcp, 7471);
const SIDR_SVC: u64 = cma::service_id(PortSpace::Udp, 7174);
/// Not a simulated host: what is sent to it is lost.
const ATTACKER: &str = "198.18.0.9";
/// Attribute IDs a forgery may take: every CM attribute, and two that are none.
fn attrs() -> impl Iterator<Item = u16> {
    attr::ALL.into_iter().chain([0x0000, 0xFFFF])
}

/// How long the network may take to go quiet once the attack stops. A forged MRA may stretch
/// an exchange's wait to the largest service timeout (2^31 × 4.096 µs, 2.4 h) plus the ACK
/// timeout, for every retry after it under the Classic policy (15): ~37 h, as Linux's
/// `cm_mra_handler` and `ib_modify_mad` would wait. Two days: only a timer that never stops
/// exceeds it.
const SETTLE_MINUTES: usize = 2 * 24 * 60;

fn ip(s: &str) -> IpAddr {
    s.parse().expect("a literal address")
}

/// What the driver knows of one host: the handles its user holds and those it destroyed.
#[derive(Default)]
struct Host {
    live: BTreeSet<CepHandle>,
    listeners: BTreeSet<CepHandle>,
    destroyed: BTreeSet<CepHandle>,
    /// Passive children left unanswered on purpose (answered or destroyed later).
    pending: Vec<CepHandle>,
    established: BTreeSet<CepHandle>,
}

struct Run {
    sim: Sim,
    rng: StdRng,
    hosts: [Host; 2],
    nodes: [NodeId; 2],
    next_qpn: u32,
    /// Comm IDs seen on the wire, for aiming forged MADs at real connections.
    ids: Vec<u32>,
    /// Legitimate MADs seen on the wire (the seeds of the forgeries).
    seen: Vec<[u8; 256]>,
    seed: u64,
}

impl Run {
    fn new(seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut sim = Sim::new(
            seed,
            NetConfig {
                latency: Duration::from_micros(rng.gen_range(20..500)),
                jitter: Duration::from_micros(rng.gen_range(0..200)),
                loss: rng.gen_range(0.0..0.1),
                duplicate: rng.gen_range(0.0..0.05),
                reorder: rng.gen_range(0.0..0.1),
                reorder_delay: Duration::from_millis(rng.gen_range(0..50)),
            },
        );
        sim.trace = Some(Vec::new());
        let mut nodes = [0; 2];
        for (k, n) in nodes.iter_mut().enumerate() {
            let mut cfg =
                EndpointConfig::new(ip(&format!("198.18.0.{}", k + 1)), 0x100 + k as u64, seed);
            cfg.seed = seed.wrapping_mul(31).wrapping_add(k as u64);
            if rng.gen_bool(0.5) {
                cfg.retry = RetryPolicy::Classic;
            }
            // A small budget, so that forged REQs and lost RTUs reach it.
            cfg.max_half_open = rng.gen_range(2..16);
            *n = sim.add_node(cfg);
        }
        let mut r = Run {
            sim,
            rng,
            hosts: [Host::default(), Host::default()],
            nodes,
            next_qpn: 0x100,
            ids: Vec::new(),
            seen: Vec::new(),
            seed,
        };
        for k in 0..2 {
            let backlog = r.rng.gen_range(2..12);
            let l = r.ep(k).listen(SVC, u64::MAX, backlog).expect("listen");
            let s = r.ep(k).listen(SIDR_SVC, u64::MAX, 0).expect("listen");
            for h in [l, s] {
                r.hosts[k].live.insert(h);
                r.hosts[k].listeners.insert(h);
            }
        }
        r
    }

    fn ep(&mut self, k: usize) -> &mut rcm_proto::ib::Endpoint {
        self.sim.ep(self.nodes[k])
    }

    fn addr(k: usize) -> IpAddr {
        ip(&format!("198.18.0.{}", k + 1))
    }

    fn qpn(&mut self) -> u32 {
        self.next_qpn += 1;
        self.next_qpn
    }

    fn fail(&self, what: &str) -> String {
        format!("seed {}: {what}", self.seed)
    }

    /// Moves what the hosts sent into the forger's stock.
    fn harvest(&mut self) {
        let Some(tr) = self.sim.trace.as_mut() else {
            return;
        };
        for p in tr.drain(..) {
            for off in [24, 28] {
                let id = u32::from_be_bytes([
                    p.mad[off],
                    p.mad[off + 1],
                    p.mad[off + 2],
                    p.mad[off + 3],
                ]);
                if id != 0 && self.ids.len() < 4096 {
                    self.ids.push(id);
                }
            }
            if self.seen.len() < 4096 {
                self.seen.push(p.mad);
            } else {
                let i = self.rng.gen_range(0..self.seen.len());
                self.seen[i] = p.mad;
            }
        }
    }

    fn pick_id(&mut self) -> u32 {
        match self.rng.gen_range(0..10) {
            0 => 0,
            1 => self.rng.gen(),
            _ if !self.ids.is_empty() => self.ids[self.rng.gen_range(0..self.ids.len())],
            _ => self.rng.gen(),
        }
    }

    /// A forged MAD: a real one changed in one to three places, or (rarely, or before any
    /// traffic) a CM header on random bytes.
    fn forge(&mut self) -> [u8; 256] {
        let mut m = if !self.seen.is_empty() && self.rng.gen_bool(0.9) {
            self.seen[self.rng.gen_range(0..self.seen.len())]
        } else {
            let mut m = [0u8; 256];
            self.rng.fill(&mut m[24..]);
            m[0] = 1; // base version
            m[1] = 7; // CM class
            m[2] = 2; // class version
            m[3] = 3; // Send
            m
        };
        for _ in 0..self.rng.gen_range(1..=3) {
            match self.rng.gen_range(0..9) {
                0 => {
                    let n = attr::ALL.len() + 2;
                    let a = attrs().nth(self.rng.gen_range(0..n)).unwrap_or(0);
                    m[16..18].copy_from_slice(&a.to_be_bytes());
                }
                1 | 2 => {
                    let off = if self.rng.gen_bool(0.5) { 24 } else { 28 };
                    let id = self.pick_id();
                    m[off..off + 4].copy_from_slice(&id.to_be_bytes());
                }
                3 => {
                    let (a, b) = (m[24..28].to_vec(), m[28..32].to_vec());
                    m[24..28].copy_from_slice(&b);
                    m[28..32].copy_from_slice(&a);
                }
                4 => {
                    let t: u64 = self.rng.gen();
                    m[8..16].copy_from_slice(&t.to_be_bytes());
                }
                5 => m[3] = [0x01, 0x02, 0x03, 0x81, self.rng.gen()][self.rng.gen_range(0..5)],
                6 => {
                    // A QPN field, a timeout or a flag of the message body.
                    let i = self.rng.gen_range(32..64);
                    m[i] = self.rng.gen();
                }
                7 => {
                    let i = self.rng.gen_range(24..256);
                    m[i] ^= 1 << self.rng.gen_range(0..8);
                }
                _ => {
                    let i = self.rng.gen_range(0..24);
                    m[i] = self.rng.gen();
                }
            }
        }
        m
    }

    fn inject(&mut self) {
        let k = self.rng.gen_range(0..2);
        let from = match self.rng.gen_range(0..3) {
            0 => ip(ATTACKER),
            1 => Self::addr(1 - k),
            _ => Self::addr(k),
        };
        let mad = self.forge();
        let now = self.sim.now();
        self.ep(k).handle_datagram(now, from, &mad);
        self.sim.flush();
    }

    fn random_live(&mut self, k: usize) -> Option<CepHandle> {
        let v: Vec<CepHandle> = self.hosts[k]
            .live
            .iter()
            .filter(|h| !self.hosts[k].listeners.contains(h))
            .copied()
            .collect();
        (!v.is_empty()).then(|| v[self.rng.gen_range(0..v.len())])
    }

    fn destroy(&mut self, k: usize, h: CepHandle) {
        let now = self.sim.now();
        let _ = self.ep(k).destroy(now, h);
        let host = &mut self.hosts[k];
        host.live.remove(&h);
        host.listeners.remove(&h);
        host.established.remove(&h);
        host.pending.retain(|p| *p != h);
        host.destroyed.insert(h);
        self.sim.flush();
    }

    /// The hosts' users, answering what happened. `eager`: answer every request now.
    fn handle_events(&mut self, eager: bool) -> Result<(), String> {
        for k in 0..2 {
            for (h, ev) in self.sim.take_events(self.nodes[k]) {
                if self.hosts[k].destroyed.contains(&h) {
                    return Err(self.fail(&format!("host {k}: {ev:?} for destroyed {h:?}")));
                }
                if !self.hosts[k].live.contains(&h) {
                    return Err(self.fail(&format!("host {k}: {ev:?} for unknown {h:?}")));
                }
                self.answer(k, h, &ev, eager)?;
            }
        }
        self.sim.flush();
        Ok(())
    }

    fn answer(&mut self, k: usize, h: CepHandle, ev: &CmEvent, eager: bool) -> Result<(), String> {
        let now = self.sim.now();
        if std::env::var("RCM_HOSTILE_VERBOSE").is_ok() && eager {
            eprintln!(
                "{:?} host {k} {h:?} {ev:?} state {:?}",
                self.sim.elapsed(),
                self.ep(k).state(h)
            );
        }
        match ev {
            &(CmEvent::ReqReceived { listener, cep, .. }
            | CmEvent::SidrReqReceived { listener, cep, .. }) => {
                if listener != h || !self.hosts[k].listeners.contains(&listener) {
                    return Err(self.fail(&format!("host {k}: request on {h:?} for {listener:?}")));
                }
                if !self.hosts[k].live.insert(cep) || self.hosts[k].destroyed.contains(&cep) {
                    return Err(self.fail(&format!("host {k}: request reuses handle {cep:?}")));
                }
                let sidr = matches!(ev, CmEvent::SidrReqReceived { .. });
                let roll = self.rng.gen_range(0..10);
                if sidr {
                    let p = SidrReplyParams {
                        qpn: self.qpn(),
                        qkey: 0x1234,
                        ..SidrReplyParams::default()
                    };
                    let _ = self.ep(k).sidr_reply(cep, &p);
                } else if roll < 6 || eager {
                    if roll == 5 {
                        let t = self.rng.gen_range(0..20);
                        let _ = self.ep(k).mra(cep, t, false);
                    }
                    let p = AcceptParams {
                        qpn: self.qpn(),
                        ..AcceptParams::default()
                    };
                    let _ = self.ep(k).accept(now, cep, &p);
                } else if roll < 8 {
                    let _ = self
                        .ep(k)
                        .reject(now, cep, RejReason::ConsumerDefined, &[], b"no");
                } else {
                    self.hosts[k].pending.push(cep);
                }
            }
            CmEvent::RepReceived(_) => {
                if !eager && self.rng.gen_range(0..8) == 0 {
                    let _ = self
                        .ep(k)
                        .reject(now, h, RejReason::ConsumerDefined, &[], b"no");
                } else {
                    let _ = self.ep(k).establish(h);
                }
            }
            CmEvent::DreqReceived { .. } => {
                let _ = self.ep(k).disconnect(now, h, b"bye");
            }
            CmEvent::Established => {
                self.hosts[k].established.insert(h);
            }
            CmEvent::Rejected { .. } | CmEvent::TimedOut(_) | CmEvent::DrepReceived => {
                self.hosts[k].established.remove(&h);
            }
            _ => {}
        }
        Ok(())
    }

    fn act(&mut self) {
        let k = self.rng.gen_range(0..2);
        let now = self.sim.now();
        match self.rng.gen_range(0..100) {
            0..=24 => {
                let p = ConnectParams::new(Self::addr(1 - k), SVC, self.qpn());
                if let Ok(h) = self.ep(k).connect(now, &p) {
                    self.hosts[k].live.insert(h);
                }
            }
            25..=29 => {
                let p = SidrParams {
                    dst: Self::addr(1 - k),
                    service_id: SIDR_SVC,
                    private_data: Vec::new(),
                    timeout: 14,
                    max_retries: 3,
                };
                if let Ok(h) = self.ep(k).sidr_request(now, &p) {
                    self.hosts[k].live.insert(h);
                }
            }
            30..=39 => {
                if let Some(h) = self.random_live(k) {
                    let _ = self.ep(k).disconnect(now, h, b"");
                }
            }
            40..=45 => {
                if let Some(h) = self.random_live(k) {
                    self.destroy(k, h);
                }
            }
            46..=50 => {
                if !self.hosts[k].pending.is_empty() {
                    let i = self.rng.gen_range(0..self.hosts[k].pending.len());
                    let h = self.hosts[k].pending.swap_remove(i);
                    let p = AcceptParams {
                        qpn: self.qpn(),
                        ..AcceptParams::default()
                    };
                    let _ = self.ep(k).accept(now, h, &p);
                }
            }
            _ => {
                for _ in 0..self.rng.gen_range(1..4) {
                    self.inject();
                }
            }
        }
        self.sim.flush();
    }

    /// Runs the network for `d`, the users answering as it goes.
    fn run(&mut self, d: Duration, eager: bool) -> Result<(), String> {
        let end = self.sim.now() + d;
        loop {
            self.handle_events(eager)?;
            self.harvest();
            if !self.sim.step(end) {
                break;
            }
        }
        self.handle_events(eager)?;
        // Nothing is due before `end`: the clock moves there.
        let left = end.saturating_duration_since(self.sim.now());
        self.sim.run_for(left);
        Ok(())
    }

    fn quiet(&mut self) -> bool {
        self.sim.next_deadline().is_none()
    }

    fn attack(&mut self, rounds: usize) -> Result<(), String> {
        for _ in 0..rounds {
            self.act();
            let d = Duration::from_micros(self.rng.gen_range(0..3000));
            self.run(d, false)?;
        }
        Ok(())
    }

    /// After the attack: the users answer what waits, the network settles.
    fn settle(&mut self) -> Result<(), String> {
        self.sim.net = NetConfig::default();
        for k in 0..2 {
            for h in std::mem::take(&mut self.hosts[k].pending) {
                let now = self.sim.now();
                let _ = self
                    .ep(k)
                    .reject(now, h, RejReason::ConsumerDefined, &[], b"late");
            }
        }
        for i in 0..SETTLE_MINUTES {
            self.run(Duration::from_secs(60), true)?;
            if self.quiet() {
                return Ok(());
            }
            if std::env::var("RCM_HOSTILE_VERBOSE").is_ok() && i % 60 == 0 {
                let t = self.sim.elapsed();
                let dl = self.sim.next_deadline().map(|d| d - self.sim.now());
                let tx = (self.ep(0).stats().tx, self.ep(1).stats().tx);
                eprintln!("{t:?} next in {dl:?}, tx {tx:?}");
            }
        }
        let states = (0..2).map(|k| self.ep(k).cep_states()).collect::<Vec<_>>();
        Err(self.fail(&format!("not quiet after two days: {states:?}")))
    }

    /// A new connection from `k` to the other host, established at both ends.
    fn probe(&mut self, k: usize) -> Result<(), String> {
        let now = self.sim.now();
        let p = ConnectParams::new(Self::addr(1 - k), SVC, self.qpn());
        let h = self
            .ep(k)
            .connect(now, &p)
            .map_err(|e| self.fail(&format!("probe connect: {e:?}")))?;
        self.hosts[k].live.insert(h);
        if std::env::var("RCM_HOSTILE_VERBOSE").is_ok() {
            eprintln!("{:?} probe from {k}: {h:?}", self.sim.elapsed());
        }
        let before = self.hosts[1 - k].established.len();
        for _ in 0..600 {
            self.run(Duration::from_millis(100), true)?;
            if self.hosts[k].established.contains(&h)
                && self.hosts[1 - k].established.len() > before
            {
                return Ok(());
            }
        }
        let st = self.ep(k).state(h);
        let stats = (self.ep(0).stats().clone(), self.ep(1).stats().clone());
        Err(self.fail(&format!(
            "probe from host {k} not established within 60 s (its state {st:?}; stats {stats:?})"
        )))
    }

    fn empty_after_destroying_all(&mut self) -> Result<(), String> {
        for k in 0..2 {
            let all: Vec<CepHandle> = self.hosts[k].live.iter().copied().collect();
            for h in all {
                self.destroy(k, h);
            }
        }
        for _ in 0..SETTLE_MINUTES {
            self.run(Duration::from_secs(60), true)?;
            if self.quiet() {
                break;
            }
        }
        for k in 0..2 {
            let (count, tables, timeout) = (
                self.ep(k).cep_count(),
                self.ep(k).table_sizes(),
                self.ep(k).poll_timeout(),
            );
            if count != 0 || tables != (0, 0, 0, 0, 0) || timeout.is_some() {
                let states = self.ep(k).cep_states();
                return Err(self.fail(&format!(
                    "host {k} not empty after destroying everything: {count} endpoints \
                     {states:?}, tables {tables:?}, timer {timeout:?}"
                )));
            }
        }
        Ok(())
    }
}

fn one_seed(seed: u64, rounds: usize) -> Result<(u64, u64), String> {
    let mut r = Run::new(seed);
    r.attack(rounds)?;
    r.settle()?;
    r.probe(0)?;
    r.probe(1)?;
    let unmatched = r.ep(0).stats().rx_unmatched + r.ep(1).stats().rx_unmatched;
    let malformed = r.ep(0).stats().rx_malformed + r.ep(1).stats().rx_malformed;
    r.empty_after_destroying_all()?;
    Ok((unmatched, malformed))
}

#[test]
fn forged_mads_break_no_rule_and_leak_nothing() {
    let seeds: Vec<u64> = if let Ok(s) = std::env::var("RCM_HOSTILE_SEED") {
        vec![s.parse().expect("RCM_HOSTILE_SEED is a number")]
    } else {
        let n = std::env::var("RCM_HOSTILE_SEEDS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(200);
        (1..=n).collect()
    };
    let (mut unmatched, mut malformed) = (0, 0);
    for seed in seeds {
        let (u, m) = one_seed(seed, rounds()).unwrap_or_else(|e| panic!("{e}"));
        unmatched += u;
        malformed += m;
    }
    // The forgeries reach the state machine (matched nothing there, or were refused by
    // the decoder): not all of them stop at the parser.
    assert!(unmatched > 0, "no forged MAD reached the state machine");
    assert!(malformed > 0, "no forged MAD was malformed");
}

/// Steps of attack per seed (`RCM_HOSTILE_ROUNDS`, 400 by default).
fn rounds() -> usize {
    std::env::var("RCM_HOSTILE_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(400)
}
