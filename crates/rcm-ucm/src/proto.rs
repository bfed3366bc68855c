//! The daemon protocol: versioned, length-prefixed binary frames over a Unix stream socket.
//! `docs/ucm-protocol.md` describes every message and error; this module is its one
//! implementation (both sides use it). Decoding never panics: every malformed input is a
//! [`ProtoError`].
//!
//! A frame is `len: u32` (bytes after this field, at least 8) then `kind: u16`, `flags: u16`
//! (0), `seq: u32` and a body; all integers little-endian. A command's reply carries the
//! command's `seq`; events carry `seq` 0.

use rcm::remote::{IdInfo, Limit, Op, Reply};
use rcm::{
    AcceptOptions, AccessFlags, ConnParam, ConnectOptions, Error, Event, PortSpace, QpAttr,
    QpAttrMask, QpState, State, UdParam, Unreachable,
};
use rcm_wire::cm::{RejReason, SidrStatus};
use rcm_wire::Gid;
use std::borrow::Cow;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// `"RCMU"`: the first field of `Hello`.
pub const MAGIC: u32 = u32::from_le_bytes(*b"RCMU");
/// The protocol version this build speaks.
pub const VERSION: u16 = 8;
/// The first handle of the range a client may choose its ids' handles from
/// ([`Command::CreateIdAs`]); the daemon gives out handles below it.
pub const CLIENT_HANDLES: u32 = 0x8000_0000;
/// The flag byte after `BIND`'s address that makes it a [`Command::BindOrSeal`].
pub const BIND_SEALS: u8 = 1;
/// Bytes of the frame header after the length field.
pub const HEADER_LEN: usize = 8;
/// Longest private data any message carries (iWARP's 256 is the largest).
pub const MAX_PRIVATE_DATA: usize = 256;

/// Most bytes of a text field (an error's text).
const MAX_TEXT: usize = 1024;

/// Frame kinds. Client commands are below 0x80, daemon messages at 0x80 and above.
pub mod kind {
    /// Opens the session (first command).
    pub const HELLO: u16 = 0x01;
    /// `create_id`.
    pub const CREATE_ID: u16 = 0x02;
    /// `destroy_id`.
    pub const DESTROY_ID: u16 = 0x03;
    /// `get_event`: grants event credit.
    pub const GET_EVENT: u16 = 0x04;
    /// `migrate_id`.
    pub const MIGRATE_ID: u16 = 0x05;
    /// The daemon's device addresses.
    pub const DEVICES: u16 = 0x06;
    /// Session counters.
    pub const STATS: u16 = 0x07;
    /// Opens a command channel of an existing session (§2.1 of the protocol document).
    pub const ATTACH: u16 = 0x08;
    /// Moves an attached command channel into shared memory (§2.2 of the protocol document).
    pub const MAP_CHANNEL: u16 = 0x09;
    /// Moves what the daemon writes on a session's connection into shared memory (§2.3 of
    /// the protocol document).
    pub const MAP_EVENTS: u16 = 0x0A;
    /// `set_option(REUSEADDR)`.
    pub const SET_REUSEADDR: u16 = 0x10;
    /// `bind`.
    pub const BIND: u16 = 0x11;
    /// `resolve_addr`.
    pub const RESOLVE_ADDR: u16 = 0x12;
    /// `resolve_route`.
    pub const RESOLVE_ROUTE: u16 = 0x13;
    /// `listen`.
    pub const LISTEN: u16 = 0x14;
    /// Attach a soft QP.
    pub const CREATE_QP: u16 = 0x15;
    /// Destroy the attached QP.
    pub const DESTROY_QP: u16 = 0x16;
    /// `connect`.
    pub const CONNECT: u16 = 0x17;
    /// `accept`.
    pub const ACCEPT: u16 = 0x18;
    /// `reject`.
    pub const REJECT: u16 = 0x19;
    /// `establish` (send the RTU).
    pub const ESTABLISH: u16 = 0x1A;
    /// `disconnect`.
    pub const DISCONNECT: u16 = 0x1B;
    /// `init_qp_attr`.
    pub const INIT_QP_ATTR: u16 = 0x1C;
    /// `query`.
    pub const QUERY: u16 = 0x1D;
    /// `notify_established` (`rdma_notify` with `COMM_EST`).
    pub const NOTIFY: u16 = 0x1E;
    /// Reply to `Hello`.
    pub const HELLO_OK: u16 = 0x81;
    /// A command succeeded.
    pub const OK: u16 = 0x82;
    /// A command failed.
    pub const ERR: u16 = 0x83;
    /// An event of one id.
    pub const EVENT: u16 = 0x84;
}

/// Why bytes are not a valid message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    /// The body ended early.
    #[error("message truncated")]
    Truncated,
    /// Bytes left after the body.
    #[error("{0} trailing byte(s)")]
    Trailing(usize),
    /// A field holds a value the protocol does not define.
    #[error("bad value for {0}")]
    BadValue(&'static str),
    /// The frame kind is not a command.
    #[error("unknown message kind {0:#06x}")]
    UnknownKind(u16),
    /// A length over the protocol's bound.
    #[error("{what}: {len} bytes, at most {max}")]
    TooLong {
        /// Which field.
        what: &'static str,
        /// Its length.
        len: usize,
        /// The bound.
        max: usize,
    },
}

/// Errors the daemon reports beyond the rcm API's own.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// An rcm error, carried over.
    #[error(transparent)]
    Cm(#[from] Error),
    /// No id with this handle in this session: never created, destroyed, migrated away, or
    /// another session's (these are indistinguishable on purpose).
    #[error("no such id")]
    NoSuchId,
    /// The command could not be decoded.
    #[error("bad message: {0}")]
    BadMessage(String),
    /// `Hello` must come first, once, with a version the daemon speaks.
    #[error("handshake: {0}")]
    Handshake(String),
    /// `migrate_id` named a session token that no open session has.
    #[error("no such session")]
    NoSuchSession,
}

