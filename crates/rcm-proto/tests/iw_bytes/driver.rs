//! Two iWARP connection endpoints ([`Cep`], side 0 active, side 1 passive) over one TCP
//! stream, driven by a byte string: every byte chooses the next thing to happen (a user's
//! call on one side, some bytes of one direction delivered, bytes altered, dropped or made
//! up, a FIN or a reset, time passing) and the bytes after it its arguments. The same bytes
//! always make the same run.
//!
//! Shared by the seeded test `tests/iw_bytes.rs` (stable, in CI) and the coverage-guided
//! fuzz target `fuzz/fuzz_targets/iw_engine.rs`, which includes this file by path.
//!
//! What [`run`] checks, for any input:
//! * no panic;
//! * the events follow the engine's documented order: nothing after `Close` or after a
//!   `ConnectReply` other than `Accepted`, nothing at all once destroyed; the active side
//!   never sees a request and the passive side never a reply; a request first and once,
//!   `Established` once and only after `accept`; messages only on an established connection,
//!   never more waiting for the application than `recv_queue` and `recv_bytes` allow;
//!   `Disconnect` once;
//! * after a terminal TCP action (`Close`, `Reset`) an endpoint writes and asks nothing more;
//! * while neither direction's bytes were anything but cut into chunks (never altered,
//!   dropped, made up or cut short by a reset), no side blames its peer for a malformed
//!   stream: the only protocol closes allowed then are negotiation outcomes (revision, IRD,
//!   RTR) and the receive limits (no buffer, message too long);
//! * once both sides are destroyed and the stream has run dry, both are closed with no
//!   timer left.

use rcm_proto::iw::{
    AcceptParams, Cep, CepConfig, CloseReason, ConnectParams, ConnectReply, Event, MpaVersion,
    ProtocolError, RtrModes, TcpAction,
};
use rcm_wire::mpa::{term_etype, term_layer, Terminate};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

#[path = "../support/byte_input.rs"]
mod byte_input;
use byte_input::Bytes;

/// Bytes a direction holds at most: past it a write is lost (and the stream counts as
/// altered), so a run's memory stays bounded.
const PIPE_MAX: usize = 1 << 20;
/// How long the settling stream may take once both sides are destroyed.
const SETTLE: Duration = Duration::from_secs(3600);

/// One direction of the stream: what side `i` wrote, on its way to the other side.
#[derive(Default)]
struct Pipe {
    bytes: VecDeque<u8>,
    fin: bool,
    fin_delivered: bool,
    rst: bool,
    rst_delivered: bool,
    /// Something other than cutting into chunks happened to these bytes.
    altered: bool,
}

/// One side and what its user saw.
struct Side {
    cep: Cep,
    destroyed: bool,
    /// `Close`, or a `ConnectReply` that is not `Accepted`: nothing may follow.
    over: bool,
    terminal_action: bool,
    request: bool,
    accepted: bool,
    connected: bool,
    disconnect: bool,
    /// Sizes of the messages reported and not yet taken.
    waiting: VecDeque<usize>,
}

/// What a run did, for the seeded test to check that it reached the engine's depths.
#[derive(Debug, Default, Clone, Copy)]
pub struct Counts {
    pub steps: usize,
    pub connected: usize,
    pub messages: usize,
    pub protocol_closes: usize,
}

struct Run {
    sides: [Side; 2],
    pipes: [Pipe; 2],
    now: Instant,
    steps: usize,
}

/// Runs the input (see the module's doc); `Err` says which promise broke.
pub fn run(data: &[u8]) -> Result<Counts, String> {
    let mut b = Bytes::new(data);
    let mut r = Run::new(&mut b);
    let mut counts = Counts::default();
    while b.more() {
        r.step(&mut b);
        r.collect(&mut counts)?;
        r.steps += 1;
    }
    counts.steps = r.steps;
    r.settle(&mut counts)?;
    Ok(counts)
}

fn config(b: &mut Bytes) -> CepConfig {
    let f = b.u8();
    CepConfig {
        max_revision: 1 + (f & 1),
        accept_v1_reply: f & 2 == 0,
        max_send_segment: 1 + usize::from(b.u8()),
        max_recv_message: 1 + usize::from(b.u16() % 4096),
        recv_queue: usize::from(f >> 2 & 7),
        recv_bytes: usize::from(b.u16()),
        responder_hold: if f & 0x20 == 0 {
            Duration::from_millis(50)
        } else {
            Duration::ZERO
        },
        ..CepConfig::default()
    }
}

