//! The iWARP engine's vocabulary: states, configuration, command parameters, events, errors.

use rcm_wire::mpa::Terminate;
use rcm_wire::WireError;
use std::time::Duration;

/// The iw_cm connection states (Linux `enum iw_cm_state`, `iwcm.h`).
///
/// A [`super::Cep`] walks a subset of them:
///
/// - active: `Idle` → `ConnSent` (`connect`) → `Established` (accepting Reply) → `Closing`
///   (`disconnect`) → `Idle` (stream closed); or `ConnSent` → `Idle` on a reject or error;
/// - passive: `Idle` (waiting for the MPA Request; siw's AWAIT_MPAREQ, no iw_cm id exists yet)
///   → `ConnRecv` (Request received, user asked) → `Established` (Reply queued; in peer-to-peer
///   mode only once the initiator's RTR frame has arrived) → `Closing` → `Idle`; or
///   `ConnRecv` → `Idle` on `reject`;
/// - any state → `Destroying` on `destroy`.
///
/// `Listen` belongs to a listening iw_cm id, not to a connection: accepting TCP streams is the
/// device's job, and it hands each accepted stream to a new passive `Cep`. The variant exists
/// so that the enum names every iw_cm state; a `Cep` never enters it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    /// Unconnected: before `connect`, a passive endpoint still waiting for the MPA Request, or
    /// a connection that has ended (see [`super::Cep::is_closed`]).
    Idle,
    /// A listening id. Never taken by a `Cep` (see above).
    Listen,
    /// Passive: the MPA Request was received and reported; `accept` or `reject` is awaited
    /// (and, after a peer-to-peer `accept`, the initiator's RTR frame).
    ConnRecv,
    /// Active: the MPA Request was sent; the Reply is awaited.
    ConnSent,
    /// MPA exchange done: FPDUs flow both ways.
    Established,
    /// Local graceful disconnect in progress: our write side is shut, the peer's FIN is awaited.
    Closing,
    /// Destroyed: no further event, every input ignored.
    Destroying,
}

/// Which end of the TCP stream this endpoint is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Opened the TCP connection; sends the MPA Request (the MPA "Initiator").
    Active,
    /// Accepted the TCP connection from a listener; answers with the MPA Reply (the "Responder").
    Passive,
}

/// Timers and limits of one endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CepConfig {
    /// Passive: how long after the TCP accept the MPA Request may take to arrive. siw's
    /// `MPAREP_TIMEOUT`, 5 s (siw_cm.h: "responder waits 5 s for the MPA request").
    pub mpa_request_timeout: Duration,
    /// Active: how long after the Request the MPA Reply may take. siw's `MPAREQ_TIMEOUT`, 10 s
    /// (siw arms it in AWAIT_MPAREP; the capture `e2-mpa-timeout` shows the FIN 10 s after the
    /// Request).
    pub mpa_reply_timeout: Duration,
    /// Passive, peer-to-peer mode: how long after our Reply the initiator's RTR frame may take.
    /// siw has no such timer (a silent initiator holds the endpoint until TCP dies); ours makes
    /// sure the endpoint cannot hang. 10 s.
    pub rtr_timeout: Duration,
    /// After a local `disconnect`: how long the peer's FIN may take before the stream is reset.
    /// Not a Linux value (siw releases the socket at once and lets TCP finish); 10 s.
    pub close_timeout: Duration,
    /// The largest IRD this device supports (siw `SIW_MAX_IRD_QP`, 128).
    pub max_ird: u16,
    /// The largest ORD this device supports (siw `SIW_MAX_ORD_QP`, 128).
    pub max_ord: u16,
    /// Passive: the highest MPA revision we answer with. 2 (RFC 6581) answers a revision-2
    /// Request in kind, as siw does; 1 makes us a pure RFC 5044 responder that answers every
    /// Request with a revision-1 Reply.
    pub max_revision: u8,
    /// Active: accept a revision-1 Reply to our revision-2 Request (the responder does not
    /// implement RFC 6581), continuing without IRD/ORD negotiation or RTR. cxgb4 accepts any
    /// Reply revision up to its own; siw refuses (CONNECT_REPLY -ECONNRESET). Default: accept.
    pub accept_v1_reply: bool,
    /// Largest Send payload put in one FPDU; longer messages are split into DDP segments
    /// (same MSN, increasing MO, L on the last). Default 1436: one FPDU per 1460-byte TCP
    /// segment, as RFC 5044 aligns FPDUs with the MSS.
    pub max_send_segment: usize,
    /// Largest received message reassembled; a longer one is answered with a Terminate
    /// (DDP untagged buffer error, "message too long"). Default 1 MiB.
    pub max_recv_message: usize,
    /// Receive buffers: how many received messages may wait for the application
    /// ([`Cep::messages_taken`](super::Cep::messages_taken)). A Send arriving when all are
    /// taken ends the stream with a Terminate (DDP untagged buffer error, "no buffer
    /// available"), as siw does without a posted receive. Default 1024 (at most 1 GiB held
    /// with the default `max_recv_message`; lower both to hold less). 0 counts as 1.
    pub recv_queue: usize,
    /// Bytes of received messages that may wait for the application, the one being
    /// reassembled included (never less than `max_recv_message`). A segment that would take
    /// them past it ends the stream like a Send without a buffer. Default 4 MiB: with
    /// `recv_queue` alone a peer could make one connection hold 1,024 messages of 1 MiB.
    pub recv_bytes: usize,
    /// Passive, without peer-to-peer mode: how long our FPDUs wait for the initiator's
    /// first FPDU. RFC 5044 has the initiator send first (rdma_connect(3): "the active side
    /// must send the first message" on iWARP), and siw as initiator holds to it: it reads
    /// the Reply's private data and 4 bytes more, and bytes there fail the connection
    /// (`siw_recv_mpa_rr` -EPROTO, the application sees CONNECT_ERROR -EINVAL; seen in the
    /// interop VM when our first FPDU followed the Reply within ms). Our FPDUs go out when
    /// the initiator's first arrives, or after this long for initiators that wait to
    /// receive first (ucmatose's client does, relying on siw's own responder not holding).
    /// Default 50 ms; zero sends at once.
    pub responder_hold: Duration,
}

