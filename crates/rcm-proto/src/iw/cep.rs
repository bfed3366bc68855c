//! `Cep`: one iWARP connection endpoint over one TCP byte stream.
//!
//! The behaviour follows Linux's split: the iw_cm (`iwcm.c`) owns the states and the events the
//! user sees; the provider (siw, `siw_cm.c`) runs the MPA exchange and its timers. Comments name
//! the RFC section or the Linux function where a choice is subtle.

use super::types::{
    AcceptParams, CepConfig, CepError, CloseReason, ConnectError, ConnectParams, ConnectReply,
    ConnectRequest, Event, MpaVersion, Negotiated, ProtocolError, Role, RtrKind, RtrModes, State,
    TcpAction,
};
use rcm_wire::mpa::{
    self, emit_fpdu, llp_ecode, term_etype, term_layer, DdpBuffer, DdpRdmapHeader, Enhanced,
    FrameKind, MpaFlags, MpaFrame, RdmapOpcode, ReadRequest, Terminate, ENHANCED_USER_MAX,
    IRD_ORD_MAX, MAX_PRIVATE_DATA, MAX_ULPDU, QN_READ_REQUEST, QN_SEND, QN_TERMINATE, REVISION_1,
    REVISION_2, UNTAGGED_HEADER_LEN,
};
use rcm_wire::WireError;
use std::collections::VecDeque;
use std::time::Instant;

/// The STag siw puts in its zero-length RTR Write and Read (`siw_qp_mpa_rts`: "some HW may
/// treat STag 0 special"), seen in the `e1-p2p-ucmatose` capture.
const RTR_STAG: u32 = 1;

// The DDP (RFC 5041) and RDMAP (RFC 5040) Terminate error codes used here, as in Linux siw.
const DDP_CATASTROPHIC_LOCAL: u8 = 0x00;
const DDP_TAGGED_INVALID_STAG: u8 = 0x00;
const DDP_TAGGED_BAD_VERSION: u8 = 0x04;
const DDP_UNTAGGED_INVALID_QN: u8 = 0x01;
const DDP_UNTAGGED_NO_BUFFER: u8 = 0x02;
const DDP_UNTAGGED_MSN_RANGE: u8 = 0x03;
const DDP_UNTAGGED_INVALID_MO: u8 = 0x04;
const DDP_UNTAGGED_TOO_LONG: u8 = 0x05;
const DDP_UNTAGGED_BAD_VERSION: u8 = 0x06;
const RDMAP_INVALID_STAG: u8 = 0x00;
const RDMAP_BAD_VERSION: u8 = 0x05;
const RDMAP_UNEXPECTED_OPCODE: u8 = 0x06;
const RDMAP_CATASTROPHIC_STREAM: u8 = 0x07;

/// What the receive side expects next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RxMode {
    /// Nothing may arrive (active before `connect`; passive between Request and `accept`).
    Forbidden,
    /// Passive: the MPA Request.
    Request,
    /// Active: the MPA Reply.
    Reply,
    /// FPDUs.
    Fpdu,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TimerKind {
    MpaRequest,
    MpaReply,
    Rtr,
    Close,
}

/// What the passive side remembers of the Request between `ConnectRequest` and `accept`.
#[derive(Debug, Clone)]
struct PeerRequest {
    frame: MpaFrame,
    /// Revision of our Reply: the Request's, capped by [`CepConfig::max_revision`].
    reply_revision: u8,
    /// Whether our Reply carries the IRD/ORD words.
    reply_enhanced: bool,
    /// siw's `cep->ird` / `cep->ord` after `siw_proc_mpareq`: the initiator's ORD / IRD capped
    /// by the device limits.
    cap_ird: u16,
    cap_ord: u16,
    /// The RTR operation we will pick, when the initiator asked for peer-to-peer mode.
    rtr: Option<RtrKind>,
}

/// One iWARP connection endpoint over one established TCP stream. See the module docs.
#[derive(Debug)]
pub struct Cep {
    cfg: CepConfig,
    role: Role,
    state: State,
    /// A terminal [`TcpAction`] was issued: the stream is finished for us.
    closed: bool,
    /// Our write side is shut down (`disconnect`): nothing more may be queued.
    write_shut: bool,
    rx_mode: RxMode,
    rx: super::ByteQueue,
    /// The sizes of the messages reported ([`Event::Message`]) and not yet taken by the
    /// application ([`Cep::messages_taken`]), oldest first: the receive buffers in use.
    undelivered: VecDeque<usize>,
    /// Their bytes.
    undelivered_bytes: usize,
    /// Do not try to parse before `rx` holds this many bytes (the parser said so).
    rx_need: usize,
    /// Active: the Request we sent. Passive: what the Request asked.
    our_request: Option<MpaFrame>,
    peer_request: Option<PeerRequest>,
    accepted: bool,
    /// Active: the IRD/ORD asked for in `connect` (kept as they are without an RFC 6581
    /// exchange).
    local_ird_ord: (u16, u16),
    neg: Option<Negotiated>,
    crc: bool,
    /// Passive, peer-to-peer: the RTR frame still awaited.
    awaiting_rtr: Option<RtrKind>,
    /// Active: our RTR was a zero-length Read; its zero-length Response is still to come.
    awaiting_read_response: bool,
    tx_msn_send: u32,
    tx_msn_read: u32,
    tx_msn_term: u32,
    rx_msn_send: u32,
    rx_msn_read: u32,
    reassembly: Vec<u8>,
    timer: Option<(Instant, TimerKind)>,
    transmits: VecDeque<Vec<u8>>,
    /// Bytes of the stream queued for transmission so far, and written to the socket so far
    /// (as the driver reports, [`Cep::transmitted`]).
    tx_queued: u64,
    tx_written: u64,
    /// Where in the stream each Read Response not yet written ends. Each is a Read Request
    /// the peer still counts against our IRD (siw frees an inbound read queue entry once its
    /// response went to the socket): more than IRD of them is a peer beyond its ORD.
    unwritten_read_responses: VecDeque<u64>,
    actions: VecDeque<TcpAction>,
    events: VecDeque<Event>,
    /// Passive, without peer-to-peer mode: until when our FPDUs wait for the initiator's
    /// first ([`CepConfig::responder_hold`]); `held` keeps them meanwhile, in order.
    hold: Option<Instant>,
    held: Vec<Vec<u8>>,
}

impl Cep {
    fn new(cfg: CepConfig, role: Role, rx_mode: RxMode) -> Self {
        Cep {
            cfg,
            role,
            state: State::Idle,
            closed: false,
            write_shut: false,
            rx_mode,
            rx: super::ByteQueue::default(),
            undelivered: VecDeque::new(),
            undelivered_bytes: 0,
            rx_need: 0,
            our_request: None,
            peer_request: None,
            accepted: false,
            local_ird_ord: (0, 0),
            neg: None,
            crc: false,
            awaiting_rtr: None,
            awaiting_read_response: false,
            tx_msn_send: 1,
            tx_msn_read: 1,
            tx_msn_term: 1,
            rx_msn_send: 1,
            rx_msn_read: 1,
            reassembly: Vec::new(),
            timer: None,
            transmits: VecDeque::new(),
            tx_queued: 0,
            tx_written: 0,
            unwritten_read_responses: VecDeque::new(),
            actions: VecDeque::new(),
            events: VecDeque::new(),
            hold: None,
            held: Vec::new(),
        }
    }

