//! tshark cross-check of the iWARP engine: two `rcm_proto::iw::Cep`s (active and passive) run
//! whole conversations in memory, every byte each side emits is recorded in order together
//! with its TCP actions, and the result is written as a TCP conversation (handshake, data
//! segments with correct sequence and acknowledgement numbers, FIN or RST as the engine's
//! `TcpAction` says) between 127.0.0.1:port and 127.0.0.2:7471 into a pcap. tshark then reads
//! it back, and every MPA Request/Reply and every FPDU it dissects is compared, per direction
//! and in order, with what the scenario asked for: MPA flags, revision, private data (with the
//! RFC 6581 IRD/ORD words), DDP/RDMAP headers, Terminates, and CRC verdicts (a deliberately
//! corrupted FPDU must read "Bad CRC32", every other one "Good CRC32" when CRC is on).
//!
//! A last test captures the real rcm iWARP driver on `lo` with `tshark -i lo` (root needed)
//! and checks the same fields.
//!
//! Conventions as in `tshark.rs`: without tshark the tests skip loudly unless
//! `RCM_REQUIRE_TSHARK=1`; `TSHARK=/path` picks the binary; `RCM_TSHARK_KEEP=1` keeps the
//! pcaps under the temp directory. tshark finds MPA by its TCP heuristic dissector (tshark
//! has no port-based "iwarp_mpa" decode-as), which is on by default.

mod tshark_harness;

use rcm::{
    AcceptOptions, CmId, ConnectOptions, Event as RcmEvent, Fabric, FabricConfig, Flow, PortSpace,
};
use rcm_cli::capture::TcpFlags;
use rcm_cli::netbuild::{Peer, TcpFlowBuilder};
use rcm_proto::iw::{
    AcceptParams, Cep, CepConfig, CloseReason, ConnectParams, ConnectReply, Event, MpaVersion,
    ProtocolError, RtrKind, RtrModes, TcpAction,
};
use rcm_wire::mpa::{self, llp_ecode, term_etype, term_layer};
use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use tshark_harness::{hex, loud_skip, required, write_pcap, Row, TempFile, Tshark};

/// The passive side's port in the built conversations (rdma_cm's iWARP default).
const IWARP_PORT: u16 = 7471;
/// The MSS of the built conversations: 1460, so that the engine's 1460-byte FPDUs (1436-byte
/// Send segments, its default) each fill one TCP segment, as RFC 5044 aligns them.
const MSS: u16 = 1460;
/// The engine's default largest Send payload per FPDU.
const SEG: usize = 1436;
/// Send sizes exchanged each way once a connection is established.
const SIZES: [usize; 4] = [0, 1, 100, 4000];
/// Live capture: the listener's TCP port, and the (unused) RoCE UDP port of the fabric.
const LIVE_PORT: u16 = 28210;
const LIVE_UDP_PORT: u16 = 28299;

// =============================================================================================
// tshark harness (shared with tshark.rs: tshark_harness/)
// =============================================================================================

/// Heuristic sub-dissectors that could claim DDP payloads (tshark 4.0 short names); those the
/// installed tshark does not know are dropped at start-up.
const NOISY_HEURISTICS: &[&str] = &[
    "rpcrdma_iwarp",
    "smb_direct_iwarp",
    "nvme_rdma",
    "iser_infiniband",
    "drbd_rdma",
];

/// The installed tshark (see `tshark_harness::tshark`).
fn tshark(test: &str) -> Option<&'static Tshark> {
    tshark_harness::tshark(test, NOISY_HEURISTICS)
}

// =============================================================================================
// Two Ceps wired back to back, recording the wire
// =============================================================================================

/// What went over the wire, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Wire {
    Data(Peer, Vec<u8>),
    Fin(Peer),
    Rst(Peer),
}

/// Side 0 is the active Cep (the TCP client), side 1 the passive one (the server).
const A: usize = 0;
const B: usize = 1;
const PEERS: [Peer; 2] = [Peer::Client, Peer::Server];

struct Conv {
    now: Instant,
    cep: [Cep; 2],
    events: [Vec<Event>; 2],
    actions: [Vec<TcpAction>; 2],
    wire: Vec<Wire>,
    /// `pipe[i]`: what side `i` wrote, not yet delivered to the other side.
    pipe: [VecDeque<Vec<u8>>; 2],
    fin: [bool; 2],
    fin_delivered: [bool; 2],
    /// The side that reset the connection.
    rst: Option<usize>,
    rst_delivered: bool,
    /// Bytes each side has written so far (stream offsets).
    sent: [usize; 2],
    /// Flip (xor 0x5a) the byte at this offset of side `i`'s stream on its way: it is recorded
    /// corrupted, as a capture point between the two would see it.
    corrupt: [Option<usize>; 2],
}

impl Conv {
    fn new() -> Self {
        let now = Instant::now();
        Conv {
            now,
            cep: [
                Cep::active(CepConfig::default()),
                Cep::passive(now, CepConfig::default()),
            ],
            events: [Vec::new(), Vec::new()],
            actions: [Vec::new(), Vec::new()],
            wire: Vec::new(),
            pipe: [VecDeque::new(), VecDeque::new()],
            fin: [false; 2],
            fin_delivered: [false; 2],
            rst: None,
            rst_delivered: false,
            sent: [0; 2],
            corrupt: [None; 2],
        }
    }

    fn pump(&mut self) {
        for _ in 0..100_000 {
            if !self.step() {
                return;
            }
        }
        panic!("the two Ceps did not settle: a livelock");
    }

    fn step(&mut self) -> bool {
        let mut p = self.collect(A) | self.collect(B);
        p |= self.deliver(A);
        p |= self.collect(B);
        p |= self.deliver(B);
        p |= self.collect(A);
        p
    }

    fn collect(&mut self, i: usize) -> bool {
        let mut progress = false;
        while let Some(mut bytes) = self.cep[i].poll_transmit() {
            progress = true;
            if self.rst.is_some() {
                continue;
            }
            assert!(
                !self.fin[i],
                "side {i} wrote {} bytes after its FIN",
                bytes.len()
            );
            if let Some(at) = self.corrupt[i] {
                if (self.sent[i]..self.sent[i] + bytes.len()).contains(&at) {
                    bytes[at - self.sent[i]] ^= 0x5a;
                    self.corrupt[i] = None;
                }
            }
            self.sent[i] += bytes.len();
            self.cep[i].transmitted(bytes.len());
            self.wire.push(Wire::Data(PEERS[i], bytes.clone()));
            self.pipe[i].push_back(bytes);
        }
        while let Some(a) = self.cep[i].poll_tcp_action() {
            progress = true;
            self.actions[i].push(a);
            if self.rst.is_some() {
                continue;
            }
            match a {
                TcpAction::Shutdown | TcpAction::Close => {
                    if !self.fin[i] {
                        self.fin[i] = true;
                        self.wire.push(Wire::Fin(PEERS[i]));
                    }
                }
                TcpAction::Reset => {
                    self.rst = Some(i);
                    self.wire.push(Wire::Rst(PEERS[i]));
                    self.pipe = [VecDeque::new(), VecDeque::new()];
                }
            }
        }
        while let Some(e) = self.cep[i].poll_event() {
            progress = true;
            self.events[i].push(e);
        }
        progress
    }

