//! The receive side of the IB CM engine against Linux's drivers/infiniband/core/cm.c: REJ
//! reception (`cm_rej_handler`, `cm_acquire_rejected_id`: a REJ(TIMEOUT) is found only by
//! the sender's comm ID and the CA GUID in its ARI), duplicate and stale REQs
//! (`cm_match_req`, `cm_dup_req_handler`, `cm_issue_rej`) and duplicate REPs
//! (`cm_dup_rep_handler`), for the transitions no other test pins down.

#[path = "support/harness.rs"]
mod harness;
#[path = "support/timers.rs"]
mod timers;
use harness::{dreq, peer_rep, peer_req, PEER_GUID, PEER_ID, PEER_QPN, SID, T, TID};
use rcm_proto::ib::{CepHandle, CmEvent, State};
use rcm_wire::cm::{self, CmMessage, Dreq, MsgCode, Rej, RejReason};
use std::time::Duration;

const MY_QPN: u32 = 0x22;

impl T {
    /// `connect`, with our comm ID in place of the REQ.
    fn connect_id(&mut self) -> (CepHandle, u32, u64) {
        let (h, req, tid) = self.connect();
        (h, req.local_comm_id, tid)
    }

    /// Active side in MRA_REQ_RCVD; returns (handle, our comm id, tid).
    fn mra_req_rcvd(&mut self) -> (CepHandle, u32, u64) {
        let (h, id, tid) = self.connect_id();
        self.recv(
            tid,
            CmMessage::Mra(cm::Mra {
                local_comm_id: PEER_ID,
                remote_comm_id: id,
                message_mraed: MsgCode::Req,
                service_timeout: 20,
                ..cm::Mra::default()
            }),
        );
        self.events();
        assert_eq!(self.ep.state(h), Some(State::MraReqRcvd));
        (h, id, tid)
    }
}

fn rej(local: u32, remote: u32, msg: MsgCode, reason: RejReason) -> Rej {
    Rej {
        local_comm_id: local,
        remote_comm_id: remote,
        message_rejected: msg,
        reason,
        ..Rej::default()
    }
}

/// A REJ(TIMEOUT) as Linux's `cm_destroy_id` sends it from REQ_SENT: the sender's CA GUID
/// as 8 bytes of ARI.
fn timeout_rej(local: u32, remote: u32, ari_guid: u64, ari_len: u8) -> CmMessage {
    let mut ari = vec![0u8; 72];
    ari[..8].copy_from_slice(&ari_guid.to_be_bytes());
    CmMessage::Rej(Rej {
        local_comm_id: local,
        remote_comm_id: remote,
        message_rejected: MsgCode::Other,
        reject_info_length: ari_len,
        reason: RejReason::Timeout,
        ari,
        ..Rej::default()
    })
}

fn rejected(ev: &[(CepHandle, CmEvent)], h: CepHandle, want: RejReason) -> bool {
    matches!(ev, [(eh, CmEvent::Rejected { reason, .. })] if *eh == h && *reason == want)
}

// =========================================================================================
// REJ(TIMEOUT) lookup.
//
// Linux `cm_acquire_rejected_id`: when the reason is IB_CM_REJ_TIMEOUT the id is found
// *only* through `cm_find_remote_id(ARI[0..8] as CA GUID, REJ.local_comm_id)` — the
// remote-ID tree — whatever the REJ's remote comm ID field says (and whatever its ARI
// length field says). Until the fifteenth session rcm used that tree only when the REJ's
// remote comm ID was 0 and the ARI length at least 8, and the comm-ID pair otherwise.
// =========================================================================================

/// A REJ(TIMEOUT) naming an established connection by both comm IDs, but whose ARI is not
/// the peer's CA GUID: `cm_find_remote_id(wrong GUID, PEER_ID)` finds nothing, Linux drops
/// the REJ and the connection stays up.
#[test]
fn timeout_rej_with_a_wrong_ari_guid_does_not_end_a_connection() {
    let mut t = T::new();
    let (c, id) = t.established_passive();
    t.recv(TID, timeout_rej(PEER_ID, id, 0x0bad_0bad_0bad_0bad, 8));
    assert!(
        t.events().is_empty(),
        "Linux looks a REJ(TIMEOUT) up by ARI GUID + peer comm ID only"
    );
    assert_eq!(t.ep.state(c), Some(State::Established));
}