impl WireError {
    /// The rcm error a client shows for it.
    pub fn into_cm(self) -> Error {
        match self {
            WireError::Cm(e) => e,
            WireError::NoSuchId => Error::Destroyed,
            other => Error::Remote(other.to_string()),
        }
    }
}

/// Limits the daemon enforces per client session (told to the client in `HelloOk`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Ids held at once.
    pub max_ids: u32,
    /// Events queued for the session (not yet written to it).
    pub max_queued_events: u32,
    /// Connect requests queued and not yet written to the session. The default is the
    /// event queue's: a listener's own backlog is what bounds its requests (the daemon's
    /// engine drops a REQ beyond it, and the peer retries), and a client that reads slowly
    /// during a burst must not get its requests rejected while the queue has room (a burst
    /// of 10,000 through the daemon met a limit of 4,096 in one run of six).
    pub max_unread_requests: u32,
    /// Bytes in one frame, header included.
    pub max_message: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_ids: 1 << 18,
            max_queued_events: 1 << 16,
            max_unread_requests: 1 << 16,
            max_message: 4096,
        }
    }
}

/// Per-session counters (`Stats`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SessionStats {
    /// Ids the session holds.
    pub ids: u64,
    /// Events queued for it.
    pub queued_events: u64,
    /// Events dropped: queue full.
    pub dropped_events: u64,
    /// Connect requests refused (rejected at the wire) because of a limit.
    pub refused_requests: u64,
    /// Event credit the client has granted and not used.
    pub credit: u64,
    /// Commands served.
    pub commands: u64,
}

/// A client command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Opens the session.
    Hello {
        /// Oldest version the client speaks.
        min: u16,
        /// Newest.
        max: u16,
    },
    /// `create_id` in a port space.
    CreateId(PortSpace),
    /// `create_id` under a handle the client chose, [`CLIENT_HANDLES`] or above and not held
    /// by the session: the client knows it before the answer, so need not wait for it.
    CreateIdAs(PortSpace, u32),
    /// `destroy_id`.
    DestroyId(u32),
    /// `bind` written without waiting for its answer: refused, it also seals the id, whose
    /// later calls are then all refused with the same error (a call the client wrote behind
    /// it, a `listen` say, must not go on as if it had been bound).
    BindOrSeal(u32, SocketAddr),
    /// Grants credit for this many more events.
    GetEvent(u32),
    /// Takes an id from another session of the same client (named by its token).
    MigrateId {
        /// The source session's token (from its `HelloOk`).
        token: u64,
        /// The id's handle there.
        handle: u32,
    },
    /// The daemon's device addresses.
    Devices,
    /// This session's counters.
    Stats,
    /// Instead of `Hello`: makes this connection a command channel of the session whose
    /// token this is. A channel carries commands and their replies, never events.
    Attach {
        /// Oldest version the client speaks.
        min: u16,
        /// Newest.
        max: u16,
        /// The session's token (from its `HelloOk`).
        token: u64,
    },
    /// On an attached command channel: asks the daemon to carry this channel's commands and
    /// answers in shared memory from now on. The answer comes with the memory's file
    /// descriptor (`SCM_RIGHTS`); see [`crate::shmchan`].
    MapChannel,
    /// On a session's own connection, before its first `GetEvent`: asks the daemon to
    /// write its events and replies for this session into shared memory from now on. The
    /// answer comes with the memory's file descriptor; see [`crate::shmchan`].
    MapEvents,
    /// An operation on an id.
    Call(u32, Op),
}

/// A daemon message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// The session is open.
    HelloOk {
        /// The version chosen.
        version: u16,
        /// The session's secret token (for `MigrateId` from another session).
        token: u64,
        /// The limits that apply.
        limits: Limits,
    },
    /// A command succeeded.
    Ok(Answer),
    /// A command failed.
    Err(WireError),
    /// An event of the id `handle`.
    Event {
        /// The id (for a connect request: the new child id).
        handle: u32,
        /// The event.
        event: WireEvent,
        /// The id's QP attributes at the time of the event, when the daemon sends them
        /// along (the latest state they are valid for is their `qp_state`): the client then
        /// answers `init_qp_attr` for that state or an earlier one itself, until the
        /// connection moves on (see the protocol document, §4.1).
        qp: Option<QpAttr>,
    },
}

/// A successful command's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// An operation's reply.
    Reply(Reply),
    /// A handle (`CreateId`, `MigrateId`).
    Handle(u32),
    /// `DestroyId` done: how many `EVENT` frames the session had been sent when the handle
    /// was removed. Every event of the destroyed id is among them, so once the client has
    /// taken that many, none of them can still be on its way to a new id under the same
    /// handle (the protocol document, §8).
    Released {
        /// Events sent to the session, counted from its start.
        events: u64,
    },
    /// Device addresses.
    Devices(Vec<IpAddr>),
    /// Counters.
    Stats(SessionStats),
}

/// An event as carried on the wire: the rcm event, with ids named by handle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireEvent {
    /// `AddrResolved`.
    AddrResolved,
    /// `AddrError`.
    AddrError(WireError),
    /// `RouteResolved`.
    RouteResolved,
    /// `RouteError`.
    RouteError(WireError),
    /// `ConnectRequest`; the frame's handle is the child's.
    ConnectRequest {
        /// The listener's handle.
        listener: u32,
        /// User private data.
        private_data: Vec<u8>,
        /// What the peer offered.
        param: ConnParam,
        /// SIDR.
        ud: bool,
    },
    /// `ConnectResponse`.
    ConnectResponse {
        /// REP private data.
        private_data: Vec<u8>,
        /// What the peer offered.
        param: ConnParam,
    },
    /// `ConnectError`.
    ConnectError(WireError),
    /// `Unreachable`.
    Unreachable(Unreachable),
    /// `Rejected`.
    Rejected {
        /// REJ reason.
        reason: RejReason,
        /// Private data.
        private_data: Vec<u8>,
    },
    /// `Established`.
    Established {
        /// UD service.
        ud: Option<UdParam>,
        /// SIDR_REP private data.
        private_data: Vec<u8>,
    },
    /// `Disconnected`.
    Disconnected,
    /// `DeviceRemoval`.
    DeviceRemoval,
    /// `TimewaitExit`.
    TimewaitExit,
}