impl Default for CepConfig {
    fn default() -> Self {
        CepConfig {
            mpa_request_timeout: Duration::from_secs(5),
            mpa_reply_timeout: Duration::from_secs(10),
            rtr_timeout: Duration::from_secs(10),
            close_timeout: Duration::from_secs(10),
            max_ird: 128,
            max_ord: 128,
            max_revision: 2,
            accept_v1_reply: true,
            max_send_segment: 1436,
            max_recv_message: 1 << 20,
            recv_queue: 1024,
            recv_bytes: 4 << 20,
            responder_hold: Duration::from_millis(50),
        }
    }
}

/// The MPA revision asked for by the initiator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MpaVersion {
    /// RFC 5044: no IRD/ORD words, no peer-to-peer RTR.
    V1,
    /// RFC 6581 enhanced connection establishment: IRD/ORD and optional peer-to-peer mode.
    V2,
}

/// Which zero-length operations may serve as the ready-to-receive (RTR) frame in RFC 6581
/// peer-to-peer mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RtrModes {
    /// A zero-length Send (needs a posted receive at the responder; siw does not offer it).
    pub send: bool,
    /// A zero-length RDMA Write (siw's preference).
    pub write: bool,
    /// A zero-length RDMA Read.
    pub read: bool,
}

impl RtrModes {
    /// What siw offers when its `peer_to_peer` parameter is on: Write or Read.
    pub const SIW: RtrModes = RtrModes {
        send: false,
        write: true,
        read: true,
    };

    /// Whether no mode is set.
    pub const fn is_empty(self) -> bool {
        !self.send && !self.write && !self.read
    }

    /// Whether `kind` is among the modes.
    pub const fn contains(self, kind: RtrKind) -> bool {
        match kind {
            RtrKind::Send => self.send,
            RtrKind::Write => self.write,
            RtrKind::Read => self.read,
        }
    }
}

/// The one RTR operation the responder picked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RtrKind {
    /// Zero-length Send (queue 0).
    Send,
    /// Zero-length tagged RDMA Write (siw sends STag 1, offset 0).
    Write,
    /// Zero-length RDMA Read Request (queue 1); the responder answers with a zero-length Read
    /// Response.
    Read,
}