    /// An active endpoint for a TCP stream the caller has just connected. Nothing is sent
    /// until [`Cep::connect`]; the peer must stay silent until our Request (RFC 5044 §7.1.2),
    /// so any byte received before that is a protocol error.
    pub fn active(cfg: CepConfig) -> Self {
        Cep::new(cfg, Role::Active, RxMode::Forbidden)
    }

    /// A passive endpoint for a TCP stream accepted from a listening socket at `now`. It waits
    /// [`CepConfig::mpa_request_timeout`] for the MPA Request (siw arms its MPA timer in
    /// `siw_accept_newconn`).
    pub fn passive(now: Instant, cfg: CepConfig) -> Self {
        let mut c = Cep::new(cfg, Role::Passive, RxMode::Request);
        c.timer = Some((now + c.cfg.mpa_request_timeout, TimerKind::MpaRequest));
        c
    }

    // ----- queries ---------------------------------------------------------------------------

    /// Active or passive.
    pub fn role(&self) -> Role {
        self.role
    }

    /// The iw_cm state.
    pub fn state(&self) -> State {
        self.state
    }

    /// The configuration.
    pub fn config(&self) -> &CepConfig {
        &self.cfg
    }

    /// What the MPA exchange settled, once it has.
    pub fn negotiated(&self) -> Option<&Negotiated> {
        self.neg.as_ref()
    }

    /// Whether the endpoint is finished: a terminal [`TcpAction`] (`Close` or `Reset`) has been
    /// issued, or it was destroyed. It takes no more input and produces no more output beyond
    /// what is already queued.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    // ----- outputs ---------------------------------------------------------------------------

    /// The next bytes to write to the stream, in order.
    pub fn poll_transmit(&mut self) -> Option<Vec<u8>> {
        self.transmits.pop_front()
    }

    /// The next thing to do with the socket, to be done after writing every pending transmit.
    pub fn poll_tcp_action(&mut self) -> Option<TcpAction> {
        // An action is only due once the bytes queued before it are out.
        if self.transmits.is_empty() {
            self.actions.pop_front()
        } else {
            None
        }
    }

    /// The next event.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// When [`Cep::on_timer`] must next be called, if a timer runs.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match (self.timer.map(|(at, _)| at), self.hold) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    // ----- commands --------------------------------------------------------------------------

    /// Active: queue the MPA Request (`iw_cm_connect` → `siw_connect`): Idle → ConnSent, and
    /// start the [`CepConfig::mpa_reply_timeout`] timer.
    ///
    /// Markers are never asked for. In revision 2 the Request carries our IRD/ORD and, with
    /// `p2p`, the peer-to-peer flag and the RTR operations offered; like siw, peer-to-peer mode
    /// raises an ORD of 0 to 1 so that a Read RTR is possible.
    pub fn connect(&mut self, now: Instant, p: &ConnectParams) -> Result<(), CepError> {
        if self.role != Role::Active {
            return Err(CepError::WrongRole(self.role));
        }
        if self.state != State::Idle || self.closed || self.our_request.is_some() {
            return Err(self.invalid());
        }
        // siw_connect checks IRD/ORD against the device whatever the revision.
        check_ird_ord(p.ird, self.cfg.max_ird)?;
        check_ird_ord(p.ord, self.cfg.max_ord)?;
        let mut frame = match p.version {
            MpaVersion::V1 => {
                check_pd(&p.private_data, false)?;
                MpaFrame::request_v1(p.private_data.clone())
            }
            MpaVersion::V2 => {
                check_pd(&p.private_data, true)?;
                let mut e = Enhanced::new(p.ird, p.ord);
                if let Some(modes) = p.p2p {
                    if modes.is_empty() {
                        return Err(CepError::NoRtrMode);
                    }
                    e.peer_to_peer = true;
                    e.zero_len_send_rtr = modes.send;
                    e.zero_len_write_rtr = modes.write;
                    e.zero_len_read_rtr = modes.read;
                    e.ord = e.ord.max(1);
                }
                MpaFrame::request_v2(e.ird, e.ord, p.private_data.clone()).with_enhanced(e)
            }
        };
        frame.flags.crc = p.crc;
        let bytes = frame.to_vec()?;
        self.push_tx(bytes);
        self.local_ird_ord = (p.ird, p.ord);
        if let Some(e) = frame.enhanced {
            self.local_ird_ord = (e.ird, e.ord);
        }
        self.our_request = Some(frame);
        self.state = State::ConnSent;
        self.rx_mode = RxMode::Reply;
        self.timer = Some((now + self.cfg.mpa_reply_timeout, TimerKind::MpaReply));
        Ok(())
    }

    /// Passive: accept the reported Request (`iw_cm_accept` → `siw_accept`) and queue the
    /// Reply.
    ///
    /// Revision 2 negotiates IRD/ORD the way siw does with `relaxed_ird_negotiation`: our ORD
    /// is lowered to the initiator's IRD, our IRD raised to the initiator's ORD (both capped by
    /// the device limits). Without peer-to-peer mode the endpoint is Established at once and
    /// reports [`Event::Established`] (the provider's ESTABLISHED upcall follows the Reply); in
    /// peer-to-peer mode it stays in ConnRecv until the initiator's RTR frame arrives (siw's
    /// `siw_rtr_data_ready`), within [`CepConfig::rtr_timeout`].
    pub fn accept(&mut self, now: Instant, p: &AcceptParams) -> Result<(), CepError> {
        if self.role != Role::Passive {
            return Err(CepError::WrongRole(self.role));
        }
        if self.state != State::ConnRecv || self.accepted || self.closed {
            return Err(self.invalid());
        }
        let Some(req) = self.peer_request.clone() else {
            return Err(self.invalid());
        };
        check_pd(&p.private_data, req.reply_enhanced)?;
        check_ird_ord(p.ird, self.cfg.max_ird)?;
        check_ird_ord(p.ord, self.cfg.max_ord)?;
        let (ird, ord, mut frame) = if req.reply_enhanced {
            let ord = p.ord.min(req.cap_ord);
            let ird = p.ird.max(req.cap_ird);
            let mut e = Enhanced::new(ird, ord);
            if let Some(kind) = req.rtr {
                e.peer_to_peer = true;
                set_rtr(&mut e, kind);
            }
            let f = MpaFrame::reply_v2(ird, ord, p.private_data.clone()).with_enhanced(e);
            (ird, ord, f)
        } else {
            let mut f = MpaFrame::reply_v1(p.private_data.clone());
            // A revision-2 Request without the Enhanced flag is answered in revision 2 too,
            // still without IRD/ORD words (siw echoes the Request's header).
            f.revision = req.reply_revision;
            (p.ird, p.ord, f)
        };
        let crc = req.frame.flags.crc || p.crc;
        frame.flags.crc = crc;
        let bytes = frame.to_vec()?;
        self.push_tx(bytes);
        self.accepted = true;
        self.crc = crc;
        let neg = Negotiated {
            revision: req.reply_revision,
            enhanced: req.reply_enhanced,
            crc,
            ird,
            ord,
            rtr: req.rtr,
            private_data: req.frame.private_data.clone(),
        };
        self.neg = Some(neg.clone());
        self.rx_mode = RxMode::Fpdu;
        self.rx_need = 0;
        if let Some(kind) = req.rtr {
            // RFC 6581 peer-to-peer mode: the responder may not send until the RTR.
            self.awaiting_rtr = Some(kind);
            self.timer = Some((now + self.cfg.rtr_timeout, TimerKind::Rtr));
        } else {
            self.state = State::Established;
            self.timer = None;
            if !self.cfg.responder_hold.is_zero() {
                self.hold = Some(now + self.cfg.responder_hold);
            }
            self.events.push_back(Event::Established(neg));
        }
        Ok(())
    }