impl WireEvent {
    /// The wire form of an rcm event. `listener` is the listener's handle for a connect
    /// request (the caller maps ids to handles).
    pub fn from_event(ev: Event, listener: u32) -> Self {
        match ev {
            Event::AddrResolved => WireEvent::AddrResolved,
            Event::AddrError(e) => WireEvent::AddrError(e.into()),
            Event::RouteResolved => WireEvent::RouteResolved,
            Event::RouteError(e) => WireEvent::RouteError(e.into()),
            Event::ConnectRequest {
                private_data,
                param,
                ud,
                ..
            } => WireEvent::ConnectRequest {
                listener,
                private_data,
                param,
                ud,
            },
            Event::ConnectResponse {
                private_data,
                param,
            } => WireEvent::ConnectResponse {
                private_data,
                param,
            },
            Event::ConnectError(e) => WireEvent::ConnectError(e.into()),
            Event::Unreachable(u) => WireEvent::Unreachable(u),
            Event::Rejected {
                reason,
                private_data,
            } => WireEvent::Rejected {
                reason,
                private_data,
            },
            Event::Established { ud, private_data } => WireEvent::Established { ud, private_data },
            Event::Disconnected => WireEvent::Disconnected,
            Event::DeviceRemoval => WireEvent::DeviceRemoval,
            Event::TimewaitExit => WireEvent::TimewaitExit,
        }
    }

    /// The rcm event (not for `ConnectRequest`, which needs the listener's id: `None`).
    pub fn into_event(self) -> Option<Event> {
        Some(match self {
            WireEvent::AddrResolved => Event::AddrResolved,
            WireEvent::AddrError(e) => Event::AddrError(e.into_cm()),
            WireEvent::RouteResolved => Event::RouteResolved,
            WireEvent::RouteError(e) => Event::RouteError(e.into_cm()),
            WireEvent::ConnectRequest { .. } => return None,
            WireEvent::ConnectResponse {
                private_data,
                param,
            } => Event::ConnectResponse {
                private_data,
                param,
            },
            WireEvent::ConnectError(e) => Event::ConnectError(e.into_cm()),
            WireEvent::Unreachable(u) => Event::Unreachable(u),
            WireEvent::Rejected {
                reason,
                private_data,
            } => Event::Rejected {
                reason,
                private_data,
            },
            WireEvent::Established { ud, private_data } => Event::Established { ud, private_data },
            WireEvent::Disconnected => Event::Disconnected,
            WireEvent::DeviceRemoval => Event::DeviceRemoval,
            WireEvent::TimewaitExit => Event::TimewaitExit,
        })
    }
}

// ---------------------------------------------------------------------------------------
// Encoding

/// Appends little-endian fields to a frame under construction.
struct W(Vec<u8>);

impl W {
    fn frame(kind: u16, seq: u32) -> Self {
        Self::frame_in(Vec::new(), kind, seq)
    }
    /// A frame written into `v`, whatever it held (its memory is what is reused).
    fn frame_in(mut v: Vec<u8>, kind: u16, seq: u32) -> Self {
        // Room for an event with its QP attributes and private data: grown from less, a
        // burst's events spent ~3 % of the daemon's instructions in reallocation.
        v.clear();
        v.reserve(256);
        v.extend_from_slice(&[0; 4]);
        v.extend_from_slice(&kind.to_le_bytes());
        v.extend_from_slice(&0u16.to_le_bytes());
        v.extend_from_slice(&seq.to_le_bytes());
        W(v)
    }
    fn qp_attr(&mut self, a: &QpAttr) {
        self.u8(a.qp_state.map_or(0, qp_state_code));
        self.u32(a.attr_mask.bits());
        self.u32(a.qp_access_flags.bits());
        self.u16(a.pkey_index);
        self.u8(a.port_num);
        self.u32(a.qkey);
        self.u8(a.path_mtu);
        self.u32(a.dest_qp_num);
        self.u32(a.rq_psn);
        self.u8(a.max_dest_rd_atomic);
        self.u8(a.min_rnr_timer);
        self.0.extend_from_slice(&a.sgid.0);
        self.0.extend_from_slice(&a.dgid.0);
        self.u32(a.flow_label);
        self.u8(a.hop_limit);
        self.u8(a.traffic_class);
        self.u32(a.sq_psn);
        self.u8(a.timeout);
        self.u8(a.retry_cnt);
        self.u8(a.rnr_retry);
        self.u8(a.max_rd_atomic);
    }
    fn finish(mut self) -> Vec<u8> {
        let len = (self.0.len() - 4) as u32;
        self.0[..4].copy_from_slice(&len.to_le_bytes());
        self.0
    }
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bool(&mut self, v: bool) {
        self.u8(u8::from(v));
    }
    /// Bytes with a u16 length (callers bound the length well below 64 KiB).
    fn bytes(&mut self, b: &[u8]) {
        let n = b.len().min(usize::from(u16::MAX));
        self.u16(n as u16);
        self.0.extend_from_slice(&b[..n]);
    }
    /// Text, cut (on a character boundary) to the 1,024 bytes a decoder accepts: a longer
    /// error text would turn the error into an undecodable answer.
    fn str(&mut self, s: &str) {
        let mut end = s.len().min(MAX_TEXT);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.bytes(&s.as_bytes()[..end]);
    }
    fn ip(&mut self, ip: IpAddr) {
        match ip {
            IpAddr::V4(a) => {
                self.u8(4);
                self.0.extend_from_slice(&a.octets());
            }
            IpAddr::V6(a) => {
                self.u8(6);
                self.0.extend_from_slice(&a.octets());
            }
        }
    }
    fn opt_ip(&mut self, ip: Option<IpAddr>) {
        match ip {
            Some(ip) => self.ip(ip),
            None => self.u8(0),
        }
    }
    fn addr(&mut self, a: SocketAddr) {
        self.ip(a.ip());
        self.u16(a.port());
    }
    fn opt_addr(&mut self, a: Option<SocketAddr>) {
        match a {
            Some(a) => self.addr(a),
            None => self.u8(0),
        }
    }
    fn opt_u32(&mut self, v: Option<u32>) {
        match v {
            Some(v) => {
                self.u8(1);
                self.u32(v);
            }
            None => self.u8(0),
        }
    }
    fn param(&mut self, p: &ConnParam) {
        self.u8(p.responder_resources);
        self.u8(p.initiator_depth);
        self.u8(p.retry_count);
        self.u8(p.rnr_retry_count);
        self.bool(p.srq);
        self.u32(p.qpn);
    }
    fn error(&mut self, e: &WireError) {
        match e {
            WireError::Cm(e) => self.cm_error(e),
            WireError::NoSuchId => self.u16(32),
            WireError::BadMessage(s) => {
                self.u16(33);
                self.str(s);
            }
            WireError::Handshake(s) => {
                self.u16(34);
                self.str(s);
            }
            WireError::NoSuchSession => self.u16(35),
        }
    }
    fn cm_error(&mut self, e: &Error) {
        use rcm_proto::ib::CmError;
        match e {
            Error::InvalidState(s) => {
                self.u16(1);
                self.u8(state_code(*s));
            }
            Error::Destroyed => self.u16(2),
            Error::DeviceRemoved => self.u16(3),
            Error::AddrNotAvailable(ip) => {
                self.u16(4);
                self.ip(*ip);
            }
            Error::AddrInUse(a) => {
                self.u16(5);
                self.addr(*a);
            }
            Error::NoPorts => self.u16(6),
            Error::PrivateDataTooLong { len, max } => {
                self.u16(7);
                self.u32(*len as u32);
                self.u32(*max as u32);
            }
            Error::EventsOutstanding(n) => {
                self.u16(8);
                self.u32(*n as u32);
            }
            Error::QpBusy(s) => {
                self.u16(9);
                self.str(s);
            }
            Error::DeviceExists(ip) => {
                self.u16(10);
                self.ip(*ip);
            }
            Error::Io(s) => {
                self.u16(11);
                self.str(s);
            }
            Error::Protocol(p) => {
                self.u16(12);
                match p {
                    CmError::UnknownHandle => self.u8(1),
                    CmError::AddressInUse(sid) => {
                        self.u8(2);
                        self.u64(*sid);
                    }
                    CmError::NoResources => self.u8(3),
                    other => {
                        self.u8(0);
                        self.str(&other.to_string());
                    }
                }
            }
            Error::InvalidArgument(s) => {
                self.u16(13);
                self.str(s);
            }
            Error::LimitExceeded(l) => {
                self.u16(14);
                self.u8(limit_code(*l));
            }
            Error::Remote(s) => {
                self.u16(15);
                self.str(s);
            }
            Error::ShutDown => self.u16(16),
        }
    }
}