/// `RCM_IW_BYTES_TRACE` set: every step, event and TCP action goes to stderr.
fn trace() -> bool {
    std::env::var_os("RCM_IW_BYTES_TRACE").is_some()
}

/// Whether a protocol close can be right even when the peer's bytes came as written.
fn honest_peer_may_cause(e: &ProtocolError) -> bool {
    match e {
        ProtocolError::RevisionMismatch
        | ProtocolError::InsufficientIrd
        | ProtocolError::NoMatchingRtr => true,
        ProtocolError::BadHeader {
            layer,
            error_type,
            error_code,
        } => {
            // The receive limits: no buffer (2) or message too long (5).
            *layer == term_layer::DDP
                && *error_type == term_etype::DDP_UNTAGGED_BUFFER
                && matches!(error_code, 2 | 5)
        }
        _ => false,
    }
}

impl Run {
    fn new(b: &mut Bytes) -> Self {
        let now = Instant::now();
        let (ca, cb) = (config(b), config(b));
        let side = |cep| Side {
            cep,
            destroyed: false,
            over: false,
            terminal_action: false,
            request: false,
            accepted: false,
            connected: false,
            disconnect: false,
            waiting: VecDeque::new(),
        };
        Run {
            sides: [side(Cep::active(ca)), side(Cep::passive(now, cb))],
            pipes: [Pipe::default(), Pipe::default()],
            now,
            steps: 0,
        }
    }

    fn run_timers(&mut self) {
        for s in &mut self.sides {
            for _ in 0..16 {
                match s.cep.poll_timeout() {
                    Some(t) if t <= self.now => s.cep.on_timer(self.now),
                    _ => break,
                }
            }
        }
    }

    /// Hands the next `n` bytes of pipe `i` (or its FIN or reset, once its bytes are gone)
    /// to the other side; false when nothing was there.
    fn deliver(&mut self, i: usize, n: usize) -> bool {
        let (now, j) = (self.now, 1 - i);
        let pipe = &mut self.pipes[i];
        if pipe.rst {
            if !pipe.rst_delivered {
                pipe.rst_delivered = true;
                self.sides[j].cep.on_tcp_closed(now, false);
                return true;
            }
            return false;
        }
        if !pipe.bytes.is_empty() {
            let n = n.clamp(1, pipe.bytes.len());
            let chunk: Vec<u8> = pipe.bytes.drain(..n).collect();
            self.sides[j].cep.on_bytes(now, &chunk);
            return true;
        }
        if pipe.fin && !pipe.fin_delivered {
            pipe.fin_delivered = true;
            self.sides[j].cep.on_tcp_closed(now, true);
            return true;
        }
        false
    }

    /// A reset of the stream (TCP failed, or a side reset it): what was in flight is lost.
    fn reset(&mut self, by: usize) {
        self.pipes[by].rst = true;
        for p in &mut self.pipes {
            p.bytes.clear();
            p.altered = true;
        }
    }