    /// Passive: reject the reported Request (`iw_cm_reject` → `siw_reject`): queue a Reply with
    /// R set and `private_data`, then close the stream. ConnRecv → Idle; no event follows (the
    /// iw_cm generates none).
    pub fn reject(&mut self, _now: Instant, private_data: &[u8]) -> Result<(), CepError> {
        if self.role != Role::Passive {
            return Err(CepError::WrongRole(self.role));
        }
        if self.state != State::ConnRecv || self.accepted || self.closed {
            return Err(self.invalid());
        }
        let Some(req) = self.peer_request.clone() else {
            return Err(self.invalid());
        };
        check_pd(private_data, req.reply_enhanced)?;
        let bytes = reject_frame(&req, private_data).to_vec()?;
        self.push_tx(bytes);
        self.finish(None, TcpAction::Close);
        Ok(())
    }

    /// Graceful disconnect (`iw_cm_disconnect(abrupt = 0)`): Established → Closing. The caller
    /// shuts down the write side ([`TcpAction::Shutdown`]) after flushing; the endpoint closes
    /// when the peer's FIN arrives ([`CloseReason::Graceful`]) or after
    /// [`CepConfig::close_timeout`] ([`CloseReason::Timeout`], reset). As in the iw_cm, a
    /// disconnect in Closing, Idle or ConnRecv does nothing.
    pub fn disconnect(&mut self, now: Instant) -> Result<(), CepError> {
        match self.state {
            State::Established => {
                // What waited for the initiator goes out before our FIN.
                self.release_held();
                self.state = State::Closing;
                self.write_shut = true;
                self.actions.push_back(TcpAction::Shutdown);
                self.timer = Some((now + self.cfg.close_timeout, TimerKind::Close));
                Ok(())
            }
            State::Closing | State::Idle | State::ConnRecv => Ok(()),
            _ => Err(self.invalid()),
        }
    }

    /// Abrupt disconnect (`iw_cm_disconnect(abrupt = 1)`, the QP moved to ERR): the stream is
    /// reset and [`CloseReason::Aborted`] reported. Valid once the Reply is out: Established,
    /// Closing, or ConnRecv after `accept`.
    pub fn abort(&mut self, _now: Instant) -> Result<(), CepError> {
        let live = match self.state {
            State::Established | State::Closing => true,
            State::ConnRecv => self.accepted,
            _ => false,
        };
        if !live || self.closed {
            return Err(self.invalid());
        }
        self.finish(Some(Event::Close(CloseReason::Aborted)), TcpAction::Reset);
        Ok(())
    }

    /// Send a Terminate carrying `term` (the caller's QP hit an error it must report, RFC 5040
    /// §7) and close: [`CloseReason::LocalTerminate`]. Established only.
    pub fn terminate(&mut self, _now: Instant, term: &Terminate) -> Result<(), CepError> {
        if self.state != State::Established || self.closed {
            return Err(self.invalid());
        }
        let ulpdu = mpa::terminate_ulpdu(QN_TERMINATE, self.tx_msn_term, term)?;
        let mut out = Vec::new();
        emit_fpdu(&ulpdu, self.crc, &mut out)?;
        self.tx_msn_term = self.tx_msn_term.wrapping_add(1);
        self.push_tx(out);
        self.finish(
            Some(Event::Close(CloseReason::LocalTerminate)),
            TcpAction::Close,
        );
        Ok(())
    }

    /// The driver wrote `n` more bytes of [`Cep::poll_transmit`]'s output to the socket.
    /// Read Responses count against our IRD until written: a driver that never reports
    /// lets the peer have at most IRD Read Requests answered, ever.
    pub fn transmitted(&mut self, n: usize) {
        self.tx_written = self.tx_written.saturating_add(n as u64);
        while self
            .unwritten_read_responses
            .front()
            .is_some_and(|&end| end <= self.tx_written)
        {
            self.unwritten_read_responses.pop_front();
        }
    }

    fn push_tx(&mut self, bytes: Vec<u8>) {
        self.tx_queued = self.tx_queued.saturating_add(bytes.len() as u64);
        if self.hold.is_some() {
            self.held.push(bytes);
        } else {
            self.transmits.push_back(bytes);
        }
    }

    /// Bytes queued but not yet handed out by [`Cep::poll_transmit`] because a responder's
    /// FPDUs wait for the initiator's first ([`CepConfig::responder_hold`]): a driver bounding
    /// what waits for the socket counts them too.
    pub fn held_bytes(&self) -> usize {
        self.held.iter().map(Vec::len).sum()
    }

    /// Ends the responder's wait for the initiator's first FPDU: what waited goes out.
    fn release_held(&mut self) {
        if self.hold.take().is_some() {
            self.transmits.extend(self.held.drain(..));
        }
    }

    /// The application took `n` of the messages reported ([`Event::Message`]): their receive
    /// buffers are free again (see [`CepConfig::recv_queue`]).
    pub fn messages_taken(&mut self, n: usize) {
        for _ in 0..n {
            let Some(len) = self.undelivered.pop_front() else {
                break;
            };
            self.undelivered_bytes = self.undelivered_bytes.saturating_sub(len);
        }
    }

    /// Queue `payload` as an RDMAP Send (untagged, queue 0, the next MSN), split into DDP
    /// segments of at most [`CepConfig::max_send_segment`] bytes, each FPDU with CRC-32C when
    /// negotiated. Established only.
    pub fn send(&mut self, _now: Instant, payload: &[u8]) -> Result<(), CepError> {
        if self.state != State::Established || self.closed {
            return Err(self.invalid());
        }
        if u32::try_from(payload.len()).is_err() {
            return Err(CepError::MessageTooLong(payload.len()));
        }
        let seg = self
            .cfg
            .max_send_segment
            .clamp(1, MAX_ULPDU - UNTAGGED_HEADER_LEN);
        let mut out = Vec::new();
        let mut off = 0usize;
        loop {
            let end = (off + seg).min(payload.len());
            let last = end == payload.len();
            let mut h =
                DdpRdmapHeader::untagged(RdmapOpcode::Send, QN_SEND, self.tx_msn_send, off as u32);
            h.last = last;
            let mut ulpdu = h.to_vec()?;
            ulpdu.extend_from_slice(&payload[off..end]);
            emit_fpdu(&ulpdu, self.crc, &mut out)?;
            off = end;
            if last {
                break;
            }
        }
        self.tx_msn_send = self.tx_msn_send.wrapping_add(1);
        self.push_tx(out);
        Ok(())
    }