fn state_code(s: State) -> u8 {
    match s {
        State::Idle => 0,
        State::AddrQuery => 1,
        State::AddrResolved => 2,
        State::RouteQuery => 3,
        State::RouteResolved => 4,
        State::Connect => 5,
        State::Established => 6,
        State::Disconnect => 7,
        State::AddrBound => 8,
        State::Listen => 9,
        State::DeviceRemoval => 10,
        State::Destroying => 11,
    }
}

fn state_from(v: u8) -> Option<State> {
    Some(match v {
        0 => State::Idle,
        1 => State::AddrQuery,
        2 => State::AddrResolved,
        3 => State::RouteQuery,
        4 => State::RouteResolved,
        5 => State::Connect,
        6 => State::Established,
        7 => State::Disconnect,
        8 => State::AddrBound,
        9 => State::Listen,
        10 => State::DeviceRemoval,
        11 => State::Destroying,
        _ => return None,
    })
}

fn limit_code(l: Limit) -> u8 {
    match l {
        Limit::Ids => 1,
        Limit::QueuedEvents => 2,
        Limit::UnreadRequests => 3,
        Limit::MessageSize => 4,
        Limit::PendingCommands => 5,
        Limit::Channels => 6,
        Limit::SendBuffer => 7,
        Limit::Connections => 8,
    }
}

fn ps_code(ps: PortSpace) -> u8 {
    match ps {
        PortSpace::Ipoib => 1,
        PortSpace::Tcp => 2,
        PortSpace::Udp => 3,
        PortSpace::Ib => 4,
    }
}

fn qp_state_code(s: QpState) -> u8 {
    match s {
        QpState::Init => 1,
        QpState::Rtr => 2,
        QpState::Rts => 3,
    }
}

fn qp_state_from(code: u8) -> Option<QpState> {
    match code {
        1 => Some(QpState::Init),
        2 => Some(QpState::Rtr),
        3 => Some(QpState::Rts),
        _ => None,
    }
}

/// The kind of frame an operation travels in.
pub fn op_kind(op: &Op) -> u16 {
    match op {
        Op::SetReuseaddr(_) => kind::SET_REUSEADDR,
        Op::Bind(_) => kind::BIND,
        Op::ResolveAddr { .. } => kind::RESOLVE_ADDR,
        Op::ResolveRoute => kind::RESOLVE_ROUTE,
        Op::Listen(_) => kind::LISTEN,
        Op::CreateQp => kind::CREATE_QP,
        Op::DestroyQp => kind::DESTROY_QP,
        Op::Connect(_) => kind::CONNECT,
        Op::Accept(_) => kind::ACCEPT,
        Op::Reject(_) => kind::REJECT,
        Op::Establish => kind::ESTABLISH,
        Op::Disconnect => kind::DISCONNECT,
        Op::InitQpAttr(_) => kind::INIT_QP_ATTR,
        Op::Query => kind::QUERY,
        Op::NotifyEstablished => kind::NOTIFY,
    }
}

