//! A bounded-time protocol fuzzer for the daemon, and a decoder property test.
//!
//! `RCM_UCM_FUZZ_SEED` overrides the seed (printed on every run), `RCM_UCM_FUZZ_SECS` the
//! time budget (default 5 s, shared by both tests: most of it goes to the daemon fuzzer).

mod common;

use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rcm::remote::{IdInfo, Limit, Op, Reply};
use rcm::{
    AcceptOptions, AccessFlags, ConnParam, ConnectOptions, PortSpace, QpAttr, QpAttrMask, QpState,
    State, UdParam, Unreachable,
};
use rcm_proto::ib::CmError;
use rcm_ucm::proto::{
    self, decode_command, decode_message, kind, split_frame, Answer, Command, Header, Limits,
    Message, SessionStats, WireError, WireEvent,
};
use rcm_wire::cm::{RejReason, SidrStatus};
use rcm_wire::Gid;
use std::borrow::Cow;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::os::unix::net::UnixStream;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

fn seed() -> u64 {
    std::env::var("RCM_UCM_FUZZ_SEED")
        .ok()
        .and_then(|s| {
            let s = s.trim();
            match s.strip_prefix("0x") {
                Some(h) => u64::from_str_radix(h, 16).ok(),
                None => s.parse().ok(),
            }
        })
        .unwrap_or(0x5EED_0C3A_u64)
}

fn budget() -> Duration {
    let secs = std::env::var("RCM_UCM_FUZZ_SECS")
        .ok()
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .unwrap_or(5.0);
    Duration::from_secs_f64(secs)
}

/// Daemon messages the fuzz sessions received, by kind: HelloOk, Ok, Err, and events by
/// their wire type (1..=13).
static SEEN: [AtomicUsize; 17] = [const { AtomicUsize::new(0) }; 17];

fn seen_index(m: &Message) -> usize {
    match m {
        Message::HelloOk { .. } => 0,
        Message::Ok(_) => 1,
        Message::Err(_) => 2,
        Message::Event { event, .. } => {
            3 + match event {
                WireEvent::AddrResolved => 0,
                WireEvent::AddrError(_) => 1,
                WireEvent::RouteResolved => 2,
                WireEvent::RouteError(_) => 3,
                WireEvent::ConnectRequest { .. } => 4,
                WireEvent::ConnectResponse { .. } => 5,
                WireEvent::ConnectError(_) => 6,
                WireEvent::Unreachable(_) => 7,
                WireEvent::Rejected { .. } => 8,
                WireEvent::Established { .. } => 9,
                WireEvent::Disconnected => 10,
                WireEvent::DeviceRemoval => 11,
                WireEvent::TimewaitExit => 12,
            }
        }
    }
}

/// Panics on the daemon's own threads (all named `rcm-…`).
static DAEMON_PANICS: AtomicUsize = AtomicUsize::new(0);

fn count_daemon_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let name = std::thread::current().name().unwrap_or("").to_owned();
            if name.starts_with("rcm-") {
                DAEMON_PANICS.fetch_add(1, Ordering::SeqCst);
            }
            prev(info);
        }));
    });
}

// ---------------------------------------------------------------------------------------
// Random values

fn pick<T: Clone>(rng: &mut StdRng, v: &[T]) -> T {
    v[rng.gen_range(0..v.len())].clone()
}

fn bytes(rng: &mut StdRng, max: usize) -> Vec<u8> {
    let n = rng.gen_range(0..=max);
    (0..n).map(|_| rng.gen()).collect()
}

fn text(rng: &mut StdRng) -> String {
    let n = rng.gen_range(0..40);
    (0..n).map(|_| rng.gen_range(b' '..=b'~') as char).collect()
}

fn any_ip(rng: &mut StdRng) -> IpAddr {
    if rng.gen() {
        IpAddr::from(rng.gen::<[u8; 4]>())
    } else {
        IpAddr::from(rng.gen::<[u8; 16]>())
    }
}

/// Addresses the fuzzer lets the daemon use: loopback (a device, or nobody) and IPv6 that no
/// device has (never leaves the host).
fn safe_addr(rng: &mut StdRng) -> SocketAddr {
    let any: u16 = rng.gen();
    let port = pick(rng, &[0u16, 7000, 7001, 7002, 7003, any]);
    let ip = pick(
        rng,
        &[
            ip(1),
            ip(1),
            ip(1),
            ip(2),
            "fd00::1".parse().expect("ip"),
            "::".parse().expect("ip"),
            "0.0.0.0".parse().expect("ip"),
        ],
    );
    SocketAddr::new(ip, port)
}

fn port_space(rng: &mut StdRng) -> PortSpace {
    pick(
        rng,
        &[
            PortSpace::Tcp,
            PortSpace::Tcp,
            PortSpace::Udp,
            PortSpace::Ib,
            PortSpace::Ipoib,
        ],
    )
}

fn qp_state(rng: &mut StdRng) -> QpState {
    pick(rng, &[QpState::Init, QpState::Rtr, QpState::Rts])
}

/// Every rdma_cm state (the document test names each in an exhaustive match).
const STATES: [State; 12] = [
    State::Idle,
    State::AddrQuery,
    State::AddrResolved,
    State::RouteQuery,
    State::RouteResolved,
    State::Connect,
    State::Established,
    State::Disconnect,
    State::AddrBound,
    State::Listen,
    State::DeviceRemoval,
    State::Destroying,
];

/// Every session limit.
const LIMITS: [Limit; 8] = [
    Limit::Ids,
    Limit::QueuedEvents,
    Limit::UnreadRequests,
    Limit::MessageSize,
    Limit::PendingCommands,
    Limit::Channels,
    Limit::SendBuffer,
    Limit::Connections,
];

fn state(rng: &mut StdRng) -> State {
    pick(rng, &STATES)
}

fn op(rng: &mut StdRng, addr: &mut dyn FnMut(&mut StdRng) -> SocketAddr) -> Op {
    match rng.gen_range(0..15) {
        0 => Op::SetReuseaddr(rng.gen()),
        1 => Op::Bind(addr(rng)),
        2 => Op::ResolveAddr {
            src: if rng.gen() {
                Some(addr(rng).ip())
            } else {
                None
            },
            dst: addr(rng),
        },
        3 => Op::ResolveRoute,
        4 => Op::Listen(rng.gen::<u32>() as usize),
        5 => Op::CreateQp,
        6 => Op::DestroyQp,
        7 => Op::Connect(ConnectOptions {
            private_data: bytes(rng, proto::MAX_PRIVATE_DATA),
            responder_resources: rng.gen(),
            initiator_depth: rng.gen(),
            retry_count: rng.gen(),
            rnr_retry_count: rng.gen(),
            qpn: if rng.gen() { Some(rng.gen()) } else { None },
        }),
        8 => Op::Accept(AcceptOptions {
            private_data: bytes(rng, proto::MAX_PRIVATE_DATA),
            responder_resources: rng.gen(),
            initiator_depth: rng.gen(),
            rnr_retry_count: rng.gen(),
            qpn: if rng.gen() { Some(rng.gen()) } else { None },
        }),
        9 => Op::Reject(bytes(rng, proto::MAX_PRIVATE_DATA)),
        10 => Op::Establish,
        11 => Op::Disconnect,
        12 => Op::InitQpAttr(qp_state(rng)),
        13 => Op::NotifyEstablished,
        _ => Op::Query,
    }
}

