//! Scenarios for the iWARP engine (`rcm_proto::iw`): two `Cep`s wired byte stream to byte
//! stream by a tiny deterministic harness (optional fragmentation into 1-byte or random chunks,
//! a fake clock for the timers), plus bytes injected by hand for the peers that misbehave.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rcm_proto::iw::{
    AcceptParams, Cep, CepConfig, CepError, CloseReason, ConnectError, ConnectParams, ConnectReply,
    Event, MpaVersion, ProtocolError, Role, RtrKind, RtrModes, State, TcpAction,
};
use rcm_wire::mpa::{
    self, emit_fpdu, llp_ecode, term_etype, term_layer, DdpRdmapHeader, Enhanced, MpaFrame,
    RdmapOpcode, Terminate, QN_SEND, QN_TERMINATE,
};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

// ------------------------------------------------------------------------------------------
// Harness
// ------------------------------------------------------------------------------------------

/// How a pipe hands its bytes to the receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Frag {
    /// Everything queued at once.
    Whole,
    /// One byte at a time.
    OneByte,
    /// Random chunks of 1..=max bytes.
    Random(usize),
}

/// One direction of the TCP connection.
#[derive(Default)]
struct Pipe {
    bytes: VecDeque<u8>,
    fin: bool,
    fin_delivered: bool,
    rst: bool,
    rst_delivered: bool,
    /// Deliver nothing (a peer that went silent, or a lost link).
    hold: bool,
    /// Flip this byte offset (counted from the start of the stream) on its way.
    corrupt_at: Option<usize>,
    offset: usize,
}

struct Side {
    cep: Cep,
    events: Vec<Event>,
    actions: Vec<TcpAction>,
    /// Every byte this side wrote, in order.
    sent: Vec<u8>,
}

impl Side {
    fn new(cep: Cep) -> Self {
        Side {
            cep,
            events: Vec::new(),
            actions: Vec::new(),
            sent: Vec::new(),
        }
    }
}

/// Side 0 is active, side 1 passive; `pipes[i]` carries what side `i` writes.
struct Net {
    t0: Instant,
    now: Instant,
    sides: [Side; 2],
    pipes: [Pipe; 2],
    frag: Frag,
    rng: StdRng,
}

const A: usize = 0;
const B: usize = 1;

impl Net {
    fn new(frag: Frag, seed: u64) -> Self {
        Self::with_configs(frag, seed, CepConfig::default(), CepConfig::default())
    }

    fn with_configs(frag: Frag, seed: u64, ca: CepConfig, cb: CepConfig) -> Self {
        let t0 = Instant::now();
        Net {
            t0,
            now: t0,
            sides: [Side::new(Cep::active(ca)), Side::new(Cep::passive(t0, cb))],
            pipes: [Pipe::default(), Pipe::default()],
            frag,
            rng: StdRng::seed_from_u64(seed),
        }
    }

    fn a(&mut self) -> &mut Cep {
        &mut self.sides[A].cep
    }

    fn b(&mut self) -> &mut Cep {
        &mut self.sides[B].cep
    }

    /// Moves outputs to pipes and pipes to inputs until nothing moves.
    fn pump(&mut self) {
        for _ in 0..10_000_000 {
            if !self.step() {
                return;
            }
        }
        panic!("the harness did not settle: a livelock");
    }

    fn collect(&mut self, i: usize) -> bool {
        let mut progress = false;
        let side = &mut self.sides[i];
        while let Some(t) = side.cep.poll_transmit() {
            progress = true;
            // Written to the socket at once (the pipe is the kernel's buffers).
            side.cep.transmitted(t.len());
            side.sent.extend_from_slice(&t);
            let pipe = &mut self.pipes[i];
            if !pipe.fin && !pipe.rst {
                pipe.bytes.extend(t);
            }
        }
        while let Some(act) = side.cep.poll_tcp_action() {
            progress = true;
            side.actions.push(act);
            match act {
                TcpAction::Shutdown | TcpAction::Close => self.pipes[i].fin = true,
                TcpAction::Reset => {
                    self.pipes[i].rst = true;
                    self.pipes[i].bytes.clear();
                    self.pipes[1 - i].bytes.clear();
                    self.pipes[1 - i].hold = true;
                }
            }
        }
        while let Some(e) = side.cep.poll_event() {
            progress = true;
            side.events.push(e);
        }
        progress
    }