    fn deliver(&mut self, i: usize) -> bool {
        let j = 1 - i;
        let now = self.now;
        if let Some(r) = self.rst {
            if r == i && !self.rst_delivered {
                self.rst_delivered = true;
                self.cep[j].on_tcp_closed(now, false);
                return true;
            }
            return false;
        }
        if let Some(b) = self.pipe[i].pop_front() {
            self.cep[j].on_bytes(now, &b);
            return true;
        }
        if self.fin[i] && !self.fin_delivered[i] {
            self.fin_delivered[i] = true;
            self.cep[j].on_tcp_closed(now, true);
            return true;
        }
        false
    }

    fn ends(&self) -> Vec<Wire> {
        self.wire
            .iter()
            .filter(|w| !matches!(w, Wire::Data(..)))
            .cloned()
            .collect()
    }
}

// =============================================================================================
// What tshark should read: MPA frames and FPDUs, per direction
// =============================================================================================

/// The RFC 6581 IRD/ORD words.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Words {
    ird: u16,
    ord: u16,
    p2p: bool,
    send_rtr: bool,
    write_rtr: bool,
    read_rtr: bool,
}

impl Words {
    fn plain(ird: u16, ord: u16) -> Self {
        Words {
            ird,
            ord,
            p2p: false,
            send_rtr: false,
            write_rtr: false,
            read_rtr: false,
        }
    }