/// What the active side asks for (`iw_cm_connect`'s `iw_cm_conn_param`, plus siw's module
/// parameters, which are per connection here).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectParams {
    /// MPA revision of the Request.
    pub version: MpaVersion,
    /// Our inbound RDMA Read depth (sent in a revision-2 Request).
    pub ird: u16,
    /// Our outbound RDMA Read depth (sent in a revision-2 Request).
    pub ord: u16,
    /// Revision 2 only: request peer-to-peer mode, offering these RTR operations (siw sets
    /// Write | Read). Ignored for revision 1.
    pub p2p: Option<RtrModes>,
    /// Set the C flag: ask for CRC-32C on every FPDU.
    pub crc: bool,
    /// Private data: at most 256 bytes in revision 1, 252 in revision 2 (the IRD/ORD words
    /// count against Linux's 256-byte limit).
    pub private_data: Vec<u8>,
}

impl Default for ConnectParams {
    /// What siw sends by default: revision 2, IRD = ORD = 1, no peer-to-peer, no CRC.
    fn default() -> Self {
        ConnectParams {
            version: MpaVersion::V2,
            ird: 1,
            ord: 1,
            p2p: None,
            crc: false,
            private_data: Vec::new(),
        }
    }
}

/// What the passive side answers with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcceptParams {
    /// Our IRD. With relaxed negotiation (siw's default) it is raised to the initiator's ORD
    /// when lower and the device allows it.
    pub ird: u16,
    /// Our ORD. It is lowered to the initiator's IRD when higher.
    pub ord: u16,
    /// Set the C flag in the Reply (CRC is then used even if the initiator did not ask).
    pub crc: bool,
    /// Private data: at most 256 bytes in a revision-1 Reply, 252 in revision 2.
    pub private_data: Vec<u8>,
}

impl Default for AcceptParams {
    fn default() -> Self {
        AcceptParams {
            ird: 1,
            ord: 1,
            crc: false,
            private_data: Vec::new(),
        }
    }
}

/// What the initiator's MPA Request asked for (passive side, `IW_CM_EVENT_CONNECT_REQUEST`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectRequest {
    /// MPA revision of the Request (1 or 2).
    pub revision: u8,
    /// Whether the Request carried the RFC 6581 IRD/ORD words.
    pub enhanced: bool,
    /// The initiator's IRD (revision 2 enhanced only).
    pub ird: Option<u16>,
    /// The initiator's ORD (revision 2 enhanced only).
    pub ord: Option<u16>,
    /// The RTR operations offered, if the initiator asked for peer-to-peer mode.
    pub p2p: Option<RtrModes>,
    /// The C flag of the Request.
    pub crc: bool,
    /// The user's private data (after the IRD/ORD words).
    pub private_data: Vec<u8>,
}

/// What both ends agreed on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    /// MPA revision in use.
    pub revision: u8,
    /// Whether the RFC 6581 IRD/ORD exchange took place.
    pub enhanced: bool,
    /// CRC-32C on every FPDU (either side set C: RFC 5044 §7.1, "page 27" as siw cites it).
    pub crc: bool,
    /// Our inbound RDMA Read depth.
    pub ird: u16,
    /// Our outbound RDMA Read depth.
    pub ord: u16,
    /// The RTR operation of peer-to-peer mode, if in use.
    pub rtr: Option<RtrKind>,
    /// The peer's private data (Reply's for the initiator, Request's for the responder).
    pub private_data: Vec<u8>,
}

/// Why the MPA exchange failed on the active side (`IW_CM_EVENT_CONNECT_REPLY` with a non-zero
/// status).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectError {
    /// No Reply within [`CepConfig::mpa_reply_timeout`] (-ETIMEDOUT).
    Timeout,
    /// The peer closed the stream (FIN) before replying (siw: -ECONNRESET).
    PeerClosed,
    /// The stream was reset before the Reply.
    Reset,
    /// The Reply broke the protocol (-EPROTO).
    Protocol(ProtocolError),
}

/// The answer to our MPA Request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectReply {
    /// Accepted: the endpoint is established (rdma_cm reports ESTABLISHED on this).
    Accepted(Negotiated),
    /// The responder set R (a reject), with its private data.
    Rejected {
        /// Revision of the Reply.
        revision: u8,
        /// The user's private data (after the IRD/ORD words, if any).
        private_data: Vec<u8>,
    },
    /// The exchange failed.
    Error(ConnectError),
}