/// The active side, in REQ_SENT, has no entry in the remote-ID tree (it only gets one on the
/// REP). A REJ(TIMEOUT) carrying its comm ID and the peer's GUID is therefore not matched by
/// Linux, which goes on retrying its REQ. (Not the documented REJ(OTHER) difference:
/// reason TIMEOUT never takes the pair lookup in Linux.)
#[test]
fn timeout_rej_does_not_reach_an_active_side_in_req_sent() {
    let mut t = T::new();
    let (h, id, tid) = t.connect_id();
    t.recv(tid, timeout_rej(PEER_ID, id, PEER_GUID, 8));
    assert!(t.events().is_empty());
    assert_eq!(t.ep.state(h), Some(State::ReqSent));
}

/// With the right ARI GUID and peer comm ID, Linux finds the id even when the REJ's remote
/// comm ID field is not ours (it is not read for reason TIMEOUT): REP_SENT → IDLE with a REJ
/// event.
#[test]
fn timeout_rej_is_found_by_ari_whatever_its_remote_comm_id() {
    let mut t = T::new();
    let (_, c, id) = t.rep_sent();
    t.recv(TID, timeout_rej(PEER_ID, id ^ 0x00ff_0000, PEER_GUID, 8));
    let ev = t.events();
    assert!(rejected(&ev, c, RejReason::Timeout), "{ev:?}");
    assert_eq!(t.ep.state(c), Some(State::Idle));
}

/// `cm_acquire_rejected_id` reads the first 8 ARI bytes as the GUID without looking at the
/// ARI length field.
#[test]
fn timeout_rej_ari_length_is_not_checked() {
    let mut t = T::new();
    let (_, c, _) = t.rep_sent();
    t.recv(TID, timeout_rej(PEER_ID, 0, PEER_GUID, 0));
    let ev = t.events();
    assert!(rejected(&ev, c, RejReason::Timeout), "{ev:?}");
    assert_eq!(t.ep.state(c), Some(State::Idle));
}

// =========================================================================================
// REJ reception: state transitions (cm_rej_handler).
// =========================================================================================

/// REQ_SENT / MRA_REQ_RCVD: a REJ(STALE_CONN) sends the attempt to timewait (and
/// TIMEWAIT_EXIT follows), any other reason to IDLE.
#[test]
fn rej_stale_conn_in_req_sent_and_mra_req_rcvd_enters_timewait() {
    for mra in [false, true] {
        let mut t = T::new();
        let (h, id, tid) = if mra {
            t.mra_req_rcvd()
        } else {
            t.connect_id()
        };
        t.recv(
            tid,
            CmMessage::Rej(rej(0, id, MsgCode::Req, RejReason::StaleConn)),
        );
        let ev = t.events();
        assert!(rejected(&ev, h, RejReason::StaleConn), "{ev:?}");
        assert_eq!(t.ep.state(h), Some(State::Timewait));
        t.advance(Duration::from_secs(60));
        assert_eq!(t.events(), vec![(h, CmEvent::TimewaitExit)]);
        assert_eq!(t.ep.state(h), Some(State::Idle));
        t.nothing_sent();
    }
    let mut t = T::new();
    let (h, id, tid) = t.mra_req_rcvd();
    t.recv(
        tid,
        CmMessage::Rej(rej(0, id, MsgCode::Req, RejReason::ConsumerDefined)),
    );
    assert!(rejected(&t.events(), h, RejReason::ConsumerDefined));
    assert_eq!(t.ep.state(h), Some(State::Idle));
}

/// Passive REQ_RCVD / MRA_REQ_SENT / REP_SENT: a REJ(TIMEOUT) found through the peer's comm ID
/// and GUID idles them; a REJ(STALE_CONN) by comm-ID pair sends REP_SENT to timewait.
#[test]
fn rej_on_the_passive_side_before_the_rtu() {
    for mra in [false, true] {
        let mut t = T::new();
        let (_, c, _) = t.req_rcvd();
        if mra {
            t.ep.mra(c, 20, true).unwrap();
        }
        t.recv(TID, timeout_rej(PEER_ID, 0, PEER_GUID, 8));
        assert!(rejected(&t.events(), c, RejReason::Timeout));
        assert_eq!(t.ep.state(c), Some(State::Idle));
        // The peer's next REQ with the same comm ID is a new request, not a duplicate.
        t.recv(TID + 1, CmMessage::Req(peer_req(PEER_ID, PEER_QPN)));
        assert!(matches!(
            t.events().as_slice(),
            [(_, CmEvent::ReqReceived { .. })]
        ));
    }
    let mut t = T::new();
    let (_, c, id) = t.rep_sent();
    t.recv(
        TID,
        CmMessage::Rej(rej(PEER_ID, id, MsgCode::Rep, RejReason::StaleConn)),
    );
    assert!(rejected(&t.events(), c, RejReason::StaleConn));
    assert_eq!(t.ep.state(c), Some(State::Timewait));
}

