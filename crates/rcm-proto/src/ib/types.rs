//! The engine's vocabulary: handles, parameters, events, transmits, timing policy.

use rcm_wire::cm::{RejReason, SidrStatus};
use std::net::IpAddr;
use std::time::Duration;

/// Names one connection endpoint (or listener, or SIDR exchange) of an [`super::Endpoint`].
/// Handles are never reused within one endpoint. Never zero, so an `Option<CepHandle>`
/// (one per id and per endpoint) takes 8 bytes, not 16.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CepHandle(pub std::num::NonZeroU64);

/// `cm_convert_to_ms`: IBA time value t (4.096 µs × 2^t) as Linux rounds it, `1 << max(t-8, 0)`.
pub fn ibta_time_ms(t: u8) -> u64 {
    1u64 << u32::from(t.min(31)).saturating_sub(8)
}

/// Linux `cm_ack_timeout(ca_ack_delay, packet_life_time)`: the local ACK timeout a REQ carries.
pub fn cm_ack_timeout(ca_ack_delay: u8, packet_life_time: u8) -> u8 {
    // Linux computes in int; the inputs here are whole u8s (a configured ACK delay is not a
    // 5-bit wire field), so each step saturates instead of wrapping, or panicking in debug.
    let mut ack = packet_life_time.saturating_add(1);
    if ack >= ca_ack_delay {
        if ca_ack_delay >= ack.saturating_sub(1) {
            ack = ack.saturating_add(1);
        }
    } else {
        ack = ca_ack_delay.saturating_add(u8::from(ack >= ca_ack_delay.saturating_sub(1)));
    }
    ack.min(31)
}

#[cfg(test)]
mod tests {
    use super::cm_ack_timeout;

    /// Linux's values (`cm_ack_timeout` in cm.c) for wire-sized inputs, and no overflow for
    /// any pair of bytes (a configured `ca_ack_delay` of 254 overflowed).
    #[test]
    fn cm_ack_timeout_matches_linux_and_takes_any_bytes() {
        assert_eq!(cm_ack_timeout(15, 18), 19);
        assert_eq!(cm_ack_timeout(15, 13), 16);
        assert_eq!(cm_ack_timeout(20, 13), 20);
        assert_eq!(cm_ack_timeout(0, 0), 2);
        for d in 0..=255u8 {
            for plt in 0..=255u8 {
                assert!(cm_ack_timeout(d, plt) <= 31);
            }
        }
    }
}

/// How a message that expects an answer is retransmitted. Once the peer sends an MRA (the
/// first one is honoured) the next retry of that message waits the time the MRA asks for
/// (its service timeout plus the ACK timeout); what follows depends on the policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryPolicy {
    /// The IBTA/classic Linux rule, taken from the message's own fields: a fixed interval of
    /// `2 × packet_life_time + cm_response_timeout` (each `1 << (t-8)` ms) and `max_cm_retries`
    /// retransmissions. After an MRA every retry waits the MRA's time (Linux up to 6.13,
    /// whose `ib_modify_mad` keeps it as the MAD's timeout).
    Classic,
    /// Exponential backoff: the first wait is `initial`, each next one doubles, no wait exceeds
    /// `max_wait`, and the exchange fails at `deadline` after the first send (or after
    /// `max_cm_retries` retransmissions, whichever comes first). `initial` is capped by
    /// `max_wait`, and no wait goes past the deadline. An MRA's time applies to the next
    /// retry only, after which the backoff starts again from `initial`, and it moves the
    /// deadline by that time, to at least two of its waits from its arrival (one retry after
    /// the stretched wait, and the time to answer it), as Linux since 6.14 does.
    Backoff {
        /// First wait.
        initial: Duration,
        /// Cap on any single wait.
        max_wait: Duration,
        /// Overall deadline from the first send.
        deadline: Duration,
    },
}

impl Default for RetryPolicy {
    /// 1 s, doubling, at most 60 s a wait, 60 s overall: a lost REQ is retried at 1, 3, 7, 15,
    /// 31 s and the connect fails at 60 s.
    fn default() -> Self {
        RetryPolicy::Backoff {
            initial: Duration::from_secs(1),
            max_wait: Duration::from_secs(60),
            deadline: Duration::from_secs(60),
        }
    }
}