    fn deliver(&mut self, i: usize) -> bool {
        let now = self.now;
        let j = 1 - i;
        let pipe = &mut self.pipes[i];
        if pipe.rst {
            if !pipe.rst_delivered {
                pipe.rst_delivered = true;
                self.sides[j].cep.on_tcp_closed(now, false);
                return true;
            }
            return false;
        }
        if pipe.hold {
            return false;
        }
        if !pipe.bytes.is_empty() {
            let n = match self.frag {
                Frag::Whole => pipe.bytes.len(),
                Frag::OneByte => 1,
                Frag::Random(max) => self.rng.gen_range(1..=max.max(1)),
            }
            .min(pipe.bytes.len());
            let mut chunk: Vec<u8> = pipe.bytes.drain(..n).collect();
            if let Some(at) = pipe.corrupt_at {
                if (pipe.offset..pipe.offset + n).contains(&at) {
                    chunk[at - pipe.offset] ^= 0x5a;
                    pipe.corrupt_at = None;
                }
            }
            pipe.offset += n;
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

    fn step(&mut self) -> bool {
        let mut progress = self.collect(A);
        progress |= self.collect(B);
        progress |= self.deliver(A);
        progress |= self.collect(B);
        progress |= self.deliver(B);
        progress
    }

    /// Advances the fake clock by `d`, firing due timers on the way (in order), then pumps.
    fn advance(&mut self, d: Duration) {
        let end = self.now + d;
        loop {
            self.pump();
            let next = [A, B]
                .iter()
                .filter_map(|&i| self.sides[i].cep.poll_timeout())
                .filter(|&t| t <= end)
                .min();
            let Some(t) = next else { break };
            self.now = t.max(self.now);
            for i in [A, B] {
                let now = self.now;
                self.sides[i].cep.on_timer(now);
            }
        }
        self.now = end;
        self.pump();
    }

    fn connect(&mut self, p: &ConnectParams) {
        let now = self.now;
        self.a().connect(now, p).unwrap();
        self.pump();
    }

    fn accept(&mut self, p: &AcceptParams) {
        let now = self.now;
        self.b().accept(now, p).unwrap();
        self.pump();
    }

    fn events(&self, i: usize) -> &[Event] {
        &self.sides[i].events
    }

    fn take_events(&mut self, i: usize) -> Vec<Event> {
        std::mem::take(&mut self.sides[i].events)
    }

    fn send(&mut self, i: usize, payload: &[u8]) {
        let now = self.now;
        self.sides[i].cep.send(now, payload).unwrap();
        self.pump();
    }

    fn messages(&self, i: usize) -> Vec<Vec<u8>> {
        self.sides[i]
            .events
            .iter()
            .filter_map(|e| match e {
                Event::Message(m) => Some(m.clone()),
                _ => None,
            })
            .collect()
    }

    /// Runs connect → ConnectRequest → accept and checks both ends are established.
    fn establish(&mut self, cp: &ConnectParams, ap: &AcceptParams) {
        self.connect(cp);
        assert!(
            matches!(self.events(B).last(), Some(Event::ConnectRequest(_))),
            "{:?}",
            self.events(B)
        );
        self.accept(ap);
        assert_eq!(self.sides[A].cep.state(), State::Established);
        assert_eq!(self.sides[B].cep.state(), State::Established);
        assert!(
            self.events(A)
                .iter()
                .any(|e| matches!(e, Event::ConnectReply(ConnectReply::Accepted(_)))),
            "{:?}",
            self.events(A)
        );
        assert!(
            self.events(B)
                .iter()
                .any(|e| matches!(e, Event::Established(_))),
            "{:?}",
            self.events(B)
        );
    }
}

fn accepted(events: &[Event]) -> rcm_proto::iw::Negotiated {
    events
        .iter()
        .find_map(|e| match e {
            Event::ConnectReply(ConnectReply::Accepted(n)) => Some(n.clone()),
            _ => None,
        })
        .expect("no accepting ConnectReply")
}

fn established(events: &[Event]) -> rcm_proto::iw::Negotiated {
    events
        .iter()
        .find_map(|e| match e {
            Event::Established(n) => Some(n.clone()),
            _ => None,
        })
        .expect("no Established")
}

fn request(events: &[Event]) -> rcm_proto::iw::ConnectRequest {
    events
        .iter()
        .find_map(|e| match e {
            Event::ConnectRequest(r) => Some(r.clone()),
            _ => None,
        })
        .expect("no ConnectRequest")
}

fn last_close(events: &[Event]) -> Option<CloseReason> {
    match events.last() {
        Some(Event::Close(r)) => Some(r.clone()),
        _ => None,
    }
}

fn v1() -> ConnectParams {
    ConnectParams {
        version: MpaVersion::V1,
        ..ConnectParams::default()
    }
}

/// Splits a byte stream into FPDUs (no CRC check) and returns their ULPDUs.
fn ulpdus(mut stream: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    while !stream.is_empty() {
        let (u, used) = mpa::parse_fpdu(stream, false).unwrap();
        out.push(u.to_vec());
        stream = &stream[used..];
    }
    out
}

/// The Terminate carried by the last FPDU of `stream`.
fn last_terminate(stream: &[u8]) -> Terminate {
    let u = ulpdus(stream).pop().expect("no FPDU");
    let (h, n) = DdpRdmapHeader::parse(&u).unwrap();
    assert_eq!(h.opcode, RdmapOpcode::Terminate);
    Terminate::parse(&u[n..]).unwrap()
}

/// A Send FPDU with header fields chosen by the test.
fn send_fpdu(qn: u32, msn: u32, mo: u32, last: bool, payload: &[u8], crc: bool) -> Vec<u8> {
    let mut h = DdpRdmapHeader::untagged(RdmapOpcode::Send, qn, msn, mo);
    h.last = last;
    let mut u = h.to_vec().unwrap();
    u.extend_from_slice(payload);
    let mut out = Vec::new();
    emit_fpdu(&u, crc, &mut out).unwrap();
    out
}

// ------------------------------------------------------------------------------------------
// Version negotiation, IRD/ORD, private data
// ------------------------------------------------------------------------------------------

fn full_exchange(frag: Frag, seed: u64, cp: &ConnectParams, ap: &AcceptParams) -> Net {
    let mut n = Net::new(frag, seed);
    n.establish(cp, ap);
    n.send(A, b"ping from the initiator");
    n.send(B, b"pong from the responder");
    n.send(A, &[]);
    n.send(B, &vec![7u8; 5000]);
    let now = n.now;
    n.a().disconnect(now).unwrap();
    assert_eq!(n.sides[A].cep.state(), State::Closing);
    n.pump();
    n
}

#[test]
fn v2_to_v2_connect_messages_and_graceful_close() {
    let cp = ConnectParams {
        private_data: b"hello".to_vec(),
        ..ConnectParams::default()
    };
    let ap = AcceptParams {
        private_data: b"welcome".to_vec(),
        ..AcceptParams::default()
    };
    let n = full_exchange(Frag::Whole, 1, &cp, &ap);
    let r = request(n.events(B));
    assert_eq!(
        (r.revision, r.enhanced, r.ird, r.ord, r.p2p, r.crc),
        (2, true, Some(1), Some(1), None, false)
    );
    assert_eq!(r.private_data, b"hello");
    let na = accepted(n.events(A));
    assert_eq!(
        (na.revision, na.enhanced, na.crc, na.ird, na.ord, na.rtr),
        (2, true, false, 1, 1, None)
    );
    assert_eq!(na.private_data, b"welcome");
    let nb = established(n.events(B));
    assert_eq!(nb.private_data, b"hello");
    assert_eq!(
        n.messages(B),
        vec![b"ping from the initiator".to_vec(), Vec::new()]
    );
    assert_eq!(
        n.messages(A),
        vec![b"pong from the responder".to_vec(), vec![7u8; 5000]]
    );
    // The responder saw our FIN: Disconnect then Close; we saw its FIN in Closing: Close.
    let eb = n.events(B);
    assert_eq!(eb[eb.len() - 2], Event::Disconnect);
    assert_eq!(last_close(eb), Some(CloseReason::Graceful));
    assert_eq!(last_close(n.events(A)), Some(CloseReason::Graceful));
    assert_eq!(
        n.sides[A].actions,
        vec![TcpAction::Shutdown, TcpAction::Close]
    );
    assert_eq!(n.sides[B].actions, vec![TcpAction::Close]);
    for i in [A, B] {
        assert!(n.sides[i].cep.is_closed());
        assert_eq!(n.sides[i].cep.state(), State::Idle);
        assert_eq!(n.sides[i].cep.poll_timeout(), None);
    }
}

#[test]
fn v1_to_v1() {
    let cp = ConnectParams {
        private_data: b"v1 data".to_vec(),
        ..v1()
    };
    let n = full_exchange(Frag::Whole, 2, &cp, &AcceptParams::default());
    let r = request(n.events(B));
    assert_eq!(
        (r.revision, r.enhanced, r.ird, r.ord),
        (1, false, None, None)
    );
    let na = accepted(n.events(A));
    assert_eq!((na.revision, na.enhanced), (1, false));
    // The Request on the wire is the 20-byte RFC 5044 header plus the data.
    assert_eq!(&n.sides[A].sent[..20], b"MPA ID Req Frame\x00\x01\x00\x07");
    assert_eq!(n.messages(B).len(), 2);
}

#[test]
fn v2_initiator_v1_responder_falls_back_to_v1() {
    let cb = CepConfig {
        max_revision: 1,
        ..CepConfig::default()
    };
    let mut n = Net::with_configs(Frag::Whole, 3, CepConfig::default(), cb);
    n.establish(&ConnectParams::default(), &AcceptParams::default());
    let na = accepted(n.events(A));
    assert_eq!((na.revision, na.enhanced, na.ird, na.ord), (1, false, 1, 1));
    // The Reply on the wire is revision 1, no Enhanced flag, no IRD/ORD words.
    let (rep, _) = MpaFrame::parse(&n.sides[B].sent).unwrap();
    assert_eq!(
        (rep.revision, rep.enhanced, rep.flags.enhanced),
        (1, None, false)
    );
    n.send(A, b"x");
    assert_eq!(n.messages(B), vec![b"x".to_vec()]);
}

#[test]
fn v2_initiator_refuses_v1_reply_when_configured_like_siw() {
    let ca = CepConfig {
        accept_v1_reply: false,
        ..CepConfig::default()
    };
    let cb = CepConfig {
        max_revision: 1,
        ..CepConfig::default()
    };
    let mut n = Net::with_configs(Frag::Whole, 4, ca, cb);
    n.connect(&ConnectParams::default());
    n.accept(&AcceptParams::default());
    assert_eq!(
        n.events(A),
        &[Event::ConnectReply(ConnectReply::Error(
            ConnectError::Protocol(ProtocolError::RevisionMismatch)
        ))]
    );
    assert_eq!(n.sides[A].actions, vec![TcpAction::Close]);
    // The responder had established; our FIN ends it.
    assert_eq!(last_close(n.events(B)), Some(CloseReason::Graceful));
}

#[test]
fn v1_initiator_v2_responder_answers_v1() {
    let mut n = Net::new(Frag::Whole, 5);
    n.establish(&v1(), &AcceptParams::default());
    let (rep, _) = MpaFrame::parse(&n.sides[B].sent).unwrap();
    assert_eq!(rep.revision, 1);
    assert_eq!(accepted(n.events(A)).revision, 1);
}

#[test]
fn ird_ord_negotiation_is_relaxed_like_siw() {
    let mut n = Net::new(Frag::Whole, 6);
    let cp = ConnectParams {
        ird: 4,
        ord: 2,
        ..ConnectParams::default()
    };
    let ap = AcceptParams {
        ird: 1,
        ord: 8,
        ..AcceptParams::default()
    };
    n.establish(&cp, &ap);
    // Responder: ORD lowered to the initiator's IRD (4), IRD raised to its ORD (2).
    let nb = established(n.events(B));
    assert_eq!((nb.ird, nb.ord), (2, 4));
    // Initiator: IRD = responder's ORD, ORD = responder's IRD.
    let na = accepted(n.events(A));
    assert_eq!((na.ird, na.ord), (4, 2));
    let (rep, _) = MpaFrame::parse(&n.sides[B].sent).unwrap();
    assert_eq!(rep.enhanced, Some(Enhanced::new(2, 4)));
}

#[test]
fn ird_ord_over_the_device_limit_is_refused() {
    let mut n = Net::new(Frag::Whole, 7);
    let now = n.now;
    let cp = ConnectParams {
        ird: 129,
        ..ConnectParams::default()
    };
    assert_eq!(
        n.a().connect(now, &cp),
        Err(CepError::IrdOrdTooLarge {
            value: 129,
            max: 128
        })
    );
    assert_eq!(n.sides[A].cep.state(), State::Idle);
    n.connect(&ConnectParams::default());
    let ap = AcceptParams {
        ord: 200,
        ..AcceptParams::default()
    };
    assert!(matches!(
        n.b().accept(now, &ap),
        Err(CepError::IrdOrdTooLarge { value: 200, .. })
    ));
    assert_eq!(n.sides[B].cep.state(), State::ConnRecv);
}

#[test]
fn private_data_limits() {
    // Revision 1: 256 bytes go both ways, 257 are refused with a typed error.
    for len in [0usize, 256] {
        let mut n = Net::new(Frag::Random(37), len as u64);
        let pd: Vec<u8> = (0..len).map(|i| i as u8).collect();
        let cp = ConnectParams {
            private_data: pd.clone(),
            ..v1()
        };
        let ap = AcceptParams {
            private_data: pd.iter().rev().copied().collect(),
            ..AcceptParams::default()
        };
        n.establish(&cp, &ap);
        assert_eq!(request(n.events(B)).private_data, pd);
        assert_eq!(
            accepted(n.events(A)).private_data,
            pd.iter().rev().copied().collect::<Vec<_>>()
        );
    }
    let mut n = Net::new(Frag::Whole, 8);
    let now = n.now;
    let too_long = ConnectParams {
        private_data: vec![0; 257],
        ..v1()
    };
    assert_eq!(
        n.a().connect(now, &too_long),
        Err(CepError::PrivateDataTooLong { len: 257, max: 256 })
    );
    // Revision 2: the IRD/ORD words count, so 252 is the most (siw_accept's rule).
    let v2_max = ConnectParams {
        private_data: vec![1; 252],
        ..ConnectParams::default()
    };
    let v2_over = ConnectParams {
        private_data: vec![1; 253],
        ..ConnectParams::default()
    };
    assert_eq!(
        n.a().connect(now, &v2_over),
        Err(CepError::PrivateDataTooLong { len: 253, max: 252 })
    );
    n.connect(&v2_max);
    assert_eq!(request(n.events(B)).private_data.len(), 252);
    let ap_over = AcceptParams {
        private_data: vec![0; 253],
        ..AcceptParams::default()
    };
    assert_eq!(
        n.b().accept(now, &ap_over),
        Err(CepError::PrivateDataTooLong { len: 253, max: 252 })
    );
    assert_eq!(
        n.b().reject(now, &[0; 257]),
        Err(CepError::PrivateDataTooLong { len: 257, max: 252 })
    );
    // The refused commands changed nothing: accepting still works.
    n.accept(&AcceptParams {
        private_data: vec![9; 252],
        ..AcceptParams::default()
    });
    assert_eq!(accepted(n.events(A)).private_data, vec![9; 252]);
}

/// A Request or Reply header announcing `pd_len` bytes.
fn raw_header(key: &[u8; 16], flags: u8, rev: u8, pd_len: u16) -> Vec<u8> {
    let mut v = key.to_vec();
    v.extend_from_slice(&[flags, rev]);
    v.extend_from_slice(&pd_len.to_be_bytes());
    v
}

#[test]
fn a_peer_sending_257_bytes_of_private_data_is_a_protocol_error() {
    // At the responder.
    let mut n = Net::new(Frag::Whole, 9);
    let now = n.now;
    let mut req = raw_header(&mpa::REQ_KEY, 0, 1, 257);
    req.extend_from_slice(&[0; 257]);
    n.b().on_bytes(now, &req);
    n.pump();
    assert_eq!(
        n.events(B),
        &[Event::Close(CloseReason::Protocol(
            ProtocolError::PrivateDataTooLong { len: 257, max: 256 }
        ))]
    );
    assert_eq!(n.sides[B].actions, vec![TcpAction::Close]);
    // At the initiator: refused as soon as the header is in, without waiting for the data.
    let mut n = Net::new(Frag::Whole, 10);
    n.pipes[A].hold = true;
    n.connect(&v1());
    let now = n.now;
    n.a().on_bytes(now, &raw_header(&mpa::REP_KEY, 0, 1, 257));
    n.pump();
    assert_eq!(
        n.events(A),
        &[Event::ConnectReply(ConnectReply::Error(
            ConnectError::Protocol(ProtocolError::PrivateDataTooLong { len: 257, max: 256 })
        ))]
    );
}

// ------------------------------------------------------------------------------------------
// Rejects, markers
// ------------------------------------------------------------------------------------------

#[test]
fn reject_with_private_data_both_versions() {
    for cp in [v1(), ConnectParams::default()] {
        for frag in [Frag::Whole, Frag::OneByte] {
            let mut n = Net::new(frag, 11);
            n.connect(&cp);
            let now = n.now;
            n.b().reject(now, b"go away").unwrap();
            assert_eq!(n.sides[B].cep.state(), State::Idle);
            n.pump();
            let rev = if cp.version == MpaVersion::V1 { 1 } else { 2 };
            assert_eq!(
                n.events(A),
                &[Event::ConnectReply(ConnectReply::Rejected {
                    revision: rev,
                    private_data: b"go away".to_vec()
                })]
            );
            // The iw_cm generates no event for a reject.
            assert_eq!(n.events(B).len(), 1);
            assert_eq!(n.sides[B].actions, vec![TcpAction::Close]);
            assert_eq!(n.sides[A].actions, vec![TcpAction::Close]);
            let (rep, _) = MpaFrame::parse(&n.sides[B].sent).unwrap();
            assert!(rep.flags.reject);
            assert_eq!(rep.flags.enhanced, rev == 2);
            assert!(n.sides[A].cep.is_closed() && n.sides[B].cep.is_closed());
        }
    }
}

#[test]
fn markers_requested_are_rejected_like_siw() {
    let mut n = Net::new(Frag::Whole, 12);
    let mut f = MpaFrame::request_v2(1, 1, Vec::new());
    f.flags.markers = true;
    let now = n.now;
    n.b().on_bytes(now, &f.to_vec().unwrap());
    n.pump();
    assert_eq!(
        n.events(B),
        &[Event::Close(CloseReason::Protocol(
            ProtocolError::MarkersRequested
        ))]
    );
    let (rep, _) = MpaFrame::parse(&n.sides[B].sent).unwrap();
    assert!(rep.flags.reject && !rep.flags.markers);
    assert!(rep.private_data.is_empty());

    // With bytes after the Request in the same read, siw's `siw_recv_mpa_rr` fails
    // ("peer sent extra data") before `siw_proc_mpareq` looks at M: a close, nothing sent.
    let mut v1 = MpaFrame::request_v1(Vec::new());
    v1.flags.markers = true;
    let mut v2 = MpaFrame::request_v2(1, 1, b"pd".to_vec());
    v2.flags.markers = true;
    for (seed, req) in [(14, v1), (15, v2)] {
        let mut n = Net::new(Frag::Whole, seed);
        let mut bytes = req.to_vec().unwrap();
        bytes.extend_from_slice(&[0, 0, 0, 0]);
        let now = n.now;
        n.b().on_bytes(now, &bytes);
        n.pump();
        assert_eq!(
            n.events(B),
            &[Event::Close(CloseReason::Protocol(
                ProtocolError::UnexpectedData
            ))],
            "revision {}",
            req.revision
        );
        assert!(
            n.sides[B].sent.is_empty(),
            "revision {}: {} bytes sent",
            req.revision,
            n.sides[B].sent.len()
        );
        assert_eq!(n.sides[B].actions, vec![TcpAction::Close]);
    }

    // A Reply asking for markers fails the connect.
    let mut n = Net::new(Frag::Whole, 13);
    n.pipes[A].hold = true;
    n.connect(&ConnectParams::default());
    let mut rep = MpaFrame::reply_v2(1, 1, Vec::new());
    rep.flags.markers = true;
    let now = n.now;
    n.a().on_bytes(now, &rep.to_vec().unwrap());
    n.pump();
    assert_eq!(
        n.events(A),
        &[Event::ConnectReply(ConnectReply::Error(
            ConnectError::Protocol(ProtocolError::MarkersRequested)
        ))]
    );
}

/// A revision-2 Reply to our revision-1 Request fails the connect (RevisionMismatch, which
/// rdma_cm reports as REJECTED). siw would take it as revision 1, the IRD/ORD words as
/// private data; no responder sends one (siw, cxgb4 and irdma answer in the Request's
/// revision), and reading a frame of a revision we did not offer is guessing.
#[test]
fn a_v2_reply_to_a_v1_request_fails_the_connect() {
    for reply in [
        MpaFrame::reply_v2(1, 1, b"pd".to_vec()),
        MpaFrame::reply_v2(1, 1, Vec::new()),
    ] {
        let mut n = Net::new(Frag::Whole, 18);
        n.pipes[A].hold = true;
        n.connect(&ConnectParams {
            version: MpaVersion::V1,
            ..ConnectParams::default()
        });
        let now = n.now;
        n.a().on_bytes(now, &reply.to_vec().unwrap());
        n.pump();
        assert_eq!(
            n.events(A),
            &[Event::ConnectReply(ConnectReply::Error(
                ConnectError::Protocol(ProtocolError::RevisionMismatch)
            ))]
        );
        assert!(n.sides[A].cep.is_closed());
    }
}

#[test]
fn an_enhanced_request_too_short_for_ird_ord_is_rejected_like_siw() {
    // siw_proc_mpareq reads the whole frame, then answers with the Request's header turned
    // into a Reply: R set, M cleared, PD_Length 0; CRC and the Enhanced flag as asked.
    for (flags, want_flags) in [(0x10, 0x30), (0x10 | 0x40 | 0x80, 0x30 | 0x40)] {
        for len in 0..4u16 {
            let mut req = raw_header(&mpa::REQ_KEY, flags, 2, len);
            req.extend(std::iter::repeat_n(7u8, usize::from(len)));
            let want = raw_header(&mpa::REP_KEY, want_flags, 2, 0);
            for frag in [Frag::Whole, Frag::OneByte, Frag::Random(7)] {
                let mut n = Net::new(frag, 16);
                n.pipes[A].bytes.extend(req.iter().copied());
                n.pump();
                assert!(
                    matches!(
                        n.events(B),
                        [Event::Close(CloseReason::Protocol(
                            ProtocolError::Malformed(_)
                        ))]
                    ),
                    "{:?}",
                    n.events(B)
                );
                assert_eq!(n.sides[B].sent, want, "flags {flags:#x}, PD_Length {len}");
                assert!(n.sides[B].cep.is_closed());
                // The initiator takes that Reply as a reject, as siw_proc_mpareply does (R
                // is looked at before the enhanced words).
                let (events, _) = feed_active(&want, false, frag);
                assert_eq!(
                    events,
                    [Event::ConnectReply(ConnectReply::Rejected {
                        revision: 2,
                        private_data: Vec::new()
                    })]
                );
            }
        }
    }
    // With bytes after it, siw's read of the frame fails first: nothing is sent.
    let mut n = Net::new(Frag::Whole, 17);
    let mut req = raw_header(&mpa::REQ_KEY, 0x10, 2, 2);
    req.extend_from_slice(&[0, 1, 0xEE]);
    n.pipes[A].bytes.extend(req.iter().copied());
    n.pump();
    assert!(n.sides[B].sent.is_empty() && n.sides[B].cep.is_closed());
    // A short enhanced Reply that is not a reject fails the connect.
    let (events, _) = feed_active(&raw_header(&mpa::REP_KEY, 0x10, 2, 0), false, Frag::Whole);
    assert!(matches!(
        events[..],
        [Event::ConnectReply(ConnectReply::Error(
            ConnectError::Protocol(ProtocolError::Malformed(_))
        ))]
    ));
}

// ------------------------------------------------------------------------------------------
// Bad frames
// ------------------------------------------------------------------------------------------

/// Feeds `bytes` (then, if `fin`, a FIN) to a fresh passive endpoint in `frag` chunks and
/// returns its events; checks it closed exactly once.
fn feed_passive(bytes: &[u8], fin: bool, frag: Frag) -> Vec<Event> {
    let mut n = Net::new(frag, 14);
    n.pipes[A].bytes.extend(bytes.iter().copied());
    n.pipes[A].fin = fin;
    n.pump();
    n.advance(Duration::from_secs(60));
    if n.sides[B].cep.state() == State::ConnRecv {
        // The bytes happened to be a valid Request: answer it so the endpoint ends.
        let now = n.now;
        n.b().reject(now, &[]).unwrap();
        n.pump();
    }
    let b = &n.sides[B];
    assert!(b.cep.is_closed(), "not closed: {:?}", b.events);
    assert_eq!(
        b.actions
            .iter()
            .filter(|a| **a != TcpAction::Shutdown)
            .count(),
        1
    );
    b.events.clone()
}

/// The same for an active endpoint that has sent its Request.
fn feed_active(bytes: &[u8], fin: bool, frag: Frag) -> (Vec<Event>, Vec<u8>) {
    // The real passive endpoint never sees the Request; keep it from timing out and closing.
    let cb = CepConfig {
        mpa_request_timeout: Duration::from_secs(3600),
        ..CepConfig::default()
    };
    let mut n = Net::with_configs(frag, 15, CepConfig::default(), cb);
    n.pipes[A].hold = true;
    n.connect(&ConnectParams::default());
    n.pipes[B].bytes.extend(bytes.iter().copied());
    n.pipes[B].fin = fin;
    n.pump();
    n.advance(Duration::from_secs(60));
    if n.sides[A].cep.state() == State::Established {
        // The bytes happened to be a valid Reply: end the connection.
        let now = n.now;
        n.a().abort(now).unwrap();
        n.pump();
    }
    let a = &n.sides[A];
    assert!(a.cep.is_closed(), "not closed: {:?}", a.events);
    (a.events.clone(), a.sent.clone())
}

fn proto_close(e: ProtocolError) -> Vec<Event> {
    vec![Event::Close(CloseReason::Protocol(e))]
}

fn proto_reply(e: ProtocolError) -> Vec<Event> {
    vec![Event::ConnectReply(ConnectReply::Error(
        ConnectError::Protocol(e),
    ))]
}

#[test]
fn bad_requests_end_in_one_error_and_a_close() {
    let good = MpaFrame::request_v2(1, 1, b"pd".to_vec()).to_vec().unwrap();
    let mut bad_rev = good.clone();
    bad_rev[17] = 3;
    let mut rev0 = good.clone();
    rev0[17] = 0;
    let reply_key = MpaFrame::reply_v2(1, 1, Vec::new()).to_vec().unwrap();
    let mut short_enhanced = raw_header(&mpa::REQ_KEY, 0x10, 2, 2);
    short_enhanced.extend_from_slice(&[0, 1]);
    let mut trailing = good.clone();
    trailing.extend_from_slice(&[0, 0, 0, 0]);
    for frag in [Frag::Whole, Frag::OneByte, Frag::Random(5)] {
        assert_eq!(
            feed_passive(&reply_key, false, frag),
            proto_close(ProtocolError::BadKey)
        );
        assert_eq!(
            feed_passive(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", false, frag),
            proto_close(ProtocolError::BadKey)
        );
        assert_eq!(
            feed_passive(&bad_rev, false, frag),
            proto_close(ProtocolError::BadRevision(3))
        );
        assert_eq!(
            feed_passive(&rev0, false, frag),
            proto_close(ProtocolError::BadRevision(0))
        );
        assert_eq!(
            feed_passive(&raw_header(&mpa::REQ_KEY, 0, 1, 0xFFFF), false, frag),
            proto_close(ProtocolError::PrivateDataTooLong {
                len: 0xFFFF,
                max: 256
            })
        );
        assert!(matches!(
            feed_passive(&short_enhanced, false, frag)[..],
            [Event::Close(CloseReason::Protocol(
                ProtocolError::Malformed(_)
            ))]
        ));
        // Truncated, then the peer closes.
        assert_eq!(
            feed_passive(&good[..good.len() - 1], true, frag),
            vec![Event::Close(CloseReason::Protocol(
                ProtocolError::Truncated
            ))]
        );
        assert_eq!(
            feed_passive(&good[..3], true, frag),
            vec![Event::Close(CloseReason::Protocol(
                ProtocolError::Truncated
            ))]
        );
        // Truncated and the peer goes silent: the MPA Request timer ends it.
        assert_eq!(
            feed_passive(&good[..10], false, frag),
            vec![Event::Close(CloseReason::Timeout)]
        );
        // Nothing at all, then FIN.
        assert_eq!(
            feed_passive(&[], true, frag),
            vec![Event::Close(CloseReason::Graceful)]
        );
    }
    // Extra bytes after the Request (the initiator may not send before the Reply).
    let ev = feed_passive(&trailing, false, Frag::Whole);
    assert_eq!(
        ev.last(),
        Some(&Event::Close(CloseReason::Protocol(
            ProtocolError::UnexpectedData
        )))
    );
}

#[test]
fn bad_replies_end_in_one_error_and_a_close() {
    let good = MpaFrame::reply_v2(1, 1, b"pd".to_vec()).to_vec().unwrap();
    let mut bad_rev = good.clone();
    bad_rev[17] = 7;
    let req_key = MpaFrame::request_v2(1, 1, Vec::new()).to_vec().unwrap();
    let mut no_enhanced = good.clone();
    no_enhanced[16] = 0;
    for frag in [Frag::Whole, Frag::OneByte, Frag::Random(3)] {
        // A wrong key earns a Terminate (LLP, invalid Request/Reply), as from siw.
        let (ev, sent) = feed_active(&req_key, false, frag);
        assert_eq!(ev, proto_reply(ProtocolError::BadKey));
        let (_, used) = MpaFrame::parse(&sent).unwrap();
        let t = last_terminate(&sent[used..]);
        assert_eq!(
            (t.layer, t.error_type, t.error_code),
            (
                term_layer::LLP,
                term_etype::LLP_MPA,
                llp_ecode::INVALID_REQ_REP
            )
        );
        let (ev, _) = feed_active(b"\x00\x00garbage garbage garbage", false, frag);
        assert_eq!(ev, proto_reply(ProtocolError::BadKey));
        // A wrong key shorter than a key, then the end of the stream: judged on the bytes
        // that came however they were split, not left waiting for 16 and called truncated.
        let (ev, sent) = feed_active(b"MPA X", true, frag);
        assert_eq!(ev, proto_reply(ProtocolError::BadKey), "{frag:?}");
        let (_, used) = MpaFrame::parse(&sent).unwrap();
        assert_eq!(
            last_terminate(&sent[used..]).error_code,
            llp_ecode::INVALID_REQ_REP
        );
        let (ev, _) = feed_active(&bad_rev, false, frag);
        assert_eq!(ev, proto_reply(ProtocolError::BadRevision(7)));
        let (ev, _) = feed_active(&raw_header(&mpa::REP_KEY, 0x10, 2, 300), false, frag);
        assert_eq!(
            ev,
            proto_reply(ProtocolError::PrivateDataTooLong { len: 300, max: 256 })
        );
        // Revision 2 without the Enhanced flag, after an enhanced Request.
        let (ev, _) = feed_active(&no_enhanced, false, frag);
        assert_eq!(ev, proto_reply(ProtocolError::RevisionMismatch));
        let (ev, _) = feed_active(&good[..good.len() - 2], true, frag);
        assert_eq!(ev, proto_reply(ProtocolError::Truncated));
        let (ev, _) = feed_active(&[], true, frag);
        assert_eq!(
            ev,
            vec![Event::ConnectReply(ConnectReply::Error(
                ConnectError::PeerClosed
            ))]
        );
        let (ev, _) = feed_active(&good[..5], false, frag);
        assert_eq!(
            ev,
            vec![Event::ConnectReply(ConnectReply::Error(
                ConnectError::Timeout
            ))]
        );
    }
}

#[test]
fn bytes_before_our_request_are_a_protocol_error() {
    let mut n = Net::new(Frag::Whole, 16);
    let now = n.now;
    n.a().on_bytes(now, b"MPA ID Rep Frame");
    n.pump();
    assert_eq!(n.events(A), proto_close(ProtocolError::UnexpectedData));
    assert!(n.sides[A].cep.is_closed());
    assert_eq!(
        n.a().connect(now, &ConnectParams::default()),
        Err(CepError::InvalidState(State::Idle))
    );
}

#[test]
fn reset_before_the_reply() {
    let mut n = Net::new(Frag::Whole, 17);
    n.pipes[A].hold = true;
    n.connect(&ConnectParams::default());
    let now = n.now;
    n.a().on_tcp_closed(now, false);
    n.pump();
    assert_eq!(
        n.events(A),
        &[Event::ConnectReply(ConnectReply::Error(
            ConnectError::Reset
        ))]
    );
}

// ------------------------------------------------------------------------------------------
// Timers
// ------------------------------------------------------------------------------------------

#[test]
fn passive_mpa_request_timer_is_5s() {
    let mut n = Net::new(Frag::Whole, 18);
    assert_eq!(
        n.sides[B].cep.poll_timeout(),
        Some(n.t0 + Duration::from_secs(5))
    );
    n.advance(Duration::from_millis(4999));
    assert!(n.events(B).is_empty());
    n.advance(Duration::from_millis(1));
    assert_eq!(n.events(B), &[Event::Close(CloseReason::Timeout)]);
    assert_eq!(n.sides[B].actions, vec![TcpAction::Close]);
    assert_eq!(n.sides[B].cep.poll_timeout(), None);
}

#[test]
fn active_mpa_reply_timer_is_10s() {
    let mut n = Net::new(Frag::Whole, 19);
    // The responder gets the Request but its user never answers (no ULP timer in ConnRecv).
    n.connect(&ConnectParams::default());
    assert_eq!(n.sides[B].cep.state(), State::ConnRecv);
    assert_eq!(
        n.sides[A].cep.poll_timeout(),
        Some(n.t0 + Duration::from_secs(10))
    );
    assert_eq!(n.sides[B].cep.poll_timeout(), None);
    n.advance(Duration::from_millis(9999));
    assert!(n.events(A).is_empty());
    n.advance(Duration::from_millis(1));
    assert_eq!(
        n.events(A),
        &[Event::ConnectReply(ConnectReply::Error(
            ConnectError::Timeout
        ))]
    );
    // Like the kernel in e2-mpa-timeout: a FIN, not a reset.
    assert_eq!(n.sides[A].actions, vec![TcpAction::Close]);
    // The responder sees the FIN while its user still decides.
    assert_eq!(
        n.events(B).last(),
        Some(&Event::Close(CloseReason::Graceful))
    );
    let now = n.now;
    assert_eq!(
        n.b().accept(now, &AcceptParams::default()),
        Err(CepError::InvalidState(State::Idle))
    );
}

#[test]
fn close_timer_resets_a_peer_that_never_answers_our_fin() {
    let mut n = Net::new(Frag::Whole, 20);
    n.establish(&ConnectParams::default(), &AcceptParams::default());
    n.pipes[A].hold = true; // our FIN never gets there
    let now = n.now;
    n.a().disconnect(now).unwrap();
    n.a().disconnect(now).unwrap(); // a second disconnect is a no-op, as in the iw_cm
    n.advance(Duration::from_secs(9));
    assert_eq!(n.sides[A].cep.state(), State::Closing);
    n.advance(Duration::from_secs(1));
    assert_eq!(last_close(n.events(A)), Some(CloseReason::Timeout));
    assert_eq!(
        n.sides[A].actions,
        vec![TcpAction::Shutdown, TcpAction::Reset]
    );
    assert_eq!(last_close(n.events(B)), Some(CloseReason::Reset));
}

// ------------------------------------------------------------------------------------------
// Abort, graceful close from either side, peer reset
// ------------------------------------------------------------------------------------------

#[test]
fn abort_resets_and_the_peer_sees_a_reset() {
    let mut n = Net::new(Frag::Whole, 21);
    n.establish(&ConnectParams::default(), &AcceptParams::default());
    let now = n.now;
    n.b().abort(now).unwrap();
    n.pump();
    assert_eq!(last_close(n.events(B)), Some(CloseReason::Aborted));
    assert_eq!(n.sides[B].actions, vec![TcpAction::Reset]);
    assert_eq!(last_close(n.events(A)), Some(CloseReason::Reset));
    assert!(!n.events(A).contains(&Event::Disconnect));
    assert_eq!(n.b().abort(now), Err(CepError::InvalidState(State::Idle)));
}

#[test]
fn passive_side_disconnects_first() {
    let mut n = Net::new(Frag::OneByte, 22);
    n.establish(&ConnectParams::default(), &AcceptParams::default());
    let now = n.now;
    n.b().disconnect(now).unwrap();
    n.pump();
    let ea = n.events(A);
    assert_eq!(
        &ea[ea.len() - 2..],
        &[Event::Disconnect, Event::Close(CloseReason::Graceful)]
    );
    assert_eq!(last_close(n.events(B)), Some(CloseReason::Graceful));
}

#[test]
fn messages_in_flight_during_closing_are_delivered() {
    let mut n = Net::new(Frag::Whole, 23);
    n.establish(&ConnectParams::default(), &AcceptParams::default());
    n.pipes[B].hold = true;
    n.send(B, b"late");
    let now = n.now;
    n.a().disconnect(now).unwrap();
    assert_eq!(
        n.a().send(now, b"x"),
        Err(CepError::InvalidState(State::Closing))
    );
    n.pump();
    n.pipes[B].hold = false;
    n.pump();
    assert_eq!(n.messages(A), vec![b"late".to_vec()]);
    assert_eq!(last_close(n.events(A)), Some(CloseReason::Graceful));
}

// ------------------------------------------------------------------------------------------
// Messages, CRC, Terminate
// ------------------------------------------------------------------------------------------

#[test]
fn messages_both_ways_with_and_without_crc() {
    for (crc_a, crc_b) in [(false, false), (true, false), (false, true), (true, true)] {
        for version in [MpaVersion::V1, MpaVersion::V2] {
            let mut n = Net::new(Frag::Random(11), 24);
            let cp = ConnectParams {
                version,
                crc: crc_a,
                ..ConnectParams::default()
            };
            let ap = AcceptParams {
                crc: crc_b,
                ..AcceptParams::default()
            };
            n.establish(&cp, &ap);
            let want = crc_a || crc_b;
            assert_eq!(accepted(n.events(A)).crc, want);
            assert_eq!(established(n.events(B)).crc, want);
            let mark = n.sides[A].sent.len();
            for i in 0..20u8 {
                n.send(A, &vec![i; i as usize * 13]);
                n.send(B, &vec![!i; i as usize * 7]);
            }
            let got_b = n.messages(B);
            let got_a = n.messages(A);
            assert_eq!(got_b.len(), 20);
            for i in 0..20u8 {
                assert_eq!(got_b[i as usize], vec![i; i as usize * 13]);
                assert_eq!(got_a[i as usize], vec![!i; i as usize * 7]);
            }
            // The CRC slot carries the CRC-32C, or 0 as Linux sends when it is off.
            let (f, _) = mpa::Fpdu::parse(&n.sides[A].sent[mark..]).unwrap();
            if want {
                assert_eq!(f.crc, f.computed_crc());
            } else {
                assert_eq!(f.crc, 0);
            }
        }
    }
}

#[test]
fn long_messages_are_segmented_and_reassembled() {
    let ca = CepConfig {
        max_send_segment: 7,
        ..CepConfig::default()
    };
    let mut n = Net::with_configs(Frag::Random(64), 25, ca, CepConfig::default());
    n.establish(
        &ConnectParams {
            crc: true,
            ..ConnectParams::default()
        },
        &AcceptParams::default(),
    );
    let mark = n.sides[A].sent.len();
    let msg: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
    n.send(A, &msg);
    n.send(A, b"next");
    assert_eq!(n.messages(B), vec![msg, b"next".to_vec()]);
    // 143 segments of the first message, one of the second; MSN 1 then 2, MO counting up.
    let us = ulpdus(&n.sides[A].sent[mark..]);
    assert_eq!(us.len(), 144);
    let (h, _) = DdpRdmapHeader::parse(&us[142]).unwrap();
    assert!(h.last);
    assert_eq!(
        h.buffer,
        mpa::DdpBuffer::Untagged {
            rsvd_ulp: 0,
            qn: 0,
            msn: 1,
            mo: 994
        }
    );
    let (h, _) = DdpRdmapHeader::parse(&us[0]).unwrap();
    assert!(!h.last);
    let (h, _) = DdpRdmapHeader::parse(&us[143]).unwrap();
    assert!(matches!(
        h.buffer,
        mpa::DdpBuffer::Untagged { msn: 2, mo: 0, .. }
    ));
}

#[test]
fn a_corrupted_crc_earns_a_terminate_and_a_close() {
    for frag in [Frag::Whole, Frag::OneByte] {
        let mut n = Net::new(frag, 26);
        n.establish(
            &ConnectParams {
                crc: true,
                ..ConnectParams::default()
            },
            &AcceptParams::default(),
        );
        // Flip a payload byte of the next FPDU from A.
        n.pipes[A].corrupt_at = Some(n.pipes[A].offset + 25);
        n.send(A, b"this will not survive");
        assert!(n.messages(B).is_empty());
        assert_eq!(
            last_close(n.events(B)),
            Some(CloseReason::Protocol(ProtocolError::BadCrc))
        );
        // B's Terminate (LLP, CRC error) reached A first.
        let t = last_terminate(&n.sides[B].sent[24..]);
        assert_eq!(
            (t.layer, t.error_type, t.error_code),
            (term_layer::LLP, term_etype::LLP_MPA, llp_ecode::CRC_ERROR)
        );
        match last_close(n.events(A)) {
            Some(CloseReason::PeerTerminated(t)) => assert_eq!(t.error_code, llp_ecode::CRC_ERROR),
            other => panic!("{other:?}"),
        }
        assert_eq!(n.sides[B].actions, vec![TcpAction::Close]);
    }
}

#[test]
fn without_crc_a_corrupted_payload_goes_unnoticed() {
    let mut n = Net::new(Frag::Whole, 27);
    n.establish(&ConnectParams::default(), &AcceptParams::default());
    n.pipes[A].corrupt_at = Some(n.pipes[A].offset + 25);
    n.send(A, b"abcdefghijklmnop");
    assert_eq!(n.messages(B).len(), 1);
    assert_ne!(n.messages(B)[0], b"abcdefghijklmnop");
}

/// Injects one FPDU into an established passive endpoint and returns the Terminate it sent
/// back and its close reason.
fn inject_into_established(fpdu: &[u8]) -> (Option<Terminate>, Option<CloseReason>) {
    let mut n = Net::new(Frag::Whole, 28);
    n.establish(&ConnectParams::default(), &AcceptParams::default());
    let mark = n.sides[B].sent.len();
    let now = n.now;
    n.b().on_bytes(now, fpdu);
    n.pump();
    let sent = &n.sides[B].sent[mark..];
    let term = (!sent.is_empty()).then(|| last_terminate(sent));
    assert!(n.sides[B].cep.is_closed());
    (term, last_close(n.events(B)))
}

fn fpdu(ulpdu: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    emit_fpdu(ulpdu, false, &mut out).unwrap();
    out
}

#[test]
fn bad_ddp_and_rdmap_headers_earn_terminates() {
    let mut bad_ddp = mpa::send_ulpdu(0, 1, 0, b"x");
    bad_ddp[0] = (bad_ddp[0] & !0x03) | 2;
    let mut bad_rdmap = mpa::send_ulpdu(0, 1, 0, b"x");
    bad_rdmap[1] = (bad_rdmap[1] & 0x3F) | 0x80;
    let mut unknown_op = mpa::send_ulpdu(0, 1, 0, b"x");
    unknown_op[1] = (unknown_op[1] & 0xF0) | 0x0C;
    let cases: Vec<(Vec<u8>, (u8, u8, u8))> = vec![
        (
            fpdu(&bad_ddp),
            (term_layer::DDP, term_etype::DDP_UNTAGGED_BUFFER, 6),
        ),
        (
            fpdu(&bad_rdmap),
            (term_layer::RDMAP, term_etype::RDMAP_REMOTE_OPERATION, 5),
        ),
        (
            fpdu(&unknown_op),
            (term_layer::RDMAP, term_etype::RDMAP_REMOTE_OPERATION, 6),
        ),
        // Wrong MSN, wrong queue, wrong offset.
        (
            send_fpdu(0, 5, 0, true, b"x", false),
            (term_layer::DDP, term_etype::DDP_UNTAGGED_BUFFER, 3),
        ),
        (
            send_fpdu(7, 1, 0, true, b"x", false),
            (term_layer::DDP, term_etype::DDP_UNTAGGED_BUFFER, 1),
        ),
        (
            send_fpdu(0, 1, 9, true, b"x", false),
            (term_layer::DDP, term_etype::DDP_UNTAGGED_BUFFER, 4),
        ),
        // An RDMA Write with data: no STag is valid here.
        (
            fpdu(&{
                let mut u = DdpRdmapHeader::tagged(RdmapOpcode::RdmaWrite, 5, 0)
                    .to_vec()
                    .unwrap();
                u.extend_from_slice(b"data");
                u
            }),
            (term_layer::DDP, term_etype::DDP_TAGGED_BUFFER, 0),
        ),
        // A ULPDU too short for any header.
        (
            fpdu(&[0x41]),
            (term_layer::DDP, term_etype::DDP_CATASTROPHIC, 0),
        ),
    ];
    for (bytes, (layer, etype, ecode)) in cases {
        let (t, reason) = inject_into_established(&bytes);
        let t = t.expect("no Terminate");
        assert_eq!((t.layer, t.error_type, t.error_code), (layer, etype, ecode));
        assert_eq!(
            reason,
            Some(CloseReason::Protocol(ProtocolError::BadHeader {
                layer,
                error_type: etype,
                error_code: ecode
            }))
        );
    }
}

#[test]
fn a_peer_terminate_closes_with_its_reason() {
    let term = Terminate::llp(llp_ecode::LOCAL_CATASTROPHIC);
    let bytes = fpdu(&mpa::terminate_ulpdu(QN_TERMINATE, 1, &term).unwrap());
    let (sent, reason) = inject_into_established(&bytes);
    assert!(sent.is_none(), "a Terminate is not answered with one");
    assert_eq!(reason, Some(CloseReason::PeerTerminated(term)));
}

#[test]
fn local_terminate_command() {
    let mut n = Net::new(Frag::Whole, 29);
    n.establish(&ConnectParams::default(), &AcceptParams::default());
    let now = n.now;
    let t = Terminate::llp(llp_ecode::LOCAL_CATASTROPHIC);
    n.a().terminate(now, &t).unwrap();
    n.pump();
    assert_eq!(last_close(n.events(A)), Some(CloseReason::LocalTerminate));
    assert_eq!(
        last_close(n.events(B)),
        Some(CloseReason::PeerTerminated(t))
    );
}

#[test]
fn a_zero_length_write_is_harmless() {
    let u = DdpRdmapHeader::tagged(RdmapOpcode::RdmaWrite, 1, 0)
        .to_vec()
        .unwrap();
    let mut n = Net::new(Frag::Whole, 30);
    n.establish(&ConnectParams::default(), &AcceptParams::default());
    let now = n.now;
    n.b().on_bytes(now, &fpdu(&u));
    n.send(A, b"still fine");
    assert_eq!(n.messages(B), vec![b"still fine".to_vec()]);
}

// ------------------------------------------------------------------------------------------
// Peer-to-peer mode (RFC 6581) and its RTR frames
// ------------------------------------------------------------------------------------------

fn p2p(modes: RtrModes) -> ConnectParams {
    ConnectParams {
        p2p: Some(modes),
        ..ConnectParams::default()
    }
}

#[test]
fn p2p_write_rtr_like_siw() {
    let mut n = Net::new(Frag::Whole, 31);
    n.pipes[A].hold = true;
    n.connect(&p2p(RtrModes::SIW));
    n.pipes[A].hold = false;
    n.pump();
    let r = request(n.events(B));
    assert_eq!(r.p2p, Some(RtrModes::SIW));
    // Hold the RTR back: the responder stays in ConnRecv, silent, after accepting.
    n.pipes[A].hold = true;
    n.accept(&AcceptParams::default());
    assert_eq!(n.sides[B].cep.state(), State::ConnRecv);
    assert!(!n
        .events(B)
        .iter()
        .any(|e| matches!(e, Event::Established(_))));
    let now = n.now;
    assert_eq!(
        n.b().send(now, b"too early"),
        Err(CepError::InvalidState(State::ConnRecv))
    );
    assert_eq!(accepted(n.events(A)).rtr, Some(RtrKind::Write));
    n.pipes[A].hold = false;
    n.pump();
    assert_eq!(n.sides[B].cep.state(), State::Established);
    assert_eq!(established(n.events(B)).rtr, Some(RtrKind::Write));
    // The RTR on the wire: a zero-length tagged Write, STag 1, offset 0.
    let (_, used) = MpaFrame::parse(&n.sides[A].sent).unwrap();
    let us = ulpdus(&n.sides[A].sent[used..]);
    assert_eq!(
        DdpRdmapHeader::parse(&us[0]).unwrap().0,
        DdpRdmapHeader::tagged(RdmapOpcode::RdmaWrite, 1, 0)
    );
    n.send(B, b"now");
    n.send(A, b"and back");
    assert_eq!(n.messages(A), vec![b"now".to_vec()]);
    assert_eq!(n.messages(B), vec![b"and back".to_vec()]);
}

#[test]
fn p2p_read_and_send_rtr() {
    for (modes, kind) in [
        (
            RtrModes {
                read: true,
                ..RtrModes::default()
            },
            RtrKind::Read,
        ),
        (
            RtrModes {
                send: true,
                ..RtrModes::default()
            },
            RtrKind::Send,
        ),
    ] {
        for crc in [false, true] {
            let mut n = Net::new(Frag::OneByte, 32);
            let cp = ConnectParams { crc, ..p2p(modes) };
            n.establish(&cp, &AcceptParams::default());
            assert_eq!(accepted(n.events(A)).rtr, Some(kind));
            assert_eq!(established(n.events(B)).rtr, Some(kind));
            n.send(A, b"one");
            n.send(B, b"two");
            n.send(A, b"three");
            assert_eq!(n.messages(B), vec![b"one".to_vec(), b"three".to_vec()]);
            assert_eq!(n.messages(A), vec![b"two".to_vec()]);
            assert!(!n.sides[A].cep.is_closed() && !n.sides[B].cep.is_closed());
        }
    }
}

#[test]
fn p2p_ord_zero_is_raised_to_one_like_siw() {
    let mut n = Net::new(Frag::Whole, 33);
    n.connect(&ConnectParams {
        ord: 0,
        ..p2p(RtrModes::SIW)
    });
    assert_eq!(request(n.events(B)).ord, Some(1));
    let now = n.now;
    assert_eq!(
        n.a().connect(now, &p2p(RtrModes::default())),
        Err(CepError::InvalidState(State::ConnSent))
    );
    let mut m = Net::new(Frag::Whole, 33);
    let now = m.now;
    assert_eq!(
        m.a().connect(now, &p2p(RtrModes::default())),
        Err(CepError::NoRtrMode)
    );
}

#[test]
fn p2p_reply_picking_an_rtr_we_did_not_offer() {
    let mut n = Net::new(Frag::Whole, 34);
    n.pipes[A].hold = true;
    n.connect(&p2p(RtrModes {
        write: true,
        ..RtrModes::default()
    }));
    let mut e = Enhanced::new(1, 1);
    e.peer_to_peer = true;
    e.zero_len_read_rtr = true;
    let mut rep = MpaFrame::reply_v2(1, 1, Vec::new());
    rep.enhanced = Some(e);
    let now = n.now;
    n.a().on_bytes(now, &rep.to_vec().unwrap());
    n.pump();
    assert_eq!(n.events(A), proto_reply(ProtocolError::NoMatchingRtr));
    let (_, used) = MpaFrame::parse(&n.sides[A].sent).unwrap();
    let t = last_terminate(&n.sides[A].sent[used..]);
    assert_eq!(t.error_code, llp_ecode::NO_MATCHING_RTR);
}

#[test]
fn p2p_wrong_first_frame_at_the_responder() {
    let mut n = Net::new(Frag::Whole, 35);
    n.pipes[A].hold = true;
    n.connect(&p2p(RtrModes::SIW));
    n.pipes[A].hold = false;
    n.pump();
    n.pipes[A].hold = true;
    n.accept(&AcceptParams::default());
    // Instead of the zero-length Write, a Send arrives.
    let now = n.now;
    n.b()
        .on_bytes(now, &send_fpdu(QN_SEND, 1, 0, true, b"hi", false));
    n.pump();
    assert_eq!(
        last_close(n.events(B)),
        Some(CloseReason::Protocol(ProtocolError::NoMatchingRtr))
    );
    let mark = MpaFrame::parse(&n.sides[B].sent).unwrap().1;
    assert_eq!(
        last_terminate(&n.sides[B].sent[mark..]).error_code,
        llp_ecode::NO_MATCHING_RTR
    );
}

/// RFC 6581: an initiator that cannot go on sends a Terminate instead of the RTR (siw does,
/// for a Reply it cannot use). The responder closes with the peer's reason, as it would once
/// established, and does not answer a Terminate with one of its own.
#[test]
fn p2p_terminate_instead_of_the_rtr_closes_with_the_peers_reason() {
    let mut n = Net::new(Frag::Whole, 37);
    n.pipes[A].hold = true;
    n.connect(&p2p(RtrModes::SIW));
    n.pipes[A].hold = false;
    n.pump();
    n.pipes[A].hold = true;
    n.accept(&AcceptParams::default());
    let mark = MpaFrame::parse(&n.sides[B].sent).unwrap().1;
    let term = Terminate::llp(llp_ecode::NO_MATCHING_RTR);
    let now = n.now;
    n.b().on_bytes(
        now,
        &fpdu(&mpa::terminate_ulpdu(QN_TERMINATE, 1, &term).unwrap()),
    );
    n.pump();
    assert_eq!(
        last_close(n.events(B)),
        Some(CloseReason::PeerTerminated(term))
    );
    assert!(
        ulpdus(&n.sides[B].sent[mark..]).is_empty(),
        "a Terminate is not answered with one"
    );
}

#[test]
fn p2p_rtr_timer() {
    let mut n = Net::new(Frag::Whole, 36);
    n.pipes[A].hold = true;
    n.connect(&p2p(RtrModes::SIW));
    n.pipes[A].hold = false;
    n.pump();
    n.pipes[A].hold = true;
    n.accept(&AcceptParams::default());
    n.advance(Duration::from_secs(10));
    assert_eq!(last_close(n.events(B)), Some(CloseReason::Timeout));
    // Abort is allowed while waiting for the RTR, too (checked on a fresh pair).
    let mut m = Net::new(Frag::Whole, 36);
    m.pipes[A].hold = true;
    m.connect(&p2p(RtrModes::SIW));
    m.pipes[A].hold = false;
    m.pump();
    m.pipes[A].hold = true;
    m.accept(&AcceptParams::default());
    let now = m.now;
    m.b().abort(now).unwrap();
    m.pump();
    assert_eq!(last_close(m.events(B)), Some(CloseReason::Aborted));
}

// ------------------------------------------------------------------------------------------
// Commands in the wrong state or role
// ------------------------------------------------------------------------------------------

#[test]
fn commands_in_the_wrong_state_or_role_change_nothing() {
    let mut n = Net::new(Frag::Whole, 37);
    let now = n.now;
    assert_eq!(
        n.a().accept(now, &AcceptParams::default()),
        Err(CepError::WrongRole(Role::Active))
    );
    assert_eq!(
        n.a().reject(now, &[]),
        Err(CepError::WrongRole(Role::Active))
    );
    assert_eq!(
        n.b().connect(now, &ConnectParams::default()),
        Err(CepError::WrongRole(Role::Passive))
    );
    assert_eq!(
        n.b().accept(now, &AcceptParams::default()),
        Err(CepError::InvalidState(State::Idle))
    );
    assert_eq!(
        n.a().send(now, b"x"),
        Err(CepError::InvalidState(State::Idle))
    );
    assert_eq!(n.a().abort(now), Err(CepError::InvalidState(State::Idle)));
    n.connect(&ConnectParams::default());
    assert_eq!(
        n.a().disconnect(now),
        Err(CepError::InvalidState(State::ConnSent))
    );
    assert_eq!(
        n.a().send(now, b"x"),
        Err(CepError::InvalidState(State::ConnSent))
    );
    // A disconnect in ConnRecv is a no-op (iw_cm_disconnect).
    n.b().disconnect(now).unwrap();
    assert_eq!(n.sides[B].cep.state(), State::ConnRecv);
    n.accept(&AcceptParams::default());
    assert_eq!(
        n.b().accept(now, &AcceptParams::default()),
        Err(CepError::InvalidState(State::Established))
    );
    assert_eq!(
        n.b().reject(now, &[]),
        Err(CepError::InvalidState(State::Established))
    );
    assert_eq!(n.sides[A].cep.role(), Role::Active);
    assert!(n.sides[A].cep.negotiated().is_some());
}

// ------------------------------------------------------------------------------------------
// Destroy
// ------------------------------------------------------------------------------------------

/// Destroys side `i` now, then throws everything at it; it must produce no event.
fn destroy_and_check(n: &mut Net, i: usize) {
    let now = n.now;
    n.sides[i].events.clear();
    n.sides[i].cep.destroy(now);
    assert_eq!(n.sides[i].cep.state(), State::Destroying);
    assert!(n.sides[i].cep.is_closed());
    n.sides[i].cep.destroy(now); // idempotent
    n.pump();
    n.advance(Duration::from_secs(120));
    let cep = &mut n.sides[i].cep;
    cep.on_bytes(now, b"MPA ID Rep Frame\x00\x02\x00\x00");
    cep.on_bytes(now, &send_fpdu(0, 1, 0, true, b"x", false));
    cep.on_tcp_closed(now, true);
    cep.on_tcp_closed(now, false);
    cep.on_timer(now + Duration::from_secs(1000));
    assert_eq!(cep.poll_timeout(), None);
    assert_eq!(
        cep.send(now, b"x"),
        Err(CepError::InvalidState(State::Destroying))
    );
    assert_eq!(
        cep.abort(now),
        Err(CepError::InvalidState(State::Destroying))
    );
    n.pump();
    assert!(
        n.sides[i].events.is_empty(),
        "event after destroy: {:?}",
        n.sides[i].events
    );
    let terminal = n.sides[i]
        .actions
        .iter()
        .filter(|a| **a != TcpAction::Shutdown)
        .count();
    assert_eq!(terminal, 1, "{:?}", n.sides[i].actions);
}

#[test]
fn destroy_in_every_state_produces_no_later_event() {
    // Active: Idle before connect.
    let mut n = Net::new(Frag::Whole, 40);
    destroy_and_check(&mut n, A);
    assert_eq!(n.sides[A].actions, vec![TcpAction::Close]);

    // Active: ConnSent (reset: we cannot wait for the provider like the iw_cm).
    let mut n = Net::new(Frag::Whole, 41);
    n.pipes[A].hold = true;
    n.connect(&ConnectParams::default());
    destroy_and_check(&mut n, A);
    assert_eq!(n.sides[A].actions, vec![TcpAction::Reset]);

    // Active: ConnSent with the Reply arriving right after the destroy.
    let mut n = Net::new(Frag::Whole, 42);
    n.connect(&ConnectParams::default());
    n.pipes[B].hold = true;
    n.accept(&AcceptParams::default());
    destroy_and_check(&mut n, A);

    // Passive: Idle, still waiting for the Request.
    let mut n = Net::new(Frag::Whole, 43);
    destroy_and_check(&mut n, B);
    assert_eq!(n.sides[B].actions, vec![TcpAction::Close]);

    // Passive: ConnRecv, the user never answered: destroy rejects (destroy_cm_id → iw_reject).
    let mut n = Net::new(Frag::Whole, 44);
    n.connect(&ConnectParams::default());
    destroy_and_check(&mut n, B);
    let (rep, _) = MpaFrame::parse(&n.sides[B].sent).unwrap();
    assert!(rep.flags.reject);
    assert!(matches!(
        n.events(A),
        [Event::ConnectReply(ConnectReply::Rejected { .. })]
    ));

    // Passive: ConnRecv after a peer-to-peer accept, RTR not yet in.
    let mut n = Net::new(Frag::Whole, 45);
    n.connect(&p2p(RtrModes::SIW));
    n.pipes[A].hold = true;
    n.accept(&AcceptParams::default());
    destroy_and_check(&mut n, B);
    assert_eq!(n.sides[B].actions, vec![TcpAction::Reset]);

    // Both: Established (abrupt close).
    for i in [A, B] {
        let mut n = Net::new(Frag::Whole, 46);
        n.establish(&ConnectParams::default(), &AcceptParams::default());
        n.send(1 - i, b"in flight");
        destroy_and_check(&mut n, i);
        assert_eq!(n.sides[i].actions, vec![TcpAction::Reset]);
        assert_eq!(last_close(n.events(1 - i)), Some(CloseReason::Reset));
    }

    // Both: Closing.
    for i in [A, B] {
        let mut n = Net::new(Frag::Whole, 47);
        n.establish(&ConnectParams::default(), &AcceptParams::default());
        n.pipes[i].hold = true;
        let now = n.now;
        n.sides[i].cep.disconnect(now).unwrap();
        n.pump();
        destroy_and_check(&mut n, i);
        assert_eq!(
            n.sides[i].actions,
            vec![TcpAction::Shutdown, TcpAction::Close]
        );
    }

    // Both: already closed.
    for i in [A, B] {
        let mut n = Net::new(Frag::Whole, 48);
        n.establish(&ConnectParams::default(), &AcceptParams::default());
        let now = n.now;
        n.a().disconnect(now).unwrap();
        n.pump();
        let before = n.sides[i].actions.clone();
        n.sides[i].cep.destroy(now);
        n.pump();
        assert_eq!(n.sides[i].actions, before);
        assert_eq!(n.sides[i].cep.poll_event(), None);
    }
}

#[test]
fn destroy_drops_queued_events() {
    let mut n = Net::new(Frag::Whole, 49);
    n.establish(&ConnectParams::default(), &AcceptParams::default());
    let now = n.now;
    n.a().send(now, b"queued").unwrap();
    let bytes: Vec<u8> = std::iter::from_fn(|| n.sides[A].cep.poll_transmit())
        .flatten()
        .collect();
    n.b().on_bytes(now, &bytes);
    n.b().destroy(now);
    assert_eq!(n.sides[B].cep.poll_event(), None);
}

// ------------------------------------------------------------------------------------------
// Fragmentation and many seeds
// ------------------------------------------------------------------------------------------

fn scenario_trace(frag: Frag, seed: u64) -> (Vec<Event>, Vec<Event>, Vec<u8>, Vec<u8>) {
    let cp = ConnectParams {
        crc: true,
        private_data: b"trace".to_vec(),
        ..p2p(RtrModes::SIW)
    };
    let mut n = full_exchange(frag, seed, &cp, &AcceptParams::default());
    (
        n.take_events(A),
        n.take_events(B),
        n.sides[A].sent.clone(),
        n.sides[B].sent.clone(),
    )
}

#[test]
fn fragmentation_does_not_change_anything() {
    let whole = scenario_trace(Frag::Whole, 50);
    assert_eq!(scenario_trace(Frag::OneByte, 50), whole);
    for seed in 0..20 {
        assert_eq!(
            scenario_trace(Frag::Random(1 + seed as usize * 3), seed),
            whole
        );
    }
}

/// One random run: random parameters, fragmentation, early commands and corruption. Checks
/// the engine's promises: no panic, at most one terminal event per side and nothing after it,
/// exactly one answer to the connect, every endpoint closed in the end. Returns whether the
/// connection got established and how many messages were delivered.
fn random_run(seed: u64) -> (bool, usize) {
    let mut rng = StdRng::seed_from_u64(seed);
    let frag = match rng.gen_range(0..3) {
        0 => Frag::Whole,
        1 => Frag::OneByte,
        _ => Frag::Random(rng.gen_range(1..40)),
    };
    let cb = CepConfig {
        max_revision: rng.gen_range(1..=2),
        ..CepConfig::default()
    };
    let ca = CepConfig {
        accept_v1_reply: rng.gen_bool(0.8),
        max_send_segment: rng.gen_range(1..3000),
        ..CepConfig::default()
    };
    let mut n = Net::with_configs(frag, seed, ca, cb);
    let version = if rng.gen_bool(0.5) {
        MpaVersion::V1
    } else {
        MpaVersion::V2
    };
    let pd_max = if version == MpaVersion::V1 { 256 } else { 252 };
    let cp = ConnectParams {
        version,
        ird: rng.gen_range(0..=130),
        ord: rng.gen_range(0..=130),
        p2p: rng.gen_bool(0.4).then(|| RtrModes {
            send: rng.gen_bool(0.5),
            write: rng.gen_bool(0.5),
            read: rng.gen_bool(0.5),
        }),
        crc: rng.gen_bool(0.5),
        private_data: vec![0xAB; rng.gen_range(0..=pd_max + 2)],
    };
    let now = n.now;
    if n.a().connect(now, &cp).is_err() {
        n.a().destroy(now);
        n.b().destroy(now);
        n.pump();
        return (false, 0);
    }
    if rng.gen_bool(0.1) {
        let off = rng.gen_range(0..40);
        n.pipes[A].corrupt_at = Some(off);
    }
    if rng.gen_bool(0.1) {
        n.pipes[B].corrupt_at = Some(rng.gen_range(0..200));
    }
    for _ in 0..rng.gen_range(0..6) {
        n.step();
    }
    n.pump();
    let now = n.now;
    if rng.gen_bool(0.85) && n.sides[B].cep.state() == State::ConnRecv {
        let ap = AcceptParams {
            ird: rng.gen_range(0..=130),
            ord: rng.gen_range(0..=130),
            crc: rng.gen_bool(0.3),
            private_data: vec![0xCD; rng.gen_range(0..=258)],
        };
        if rng.gen_bool(0.9) {
            let _ = n.b().accept(now, &ap);
        } else {
            let _ = n.b().reject(now, &ap.private_data);
        }
    }
    for _ in 0..rng.gen_range(0..30) {
        let i = rng.gen_range(0..2);
        let now = n.now;
        match rng.gen_range(0..20) {
            0 => {
                let _ = n.sides[i].cep.disconnect(now);
            }
            1 => {
                let _ = n.sides[i].cep.abort(now);
            }
            2 => n.sides[i].cep.destroy(now),
            3 => {
                let junk: Vec<u8> = (0..rng.gen_range(1..30)).map(|_| rng.gen()).collect();
                n.sides[i].cep.on_bytes(now, &junk);
            }
            4 => n.advance(Duration::from_millis(rng.gen_range(0..12_000))),
            _ => {
                let len = rng.gen_range(0..4000);
                let _ = n.sides[i].cep.send(now, &vec![i as u8; len]);
            }
        }
        for _ in 0..rng.gen_range(0..8) {
            n.step();
        }
    }
    n.pump();
    // Whoever is still up closes; time runs out every timer.
    for i in [A, B] {
        let now = n.now;
        let _ = n.sides[i].cep.disconnect(now);
    }
    n.advance(Duration::from_secs(60));
    for i in [A, B] {
        let side = &n.sides[i];
        assert!(
            side.cep.is_closed(),
            "seed {seed}: side {i} open: {:?}",
            side.events
        );
        assert_eq!(side.cep.poll_timeout(), None, "seed {seed}");
        let terminal: Vec<usize> = side
            .events
            .iter()
            .enumerate()
            .filter(|(_, e)| {
                matches!(
                    e,
                    Event::Close(_)
                        | Event::ConnectReply(
                            ConnectReply::Rejected { .. } | ConnectReply::Error(_)
                        )
                )
            })
            .map(|(k, _)| k)
            .collect();
        assert!(terminal.len() <= 1, "seed {seed}: {:?}", side.events);
        if let Some(&k) = terminal.first() {
            assert_eq!(k, side.events.len() - 1, "seed {seed}: {:?}", side.events);
        }
        let ends = side
            .actions
            .iter()
            .filter(|a| **a != TcpAction::Shutdown)
            .count();
        assert_eq!(ends, 1, "seed {seed}: {:?}", side.actions);
    }
    let replies = n.sides[A]
        .events
        .iter()
        .filter(|e| matches!(e, Event::ConnectReply(_)))
        .count();
    assert!(replies <= 1, "seed {seed}");
    if n.sides[A].cep.state() != State::Destroying {
        assert_eq!(replies, 1, "seed {seed}: {:?}", n.sides[A].events);
    }
    let up = n.sides[A]
        .events
        .iter()
        .any(|e| matches!(e, Event::ConnectReply(ConnectReply::Accepted(_))));
    (up, n.messages(A).len() + n.messages(B).len())
}

#[test]
fn many_random_runs_never_panic_and_keep_the_promises() {
    let (mut up, mut msgs) = (0, 0);
    for seed in 0..600 {
        let (u, m) = random_run(seed);
        up += usize::from(u);
        msgs += m;
    }
    // The runs are not all trivial failures.
    assert!(up > 200, "only {up} of 600 runs connected");
    assert!(msgs > 400, "only {msgs} messages delivered");
    eprintln!("{up} of 600 runs connected, {msgs} messages delivered");
}

#[test]
fn random_garbage_never_panics_or_hangs() {
    let mut rng = StdRng::seed_from_u64(99);
    let good_req = MpaFrame::request_v2(1, 1, b"abc".to_vec())
        .to_vec()
        .unwrap();
    let good_rep = MpaFrame::reply_v2(1, 1, b"abc".to_vec()).to_vec().unwrap();
    for round in 0..400 {
        let base = if round % 2 == 0 { &good_req } else { &good_rep };
        let mut bytes = base[..rng.gen_range(0..=base.len())].to_vec();
        for _ in 0..rng.gen_range(0..3) {
            if !bytes.is_empty() {
                let k = rng.gen_range(0..bytes.len());
                bytes[k] = rng.gen();
            }
        }
        bytes.extend((0..rng.gen_range(0..300)).map(|_| rng.gen::<u8>()));
        let fin = rng.gen_bool(0.5);
        let frag = Frag::Random(rng.gen_range(1..50));
        let ev = feed_passive(&bytes, fin, frag);
        assert!(matches!(
            ev.last(),
            Some(Event::Close(_) | Event::ConnectRequest(_))
        ));
        let (ev, _) = feed_active(&bytes, fin, frag);
        assert!(matches!(
            ev.last(),
            Some(Event::Close(_) | Event::ConnectReply(_))
        ));
    }
}

#[test]
fn no_terminate_after_our_write_side_is_shut() {
    let mut n = Net::new(Frag::Whole, 51);
    n.establish(&ConnectParams::default(), &AcceptParams::default());
    let now = n.now;
    n.a().disconnect(now).unwrap();
    n.pipes[A].hold = true;
    n.pump();
    let mark = n.sides[A].sent.len();
    n.a()
        .on_bytes(now, &send_fpdu(0, 9, 0, true, b"bad msn", false));
    n.pump();
    assert!(matches!(
        last_close(n.events(A)),
        Some(CloseReason::Protocol(ProtocolError::BadHeader { .. }))
    ));
    assert_eq!(n.sides[A].sent.len(), mark, "nothing may follow our FIN");
    assert_eq!(
        n.sides[A].actions,
        vec![TcpAction::Shutdown, TcpAction::Close]
    );
}

/// B ended the stream with a Terminate of `(layer, error type, error code)` among what it
/// sent from `mark` on.
fn assert_terminated(n: &Net, mark: usize, want: (u8, u8, u8)) {
    let t = last_terminate(&n.sides[B].sent[mark..]);
    assert_eq!((t.layer, t.error_type, t.error_code), want);
    assert!(n.sides[B].cep.is_closed());
}

/// A zero-length RDMA Read Request FPDU (no CRC) with message sequence number `msn`.
fn zero_read_request(msn: u32) -> Vec<u8> {
    let mut u =
        DdpRdmapHeader::untagged(RdmapOpcode::RdmaReadRequest, mpa::QN_READ_REQUEST, msn, 0)
            .to_vec()
            .unwrap();
    u.extend_from_slice(
        &mpa::ReadRequest {
            sink_stag: 9,
            sink_to: 0,
            size: 0,
            source_stag: 3,
            source_to: 0,
        }
        .to_bytes(),
    );
    fpdu(&u)
}

/// A zero-length RDMA Read Request gets a Read Response while this side agreed to answer
/// reads (IRD ≥ 1), and ends the stream with a Terminate (RDMAP, remote operation,
/// catastrophic for the stream) when it agreed to none (IRD 0), as siw's `siw_init_rresp`
/// does; it was answered whatever the IRD.
#[test]
fn read_requests_are_answered_only_within_the_ird() {
    let read_request = zero_read_request(1);
    for ird in [1u16, 0] {
        let mut n = Net::new(Frag::Whole, 30);
        n.establish(
            &ConnectParams {
                ord: ird,
                ..ConnectParams::default()
            },
            &AcceptParams {
                ird,
                ..AcceptParams::default()
            },
        );
        assert_eq!(established(n.events(B)).ird, ird);
        let mark = n.sides[B].sent.len();
        let now = n.now;
        n.b().on_bytes(now, &read_request);
        n.pump();
        let sent = ulpdus(&n.sides[B].sent[mark..]);
        let (first, _) = DdpRdmapHeader::parse(sent.first().expect("an answer")).unwrap();
        if ird == 1 {
            // (The Read Response reaches A, which asked for none; what A does then is not
            // this test's business.)
            assert_eq!(first.opcode, RdmapOpcode::RdmaReadResponse);
        } else {
            let t = last_terminate(&n.sides[B].sent[mark..]);
            assert_eq!(
                (t.layer, t.error_type, t.error_code),
                (term_layer::RDMAP, term_etype::RDMAP_REMOTE_OPERATION, 0x07)
            );
            assert!(n.sides[B].cep.is_closed());
        }
    }
}

#[test]
fn thousands_of_fpdus_in_one_read_or_in_odd_pieces_arrive_whole_and_in_order() {
    // The receive buffer consumes parsed FPDUs by an offset and compacts when bytes come:
    // one read of 3,000 small FPDUs, then pieces cutting FPDUs anywhere, with both
    // parsed-but-not-compacted and partial bytes held between reads.
    for frag in [Frag::Whole, Frag::Random(37), Frag::OneByte] {
        // Receive buffers for all of them (none is taken here).
        let cb = CepConfig {
            recv_queue: 3000,
            ..CepConfig::default()
        };
        let mut n = Net::with_configs(frag, 91, CepConfig::default(), cb);
        n.establish(&v1(), &AcceptParams::default());
        n.pipes[A].hold = true;
        let want: Vec<Vec<u8>> = (0..3000u32)
            .map(|i| i.to_be_bytes()[..(i % 5) as usize].to_vec())
            .collect();
        for m in &want {
            let now = n.now;
            n.a().send(now, m).unwrap();
        }
        n.pump();
        assert!(n.messages(B).is_empty());
        n.pipes[A].hold = false;
        n.pump();
        assert_eq!(n.messages(B), want, "{frag:?}");
        assert_eq!(n.sides[B].cep.state(), State::Established);
    }
}

#[test]
fn a_send_with_every_receive_buffer_taken_is_terminated_like_siw() {
    let cb = CepConfig {
        recv_queue: 2,
        ..CepConfig::default()
    };
    let mut n = Net::with_configs(Frag::Random(9), 5, CepConfig::default(), cb);
    n.establish(&v1(), &AcceptParams::default());
    // Buffers come back as the application takes messages: any number passes.
    for i in 0..10u8 {
        n.send(A, &[i; 3]);
        n.b().messages_taken(1);
    }
    // Two held, none taken: the third Send's first segment has no buffer.
    n.send(A, b"one");
    n.send(A, b"two");
    let mark = n.sides[B].sent.len();
    n.send(A, &vec![3u8; 4000]);
    let got = n.messages(B);
    assert_eq!(got.len(), 12);
    assert_eq!(&got[10..], [b"one".to_vec(), b"two".to_vec()]);
    let t = last_terminate(&n.sides[B].sent[mark..]);
    assert_eq!(
        (t.layer, t.error_type, t.error_code),
        (term_layer::DDP, term_etype::DDP_UNTAGGED_BUFFER, 0x02)
    );
    // The offending segment's DDP header goes with it.
    assert!(t.d && t.m, "{t:?}");
    assert!(n.sides[B].cep.is_closed());
    assert!(matches!(
        last_close(n.events(A)),
        Some(CloseReason::PeerTerminated(_))
    ));
}

#[test]
fn a_receive_queue_of_zero_holds_one_message() {
    // 0 would refuse every Send; it counts as one buffer.
    let cb = CepConfig {
        recv_queue: 0,
        ..CepConfig::default()
    };
    let mut n = Net::with_configs(Frag::Random(11), 5, CepConfig::default(), cb);
    n.establish(&v1(), &AcceptParams::default());
    n.send(A, b"first");
    assert_eq!(n.messages(B), [b"first".to_vec()]);
    assert!(!n.sides[B].cep.is_closed());
    // Held, not taken: the next Send has no buffer.
    let mark = n.sides[B].sent.len();
    n.send(A, b"second");
    assert_eq!(n.messages(B), [b"first".to_vec()]);
    assert_terminated(
        &n,
        mark,
        (term_layer::DDP, term_etype::DDP_UNTAGGED_BUFFER, 0x02),
    );
}

/// A Read Request counts against our IRD until its Response is written to the socket (siw
/// frees an inbound read queue entry then): one more than IRD unwritten is a peer beyond
/// the ORD it was given, and ends the stream; Responses written free their places.
#[test]
fn read_requests_beyond_the_ird_unwritten_end_the_stream() {
    let read_request = zero_read_request;
    let up = || {
        let mut n = Net::new(Frag::Whole, 31);
        n.establish(
            &ConnectParams {
                ord: 2,
                ..ConnectParams::default()
            },
            &AcceptParams {
                ird: 2,
                ..AcceptParams::default()
            },
        );
        assert_eq!(established(n.events(B)).ird, 2);
        // B's answers stay in the pipe: A, which asked for none, is not this test's business.
        n.pipes[B].hold = true;
        n
    };
    // Written between the requests: any number, two at a time.
    let mut n = up();
    for msn in (1..=8).step_by(2) {
        let now = n.now;
        let two = [read_request(msn), read_request(msn + 1)].concat();
        n.b().on_bytes(now, &two);
        n.pump();
    }
    assert!(!n.sides[B].cep.is_closed());
    // Three before any is written: the third is one beyond.
    let mut n = up();
    let mark = n.sides[B].sent.len();
    let now = n.now;
    let three = [read_request(1), read_request(2), read_request(3)].concat();
    n.b().on_bytes(now, &three);
    n.pump();
    assert_terminated(
        &n,
        mark,
        (term_layer::RDMAP, term_etype::RDMAP_REMOTE_OPERATION, 0x07),
    );
}

#[test]
fn bytes_held_for_the_application_are_bounded_too() {
    let cb = CepConfig {
        recv_bytes: 10_000,
        max_recv_message: 4_000,
        ..CepConfig::default()
    };
    let mut n = Net::with_configs(Frag::Random(13), 5, CepConfig::default(), cb);
    n.establish(&v1(), &AcceptParams::default());
    // Taken as they come: any number.
    for i in 0..10u8 {
        n.send(A, &[i; 3000]);
        n.b().messages_taken(1);
    }
    // Three held, 9,000 bytes: a fourth would take them past 10,000, though buffers (1,024
    // messages) are free.
    for i in 0..3u8 {
        n.send(A, &[i; 3000]);
    }
    assert!(!n.sides[B].cep.is_closed());
    let mark = n.sides[B].sent.len();
    n.send(A, &[9u8; 3000]);
    assert_eq!(n.messages(B).len(), 13);
    assert_terminated(
        &n,
        mark,
        (term_layer::DDP, term_etype::DDP_UNTAGGED_BUFFER, 0x02),
    );
}

/// RFC 5044 has the initiator send the first FPDU, and siw as initiator fails a connection
/// whose first FPDU comes with the Reply (it reads 4 bytes past the Reply's private data).
/// The responder's FPDUs therefore wait for the initiator's first, or for
/// `CepConfig::responder_hold` when the initiator waits to receive first (ucmatose's client
/// does); a disconnect sends what waited before its FIN.
#[test]
fn responder_fpdus_wait_for_the_initiators_first() {
    // The initiator sends first: the responder's message follows it at once.
    let mut n = Net::new(Frag::Whole, 31);
    n.establish(&ConnectParams::default(), &AcceptParams::default());
    let reply_len = n.sides[B].sent.len();
    n.send(B, b"early pong");
    assert_eq!(
        n.sides[B].sent.len(),
        reply_len,
        "held until the initiator speaks"
    );
    assert!(n.messages(A).is_empty());
    n.send(A, b"ping");
    assert_eq!(n.messages(A), vec![b"early pong".to_vec()]);
    assert_eq!(n.messages(B), vec![b"ping".to_vec()]);

    // The initiator waits to receive: the responder's messages go after the hold, in order.
    let mut n = Net::new(Frag::Whole, 32);
    n.establish(&ConnectParams::default(), &AcceptParams::default());
    let t = n.now;
    n.send(B, b"one");
    n.send(B, b"two");
    assert!(n.messages(A).is_empty());
    n.advance(
        CepConfig::default()
            .responder_hold
            .saturating_sub(Duration::from_millis(1)),
    );
    assert!(n.messages(A).is_empty(), "sent before the hold ended");
    n.advance(Duration::from_millis(1));
    assert_eq!(n.messages(A), vec![b"one".to_vec(), b"two".to_vec()]);
    assert!(n.now >= t + CepConfig::default().responder_hold);

    // A disconnect during the hold: the data, then the FIN.
    let mut n = Net::new(Frag::Whole, 33);
    n.establish(&ConnectParams::default(), &AcceptParams::default());
    n.send(B, b"bye");
    let now = n.now;
    n.b().disconnect(now).unwrap();
    n.pump();
    assert_eq!(n.messages(A), vec![b"bye".to_vec()]);
    assert!(n.events(A).contains(&Event::Disconnect));

    // An abort during the hold: nothing that waited goes out, not even after the hold.
    let mut n = Net::new(Frag::Whole, 35);
    n.establish(&ConnectParams::default(), &AcceptParams::default());
    let reply_len = n.sides[B].sent.len();
    n.send(B, b"never");
    let now = n.now;
    n.b().abort(now).unwrap();
    n.pump();
    n.advance(CepConfig::default().responder_hold);
    assert_eq!(n.sides[B].sent.len(), reply_len, "sent after the abort");
    assert!(n.messages(A).is_empty());
    assert_eq!(last_close(n.events(A)), Some(CloseReason::Reset));

    // Zero hold: the responder sends at once (siw's own behaviour).
    let cb = CepConfig {
        responder_hold: Duration::ZERO,
        ..CepConfig::default()
    };
    let mut n = Net::with_configs(Frag::Whole, 34, CepConfig::default(), cb);
    n.establish(&ConnectParams::default(), &AcceptParams::default());
    n.send(B, b"now");
    assert_eq!(n.messages(A), vec![b"now".to_vec()]);
}

/// The bytes of a default MPA Request (revision 2, enhanced) carrying `pd`.
fn default_request_bytes(pd: &[u8]) -> Vec<u8> {
    let mut a = Cep::active(CepConfig::default());
    a.connect(
        Instant::now(),
        &ConnectParams {
            private_data: pd.to_vec(),
            ..ConnectParams::default()
        },
    )
    .expect("connect");
    let mut out = Vec::new();
    while let Some(t) = a.poll_transmit() {
        out.extend_from_slice(&t);
    }
    out
}

/// What a fresh passive endpoint reports for `bytes`.
fn passive_events(bytes: &[u8]) -> Vec<Event> {
    let mut p = Cep::passive(Instant::now(), CepConfig::default());
    p.on_bytes(Instant::now(), bytes);
    std::iter::from_fn(|| p.poll_event()).collect()
}

/// Linux `siw_proc_mpareq` never looks at the R (reject) bit of an MPA Request: it checks the
/// revision, the key, the Enhanced flag's room for IRD/ORD, M and C, and then raises
/// IW_CM_EVENT_CONNECT_REQUEST (RFC 5044 §7.1: R is zero in a Request and not checked on
/// receipt). rcm's frame parser refused a Request with R set ("MPA reject flag"), so the
/// passive endpoint closed the stream with a protocol error instead of reporting the request.
#[test]
fn a_request_with_the_r_bit_set_is_still_a_request() {
    let clean = default_request_bytes(b"hi");
    // Setup check: the unmodified Request is reported.
    let ev = passive_events(&clean);
    assert!(
        matches!(ev.as_slice(), [Event::ConnectRequest(r)] if r.private_data == b"hi"),
        "{ev:?}"
    );
    let mut with_r = clean.clone();
    with_r[16] |= 0x20;
    let ev = passive_events(&with_r);
    assert!(
        matches!(ev.as_slice(), [Event::ConnectRequest(r)] if r.private_data == b"hi"),
        "a Request with R set was not reported as a request: {ev:?}"
    );
}
