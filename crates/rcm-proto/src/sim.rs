//! A deterministic network for driving [`crate::ib::Endpoint`]s: seeded, with latency,
//! jitter, loss, duplication, reordering, partitions, crashes and restarts, and virtual time
//! that jumps to the next deadline. Same seed, same run.

use crate::ib::{CepHandle, CmEvent, Endpoint, EndpointConfig};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet};
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// Index of a node in the simulation.
pub type NodeId = usize;

/// Link behaviour, applied to every datagram independently.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NetConfig {
    /// Base one-way latency.
    pub latency: Duration,
    /// Uniform extra delay in `[0, jitter)`.
    pub jitter: Duration,
    /// Probability a datagram is lost.
    pub loss: f64,
    /// Probability a datagram is delivered twice.
    pub duplicate: f64,
    /// Probability a datagram is held back by up to `reorder_delay`, overtaking others.
    pub reorder: f64,
    /// How long a reordered datagram is held back at most.
    pub reorder_delay: Duration,
}

impl Default for NetConfig {
    fn default() -> Self {
        NetConfig {
            latency: Duration::from_micros(50),
            jitter: Duration::ZERO,
            loss: 0.0,
            duplicate: 0.0,
            reorder: 0.0,
            reorder_delay: Duration::ZERO,
        }
    }
}

/// One simulated host.
pub struct Node {
    /// Its address.
    pub addr: IpAddr,
    /// Its CM endpoint.
    pub ep: Endpoint,
    /// Whether it is running (a crashed node receives and sends nothing).
    pub up: bool,
    /// Events it emitted and the test has not taken yet.
    pub events: Vec<(CepHandle, CmEvent)>,
    cfg: EndpointConfig,
}

/// A datagram seen on the network (for traces and assertions).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packet {
    /// When it was sent.
    pub at: Duration,
    /// Sender.
    pub from: IpAddr,
    /// Receiver.
    pub to: IpAddr,
    /// The MAD.
    pub mad: [u8; 256],
}

/// The simulation.
pub struct Sim {
    start: Instant,
    now: Instant,
    rng: StdRng,
    /// Link behaviour.
    pub net: NetConfig,
    nodes: Vec<Node>,
    flight: BinaryHeap<Reverse<(Instant, u64, usize)>>,
    packets: Vec<Option<(IpAddr, IpAddr, [u8; 256])>>,
    seq: u64,
    cut: HashSet<(IpAddr, IpAddr)>,
    /// Every datagram sent, in order, when tracing is on.
    pub trace: Option<Vec<Packet>>,
    /// Datagrams delivered.
    pub delivered: u64,
    /// Datagrams lost (randomly, to a partition, or to a down node).
    pub dropped: u64,
}

impl Sim {
    /// An empty network with the given seed.
    pub fn new(seed: u64, net: NetConfig) -> Self {
        let now = Instant::now();
        Sim {
            start: now,
            now,
            rng: StdRng::seed_from_u64(seed),
            net,
            nodes: Vec::new(),
            flight: BinaryHeap::new(),
            packets: Vec::new(),
            seq: 0,
            cut: HashSet::new(),
            trace: None,
            delivered: 0,
            dropped: 0,
        }
    }

    /// The current virtual time.
    pub fn now(&self) -> Instant {
        self.now
    }

    /// Virtual time since the start.
    pub fn elapsed(&self) -> Duration {
        self.now - self.start
    }

    /// Adds a host with an endpoint built from `cfg`.
    pub fn add_node(&mut self, cfg: EndpointConfig) -> NodeId {
        let ep = Endpoint::new(cfg.clone());
        self.nodes.push(Node {
            addr: cfg.local_addr,
            ep,
            up: true,
            events: Vec::new(),
            cfg,
        });
        self.nodes.len() - 1
    }

    /// A host.
    pub fn node(&mut self, n: NodeId) -> &mut Node {
        &mut self.nodes[n]
    }

    /// Its endpoint.
    pub fn ep(&mut self, n: NodeId) -> &mut Endpoint {
        &mut self.nodes[n].ep
    }

    /// Number of hosts.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether there are no hosts.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Takes the events a host emitted so far.
    pub fn take_events(&mut self, n: NodeId) -> Vec<(CepHandle, CmEvent)> {
        std::mem::take(&mut self.nodes[n].events)
    }

    /// Cuts (or restores) the link between two hosts, both directions.
    pub fn partition(&mut self, a: NodeId, b: NodeId, cut: bool) {
        let (x, y) = (self.nodes[a].addr, self.nodes[b].addr);
        if cut {
            self.cut.insert((x, y));
            self.cut.insert((y, x));
        } else {
            self.cut.remove(&(x, y));
            self.cut.remove(&(y, x));
        }
    }