/// Configuration of one endpoint (one CM port, one local address).
#[derive(Debug, Clone)]
pub struct EndpointConfig {
    /// The local address; its GID is the local port GID.
    pub local_addr: IpAddr,
    /// The local CA GUID (node GUID) put in REQ/REP and used in REJ(TIMEOUT) ARIs.
    pub ca_guid: u64,
    /// Retransmission policy.
    pub retry: RetryPolicy,
    /// Seed of the engine's generator (comm-ID operand, PSNs). The driver seeds it from the OS
    /// so IDs are unpredictable; simulations pass a fixed seed.
    pub seed: u64,
    /// The MAD agent id Linux would put in the TID's upper half.
    pub agent_id: u32,
    /// Local CA ACK delay (REP target ACK delay).
    pub ca_ack_delay: u8,
    /// Cap on connection endpoints (listeners excluded), so a flood cannot exhaust memory.
    pub max_ceps: usize,
    /// Shortest timewait, whatever the path's ACK timeout says.
    pub min_timewait: Duration,
    /// Most accepted connections waiting for their RTU at once (the half-open budget: with
    /// ~1.5 KB each, 65,536 bound a REQ flood's memory near 100 MB); past it the oldest are
    /// given up as REP timeouts.
    pub max_half_open: usize,
}

impl EndpointConfig {
    /// Defaults for an endpoint on `local_addr`.
    pub fn new(local_addr: IpAddr, ca_guid: u64, seed: u64) -> Self {
        EndpointConfig {
            local_addr,
            ca_guid,
            retry: RetryPolicy::default(),
            seed,
            agent_id: 1,
            ca_ack_delay: 15,
            max_ceps: 1 << 20,
            min_timewait: Duration::from_millis(0),
            max_half_open: 1 << 16,
        }
    }
}

/// The path part of a REQ (synthesised by rdma_cm on RoCE; no SA).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathParams {
    /// Flow label (20 bits).
    pub flow_label: u32,
    /// Traffic class.
    pub traffic_class: u8,
    /// Hop limit (64 routed; 1 link-local).
    pub hop_limit: u8,
    /// Service level.
    pub sl: u8,
    /// Packet lifetime. Linux 6.1 rdma_cm on RoCE uses 18 (its REQs carry ACK timeout 19 and
    /// retry every 2 × 1 s + 4 s ≈ 6.1 s, as the captures show); newer kernels 16.
    pub packet_life_time: u8,
    /// Path MTU enum (1 = 256 … 5 = 4096; 1500-byte Ethernet → 3).
    pub mtu: u8,
    /// Packet rate enum (0 = port current).
    pub rate: u8,
}

impl Default for PathParams {
    fn default() -> Self {
        PathParams {
            flow_label: 0,
            traffic_class: 0,
            hop_limit: 64,
            sl: 0,
            packet_life_time: 18,
            mtu: 3,
            rate: 0,
        }
    }
}

/// What the active side asks for in a REQ.
#[derive(Debug, Clone)]
pub struct ConnectParams {
    /// Destination address (the peer's GID).
    pub dst: IpAddr,
    /// Service ID (rdma_cm: port space << 16 | port).
    pub service_id: u64,
    /// The local QP number (24 bits).
    pub qpn: u32,
    /// Starting PSN; `None` picks a random 24-bit one, as rdma_cm does.
    pub starting_psn: Option<u32>,
    /// Responder resources.
    pub responder_resources: u8,
    /// Initiator depth.
    pub initiator_depth: u8,
    /// QP retry count (0..=7).
    pub retry_count: u8,
    /// RNR retry count (0..=7).
    pub rnr_retry_count: u8,
    /// Whether the QP uses an SRQ.
    pub srq: bool,
    /// CM response timeout for both directions (rdma_cm: 20).
    pub cm_response_timeout: u8,
    /// Max CM retries (rdma_cm: 15).
    pub max_cm_retries: u8,
    /// The path.
    pub path: PathParams,
    /// Private data (rdma_cm puts its 36-byte header first), at most 92 bytes.
    pub private_data: Vec<u8>,
    /// Answer a valid REP with the RTU at once, as rdma_cm does for an id with a QP
    /// (`cma_rep_recv` moves the QP to RTR and RTS and sends the RTU before it reports
    /// ESTABLISHED): `RepReceived` (with `established` set) is then followed by
    /// `Established` in the same call, with no [`Endpoint::establish`] to make.
    /// Off (the default): `RepReceived` waits for the caller's `establish` or `reject`.
    ///
    /// [`Endpoint::establish`]: super::Endpoint::establish
    pub establish_on_rep: bool,
}