impl Command {
    /// The frame for this command.
    pub fn encode(&self, seq: u32) -> Vec<u8> {
        let mut w;
        match self {
            Command::Hello { min, max } => {
                w = W::frame(kind::HELLO, seq);
                w.u32(MAGIC);
                w.u16(*min);
                w.u16(*max);
            }
            Command::CreateId(ps) => {
                w = W::frame(kind::CREATE_ID, seq);
                w.u8(ps_code(*ps));
            }
            Command::CreateIdAs(ps, h) => {
                w = W::frame(kind::CREATE_ID, seq);
                w.u8(ps_code(*ps));
                w.u32(*h);
            }
            Command::DestroyId(h) => {
                w = W::frame(kind::DESTROY_ID, seq);
                w.u32(*h);
            }
            Command::BindOrSeal(h, a) => {
                w = W::frame(kind::BIND, seq);
                w.u32(*h);
                w.addr(*a);
                w.u8(BIND_SEALS);
            }
            Command::GetEvent(n) => {
                w = W::frame(kind::GET_EVENT, seq);
                w.u32(*n);
            }
            Command::MigrateId { token, handle } => {
                w = W::frame(kind::MIGRATE_ID, seq);
                w.u64(*token);
                w.u32(*handle);
            }
            Command::Devices => w = W::frame(kind::DEVICES, seq),
            Command::Stats => w = W::frame(kind::STATS, seq),
            Command::MapChannel => w = W::frame(kind::MAP_CHANNEL, seq),
            Command::MapEvents => w = W::frame(kind::MAP_EVENTS, seq),
            Command::Attach { min, max, token } => {
                w = W::frame(kind::ATTACH, seq);
                w.u32(MAGIC);
                w.u16(*min);
                w.u16(*max);
                w.u64(*token);
            }
            Command::Call(h, op) => {
                w = W::frame(op_kind(op), seq);
                w.u32(*h);
                match op {
                    Op::SetReuseaddr(b) => w.bool(*b),
                    Op::Bind(a) => w.addr(*a),
                    Op::ResolveAddr { src, dst } => {
                        w.opt_ip(*src);
                        w.addr(*dst);
                    }
                    Op::Listen(b) => w.u32((*b).min(u32::MAX as usize) as u32),
                    Op::Connect(o) => {
                        w.bytes(&o.private_data);
                        w.u8(o.responder_resources);
                        w.u8(o.initiator_depth);
                        w.u8(o.retry_count);
                        w.u8(o.rnr_retry_count);
                        w.opt_u32(o.qpn);
                    }
                    Op::Accept(o) => {
                        w.bytes(&o.private_data);
                        w.u8(o.responder_resources);
                        w.u8(o.initiator_depth);
                        w.u8(o.rnr_retry_count);
                        w.opt_u32(o.qpn);
                    }
                    Op::Reject(pd) => w.bytes(pd),
                    Op::InitQpAttr(s) => w.u8(qp_state_code(*s)),
                    Op::ResolveRoute
                    | Op::CreateQp
                    | Op::DestroyQp
                    | Op::Establish
                    | Op::NotifyEstablished
                    | Op::Disconnect
                    | Op::Query => {}
                }
            }
        }
        w.finish()
    }
}

impl Message {
    /// The frame for this message.
    pub fn encode(&self, seq: u32) -> Vec<u8> {
        self.encode_in(Vec::new(), seq)
    }

    /// The frame for this message, written into `buf` (cleared first): a daemon encodes its
    /// answers and events into buffers it keeps, not into a new allocation each (~19 a
    /// connection of a burst).
    pub fn encode_in(&self, buf: Vec<u8>, seq: u32) -> Vec<u8> {
        let mut w;
        match self {
            Message::HelloOk {
                version,
                token,
                limits,
            } => {
                w = W::frame_in(buf, kind::HELLO_OK, seq);
                w.u16(*version);
                w.u64(*token);
                w.u32(limits.max_ids);
                w.u32(limits.max_queued_events);
                w.u32(limits.max_unread_requests);
                w.u32(limits.max_message);
            }
            Message::Ok(a) => {
                w = W::frame_in(buf, kind::OK, seq);
                match a {
                    Answer::Reply(Reply::Done) => w.u8(0),
                    Answer::Reply(Reply::Qpn(n)) => {
                        w.u8(1);
                        w.u32(*n);
                    }
                    Answer::Reply(Reply::QpAttr(a)) => {
                        w.u8(2);
                        w.qp_attr(a);
                    }
                    Answer::Reply(Reply::Info(i)) => {
                        w.u8(3);
                        w.u8(state_code(i.state));
                        w.opt_addr(i.local);
                        w.opt_addr(i.peer);
                        w.opt_ip(i.device);
                    }
                    Answer::Handle(h) => {
                        w.u8(4);
                        w.u32(*h);
                    }
                    Answer::Devices(ds) => {
                        w.u8(5);
                        let n = ds.len().min(256);
                        w.u16(n as u16);
                        for d in &ds[..n] {
                            w.ip(*d);
                        }
                    }
                    Answer::Released { events } => {
                        w.u8(7);
                        w.u64(*events);
                    }
                    Answer::Stats(s) => {
                        w.u8(6);
                        for v in [
                            s.ids,
                            s.queued_events,
                            s.dropped_events,
                            s.refused_requests,
                            s.credit,
                            s.commands,
                        ] {
                            w.u64(v);
                        }
                    }
                }
            }
            Message::Err(e) => {
                w = W::frame_in(buf, kind::ERR, seq);
                w.error(e);
            }
            Message::Event { handle, event, qp } => {
                w = W::frame_in(buf, kind::EVENT, seq);
                w.u32(*handle);
                encode_event(&mut w, event);
                // Optional and last: absent, the frame ends with the event.
                if let Some(a) = qp {
                    w.u8(1);
                    w.qp_attr(a);
                }
            }
        }
        w.finish()
    }
}

