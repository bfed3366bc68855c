//! One connection endpoint: the IBTA chapter 12 state and what the engine must remember to
//! answer duplicates, retransmit and time out.

use super::CepHandle;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// The IBTA chapter 12 connection states (Linux `enum ib_cm_state`), plus `Listen`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    /// No exchange in progress.
    Idle,
    /// A listener.
    Listen,
    /// Active: REQ sent, waiting for REP.
    ReqSent,
    /// Passive: REQ received, not yet answered.
    ReqRcvd,
    /// Passive: MRA sent (or armed, when lazy) for the REQ.
    MraReqSent,
    /// Active: the peer sent an MRA for our REQ.
    MraReqRcvd,
    /// Passive: REP sent, waiting for RTU.
    RepSent,
    /// Active: REP received, RTU not yet sent.
    RepRcvd,
    /// Active: MRA sent for the REP.
    MraRepSent,
    /// Passive: the peer sent an MRA for our REP.
    MraRepRcvd,
    /// Connected.
    Established,
    /// DREQ sent, waiting for DREP.
    DreqSent,
    /// DREQ received, DREP not yet sent.
    DreqRcvd,
    /// Disconnected; the comm ID and QPN stay reserved until the timewait timer fires.
    Timewait,
    /// Active SIDR: request sent.
    SidrReqSent,
    /// Passive SIDR: request received, not yet answered.
    SidrReqRcvd,
}

/// A message waiting for its answer, retransmitted until it comes or the policy gives up.
#[derive(Debug, Clone)]
pub(crate) struct Outstanding {
    /// Inline: the endpoint boxes the whole `Outstanding`, one allocation per message.
    pub mad: [u8; 256],
    pub retries_done: u8,
    pub next_wait: Duration,
    pub deadline: Option<Instant>,
    /// An MRA set `next_wait` to the time the peer asked for. Under `Classic` every later
    /// retry waits that long (Linux up to 6.13: `ib_modify_mad` changes the MAD's timeout,
    /// which `retry_send` uses for each retry); under `Backoff` only the next one does, and
    /// the backoff starts again after it (Linux since 6.14).
    pub stretched: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TimerKind {
    None,
    Retransmit,
    Timewait,
}

#[derive(Debug, Clone)]
pub(crate) struct Cep {
    pub state: State,
    /// Destroyed by the user but still finishing protocol duties (timewait); never reported.
    pub orphan: bool,
    pub local_id: u32,
    pub remote_id: u32,
    pub remote_guid: u64,
    pub peer: IpAddr,
    pub local_qpn: u32,
    pub remote_qpn: u32,
    pub service_id: u64,
    /// TID of the current exchange: the REQ's (echoed by MRA/REJ/REP/RTU) or the DREQ's.
    pub tid: u64,
    /// The REQ's TID, kept for RTU/MRA resends after a DREQ changed `tid`.
    pub req_tid: u64,
    /// The listener whose backlog this unanswered passive endpoint counts against.
    pub listener: Option<CepHandle>,
    pub out: Option<Box<Outstanding>>,
    /// Classic retry interval for this connection, in ms.
    pub timeout_ms: u32,
    pub max_retries: u8,
    /// The path's local ACK timeout (IBTA time value): timewait lasts this long.
    pub ack_timeout: u8,
    /// Active side: the path's packet lifetime, from which the REP's target ACK delay makes
    /// the ACK timeout.
    pub packet_life_time: u8,
    /// Service timeout of the MRA we sent (or armed) and whether it actually went out.
    pub mra_timeout: u8,
    pub mra_sent: bool,
    /// An MRA from the peer was already honoured once.
    pub mra_honoured: bool,
    /// Active side: a valid REP is answered with the RTU at once ([`ConnectParams`]'s
    /// `establish_on_rep`).
    ///
    /// [`ConnectParams`]: super::ConnectParams
    pub establish_on_rep: bool,
    pub timer_gen: u32,
    pub timer: TimerKind,
    /// The peer comm ID of a REP we rejected as stale: later copies of it are dropped, so a
    /// retransmitted stale REP cannot half-open a connection its sender already tore down.
    pub stale_rep: Option<u32>,
}

impl Cep {
    pub(crate) fn new(state: State, local_id: u32, peer: IpAddr) -> Self {
        Cep {
            state,
            orphan: false,
            local_id,
            remote_id: 0,
            remote_guid: 0,
            peer,
            local_qpn: 0,
            remote_qpn: 0,
            service_id: 0,
            tid: 0,
            req_tid: 0,
            listener: None,
            out: None,
            timeout_ms: 0,
            max_retries: 0,
            ack_timeout: 0,
            packet_life_time: 0,
            mra_timeout: 0,
            mra_sent: false,
            mra_honoured: false,
            establish_on_rep: false,
            timer_gen: 0,
            timer: TimerKind::None,
            stale_rep: None,
        }
    }
}