    fn step(&mut self, b: &mut Bytes) {
        let op = b.u8();
        let k = usize::from(op >> 7);
        let now = self.now;
        if trace() {
            let q = [self.pipes[0].bytes.len(), self.pipes[1].bytes.len()];
            let st = [self.sides[0].cep.state(), self.sides[1].cep.state()];
            eprintln!(
                "step {}: op {} side {k}; queued {q:?}, states {st:?}",
                self.steps,
                op & 0x7F
            );
        }
        match op & 0x7F {
            0..=5 => {
                let p = ConnectParams {
                    version: if b.bit() {
                        MpaVersion::V1
                    } else {
                        MpaVersion::V2
                    },
                    ird: u16::from(b.u8() % 140),
                    ord: u16::from(b.u8() % 140),
                    p2p: {
                        let m = b.u8();
                        (m & 1 == 1).then_some(RtrModes {
                            send: m & 2 != 0,
                            write: m & 4 != 0,
                            read: m & 8 != 0,
                        })
                    },
                    crc: b.bit(),
                    private_data: vec![0x5A; usize::from(b.u16() % 270)],
                };
                let _ = self.sides[0].cep.connect(now, &p);
            }
            6..=11 => {
                let p = AcceptParams {
                    ird: u16::from(b.u8() % 140),
                    ord: u16::from(b.u8() % 140),
                    crc: b.bit(),
                    private_data: vec![0xA5; usize::from(b.u16() % 270)],
                };
                if self.sides[1].cep.accept(now, &p).is_ok() {
                    self.sides[1].accepted = true;
                }
            }
            12..=13 => {
                let pd = vec![0x3C; usize::from(b.u16() % 270)];
                let _ = self.sides[1].cep.reject(now, &pd);
            }
            14..=16 => {
                let _ = self.sides[k].cep.disconnect(now);
            }
            17 => {
                let _ = self.sides[k].cep.abort(now);
            }
            18 => {
                let _ = self.sides[k]
                    .cep
                    .terminate(now, &Terminate::llp(b.u8() % 8));
            }
            19..=30 => {
                let len = usize::from(b.u16() % 5000);
                let _ = self.sides[k].cep.send(now, &vec![0xC3; len]);
            }
            31..=36 => {
                let n = usize::from(b.u8() % 4);
                self.sides[k].cep.messages_taken(n);
                let w = &mut self.sides[k].waiting;
                for _ in 0..n.min(w.len()) {
                    w.pop_front();
                }
            }
            37..=38 => {
                self.sides[k].cep.destroy(now);
                self.sides[k].destroyed = true;
            }
            // The stream: a chunk of one direction (most often), or all of both.
            39..=74 => {
                let n = 1 + usize::from(b.u16() % 2048);
                self.deliver(k, n);
            }
            75..=80 => {
                for i in [0, 1] {
                    while self.deliver(i, usize::MAX) {}
                }
            }
            // Bytes that are not what a side wrote: one changed, some lost, some made up.
            81..=84 => {
                let pipe = &mut self.pipes[k];
                if !pipe.bytes.is_empty() {
                    let at = usize::from(b.u16()) % pipe.bytes.len();
                    pipe.bytes[at] ^= b.u8() | 1;
                    pipe.altered = true;
                }
            }
            85..=86 => {
                let pipe = &mut self.pipes[k];
                let n = usize::from(b.u16()).min(pipe.bytes.len());
                if n > 0 {
                    pipe.bytes.drain(..n);
                    pipe.altered = true;
                }
            }
            87..=89 => {
                let len = usize::from(b.u16() % 600);
                let made_up = b.take(len);
                let pipe = &mut self.pipes[k];
                if !pipe.fin && !pipe.rst && !made_up.is_empty() {
                    pipe.bytes.extend(made_up);
                    pipe.altered = true;
                }
            }
            90 => self.reset(k),
            // Time: 1 µs to 2^33 µs (~2.4 h), or straight to the next timer.
            91..=104 => {
                self.now += Duration::from_micros(1 << (b.u8() % 34));
                self.run_timers();
            }
            _ => {
                let next = self.sides.iter().filter_map(|s| s.cep.poll_timeout()).min();
                if let Some(t) = next {
                    self.now = self.now.max(t);
                    self.run_timers();
                }
            }
        }
    }

    /// Moves what the sides wrote into the pipes and checks what they reported.
    fn collect(&mut self, counts: &mut Counts) -> Result<(), String> {
        let step = self.steps;
        for i in 0..2 {
            while let Some(t) = self.sides[i].cep.poll_transmit() {
                if self.sides[i].terminal_action {
                    return Err(format!(
                        "step {step}: side {i} wrote after its terminal action"
                    ));
                }
                self.sides[i].cep.transmitted(t.len());
                let pipe = &mut self.pipes[i];
                if !pipe.fin && !pipe.rst {
                    if pipe.bytes.len() + t.len() > PIPE_MAX {
                        pipe.altered = true;
                    } else {
                        pipe.bytes.extend(t);
                    }
                }
            }
            while let Some(a) = self.sides[i].cep.poll_tcp_action() {
                if trace() {
                    eprintln!("  side {i} action {a:?}");
                }
                if self.sides[i].terminal_action {
                    return Err(format!(
                        "step {step}: side {i} asked {a:?} after its terminal action"
                    ));
                }
                match a {
                    TcpAction::Shutdown => self.pipes[i].fin = true,
                    TcpAction::Close => {
                        self.pipes[i].fin = true;
                        self.sides[i].terminal_action = true;
                    }
                    TcpAction::Reset => {
                        self.reset(i);
                        self.sides[i].terminal_action = true;
                    }
                }
            }
            while let Some(e) = self.sides[i].cep.poll_event() {
                if trace() {
                    eprintln!("  side {i} event {e:?}");
                }
                self.check_event(i, &e, counts)?;
            }
        }
        Ok(())
    }