/// A random command. `handle` and `token` pick those fields; `addr` the addresses.
fn command(
    rng: &mut StdRng,
    handle: &mut dyn FnMut(&mut StdRng) -> u32,
    token: &mut dyn FnMut(&mut StdRng) -> u64,
    addr: &mut dyn FnMut(&mut StdRng) -> SocketAddr,
) -> Command {
    match rng.gen_range(0..20) {
        0 => Command::Hello {
            min: rng.gen_range(0..3),
            max: rng.gen_range(0..3),
        },
        1 => Command::CreateId(port_space(rng)),
        // Half in the client's range, half wherever `handle` picks (refused below it).
        2 => Command::CreateIdAs(
            port_space(rng),
            if rng.gen() {
                proto::CLIENT_HANDLES | rng.gen::<u32>()
            } else {
                handle(rng)
            },
        ),
        3 => Command::DestroyId(handle(rng)),
        4 => Command::GetEvent(rng.gen_range(0..64)),
        5 => Command::MigrateId {
            token: token(rng),
            handle: handle(rng),
        },
        6 => Command::Devices,
        7 => Command::Stats,
        8 => Command::Attach {
            min: rng.gen_range(0..3),
            max: rng.gen_range(0..3),
            token: token(rng),
        },
        9 => Command::MapChannel,
        // Mapped (only before the session's first credit), the session's frames go into a
        // ring nobody reads here: its socket then stays silent, which the fuzzer takes.
        10 => Command::MapEvents,
        // A bind whose refusal seals the id (then every later call of it is refused).
        11 => Command::BindOrSeal(handle(rng), addr(rng)),
        _ => {
            let h = handle(rng);
            Command::Call(h, op(rng, addr))
        }
    }
}

fn cm_error(rng: &mut StdRng) -> rcm::Error {
    use rcm::Error as E;
    match rng.gen_range(0..18) {
        0 => E::InvalidState(state(rng)),
        1 => E::Destroyed,
        2 => E::DeviceRemoved,
        3 => E::AddrNotAvailable(any_ip(rng)),
        4 => E::AddrInUse(SocketAddr::new(any_ip(rng), rng.gen())),
        5 => E::NoPorts,
        6 => E::PrivateDataTooLong {
            len: rng.gen::<u32>() as usize,
            max: rng.gen::<u32>() as usize,
        },
        7 => E::EventsOutstanding(rng.gen::<u32>() as usize),
        8 => E::QpBusy(Cow::Owned(text(rng))),
        9 => E::DeviceExists(any_ip(rng)),
        10 => E::Io(text(rng)),
        11 => E::Protocol(CmError::UnknownHandle),
        12 => E::Protocol(CmError::AddressInUse(rng.gen())),
        13 => E::Protocol(CmError::NoResources),
        14 => E::InvalidArgument(Cow::Owned(text(rng))),
        15 => E::LimitExceeded(pick(rng, &LIMITS)),
        16 => E::ShutDown,
        _ => E::Remote(text(rng)),
    }
}

fn wire_error(rng: &mut StdRng) -> WireError {
    match rng.gen_range(0..8) {
        0 => WireError::NoSuchId,
        1 => WireError::BadMessage(text(rng)),
        2 => WireError::Handshake(text(rng)),
        3 => WireError::NoSuchSession,
        _ => WireError::Cm(cm_error(rng)),
    }
}

fn param(rng: &mut StdRng) -> ConnParam {
    ConnParam {
        responder_resources: rng.gen(),
        initiator_depth: rng.gen(),
        retry_count: rng.gen(),
        rnr_retry_count: rng.gen(),
        srq: rng.gen(),
        qpn: rng.gen(),
    }
}

fn opt_addr(rng: &mut StdRng) -> Option<SocketAddr> {
    rng.gen::<bool>()
        .then(|| SocketAddr::new(any_ip(rng), rng.gen()))
}

fn wire_event(rng: &mut StdRng) -> WireEvent {
    match rng.gen_range(0..13) {
        0 => WireEvent::AddrResolved,
        1 => WireEvent::AddrError(wire_error(rng)),
        2 => WireEvent::RouteResolved,
        3 => WireEvent::RouteError(wire_error(rng)),
        4 => WireEvent::ConnectRequest {
            listener: rng.gen(),
            private_data: bytes(rng, proto::MAX_PRIVATE_DATA),
            param: param(rng),
            ud: rng.gen(),
        },
        5 => WireEvent::ConnectResponse {
            private_data: bytes(rng, proto::MAX_PRIVATE_DATA),
            param: param(rng),
        },
        6 => WireEvent::ConnectError(wire_error(rng)),
        7 => WireEvent::Unreachable(match rng.gen_range(0..3) {
            0 => Unreachable::Timeout,
            1 => Unreachable::RepTimeout,
            // Any status but success (0), which the decoder refuses.
            _ => Unreachable::Sidr {
                status: SidrStatus::from_raw_value(rng.gen_range(1..=u8::MAX)),
                private_data: bytes(rng, proto::MAX_PRIVATE_DATA),
            },
        }),
        8 => WireEvent::Rejected {
            reason: RejReason::from_raw_value(rng.gen()),
            private_data: bytes(rng, proto::MAX_PRIVATE_DATA),
        },
        9 => WireEvent::Established {
            ud: rng.gen::<bool>().then(|| UdParam {
                qpn: rng.gen(),
                qkey: rng.gen(),
            }),
            private_data: bytes(rng, proto::MAX_PRIVATE_DATA),
        },
        10 => WireEvent::Disconnected,
        11 => WireEvent::DeviceRemoval,
        _ => WireEvent::TimewaitExit,
    }
}