impl ConnectParams {
    /// rdma_cm's defaults for an RC connection to `dst`.
    pub fn new(dst: IpAddr, service_id: u64, qpn: u32) -> Self {
        ConnectParams {
            dst,
            service_id,
            qpn,
            starting_psn: None,
            responder_resources: 1,
            initiator_depth: 1,
            retry_count: 7,
            rnr_retry_count: 7,
            srq: false,
            cm_response_timeout: 20,
            max_cm_retries: 15,
            path: PathParams::default(),
            private_data: Vec::new(),
            establish_on_rep: false,
        }
    }
}

/// What the passive side answers with in a REP.
#[derive(Debug, Clone, Default)]
pub struct AcceptParams {
    /// The local QP number.
    pub qpn: u32,
    /// Starting PSN; `None` picks a random one.
    pub starting_psn: Option<u32>,
    /// Responder resources.
    pub responder_resources: u8,
    /// Initiator depth.
    pub initiator_depth: u8,
    /// RNR retry count.
    pub rnr_retry_count: u8,
    /// Whether the QP uses an SRQ.
    pub srq: bool,
    /// Private data, at most 196 bytes.
    pub private_data: Vec<u8>,
}

/// A SIDR request (UD service resolution).
#[derive(Debug, Clone)]
pub struct SidrParams {
    /// Destination.
    pub dst: IpAddr,
    /// Service ID.
    pub service_id: u64,
    /// Private data (rdma_cm header first), at most 216 bytes.
    pub private_data: Vec<u8>,
    /// Response timeout (IBTA time value; rdma_cm: 20).
    pub timeout: u8,
    /// Retries (rdma_cm: 15).
    pub max_retries: u8,
}

/// The answer to a SIDR request.
#[derive(Debug, Clone, Default)]
pub struct SidrReplyParams {
    /// Status (success, rejected, …).
    pub status: SidrStatus,
    /// The UD QP number.
    pub qpn: u32,
    /// Its Q_Key.
    pub qkey: u32,
    /// Private data, at most 136 bytes.
    pub private_data: Vec<u8>,
}

/// What a received REQ offered, handed to the listener's owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReqInfo {
    /// The peer's address.
    pub peer: IpAddr,
    /// Service ID asked for.
    pub service_id: u64,
    /// The peer's QP number.
    pub remote_qpn: u32,
    /// The peer's starting PSN.
    pub starting_psn: u32,
    /// The peer's CA GUID.
    pub remote_ca_guid: u64,
    /// Responder resources offered.
    pub responder_resources: u8,
    /// Initiator depth offered.
    pub initiator_depth: u8,
    /// Retry count.
    pub retry_count: u8,
    /// RNR retry count.
    pub rnr_retry_count: u8,
    /// Path MTU enum.
    pub mtu: u8,
    /// Flow label.
    pub flow_label: u32,
    /// Traffic class.
    pub traffic_class: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// The ACK timeout the passive side's QP takes: the REQ's local ACK timeout, 0 made 1
    /// as Linux makes it (a QP timeout of 0 never retransmits).
    pub local_ack_timeout: u8,
    /// SRQ.
    pub srq: bool,
    /// The whole private-data area (92 bytes).
    pub private_data: Vec<u8>,
}