    fn check_event(&mut self, i: usize, e: &Event, counts: &mut Counts) -> Result<(), String> {
        let step = self.steps;
        // Either direction: a side fed altered bytes may answer with what its peer must
        // refuse (a Terminate for a garbled MPA Reply reaches a responder that has not
        // replied yet, which refuses it as unexpected data).
        let altered = self.pipes[0].altered || self.pipes[1].altered;
        let s = &mut self.sides[i];
        let bad = |why: &str| Err(format!("step {step}: side {i}: {e:?}: {why}"));
        if s.destroyed {
            return bad("an event after destroy");
        }
        if s.over {
            return bad("an event after the end");
        }
        match e {
            Event::ConnectRequest(_) => {
                if i == 0 || s.request {
                    return bad("a request at the active side, or a second one");
                }
                s.request = true;
            }
            Event::ConnectReply(r) => {
                if i == 1 || s.connected {
                    return bad("a reply at the passive side, or a second one");
                }
                if matches!(r, ConnectReply::Accepted(_)) {
                    s.connected = true;
                    counts.connected += 1;
                } else {
                    s.over = true;
                }
            }
            Event::Established(_) => {
                if i == 0 || s.connected || !s.accepted {
                    return bad("established twice, at the active side, or before accept");
                }
                s.connected = true;
                counts.connected += 1;
            }
            Event::Message(m) => {
                if !s.connected {
                    return bad("a message before the connection was up");
                }
                counts.messages += 1;
                s.waiting.push_back(m.len());
                let cfg = s.cep.config();
                let (queue, bytes) = (
                    cfg.recv_queue.max(1),
                    cfg.recv_bytes.max(cfg.max_recv_message),
                );
                let held: usize = s.waiting.iter().sum();
                if s.waiting.len() > queue || held > bytes {
                    return bad(&format!(
                        "{} messages ({held} bytes) wait, over the limits {queue} and {bytes}",
                        s.waiting.len()
                    ));
                }
            }
            Event::Disconnect => {
                if !s.connected || s.disconnect {
                    return bad("a disconnect before the connection was up, or a second one");
                }
                s.disconnect = true;
            }
            Event::Close(reason) => {
                s.over = true;
                if let CloseReason::Protocol(p) = reason {
                    counts.protocol_closes += 1;
                    if !altered && !honest_peer_may_cause(p) {
                        return bad("the peer's bytes came as written, yet they were refused");
                    }
                }
            }
        }
        Ok(())
    }

    /// Both users destroy their sides; the stream runs dry; both must be closed with no
    /// timer left.
    fn settle(&mut self, counts: &mut Counts) -> Result<(), String> {
        for s in &mut self.sides {
            if !s.destroyed {
                s.cep.destroy(self.now);
                s.destroyed = true;
            }
        }
        let end = self.now + SETTLE;
        loop {
            self.collect(counts)?;
            let mut moved = false;
            for i in [0, 1] {
                moved |= self.deliver(i, usize::MAX);
            }
            if moved {
                continue;
            }
            let next = self.sides.iter().filter_map(|s| s.cep.poll_timeout()).min();
            match next {
                Some(t) if t <= end => {
                    self.now = self.now.max(t);
                    self.run_timers();
                }
                Some(t) => {
                    return Err(format!(
                        "a timer still armed an hour after both were destroyed (in {:?})",
                        t - self.now
                    ))
                }
                None => break,
            }
        }
        for (i, s) in self.sides.iter().enumerate() {
            if !s.cep.is_closed() || s.cep.poll_timeout().is_some() {
                return Err(format!(
                    "side {i} destroyed but not closed ({:?}, timer {:?})",
                    s.cep.state(),
                    s.cep.poll_timeout()
                ));
            }
        }
        Ok(())
    }
}