fn message(rng: &mut StdRng) -> Message {
    match rng.gen_range(0..13) {
        0 => Message::HelloOk {
            version: rng.gen(),
            token: rng.gen(),
            limits: Limits {
                max_ids: rng.gen(),
                max_queued_events: rng.gen(),
                max_unread_requests: rng.gen(),
                max_message: rng.gen(),
            },
        },
        1 => Message::Ok(Answer::Reply(Reply::Done)),
        2 => Message::Ok(Answer::Reply(Reply::Qpn(rng.gen()))),
        3 => Message::Ok(Answer::Reply(Reply::QpAttr(qp_attr(rng)))),
        4 => Message::Ok(Answer::Reply(Reply::Info(IdInfo {
            state: state(rng),
            local: opt_addr(rng),
            peer: opt_addr(rng),
            device: rng.gen::<bool>().then(|| any_ip(rng)),
        }))),
        5 => Message::Ok(Answer::Handle(rng.gen())),
        6 => {
            let n = rng.gen_range(0..=256);
            Message::Ok(Answer::Devices((0..n).map(|_| any_ip(rng)).collect()))
        }
        7 => Message::Ok(Answer::Stats(SessionStats {
            ids: rng.gen(),
            queued_events: rng.gen(),
            dropped_events: rng.gen(),
            refused_requests: rng.gen(),
            credit: rng.gen(),
            commands: rng.gen(),
        })),
        8 => Message::Err(wire_error(rng)),
        9 => Message::Ok(Answer::Released { events: rng.gen() }),
        _ => Message::Event {
            handle: rng.gen(),
            event: wire_event(rng),
            qp: rng.gen::<bool>().then(|| qp_attr(rng)),
        },
    }
}

fn qp_attr(rng: &mut StdRng) -> QpAttr {
    QpAttr {
        qp_state: rng.gen::<bool>().then(|| qp_state(rng)),
        attr_mask: QpAttrMask::from_bits(rng.gen()),
        qp_access_flags: AccessFlags::from_bits(rng.gen()),
        pkey_index: rng.gen(),
        port_num: rng.gen(),
        qkey: rng.gen(),
        path_mtu: rng.gen(),
        dest_qp_num: rng.gen(),
        rq_psn: rng.gen(),
        max_dest_rd_atomic: rng.gen(),
        min_rnr_timer: rng.gen(),
        sgid: Gid(rng.gen()),
        dgid: Gid(rng.gen()),
        flow_label: rng.gen(),
        hop_limit: rng.gen(),
        traffic_class: rng.gen(),
        sq_psn: rng.gen(),
        timeout: rng.gen(),
        retry_cnt: rng.gen(),
        rnr_retry: rng.gen(),
        max_rd_atomic: rng.gen(),
    }
}

/// A damaged copy of a frame: bits flipped, cut short, extended, or a header field changed.
fn mutate(rng: &mut StdRng, frame: &[u8]) -> Vec<u8> {
    let mut f = frame.to_vec();
    for _ in 0..rng.gen_range(1..4) {
        match rng.gen_range(0..7) {
            0 | 1 if !f.is_empty() => {
                let i = rng.gen_range(0..f.len());
                f[i] ^= 1 << rng.gen_range(0..8);
            }
            2 => {
                let n = rng.gen_range(0..=f.len());
                f.truncate(n);
            }
            3 => {
                let extra = bytes(rng, 32);
                f.extend_from_slice(&extra);
            }
            4 if f.len() >= 4 => {
                // A length that disagrees with the bytes that follow.
                let len = u32::from_le_bytes([f[0], f[1], f[2], f[3]]);
                let new = match rng.gen_range(0..4) {
                    0 => len.wrapping_add(rng.gen_range(1..8)),
                    1 => len.saturating_sub(rng.gen_range(1..8)),
                    2 => rng.gen_range(0..16),
                    _ => rng.gen(),
                };
                f[..4].copy_from_slice(&new.to_le_bytes());
            }
            5 if f.len() >= 6 => {
                let ks: [u16; 3] = [rng.gen_range(0..0x20), rng.gen_range(0x80..0x85), rng.gen()];
                let k = pick(rng, &ks);
                f[4..6].copy_from_slice(&k.to_le_bytes());
            }
            _ if f.len() >= 8 => {
                f[6..8].copy_from_slice(&rng.gen::<u16>().to_le_bytes());
            }
            _ => {}
        }
    }
    f
}

// ---------------------------------------------------------------------------------------
// Decoder properties

/// Decodes `body` under `kind`; what the decoder accepts must re-encode under the same kind
/// and decode to the same value (a decoder taking what its encoder cannot say would let the
/// two ends read one frame two ways). Returns whether it was accepted.
fn accepted_round_trips<T: PartialEq + std::fmt::Debug>(
    kind: u16,
    body: &[u8],
    decode: fn(u16, &[u8]) -> Result<T, proto::ProtoError>,
    encode: fn(&T, u32) -> Vec<u8>,
) -> bool {
    let Ok(v) = decode(kind, body) else {
        return false;
    };
    let frame = encode(&v, 7);
    let (h, b) = split_frame(&frame)
        .unwrap_or_else(|e| panic!("{v:?} was accepted but its encoding does not split: {e:?}"));
    assert_eq!(h.kind, kind, "{v:?} re-encodes under another kind");
    assert_eq!(
        decode(h.kind, b).as_ref(),
        Ok(&v),
        "{v:?} does not survive its own encoding"
    );
    true
}