/// What a received REP offered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepInfo {
    /// The peer's QP number.
    pub remote_qpn: u32,
    /// The peer's starting PSN.
    pub starting_psn: u32,
    /// Responder resources.
    pub responder_resources: u8,
    /// Initiator depth.
    pub initiator_depth: u8,
    /// Target ACK delay.
    pub target_ack_delay: u8,
    /// RNR retry count.
    pub rnr_retry_count: u8,
    /// SRQ.
    pub srq: bool,
    /// The whole private-data area (196 bytes).
    pub private_data: Vec<u8>,
    /// The RTU went out with this event (`ConnectParams::establish_on_rep`): `Established`
    /// follows, and `establish` is not to be called.
    pub established: bool,
}

/// Which exchange ran out of retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimedOut {
    /// The REQ was never answered (IB_CM_REQ_ERROR).
    Req,
    /// The REP was never answered by an RTU (IB_CM_REP_ERROR).
    Rep,
    /// The DREQ was never answered (IB_CM_DREQ_ERROR); the endpoint is in timewait.
    Dreq,
    /// The SIDR_REQ was never answered (IB_CM_SIDR_REQ_ERROR).
    SidrReq,
}

/// What the engine tells its user, per endpoint handle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CmEvent {
    /// A REQ arrived for a listener: `cep` is a new passive endpoint in ReqRcvd, owned by the
    /// listener's user until accepted, rejected or destroyed.
    ReqReceived {
        /// The listener it matched.
        listener: CepHandle,
        /// The new endpoint.
        cep: CepHandle,
        /// What the peer asked for.
        info: Box<ReqInfo>,
    },
    /// The REP answering our REQ (send the RTU with `establish`, or reject); with
    /// `ConnectParams::establish_on_rep` the RTU is already out and `Established` follows
    /// (`RepInfo::established`).
    RepReceived(Box<RepInfo>),
    /// The connection is established (passive: RTU received; active: RTU sent).
    Established,
    /// The peer rejected (or the stale-connection rule fired, or we refused the peer's REP
    /// for its comm ID of 0: reason INVALID_COMM_ID).
    Rejected {
        /// Reason.
        reason: RejReason,
        /// Additional rejection information (its meaningful bytes).
        ari: Vec<u8>,
        /// The REJ's private-data area.
        private_data: Vec<u8>,
    },
    /// The peer needs more time (MRA received); our wait was extended.
    MraReceived {
        /// The service timeout it asked for.
        service_timeout: u8,
    },
    /// The peer asked to disconnect; reply with `disconnect` (which sends the DREP).
    DreqReceived {
        /// The DREQ's private-data area.
        private_data: Vec<u8>,
    },
    /// Our DREQ was answered; the endpoint is in timewait.
    DrepReceived,
    /// Timewait is over: the endpoint is idle and its comm ID free.
    TimewaitExit,
    /// An exchange ran out of retries.
    TimedOut(TimedOut),
    /// A SIDR_REQ arrived for a listener: answer with `sidr_reply`.
    SidrReqReceived {
        /// The listener it matched.
        listener: CepHandle,
        /// The new endpoint for this exchange.
        cep: CepHandle,
        /// Who asked.
        peer: IpAddr,
        /// Service ID asked for.
        service_id: u64,
        /// The whole private-data area (216 bytes).
        private_data: Vec<u8>,
    },
    /// The answer to our SIDR_REQ.
    SidrRepReceived {
        /// Status.
        status: SidrStatus,
        /// The peer's UD QPN.
        qpn: u32,
        /// Its Q_Key.
        qkey: u32,
        /// The private-data area (136 bytes).
        private_data: Vec<u8>,
    },
}

/// A MAD to send to QP1 of `dst`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transmit {
    /// The destination address.
    pub dst: IpAddr,
    /// The 256-byte MAD.
    pub mad: [u8; 256],
}

/// Why a command was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CmError {
    /// No such handle (never existed, or destroyed).
    #[error("no such connection endpoint")]
    UnknownHandle,
    /// The command does not apply in the endpoint's state.
    #[error("invalid in state {0:?}")]
    InvalidState(super::State),
    /// A listener already holds this service ID.
    #[error("service ID {0:#x} is already being listened on")]
    AddressInUse(u64),
    /// A parameter does not fit the wire format.
    #[error(transparent)]
    Wire(#[from] rcm_wire::WireError),
    /// Too many connection endpoints.
    #[error("too many connection endpoints")]
    NoResources,
}
