//! rdma_cm events (`enum rdma_cm_event_type`, multicast ones aside).

use crate::id::CmId;
use rcm_wire::cm::{RejReason, SidrStatus};

/// Connection parameters a peer offered (CONNECT_REQUEST / CONNECT_RESPONSE).
///
/// The RDMA read resources are given from this side's point of view, as Linux's rdma_cm
/// gives them (`cm_format_req_event` and `cm_format_rep_event` in cm.c swap the two
/// fields; so do siw and cma.c for an MPA request): `initiator_depth` is what the peer can
/// answer (its responder resources, or IRD, on the wire) and `responder_resources` what it
/// may ask of us (its initiator depth, or ORD). They are thus the most this side should
/// use in its own [`crate::AcceptOptions`] or QP attributes, and can be passed on as they
/// are.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConnParam {
    /// RDMA reads the peer may have outstanding at us: the peer's initiator depth (ORD).
    pub responder_resources: u8,
    /// RDMA reads we may have outstanding at the peer: the peer's responder resources (IRD).
    pub initiator_depth: u8,
    /// Retry count.
    pub retry_count: u8,
    /// RNR retry count.
    pub rnr_retry_count: u8,
    /// Whether the peer uses an SRQ.
    pub srq: bool,
    /// The peer's QP number.
    pub qpn: u32,
}

/// The parameters of a resolved UD service (SIDR): where to send datagrams.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UdParam {
    /// The remote UD QPN.
    pub qpn: u32,
    /// Its Q_Key.
    pub qkey: u32,
}

/// A UD datagram received for a UD id (see [`CmId::recv_ud`]): a RoCEv2 UD SEND Only, with or
/// without immediate data, whose destination QPN is the id's and whose Q_Key is rdma_cm's
/// (`RDMA_UDP_QKEY`, 0x01234567).
///
/// Its ICRC was **not** verified: a UDP socket cannot see the IPv4 Identification field the
/// ICRC covers (rxe sends nonzero IDs), so the datagram is accepted as the UDP layer gives it.
///
/// [`CmId::recv_ud`]: crate::CmId::recv_ud
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UdMessage {
    /// The sender's IP address.
    pub src: std::net::IpAddr,
    /// The sender's QPN (the DETH source QP).
    pub src_qpn: u32,
    /// The immediate data (BTH opcode 0x65, UD SEND Only with Immediate), as the 32-bit value
    /// carried big-endian on the wire; `None` for a plain SEND Only (0x64). rdma-core's
    /// `udaddy` puts its own QPN here and its server answers to the QPN it finds here.
    pub imm: Option<u32>,
    /// The payload (pad bytes removed).
    pub payload: Vec<u8>,
}

/// Why a connection attempt failed without a REJ from the peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unreachable {
    /// The REQ (or SIDR_REQ) was never answered.
    Timeout,
    /// The REP was never confirmed by an RTU.
    RepTimeout,
    /// SIDR: the peer answered with a SIDR_REP whose status is not success. Linux's
    /// `cma_sidr_rep_handler` reports every such answer as RDMA_CM_EVENT_UNREACHABLE with
    /// `status` the SIDR status, never as REJECTED: `UnsupportedServiceId` (1) when nobody
    /// serves that port, `Rejected` (2) for the server's `reject` on its UD child (with the
    /// reject's private data), and so on.
    Sidr {
        /// The SIDR_REP's status (IBTA table 121).
        status: SidrStatus,
        /// The SIDR_REP's private data (136 bytes).
        private_data: Vec<u8>,
    },
}

impl std::fmt::Display for Unreachable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unreachable::Timeout => f.write_str("Timeout (no answer)"),
            Unreachable::RepTimeout => f.write_str("RepTimeout (the REP was never confirmed)"),
            Unreachable::Sidr { status, .. } => {
                write!(f, "SIDR status {} ({status:?})", status.raw())
            }
        }
    }
}