#[test]
fn decoders_never_panic_and_round_trip() {
    let seed = seed() ^ 0xDEC0;
    let until = Instant::now() + budget().mul_f64(0.3);
    eprintln!(
        "decoder property seed {seed:#x} (RCM_UCM_FUZZ_SEED={:#x})",
        seed ^ 0xDEC0
    );
    let mut rng = StdRng::seed_from_u64(seed);
    let mut n = 0u64;
    let accepted = std::cell::Cell::new(0u64);
    let check = |what: &str, b: &[u8], f: &dyn Fn()| {
        assert!(
            catch_unwind(AssertUnwindSafe(f)).is_ok(),
            "{what} panicked on {b:02x?}"
        );
    };
    while Instant::now() < until {
        for _ in 0..200 {
            n += 1;
            // Commands: encode → split → decode is the identity.
            let cmd = command(&mut rng, &mut |r| r.gen(), &mut |r| r.gen(), &mut |r| {
                SocketAddr::new(any_ip(r), r.gen())
            });
            let seq = rng.gen();
            let frame = cmd.encode(seq);
            let (h, body) = split_frame(&frame).expect("a valid frame splits");
            assert_eq!(h.len as usize, frame.len() - 4);
            assert_eq!((h.seq, h.flags), (seq, 0));
            assert!(h.kind < 0x80, "command kinds are below 0x80");
            assert_eq!(decode_command(h.kind, body).as_ref(), Ok(&cmd));
            // Messages likewise.
            let msg = message(&mut rng);
            let seq = rng.gen();
            let mframe = msg.encode(seq);
            let (mh, mbody) = split_frame(&mframe).expect("a valid frame splits");
            assert_eq!((mh.seq, mh.flags), (seq, 0));
            assert!(mh.kind >= 0x80, "daemon message kinds are 0x80 and above");
            assert_eq!(decode_message(mh.kind, mbody).as_ref(), Ok(&msg));
            // Encoded into a buffer that held another frame (the daemon reuses its
            // answers' and events' buffers): the same bytes, nothing of the old left.
            assert_eq!(msg.encode_in(frame.clone(), seq), mframe);
            // Damaged frames, and random bytes under every kind: errors, never panics.
            for f in [
                mutate(&mut rng, &frame),
                mutate(&mut rng, &mframe),
                bytes(&mut rng, 64),
            ] {
                check("split_frame", &f, &|| {
                    let _ = split_frame(&f);
                });
                if f.len() >= 12 {
                    let mut hb = [0u8; 12];
                    hb.copy_from_slice(&f[..12]);
                    check("Header::parse", &f, &|| {
                        if let Ok(h) = Header::parse(&hb) {
                            assert!(h.body_len() <= h.len as usize);
                        }
                    });
                }
                let body = f.get(12..).unwrap_or(&f[..]);
                let ks = [
                    h.kind,
                    mh.kind,
                    rng.gen_range(0..0x20),
                    rng.gen_range(0x80..0x88),
                ];
                let k = pick(&mut rng, &ks);
                check("decode_command", body, &|| {
                    if accepted_round_trips(k, body, decode_command, Command::encode) {
                        accepted.set(accepted.get() + 1);
                    }
                });
                check("decode_message", body, &|| {
                    if accepted_round_trips(k, body, decode_message, Message::encode) {
                        accepted.set(accepted.get() + 1);
                    }
                });
            }
        }
    }
    // Every header of 12 bytes either parses with len >= 8 or is refused.
    for len in 0u32..16 {
        let mut hb = [0u8; 12];
        hb[..4].copy_from_slice(&len.to_le_bytes());
        assert_eq!(Header::parse(&hb).is_ok(), len >= 8, "len {len}");
    }
    eprintln!(
        "{n} round trips and {} damaged inputs, {} of them accepted and re-encoded",
        3 * n,
        accepted.get()
    );
    // Damage often leaves a frame decodable (a changed value, a changed kind): the
    // re-encoding property is exercised, not just the refusals.
    assert!(accepted.get() > 0, "no damaged input was accepted");
}

// ---------------------------------------------------------------------------------------
// The daemon under fuzz

/// Follows the byte stream as the daemon frames it, to know which complete frames a chunk
/// would deliver (and whether the daemon ends the session).
#[derive(Clone)]
struct Mirror {
    buf: Vec<u8>,
    skip: u64,
    dead: bool,
    max: usize,
}

impl Mirror {
    fn feed(&mut self, mut b: &[u8], frames: &mut Vec<(u16, Vec<u8>)>) {
        while !b.is_empty() && !self.dead {
            if self.skip > 0 {
                let n = (self.skip.min(b.len() as u64)) as usize;
                self.skip -= n as u64;
                b = &b[n..];
                continue;
            }
            let need = if self.buf.len() < 12 {
                12
            } else {
                let mut hb = [0u8; 12];
                hb.copy_from_slice(&self.buf[..12]);
                let Ok(h) = Header::parse(&hb) else {
                    self.dead = true;
                    return;
                };
                if 4 + h.len as usize > self.max {
                    self.skip = h.body_len() as u64;
                    self.buf.clear();
                    continue;
                }
                12 + h.body_len()
            };
            if self.buf.len() == need {
                let kind = u16::from_le_bytes([self.buf[4], self.buf[5]]);
                frames.push((kind, self.buf[12..].to_vec()));
                self.buf.clear();
                continue;
            }
            let n = (need - self.buf.len()).min(b.len());
            self.buf.extend_from_slice(&b[..n]);
            b = &b[n..];
            if self.buf.len() == 12 {
                // Header complete: loop to check it (even with no bytes left).
                let mut hb = [0u8; 12];
                hb.copy_from_slice(&self.buf[..12]);
                match Header::parse(&hb) {
                    Err(_) => self.dead = true,
                    Ok(h) if 4 + h.len as usize > self.max => {
                        self.skip = h.body_len() as u64;
                        self.buf.clear();
                    }
                    Ok(h) if h.body_len() == 0 => {
                        frames.push((h.kind, Vec::new()));
                        self.buf.clear();
                    }
                    Ok(_) => {}
                }
            }
        }
    }
}

/// A command that could make the daemon send packets off the loopback network.
fn leaves_loopback(kind: u16, body: &[u8]) -> bool {
    match decode_command(kind, body) {
        Ok(Command::Call(_, Op::ResolveAddr { dst, .. })) => match dst.ip() {
            IpAddr::V4(a) => !a.is_loopback(),
            // The daemon has no IPv6 device: nothing is ever sent to one.
            IpAddr::V6(_) => false,
        },
        _ => false,
    }
}

struct FuzzSession {
    stream: UnixStream,
    mirror: Mirror,
    reads: bool,
    inbox: Vec<u8>,
    created: u32,
    frames_in: usize,
    /// Children of connect requests received, and ids that got a ConnectResponse.
    requests: Vec<u32>,
    responses: Vec<u32>,
    /// `OK Handle` answers seen, by seq (the last few).
    handles: Vec<(u32, u32)>,
    /// Events read, and the count in the last `OK Released` (protocol §8).
    events_in: u64,
    released: u64,
}

impl FuzzSession {
    fn open(path: &std::path::Path, max: usize, reads: bool) -> Option<Self> {
        let stream = UnixStream::connect(path).ok()?;
        stream.set_nonblocking(true).ok()?;
        Some(FuzzSession {
            stream,
            mirror: Mirror {
                buf: Vec::new(),
                skip: 0,
                dead: false,
                max,
            },
            reads,
            inbox: Vec::new(),
            created: 0,
            frames_in: 0,
            requests: Vec::new(),
            responses: Vec::new(),
            handles: Vec::new(),
            events_in: 0,
            released: 0,
        })
    }

    /// Sends `b` (in `parts` writes) unless a complete frame in it would leave loopback.
    /// `false`: the session is over (the daemon ends it, or it stopped taking bytes).
    fn send(&mut self, b: &[u8], parts: usize) -> bool {
        let mut m = self.mirror.clone();
        let mut frames = Vec::new();
        m.feed(b, &mut frames);
        if frames.iter().any(|(k, body)| leaves_loopback(*k, body)) {
            return true;
        }
        self.mirror = m;
        let step = b.len().div_ceil(parts.max(1)).max(1);
        for chunk in b.chunks(step) {
            let mut off = 0;
            let t0 = Instant::now();
            while off < chunk.len() {
                match self.stream.write(&chunk[off..]) {
                    Ok(0) => return false,
                    Ok(n) => off += n,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        // A client that does not read its replies stalls only itself.
                        if t0.elapsed() > Duration::from_millis(50) {
                            return false;
                        }
                        self.drain();
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(_) => return false,
                }
            }
            if parts > 1 {
                std::thread::yield_now();
            }
        }
        !self.mirror.dead
    }