    /// Destroy the endpoint (`iw_destroy_cm_id` → `destroy_cm_id`), from any state. After this
    /// no event is produced, queued ones are dropped (the iw_cm's `IWCM_F_DROP_EVENTS`), and
    /// every input is ignored. What happens to the stream depends on the state:
    ///
    /// - ConnRecv before `accept`: the Request is rejected (Reply with R, no private data) and
    ///   the stream closed, as `destroy_cm_id` calls `iw_reject`;
    /// - Established, or ConnRecv after `accept`: reset (the QP goes to ERR: abrupt close);
    /// - ConnSent: reset. The iw_cm would block until the provider's CONNECT_REPLY; a sans-IO
    ///   engine cannot wait, so it gives the connection up instead;
    /// - Idle (never connected or still awaiting the Request) and Closing: closed;
    /// - already closed: nothing more.
    pub fn destroy(&mut self, _now: Instant) {
        if self.state == State::Destroying {
            return;
        }
        if !self.closed {
            let action = match self.state {
                State::ConnRecv if !self.accepted => {
                    if let Some(req) = self.peer_request.clone() {
                        if let Ok(b) = reject_frame(&req, &[]).to_vec() {
                            self.push_tx(b);
                        }
                    }
                    TcpAction::Close
                }
                State::ConnRecv | State::Established | State::ConnSent => TcpAction::Reset,
                _ => TcpAction::Close,
            };
            self.finish(None, action);
        }
        self.events.clear();
        self.state = State::Destroying;
    }

    // ----- inputs ----------------------------------------------------------------------------

    /// Bytes received from the stream, in order, fragmented any way.
    pub fn on_bytes(&mut self, now: Instant, bytes: &[u8]) {
        if self.closed || bytes.is_empty() {
            return;
        }
        if self.rx_mode == RxMode::Forbidden {
            self.fail(ProtocolError::UnexpectedData, None);
            return;
        }
        self.rx.extend(bytes);
        self.process_rx(now);
    }

    /// The stream ended: `graceful` for the peer's FIN, false for a reset or a TCP error.
    pub fn on_tcp_closed(&mut self, _now: Instant, graceful: bool) {
        if self.closed {
            return;
        }
        let partial = !self.rx.is_empty() || !self.reassembly.is_empty();
        let reason = if !graceful {
            CloseReason::Reset
        } else if partial {
            CloseReason::Protocol(ProtocolError::Truncated)
        } else {
            CloseReason::Graceful
        };
        match self.state {
            State::ConnSent => {
                let err = match reason {
                    CloseReason::Reset => ConnectError::Reset,
                    CloseReason::Protocol(p) => ConnectError::Protocol(p),
                    _ => ConnectError::PeerClosed,
                };
                self.finish(
                    Some(Event::ConnectReply(ConnectReply::Error(err))),
                    TcpAction::Close,
                );
            }
            State::Established if reason == CloseReason::Graceful => {
                // siw's PEER_CLOSE in RDMA mode: DISCONNECT (the iw_cm moves to CLOSING),
                // then CLOSE.
                self.events.push_back(Event::Disconnect);
                self.finish(Some(Event::Close(reason)), TcpAction::Close);
            }
            _ => self.finish(Some(Event::Close(reason)), TcpAction::Close),
        }
    }

    /// Time passed; run whatever timer is due at `now`.
    pub fn on_timer(&mut self, now: Instant) {
        if self.hold.is_some_and(|at| now >= at) && !self.closed {
            self.release_held();
        }
        let Some((at, kind)) = self.timer else {
            return;
        };
        if now < at || self.closed {
            return;
        }
        self.timer = None;
        match kind {
            // siw's MPATIMEOUT work in AWAIT_MPAREQ releases the endpoint (FIN); our RTR wait
            // ends the same way.
            TimerKind::MpaRequest | TimerKind::Rtr => {
                self.finish(Some(Event::Close(CloseReason::Timeout)), TcpAction::Close);
            }
            // siw's MPATIMEOUT in AWAIT_MPAREP: CONNECT_REPLY -ETIMEDOUT, then FIN (capture
            // e2-mpa-timeout).
            TimerKind::MpaReply => self.finish(
                Some(Event::ConnectReply(ConnectReply::Error(
                    ConnectError::Timeout,
                ))),
                TcpAction::Close,
            ),
            TimerKind::Close => {
                self.finish(Some(Event::Close(CloseReason::Timeout)), TcpAction::Reset);
            }
        }
    }

    // ----- internals -------------------------------------------------------------------------

    fn invalid(&self) -> CepError {
        CepError::InvalidState(self.state)
    }

    /// Ends the connection: one event (unless `None`), one terminal TCP action, state Idle.
    fn finish(&mut self, event: Option<Event>, action: TcpAction) {
        if self.closed {
            return;
        }
        self.closed = true;
        self.timer = None;
        self.rx.clear();
        self.reassembly.clear();
        if self.state != State::Destroying {
            self.state = State::Idle;
        }
        if let Some(e) = event {
            self.events.push_back(e);
        }
        if action == TcpAction::Reset {
            self.hold = None;
            self.held.clear();
            self.transmits.clear();
        } else {
            // A closing stream still carries what waited for the initiator, in order.
            self.release_held();
        }
        self.actions.push_back(action);
    }

    /// A protocol failure: the event that fits the state, an optional Terminate first, close.
    fn fail(&mut self, err: ProtocolError, term: Option<Terminate>) {
        if let Some(t) = term {
            self.queue_terminate(&t);
        }
        let event = if self.state == State::ConnSent {
            Event::ConnectReply(ConnectReply::Error(ConnectError::Protocol(err)))
        } else {
            Event::Close(CloseReason::Protocol(err))
        };
        self.finish(Some(event), TcpAction::Close);
    }

    /// Queues one FPDU carrying `ulpdu`, unless our write side is already shut (after a
    /// `disconnect` nothing more can be sent, not even a Terminate).
    fn push_fpdu(&mut self, ulpdu: &[u8]) -> bool {
        let mut out = Vec::new();
        if self.write_shut || emit_fpdu(ulpdu, self.crc, &mut out).is_err() {
            return false;
        }
        self.push_tx(out);
        true
    }

    fn queue_terminate(&mut self, t: &Terminate) {
        if let Ok(ulpdu) = mpa::terminate_ulpdu(QN_TERMINATE, self.tx_msn_term, t) {
            if self.push_fpdu(&ulpdu) {
                self.tx_msn_term = self.tx_msn_term.wrapping_add(1);
            }
        }
    }