/// REP_RCVD, MRA_REP_SENT and DREQ_SENT: any REJ (naming a REP or another message) enters
/// timewait.
#[test]
fn rej_after_the_rep_or_during_disconnect_enters_timewait() {
    for step in 0..3 {
        let mut t = T::new();
        let (h, id, tid) = t.rep_rcvd();
        match step {
            0 => {}
            1 => {
                t.ep.mra(h, 20, false).unwrap();
                t.sent();
            }
            _ => {
                t.ep.establish(h).unwrap();
                t.sent();
                t.events();
                t.ep.disconnect(t.now, h, &[]).unwrap();
                assert!(matches!(t.sent_one().msg, CmMessage::Dreq(_)));
            }
        }
        t.recv(
            tid,
            CmMessage::Rej(rej(PEER_ID, id, MsgCode::Other, RejReason::ConsumerDefined)),
        );
        assert!(
            rejected(&t.events(), h, RejReason::ConsumerDefined),
            "step {step}"
        );
        assert_eq!(t.ep.state(h), Some(State::Timewait), "step {step}");
        // The DREQ is not retried any more.
        t.advance(Duration::from_secs(60));
        t.nothing_sent();
    }
}

/// DREQ_RCVD and TIMEWAIT are not in cm_rej_handler's switch: the REJ is dropped.
#[test]
fn rej_in_dreq_rcvd_or_timewait_is_ignored() {
    let mut t = T::new();
    let (c, id) = t.established_passive();
    t.recv(
        0x77,
        CmMessage::Dreq(Dreq {
            local_comm_id: PEER_ID,
            remote_comm_id: id,
            remote_qpn: MY_QPN,
            ..Dreq::default()
        }),
    );
    assert!(matches!(
        t.events().as_slice(),
        [(_, CmEvent::DreqReceived { .. })]
    ));
    t.recv(
        TID,
        CmMessage::Rej(rej(PEER_ID, id, MsgCode::Other, RejReason::ConsumerDefined)),
    );
    assert!(t.events().is_empty());
    assert_eq!(t.ep.state(c), Some(State::DreqRcvd));
    t.ep.disconnect(t.now, c, &[]).unwrap();
    t.sent();
    t.recv(
        TID,
        CmMessage::Rej(rej(PEER_ID, id, MsgCode::Other, RejReason::ConsumerDefined)),
    );
    assert!(t.events().is_empty());
    assert_eq!(t.ep.state(c), Some(State::Timewait));
}

// =========================================================================================
// Duplicate / stale REQ (cm_match_req, cm_dup_req_handler).
// =========================================================================================

/// `cm_dup_req_handler` answers only REQ_RCVD (silently), MRA_REQ_SENT (MRA) and TIMEWAIT;
/// ESTABLISHED, DREQ_SENT and DREQ_RCVD send nothing, and no new request is made.
#[test]
fn duplicate_req_after_the_rtu_sends_nothing() {
    for step in 0..3 {
        let mut t = T::new();
        let (c, id) = t.established_passive();
        if step >= 1 {
            if step == 1 {
                t.ep.disconnect(t.now, c, &[]).unwrap();
            } else {
                t.recv(
                    0x77,
                    CmMessage::Dreq(Dreq {
                        local_comm_id: PEER_ID,
                        remote_comm_id: id,
                        remote_qpn: MY_QPN,
                        ..Dreq::default()
                    }),
                );
            }
            t.sent();
            t.events();
        }
        let before = t.ep.state(c);
        t.recv(TID, CmMessage::Req(peer_req(PEER_ID, PEER_QPN)));
        t.nothing_sent();
        assert!(t.events().is_empty(), "step {step}");
        assert_eq!(t.ep.state(c), before);
        assert_eq!(t.ep.cep_count(), 1, "no new connection endpoint");
    }
}

/// An eager MRA is sent again for every copy of the REQ (MRA_REQ_SENT), with the REQ's TID.
#[test]
fn duplicate_req_after_an_eager_mra_resends_the_mra() {
    let mut t = T::new();
    let (_, c, id) = t.req_rcvd();
    t.ep.mra(c, 21, false).unwrap();
    assert!(matches!(t.sent_one().msg, CmMessage::Mra(_)));
    for _ in 0..2 {
        t.recv(TID, CmMessage::Req(peer_req(PEER_ID, PEER_QPN)));
        let m = t.sent_one();
        assert_eq!(m.header.tid, TID);
        let CmMessage::Mra(mra) = m.msg else { panic!() };
        assert_eq!(
            (
                mra.local_comm_id,
                mra.remote_comm_id,
                mra.message_mraed,
                mra.service_timeout
            ),
            (id, PEER_ID, MsgCode::Req, 21)
        );
    }
    assert!(t.events().is_empty());
}