    /// Reads what is there (if this session reads at all); every frame the daemon sends
    /// must be a valid message. Learns tokens.
    fn drain(&mut self) {
        if !self.reads {
            return;
        }
        let mut buf = [0u8; 16 * 1024];
        loop {
            match self.stream.read(&mut buf) {
                Ok(n) if n > 0 => self.inbox.extend_from_slice(&buf[..n]),
                _ => break,
            }
        }
    }

    /// Creates an id and waits (briefly) for its handle.
    fn create(&mut self, seq: u32, tokens: &Mutex<Vec<u64>>) -> Option<u32> {
        if !self.send(&Command::CreateId(PortSpace::Tcp).encode(seq), 1) {
            return None;
        }
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_millis(200) {
            self.drain();
            self.parse_inbox(tokens);
            if let Some(&(_, h)) = self.handles.iter().find(|(s, _)| *s == seq) {
                return Some(h);
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        None
    }

    fn parse_inbox(&mut self, tokens: &Mutex<Vec<u64>>) {
        loop {
            if self.inbox.len() < 12 {
                return;
            }
            let (h, total) = {
                let mut hb = [0u8; 12];
                hb.copy_from_slice(&self.inbox[..12]);
                let h = Header::parse(&hb).expect("the daemon sends valid headers");
                (h, 4 + h.len as usize)
            };
            if self.inbox.len() < total {
                return;
            }
            let m = decode_message(h.kind, &self.inbox[12..total]).unwrap_or_else(|e| {
                panic!(
                    "the daemon sent an undecodable frame ({e}): {:02x?}",
                    &self.inbox[..total]
                )
            });
            assert_eq!(h.flags, 0);
            if let Message::Event { .. } = m {
                assert_eq!(h.seq, 0, "events carry seq 0");
                self.events_in += 1;
            }
            // A destroy's answer counts events written before it on this connection (the
            // fuzz sessions have no channels): never more than were read, and never fewer
            // than an earlier answer counted.
            if let Message::Ok(Answer::Released { events }) = m {
                assert!(
                    events <= self.events_in,
                    "a destroy answered {events} events, {} were read before it",
                    self.events_in
                );
                assert!(events >= self.released, "the count went back");
                self.released = events;
            }
            if let Message::HelloOk { token, .. } = m {
                let mut t = tokens.lock().expect("tokens");
                if t.len() < 64 {
                    t.push(token);
                }
            }
            SEEN[seen_index(&m)].fetch_add(1, Ordering::Relaxed);
            match m {
                Message::Event {
                    handle,
                    event: WireEvent::ConnectRequest { .. },
                    ..
                } if self.requests.len() < 64 => self.requests.push(handle),
                Message::Event {
                    handle,
                    event: WireEvent::ConnectResponse { .. },
                    ..
                } if self.responses.len() < 64 => self.responses.push(handle),
                Message::Ok(Answer::Handle(hd)) => {
                    if self.handles.len() >= 16 {
                        self.handles.remove(0);
                    }
                    self.handles.push((h.seq, hd));
                }
                _ => {}
            }
            self.frames_in += 1;
            self.inbox.drain(..total);
        }
    }
}

fn fuzz_worker(
    path: &std::path::Path,
    max: usize,
    seed: u64,
    until: Instant,
    tokens: &Arc<Mutex<Vec<u64>>>,
    steady: bool,
) -> (u64, u64, usize) {
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut sessions, mut sent, mut received) = (0u64, 0u64, 0usize);
    while Instant::now() < until {
        // A steady worker keeps long sessions that read and answer requests (so fuzzed
        // dialers find listeners), with valid commands (some split) and no stream breakage.
        let reads = steady || rng.gen_bool(0.8);
        let Some(mut s) = FuzzSession::open(path, max, reads) else {
            continue;
        };
        sessions += 1;
        if rng.gen_bool(0.9) {
            let hello = Command::Hello {
                min: proto::VERSION,
                max: proto::VERSION,
            }
            .encode(1);
            if !s.send(&hello, 1) {
                continue;
            }
        }
        let mut mine: Vec<u32> = Vec::new();
        let actions = if steady {
            rng.gen_range(500..3000)
        } else {
            rng.gen_range(1..300)
        };
        'session: for _ in 0..actions {
            if Instant::now() >= until {
                break;
            }
            let created = s.created;
            let tk = tokens.clone();
            let mut handle = |r: &mut StdRng| -> u32 {
                match r.gen_range(0..10) {
                    0 => r.gen(),
                    1 => 0,
                    2..=5 => created.max(1),
                    _ => r.gen_range(1..created.max(1) + 4),
                }
            };
            let mut token = |r: &mut StdRng| -> u64 {
                let t = tk.lock().expect("tokens");
                if t.is_empty() || r.gen_bool(0.2) {
                    r.gen()
                } else {
                    t[r.gen_range(0..t.len())]
                }
            };
            let seq = rng.gen();
            let action = match (steady, rng.gen_range(0..4)) {
                (true, 0) => 50,
                (true, 1) => 40,
                (true, 2) => rng.gen_range(70..80),
                (true, _) => rng.gen_range(0..40),
                (false, _) => rng.gen_range(0..100),
            };
            let ok = match action {
                // Valid commands with random fields.
                0..=39 => {
                    let c = command(&mut rng, &mut handle, &mut token, &mut safe_addr);
                    if matches!(c, Command::CreateId(_)) {
                        s.created += 1;
                    }
                    s.send(&c.encode(seq), 1)
                }
                // Scripts that make real connections and events happen.
                40..=49 => {
                    let h = if steady {
                        // Its ids are few and known: destroy the oldest to stay in bounds.
                        if mine.len() >= 12 {
                            let old = mine.remove(0);
                            let _ = s.send(&Command::DestroyId(old).encode(seq), 1);
                        }
                        let Some(h) = s.create(seq.wrapping_add(100), tokens) else {
                            break 'session;
                        };
                        mine.push(h);
                        h
                    } else {
                        s.created + 1
                    };
                    s.created += 1;
                    // The steady worker listens on 7003, the others on 7000-7002.
                    let lport = if steady {
                        7003
                    } else {
                        rng.gen_range(7000..7003)
                    };
                    let port = rng.gen_range(7000..7004);
                    let mut script = if steady {
                        Vec::new()
                    } else {
                        vec![Command::CreateId(PortSpace::Tcp)]
                    };
                    if rng.gen() {
                        script.push(Command::Call(h, Op::Bind(sa(1, lport))));
                        script.push(Command::Call(h, Op::Listen(rng.gen_range(0..8))));
                    } else {
                        script.push(Command::Call(
                            h,
                            Op::ResolveAddr {
                                src: None,
                                dst: sa(1, port),
                            },
                        ));
                        script.push(Command::Call(h, Op::ResolveRoute));
                        script.push(Command::Call(h, Op::Connect(ConnectOptions::default())));
                    }
                    script.push(Command::GetEvent(rng.gen_range(0..32)));
                    let mut ok = true;
                    for (i, c) in script.iter().enumerate() {
                        ok &= s.send(&c.encode(seq.wrapping_add(i as u32)), 1);
                    }
                    ok
                }
                // Answer connect requests and responses seen (or guess a handle).
                50..=54 => {
                    let (h, op) = if let Some(h) = s.responses.pop() {
                        (h, Op::Establish)
                    } else {
                        let h = s.requests.pop().unwrap_or_else(|| handle(&mut rng));
                        if rng.gen_bool(0.8) {
                            let o = AcceptOptions {
                                private_data: bytes(&mut rng, 8),
                                ..AcceptOptions::default()
                            };
                            (h, Op::Accept(o))
                        } else {
                            (h, Op::Reject(bytes(&mut rng, 8)))
                        }
                    };
                    let mut ok = s.send(&Command::Call(h, op).encode(seq), 1);
                    if rng.gen_bool(0.3) {
                        let dis = Command::Call(h, Op::Disconnect).encode(seq.wrapping_add(1));
                        ok &= s.send(&dis, 1);
                    }
                    ok
                }
                // Damaged valid frames.
                55..=69 => {
                    let c = command(&mut rng, &mut handle, &mut token, &mut safe_addr);
                    let f = mutate(&mut rng, &c.encode(seq));
                    s.send(&f, 1)
                }
                // Valid frames split across writes.
                70..=79 => {
                    let c = command(&mut rng, &mut handle, &mut token, &mut safe_addr);
                    let parts = rng.gen_range(2..6);
                    s.send(&c.encode(seq), parts)
                }
                // Random bytes.
                80..=84 => {
                    let b = bytes(&mut rng, 48);
                    s.send(&b, rng.gen_range(1..3))
                }
                // A huge length, with a little of its body.
                85..=87 => {
                    let mut f = Vec::new();
                    let len = rng.gen_range(max as u32..=u32::MAX);
                    f.extend_from_slice(&len.to_le_bytes());
                    f.extend_from_slice(&kind::STATS.to_le_bytes());
                    f.extend_from_slice(&0u16.to_le_bytes());
                    f.extend_from_slice(&seq.to_le_bytes());
                    let body = bytes(&mut rng, 512);
                    f.extend_from_slice(&body);
                    s.send(&f, 1)
                }
                // A zero or short length: the daemon ends the session.
                88..=89 => {
                    let mut f = rng.gen_range(0u32..8).to_le_bytes().to_vec();
                    f.extend_from_slice(&[0; 8]);
                    s.send(&f, 1)
                }
                // Close in the middle of a frame.
                90..=92 => {
                    let c = command(&mut rng, &mut handle, &mut token, &mut safe_addr);
                    let f = c.encode(seq);
                    let cut = rng.gen_range(1..f.len());
                    let _ = s.send(&f[..cut], 1);
                    break 'session;
                }
                // Just read (or not, for a session that never reads).
                _ => {
                    std::thread::sleep(Duration::from_micros(rng.gen_range(0..500)));
                    true
                }
            };
            sent += 1;
            s.drain();
            s.parse_inbox(tokens);
            if !ok {
                break;
            }
        }
        // Sometimes wait for the answers before closing; a session that does not read never
        // does.
        if s.reads && rng.gen_bool(0.3) {
            std::thread::sleep(Duration::from_millis(2));
            s.drain();
            s.parse_inbox(tokens);
        }
        received += s.frames_in;
    }
    (sessions, sent, received)
}