    fn process_rx(&mut self, now: Instant) {
        while !self.closed && !self.rx.is_empty() && self.rx.len() >= self.rx_need {
            let progressed = match self.rx_mode {
                RxMode::Forbidden => {
                    self.fail(ProtocolError::UnexpectedData, None);
                    false
                }
                RxMode::Request => self.rx_request(now),
                RxMode::Reply => self.rx_reply(now),
                RxMode::Fpdu => self.rx_fpdu(now),
            };
            if !progressed {
                break;
            }
        }
    }

    /// Parses an MPA frame from `rx`. `Ok(None)`: more bytes needed.
    fn parse_frame(&mut self) -> Result<Option<MpaFrame>, ProtocolError> {
        match MpaFrame::parse_with_limit(self.rx.bytes(), MAX_PRIVATE_DATA) {
            Ok((f, used)) => {
                self.rx.consume(used);
                self.rx_need = 0;
                Ok(Some(f))
            }
            // Inside the key every new byte is looked at: a garbage key fails as soon as it
            // shows (as siw judges it), not only once 16 bytes came, so a stream that ends
            // early is refused the same however it was split.
            Err(WireError::Truncated {
                what: "MPA key", ..
            }) => {
                self.rx_need = self.rx.len() + 1;
                Ok(None)
            }
            Err(WireError::Truncated { need, .. }) => {
                self.rx_need = need.max(self.rx.len() + 1);
                Ok(None)
            }
            Err(WireError::BadField {
                field: "MPA key", ..
            }) => Err(ProtocolError::BadKey),
            Err(WireError::BadField {
                field: "MPA revision",
                value,
            }) => Err(ProtocolError::BadRevision(value as u8)),
            Err(e @ WireError::BadLength { .. }) => {
                let pd = match self.rx.bytes().get(18..20) {
                    Some(b) => u16::from_be_bytes([b[0], b[1]]) as usize,
                    None => 0,
                };
                if pd > MAX_PRIVATE_DATA {
                    Err(ProtocolError::PrivateDataTooLong {
                        len: pd,
                        max: MAX_PRIVATE_DATA,
                    })
                } else {
                    Err(ProtocolError::Malformed(e))
                }
            }
            Err(e) => Err(ProtocolError::Malformed(e)),
        }
    }

    /// Passive: the MPA Request (`siw_proc_mpareq`).
    fn rx_request(&mut self, _now: Instant) -> bool {
        let frame = match self.parse_frame() {
            Ok(Some(f)) => f,
            Ok(None) => return false,
            Err(e) => {
                // siw_proc_mpareq: an enhanced Request with no room for its IRD/ORD words is
                // refused with a Reply, as markers are; with bytes after it, siw's read of
                // the frame fails first and nothing is sent.
                if let Some(short) = ShortEnhanced::of(self.rx.bytes(), FrameKind::Request) {
                    if short.len == self.rx.len() {
                        self.push_tx(short.reject_reply().to_vec());
                    }
                }
                self.fail(e, None);
                return false;
            }
        };
        if frame.kind != FrameKind::Request {
            self.fail(ProtocolError::BadKey, None);
            return false;
        }
        let reply_revision = frame.revision.min(self.cfg.max_revision.max(REVISION_1));
        let reply_enhanced = reply_revision == REVISION_2 && frame.enhanced.is_some();
        let (cap_ird, cap_ord, rtr) = match (&frame.enhanced, reply_enhanced) {
            (Some(e), true) => {
                // Peer IRD becomes our ORD and peer ORD our IRD, each capped by the device.
                let cap_ord = e.ird.min(self.cfg.max_ord);
                let cap_ird = e.ord.min(self.cfg.max_ird);
                // siw prefers Write, then Read, and proposes Write when neither is offered; we
                // also take a Send when it is all the initiator offers.
                let pick = if e.zero_len_write_rtr {
                    RtrKind::Write
                } else if e.zero_len_read_rtr {
                    RtrKind::Read
                } else if e.zero_len_send_rtr {
                    RtrKind::Send
                } else {
                    RtrKind::Write
                };
                let rtr = e.peer_to_peer.then_some(pick);
                (cap_ird, cap_ord, rtr)
            }
            _ => (0, 0, None),
        };
        let req = PeerRequest {
            frame: frame.clone(),
            reply_revision,
            reply_enhanced,
            cap_ird,
            cap_ord,
            rtr,
        };
        if !self.rx.is_empty() {
            // RFC 5044 §7.1.2: the initiator sends nothing more until it has the Reply
            // (siw: "peer sent extra data", -EPROTO). siw's read of the frame fails on them
            // before `siw_proc_mpareq` looks at any flag: nothing is sent, not even the
            // reject Reply that markers would get.
            self.fail(ProtocolError::UnexpectedData, None);
            return false;
        }
        if frame.flags.markers {
            // siw_proc_mpareq: markers are not supported; answer with R set, M cleared, no
            // private data, and drop the connection.
            let mut rej = reject_frame(&req, &[]);
            if let Some(e) = rej.enhanced.as_mut() {
                *e = Enhanced::new(0, 0);
            }
            if let Ok(b) = rej.to_vec() {
                self.push_tx(b);
            }
            self.fail(ProtocolError::MarkersRequested, None);
            return false;
        }
        let enhanced = frame.enhanced;
        self.events.push_back(Event::ConnectRequest(ConnectRequest {
            revision: frame.revision,
            enhanced: enhanced.is_some(),
            ird: enhanced.map(|e| e.ird),
            ord: enhanced.map(|e| e.ord),
            p2p: enhanced.filter(|e| e.peer_to_peer).map(|e| RtrModes {
                send: e.zero_len_send_rtr,
                write: e.zero_len_write_rtr,
                read: e.zero_len_read_rtr,
            }),
            crc: frame.flags.crc,
            private_data: frame.private_data.clone(),
        }));
        self.peer_request = Some(req);
        // siw keeps no timer while the user decides (its MPA timer only acts in AWAIT_MPAREQ
        // and AWAIT_MPAREP).
        self.timer = None;
        self.state = State::ConnRecv;
        self.rx_mode = RxMode::Forbidden;
        false
    }