    /// Decoded by hand from the 4 bytes (RFC 6581 §9.1, Linux's bit assignment), not by our
    /// codec.
    fn from_bytes(b: &[u8]) -> Self {
        let a = u16::from_be_bytes([b[0], b[1]]);
        let c = u16::from_be_bytes([b[2], b[3]]);
        Words {
            ird: a & 0x3FFF,
            ord: c & 0x3FFF,
            p2p: a & 0x8000 != 0,
            send_rtr: a & 0x4000 != 0,
            write_rtr: c & 0x8000 != 0,
            read_rtr: c & 0x4000 != 0,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct MpaUnit {
    request: bool,
    crc: bool,
    reject: bool,
    rev: u8,
    /// The IRD/ORD words of an enhanced (revision-2) frame.
    words: Option<Words>,
    /// The user's private data (after the words).
    pd: Vec<u8>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Crc {
    /// CRC not negotiated: the CRC field carries 0.
    Off,
    Good,
    Bad,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct FpduUnit {
    ulpdu_len: u64,
    opcode: u8,
    last: bool,
    /// Untagged: (QN, MSN, MO).
    untagged: Option<(u64, u64, u64)>,
    /// Tagged: (STag, TO).
    tagged: Option<(u64, u64)>,
    crc: Crc,
    /// Terminate: (layer, error type, error code).
    term: Option<(u8, u8, u8)>,
    /// Terminate: the copied DDP header, if any.
    term_ddp_h: Option<Vec<u8>>,
    /// RDMA Read Request: sink STag, sink TO, size, source STag, source TO.
    read_req: Option<[u64; 5]>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Unit {
    Mpa(MpaUnit),
    Fpdu(FpduUnit),
}

const OP_WRITE: u8 = 0;
const OP_READ_REQ: u8 = 1;
const OP_READ_RESP: u8 = 2;
const OP_SEND: u8 = 3;
const OP_TERMINATE: u8 = 7;

fn crc_of(on: bool) -> Crc {
    if on {
        Crc::Good
    } else {
        Crc::Off
    }
}

/// The FPDUs of one Send of `len` bytes with MSN `msn` (split at 1436 bytes).
fn send_units(msn: u32, len: usize, crc: bool) -> Vec<Unit> {
    let mut out = Vec::new();
    let mut off = 0;
    loop {
        let end = (off + SEG).min(len);
        out.push(Unit::Fpdu(FpduUnit {
            ulpdu_len: (mpa::UNTAGGED_HEADER_LEN + end - off) as u64,
            opcode: OP_SEND,
            last: end == len,
            untagged: Some((0, u64::from(msn), off as u64)),
            tagged: None,
            crc: crc_of(crc),
            term: None,
            term_ddp_h: None,
            read_req: None,
        }));
        off = end;
        if off == len {
            return out;
        }
    }
}

fn terminate_unit(msn: u32, crc: bool, term: (u8, u8, u8), ddp_h: Option<Vec<u8>>) -> Unit {
    // Terminate: 4 fixed bytes, the DDP segment length (2) and the copied header when D.
    let extra = ddp_h.as_ref().map_or(0, |h| 2 + h.len());
    Unit::Fpdu(FpduUnit {
        ulpdu_len: (mpa::UNTAGGED_HEADER_LEN + 4 + extra) as u64,
        opcode: OP_TERMINATE,
        last: true,
        untagged: Some((2, u64::from(msn), 0)),
        tagged: None,
        crc: crc_of(crc),
        term: Some(term),
        term_ddp_h: ddp_h,
        read_req: None,
    })
}

fn payload(len: usize, salt: u8) -> Vec<u8> {
    (0..len)
        .map(|k| (k as u8).wrapping_mul(7).wrapping_add(salt))
        .collect()
}

// =============================================================================================
// Scenarios
// =============================================================================================

#[derive(Clone)]
enum Answer {
    Accept(AcceptParams),
    Reject(Vec<u8>),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum End {
    /// `disconnect` by this side: FIN, the peer's FIN.
    Disconnect(usize),
    /// `abort` by this side: RST.
    Abort(usize),
    /// The active side's next Send has a payload byte flipped; CRC is on, so the passive side
    /// answers with an LLP Terminate (CRC error) and closes.
    CorruptCrc,
    /// The active side's next Send has its MSN flipped (no CRC to notice); the passive side
    /// answers with a DDP Terminate (MSN out of range) copying the header, and closes.
    CorruptMsn,
}

#[derive(Clone)]
struct Scenario {
    name: &'static str,
    client_port: u16,
    connect: ConnectParams,
    answer: Answer,
    end: End,
}

/// A finished in-memory conversation and what tshark should read in it.
struct Ran {
    name: &'static str,
    client_port: u16,
    wire: Vec<Wire>,
    /// Expected units from the client (active) and from the server (passive).
    expect: [Vec<Unit>; 2],
    /// The FINs and RSTs expected, in order.
    ends: Vec<Wire>,
}

fn run(s: &Scenario) -> Ran {
    let mut c = Conv::new();
    let mut expect: [Vec<Unit>; 2] = [Vec::new(), Vec::new()];
    let now = c.now;
    let p = &s.connect;
    let v2 = p.version == MpaVersion::V2;
    c.cep[A].connect(now, p).expect("connect");
    c.pump();
    // The Request.
    let req_words = v2.then(|| {
        let mut w = Words::plain(p.ird, p.ord);
        if let Some(m) = p.p2p {
            w.p2p = true;
            w.send_rtr = m.send;
            w.write_rtr = m.write;
            w.read_rtr = m.read;
            w.ord = w.ord.max(1);
        }
        w
    });
    expect[A].push(Unit::Mpa(MpaUnit {
        request: true,
        crc: p.crc,
        reject: false,
        rev: if v2 { 2 } else { 1 },
        words: req_words,
        pd: p.private_data.clone(),
    }));
    match c.events[B].as_slice() {
        [Event::ConnectRequest(r)] => {
            assert_eq!(r.private_data, p.private_data, "{}: request pd", s.name);
        }
        other => panic!("{}: passive events {other:?}", s.name),
    }

    let acc = match &s.answer {
        Answer::Reject(pd) => {
            c.cep[B].reject(now, pd).expect("reject");
            c.pump();
            expect[B].push(Unit::Mpa(MpaUnit {
                request: false,
                crc: p.crc,
                reject: true,
                rev: if v2 { 2 } else { 1 },
                // siw's reject carries the IRD/ORD it had prepared: the initiator's ORD/IRD.
                words: req_words.map(|w| Words::plain(w.ord, w.ird)),
                pd: pd.clone(),
            }));
            assert!(
                c.events[A].iter().any(|e| matches!(e,
                    Event::ConnectReply(ConnectReply::Rejected { private_data, .. })
                        if private_data == pd)),
                "{}: active events {:?}",
                s.name,
                c.events[A]
            );
            return Ran {
                name: s.name,
                client_port: s.client_port,
                ends: c.ends(),
                wire: c.wire,
                expect,
            };
        }
        Answer::Accept(acc) => acc.clone(),
    };
    c.cep[B].accept(now, &acc).expect("accept");
    c.pump();
    let crc = p.crc || acc.crc;
    let neg_b = c.events[B]
        .iter()
        .find_map(|e| match e {
            Event::Established(n) => Some(n.clone()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("{}: passive not established: {:?}", s.name, c.events[B]));
    let neg_a = c.events[A]
        .iter()
        .find_map(|e| match e {
            Event::ConnectReply(ConnectReply::Accepted(n)) => Some(n.clone()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("{}: active not established: {:?}", s.name, c.events[A]));
    assert_eq!(neg_a.private_data, acc.private_data, "{}: reply pd", s.name);
    assert_eq!((neg_a.crc, neg_b.crc), (crc, crc), "{}: CRC", s.name);
    let rep_words = v2.then(|| {
        let mut w = Words::plain(neg_b.ird, neg_b.ord);
        if let Some(kind) = neg_b.rtr {
            w.p2p = true;
            match kind {
                RtrKind::Send => w.send_rtr = true,
                RtrKind::Write => w.write_rtr = true,
                RtrKind::Read => w.read_rtr = true,
            }
        }
        w
    });
    if let Some(w) = rep_words {
        // The initiator takes the Reply's words crosswise.
        assert_eq!(
            (neg_a.ird, neg_a.ord),
            (w.ord, w.ird),
            "{}: IRD/ORD",
            s.name
        );
    }
    expect[B].push(Unit::Mpa(MpaUnit {
        request: false,
        crc: acc.crc || p.crc,
        reject: false,
        rev: if v2 { 2 } else { 1 },
        words: rep_words,
        pd: acc.private_data.clone(),
    }));
    match neg_a.rtr {
        Some(RtrKind::Write) => expect[A].push(Unit::Fpdu(FpduUnit {
            ulpdu_len: mpa::TAGGED_HEADER_LEN as u64,
            opcode: OP_WRITE,
            last: true,
            untagged: None,
            tagged: Some((1, 0)),
            crc: crc_of(crc),
            term: None,
            term_ddp_h: None,
            read_req: None,
        })),
        Some(RtrKind::Read) => {
            expect[A].push(Unit::Fpdu(FpduUnit {
                ulpdu_len: (mpa::UNTAGGED_HEADER_LEN + 28) as u64,
                opcode: OP_READ_REQ,
                last: true,
                untagged: Some((1, 1, 0)),
                tagged: None,
                crc: crc_of(crc),
                term: None,
                term_ddp_h: None,
                read_req: Some([0, 0, 0, 1, 0]),
            }));
            expect[B].push(Unit::Fpdu(FpduUnit {
                ulpdu_len: mpa::TAGGED_HEADER_LEN as u64,
                opcode: OP_READ_RESP,
                last: true,
                untagged: None,
                tagged: Some((0, 0)),
                crc: crc_of(crc),
                term: None,
                term_ddp_h: None,
                read_req: None,
            }));
        }
        Some(RtrKind::Send) => panic!("test bug: no Send RTR scenario"),
        None => {}
    }

    // Sends both ways.
    for (side, salt) in [(A, 0x10u8), (B, 0x80u8)] {
        for (k, &len) in SIZES.iter().enumerate() {
            let data = payload(len, salt.wrapping_add(k as u8));
            c.cep[side].send(now, &data).expect("send");
            expect[side].extend(send_units(k as u32 + 1, len, crc));
        }
        c.pump();
        let got: Vec<&Vec<u8>> = c.events[1 - side]
            .iter()
            .filter_map(|e| match e {
                Event::Message(m) => Some(m),
                _ => None,
            })
            .collect();
        let want: Vec<Vec<u8>> = SIZES
            .iter()
            .enumerate()
            .map(|(k, &len)| payload(len, salt.wrapping_add(k as u8)))
            .collect();
        assert_eq!(
            got,
            want.iter().collect::<Vec<_>>(),
            "{}: messages from side {side}",
            s.name
        );
    }

    let msn = SIZES.len() as u32 + 1;
    match s.end {
        End::Disconnect(side) => {
            c.cep[side].disconnect(now).expect("disconnect");
            c.pump();
            for i in [A, B] {
                assert!(
                    c.events[i].contains(&Event::Close(CloseReason::Graceful)),
                    "{}: side {i}: {:?}",
                    s.name,
                    c.events[i]
                );
            }
        }
        End::Abort(side) => {
            c.cep[side].abort(now).expect("abort");
            c.pump();
            assert!(c.events[1 - side].contains(&Event::Close(CloseReason::Reset)));
        }
        End::CorruptCrc => {
            assert!(crc, "test bug: CorruptCrc needs CRC");
            // A payload byte of the next FPDU: 2 (length) + 18 (header) + 10.
            c.corrupt[A] = Some(c.sent[A] + 30);
            c.cep[A].send(now, &payload(64, 0x33)).expect("send");
            let mut u = send_units(msn, 64, crc);
            if let Some(Unit::Fpdu(f)) = u.first_mut() {
                f.crc = Crc::Bad;
            }
            expect[A].extend(u);
            c.pump();
            assert!(
                c.events[B].contains(&Event::Close(CloseReason::Protocol(ProtocolError::BadCrc)))
            );
            expect[B].push(terminate_unit(
                1,
                crc,
                (term_layer::LLP, term_etype::LLP_MPA, llp_ecode::CRC_ERROR),
                None,
            ));
        }
        End::CorruptMsn => {
            // The MSN's low byte: 2 (length) + 13.
            let at = c.sent[A] + 15;
            c.corrupt[A] = Some(at);
            c.cep[A].send(now, &payload(50, 0x44)).expect("send");
            c.pump();
            let bad_msn = msn ^ 0x5a;
            let mut u = send_units(bad_msn, 50, crc);
            if crc {
                if let Some(Unit::Fpdu(f)) = u.first_mut() {
                    f.crc = Crc::Bad;
                }
            }
            expect[A].extend(u);
            // The header as it arrived, copied into the Terminate.
            let mut h = mpa::DdpRdmapHeader::untagged(mpa::RdmapOpcode::Send, 0, bad_msn, 0);
            h.last = true;
            let h = h.to_vec().expect("DDP header");
            expect[B].push(terminate_unit(
                1,
                crc,
                (term_layer::DDP, term_etype::DDP_UNTAGGED_BUFFER, 3),
                Some(h),
            ));
            assert!(
                c.events[B].iter().any(|e| matches!(
                    e,
                    Event::Close(CloseReason::Protocol(ProtocolError::BadHeader { .. }))
                )),
                "{}: {:?}",
                s.name,
                c.events[B]
            );
        }
    }
    for i in [A, B] {
        assert!(
            c.cep[i].is_closed(),
            "{}: side {i} not closed: {:?}",
            s.name,
            c.events[i]
        );
    }
    // What the engine asked of TCP must be what went on the wire.
    let ends = match s.end {
        End::Disconnect(side) => vec![Wire::Fin(PEERS[side]), Wire::Fin(PEERS[1 - side])],
        End::Abort(side) => vec![Wire::Rst(PEERS[side])],
        End::CorruptCrc | End::CorruptMsn => vec![Wire::Fin(Peer::Server), Wire::Fin(Peer::Client)],
    };
    assert_eq!(c.ends(), ends, "{}: FIN/RST from the engine", s.name);
    match s.end {
        End::Abort(side) => assert_eq!(c.actions[side].last(), Some(&TcpAction::Reset)),
        End::Disconnect(side) => {
            assert_eq!(c.actions[side].first(), Some(&TcpAction::Shutdown));
        }
        _ => {}
    }
    Ran {
        name: s.name,
        client_port: s.client_port,
        wire: c.wire,
        expect,
        ends,
    }
}

fn reject_ends() -> Vec<Wire> {
    vec![Wire::Fin(Peer::Server), Wire::Fin(Peer::Client)]
}

// =============================================================================================
// The pcap
// =============================================================================================

/// One data segment of the built pcap.
struct DataSeg {
    /// 1-based frame number.
    frame: usize,
    from: Peer,
}

struct Built {
    frames: Vec<(Duration, Vec<u8>)>,
    /// Per conversation: its data segments.
    data: Vec<Vec<DataSeg>>,
    /// Per conversation: its frame numbers.
    all: Vec<Vec<usize>>,
}

/// Writes the conversations one after the other into one frame list.
fn build(runs: &[Ran]) -> Built {
    let mut frames = Vec::new();
    let mut data = Vec::new();
    let mut all = Vec::new();
    for (n, r) in runs.iter().enumerate() {
        let client = SocketAddr::from(([127, 0, 0, 1], r.client_port));
        let server = SocketAddr::from(([127, 0, 0, 2], IWARP_PORT));
        let t0 = Duration::from_secs(1_700_000_000 + n as u64);
        let mut b = TcpFlowBuilder::new(client, server)
            .mss(MSS)
            .start(t0, Duration::from_micros(100))
            .isns(
                u32::from(r.client_port).wrapping_mul(0x9E37_79B9),
                0xFFFF_F000 | u32::from(r.client_port & 0xFF), // wraps: sequence arithmetic
            );
        b.handshake();
        let base = frames.len();
        let mut segs = Vec::new();
        for w in &r.wire {
            match w {
                Wire::Data(from, bytes) => {
                    let chunks: Vec<&[u8]> = bytes.chunks(usize::from(MSS)).collect();
                    let last = chunks.len() - 1;
                    for (k, chunk) in chunks.into_iter().enumerate() {
                        let flags = if k == last {
                            TcpFlags::ACK | TcpFlags::PSH
                        } else {
                            TcpFlags::ACK
                        };
                        segs.push(DataSeg {
                            frame: base + b.frames().len() + 1,
                            from: *from,
                        });
                        b.segment(*from, flags, chunk);
                    }
                    b.segment(from.other(), TcpFlags::ACK, &[]);
                }
                Wire::Fin(from) => {
                    b.segment(*from, TcpFlags::FIN | TcpFlags::ACK, &[]);
                    b.segment(from.other(), TcpFlags::ACK, &[]);
                }
                Wire::Rst(from) => {
                    b.segment(*from, TcpFlags::RST | TcpFlags::ACK, &[]);
                }
            }
        }
        let f = b.into_frames();
        all.push((base + 1..=base + f.len()).collect());
        frames.extend(f);
        data.push(segs);
    }
    Built { frames, data, all }
}

// =============================================================================================
// Reading tshark's output back into units
// =============================================================================================

const FIELDS: &[&str] = &[
    "frame.protocols",
    "_ws.col.Info",
    "_ws.malformed",
    "_ws.expert.message",
    "tcp.srcport",
    "tcp.len",
    "tcp.flags.fin",
    "tcp.flags.reset",
    "tcp.analysis.flags",
    "tcp.checksum.status",
    "ip.checksum.status",
    "iwarp_mpa.key.req",
    "iwarp_mpa.key.rep",
    "iwarp_mpa.marker_flag",
    "iwarp_mpa.crc_flag",
    "iwarp_mpa.rej_flag",
    "iwarp_mpa.res",
    "iwarp_mpa.rev",
    "iwarp_mpa.pdlength",
    "iwarp_mpa.privatedata",
    "iwarp_mpa.ulpdulength",
    "iwarp_mpa.crc",
    "iwarp_mpa.crc_check",
    "iwarp_ddp.tagged_flag",
    "iwarp_ddp.last_flag",
    "iwarp_ddp.dv",
    "iwarp_ddp.stag",
    "iwarp_ddp.tagged_offset",
    "iwarp_ddp.qn",
    "iwarp_ddp.msn",
    "iwarp_ddp.mo",
    "iwarp_rdma.version",
    "iwarp_rdma.opcode",
    "iwarp_rdma.sinkstag",
    "iwarp_rdma.sinkto",
    "iwarp_rdma.rdmardsz",
    "iwarp_rdma.srcstag",
    "iwarp_rdma.srcto",
    "iwarp_rdma.term_layer",
    "iwarp_rdma.term_etype_rdma",
    "iwarp_rdma.term_etype_ddp",
    "iwarp_rdma.term_etype_llp",
    "iwarp_rdma.term_errcode_rdma",
    "iwarp_rdma.term_errcode_ddp_tagged",
    "iwarp_rdma.term_errcode_ddp_untagged",
    "iwarp_rdma.term_errcode_llp",
    "iwarp_rdma.term_ddp_h",
];

/// Collects every mismatch of a test, then fails once with all of them.
struct Mismatches {
    test: &'static str,
    list: Vec<String>,
}

impl Mismatches {
    fn new(test: &'static str) -> Self {
        Mismatches {
            test,
            list: Vec::new(),
        }
    }

    fn push(&mut self, msg: String) {
        self.list.push(msg);
    }

    fn finish(self, t: &Tshark) {
        assert!(
            self.list.is_empty(),
            "{}: {} mismatch(es) between the iWARP engine and {}:\n  {}",
            self.test,
            self.list.len(),
            t.version_line,
            self.list.join("\n  ")
        );
    }
}

/// The CRC verdicts tshark wrote in one frame's `-V` text, in order.
fn crc_verdicts(text: &str) -> Vec<Crc> {
    text.lines()
        .filter_map(|l| {
            if l.contains("(Good CRC32)") {
                Some(Crc::Good)
            } else if l.contains("Bad CRC32") {
                Some(Crc::Bad)
            } else {
                None
            }
        })
        .collect()
}

/// The units tshark dissected in one data frame; problems go to `m`.
fn units_of(t: &Tshark, row: &Row, vtext: &str, ctx: &str, m: &mut Mismatches) -> Vec<Unit> {
    let protocols = row.get("frame.protocols");
    if !protocols.contains("iwarp_mpa") {
        m.push(format!(
            "{ctx}: a data segment tshark did not dissect as MPA (protocols {protocols:?}, info \
             {:?})",
            row.get("_ws.col.Info")
        ));
        return Vec::new();
    }
    let req = row.bytes_each("iwarp_mpa.key.req");
    let rep = row.bytes_each("iwarp_mpa.key.rep");
    if !req.is_empty() || !rep.is_empty() {
        let request = !req.is_empty();
        let key = if request { &req[0] } else { &rep[0] };
        let want_key: &[u8] = if request {
            b"MPA ID Req Frame"
        } else {
            b"MPA ID Rep Frame"
        };
        if key.as_slice() != want_key {
            m.push(format!("{ctx}: MPA key {}", hex(key)));
        }
        if row.num("iwarp_mpa.marker_flag") != Some(0) {
            m.push(format!(
                "{ctx}: marker flag {:?}",
                row.get("iwarp_mpa.marker_flag")
            ));
        }
        let res = row.num("iwarp_mpa.res").unwrap_or(0xFF);
        let enhanced = res == 0x10;
        if res != 0 && !enhanced {
            m.push(format!("{ctx}: MPA reserved bits {res:#x}"));
        }
        let rev = row.num("iwarp_mpa.rev").unwrap_or(0) as u8;
        let pdlen = row.num("iwarp_mpa.pdlength").unwrap_or(u64::MAX);
        let pd_all = row
            .bytes_each("iwarp_mpa.privatedata")
            .into_iter()
            .next()
            .unwrap_or_default();
        let (words, pd) = if enhanced && t.version < (4, 6) {
            // tshark 4.0 knows RFC 5044 only: the words open its "private data".
            if pd_all.len() < 4 {
                m.push(format!(
                    "{ctx}: enhanced frame with {} pd bytes",
                    pd_all.len()
                ));
                (None, pd_all)
            } else {
                (Some(Words::from_bytes(&pd_all[..4])), pd_all[4..].to_vec())
            }
        } else if enhanced {
            // Later versions may decode the words themselves; accept either reading of pd.
            (None, pd_all)
        } else {
            (None, pd_all)
        };
        let shown = if enhanced && t.version < (4, 6) {
            pd.len() as u64 + 4
        } else {
            pd.len() as u64
        };
        if pdlen != shown && t.version < (4, 6) {
            m.push(format!(
                "{ctx}: PD_Length {pdlen} but {shown} private-data bytes shown"
            ));
        }
        return vec![Unit::Mpa(MpaUnit {
            request,
            crc: row.num("iwarp_mpa.crc_flag") == Some(1),
            reject: row.num("iwarp_mpa.rej_flag") == Some(1),
            rev,
            words: if enhanced {
                words.or(Some(Words::plain(u16::MAX, u16::MAX)))
            } else {
                None
            },
            pd,
        })];
    }
    if !protocols.contains("iwarp_ddp_rdmap") {
        m.push(format!(
            "{ctx}: an MPA segment without DDP/RDMAP (protocols {protocols:?})"
        ));
    }
    let lens = row.nums("iwarp_mpa.ulpdulength");
    let n = lens.len();
    let opcodes = row.nums("iwarp_rdma.opcode");
    let tagged = row.nums("iwarp_ddp.tagged_flag");
    let last = row.nums("iwarp_ddp.last_flag");
    let dv = row.nums("iwarp_ddp.dv");
    let rv = row.nums("iwarp_rdma.version");
    for (what, v) in [
        ("opcode", &opcodes),
        ("tagged flag", &tagged),
        ("last flag", &last),
    ] {
        if v.len() != n {
            m.push(format!(
                "{ctx}: {n} FPDU(s) but {} {what} value(s)",
                v.len()
            ));
            return Vec::new();
        }
    }
    if dv.iter().any(|&v| v != 1) || rv.iter().any(|&v| v != 1) || dv.len() != n {
        m.push(format!("{ctx}: DDP versions {dv:?}, RDMAP versions {rv:?}"));
    }
    let (mut qn, mut msn, mut mo) = (
        row.nums("iwarp_ddp.qn").into_iter(),
        row.nums("iwarp_ddp.msn").into_iter(),
        row.nums("iwarp_ddp.mo").into_iter(),
    );
    let (mut stag, mut to) = (
        row.nums("iwarp_ddp.stag").into_iter(),
        row.nums("iwarp_ddp.tagged_offset").into_iter(),
    );
    let mut layer = row.nums("iwarp_rdma.term_layer").into_iter();
    let mut etypes = [
        row.nums("iwarp_rdma.term_etype_rdma").into_iter(),
        row.nums("iwarp_rdma.term_etype_ddp").into_iter(),
        row.nums("iwarp_rdma.term_etype_llp").into_iter(),
    ];
    let mut ecode_rdma = row.nums("iwarp_rdma.term_errcode_rdma").into_iter();
    let mut ecode_ddp_t = row.nums("iwarp_rdma.term_errcode_ddp_tagged").into_iter();
    let mut ecode_ddp_u = row.nums("iwarp_rdma.term_errcode_ddp_untagged").into_iter();
    let mut ecode_llp = row.nums("iwarp_rdma.term_errcode_llp").into_iter();
    let mut ddp_h = row.bytes_each("iwarp_rdma.term_ddp_h").into_iter();
    let rr: Vec<Vec<u64>> = [
        "iwarp_rdma.sinkstag",
        "iwarp_rdma.sinkto",
        "iwarp_rdma.rdmardsz",
        "iwarp_rdma.srcstag",
        "iwarp_rdma.srcto",
    ]
    .iter()
    .map(|f| row.nums(f))
    .collect();
    let mut rr_i = 0;
    let crc_values = row.nums("iwarp_mpa.crc");
    let crc_checks = row.nums("iwarp_mpa.crc_check");
    let verdicts = crc_verdicts(vtext);
    let crcs: Vec<Crc> = if crc_checks.is_empty() {
        if crc_values.len() != n || !verdicts.is_empty() {
            m.push(format!(
                "{ctx}: {n} FPDU(s) without CRC, CRC fields {crc_values:?}, verdicts {verdicts:?}"
            ));
        }
        crc_values
            .iter()
            .map(|&v| if v == 0 { Crc::Off } else { Crc::Bad })
            .collect()
    } else {
        if crc_checks.len() != n || verdicts.len() != n || !crc_values.is_empty() {
            m.push(format!(
                "{ctx}: {n} FPDU(s), {} CRC check(s), {} verdict(s), {} unchecked CRC(s)",
                crc_checks.len(),
                verdicts.len(),
                crc_values.len()
            ));
        }
        verdicts
    };
    let mut out = Vec::new();
    for k in 0..n {
        let op = opcodes[k] as u8;
        let is_tagged = tagged[k] == 1;
        let untagged = if is_tagged {
            None
        } else {
            Some((
                qn.next().unwrap_or(u64::MAX),
                msn.next().unwrap_or(u64::MAX),
                mo.next().unwrap_or(u64::MAX),
            ))
        };
        let tagged_at = if is_tagged {
            Some((
                stag.next().unwrap_or(u64::MAX),
                to.next().unwrap_or(u64::MAX),
            ))
        } else {
            None
        };
        let (term, term_ddp_h) = if op == OP_TERMINATE {
            let l = layer.next().unwrap_or(0xFF) as u8;
            let et = etypes
                .get_mut(usize::from(l).min(2))
                .and_then(Iterator::next)
                .unwrap_or(0xFF) as u8;
            let ec = match (l, et) {
                (0, _) => ecode_rdma.next(),
                (1, 1) => ecode_ddp_t.next(),
                (1, _) => ecode_ddp_u.next(),
                _ => ecode_llp.next(),
            }
            .unwrap_or(0xFF) as u8;
            (Some((l, et, ec)), ddp_h.next())
        } else {
            (None, None)
        };
        let read_req = if op == OP_READ_REQ {
            let v = [0, 1, 2, 3, 4].map(|f| rr[f].get(rr_i).copied().unwrap_or(u64::MAX));
            rr_i += 1;
            Some(v)
        } else {
            None
        };
        out.push(Unit::Fpdu(FpduUnit {
            ulpdu_len: lens[k],
            opcode: op,
            last: last[k] == 1,
            untagged,
            tagged: tagged_at,
            crc: crcs.get(k).copied().unwrap_or(Crc::Off),
            term,
            term_ddp_h,
            read_req,
        }));
    }
    out
}

/// Writes the conversations into one pcap, runs tshark over it and compares everything.
fn check_runs(t: &Tshark, test: &'static str, runs: &[Ran]) {
    let built = build(runs);
    let file = write_pcap(test, &built.frames);
    let rows = t.fields(file.path(), FIELDS, true);
    assert_eq!(rows.len(), built.frames.len(), "tshark frame count");
    let (text, vframes) = t.verbose_frames(file.path());
    let mut m = Mismatches::new(test);
    for (r, (segs, all)) in runs.iter().zip(built.data.iter().zip(&built.all)) {
        // Every frame: no malformed packet, TCP as tshark expects it.
        for &f in all {
            let row = &rows[f - 1];
            assert_eq!(row.frame, f);
            let ctx = format!("{} frame {f}", r.name);
            if !row.get("_ws.malformed").is_empty() {
                m.push(format!("{ctx}: malformed: {:?}", row.get("_ws.malformed")));
            }
            let expert = row.get("_ws.expert.message");
            for bad in ["Malformed", "ULPDU length", "Bad length", "bug", "Bad CRC"] {
                if expert.contains(bad) {
                    m.push(format!("{ctx}: expert info {expert:?}"));
                }
            }
            if !row.get("tcp.analysis.flags").is_empty() {
                m.push(format!(
                    "{ctx}: TCP analysis flags (sequence/ack trouble): {:?}",
                    row.get("_ws.expert.message")
                ));
            }
            for c in ["tcp.checksum.status", "ip.checksum.status"] {
                if row.num(c) != Some(1) {
                    m.push(format!("{ctx}: {c} {:?} (1 = good)", row.get(c)));
                }
            }
        }
        // The units per direction.
        let mut seen: [Vec<Unit>; 2] = [Vec::new(), Vec::new()];
        for s in segs {
            let row = &rows[s.frame - 1];
            let side = usize::from(s.from == Peer::Server);
            let port = if side == A { r.client_port } else { IWARP_PORT };
            let ctx = format!("{} frame {} ({:?})", r.name, s.frame, s.from);
            if row.num("tcp.srcport") != Some(u64::from(port)) || row.num("tcp.len") == Some(0) {
                m.push(format!("{ctx}: not the data segment we wrote"));
            }
            let v = vframes.get(&s.frame).map_or("", String::as_str);
            seen[side].extend(units_of(t, row, v, &ctx, &mut m));
        }
        for side in [A, B] {
            let (want, got) = (&r.expect[side], &seen[side]);
            let dir = if side == A {
                "active -> passive"
            } else {
                "passive -> active"
            };
            for k in 0..want.len().max(got.len()) {
                match (want.get(k), got.get(k)) {
                    (Some(w), Some(g)) if same(t, w, g) => {}
                    (w, g) => m.push(format!(
                        "{} {dir} unit {k}:\n      expected {w:?}\n      tshark   {g:?}",
                        r.name
                    )),
                }
            }
        }
        // FIN/RST as the engine asked.
        let mut ends = Vec::new();
        for &f in all {
            let row = &rows[f - 1];
            let from = if row.num("tcp.srcport") == Some(u64::from(r.client_port)) {
                Peer::Client
            } else {
                Peer::Server
            };
            if row.num("tcp.flags.fin") == Some(1) {
                ends.push(Wire::Fin(from));
            }
            if row.num("tcp.flags.reset") == Some(1) {
                ends.push(Wire::Rst(from));
            }
        }
        if ends != r.ends {
            m.push(format!(
                "{}: tshark sees the close {ends:?}, the engine asked {:?}",
                r.name, r.ends
            ));
        }
    }
    if text.contains("Malformed Packet") || text.contains("Dissector bug") {
        m.push("tshark -V: a Malformed Packet or dissector bug".to_owned());
    }
    let expert = t.expert_summary(file.path());
    if expert.contains("Malformed") || expert.contains("Errors (") {
        m.push(format!("tshark -z expert reports errors:\n{expert}"));
    }
    m.finish(t);
}

/// Unit equality, allowing for what the installed tshark cannot show.
fn same(t: &Tshark, want: &Unit, got: &Unit) -> bool {
    match (want, got) {
        (Unit::Mpa(w), Unit::Mpa(g)) if w.words.is_some() && t.version >= (4, 6) => {
            // Newer tshark decodes the words itself (not checked): user pd, with or without
            // the words in front.
            let words_bytes = |x: &Words| {
                let mut a = x.ird;
                let mut b = x.ord;
                a |= u16::from(x.p2p) << 15 | u16::from(x.send_rtr) << 14;
                b |= u16::from(x.write_rtr) << 15 | u16::from(x.read_rtr) << 14;
                [a.to_be_bytes(), b.to_be_bytes()].concat()
            };
            let mut with = words_bytes(w.words.as_ref().expect("words"));
            with.extend_from_slice(&w.pd);
            (w.request, w.crc, w.reject, w.rev) == (g.request, g.crc, g.reject, g.rev)
                && g.words.is_some()
                && (g.pd == w.pd || g.pd == with)
        }
        _ => want == got,
    }
}

// =============================================================================================
// The tests over built conversations
// =============================================================================================

fn accept(ird: u16, ord: u16, crc: bool, pd: &[u8]) -> Answer {
    Answer::Accept(AcceptParams {
        ird,
        ord,
        crc,
        private_data: pd.to_vec(),
    })
}

fn connect(version: MpaVersion, crc: bool, pd: &[u8]) -> ConnectParams {
    ConnectParams {
        version,
        ird: 1,
        ord: 1,
        p2p: None,
        crc,
        private_data: pd.to_vec(),
    }
}

#[test]
fn mpa_v1_conversations_read_back_by_tshark() {
    const TEST: &str = "mpa_v1_conversations_read_back_by_tshark";
    let Some(t) = tshark(TEST) else { return };
    let runs = [
        // Revision 1, no CRC, graceful disconnect by the active side.
        run(&Scenario {
            name: "v1 no CRC",
            client_port: 40101,
            connect: connect(MpaVersion::V1, false, b"hello from a v1 initiator"),
            answer: accept(1, 1, false, b"welcome, v1 responder here"),
            end: End::Disconnect(A),
        }),
        // The initiator asks for CRC; a payload byte is corrupted on the way: Bad CRC32, and an
        // LLP Terminate (CRC error) comes back.
        run(&Scenario {
            name: "v1 CRC asked by the initiator, corrupted FPDU",
            client_port: 40102,
            connect: connect(MpaVersion::V1, true, &payload(256, 1)),
            answer: accept(1, 1, false, b"ok"),
            end: End::CorruptCrc,
        }),
        // Only the responder asks for CRC (either side's C means CRC), it disconnects.
        run(&Scenario {
            name: "v1 CRC asked by the responder",
            client_port: 40103,
            connect: connect(MpaVersion::V1, false, b""),
            answer: accept(1, 1, true, &payload(255, 9)),
            end: End::Disconnect(B),
        }),
    ];
    check_runs(t, TEST, &runs);
}

#[test]
fn mpa_v2_enhanced_conversations_read_back_by_tshark() {
    const TEST: &str = "mpa_v2_enhanced_conversations_read_back_by_tshark";
    let Some(t) = tshark(TEST) else { return };
    let mut c1 = connect(MpaVersion::V2, false, b"v2 hello");
    (c1.ird, c1.ord) = (16, 8);
    let mut c2 = connect(MpaVersion::V2, true, &payload(252, 3));
    (c2.ird, c2.ord) = (128, 0);
    let runs = [
        // IRD/ORD negotiation without CRC; the MSN of an FPDU is corrupted (no CRC to catch
        // it): a DDP Terminate copying the header comes back.
        run(&Scenario {
            name: "v2 IRD/ORD no CRC, corrupted MSN",
            client_port: 40201,
            connect: c1,
            answer: accept(4, 32, false, b"v2 welcome"),
            end: End::CorruptMsn,
        }),
        // With CRC, ended by an abort (RST).
        run(&Scenario {
            name: "v2 IRD/ORD with CRC, abort",
            client_port: 40202,
            connect: c2,
            answer: accept(2, 3, false, &payload(252, 4)),
            end: End::Abort(A),
        }),
        // With CRC from the responder, the passive side aborts.
        run(&Scenario {
            name: "v2 CRC from the responder, passive abort",
            client_port: 40203,
            connect: connect(MpaVersion::V2, false, b""),
            answer: accept(1, 1, true, b""),
            end: End::Abort(B),
        }),
    ];
    check_runs(t, TEST, &runs);
}

#[test]
fn mpa_v2_peer_to_peer_rtr_read_back_by_tshark() {
    const TEST: &str = "mpa_v2_peer_to_peer_rtr_read_back_by_tshark";
    let Some(t) = tshark(TEST) else { return };
    let mut siw = connect(MpaVersion::V2, false, b"p2p please");
    siw.p2p = Some(RtrModes::SIW);
    let mut read = connect(MpaVersion::V2, true, b"p2p, read RTR");
    read.p2p = Some(RtrModes {
        send: false,
        write: false,
        read: true,
    });
    read.ord = 0; // raised to 1 for the Read RTR
    let runs = [
        // siw's offer (Write | Read): the responder picks Write, the initiator sends a
        // zero-length RDMA Write (STag 1, TO 0) before anything else.
        run(&Scenario {
            name: "v2 p2p Write RTR",
            client_port: 40301,
            connect: siw,
            answer: accept(1, 1, false, b"p2p ok"),
            end: End::Disconnect(A),
        }),
        // Read only, with CRC: a zero-length Read Request and its zero-length Response.
        run(&Scenario {
            name: "v2 p2p Read RTR with CRC",
            client_port: 40302,
            connect: read,
            answer: accept(1, 1, false, b"read ok"),
            end: End::Disconnect(B),
        }),
    ];
    check_runs(t, TEST, &runs);
}

#[test]
fn mpa_rejects_read_back_by_tshark() {
    const TEST: &str = "mpa_rejects_read_back_by_tshark";
    let Some(t) = tshark(TEST) else { return };
    let mut v2 = connect(MpaVersion::V2, true, b"may I?");
    (v2.ird, v2.ord) = (5, 7);
    let runs = [
        run(&Scenario {
            name: "v1 reject",
            client_port: 40401,
            connect: connect(MpaVersion::V1, false, b"may I?"),
            answer: Answer::Reject(b"no: v1 reject with private data".to_vec()),
            end: End::Disconnect(A),
        }),
        run(&Scenario {
            name: "v2 reject (C set by the initiator)",
            client_port: 40402,
            connect: v2,
            answer: Answer::Reject(payload(252, 0x77)),
            end: End::Disconnect(A),
        }),
    ];
    for r in &runs {
        assert_eq!(r.ends, reject_ends(), "{}", r.name);
    }
    check_runs(t, TEST, &runs);
}

// =============================================================================================
// The real driver, captured live on lo
// =============================================================================================

/// `tshark -i lo -w FILE -f "tcp port P"` in the background.
struct LiveCapture {
    child: Child,
    stderr: Arc<Mutex<String>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl LiveCapture {
    /// Starts the capture and waits until tshark says it captures; `Err` says why not.
    fn start(t: &Tshark, file: &Path, port: u16) -> Result<Self, String> {
        let mut child = Command::new(&t.bin)
            .args(["-n", "-i", "lo", "-w"])
            .arg(file)
            .args(["-f", &format!("tcp port {port}")])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start tshark -i lo: {e}"))?;
        let stderr = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = mpsc::channel();
        let pipe = child.stderr.take().expect("stderr");
        let log = stderr.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                if line.contains("Capturing on") {
                    let _ = tx.send(());
                }
                let mut g = log.lock().unwrap();
                g.push_str(&line);
                g.push('\n');
            }
        });
        let end = Instant::now() + Duration::from_secs(20);
        loop {
            if rx.recv_timeout(Duration::from_millis(50)).is_ok() {
                // tshark prints the line just before the capture loop starts.
                std::thread::sleep(Duration::from_millis(500));
                return Ok(LiveCapture {
                    child,
                    stderr,
                    reader: Some(reader),
                });
            }
            if let Ok(Some(st)) = child.try_wait() {
                let _ = reader.join();
                return Err(format!(
                    "tshark -i lo exited ({st}): {}",
                    stderr.lock().unwrap().trim()
                ));
            }
            if Instant::now() > end {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "tshark -i lo did not start capturing within 20 s: {}",
                    stderr.lock().unwrap().trim()
                ));
            }
        }
    }

    /// Lets the last packets in, then SIGINTs tshark (our own child, by its PID) and waits.
    /// `Err` (with tshark's stderr) if the capture failed.
    fn stop(mut self) -> Result<String, String> {
        std::thread::sleep(Duration::from_millis(700));
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-INT", &pid]).status();
        let end = Instant::now() + Duration::from_secs(15);
        let status = loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                break Some(st);
            }
            if Instant::now() > end {
                let _ = self.child.kill();
                let _ = self.child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        if let Some(r) = self.reader.take() {
            // The pipe closes with tshark: the whole of its stderr is in.
            let _ = r.join();
        }
        let log = self.stderr.lock().unwrap().clone();
        match status {
            Some(st) if st.success() => Ok(log),
            Some(st) => Err(format!("tshark -i lo ended with {st}: {}", log.trim())),
            None => Err(format!("tshark -i lo ignored SIGINT: {}", log.trim())),
        }
    }
}

impl Drop for LiveCapture {
    fn drop(&mut self) {
        // Only if `stop` was not reached (a panic): end our own child.
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Runs the rdma_cm-level exchange on two iWARP devices: connect/accept with private data,
/// one Send each way, disconnect.
fn live_exchange(port: u16, req_pd: &[u8], rep_pd: &[u8], ping: &[u8], pong: &[u8]) {
    const T: Duration = Duration::from_secs(10);
    let f = Fabric::new(FabricConfig {
        udp_port: LIVE_UDP_PORT,
        ..FabricConfig::default()
    });
    let server_ip = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
    let client_ip = IpAddr::V4(Ipv4Addr::LOCALHOST);
    f.add_iwarp_device(client_ip)
        .expect("iWARP device 127.0.0.1");
    f.add_iwarp_device(server_ip)
        .expect("iWARP device 127.0.0.2");

    let (tx, rx) = mpsc::channel::<(&'static str, Option<CmId>, Vec<u8>)>();
    let stx = Mutex::new(tx.clone());
    let rep = rep_pd.to_vec();
    let l = f.create_id(PortSpace::Tcp, move |id, ev| {
        let tx = stx.lock().unwrap().clone();
        match ev {
            RcmEvent::ConnectRequest { private_data, .. } => {
                id.accept(&AcceptOptions {
                    private_data: rep.clone(),
                    ..AcceptOptions::default()
                })
                .expect("accept");
                let _ = tx.send(("request", Some(id.clone()), private_data));
            }
            RcmEvent::Established { .. } => {
                let _ = tx.send(("server established", None, Vec::new()));
            }
            RcmEvent::Disconnected => {
                let _ = tx.send(("server disconnected", None, Vec::new()));
            }
            _ => {}
        }
        Flow::Continue
    });
    l.bind(SocketAddr::new(server_ip, port)).expect("bind");
    l.listen(0).expect("listen");
    let ctx = Mutex::new(tx);
    let pd = req_pd.to_vec();
    let c = f.create_id(PortSpace::Tcp, move |id, ev| {
        let tx = ctx.lock().unwrap().clone();
        match ev {
            RcmEvent::AddrResolved => id.resolve_route().expect("resolve_route"),
            RcmEvent::RouteResolved => id
                .connect(&ConnectOptions {
                    private_data: pd.clone(),
                    ..ConnectOptions::default()
                })
                .expect("connect"),
            RcmEvent::Established { private_data, .. } => {
                let _ = tx.send(("client established", None, private_data));
            }
            RcmEvent::Disconnected => {
                let _ = tx.send(("client disconnected", None, Vec::new()));
            }
            other => {
                let _ = tx.send(("client other", None, format!("{other:?}").into_bytes()));
            }
        }
        Flow::Continue
    });
    c.resolve_addr(Some(client_ip), SocketAddr::new(server_ip, port))
        .expect("resolve_addr");

    // Events from the two sides race (the client may be ESTABLISHED before the server's
    // callback has reported the request), so each wait first looks at what already arrived.
    let mut server = None;
    let mut seen: Vec<(String, Vec<u8>)> = Vec::new();
    let wait =
        |what: &str, seen: &mut Vec<(String, Vec<u8>)>, server: &mut Option<CmId>| -> Vec<u8> {
            if let Some((_, data)) = seen.iter().find(|(w, _)| w == what) {
                return data.clone();
            }
            let end = Instant::now() + T;
            loop {
                let left = end.saturating_duration_since(Instant::now());
                let (w, id, data) = rx.recv_timeout(left).unwrap_or_else(|_| {
                    let names: Vec<&str> = seen.iter().map(|(w, _)| w.as_str()).collect();
                    panic!("live: no {what:?} within {T:?}; saw {names:?}")
                });
                seen.push((w.to_owned(), data.clone()));
                if id.is_some() {
                    *server = id;
                }
                assert_ne!(
                    w,
                    "client other",
                    "live: {}",
                    String::from_utf8_lossy(&data)
                );
                if w == what {
                    return data;
                }
            }
        };
    assert_eq!(wait("request", &mut seen, &mut server), req_pd);
    assert_eq!(wait("client established", &mut seen, &mut server), rep_pd);
    let s = server.clone().expect("server id");
    wait("server established", &mut seen, &mut server);
    c.send(ping).expect("client send");
    assert_eq!(s.recv_message(T).as_deref(), Some(ping));
    s.send(pong).expect("server send");
    assert_eq!(c.recv_message(T).as_deref(), Some(pong));
    c.disconnect().expect("disconnect");
    for w in ["client disconnected", "server disconnected"] {
        wait(w, &mut seen, &mut server);
    }
    for id in [c, s, l] {
        let _ = id.destroy();
    }
    f.shutdown();
}

#[test]
fn live_rcm_iwarp_driver_read_back_by_tshark() {
    const TEST: &str = "live_rcm_iwarp_driver_read_back_by_tshark";
    let Some(t) = tshark(TEST) else { return };
    let file = TempFile::new("live", "pcapng");
    let cap = match LiveCapture::start(t, file.path(), LIVE_PORT) {
        Ok(c) => c,
        Err(why) => {
            assert!(
                !required(),
                "{TEST}: live capture on lo is not possible and RCM_REQUIRE_TSHARK=1: {why}"
            );
            loud_skip(TEST, &format!("live capture on lo not possible: {why}"));
            return;
        }
    };
    let req_pd = b"rcm live: request private data".to_vec();
    let rep_pd = b"rcm live: reply private data!".to_vec();
    let ping = b"ping from the active side".to_vec();
    let pong = b"pong from the passive side, a bit longer".to_vec();
    live_exchange(LIVE_PORT, &req_pd, &rep_pd, &ping, &pong);
    let log = match cap.stop() {
        Ok(log) if file.path().exists() => log,
        r => {
            let why = r.map_or_else(|e| e, |_| "tshark wrote no capture file".to_owned());
            assert!(
                !required(),
                "{TEST}: live capture on lo failed and RCM_REQUIRE_TSHARK=1: {why}"
            );
            loud_skip(TEST, &format!("live capture on lo failed: {why}"));
            return;
        }
    };
    let rows = t.fields(file.path(), FIELDS, false);
    assert!(
        !rows.is_empty(),
        "{TEST}: tshark captured nothing on lo (port {LIVE_PORT}); its stderr:\n{log}"
    );
    let (text, vframes) = t.verbose_frames(file.path());
    let mut m = Mismatches::new(TEST);
    let mut seen: [Vec<Unit>; 2] = [Vec::new(), Vec::new()];
    let mut ends = Vec::new();
    for row in &rows {
        let ctx = format!("live frame {}", row.frame);
        if !row.get("_ws.malformed").is_empty() {
            m.push(format!("{ctx}: malformed: {:?}", row.get("_ws.malformed")));
        }
        let from_server = row.num("tcp.srcport") == Some(u64::from(LIVE_PORT));
        if row.num("tcp.flags.fin") == Some(1) {
            ends.push(if from_server {
                "server FIN"
            } else {
                "client FIN"
            });
        }
        if row.num("tcp.flags.reset") == Some(1) {
            ends.push(if from_server {
                "server RST"
            } else {
                "client RST"
            });
        }
        if row.num("tcp.len").unwrap_or(0) == 0 {
            continue;
        }
        let v = vframes.get(&row.frame).map_or("", String::as_str);
        seen[usize::from(from_server)].extend(units_of(t, row, v, &ctx, &mut m));
    }
    // What rcm sends by default: revision 2, IRD = ORD = 1, no CRC, no peer-to-peer.
    let expect: [Vec<Unit>; 2] = [
        [Unit::Mpa(MpaUnit {
            request: true,
            crc: false,
            reject: false,
            rev: 2,
            words: Some(Words::plain(1, 1)),
            pd: req_pd.clone(),
        })]
        .into_iter()
        .chain(send_units(1, ping.len(), false))
        .collect(),
        [Unit::Mpa(MpaUnit {
            request: false,
            crc: false,
            reject: false,
            rev: 2,
            words: Some(Words::plain(1, 1)),
            pd: rep_pd.clone(),
        })]
        .into_iter()
        .chain(send_units(1, pong.len(), false))
        .collect(),
    ];
    for side in [A, B] {
        let (want, got) = (&expect[side], &seen[side]);
        for k in 0..want.len().max(got.len()) {
            match (want.get(k), got.get(k)) {
                (Some(w), Some(g)) if same(t, w, g) => {}
                (w, g) => m.push(format!(
                    "live side {side} unit {k}:\n      expected {w:?}\n      tshark   {g:?}"
                )),
            }
        }
    }
    // A graceful disconnect: a FIN each way, no reset.
    for fin in ["client FIN", "server FIN"] {
        if !ends.contains(&fin) {
            m.push(format!("live: no {fin} in the capture (saw {ends:?})"));
        }
    }
    if ends.iter().any(|e| e.contains("RST")) {
        m.push(format!(
            "live: a reset after a graceful disconnect: {ends:?}"
        ));
    }
    if text.contains("Malformed Packet") || text.contains("Dissector bug") {
        m.push("live: tshark -V shows a Malformed Packet or dissector bug".to_owned());
    }
    m.finish(t);
}