#[test]
fn daemon_survives_fuzzed_sessions() {
    count_daemon_panics();
    let seed = seed();
    let run = budget().mul_f64(0.6);
    eprintln!(
        "daemon fuzz seed {seed:#x} for {run:?} (override: RCM_UCM_FUZZ_SEED, RCM_UCM_FUZZ_SECS)"
    );
    let max = 1024usize;
    let mut cfg = config("fuzz", 47290, &[1]);
    cfg.limits = Limits {
        max_ids: 32,
        max_queued_events: 64,
        max_unread_requests: 8,
        max_message: max as u32,
    };
    let d = rcm_ucm::Daemon::start(cfg).expect("daemon");
    let tokens = Arc::new(Mutex::new(Vec::new()));
    let until = Instant::now() + run;
    let workers: Vec<_> = (0..4u64)
        .map(|i| {
            let path = d.socket().to_path_buf();
            let tokens = tokens.clone();
            std::thread::Builder::new()
                .name(format!("fuzz-{i}"))
                .spawn(move || {
                    fuzz_worker(&path, max, seed.wrapping_add(i), until, &tokens, i == 0)
                })
                .expect("spawn")
        })
        .collect();
    let (mut sessions, mut sent, mut received) = (0, 0, 0);
    for w in workers {
        let (a, b, c) = w.join().expect("a fuzz worker panicked (see above)");
        sessions += a;
        sent += b;
        received += c;
    }
    eprintln!(
        "{sessions} sessions, {sent} actions, {received} frames back, {} events dropped",
        d.dropped_events()
    );
    let seen: Vec<usize> = SEEN.iter().map(|a| a.load(Ordering::Relaxed)).collect();
    eprintln!(
        "received: hello_ok {} ok {} err {}; events addr_resolved {} addr_error {} \
         route_resolved {} route_error {} connect_request {} connect_response {} \
         connect_error {} unreachable {} rejected {} established {} disconnected {} \
         device_removal {} timewait_exit {}",
        seen[0],
        seen[1],
        seen[2],
        seen[3],
        seen[4],
        seen[5],
        seen[6],
        seen[7],
        seen[8],
        seen[9],
        seen[10],
        seen[11],
        seen[12],
        seen[13],
        seen[14],
        seen[15]
    );
    assert!(sessions > 0 && sent > 0);
    assert_eq!(
        DAEMON_PANICS.load(Ordering::SeqCst),
        0,
        "a daemon thread panicked"
    );
    // All fuzz sessions are closed: the daemon lets go of everything they held.
    wait_until(
        || d.sessions() == 0,
        || format!("{} fuzz sessions still open", d.sessions()),
    );
    wait_ids(&d, 0, 0);
    // And it still serves a well-behaved client end to end.
    round_trip(&d, sa(1, 7900));
    wait_until(
        || d.sessions() == 0,
        || format!("{} sessions", d.sessions()),
    );
    wait_ids(&d, 0, 0);
    assert_eq!(d.fabric().bound_ports(), 0, "port bindings leaked");
    assert_eq!(
        DAEMON_PANICS.load(Ordering::SeqCst),
        0,
        "a daemon thread panicked"
    );
    d.shutdown();
}