    /// Active: the MPA Reply (`siw_proc_mpareply`).
    fn rx_reply(&mut self, _now: Instant) -> bool {
        let Some(ours) = self.our_request.clone() else {
            self.fail(ProtocolError::UnexpectedData, None);
            return false;
        };
        let frame = match self.parse_frame() {
            Ok(Some(f)) if f.kind == FrameKind::Reply => f,
            Ok(None) => return false,
            Ok(Some(_)) | Err(ProtocolError::BadKey) => {
                // siw answers a wrong key with a Terminate (LLP, invalid Request/Reply); CRC
                // as far as we asked for it.
                self.crc = ours.flags.crc;
                self.fail(
                    ProtocolError::BadKey,
                    Some(Terminate::llp(llp_ecode::INVALID_REQ_REP)),
                );
                return false;
            }
            Err(e) => {
                // siw_proc_mpareply looks at R before anything about the enhanced words, so
                // a reject Reply too short for them (as siw sends for such a Request) is a
                // reject all the same.
                if let Some(short) = ShortEnhanced::of(self.rx.bytes(), FrameKind::Reply) {
                    if short.flags.reject {
                        self.rx.consume(short.len);
                        self.finish(
                            Some(Event::ConnectReply(ConnectReply::Rejected {
                                revision: REVISION_2,
                                private_data: Vec::new(),
                            })),
                            TcpAction::Close,
                        );
                        return false;
                    }
                }
                self.fail(e, None);
                return false;
            }
        };
        if frame.flags.reject {
            self.finish(
                Some(Event::ConnectReply(ConnectReply::Rejected {
                    revision: frame.revision,
                    private_data: frame.private_data,
                })),
                TcpAction::Close,
            );
            return false;
        }
        if frame.flags.markers {
            self.fail(ProtocolError::MarkersRequested, None);
            return false;
        }
        if frame.revision > ours.revision {
            self.fail(ProtocolError::RevisionMismatch, None);
            return false;
        }
        let crc = mpa::crc_negotiated(&ours, &frame);
        self.crc = crc;
        let (mut ird, mut ord) = self.local_ird_ord;
        let (mut enhanced, mut rtr) = (false, None);
        if let Some(mine) = ours.enhanced {
            match frame.enhanced {
                Some(rep) => {
                    enhanced = true;
                    // Relaxed negotiation: take the responder's values; only an ORD beyond
                    // what this device could ever serve is fatal.
                    if rep.ord > ird && rep.ord > self.cfg.max_ird {
                        self.fail(
                            ProtocolError::InsufficientIrd,
                            Some(Terminate::llp(llp_ecode::INSUFFICIENT_IRD)),
                        );
                        return false;
                    }
                    ird = rep.ord;
                    ord = rep.ird;
                    if mine.peer_to_peer {
                        let offered = RtrModes {
                            send: mine.zero_len_send_rtr,
                            write: mine.zero_len_write_rtr,
                            read: mine.zero_len_read_rtr,
                        };
                        let picked = if rep.zero_len_write_rtr && offered.write {
                            Some(RtrKind::Write)
                        } else if rep.zero_len_read_rtr && offered.read {
                            Some(RtrKind::Read)
                        } else if rep.zero_len_send_rtr && offered.send {
                            Some(RtrKind::Send)
                        } else {
                            None
                        };
                        if picked.is_none() {
                            self.fail(
                                ProtocolError::NoMatchingRtr,
                                Some(Terminate::llp(llp_ecode::NO_MATCHING_RTR)),
                            );
                            return false;
                        }
                        rtr = picked;
                    }
                }
                None if frame.revision == REVISION_1 && self.cfg.accept_v1_reply => {
                    // An RFC 5044 responder: no IRD/ORD exchange, no RTR. Keep our own values.
                }
                None => {
                    // siw: "the responder MUST reply with MPA version 2 and MUST set the
                    // Enhanced flag" once the initiator did.
                    self.fail(ProtocolError::RevisionMismatch, None);
                    return false;
                }
            }
        }
        let neg = Negotiated {
            revision: frame.revision,
            enhanced,
            crc,
            ird,
            ord,
            rtr,
            private_data: frame.private_data,
        };
        self.neg = Some(neg.clone());
        self.timer = None;
        self.state = State::Established;
        self.rx_mode = RxMode::Fpdu;
        self.rx_need = 0;
        // siw sends the RTR frame before its CONNECT_REPLY upcall.
        if let Some(kind) = rtr {
            self.queue_rtr(kind);
        }
        self.events
            .push_back(Event::ConnectReply(ConnectReply::Accepted(neg)));
        true
    }

    /// Active, peer-to-peer: the zero-length operation that tells the responder it may send.
    fn queue_rtr(&mut self, kind: RtrKind) {
        let ulpdu = match kind {
            RtrKind::Write => DdpRdmapHeader::tagged(RdmapOpcode::RdmaWrite, RTR_STAG, 0).to_vec(),
            RtrKind::Read => {
                let h = DdpRdmapHeader::untagged(
                    RdmapOpcode::RdmaReadRequest,
                    QN_READ_REQUEST,
                    self.tx_msn_read,
                    0,
                );
                self.tx_msn_read = self.tx_msn_read.wrapping_add(1);
                self.awaiting_read_response = true;
                let rr = ReadRequest {
                    sink_stag: 0,
                    sink_to: 0,
                    size: 0,
                    source_stag: RTR_STAG,
                    source_to: 0,
                };
                h.to_vec().map(|mut v| {
                    v.extend_from_slice(&rr.to_bytes());
                    v
                })
            }
            RtrKind::Send => {
                let h = DdpRdmapHeader::untagged(RdmapOpcode::Send, QN_SEND, self.tx_msn_send, 0);
                self.tx_msn_send = self.tx_msn_send.wrapping_add(1);
                h.to_vec()
            }
        };
        if let Ok(u) = ulpdu {
            self.push_fpdu(&u);
        }
    }

    /// One FPDU from `rx`.
    fn rx_fpdu(&mut self, _now: Instant) -> bool {
        let (ulpdu, crc_ok) = match mpa::Fpdu::parse(self.rx.bytes()) {
            Ok((f, used)) => {
                let ok = !self.crc || f.verify_crc().is_ok();
                let u = f.ulpdu.to_vec();
                self.rx.consume(used);
                self.rx_need = 0;
                (u, ok)
            }
            Err(WireError::Truncated { need, .. }) => {
                self.rx_need = need.max(self.rx.len() + 1);
                return false;
            }
            Err(e) => {
                self.fail(ProtocolError::Malformed(e), None);
                return false;
            }
        };
        if !crc_ok {
            self.fail(
                ProtocolError::BadCrc,
                Some(Terminate::llp(llp_ecode::CRC_ERROR)),
            );
            return false;
        }
        // The initiator's first FPDU: a responder's may follow (RFC 5044, see
        // `CepConfig::responder_hold`).
        self.release_held();
        let (hdr, hlen) = match DdpRdmapHeader::parse(&ulpdu) {
            Ok(x) => x,
            Err(e) => {
                let tagged = ulpdu.first().is_some_and(|b| b & 0x80 != 0);
                let (layer, etype, ecode) = match e {
                    WireError::BadField {
                        field: "RDMAP version",
                        ..
                    } => (
                        term_layer::RDMAP,
                        term_etype::RDMAP_REMOTE_OPERATION,
                        RDMAP_BAD_VERSION,
                    ),
                    WireError::BadField {
                        field: "DDP version",
                        ..
                    } if tagged => (
                        term_layer::DDP,
                        term_etype::DDP_TAGGED_BUFFER,
                        DDP_TAGGED_BAD_VERSION,
                    ),
                    WireError::BadField {
                        field: "DDP version",
                        ..
                    } => (
                        term_layer::DDP,
                        term_etype::DDP_UNTAGGED_BUFFER,
                        DDP_UNTAGGED_BAD_VERSION,
                    ),
                    _ => (
                        term_layer::DDP,
                        term_etype::DDP_CATASTROPHIC,
                        DDP_CATASTROPHIC_LOCAL,
                    ),
                };
                self.header_error(&ulpdu, layer, etype, ecode);
                return false;
            }
        };
        let payload = &ulpdu[hlen..];
        if let Some(kind) = self.awaiting_rtr {
            // A Terminate in place of the RTR (an initiator that cannot go on, RFC 6581) is
            // the peer's close, handled as once established: not a wrong RTR to answer with
            // a Terminate of our own.
            let terminate = hdr.opcode == RdmapOpcode::Terminate
                && matches!(hdr.buffer, DdpBuffer::Untagged { qn, .. } if qn == QN_TERMINATE);
            if !terminate {
                return self.rx_rtr(kind, &hdr, payload);
            }
        }
        self.rx_message(&ulpdu, &hdr, payload)
    }