    /// Crashes a host: it loses all state and stops until `restart`.
    pub fn crash(&mut self, n: NodeId) {
        let node = &mut self.nodes[n];
        node.up = false;
        node.events.clear();
    }

    /// Restarts a crashed host with a fresh endpoint (new seed: new comm IDs).
    pub fn restart(&mut self, n: NodeId, seed: u64) {
        let node = &mut self.nodes[n];
        node.cfg.seed = seed;
        node.ep = Endpoint::new(node.cfg.clone());
        node.up = true;
    }

    /// Moves transmits from every endpoint onto the network and events into the hosts'
    /// queues. Called after every step; call it after issuing commands.
    pub fn flush(&mut self) {
        for i in 0..self.nodes.len() {
            while let Some(ev) = self.nodes[i].ep.poll_event() {
                self.nodes[i].events.push(ev);
            }
            while let Some(t) = self.nodes[i].ep.poll_transmit() {
                if !self.nodes[i].up {
                    continue;
                }
                let from = self.nodes[i].addr;
                if let Some(tr) = self.trace.as_mut() {
                    tr.push(Packet {
                        at: self.now - self.start,
                        from,
                        to: t.dst,
                        mad: t.mad,
                    });
                }
                self.launch(from, t.dst, t.mad);
            }
        }
    }

    fn launch(&mut self, from: IpAddr, to: IpAddr, mad: [u8; 256]) {
        if self.cut.contains(&(from, to)) || self.rng.gen_bool(self.net.loss.clamp(0.0, 1.0)) {
            self.dropped += 1;
            return;
        }
        let copies = if self.rng.gen_bool(self.net.duplicate.clamp(0.0, 1.0)) {
            2
        } else {
            1
        };
        for _ in 0..copies {
            let mut delay = self.net.latency;
            if !self.net.jitter.is_zero() {
                delay += self.net.jitter.mul_f64(self.rng.gen::<f64>());
            }
            if self.rng.gen_bool(self.net.reorder.clamp(0.0, 1.0)) {
                delay += self.net.reorder_delay.mul_f64(self.rng.gen::<f64>());
            }
            let idx = self.packets.len();
            self.packets.push(Some((from, to, mad)));
            self.seq += 1;
            self.flight.push(Reverse((self.now + delay, self.seq, idx)));
        }
    }

    /// The next moment something happens: a delivery or an endpoint deadline.
    pub fn next_deadline(&mut self) -> Option<Instant> {
        let net = self.flight.peek().map(|Reverse((at, _, _))| *at);
        let eps = self
            .nodes
            .iter_mut()
            .filter(|n| n.up)
            .filter_map(|n| n.ep.poll_timeout())
            .min();
        match (net, eps) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Advances to the next deadline (not past `limit`) and processes everything due then.
    /// Returns false when nothing is left to happen before `limit`.
    pub fn step(&mut self, limit: Instant) -> bool {
        self.flush();
        let Some(at) = self.next_deadline() else {
            return false;
        };
        if at > limit {
            return false;
        }
        self.now = self.now.max(at);
        while let Some(Reverse((t, _, idx))) = self.flight.peek().copied() {
            if t > self.now {
                break;
            }
            self.flight.pop();
            let Some((from, to, mad)) = self.packets.get_mut(idx).and_then(Option::take) else {
                continue;
            };
            match self.nodes.iter_mut().find(|n| n.addr == to) {
                Some(n) if n.up => {
                    self.delivered += 1;
                    n.ep.handle_datagram(self.now, from, &mad);
                }
                _ => self.dropped += 1,
            }
        }
        if self.flight.is_empty() {
            self.packets.clear();
        }
        let now = self.now;
        for n in self.nodes.iter_mut().filter(|n| n.up) {
            n.ep.handle_timeout(now);
        }
        self.flush();
        true
    }

    /// Runs for `d` of virtual time (or until nothing is left to happen).
    pub fn run_for(&mut self, d: Duration) {
        let limit = self.now + d;
        while self.step(limit) {}
        self.now = self.now.max(limit);
    }

    /// Runs until nothing is scheduled at all, at most `max` of virtual time. Returns whether
    /// it went quiet.
    pub fn run_until_quiet(&mut self, max: Duration) -> bool {
        let limit = self.now + max;
        while self.step(limit) {}
        self.next_deadline().is_none()
    }

    /// Steps until `pred` holds (checked after every step), at most `max`. Returns whether it
    /// did.
    pub fn run_until(&mut self, max: Duration, mut pred: impl FnMut(&mut Sim) -> bool) -> bool {
        let limit = self.now + max;
        loop {
            if pred(self) {
                return true;
            }
            if !self.step(limit) {
                return pred(self);
            }
        }
    }
}