fn encode_event(w: &mut W, e: &WireEvent) {
    match e {
        WireEvent::AddrResolved => w.u8(1),
        WireEvent::AddrError(err) => {
            w.u8(2);
            w.error(err);
        }
        WireEvent::RouteResolved => w.u8(3),
        WireEvent::RouteError(err) => {
            w.u8(4);
            w.error(err);
        }
        WireEvent::ConnectRequest {
            listener,
            private_data,
            param,
            ud,
        } => {
            w.u8(5);
            w.u32(*listener);
            w.bytes(private_data);
            w.param(param);
            w.bool(*ud);
        }
        WireEvent::ConnectResponse {
            private_data,
            param,
        } => {
            w.u8(6);
            w.bytes(private_data);
            w.param(param);
        }
        WireEvent::ConnectError(err) => {
            w.u8(7);
            w.error(err);
        }
        WireEvent::Unreachable(u) => {
            w.u8(8);
            match u {
                Unreachable::Timeout => w.u8(1),
                Unreachable::RepTimeout => w.u8(2),
                Unreachable::Sidr {
                    status,
                    private_data,
                } => {
                    w.u8(3);
                    w.u8(status.raw());
                    w.bytes(private_data);
                }
            }
        }
        WireEvent::Rejected {
            reason,
            private_data,
        } => {
            w.u8(9);
            w.u16(reason.raw());
            w.bytes(private_data);
        }
        WireEvent::Established { ud, private_data } => {
            w.u8(10);
            match ud {
                Some(u) => {
                    w.u8(1);
                    w.u32(u.qpn);
                    w.u32(u.qkey);
                }
                None => w.u8(0),
            }
            w.bytes(private_data);
        }
        WireEvent::Disconnected => w.u8(11),
        WireEvent::DeviceRemoval => w.u8(12),
        WireEvent::TimewaitExit => w.u8(13),
    }
}

// ---------------------------------------------------------------------------------------
// Decoding

/// Reads fields from a frame body; every read checks the length.
struct R<'a>(&'a [u8]);

type Res<T> = Result<T, ProtoError>;

impl<'a> R<'a> {
    fn take(&mut self, n: usize) -> Res<&'a [u8]> {
        if self.0.len() < n {
            return Err(ProtoError::Truncated);
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Res<u8> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Res<u16> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Res<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Res<u64> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn bool(&mut self) -> Res<bool> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(ProtoError::BadValue("bool")),
        }
    }
    fn bytes(&mut self, max: usize, what: &'static str) -> Res<Vec<u8>> {
        let n = usize::from(self.u16()?);
        if n > max {
            return Err(ProtoError::TooLong { what, len: n, max });
        }
        Ok(self.take(n)?.to_vec())
    }
    fn str(&mut self) -> Res<String> {
        let b = self.bytes(MAX_TEXT, "text")?;
        Ok(String::from_utf8_lossy(&b).into_owned())
    }
    fn ip_of(&mut self, fam: u8) -> Res<IpAddr> {
        match fam {
            4 => {
                let b = self.take(4)?;
                Ok(IpAddr::V4(Ipv4Addr::new(b[0], b[1], b[2], b[3])))
            }
            6 => {
                let mut a = [0u8; 16];
                a.copy_from_slice(self.take(16)?);
                Ok(IpAddr::V6(Ipv6Addr::from(a)))
            }
            _ => Err(ProtoError::BadValue("address family")),
        }
    }
    fn ip(&mut self) -> Res<IpAddr> {
        let f = self.u8()?;
        self.ip_of(f)
    }
    fn opt_ip(&mut self) -> Res<Option<IpAddr>> {
        match self.u8()? {
            0 => Ok(None),
            f => self.ip_of(f).map(Some),
        }
    }
    fn addr(&mut self) -> Res<SocketAddr> {
        let ip = self.ip()?;
        Ok(SocketAddr::new(ip, self.u16()?))
    }
    fn opt_addr(&mut self) -> Res<Option<SocketAddr>> {
        match self.u8()? {
            0 => Ok(None),
            f => {
                let ip = self.ip_of(f)?;
                Ok(Some(SocketAddr::new(ip, self.u16()?)))
            }
        }
    }
    fn opt_u32(&mut self) -> Res<Option<u32>> {
        match self.u8()? {
            0 => Ok(None),
            1 => self.u32().map(Some),
            _ => Err(ProtoError::BadValue("option flag")),
        }
    }
    fn param(&mut self) -> Res<ConnParam> {
        Ok(ConnParam {
            responder_resources: self.u8()?,
            initiator_depth: self.u8()?,
            retry_count: self.u8()?,
            rnr_retry_count: self.u8()?,
            srq: self.bool()?,
            qpn: self.u32()?,
        })
    }
    fn qp_attr(&mut self) -> Res<QpAttr> {
        let qp_state = match self.u8()? {
            0 => None,
            c => Some(qp_state_from(c).ok_or(ProtoError::BadValue("QP state"))?),
        };
        Ok(QpAttr {
            qp_state,
            attr_mask: QpAttrMask::from_bits(self.u32()?),
            qp_access_flags: AccessFlags::from_bits(self.u32()?),
            pkey_index: self.u16()?,
            port_num: self.u8()?,
            qkey: self.u32()?,
            path_mtu: self.u8()?,
            dest_qp_num: self.u32()?,
            rq_psn: self.u32()?,
            max_dest_rd_atomic: self.u8()?,
            min_rnr_timer: self.u8()?,
            sgid: self.gid()?,
            dgid: self.gid()?,
            flow_label: self.u32()?,
            hop_limit: self.u8()?,
            traffic_class: self.u8()?,
            sq_psn: self.u32()?,
            timeout: self.u8()?,
            retry_cnt: self.u8()?,
            rnr_retry: self.u8()?,
            max_rd_atomic: self.u8()?,
        })
    }
    fn gid(&mut self) -> Res<Gid> {
        let mut a = [0u8; 16];
        a.copy_from_slice(self.take(16)?);
        Ok(Gid(a))
    }
    fn error(&mut self) -> Res<WireError> {
        use rcm_proto::ib::CmError;
        let code = self.u16()?;
        let cm = match code {
            1 => Error::InvalidState(state_from(self.u8()?).ok_or(ProtoError::BadValue("state"))?),
            2 => Error::Destroyed,
            3 => Error::DeviceRemoved,
            4 => Error::AddrNotAvailable(self.ip()?),
            5 => Error::AddrInUse(self.addr()?),
            6 => Error::NoPorts,
            7 => Error::PrivateDataTooLong {
                len: self.u32()? as usize,
                max: self.u32()? as usize,
            },
            8 => Error::EventsOutstanding(self.u32()? as usize),
            9 => Error::QpBusy(Cow::Owned(self.str()?)),
            10 => Error::DeviceExists(self.ip()?),
            11 => Error::Io(self.str()?),
            12 => Error::Protocol(match self.u8()? {
                1 => CmError::UnknownHandle,
                2 => CmError::AddressInUse(self.u64()?),
                3 => CmError::NoResources,
                0 => return Ok(WireError::Cm(Error::Remote(self.str()?))),
                _ => return Err(ProtoError::BadValue("protocol error")),
            }),
            13 => Error::InvalidArgument(Cow::Owned(self.str()?)),
            14 => Error::LimitExceeded(match self.u8()? {
                1 => Limit::Ids,
                2 => Limit::QueuedEvents,
                3 => Limit::UnreadRequests,
                4 => Limit::MessageSize,
                5 => Limit::PendingCommands,
                6 => Limit::Channels,
                7 => Limit::SendBuffer,
                8 => Limit::Connections,
                _ => return Err(ProtoError::BadValue("limit")),
            }),
            15 => Error::Remote(self.str()?),
            16 => Error::ShutDown,
            32 => return Ok(WireError::NoSuchId),
            33 => return Ok(WireError::BadMessage(self.str()?)),
            34 => return Ok(WireError::Handshake(self.str()?)),
            35 => return Ok(WireError::NoSuchSession),
            _ => return Err(ProtoError::BadValue("error code")),
        };
        Ok(WireError::Cm(cm))
    }
    fn end(&self) -> Res<()> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(ProtoError::Trailing(self.0.len()))
        }
    }
}