/// A broken protocol rule, in the MPA exchange or in the FPDU stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProtocolError {
    /// The frame does not start with the key this side expects.
    BadKey,
    /// An MPA revision other than 1 or 2.
    BadRevision(u8),
    /// PD_Length over Linux's 256-byte limit (IRD/ORD words included).
    PrivateDataTooLong {
        /// PD_Length as sent.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The frame is otherwise malformed (R on a Request, enhanced frame shorter than 4, …).
    Malformed(WireError),
    /// The peer wants markers, which we never insert (siw rejects them too).
    MarkersRequested,
    /// The initiator asked for revision 2 but the Reply was revision 1 and
    /// [`CepConfig::accept_v1_reply`] is off, or the Reply dropped the Enhanced flag; or
    /// the Reply's revision is above the Request's (siw would read a revision-2 Reply to
    /// its revision-1 Request as revision 1; no responder sends one).
    RevisionMismatch,
    /// The responder's ORD exceeds what our IRD can take (Terminate: insufficient IRD).
    InsufficientIrd,
    /// The RTR operation picked (or sent) is not one that was agreed (Terminate: no matching
    /// RTR).
    NoMatchingRtr,
    /// Bytes arrived where the peer must not send any (before our Reply, or after its own
    /// Terminate).
    UnexpectedData,
    /// The stream ended in the middle of a frame.
    Truncated,
    /// An FPDU's CRC-32C did not match.
    BadCrc,
    /// A DDP or RDMAP header we cannot accept; the Terminate we sent says which.
    BadHeader {
        /// Terminate layer (`rcm_wire::mpa::term_layer`).
        layer: u8,
        /// Terminate error type.
        error_type: u8,
        /// Terminate error code.
        error_code: u8,
    },
}

/// Why an endpoint's connection ended (`IW_CM_EVENT_CLOSE` and what preceded it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CloseReason {
    /// Orderly: both FINs exchanged (or the peer's FIN answered).
    Graceful,
    /// The peer reset the stream, or TCP failed.
    Reset,
    /// We aborted (`abort`).
    Aborted,
    /// A timer ran out: the MPA Request or the RTR never came, or the peer never answered our
    /// FIN.
    Timeout,
    /// The peer broke the protocol; we sent a Terminate where one applies.
    Protocol(ProtocolError),
    /// The peer sent a Terminate.
    PeerTerminated(Terminate),
    /// We sent a Terminate on the caller's request (`terminate`).
    LocalTerminate,
}

/// What the engine reports, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Passive: a valid MPA Request arrived; answer with `accept` or `reject`.
    ConnectRequest(ConnectRequest),
    /// Active: the end of the MPA exchange. After anything but `Accepted` nothing follows.
    ConnectReply(ConnectReply),
    /// Passive: the connection is established (our Reply is queued; in peer-to-peer mode, the
    /// RTR has arrived).
    Established(Negotiated),
    /// The peer closed its side (FIN) of an established connection; a `Close` follows.
    Disconnect,
    /// The connection is over. Nothing follows.
    Close(CloseReason),
    /// A Send message arrived (all its segments reassembled).
    Message(Vec<u8>),
}

/// What the caller must do with the TCP socket, after writing every pending transmit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TcpAction {
    /// Shut down the write side (FIN) but keep reading: a graceful disconnect is under way.
    Shutdown,
    /// Close the socket (FIN). Terminal: the endpoint takes no more input.
    Close,
    /// Reset the connection (RST, e.g. `SO_LINGER` 0), discarding unsent data. Terminal.
    Reset,
}

/// Why a command was refused. A refused command changes nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CepError {
    /// The command does not apply in this state.
    #[error("invalid in state {0:?}")]
    InvalidState(State),
    /// The command belongs to the other role (`connect` on a passive endpoint, say).
    #[error("not valid for a {0:?} endpoint")]
    WrongRole(Role),
    /// Private data over the limit (256 bytes, 252 with the revision-2 IRD/ORD words).
    #[error("private data too long: {len} bytes, at most {max}")]
    PrivateDataTooLong {
        /// Bytes given.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// IRD or ORD over the device limit or the 14-bit field.
    #[error("IRD/ORD {value} over the limit {max}")]
    IrdOrdTooLarge {
        /// The value given.
        value: u16,
        /// The limit.
        max: u16,
    },
    /// Peer-to-peer mode asked with no RTR operation.
    #[error("peer-to-peer mode needs at least one RTR operation")]
    NoRtrMode,
    /// A message longer than DDP's 32-bit offsets allow.
    #[error("message too long: {0} bytes")]
    MessageTooLong(usize),
    /// The encoder refused a value.
    #[error(transparent)]
    Wire(#[from] WireError),
}