/// A duplicate REQ is recognised before the listener is looked up: with the listener gone
/// it still gets the MRA, not REJ(INVALID_SERVICE_ID).
#[test]
fn duplicate_req_is_recognised_before_the_listener_lookup() {
    let mut t = T::new();
    let (l, c, _) = t.req_rcvd();
    t.ep.mra(c, 20, true).unwrap();
    t.ep.destroy(t.now, l).unwrap();
    t.recv(TID, CmMessage::Req(peer_req(PEER_ID, PEER_QPN)));
    assert!(matches!(t.sent_one().msg, CmMessage::Mra(_)));
}

/// The stale-QPN check comes before the listener lookup, and an old connection that is not
/// ESTABLISHED gets no DREQ (`ib_send_cm_dreq` refuses other states): REJ(STALE_CONN) only,
/// built from the REQ (`cm_issue_rej`), with the REQ's TID.
#[test]
fn stale_req_against_a_connection_not_yet_established_rejects_only() {
    let mut t = T::new();
    let (_, c, _) = t.rep_sent();
    t.recv(0x4242, CmMessage::Req(peer_req(0x7777_0000, PEER_QPN)));
    let m = t.sent_one();
    assert_eq!(m.header.tid, 0x4242);
    let CmMessage::Rej(r) = m.msg else { panic!() };
    assert_eq!(
        (r.reason, r.message_rejected, r.remote_comm_id),
        (RejReason::StaleConn, MsgCode::Req, 0x7777_0000)
    );
    assert_eq!(t.ep.state(c), Some(State::RepSent));
    assert!(t.events().is_empty());

    // Without any listener (and even for another service) the answer is still STALE_CONN.
    let mut t = T::new();
    let (_, c, _) = t.req_rcvd();
    let mut req = peer_req(0x7777_0000, PEER_QPN);
    req.service_id = SID + 1;
    t.recv(0x4243, CmMessage::Req(req));
    let CmMessage::Rej(r) = t.sent_one().msg else {
        panic!()
    };
    assert_eq!(r.reason, RejReason::StaleConn);
    assert_eq!(t.ep.state(c), Some(State::ReqRcvd));
}

// =========================================================================================
// Duplicate / stale REP (cm_rep_handler, cm_dup_rep_handler).
// =========================================================================================

/// `cm_dup_rep_handler` answers only ESTABLISHED (RTU) and MRA_REP_SENT (MRA): in DREQ_SENT,
/// DREQ_RCVD and TIMEWAIT a copy of the REP gets nothing.
#[test]
fn duplicate_rep_during_or_after_disconnect_sends_nothing() {
    for step in 0..3 {
        let mut t = T::new();
        let (h, id, tid) = t.rep_rcvd();
        t.ep.establish(h).unwrap();
        t.sent();
        assert_eq!(t.events(), vec![(h, CmEvent::Established)]);
        if step == 0 {
            t.ep.disconnect(t.now, h, &[]).unwrap();
        } else {
            t.recv(0x77, dreq(PEER_ID, id, 0x11));
            assert_eq!(t.ep.state(h), Some(State::DreqRcvd));
            if step == 2 {
                t.events();
                t.ep.disconnect(t.now, h, &[]).unwrap();
            }
        }
        t.sent();
        t.events();
        let before = t.ep.state(h);
        t.recv(tid, CmMessage::Rep(peer_rep(id)));
        t.nothing_sent();
        assert!(t.events().is_empty());
        assert_eq!(t.ep.state(h), before, "step {step}");
    }
}

/// A stale REP (its QPN held by a connection not yet established) is rejected with
/// REJ(STALE_CONN) built from the REP, and the holder gets no DREQ.
#[test]
fn stale_rep_against_a_connection_not_yet_established_rejects_only() {
    let mut t = T::new();
    let (old, _, _) = t.rep_rcvd(); // holds the peer's QPN, no RTU yet
    let (h, id, tid) = t.connect_id();
    let mut rep = peer_rep(id);
    rep.local_comm_id = 0x6666_0000;
    t.recv(tid, CmMessage::Rep(rep));
    let m = t.sent_one();
    assert_eq!(m.header.tid, tid);
    let CmMessage::Rej(r) = m.msg else { panic!() };
    assert_eq!(
        (
            r.reason,
            r.message_rejected,
            r.local_comm_id,
            r.remote_comm_id
        ),
        (RejReason::StaleConn, MsgCode::Rep, id, 0x6666_0000)
    );
    assert_eq!(t.ep.state(old), Some(State::RepRcvd));
    assert_eq!(t.ep.state(h), Some(State::ReqSent));
    assert!(t.events().is_empty());
}