/// One rdma_cm event.
#[derive(Debug)]
pub enum Event {
    /// `resolve_addr` completed: a local device reaches the destination.
    AddrResolved,
    /// `resolve_addr` failed.
    AddrError(crate::Error),
    /// `resolve_route` completed.
    RouteResolved,
    /// `resolve_route` failed.
    RouteError(crate::Error),
    /// A peer wants to connect. Delivered on the new child id (with the listener's handler or
    /// channel); accept, reject or destroy it. Returning `Flow::Destroy` rejects it.
    ConnectRequest {
        /// The listener the request arrived on.
        listener: CmId,
        /// The user private data (the whole area: 56 bytes for a REQ, 180 for SIDR_REQ; on
        /// iWARP exactly what the MPA Request carried).
        private_data: Vec<u8>,
        /// What the peer offered.
        param: ConnParam,
        /// Whether this is a UD (SIDR) request.
        ud: bool,
    },
    /// The peer accepted (REP); with no QP attached, call `establish` to send the RTU.
    ConnectResponse {
        /// The REP's private data (196 bytes).
        private_data: Vec<u8>,
        /// What the peer offered.
        param: ConnParam,
    },
    /// Establishing failed locally.
    ConnectError(crate::Error),
    /// The peer did not answer.
    Unreachable(Unreachable),
    /// The peer rejected. On iWARP: an MPA Reply with R set, or the stream closed before
    /// the Reply, gives reason 28 (consumer reject) with the Reply's private data; a refused
    /// TCP connect (nobody listens on the port) gives 8 (invalid service ID), what a RoCE
    /// peer without a listener answers.
    Rejected {
        /// The IB reject reason (28 = consumer reject).
        reason: RejReason,
        /// The REJ's private data (148 bytes) or SIDR_REP's (136).
        private_data: Vec<u8>,
    },
    /// The connection is up (for UD: the service is resolved).
    Established {
        /// UD only: where to send.
        ud: Option<UdParam>,
        /// UD: the SIDR_REP private data. iWARP active side: the MPA Reply's private data,
        /// exactly as sent (iWARP has no `ConnectResponse`: the Reply establishes, as the
        /// iw_cm's CONNECT_REPLY becomes rdma_cm's ESTABLISHED). RoCE active side with a QP
        /// attached: the REP's (its ESTABLISHED replaces `ConnectResponse`, as Linux's
        /// does). Otherwise empty.
        private_data: Vec<u8>,
    },
    /// The connection is down (DREQ received or our DREQ answered or timed out; on iWARP
    /// the stream closed: both FINs, a reset, or a Terminate).
    Disconnected,
    /// The id's device was removed (through a daemon: the session with it ended); only
    /// destroy is valid now. It is the id's last event, and it replaces the id's events
    /// still queued, not yet delivered to a callback or taken from a channel: an event in a
    /// running callback (or held from a channel) finishes first, the others are dropped.
    /// (Linux's ucma instead leaves earlier events queued ahead of it.)
    DeviceRemoval,
    /// Timewait is over: the QP may be reused.
    TimewaitExit,
}

impl Event {
    /// The librdmacm name of the event type (`RDMA_CM_EVENT_*` without the prefix).
    pub fn name(&self) -> &'static str {
        match self {
            Event::AddrResolved => "ADDR_RESOLVED",
            Event::AddrError(_) => "ADDR_ERROR",
            Event::RouteResolved => "ROUTE_RESOLVED",
            Event::RouteError(_) => "ROUTE_ERROR",
            Event::ConnectRequest { .. } => "CONNECT_REQUEST",
            Event::ConnectResponse { .. } => "CONNECT_RESPONSE",
            Event::ConnectError(_) => "CONNECT_ERROR",
            Event::Unreachable(_) => "UNREACHABLE",
            Event::Rejected { .. } => "REJECTED",
            Event::Established { .. } => "ESTABLISHED",
            Event::Disconnected => "DISCONNECTED",
            Event::DeviceRemoval => "DEVICE_REMOVAL",
            Event::TimewaitExit => "TIMEWAIT_EXIT",
        }
    }
}