/// A frame's header fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Bytes after the length field (header rest + body).
    pub len: u32,
    /// Message kind.
    pub kind: u16,
    /// Flags (0).
    pub flags: u16,
    /// Sequence number.
    pub seq: u32,
}

impl Header {
    /// Parses the 12 header bytes. `len` below 8 is refused.
    pub fn parse(b: &[u8; 12]) -> Result<Self, ProtoError> {
        let h = Header {
            len: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            kind: u16::from_le_bytes([b[4], b[5]]),
            flags: u16::from_le_bytes([b[6], b[7]]),
            seq: u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
        };
        if (h.len as usize) < HEADER_LEN {
            return Err(ProtoError::BadValue("frame length"));
        }
        Ok(h)
    }

    /// Body bytes that follow the header.
    pub fn body_len(&self) -> usize {
        self.len as usize - HEADER_LEN
    }

    /// The whole frame's length, the length word's four bytes included; saturating, so
    /// that a length near 4 GiB cannot wrap where `usize` is 32 bits (no frame is that
    /// long, and every limit refuses it).
    pub fn frame_len(&self) -> usize {
        (self.len as usize).saturating_add(4)
    }
}

/// Decodes a command body of frame kind `kind`.
pub fn decode_command(kind: u16, body: &[u8]) -> Result<Command, ProtoError> {
    let mut r = R(body);
    let c = match kind {
        kind::HELLO => {
            if r.u32()? != MAGIC {
                return Err(ProtoError::BadValue("magic"));
            }
            Command::Hello {
                min: r.u16()?,
                max: r.u16()?,
            }
        }
        kind::CREATE_ID => {
            let ps = match r.u8()? {
                1 => PortSpace::Ipoib,
                2 => PortSpace::Tcp,
                3 => PortSpace::Udp,
                4 => PortSpace::Ib,
                _ => return Err(ProtoError::BadValue("port space")),
            };
            // The handle is optional: a body of the port space alone lets the daemon choose.
            if r.0.is_empty() {
                Command::CreateId(ps)
            } else {
                Command::CreateIdAs(ps, r.u32()?)
            }
        }
        kind::DESTROY_ID => Command::DestroyId(r.u32()?),
        kind::GET_EVENT => Command::GetEvent(r.u32()?),
        kind::MIGRATE_ID => Command::MigrateId {
            token: r.u64()?,
            handle: r.u32()?,
        },
        kind::DEVICES => Command::Devices,
        kind::STATS => Command::Stats,
        kind::MAP_CHANNEL => Command::MapChannel,
        kind::MAP_EVENTS => Command::MapEvents,
        kind::ATTACH => {
            if r.u32()? != MAGIC {
                return Err(ProtoError::BadValue("magic"));
            }
            Command::Attach {
                min: r.u16()?,
                max: r.u16()?,
                token: r.u64()?,
            }
        }
        k @ kind::SET_REUSEADDR..=kind::NOTIFY => {
            let h = r.u32()?;
            let op = match k {
                kind::SET_REUSEADDR => Op::SetReuseaddr(r.bool()?),
                kind::BIND => {
                    let a = r.addr()?;
                    // The seal flag is optional: without it a refused bind changes nothing.
                    if r.0.is_empty() {
                        Op::Bind(a)
                    } else if r.u8()? == BIND_SEALS {
                        r.end()?;
                        return Ok(Command::BindOrSeal(h, a));
                    } else {
                        return Err(ProtoError::BadValue("bind flags"));
                    }
                }
                kind::RESOLVE_ADDR => Op::ResolveAddr {
                    src: r.opt_ip()?,
                    dst: r.addr()?,
                },
                kind::RESOLVE_ROUTE => Op::ResolveRoute,
                kind::LISTEN => Op::Listen(r.u32()? as usize),
                kind::CREATE_QP => Op::CreateQp,
                kind::DESTROY_QP => Op::DestroyQp,
                kind::CONNECT => Op::Connect(ConnectOptions {
                    private_data: r.bytes(MAX_PRIVATE_DATA, "private data")?,
                    responder_resources: r.u8()?,
                    initiator_depth: r.u8()?,
                    retry_count: r.u8()?,
                    rnr_retry_count: r.u8()?,
                    qpn: r.opt_u32()?,
                }),
                kind::ACCEPT => Op::Accept(AcceptOptions {
                    private_data: r.bytes(MAX_PRIVATE_DATA, "private data")?,
                    responder_resources: r.u8()?,
                    initiator_depth: r.u8()?,
                    rnr_retry_count: r.u8()?,
                    qpn: r.opt_u32()?,
                }),
                kind::REJECT => Op::Reject(r.bytes(MAX_PRIVATE_DATA, "private data")?),
                kind::ESTABLISH => Op::Establish,
                kind::NOTIFY => Op::NotifyEstablished,
                kind::DISCONNECT => Op::Disconnect,
                kind::INIT_QP_ATTR => {
                    Op::InitQpAttr(qp_state_from(r.u8()?).ok_or(ProtoError::BadValue("QP state"))?)
                }
                _ => Op::Query,
            };
            Command::Call(h, op)
        }
        k => return Err(ProtoError::UnknownKind(k)),
    };
    r.end()?;
    Ok(c)
}