/// `BIND`'s seal flag is optional and last: absent, a plain bind; 1, a sealing one; any
/// other value, or a byte after it, is refused (a daemon reading 2 as "seal" or "no seal"
/// would guess what the client meant).
#[test]
fn binds_seal_flag_is_optional_exactly_one_and_last() {
    let a = SocketAddr::new(IpAddr::from([127, 0, 0, 1]), 7471);
    let sealing = Command::BindOrSeal(9, a).encode(1);
    let plain = Command::Call(9, Op::Bind(a)).encode(1);
    let (h, body) = split_frame(&sealing).expect("frame");
    let (_, plain_body) = split_frame(&plain).expect("frame");
    assert_eq!(h.kind, proto::kind::BIND);
    assert_eq!(body.split_last(), Some((&proto::BIND_SEALS, plain_body)));
    assert_eq!(decode_command(h.kind, body), Ok(Command::BindOrSeal(9, a)));
    assert_eq!(
        decode_command(h.kind, plain_body),
        Ok(Command::Call(9, Op::Bind(a)))
    );
    for flag in [0u8, 2, 0xFF] {
        let mut b = plain_body.to_vec();
        b.push(flag);
        assert!(decode_command(h.kind, &b).is_err(), "flag {flag}");
    }
    let mut b = body.to_vec();
    b.push(0);
    assert!(decode_command(h.kind, &b).is_err(), "a byte after the flag");
}

/// The QP attributes after an event are optional and last: absent, the frame ends with the
/// event; present, a 1 byte and the 73-byte attributes; anything else there is refused.
#[test]
fn an_events_qp_attributes_are_optional_flagged_and_exact() {
    let attr = QpAttr {
        qp_state: Some(QpState::Rts),
        dest_qp_num: 0x12_3456,
        sq_psn: 7,
        port_num: 1,
        ..QpAttr::default()
    };
    let with = Message::Event {
        handle: 9,
        event: WireEvent::Disconnected,
        qp: Some(attr),
    }
    .encode(0);
    let without = Message::Event {
        handle: 9,
        event: WireEvent::Disconnected,
        qp: None,
    }
    .encode(0);
    let (_, wb) = split_frame(&with).expect("frame");
    let (_, nb) = split_frame(&without).expect("frame");
    assert_eq!(
        wb.len(),
        nb.len() + 1 + 73,
        "flag byte + 73 bytes of attributes"
    );
    assert!(matches!(
        decode_message(kind::EVENT, nb),
        Ok(Message::Event { qp: None, .. })
    ));
    assert!(matches!(
        decode_message(kind::EVENT, wb),
        Ok(Message::Event { qp: Some(a), .. }) if a.dest_qp_num == 0x12_3456 && a.sq_psn == 7
    ));
    // Another flag value, a cut attribute block, and bytes after it: all errors.
    let mut bad_flag = wb.to_vec();
    bad_flag[nb.len()] = 2;
    assert!(decode_message(kind::EVENT, &bad_flag).is_err());
    assert!(decode_message(kind::EVENT, &wb[..wb.len() - 1]).is_err());
    let mut trailing = wb.to_vec();
    trailing.push(0);
    assert!(decode_message(kind::EVENT, &trailing).is_err());
}

/// A table of `docs/ucm-protocol.md` as (code, name) rows: the `nth` table (from 0) of the
/// section whose heading starts with `heading`, rows whose first cell is a number (decimal
/// or 0x).
fn doc_table(heading: &str, nth: usize) -> Vec<(u16, String)> {
    let doc = include_str!("../../../docs/ucm-protocol.md");
    let section = doc
        .lines()
        .skip_while(|l| !l.starts_with(heading))
        .skip(1)
        .take_while(|l| !l.starts_with('#'));
    let mut tables: Vec<Vec<(u16, String)>> = Vec::new();
    let mut in_table = false;
    for l in section {
        if !l.starts_with('|') {
            in_table = false;
            continue;
        }
        if !in_table {
            tables.push(Vec::new());
            in_table = true;
        }
        let cells: Vec<&str> = l.split('|').map(str::trim).collect();
        let (Some(code), Some(name)) = (cells.get(1), cells.get(2)) else {
            continue;
        };
        let code = match code.strip_prefix("0x") {
            Some(h) => u16::from_str_radix(h, 16).ok(),
            None => code.parse().ok(),
        };
        if let (Some(code), Some(t)) = (code, tables.last_mut()) {
            t.push((code, name.trim_matches('`').to_string()));
        }
    }
    let rows = tables.into_iter().nth(nth).unwrap_or_default();
    assert!(!rows.is_empty(), "no table {nth} under {heading:?}");
    rows
}

/// A variant's name as `Debug` prints it (`AddrInUse(..)` → `AddrInUse`).
fn variant<T: std::fmt::Debug>(v: &T) -> String {
    format!("{v:?}")
        .split(|c: char| !c.is_alphanumeric())
        .next()
        .unwrap_or_default()
        .to_string()
}