    /// Passive, peer-to-peer: the first FPDU must be the agreed RTR (RFC 6581).
    fn rx_rtr(&mut self, kind: RtrKind, h: &DdpRdmapHeader, payload: &[u8]) -> bool {
        let matches = payload.is_empty()
            && match (kind, h.opcode, h.buffer) {
                (RtrKind::Write, RdmapOpcode::RdmaWrite, DdpBuffer::Tagged { .. }) => true,
                (RtrKind::Send, RdmapOpcode::Send, DdpBuffer::Untagged { qn, msn, mo, .. }) => {
                    qn == QN_SEND && msn == self.rx_msn_send && mo == 0 && h.last
                }
                _ => false,
            };
        let read_matches = kind == RtrKind::Read
            && h.opcode == RdmapOpcode::RdmaReadRequest
            && matches!(h.buffer, DdpBuffer::Untagged { qn, msn, .. }
                if qn == QN_READ_REQUEST && msn == self.rx_msn_read)
            && ReadRequest::parse(payload).is_ok_and(|r| r.size == 0);
        if !matches && !read_matches {
            self.fail(
                ProtocolError::NoMatchingRtr,
                Some(Terminate::llp(llp_ecode::NO_MATCHING_RTR)),
            );
            return false;
        }
        match kind {
            RtrKind::Send => self.rx_msn_send = self.rx_msn_send.wrapping_add(1),
            RtrKind::Read => {
                self.rx_msn_read = self.rx_msn_read.wrapping_add(1);
                if let Ok(r) = ReadRequest::parse(payload) {
                    self.queue_read_response(r);
                }
            }
            RtrKind::Write => {}
        }
        self.awaiting_rtr = None;
        self.timer = None;
        self.state = State::Established;
        if let Some(neg) = self.neg.clone() {
            self.events.push_back(Event::Established(neg));
        }
        true
    }

    /// A zero-length RDMA Read Response to a zero-length Read Request.
    fn queue_read_response(&mut self, r: ReadRequest) {
        let h = DdpRdmapHeader::tagged(RdmapOpcode::RdmaReadResponse, r.sink_stag, r.sink_to);
        if let Ok(u) = h.to_vec() {
            if self.push_fpdu(&u) {
                self.unwritten_read_responses.push_back(self.tx_queued);
            }
        }
    }

    /// Established or Closing: one DDP segment.
    fn rx_message(&mut self, ulpdu: &[u8], h: &DdpRdmapHeader, payload: &[u8]) -> bool {
        use term_etype::{
            DDP_TAGGED_BUFFER as TAGGED, DDP_UNTAGGED_BUFFER as UNTAGGED,
            RDMAP_REMOTE_OPERATION as REMOTE_OP, RDMAP_REMOTE_PROTECTION as REMOTE_PROT,
        };
        match (h.opcode, h.buffer) {
            (RdmapOpcode::Terminate, DdpBuffer::Untagged { qn, .. }) if qn == QN_TERMINATE => {
                let reason = match Terminate::parse(payload) {
                    Ok(t) => CloseReason::PeerTerminated(t),
                    Err(e) => CloseReason::Protocol(ProtocolError::Malformed(e)),
                };
                self.finish(Some(Event::Close(reason)), TcpAction::Close);
                false
            }
            (
                RdmapOpcode::Send
                | RdmapOpcode::SendSe
                | RdmapOpcode::SendInvalidate
                | RdmapOpcode::SendSeInvalidate,
                DdpBuffer::Untagged { qn, msn, mo, .. },
            ) => {
                // A Send's first segment takes a receive buffer: with none free (every one
                // holds a message the application has not taken), siw's siw_proc_send
                // terminates the stream before looking at the header ("Invalid MSN - no
                // buffer available", RFC 5041 §7.2): a peer cannot make us hold more.
                if self.reassembly.is_empty()
                    && self.undelivered.len() >= self.cfg.recv_queue.max(1)
                {
                    self.header_error(ulpdu, term_layer::DDP, UNTAGGED, DDP_UNTAGGED_NO_BUFFER);
                    return false;
                }
                // So does a segment that would take the bytes held for the application past
                // `recv_bytes` (never below one longest message): the buffers are full.
                let held = self.undelivered_bytes + self.reassembly.len() + payload.len();
                if held > self.cfg.recv_bytes.max(self.cfg.max_recv_message) {
                    self.header_error(ulpdu, term_layer::DDP, UNTAGGED, DDP_UNTAGGED_NO_BUFFER);
                    return false;
                }
                if qn != QN_SEND {
                    self.header_error(ulpdu, term_layer::DDP, UNTAGGED, DDP_UNTAGGED_INVALID_QN);
                    return false;
                }
                if msn != self.rx_msn_send {
                    self.header_error(ulpdu, term_layer::DDP, UNTAGGED, DDP_UNTAGGED_MSN_RANGE);
                    return false;
                }
                if mo as usize != self.reassembly.len() {
                    self.header_error(ulpdu, term_layer::DDP, UNTAGGED, DDP_UNTAGGED_INVALID_MO);
                    return false;
                }
                if self.reassembly.len() + payload.len() > self.cfg.max_recv_message {
                    self.header_error(ulpdu, term_layer::DDP, UNTAGGED, DDP_UNTAGGED_TOO_LONG);
                    return false;
                }
                self.reassembly.extend_from_slice(payload);
                if h.last {
                    self.rx_msn_send = self.rx_msn_send.wrapping_add(1);
                    let msg = std::mem::take(&mut self.reassembly);
                    self.undelivered.push_back(msg.len());
                    self.undelivered_bytes += msg.len();
                    self.events.push_back(Event::Message(msg));
                }
                true
            }
            (RdmapOpcode::RdmaReadResponse, DdpBuffer::Tagged { .. })
                if self.awaiting_read_response && payload.is_empty() =>
            {
                self.awaiting_read_response = false;
                true
            }
            // A zero-length Write touches no memory; siw does not check its STag.
            (RdmapOpcode::RdmaWrite, DdpBuffer::Tagged { .. }) if payload.is_empty() => true,
            (RdmapOpcode::RdmaWrite | RdmapOpcode::RdmaReadResponse, DdpBuffer::Tagged { .. }) => {
                // No memory is registered with this engine: every STag is invalid.
                self.header_error(ulpdu, term_layer::DDP, TAGGED, DDP_TAGGED_INVALID_STAG);
                false
            }
            (RdmapOpcode::RdmaReadRequest, DdpBuffer::Untagged { qn, msn, .. })
                if qn == QN_READ_REQUEST =>
            {
                if msn != self.rx_msn_read {
                    self.header_error(ulpdu, term_layer::DDP, UNTAGGED, DDP_UNTAGGED_MSN_RANGE);
                    return false;
                }
                // A read beyond our IRD (RFC 5040 §6.6: the requester keeps to the ORD it was
                // given, which is our IRD); with IRD 0 every read. siw's siw_init_rresp
                // terminates the stream when its inbound read queue is full. An answered
                // read counts until its response is written to the socket.
                let ird = self.neg.as_ref().map_or(0, |n| usize::from(n.ird));
                if self.unwritten_read_responses.len() >= ird {
                    self.header_error(
                        ulpdu,
                        term_layer::RDMAP,
                        REMOTE_OP,
                        RDMAP_CATASTROPHIC_STREAM,
                    );
                    return false;
                }
                match ReadRequest::parse(payload) {
                    Ok(r) if r.size == 0 => {
                        self.rx_msn_read = self.rx_msn_read.wrapping_add(1);
                        self.queue_read_response(r);
                        true
                    }
                    _ => {
                        self.header_error(
                            ulpdu,
                            term_layer::RDMAP,
                            REMOTE_PROT,
                            RDMAP_INVALID_STAG,
                        );
                        false
                    }
                }
            }
            (_, DdpBuffer::Untagged { qn, .. }) if qn > QN_TERMINATE => {
                self.header_error(ulpdu, term_layer::DDP, UNTAGGED, DDP_UNTAGGED_INVALID_QN);
                false
            }
            _ => {
                self.header_error(ulpdu, term_layer::RDMAP, REMOTE_OP, RDMAP_UNEXPECTED_OPCODE);
                false
            }
        }
    }