/// Decodes a daemon message body of frame kind `kind`.
pub fn decode_message(kind: u16, body: &[u8]) -> Result<Message, ProtoError> {
    let mut r = R(body);
    let m = match kind {
        kind::HELLO_OK => Message::HelloOk {
            version: r.u16()?,
            token: r.u64()?,
            limits: Limits {
                max_ids: r.u32()?,
                max_queued_events: r.u32()?,
                max_unread_requests: r.u32()?,
                max_message: r.u32()?,
            },
        },
        kind::OK => Message::Ok(match r.u8()? {
            0 => Answer::Reply(Reply::Done),
            1 => Answer::Reply(Reply::Qpn(r.u32()?)),
            2 => Answer::Reply(Reply::QpAttr(r.qp_attr()?)),
            3 => Answer::Reply(Reply::Info(IdInfo {
                state: state_from(r.u8()?).ok_or(ProtoError::BadValue("state"))?,
                local: r.opt_addr()?,
                peer: r.opt_addr()?,
                device: r.opt_ip()?,
            })),
            4 => Answer::Handle(r.u32()?),
            5 => {
                let n = r.u16()?;
                if n > 256 {
                    return Err(ProtoError::TooLong {
                        what: "device list",
                        len: n as usize,
                        max: 256,
                    });
                }
                let mut v = Vec::with_capacity(usize::from(n));
                for _ in 0..n {
                    v.push(r.ip()?);
                }
                Answer::Devices(v)
            }
            6 => Answer::Stats(SessionStats {
                ids: r.u64()?,
                queued_events: r.u64()?,
                dropped_events: r.u64()?,
                refused_requests: r.u64()?,
                credit: r.u64()?,
                commands: r.u64()?,
            }),
            7 => Answer::Released { events: r.u64()? },
            _ => return Err(ProtoError::BadValue("answer")),
        }),
        kind::ERR => Message::Err(r.error()?),
        kind::EVENT => {
            let handle = r.u32()?;
            let event = match r.u8()? {
                1 => WireEvent::AddrResolved,
                2 => WireEvent::AddrError(r.error()?),
                3 => WireEvent::RouteResolved,
                4 => WireEvent::RouteError(r.error()?),
                5 => WireEvent::ConnectRequest {
                    listener: r.u32()?,
                    private_data: r.bytes(MAX_PRIVATE_DATA, "private data")?,
                    param: r.param()?,
                    ud: r.bool()?,
                },
                6 => WireEvent::ConnectResponse {
                    private_data: r.bytes(MAX_PRIVATE_DATA, "private data")?,
                    param: r.param()?,
                },
                7 => WireEvent::ConnectError(r.error()?),
                8 => WireEvent::Unreachable(match r.u8()? {
                    1 => Unreachable::Timeout,
                    2 => Unreachable::RepTimeout,
                    3 => Unreachable::Sidr {
                        status: match SidrStatus::from_raw_value(r.u8()?) {
                            // A success is Established, never Unreachable.
                            SidrStatus::Success => {
                                return Err(ProtoError::BadValue("unreachable SIDR status"))
                            }
                            s => s,
                        },
                        private_data: r.bytes(MAX_PRIVATE_DATA, "private data")?,
                    },
                    _ => return Err(ProtoError::BadValue("unreachable kind")),
                }),
                9 => WireEvent::Rejected {
                    reason: RejReason::from_raw_value(r.u16()?),
                    private_data: r.bytes(MAX_PRIVATE_DATA, "private data")?,
                },
                10 => {
                    let ud = match r.u8()? {
                        0 => None,
                        1 => Some(UdParam {
                            qpn: r.u32()?,
                            qkey: r.u32()?,
                        }),
                        _ => return Err(ProtoError::BadValue("option flag")),
                    };
                    WireEvent::Established {
                        ud,
                        private_data: r.bytes(MAX_PRIVATE_DATA, "private data")?,
                    }
                }
                11 => WireEvent::Disconnected,
                12 => WireEvent::DeviceRemoval,
                13 => WireEvent::TimewaitExit,
                _ => return Err(ProtoError::BadValue("event type")),
            };
            let qp = if r.0.is_empty() {
                None
            } else {
                match r.u8()? {
                    1 => Some(r.qp_attr()?),
                    _ => return Err(ProtoError::BadValue("QP attribute flag")),
                }
            };
            Message::Event { handle, event, qp }
        }
        k => return Err(ProtoError::UnknownKind(k)),
    };
    r.end()?;
    Ok(m)
}

/// Splits a whole frame into header and body (for tests and tools holding complete frames).
pub fn split_frame(frame: &[u8]) -> Result<(Header, &[u8]), ProtoError> {
    let Some(hb) = frame.get(..12) else {
        return Err(ProtoError::Truncated);
    };
    let mut a = [0u8; 12];
    a.copy_from_slice(hb);
    let h = Header::parse(&a)?;
    let body = frame.get(12..h.frame_len()).ok_or(ProtoError::Truncated)?;
    if frame.len() != h.frame_len() {
        return Err(ProtoError::Trailing(frame.len() - h.frame_len()));
    }
    Ok((h, body))
}