/// `CreateId` → `CREATE_ID`, as the document names commands and messages.
fn upper_snake(s: &str) -> String {
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

/// The protocol document (the issue asks for every message and every error there) against
/// the codec: every command, daemon message, answer, event and error the encoder writes has
/// the code the document gives its name, every row of those tables is written by some
/// value, and no kind the decoders take is missing from the document (nor one they refuse
/// listed in it).
#[test]
fn the_protocol_document_matches_the_codec() {
    let mut rng = StdRng::seed_from_u64(seed() ^ 0xD0C);
    let tables = [
        ("commands", doc_table("## 3. Commands", 0)),
        ("messages", doc_table("## 4. Daemon messages", 0)),
        ("answers", doc_table("## 4. Daemon messages", 1)),
        ("events", doc_table("### 4.1 Events", 0)),
        ("errors", doc_table("## 5. Errors", 0)),
    ];
    let table =
        |what: &str| -> &Vec<(u16, String)> { &tables.iter().find(|(w, _)| *w == what).unwrap().1 };
    let mut hit = std::collections::BTreeSet::<(String, String)>::new();
    let mut check = |what: &str, name: String, code: u16| {
        let rows = table(what);
        let Some((doc_code, _)) = rows.iter().find(|(_, n)| *n == name) else {
            panic!("{what}: {name} (code {code:#x}) is not in the document");
        };
        assert_eq!(*doc_code, code, "{what}: {name} is {code:#x} on the wire");
        hit.insert((what.to_string(), name));
    };
    let body = |frame: &[u8]| frame[12..].to_vec();
    let kind_of = |frame: &[u8]| u16::from_le_bytes([frame[4], frame[5]]);
    for _ in 0..20_000 {
        let c = command(&mut rng, &mut |r| r.gen(), &mut |r| r.gen(), &mut |r| {
            safe_addr(r)
        });
        let name = match &c {
            Command::Call(_, Op::NotifyEstablished) => "NOTIFY".to_string(),
            // CREATE_ID with the optional handle (§3).
            Command::CreateIdAs(..) => "CREATE_ID".to_string(),
            // BIND with the seal flag (§3).
            Command::BindOrSeal(..) => "BIND".to_string(),
            Command::Call(_, op) => upper_snake(&variant(op)),
            c => upper_snake(&variant(c)),
        };
        check("commands", name, kind_of(&c.encode(1)));
        let m = message(&mut rng);
        let f = m.encode(1);
        check("messages", upper_snake(&variant(&m)), kind_of(&f));
        let b = body(&f);
        match &m {
            Message::Ok(a) => {
                let name = match a {
                    Answer::Reply(r) => variant(r),
                    a => variant(a),
                };
                check("answers", name, u16::from(b[0]));
            }
            Message::Err(e) => {
                let name = match e {
                    WireError::Cm(e) => variant(e),
                    e => variant(e),
                };
                check("errors", name, u16::from_le_bytes([b[0], b[1]]));
            }
            Message::Event { event, .. } => {
                check("events", variant(event), u16::from(b[4]));
            }
            Message::HelloOk { .. } => {}
        }
    }
    for (what, rows) in &tables {
        for (code, name) in rows {
            assert!(
                hit.contains(&(what.to_string(), name.clone())),
                "{what}: the document's {name} ({code:#x}) was never written"
            );
        }
    }
    // The decoders' kinds, both ways.
    for k in 0..=0x00FF_u16 {
        let known = if k < 0x80 {
            !matches!(
                decode_command(k, &[]),
                Err(proto::ProtoError::UnknownKind(_))
            )
        } else {
            !matches!(
                decode_message(k, &[]),
                Err(proto::ProtoError::UnknownKind(_))
            )
        };
        let what = if k < 0x80 { "commands" } else { "messages" };
        let listed = table(what).iter().any(|(c, _)| *c == k);
        assert_eq!(
            known, listed,
            "{what}: kind {k:#x} decoded {known}, listed {listed}"
        );
    }
}

/// An enumeration of the protocol document's §1.1 (`* Title (`u8`): 1 A, 2 B, …`, over one or
/// more lines) as (code, text) items.
fn doc_enum(title: &str) -> Vec<(u8, String)> {
    let doc = include_str!("../../../docs/ucm-protocol.md");
    let start = format!("* {title} (`u8`):");
    let mut text = String::new();
    let mut lines = doc.lines().skip_while(|l| !l.starts_with(&start));
    if let Some(first) = lines.next() {
        text.push_str(&first[start.len()..]);
    }
    for l in lines.take_while(|l| l.starts_with("  ")) {
        text.push(' ');
        text.push_str(l.trim());
    }
    let items: Vec<(u8, String)> = text
        .split(", ")
        .filter_map(|item| {
            let item = item.trim();
            let (n, rest) = item.split_once(' ')?;
            // Up to a parenthesis: "3 RTS (0 = none, …)" is RTS.
            let rest = rest.split(" (").next().unwrap_or(rest);
            Some((n.parse().ok()?, rest.trim_end_matches('.').to_string()))
        })
        .collect();
    assert!(!items.is_empty(), "no enumeration {title:?}");
    items
}

/// The §1.1 enumerations against the encoder: port spaces, QP states, rdma_cm states and
/// session limits each have the code the document gives them, and the document lists no
/// code the encoder does not write. The `match`es have no wildcard: a new variant does not
/// compile here until it is named, and then it must be in the document.
#[test]
fn the_protocol_documents_enumerations_match_the_codec() {
    fn check(title: &str, written: &[(u8, &str)], same: impl Fn(&str, &str) -> bool) {
        let doc = doc_enum(title);
        for (code, name) in written {
            assert!(
                doc.iter().any(|(c, t)| c == code && same(t, name)),
                "{title}: {name} is {code} on the wire; the document has {doc:?}"
            );
        }
        for (c, t) in &doc {
            assert!(
                written.iter().any(|(code, _)| code == c),
                "{title}: the document's {c} ({t}) is never written"
            );
        }
    }
    let eq = |t: &str, n: &str| t.eq_ignore_ascii_case(n);
    let ps_name = |p: PortSpace| match p {
        PortSpace::Ipoib => "IPoIB",
        PortSpace::Tcp => "TCP",
        PortSpace::Udp => "UDP",
        PortSpace::Ib => "IB",
    };
    let ps: Vec<(u8, &str)> = [
        PortSpace::Ipoib,
        PortSpace::Tcp,
        PortSpace::Udp,
        PortSpace::Ib,
    ]
    .into_iter()
    .map(|p| (Command::CreateId(p).encode(1)[12], ps_name(p)))
    .collect();
    check("Port space", &ps, eq);
    let qs_name = |s: QpState| match s {
        QpState::Init => "INIT",
        QpState::Rtr => "RTR",
        QpState::Rts => "RTS",
    };
    let qs: Vec<(u8, &str)> = [QpState::Init, QpState::Rtr, QpState::Rts]
        .into_iter()
        .map(|s| {
            (
                Command::Call(7, Op::InitQpAttr(s)).encode(1)[16],
                qs_name(s),
            )
        })
        .collect();
    check("QP state", &qs, eq);
    let st_name = |s: State| match s {
        State::Idle => "Idle",
        State::AddrQuery => "AddrQuery",
        State::AddrResolved => "AddrResolved",
        State::RouteQuery => "RouteQuery",
        State::RouteResolved => "RouteResolved",
        State::Connect => "Connect",
        State::Established => "Established",
        State::Disconnect => "Disconnect",
        State::AddrBound => "AddrBound",
        State::Listen => "Listen",
        State::DeviceRemoval => "DeviceRemoval",
        State::Destroying => "Destroying",
    };
    let st: Vec<(u8, &str)> = STATES
        .into_iter()
        .map(|s| {
            let m = Message::Ok(Answer::Reply(Reply::Info(IdInfo {
                state: s,
                local: None,
                peer: None,
                device: None,
            })));
            (m.encode(1)[13], st_name(s))
        })
        .collect();
    check("rdma_cm state", &st, eq);
    // Limits are named in words there: each must start with these.
    let limit_words = |l: Limit| match l {
        Limit::Ids => "ids",
        Limit::QueuedEvents => "queued events",
        Limit::UnreadRequests => "unread connect requests",
        Limit::MessageSize => "message size",
        Limit::PendingCommands => "pending commands",
        Limit::Channels => "command channels",
        Limit::SendBuffer => "unsent bytes of an iWARP connection",
        Limit::Connections => "connections the daemon serves at once",
    };
    let li: Vec<(u8, &str)> = LIMITS
        .into_iter()
        .map(|l| {
            let m = Message::Err(WireError::Cm(rcm::Error::LimitExceeded(l)));
            (m.encode(1)[14], limit_words(l))
        })
        .collect();
    check("Limit", &li, |t, n| t.starts_with(n));
}