    /// Answers an unacceptable segment with a Terminate that carries its DDP segment length and
    /// (when whole) a copy of its DDP header, then closes.
    fn header_error(&mut self, ulpdu: &[u8], layer: u8, error_type: u8, error_code: u8) {
        let hlen = match ulpdu.first() {
            Some(b) if b & 0x80 != 0 => mpa::TAGGED_HEADER_LEN,
            _ => UNTAGGED_HEADER_LEN,
        };
        let whole = ulpdu.len() >= hlen;
        let term = Terminate {
            layer,
            error_type,
            error_code,
            m: true,
            d: whole,
            r: false,
            reserved: 0,
            ddp_segment_length: Some(ulpdu.len() as u16),
            copied_headers: if whole {
                ulpdu[..hlen].to_vec()
            } else {
                Vec::new()
            },
        };
        self.fail(
            ProtocolError::BadHeader {
                layer,
                error_type,
                error_code,
            },
            Some(term),
        );
    }
}

/// Fails unless `pd` fits Linux's limit: 256 bytes, or 252 after the revision-2 IRD/ORD words
/// (siw_accept's rule; siw_connect forgets the 4 bytes, and a peer then refuses the frame).
fn check_pd(pd: &[u8], enhanced: bool) -> Result<(), CepError> {
    let max = if enhanced {
        ENHANCED_USER_MAX
    } else {
        MAX_PRIVATE_DATA
    };
    if pd.len() > max {
        return Err(CepError::PrivateDataTooLong { len: pd.len(), max });
    }
    Ok(())
}

fn check_ird_ord(value: u16, device_max: u16) -> Result<(), CepError> {
    let max = device_max.min(IRD_ORD_MAX);
    if value > max {
        return Err(CepError::IrdOrdTooLarge { value, max });
    }
    Ok(())
}

fn set_rtr(e: &mut Enhanced, kind: RtrKind) {
    match kind {
        RtrKind::Send => e.zero_len_send_rtr = true,
        RtrKind::Write => e.zero_len_write_rtr = true,
        RtrKind::Read => e.zero_len_read_rtr = true,
    }
}

/// The rejecting Reply siw builds from the Request's header (`siw_reject`): same revision
/// (capped), C echoed, R set, and in an enhanced exchange the IRD/ORD words it had prepared.
fn reject_frame(req: &PeerRequest, private_data: &[u8]) -> MpaFrame {
    let mut f = if req.reply_enhanced {
        let mut e = Enhanced::new(req.cap_ird, req.cap_ord);
        if let Some(kind) = req.rtr {
            e.peer_to_peer = true;
            set_rtr(&mut e, kind);
        }
        MpaFrame::reject_v2(0, 0, private_data.to_vec()).with_enhanced(e)
    } else {
        let mut f = MpaFrame::reject_v1(private_data.to_vec());
        f.revision = req.reply_revision;
        f
    };
    f.flags = MpaFlags {
        crc: req.frame.flags.crc,
        ..f.flags
    };
    f
}

/// A whole revision-2 frame with the Enhanced flag but PD_Length below 4, which
/// [`MpaFrame::parse`] refuses: what is needed to answer or judge it as siw does.
struct ShortEnhanced {
    flags: MpaFlags,
    /// Header and private data, in bytes.
    len: usize,
}

impl ShortEnhanced {
    /// `bytes` starts with such a frame of `kind`, all of it present.
    fn of(bytes: &[u8], kind: FrameKind) -> Option<Self> {
        let h = bytes.first_chunk::<{ mpa::MPA_FRAME_HEADER_LEN }>()?;
        let flags = MpaFlags::from_byte(h[16]);
        let pd_len = usize::from(u16::from_be_bytes([h[18], h[19]]));
        let len = mpa::MPA_FRAME_HEADER_LEN + pd_len;
        let short = h[..16] == *kind.key()
            && h[17] == REVISION_2
            && flags.enhanced
            && pd_len < mpa::ENHANCED_LEN
            && bytes.len() >= len;
        short.then_some(ShortEnhanced { flags, len })
    }

    /// siw's answer to such a Request: the Request's header with the Reply key, R set,
    /// M cleared and no private data (the Enhanced flag stays, with no IRD/ORD words).
    fn reject_reply(&self) -> [u8; mpa::MPA_FRAME_HEADER_LEN] {
        let mut r = [0u8; mpa::MPA_FRAME_HEADER_LEN];
        r[..16].copy_from_slice(&mpa::REP_KEY);
        r[16] = MpaFlags {
            reject: true,
            markers: false,
            ..self.flags
        }
        .to_byte();
        r[17] = REVISION_2;
        r
    }
}

/// Replaces the IRD/ORD words of an enhanced frame (the rcm-wire builders take only IRD/ORD).
trait WithEnhanced {
    fn with_enhanced(self, e: Enhanced) -> Self;
}

impl WithEnhanced for MpaFrame {
    fn with_enhanced(mut self, e: Enhanced) -> Self {
        self.enhanced = Some(e);
        self
    }
}
