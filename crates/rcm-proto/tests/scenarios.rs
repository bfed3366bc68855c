//! Scenario scripts for every transition of the IB CM state machine, smoltcp style: one
//! endpoint under test, hand-built MADs in, the MADs it sends and the events it emits out.

#[path = "support/harness.rs"]
mod harness;
#[path = "support/timers.rs"]
mod timers;
use harness::{
    dreq, ip, peer_rep, peer_req, ME, MY_GUID, PEER, PEER_GUID, PEER_ID, PEER_QPN, SID, T, TID,
};
use rcm_proto::ib::{
    AcceptParams, CepHandle, CmError, CmEvent, ConnectParams, RetryPolicy, SidrParams,
    SidrReplyParams, State, TimedOut,
};
use rcm_wire::cm::{
    self, ClassPortInfo, CmMad, CmMessage, Drep, Lap, Mra, MsgCode, Rej, RejReason, Rep, Req, Rtu,
    SidrRep, SidrReq, SidrStatus,
};
use rcm_wire::cma::{self, PortSpace};
use rcm_wire::{mad, tid};
use std::time::Duration;

const OTHER: &str = "198.18.0.3";

// ---------------------------------------------------------------- active side

#[test]
fn connect_sends_a_linux_shaped_req() {
    let mut t = T::new();
    let (h, req, tid) = t.connect();
    assert_eq!(t.ep.state(h), Some(State::ReqSent));
    assert_ne!(req.local_comm_id, 0);
    assert_eq!(
        tid,
        tid::linux_tid(1, req.local_comm_id),
        "TID is built as Linux builds it"
    );
    assert_eq!(req.service_id, SID);
    assert_eq!(req.local_qpn, 0x11);
    assert_eq!(req.local_ca_guid, MY_GUID);
    assert_eq!(
        (
            req.remote_cm_response_timeout,
            req.local_cm_response_timeout,
            req.max_cm_retries
        ),
        (20, 20, 15)
    );
    assert_eq!(req.primary_path.local_gid.to_ip(), ip(ME));
    assert_eq!(req.primary_path.remote_gid.to_ip(), ip(PEER));
    assert_eq!(
        (req.primary_path.local_lid, req.primary_path.remote_lid),
        (0xFFFF, 0xFFFF)
    );
    assert_eq!(
        req.primary_path.local_ack_timeout, 19,
        "cm_ack_timeout(15, 18) as on Linux 6.1"
    );
    assert_eq!(&req.private_data[..5], b"hello");
    assert!(req.starting_psn <= 0xFF_FFFF);
}

#[test]
fn rep_then_establish_sends_rtu() {
    let mut t = T::new();
    let (h, id, tid) = t.rep_rcvd();
    assert_eq!(t.ep.state(h), Some(State::RepRcvd));
    t.ep.establish(h).unwrap();
    let m = t.sent_one();
    assert_eq!(m.header.tid, tid, "RTU reuses the REQ's TID");
    let CmMessage::Rtu(rtu) = m.msg else { panic!() };
    assert_eq!((rtu.local_comm_id, rtu.remote_comm_id), (id, PEER_ID));
    assert_eq!(t.ep.state(h), Some(State::Established));
    // The REQ is no longer retransmitted.
    t.advance(Duration::from_secs(120));
    t.nothing_sent();
}

#[test]
fn establish_on_rep_answers_the_rep_with_the_rtu_in_the_same_call() {
    let mut t = T::new();
    let (h, req, tid) = t.connect_with(|p| p.establish_on_rep = true);
    t.recv(tid, CmMessage::Rep(peer_rep(req.local_comm_id)));
    let m = t.sent_one();
    assert_eq!(m.header.tid, tid, "the RTU reuses the REQ's TID");
    let CmMessage::Rtu(rtu) = m.msg else {
        panic!("{:?}", m.msg.name())
    };
    assert_eq!(
        (rtu.local_comm_id, rtu.remote_comm_id),
        (req.local_comm_id, PEER_ID)
    );
    let ev = t.events();
    let [(a, CmEvent::RepReceived(info)), (b, CmEvent::Established)] = ev.as_slice() else {
        panic!("{ev:?}")
    };
    assert_eq!((*a, *b), (h, h));
    assert!(info.established);
    assert_eq!(info.remote_qpn, PEER_QPN);
    assert_eq!(t.ep.state(h), Some(State::Established));
    assert_eq!(
        t.ep.establish(h),
        Err(CmError::InvalidState(State::Established)),
        "nothing is left for the caller to establish"
    );
    // Neither the REQ nor the RTU is retried, and a repeated REP is answered with the RTU
    // again, as after an establish of the caller's.
    t.advance(Duration::from_secs(120));
    t.nothing_sent();
    t.recv(tid, CmMessage::Rep(peer_rep(req.local_comm_id)));
    assert!(matches!(t.sent_one().msg, CmMessage::Rtu(_)));
    assert!(t.events().is_empty());
}

#[test]
fn without_establish_on_rep_the_rep_waits_for_the_caller() {
    let mut t = T::new();
    let (h, req, tid) = t.connect();
    t.recv(tid, CmMessage::Rep(peer_rep(req.local_comm_id)));
    let ev = t.events();
    let [(_, CmEvent::RepReceived(info))] = ev.as_slice() else {
        panic!("{ev:?}")
    };
    assert!(!info.established);
    t.nothing_sent();
    assert_eq!(t.ep.state(h), Some(State::RepRcvd));
}

#[test]
fn rep_received_event_carries_the_offer() {
    let mut t = T::new();
    let (h, req, tid) = t.connect();
    t.recv(tid, CmMessage::Rep(peer_rep(req.local_comm_id)));
    let ev = t.events();
    let [(eh, CmEvent::RepReceived(info))] = ev.as_slice() else {
        panic!("{ev:?}")
    };
    assert_eq!(*eh, h);
    assert_eq!((info.remote_qpn, info.starting_psn), (PEER_QPN, 0x123456));
    assert_eq!(&info.private_data[..8], b"accepted");
    assert_eq!(info.private_data.len(), 196);
}

#[test]
fn rep_from_elsewhere_or_for_another_id_is_ignored() {
    let mut t = T::new();
    let (h, req, tid) = t.connect();
    t.recv_from(OTHER, tid, CmMessage::Rep(peer_rep(req.local_comm_id)));
    t.recv(tid, CmMessage::Rep(peer_rep(req.local_comm_id ^ 1)));
    assert!(t.events().is_empty());
    assert_eq!(t.ep.state(h), Some(State::ReqSent));
    assert_eq!(t.ep.stats().rx_unmatched, 2);
}

/// An MRA from the peer with comm ID `peer` of our `mraed` message (our comm ID `our_id`),
/// asking for `service_timeout`.
fn peer_mra(peer: u32, our_id: u32, mraed: MsgCode, service_timeout: u8) -> CmMessage {
    CmMessage::Mra(Mra {
        local_comm_id: peer,
        remote_comm_id: our_id,
        message_mraed: mraed,
        service_timeout,
        ..Mra::default()
    })
}

/// The peer's MRA of our REQ (comm ID `our_id`), asking for `service_timeout`.
fn mra_of_req(our_id: u32, service_timeout: u8) -> CmMessage {
    peer_mra(PEER_ID, our_id, MsgCode::Req, service_timeout)
}

#[test]
fn mra_for_req_extends_the_wait_once() {
    let mut t = T::new();
    let (h, req, tid) = t.connect();
    let mra = |st| mra_of_req(req.local_comm_id, st);
    t.recv(tid, mra(24)); // 1 << 16 ms ≈ 65 s more
    assert_eq!(
        t.events(),
        vec![(
            h,
            CmEvent::MraReceived {
                service_timeout: 24
            }
        )]
    );
    assert_eq!(t.ep.state(h), Some(State::MraReqRcvd));
    // The classic 6.1 s retry does not fire: the MRA pushed it past 60 s.
    t.advance(Duration::from_secs(60));
    t.nothing_sent();
    t.advance(Duration::from_secs(10));
    assert!(
        matches!(t.sent_one().msg, CmMessage::Req(_)),
        "retransmitted after the extension"
    );
    // REP still completes it.
    t.recv(tid, CmMessage::Rep(peer_rep(req.local_comm_id)));
    assert!(matches!(
        t.events().as_slice(),
        [(_, CmEvent::RepReceived(_))]
    ));
}

/// The wait an MRA of our REQ asks for is its service timeout plus Linux's `av.timeout`,
/// which before the REP is the path's packet lifetime + 1 (`cm_init_av_by_path`;
/// `cm_mra_handler`: `ms(service_timeout) + ms(av.timeout)`), not the REQ's Local ACK
/// Timeout field (`cm_ack_timeout`). They differ when the CA ACK delay is not below the
/// packet lifetime: with 16 and 16 the REQ says 18, and an MRA of service timeout 8 (1 ms)
/// has the REQ resent 1 + ms(17) = 513 ms later (it was 1,025).
#[test]
fn an_mra_of_our_req_waits_packet_lifetime_plus_one() {
    let mut t = T::with(|c| c.ca_ack_delay = 16);
    let (h, req, tid) = t.connect_with(|p| p.path.packet_life_time = 16);
    assert_eq!(
        req.primary_path.local_ack_timeout, 18,
        "cm_ack_timeout(16, 16)"
    );
    t.recv(tid, mra_of_req(req.local_comm_id, 8));
    assert_eq!(t.ep.state(h), Some(State::MraReqRcvd));
    t.events();
    t.advance(Duration::from_millis(512));
    t.nothing_sent();
    t.advance(Duration::from_millis(1));
    assert!(
        matches!(t.sent_one().msg, CmMessage::Req(_)),
        "the REQ is resent 513 ms after the MRA"
    );
}

/// An MRA does not fix who the peer is (cm_mra_handler records no remote ID): a REP from
/// another id of the peer (the MRA's one destroyed, its REJ lost, our REQ retried) is still
/// this connection's reply. It was dropped as unmatched and the connect timed out.
#[test]
fn an_mra_does_not_fix_the_peers_comm_id() {
    let mut t = T::new();
    let (h, req, tid) = t.connect();
    t.recv(tid, mra_of_req(req.local_comm_id, 20));
    t.events();
    assert_eq!(t.ep.state(h), Some(State::MraReqRcvd));
    t.recv(
        tid,
        CmMessage::Rep(Rep {
            local_comm_id: PEER_ID + 1,
            ..peer_rep(req.local_comm_id)
        }),
    );
    let ev = t.events();
    assert!(
        matches!(ev.as_slice(), [(eh, CmEvent::RepReceived(_))] if *eh == h),
        "{ev:?}"
    );
}

/// A DREP's private data may fill its area (224 bytes); a DREQ's is 220. Answering a DREQ
/// was held to the DREQ's limit.
#[test]
fn drep_private_data_has_the_drep_limit() {
    let mut t = T::new();
    let (c, id) = t.established_passive();
    assert!(matches!(
        t.ep.disconnect(t.now, c, &[7; 221]),
        Err(CmError::Wire(
            rcm_wire::WireError::PrivateDataTooLong { .. }
        ))
    ));
    t.recv(0x77, dreq(PEER_ID, id, 0x22));
    t.events();
    assert_eq!(t.ep.disconnect(t.now, c, &[7; 224]), Ok(()));
    let CmMessage::Drep(d) = t.sent_one().msg else {
        panic!("a DREP")
    };
    assert_eq!(d.private_data[..], [7; 224][..]);
}

/// A repeated DREQ in timewait (our DREP was lost) gets the DREP again, with its private
/// data (IBTA 12.9.7; Linux's `cm_dreq_handler` answers in IB_CM_TIMEWAIT with the private
/// data `cm_send_drep_locked` saved), echoing the repeated DREQ's transaction ID; it went
/// out with none.
#[test]
fn a_repeated_dreq_in_timewait_gets_the_same_drep() {
    let mut t = T::new();
    let (c, id) = t.established_passive();
    t.recv(0x77, dreq(PEER_ID, id, 0x22));
    t.events();
    t.ep.disconnect(t.now, c, b"bye").unwrap();
    let CmMessage::Drep(first) = t.sent_one().msg else {
        panic!("a DREP")
    };
    assert_eq!(t.ep.state(c), Some(State::Timewait));
    t.recv(0x78, dreq(PEER_ID, id, 0x22));
    let m = t.sent_one();
    assert_eq!(m.header.tid, 0x78);
    let CmMessage::Drep(again) = m.msg else {
        panic!("{m:?}")
    };
    assert_eq!(again, first, "the same DREP, private data included");
    assert_eq!(&again.private_data[..3], b"bye");
}

/// After an MRA every retry waits the interval it asked for, as Linux's `ib_modify_mad`
/// leaves the MAD's timeout (the classic interval came back after the first stretched
/// wait); a second MRA changes nothing.
#[test]
fn second_mra_is_not_honoured() {
    let mut t = T::with(|c| c.retry = RetryPolicy::Classic);
    let (h, req, tid) = t.connect();
    let mra = |st| mra_of_req(req.local_comm_id, st);
    // 16.4 s of service time plus our ACK timeout; the classic interval is 6.1 s.
    let extra = Duration::from_millis(
        rcm_proto::ib::ibta_time_ms(22)
            + rcm_proto::ib::ibta_time_ms(req.primary_path.local_ack_timeout),
    );
    let ms = Duration::from_millis(1);
    t.recv(tid, mra(22));
    t.advance(extra.saturating_sub(ms));
    t.nothing_sent();
    t.advance(2 * ms);
    assert!(matches!(t.sent_one().msg, CmMessage::Req(_)));
    t.recv(tid, mra(26)); // state is MraReqRcvd now: ignored
    assert_eq!(t.ep.stats().rx_unmatched, 1);
    t.events();
    t.advance(extra.saturating_sub(2 * ms));
    t.nothing_sent();
    t.advance(2 * ms);
    assert!(
        matches!(t.sent_one().msg, CmMessage::Req(_)),
        "the first MRA's interval again, neither the classic one nor the second MRA's"
    );
    assert_eq!(t.ep.state(h), Some(State::MraReqRcvd));
}

/// Backoff with a 10 s deadline, a REQ sent and MRA'd for service timeout 22 (16.4 s): the
/// endpoint, the REQ's handle, the REQ, its TID and the stretched wait.
fn backoff_req_mraed() -> (T, CepHandle, Req, u64, Duration) {
    let mut t = T::with(|c| {
        c.retry = RetryPolicy::Backoff {
            initial: Duration::from_secs(1),
            max_wait: Duration::from_secs(60),
            deadline: Duration::from_secs(10),
        }
    });
    let (h, req, tid) = t.connect();
    let extra = Duration::from_millis(
        rcm_proto::ib::ibta_time_ms(22)
            + rcm_proto::ib::ibta_time_ms(req.primary_path.local_ack_timeout),
    );
    t.recv(tid, mra_of_req(req.local_comm_id, 22));
    t.events();
    (t, h, req, tid, extra)
}

/// With the backoff policy an MRA'd REQ is still retried once the stretched wait is over
/// (a REP lost after the peer's long work no longer fails the connect), at the MRA's
/// interval, and a REP then completes it.
#[test]
fn backoff_retries_a_req_after_an_mra() {
    let (mut t, h, req, tid, extra) = backoff_req_mraed();
    // Past the 10 s deadline and the stretched wait: retried, not given up.
    t.advance(extra + Duration::from_millis(1));
    assert!(matches!(t.sent_one().msg, CmMessage::Req(_)));
    assert!(t.events().is_empty(), "{:?}", t.ep.state(h));
    t.recv(tid, CmMessage::Rep(peer_rep(req.local_comm_id)));
    assert!(matches!(
        t.events().as_slice(),
        [(eh, CmEvent::RepReceived(_))] if *eh == h
    ));
}

/// The MRA's time is for the next retry only: after it the backoff starts again from its
/// first wait (1 s, 2 s, 4 s, 8 s), as Linux's since 6.14, and the exchange ends at the
/// deadline the MRA moved (here two stretched waits from it, past the 10 s deadline plus
/// one). Before, every later retry waited the MRA's time, which left room for one retry:
/// one lost answer after it failed the connect.
#[test]
fn backoff_after_an_mras_wait_starts_again_and_ends_at_the_moved_deadline() {
    let (mut t, h, _, _, extra) = backoff_req_mraed();
    let ms = Duration::from_millis(1);
    t.advance(extra.saturating_sub(ms));
    t.nothing_sent();
    t.advance(2 * ms);
    assert!(
        matches!(t.sent_one().msg, CmMessage::Req(_)),
        "the stretched retry"
    );
    let mut at = extra + ms;
    for wait in [1, 2, 4, 8] {
        let wait = Duration::from_secs(wait);
        t.advance(wait.saturating_sub(2 * ms));
        t.nothing_sent();
        t.advance(2 * ms);
        assert!(
            matches!(t.sent_one().msg, CmMessage::Req(_)),
            "retried {wait:?} after the last"
        );
        at += wait;
    }
    // The next wait (16 s) would pass the deadline: the exchange ends there.
    let deadline = 2 * extra;
    t.advance(deadline.saturating_sub(at + ms));
    t.nothing_sent();
    assert!(t.events().is_empty());
    t.advance(2 * ms);
    let ev = t.events();
    assert!(
        matches!(ev.as_slice(), [(eh, CmEvent::TimedOut(TimedOut::Req))] if *eh == h),
        "{ev:?}"
    );
}

/// A first wait longer than the whole exchange is cut to its deadline (the exchange ended
/// 30 s past it), and `initial` is capped by `max_wait`.
#[test]
fn backoff_first_wait_is_capped_by_max_wait_and_the_deadline() {
    for (initial, max_wait, deadline, first) in [(90, 120, 60, 60), (30, 5, 60, 5)] {
        let mut t = T::with(|c| {
            c.retry = RetryPolicy::Backoff {
                initial: Duration::from_secs(initial),
                max_wait: Duration::from_secs(max_wait),
                deadline: Duration::from_secs(deadline),
            }
        });
        let _ = t.connect();
        t.advance(Duration::from_secs(first).saturating_sub(Duration::from_millis(1)));
        t.nothing_sent();
        assert!(t.events().is_empty());
        t.advance(Duration::from_millis(2));
        if first < deadline {
            assert!(matches!(t.sent_one().msg, CmMessage::Req(_)), "{initial} s");
        } else {
            assert!(
                matches!(
                    t.events().as_slice(),
                    [(_, CmEvent::TimedOut(TimedOut::Req))]
                ),
                "{initial} s"
            );
        }
    }
}

#[test]
fn rej_of_req_reports_reason_and_private_data() {
    let mut t = T::new();
    let (h, req, tid) = t.connect();
    t.recv(
        tid,
        CmMessage::Rej(Rej {
            local_comm_id: PEER_ID,
            remote_comm_id: req.local_comm_id,
            message_rejected: MsgCode::Req,
            reason: RejReason::ConsumerDefined,
            private_data: b"go away".to_vec(),
            ..Rej::default()
        }),
    );
    let ev = t.events();
    let [(
        eh,
        CmEvent::Rejected {
            reason,
            private_data,
            ..
        },
    )] = ev.as_slice()
    else {
        panic!("{ev:?}")
    };
    assert_eq!((*eh, *reason), (h, RejReason::ConsumerDefined));
    assert_eq!(&private_data[..7], b"go away");
    assert_eq!(t.ep.state(h), Some(State::Idle));
    t.advance(Duration::from_secs(120));
    t.nothing_sent();
}

/// After the 15th retry's wait the exchange ends without a REJ: Linux's
/// `cm_process_send_error` moves REQ_SENT to IDLE before reporting IB_CM_REQ_ERROR, so
/// the rdma_cm user's later destroy has nothing to send (b-req.pcap's REJ(TIMEOUT) is
/// such a destroy, before retries ran out).
#[test]
fn req_timeout_classic_retries_fifteen_times_then_ends_silently() {
    let mut t = T::new();
    let (h, _, _) = t.connect();
    let mut times = Vec::new();
    let start = t.now;
    for _ in 0..15 {
        t.advance(Duration::from_millis(6144));
        let m = t.sent_one();
        assert!(matches!(m.msg, CmMessage::Req(_)));
        times.push((t.now - start).as_millis());
    }
    assert_eq!(times[0], 6144, "2 × 1 s + 4 s, from the REQ's own fields");
    t.advance(Duration::from_millis(6143));
    t.nothing_sent();
    assert!(t.events().is_empty());
    t.advance(Duration::from_millis(1));
    t.nothing_sent();
    assert_eq!(t.events(), vec![(h, CmEvent::TimedOut(TimedOut::Req))]);
    assert_eq!(t.ep.state(h), Some(State::Idle));
    // Destroying the idle id afterwards sends nothing either.
    t.ep.destroy(t.now, h).expect("destroy");
    t.advance(Duration::from_secs(120));
    t.nothing_sent();
}

/// Classic retries: the REP is resent every ms(the REQ's local CM response timeout), as
/// Linux's `cm_req_handler` sets it (20 → 4,096 ms), without the twice-the-packet-lifetime
/// the active side adds to its REQ's interval (which made it ~6.1 s here).
#[test]
fn rep_retry_interval_is_the_peers_response_timeout() {
    let mut t = T::new();
    let (_, _, _) = t.rep_sent();
    let start = t.now;
    let mut reps = Vec::new();
    while reps.len() < 3 {
        t.advance(Duration::from_millis(1));
        for m in t.sent() {
            if m.msg.name() == "REP" {
                reps.push((t.now - start).as_millis());
            }
        }
        assert!(t.now - start < Duration::from_secs(60), "{reps:?}");
    }
    assert_eq!(reps, vec![4096, 8192, 12288]);
}

#[test]
fn req_timeout_backoff_doubles_and_stops_at_the_deadline() {
    let mut t = T::with(|c| c.retry = RetryPolicy::default());
    let (h, _, _) = t.connect();
    let start = t.now;
    let mut at = Vec::new();
    let mut ended = None;
    for _ in 0..700 {
        t.advance(Duration::from_millis(100));
        for m in t.sent() {
            at.push(((t.now - start).as_millis(), m.msg.name()));
        }
        let ev = t.events();
        if !ev.is_empty() {
            ended = Some(((t.now - start).as_millis(), ev));
            break;
        }
    }
    assert!(at.iter().all(|(_, n)| *n == "REQ"), "{at:?}");
    let reqs: Vec<u128> = at.iter().map(|(t, _)| *t).collect();
    assert_eq!(
        reqs,
        vec![1000, 3000, 7000, 15000, 31000],
        "1 s doubling: {at:?}"
    );
    assert_eq!(
        ended,
        Some((60000, vec![(h, CmEvent::TimedOut(TimedOut::Req))])),
        "gives up at the 60 s deadline"
    );
    assert_eq!(t.ep.state(h), Some(State::Idle));
}

/// Durations configured as `Duration::MAX` (a natural way to write "no deadline", "no cap",
/// "a long timewait") are taken as very long, not overflowed: each panicked adding to or
/// doubling a time (the REQ's deadline at the connect; the doubled wait at the retry; the
/// timewait's end).
#[test]
fn durations_configured_as_duration_max_do_not_overflow() {
    let mut t = T::with(|c| {
        c.retry = RetryPolicy::Backoff {
            initial: Duration::from_secs(1),
            max_wait: Duration::MAX,
            deadline: Duration::MAX,
        };
        c.min_timewait = Duration::MAX;
    });
    let (h, req, tid) = t.connect();
    for wait in [1, 2, 4] {
        t.advance(Duration::from_secs(wait));
        assert_eq!(t.sent_one().msg.name(), "REQ", "after {wait} s more");
    }
    // A REJ(STALE) takes the active side into timewait, for "ever".
    t.recv(
        tid,
        CmMessage::Rej(Rej {
            local_comm_id: PEER_ID,
            remote_comm_id: req.local_comm_id,
            message_rejected: MsgCode::Req,
            reason: RejReason::StaleConn,
            ..Rej::default()
        }),
    );
    assert!(!t.events().is_empty());
    t.advance(Duration::from_secs(3600));
    assert_eq!(t.ep.state(h), Some(State::Timewait));
}

#[test]
fn duplicate_rep_resends_rtu_when_established() {
    let mut t = T::new();
    let (_, id) = t.established_active();
    let tid = tid::linux_tid(1, id);
    t.recv(tid, CmMessage::Rep(peer_rep(id)));
    let CmMessage::Rtu(rtu) = t.sent_one().msg else {
        panic!()
    };
    assert_eq!(rtu.remote_comm_id, PEER_ID);
    assert_eq!(t.ep.stats().rx_duplicates, 1);
}

#[test]
fn duplicate_rep_in_rep_rcvd_is_dropped() {
    let mut t = T::new();
    let (_, id, tid) = t.rep_rcvd();
    t.recv(tid, CmMessage::Rep(peer_rep(id)));
    t.nothing_sent();
    assert!(t.events().is_empty());
}

#[test]
fn mra_of_rep_lazy_and_eager() {
    let mut t = T::new();
    let (h, id, tid) = t.rep_rcvd();
    t.ep.mra(h, 24, true).unwrap();
    assert_eq!(t.ep.state(h), Some(State::MraRepSent));
    t.nothing_sent();
    t.recv(tid, CmMessage::Rep(peer_rep(id)));
    let CmMessage::Mra(m) = t.sent_one().msg else {
        panic!()
    };
    assert_eq!(
        (m.message_mraed, m.service_timeout, m.remote_comm_id),
        (MsgCode::Rep, 24, PEER_ID)
    );
    t.ep.establish(h).unwrap();
    assert!(matches!(t.sent_one().msg, CmMessage::Rtu(_)));
    // Eager.
    let mut t = T::new();
    let (h, _, _) = t.rep_rcvd();
    t.ep.mra(h, 20, false).unwrap();
    assert!(matches!(t.sent_one().msg, CmMessage::Mra(_)));
    // Once only (cm.c's ib_send_cm_mra refuses an MRA state), and the refusal sends nothing.
    assert_eq!(
        t.ep.mra(h, 22, false),
        Err(CmError::InvalidState(State::MraRepSent))
    );
    t.nothing_sent();
}

#[test]
fn dreq_received_then_disconnect_sends_drep_and_timewait_expires() {
    let mut t = T::new();
    let (h, id) = t.established_active();
    t.recv(0x77, dreq(PEER_ID, id, 0x11));
    assert_eq!(
        t.events(),
        vec![(
            h,
            CmEvent::DreqReceived {
                private_data: vec![0; 220]
            }
        )]
    );
    assert_eq!(t.ep.state(h), Some(State::DreqRcvd));
    t.ep.disconnect(t.now, h, &[]).unwrap();
    let m = t.sent_one();
    assert_eq!(m.header.tid, 0x77, "DREP echoes the DREQ's TID");
    assert!(
        matches!(m.msg, CmMessage::Drep(Drep { local_comm_id, remote_comm_id: PEER_ID, .. }) if local_comm_id == id)
    );
    assert_eq!(t.ep.state(h), Some(State::Timewait));
    // Duplicate DREQ in timewait: DREP again, no event.
    t.recv(0x77, dreq(PEER_ID, id, 0x11));
    assert!(matches!(t.sent_one().msg, CmMessage::Drep(_)));
    assert!(t.events().is_empty());
    // Timewait lasts the path's ACK timeout: 19 → 2048 ms.
    t.advance(Duration::from_secs(2));
    assert!(t.events().is_empty());
    t.advance(Duration::from_millis(100));
    assert_eq!(t.events(), vec![(h, CmEvent::TimewaitExit)]);
    assert_eq!(t.ep.state(h), Some(State::Idle));
    assert_eq!(t.ep.table_sizes(), (1, 0, 0, 0, t.ep.table_sizes().4));
}

/// Destroyed in timewait, an endpoint is kept only as its comm ID and timer: a repeated
/// DREQ still gets its DREP, nothing is reported, and the ID and the endpoint's place
/// (`cep_count`, the comm-ID table) stay taken until the timewait ends, then are released.
#[test]
fn a_destroyed_endpoint_in_timewait_still_answers_and_holds_its_id_until_the_end() {
    let mut t = T::new();
    let (h, id) = t.established_active();
    assert_eq!(t.peer_disconnects(h, id, 0x11).len(), 1, "the DREP");
    t.ep.destroy(t.now, h).unwrap();
    assert_eq!(t.ep.state(h), None, "an orphan is not reported");
    assert_eq!(t.ep.cep_count(), 1);
    assert_eq!(t.ep.cep_states().get("Timewait (orphan)"), Some(&1));
    assert_eq!(t.ep.table_sizes().0, 1, "its comm ID is held");
    t.recv(0x78, dreq(PEER_ID, id, 0x11));
    let m = t.sent_one();
    assert_eq!(m.header.tid, 0x78);
    assert!(
        matches!(m.msg, CmMessage::Drep(Drep { local_comm_id, remote_comm_id: PEER_ID, .. }) if local_comm_id == id)
    );
    assert_eq!(t.ep.destroy(t.now, h), Err(CmError::UnknownHandle));
    t.advance(Duration::from_millis(2100));
    assert!(t.events().is_empty());
    t.nothing_sent();
    assert_eq!(t.ep.cep_count(), 0);
    assert!(t.ep.cep_states().is_empty());
    assert_eq!(t.ep.table_sizes().0, 0, "the comm ID is free again");
}

#[test]
fn dreq_must_name_our_qpn_and_both_comm_ids() {
    let mut t = T::new();
    let (h, id) = t.established_active();
    t.recv(1, dreq(PEER_ID, id, 0x12)); // wrong QPN
    t.recv(2, dreq(PEER_ID ^ 1, id, 0x11)); // wrong remote comm ID
    t.recv_from(OTHER, 3, dreq(PEER_ID, id, 0x11)); // wrong host
    assert!(t.events().is_empty());
    assert_eq!(t.ep.state(h), Some(State::Established));
    // The unmatched ones are answered with a DREP that changes nothing (Linux cm_issue_drep).
    let sent = t.sent();
    assert!(sent.iter().all(|m| matches!(m.msg, CmMessage::Drep(_))));
}

#[test]
fn disconnect_sends_dreq_and_drep_ends_in_timewait() {
    let mut t = T::new();
    let (h, id) = t.established_active();
    t.ep.disconnect(t.now, h, b"bye").unwrap();
    let m = t.sent_one();
    let CmMessage::Dreq(d) = m.msg else { panic!() };
    assert_eq!(
        (d.local_comm_id, d.remote_comm_id, d.remote_qpn),
        (id, PEER_ID, PEER_QPN)
    );
    assert_eq!(&d.private_data[..3], b"bye");
    assert_eq!(t.ep.state(h), Some(State::DreqSent));
    t.recv(
        m.header.tid,
        CmMessage::Drep(Drep {
            local_comm_id: PEER_ID,
            remote_comm_id: id,
            ..Drep::default()
        }),
    );
    assert_eq!(t.events(), vec![(h, CmEvent::DrepReceived)]);
    assert_eq!(t.ep.state(h), Some(State::Timewait));
    t.advance(Duration::from_secs(120));
    t.nothing_sent();
}

/// The active side's ACK timeout follows the REP's target ACK delay, as Linux's
/// `cm_rep_handler` recomputes it: a peer that acknowledges late (delay 20) makes it 21, not
/// the 19 our own REQ announced, and timewait lasts 2^13 ms, not 2^11.
#[test]
fn the_active_sides_ack_timeout_follows_the_reps_target_ack_delay() {
    let mut t = T::new();
    let (h, req, tid) = t.connect();
    assert_eq!(req.primary_path.local_ack_timeout, 19);
    t.recv(
        tid,
        CmMessage::Rep(Rep {
            target_ack_delay: 20,
            ..peer_rep(req.local_comm_id)
        }),
    );
    t.events();
    t.ep.establish(h).unwrap();
    t.sent();
    t.events();
    t.ep.disconnect(t.now, h, &[]).unwrap();
    let m = t.sent_one();
    t.recv(
        m.header.tid,
        CmMessage::Drep(Drep {
            local_comm_id: PEER_ID,
            remote_comm_id: req.local_comm_id,
            ..Drep::default()
        }),
    );
    assert_eq!(t.events(), vec![(h, CmEvent::DrepReceived)]);
    t.advance(Duration::from_millis(8191));
    assert!(t.events().is_empty(), "still in timewait");
    assert_eq!(t.ep.state(h), Some(State::Timewait));
    t.advance(Duration::from_millis(2));
    assert_eq!(t.events(), vec![(h, CmEvent::TimewaitExit)]);
}

#[test]
fn dreq_retries_then_times_out_into_timewait() {
    let mut t = T::new();
    let (h, _) = t.established_active();
    t.ep.disconnect(t.now, h, &[]).unwrap();
    t.sent();
    t.advance(Duration::from_secs(6 * 16 + 10));
    let sent = t.sent();
    assert_eq!(sent.len(), 15, "15 DREQ retries");
    assert!(sent.iter().all(|m| matches!(m.msg, CmMessage::Dreq(_))));
    let ev = t.events();
    assert_eq!(ev[0], (h, CmEvent::TimedOut(TimedOut::Dreq)));
    assert_eq!(ev.last(), Some(&(h, CmEvent::TimewaitExit)));
}

#[test]
fn simultaneous_dreqs_both_end_in_timewait() {
    let mut t = T::new();
    let (h, id) = t.established_active();
    t.ep.disconnect(t.now, h, &[]).unwrap();
    t.sent();
    t.recv(0x55, dreq(PEER_ID, id, 0x11));
    assert_eq!(t.ep.state(h), Some(State::DreqRcvd));
    assert!(matches!(
        t.events().as_slice(),
        [(_, CmEvent::DreqReceived { .. })]
    ));
    t.ep.disconnect(t.now, h, &[]).unwrap();
    assert!(matches!(t.sent_one().msg, CmMessage::Drep(_)));
    assert_eq!(t.ep.state(h), Some(State::Timewait));
    // The peer's DREP for our DREQ now is a late duplicate.
    t.recv(
        0x56,
        CmMessage::Drep(Drep {
            local_comm_id: PEER_ID,
            remote_comm_id: id,
            ..Drep::default()
        }),
    );
    assert!(t.events().is_empty());
    t.advance(Duration::from_secs(60));
    t.nothing_sent();
}

#[test]
fn rej_while_established_goes_to_timewait() {
    let mut t = T::new();
    let (h, id) = t.established_active();
    t.recv(1, peer_rej(id, MsgCode::Other));
    assert!(matches!(
        t.events().as_slice(),
        [(_, CmEvent::Rejected { .. })]
    ));
    assert_eq!(t.ep.state(h), Some(State::Timewait));
}

/// A REJ from the peer (comm ID `PEER_ID`) naming our comm ID `our_id`, with the
/// message-rejected field `msg`.
fn peer_rej(our_id: u32, msg: MsgCode) -> CmMessage {
    CmMessage::Rej(Rej {
        local_comm_id: PEER_ID,
        remote_comm_id: our_id,
        message_rejected: msg,
        reason: RejReason::ConsumerDefined,
        ..Rej::default()
    })
}

/// Linux's `cm_acquire_rejected_id` looks a REJ whose message-rejected field says REQ up by
/// our comm ID with a remote comm ID of 0, so it can only end an attempt that has not
/// learned its peer's comm ID (REQ_SENT, MRA_REQ_RCVD). An active id past the REP ignores
/// it; the same REJ naming another message ends the connection.
#[test]
fn a_rej_of_a_req_does_not_reach_an_active_endpoint_past_the_rep() {
    let mut t = T::new();
    let (h, id, _) = t.rep_rcvd();
    t.recv(TID, peer_rej(id, MsgCode::Req));
    assert!(t.events().is_empty());
    assert_eq!(t.ep.state(h), Some(State::RepRcvd));

    let mut t = T::new();
    let (h, id) = t.established_active();
    t.recv(TID, peer_rej(id, MsgCode::Req));
    assert!(t.events().is_empty());
    assert_eq!(t.ep.state(h), Some(State::Established));
    t.recv(TID, peer_rej(id, MsgCode::Other));
    assert!(matches!(
        t.events().as_slice(),
        [(eh, CmEvent::Rejected { .. })] if *eh == h
    ));
    assert_eq!(t.ep.state(h), Some(State::Timewait));
}

/// The same rule on the passive side, where every id knows the peer's comm ID from the
/// REQ: a REJ of a REQ never reaches it.
#[test]
fn a_rej_of_a_req_does_not_reach_a_passive_endpoint() {
    let mut t = T::new();
    let (_, c, id) = t.rep_sent();
    t.recv(TID, peer_rej(id, MsgCode::Req));
    assert!(t.events().is_empty());
    assert_eq!(t.ep.state(c), Some(State::RepSent));

    let mut t = T::new();
    let (c, id) = t.established_passive();
    t.recv(TID, peer_rej(id, MsgCode::Req));
    assert!(t.events().is_empty());
    assert_eq!(t.ep.state(c), Some(State::Established));
}

/// Linux's `cm_rep_handler` inserts the REP's comm ID (`cm_insert_remote_id`) before its
/// QPN (`cm_insert_remote_qpn`): a REP whose comm ID and CA GUID already belong to a
/// connection is a duplicate, dropped without a word, even when its QPN is that
/// connection's too: no REJ(STALE_CONN), no DREQ to the connection, the new attempt stays
/// in REQ_SENT.
#[test]
fn a_rep_with_a_known_comm_id_is_dropped_before_the_stale_qpn_check() {
    let mut t = T::new();
    let (old, _) = t.established_active();
    let (h, req, tid) = t.connect();
    t.recv(tid, CmMessage::Rep(peer_rep(req.local_comm_id)));
    t.nothing_sent();
    assert!(t.events().is_empty());
    assert_eq!(t.ep.state(h), Some(State::ReqSent));
    assert_eq!(t.ep.state(old), Some(State::Established));
}

// ---------------------------------------------------------------- passive side

#[test]
fn req_without_listener_gets_rej_invalid_service_id() {
    let mut t = T::new();
    t.recv(TID, CmMessage::Req(peer_req(PEER_ID, PEER_QPN)));
    let m = t.sent_one();
    assert_eq!(m.header.tid, TID, "copied from the REQ");
    let CmMessage::Rej(rej) = m.msg else { panic!() };
    assert_eq!(
        (rej.reason, rej.message_rejected),
        (RejReason::InvalidServiceId, MsgCode::Req)
    );
    assert_eq!((rej.local_comm_id, rej.remote_comm_id), (0, PEER_ID));
    assert_eq!(t.ep.cep_count(), 0);
}

/// The passive side's QP ACK timeout is the REQ's local ACK timeout, except that 0 (an
/// infinite timeout: a QP that never retransmits a lost packet) becomes 1, as Linux's
/// cm_format_paths_from_req and cm_init_av_by_path make it (less one, then plus one).
#[test]
fn a_reqs_ack_timeout_of_zero_becomes_one() {
    for (asked, got) in [(0u8, 1u8), (1, 1), (14, 14), (31, 31)] {
        let mut t = T::new();
        let mut req = peer_req(PEER_ID, PEER_QPN);
        req.primary_path.local_ack_timeout = asked;
        t.ep.listen(SID, u64::MAX, 0).unwrap();
        t.recv(TID, CmMessage::Req(req));
        let ev = t.events();
        let [(_, CmEvent::ReqReceived { info, .. })] = ev.as_slice() else {
            panic!("{ev:?}")
        };
        assert_eq!(info.local_ack_timeout, got, "asked {asked}");
    }
}

#[test]
fn req_received_then_accept_then_rtu() {
    let mut t = T::new();
    let (_, c, id) = t.req_rcvd();
    assert_eq!(t.ep.state(c), Some(State::ReqRcvd));
    t.ep.accept(
        t.now,
        c,
        &AcceptParams {
            qpn: 0x22,
            private_data: b"welcome".to_vec(),
            ..AcceptParams::default()
        },
    )
    .unwrap();
    let m = t.sent_one();
    let CmMessage::Rep(rep) = m.msg else { panic!() };
    assert_eq!(
        (rep.local_comm_id, rep.remote_comm_id, rep.local_qpn),
        (id, PEER_ID, 0x22)
    );
    assert_eq!(rep.local_ca_guid, MY_GUID);
    assert_eq!(&rep.private_data[..7], b"welcome");
    assert_eq!(t.ep.state(c), Some(State::RepSent));
    t.recv(
        TID,
        CmMessage::Rtu(Rtu {
            local_comm_id: PEER_ID,
            remote_comm_id: id,
            ..Rtu::default()
        }),
    );
    assert_eq!(t.events(), vec![(c, CmEvent::Established)]);
    // A duplicate RTU changes nothing.
    t.recv(
        TID,
        CmMessage::Rtu(Rtu {
            local_comm_id: PEER_ID,
            remote_comm_id: id,
            ..Rtu::default()
        }),
    );
    assert!(t.events().is_empty());
    assert_eq!(t.ep.stats().rx_duplicates, 1);
}

/// `COMM_EST` (the QP got data before the RTU; ib_cm_notify): established at once, the REP
/// is not retried any more, a late RTU is a duplicate; and only a passive side that sent
/// its REP can be notified.
#[test]
fn notify_established_stands_in_for_a_lost_rtu() {
    let mut t = T::new();
    let (_, c, id) = t.req_rcvd();
    assert_eq!(
        t.ep.notify_established(c),
        Err(CmError::InvalidState(State::ReqRcvd)),
        "no REP sent yet"
    );
    t.ep.accept(t.now, c, &AcceptParams::default()).unwrap();
    assert!(matches!(t.sent_one().msg, CmMessage::Rep(_)));
    t.ep.notify_established(c).unwrap();
    assert_eq!(t.ep.state(c), Some(State::Established));
    assert_eq!(t.events(), vec![(c, CmEvent::Established)]);
    assert_eq!(
        t.ep.notify_established(c),
        Err(CmError::InvalidState(State::Established))
    );
    // The REP's retries (every 6.1 s here) are over.
    t.advance(Duration::from_secs(60));
    t.nothing_sent();
    assert!(t.events().is_empty());
    t.recv(
        TID,
        CmMessage::Rtu(Rtu {
            local_comm_id: PEER_ID,
            remote_comm_id: id,
            ..Rtu::default()
        }),
    );
    assert!(t.events().is_empty());
    assert_eq!(t.ep.stats().rx_duplicates, 1);
    assert_eq!(t.ep.state(c), Some(State::Established));
    // The active side establishes with `establish` (the RTU), not with this.
    let mut a = T::new();
    let (h, _, _) = a.rep_rcvd();
    assert_eq!(
        a.ep.notify_established(h),
        Err(CmError::InvalidState(State::RepRcvd))
    );
}

#[test]
fn duplicate_req_while_unanswered_is_dropped() {
    let mut t = T::new();
    let (_, c, _) = t.req_rcvd();
    t.recv(TID, CmMessage::Req(peer_req(PEER_ID, PEER_QPN)));
    t.nothing_sent();
    assert!(t.events().is_empty());
    assert_eq!(t.ep.state(c), Some(State::ReqRcvd));
    assert_eq!(t.ep.cep_count(), 1);
}

#[test]
fn lazy_mra_goes_out_only_when_the_req_is_repeated() {
    let mut t = T::new();
    let (_, c, id) = t.req_rcvd();
    t.ep.mra(c, 24, true).unwrap();
    assert_eq!(t.ep.state(c), Some(State::MraReqSent));
    t.nothing_sent();
    t.recv(TID, CmMessage::Req(peer_req(PEER_ID, PEER_QPN)));
    let m = t.sent_one();
    assert_eq!(m.header.tid, TID);
    let CmMessage::Mra(mra) = m.msg else { panic!() };
    assert_eq!((mra.local_comm_id, mra.remote_comm_id), (id, PEER_ID));
    assert_eq!((mra.message_mraed, mra.service_timeout), (MsgCode::Req, 24));
    // A second mra() is refused and leaves the lazy MRA's time as it was.
    assert_eq!(
        t.ep.mra(c, 10, false),
        Err(CmError::InvalidState(State::MraReqSent))
    );
    t.nothing_sent();
    t.recv(TID, CmMessage::Req(peer_req(PEER_ID, PEER_QPN)));
    let CmMessage::Mra(mra) = t.sent_one().msg else {
        panic!()
    };
    assert_eq!(mra.service_timeout, 24);
    // Accept from MraReqSent works.
    t.ep.accept(t.now, c, &AcceptParams::default()).unwrap();
    assert!(matches!(t.sent_one().msg, CmMessage::Rep(_)));
}

#[test]
fn duplicate_req_in_rep_sent_resends_the_rep() {
    let mut t = T::new();
    let (_, _, id) = t.rep_sent();
    t.recv(TID, CmMessage::Req(peer_req(PEER_ID, PEER_QPN)));
    let CmMessage::Rep(rep) = t.sent_one().msg else {
        panic!()
    };
    assert_eq!(rep.local_comm_id, id);
}

#[test]
fn rep_times_out_without_rtu() {
    let mut t = T::new();
    let (_, c, _) = t.rep_sent();
    // REP timeout: 2 × ms(19 − 1) + ms(20) = 6144 ms, 15 retries.
    t.advance(Duration::from_millis(6144 * 16 + 1));
    assert_eq!(t.sent().len(), 15);
    assert_eq!(t.events(), vec![(c, CmEvent::TimedOut(TimedOut::Rep))]);
    assert_eq!(t.ep.state(c), Some(State::Idle));
}

#[test]
fn mra_of_rep_then_rtu() {
    let mut t = T::new();
    let (_, c, id) = t.rep_sent();
    t.recv(TID, peer_mra(PEER_ID, id, MsgCode::Rep, 22));
    assert_eq!(t.ep.state(c), Some(State::MraRepRcvd));
    t.events();
    t.recv(
        TID,
        CmMessage::Rtu(Rtu {
            local_comm_id: PEER_ID,
            remote_comm_id: id,
            ..Rtu::default()
        }),
    );
    assert_eq!(t.events(), vec![(c, CmEvent::Established)]);
}

/// After an MRA of our REP every REP retry waits the interval the MRA asked for (Linux's
/// `ib_modify_mad`), not the peer's response timeout (4.1 s here).
#[test]
fn an_mraed_rep_is_retried_at_the_mras_interval() {
    let mut t = T::new();
    let (_, c, id) = t.rep_sent();
    t.recv(TID, peer_mra(PEER_ID, id, MsgCode::Rep, 22));
    t.events();
    // 16.4 s asked for, plus the REQ's ACK timeout (19: 2.0 s).
    let extra =
        Duration::from_millis(rcm_proto::ib::ibta_time_ms(22) + rcm_proto::ib::ibta_time_ms(19));
    let ms = Duration::from_millis(1);
    for _ in 0..2 {
        t.advance(extra.saturating_sub(ms));
        t.nothing_sent();
        t.advance(ms);
        assert!(matches!(t.sent_one().msg, CmMessage::Rep(_)));
    }
    assert_eq!(t.ep.state(c), Some(State::MraRepRcvd));
}

/// Every way out of the half-open state gives its place in the budget back: with room for
/// one, a connection accepted after another left (confirmed, MRA'd then confirmed,
/// disconnected, rejected, timed out, destroyed, confirmed by its QP) is not given up.
#[test]
fn every_way_out_of_half_open_frees_its_place_in_the_budget() {
    fn rtu(peer: u32, id: u32) -> CmMessage {
        CmMessage::Rtu(Rtu {
            local_comm_id: peer,
            remote_comm_id: id,
            ..Rtu::default()
        })
    }

    type Exit = fn(&mut T, CepHandle, u32, u32);

    let mut t = T::with(|c| c.max_half_open = 1);
    t.ep.listen(SID, u64::MAX, 0).unwrap();
    let mut n = 0u32;
    let mut accept = |t: &mut T| {
        n += 1;
        t.recv(
            TID + u64::from(n),
            CmMessage::Req(peer_req(PEER_ID + n, 0x100 + n)),
        );
        let ev = t.events();
        let [(_, CmEvent::ReqReceived { cep, .. })] = ev.as_slice() else {
            panic!("{ev:?}")
        };
        let cep = *cep;
        t.ep.accept(
            t.now,
            cep,
            &AcceptParams {
                qpn: 0x22,
                ..AcceptParams::default()
            },
        )
        .unwrap();
        t.sent();
        (cep, PEER_ID + n, t.ep.local_comm_id(cep).unwrap())
    };
    let exits: [(&str, Exit); 7] = [
        ("RTU", |t, _, peer, id| t.recv(TID, rtu(peer, id))),
        ("MRA, then RTU", |t, _, peer, id| {
            t.recv(TID, peer_mra(peer, id, MsgCode::Rep, 22));
            t.recv(TID, rtu(peer, id));
        }),
        ("DREQ", |t, _, peer, id| t.recv(TID, dreq(peer, id, 0x22))),
        ("REJ", |t, _, peer, id| {
            t.recv(
                TID,
                CmMessage::Rej(Rej {
                    local_comm_id: peer,
                    remote_comm_id: id,
                    message_rejected: MsgCode::Rep,
                    reason: RejReason::ConsumerDefined,
                    ..Rej::default()
                }),
            );
        }),
        ("REP timeout", |t, _, _, _| {
            t.advance(Duration::from_secs(120));
        }),
        ("destroy", |t, c, _, _| t.ep.destroy(t.now, c).unwrap()),
        ("COMM_EST", |t, c, _, _| t.ep.notify_established(c).unwrap()),
    ];
    for (name, exit) in exits {
        let (c, peer, id) = accept(&mut t);
        assert_eq!(t.ep.state(c), Some(State::RepSent), "{name}");
        exit(&mut t, c, peer, id);
        t.sent();
        t.events();
        assert_ne!(t.ep.state(c), Some(State::RepSent), "{name}");
        assert_ne!(t.ep.state(c), Some(State::MraRepRcvd), "{name}");
    }
    let (last, _, _) = accept(&mut t);
    assert_eq!(t.ep.stats().half_open_evictions, 0);
    assert_eq!(t.ep.state(last), Some(State::RepSent));
}

/// From MRA_REQ_SENT the peer knows our comm ID (the MRA carried it), and the REJ names it
/// (Linux `cm_format_rej`); only REQ_RCVD sends 0.
#[test]
fn reject_after_an_mra_carries_our_comm_id() {
    let mut t = T::new();
    let (_, c, id) = t.req_rcvd();
    t.ep.mra(c, 20, false).unwrap();
    assert!(matches!(t.sent_one().msg, CmMessage::Mra(_)));
    t.ep.reject(t.now, c, RejReason::ConsumerDefined, &[], &[])
        .unwrap();
    let CmMessage::Rej(rej) = t.sent_one().msg else {
        panic!()
    };
    assert_eq!((rej.local_comm_id, rej.remote_comm_id), (id, PEER_ID));
    assert_eq!(rej.message_rejected, MsgCode::Req);
}

#[test]
fn reject_with_private_data() {
    let mut t = T::new();
    let (_, c, id) = t.req_rcvd();
    t.ep.reject(t.now, c, RejReason::ConsumerDefined, &[], b"no thanks")
        .unwrap();
    let m = t.sent_one();
    assert_eq!(m.header.tid, TID);
    let CmMessage::Rej(rej) = m.msg else { panic!() };
    // Linux `cm_format_rej` from REQ_RCVD: the peer never learned our comm ID, the field is 0.
    assert_ne!(id, 0);
    assert_eq!((rej.local_comm_id, rej.remote_comm_id), (0, PEER_ID));
    assert_eq!(
        (rej.reason, rej.message_rejected),
        (RejReason::ConsumerDefined, MsgCode::Req)
    );
    assert_eq!(&rej.private_data[..9], b"no thanks");
    assert_eq!(t.ep.state(c), Some(State::Idle));
    assert_eq!(
        t.ep.reject(t.now, c, RejReason::ConsumerDefined, &[], &[]),
        Err(CmError::InvalidState(State::Idle))
    );
    assert!(t
        .ep
        .reject(t.now, c, RejReason::ConsumerDefined, &[], &[0; 149])
        .is_err());
}

#[test]
fn rej_after_rep_sent_reports_and_idles() {
    let mut t = T::new();
    let (_, c, id) = t.rep_sent();
    t.recv(
        TID,
        CmMessage::Rej(Rej {
            local_comm_id: PEER_ID,
            remote_comm_id: id,
            message_rejected: MsgCode::Rep,
            reason: RejReason::ConsumerDefined,
            ..Rej::default()
        }),
    );
    assert!(matches!(
        t.events().as_slice(),
        [(
            _,
            CmEvent::Rejected {
                reason: RejReason::ConsumerDefined,
                ..
            }
        )]
    ));
    assert_eq!(t.ep.state(c), Some(State::Idle));
}

#[test]
fn timeout_rej_without_our_comm_id_finds_us_by_peer_id_and_guid() {
    let mut t = T::new();
    let (_, c, _) = t.rep_sent();
    let mut ari = vec![0u8; 72];
    ari[..8].copy_from_slice(&PEER_GUID.to_be_bytes());
    let rej = |ari: Vec<u8>| {
        CmMessage::Rej(Rej {
            local_comm_id: PEER_ID,
            remote_comm_id: 0,
            message_rejected: MsgCode::Other,
            reject_info_length: 8,
            reason: RejReason::Timeout,
            ari,
            ..Rej::default()
        })
    };
    let mut wrong = ari.clone();
    wrong[0] ^= 1;
    t.recv(TID, rej(wrong));
    assert!(t.events().is_empty(), "a guessed GUID does not match");
    t.recv(TID, rej(ari));
    assert!(
        matches!(t.events().as_slice(), [(h, CmEvent::Rejected { reason: RejReason::Timeout, .. })] if *h == c)
    );
}

#[test]
fn stale_connection_rejected_and_old_one_disconnected() {
    let mut t = T::new();
    let (c, id) = t.established_passive();
    // The peer restarted and reuses QPN 0x99 with a new comm ID.
    t.recv(0x999, CmMessage::Req(peer_req(0x7777_0000, PEER_QPN)));
    let sent = t.sent();
    let names: Vec<_> = sent.iter().map(|m| m.msg.name()).collect();
    assert_eq!(names, ["REJ", "DREQ"]);
    let CmMessage::Rej(rej) = &sent[0].msg else {
        panic!()
    };
    assert_eq!(
        (rej.reason, rej.remote_comm_id),
        (RejReason::StaleConn, 0x7777_0000)
    );
    let CmMessage::Dreq(d) = &sent[1].msg else {
        panic!()
    };
    assert_eq!((d.local_comm_id, d.remote_comm_id), (id, PEER_ID));
    assert_eq!(t.ep.state(c), Some(State::DreqSent));
    assert_eq!(t.ep.stats().stale_rejects, 1);
    assert!(t.events().is_empty(), "no new connection request surfaced");
}

/// Entering timewait releases the peer's comm ID and QPN, as Linux's `cm_enter_timewait`
/// (`cm_remove_remote`) does: the peer's next REQ, reusing its QPN (cmtime's invented QPNs
/// repeat, drivers hand out the lowest free one), is a new connect request while our end of
/// the previous connection sits out its timewait. (It was refused with REJ(STALE_CONN), where
/// a Linux CM accepts.) Only the local comm ID stays reserved.
#[test]
fn a_req_reusing_the_qpn_of_a_connection_in_timewait_is_a_new_request() {
    let mut t = T::new();
    let (c, id) = t.established_passive();
    t.peer_disconnects(c, id, 0x22);
    assert_eq!(t.ep.state(c), Some(State::Timewait));
    t.recv(TID + 1, CmMessage::Req(peer_req(PEER_ID + 1, PEER_QPN)));
    t.nothing_sent();
    let ev = t.events();
    let [(_, CmEvent::ReqReceived { cep, .. })] = ev.as_slice() else {
        panic!("expected a new connect request, got {ev:?}")
    };
    assert_ne!(
        t.ep.local_comm_id(*cep),
        Some(id),
        "the old comm ID stays reserved"
    );
    assert_eq!(t.ep.state(c), Some(State::Timewait));
    assert_eq!(t.ep.stats().stale_rejects, 0);
}

#[test]
fn backlog_full_drops_then_retry_gets_through() {
    let mut t = T::new();
    let l = t.ep.listen(SID, u64::MAX, 2).unwrap();
    for i in 0..3 {
        t.recv(
            TID + i,
            CmMessage::Req(peer_req(PEER_ID + i as u32, PEER_QPN + i as u32)),
        );
    }
    t.nothing_sent();
    let ev = t.events();
    assert_eq!(ev.len(), 2);
    assert_eq!(t.ep.stats().rx_backlog_drops, 1);
    let CmEvent::ReqReceived { cep, .. } = &ev[0].1 else {
        panic!()
    };
    t.ep.accept(t.now, *cep, &AcceptParams::default()).unwrap();
    t.sent();
    t.recv(TID + 2, CmMessage::Req(peer_req(PEER_ID + 2, PEER_QPN + 2)));
    assert!(matches!(t.events().as_slice(), [(h, CmEvent::ReqReceived { .. })] if *h == l));
}

/// `drop_request` forgets only an unanswered REQ silently; a SIDR request is answered
/// REJECT (cm.c's `cm_destroy_id` from SIDR_REQ_RCVD), and an endpoint that already sent
/// its REP is destroyed as usual (a REJ), so a caller that lost a race with `accept` does
/// not leave the peer waiting.
#[test]
fn drop_request_is_silent_only_for_an_unanswered_req() {
    let mut t = T::new();
    let (_, c, _) = t.req_rcvd();
    t.ep.drop_request(t.now, c).unwrap();
    t.nothing_sent();
    assert_eq!(t.ep.state(c), None);
    assert_eq!(t.ep.stats().rx_backlog_drops, 1);

    let mut t = T::new();
    let sid = cma::service_id(PortSpace::Udp, 7000);
    t.ep.listen(sid, u64::MAX, 0).unwrap();
    let sidr = SidrReq {
        request_id: 0xAC,
        pkey: 0xFFFF,
        service_id: sid,
        ..SidrReq::default()
    };
    t.recv(9, CmMessage::SidrReq(sidr));
    let ev = t.events();
    let [(_, CmEvent::SidrReqReceived { cep, .. })] = ev.as_slice() else {
        panic!("{ev:?}")
    };
    t.ep.drop_request(t.now, *cep).unwrap();
    let CmMessage::SidrRep(r) = t.sent_one().msg else {
        panic!()
    };
    assert_eq!((r.status, r.request_id), (SidrStatus::Rejected, 0xAC));
    assert_eq!(t.ep.stats().rx_backlog_drops, 0);

    let mut t = T::new();
    let (_, c, id) = t.rep_sent();
    t.ep.drop_request(t.now, c).unwrap();
    let CmMessage::Rej(rej) = t.sent_one().msg else {
        panic!()
    };
    assert_eq!((rej.local_comm_id, rej.remote_comm_id), (id, PEER_ID));
    assert_eq!(t.ep.stats().rx_backlog_drops, 0);
}

#[test]
fn wildcard_listener_by_port_space_mask() {
    let mut t = T::new();
    let (base, mask) = PortSpace::Tcp.service_id_range();
    let l = t.ep.listen(base, mask, 0).unwrap();
    assert!(matches!(
        t.ep.listen(SID, u64::MAX, 0),
        Err(CmError::AddressInUse(_))
    ));
    t.recv(TID, CmMessage::Req(peer_req(PEER_ID, PEER_QPN)));
    assert!(matches!(t.events().as_slice(), [(h, CmEvent::ReqReceived { .. })] if *h == l));
    let mut udp = peer_req(PEER_ID + 1, PEER_QPN + 1);
    udp.service_id = cma::service_id(PortSpace::Udp, 7471);
    t.recv(TID, CmMessage::Req(udp));
    assert!(matches!(
        t.sent_one().msg,
        CmMessage::Rej(Rej {
            reason: RejReason::InvalidServiceId,
            ..
        })
    ));
}

// ---------------------------------------------------------------- ids, destroy, misc

/// Local comm IDs are a cyclic index XOR a random operand (`alloc_local_id`): unique, not a
/// counter, and never one a connection in timewait still holds.
#[test]
fn comm_ids_are_unique_random_and_not_reused_in_timewait() {
    // Runs (seeds) and connects a run, for "not a counter" below.
    const SEEDS: u64 = 8;
    const N: u32 = 2000;
    let mut a = T::with(|c| c.seed = 1);
    let mut b = T::with(|c| c.seed = 2);
    let (_, ra, _) = a.connect();
    let (_, rb, _) = b.connect();
    assert_ne!(
        ra.local_comm_id, rb.local_comm_id,
        "start depends on the seed"
    );

    // Not a counter. Consecutive indices XORed with an operand that ends in z zero bits
    // differ by one only where the index's carry stays below bit z: about 2^-z of the
    // steps are something else (a fall, or a jump), every step when the operand is odd. A
    // counter steps by one each time but where it wraps or skips 0, at most once in a run
    // this short. So over SEEDS runs a counter has at most SEEDS other steps, and the XOR
    // allocator (about 2,000 × 2^-z a run) that few only if every seed's operand ended in
    // 8 or more zero bits: odds under 2^-64.
    let mut other_steps = 0;
    for seed in 0..SEEDS {
        let mut t = T::with(|c| c.seed = seed);
        let mut ids = std::collections::HashSet::new();
        let mut prev: Option<u32> = None;
        for i in 0..N {
            let mut p = ConnectParams::new(ip(PEER), SID, i + 2);
            p.starting_psn = Some(1);
            let h = t.ep.connect(t.now, &p).unwrap();
            let id = t.ep.local_comm_id(h).unwrap();
            assert_ne!(id, 0, "seed {seed}: comm ID 0 handed out");
            assert!(
                ids.insert(id),
                "seed {seed}: comm ID {id:#x} handed out twice"
            );
            if prev.is_some_and(|p| id != p.wrapping_add(1)) {
                other_steps += 1;
            }
            prev = Some(id);
        }
    }
    assert!(
        other_steps > SEEDS,
        "comm IDs count up by one: {other_steps} other steps in {SEEDS} runs of {N}"
    );

    // Not reused in timewait: one connection in timewait that the user still holds, one
    // destroyed (parked with only its comm ID), and many connects meanwhile.
    let mut t = T::new();
    let (held, held_id) = t.established_passive();
    t.peer_disconnects(held, held_id, 0x22);
    assert_eq!(t.ep.state(held), Some(State::Timewait));
    let (gone, gone_id) = t.established_active();
    t.ep.destroy(t.now, gone).unwrap();
    assert!(matches!(t.sent_one().msg, CmMessage::Dreq(_)));
    t.recv(
        1,
        CmMessage::Drep(Drep {
            local_comm_id: PEER_ID,
            remote_comm_id: gone_id,
            ..Drep::default()
        }),
    );
    assert_eq!(
        t.ep.state(gone),
        None,
        "destroyed: the user's handle is gone"
    );
    assert_eq!(t.ep.cep_count(), 2, "both wait out their timewait");
    for i in 0..5000 {
        let mut p = ConnectParams::new(ip(PEER), SID, i + 2);
        p.starting_psn = Some(1);
        let h = t.ep.connect(t.now, &p).unwrap();
        let id = t.ep.local_comm_id(h).unwrap();
        assert!(
            id != held_id && id != gone_id,
            "connect {i} got comm ID {id:#x}, held by a connection in timewait"
        );
        t.ep.destroy(t.now, h).unwrap();
    }
    t.sent();
    assert_eq!(t.ep.state(held), Some(State::Timewait), "still waiting");
    assert_eq!(t.ep.local_comm_id(held), Some(held_id));
    assert_eq!(t.ep.cep_count(), 2, "both still wait out their timewait");
}

#[test]
fn destroy_in_each_state_sends_what_linux_sends() {
    // ReqSent: REJ(TIMEOUT) with our GUID.
    let mut t = T::new();
    let (h, _, _) = t.connect();
    t.ep.destroy(t.now, h).unwrap();
    assert!(matches!(
        t.sent_one().msg,
        CmMessage::Rej(Rej {
            reason: RejReason::Timeout,
            ..
        })
    ));
    assert_eq!(t.ep.state(h), None);
    assert_eq!(t.ep.cep_count(), 0);
    t.advance(Duration::from_secs(100));
    t.nothing_sent();
    assert_eq!(t.ep.destroy(t.now, h), Err(CmError::UnknownHandle));

    // ReqRcvd: REJ(CONSUMER_DEFINED).
    let mut t = T::new();
    let (_, c, _) = t.req_rcvd();
    t.ep.destroy(t.now, c).unwrap();
    assert!(matches!(
        t.sent_one().msg,
        CmMessage::Rej(Rej {
            reason: RejReason::ConsumerDefined,
            ..
        })
    ));

    // Established: DREQ once, then an invisible timewait; no events, ever.
    let mut t = T::new();
    let (h, id) = t.established_active();
    t.ep.destroy(t.now, h).unwrap();
    assert!(matches!(t.sent_one().msg, CmMessage::Dreq(_)));
    t.recv(
        1,
        CmMessage::Drep(Drep {
            local_comm_id: PEER_ID,
            remote_comm_id: id,
            ..Drep::default()
        }),
    );
    t.recv(2, dreq(PEER_ID, id, 0x11));
    t.advance(Duration::from_secs(100));
    assert!(t.events().is_empty());
    assert_eq!(t.ep.cep_count(), 0, "gone after timewait");
    assert_eq!(t.ep.table_sizes(), (0, 0, 0, 0, 0));

    // DreqRcvd: DREP.
    let mut t = T::new();
    let (h, id) = t.established_active();
    t.recv(1, dreq(PEER_ID, id, 0x11));
    t.events();
    t.ep.destroy(t.now, h).unwrap();
    assert!(matches!(t.sent_one().msg, CmMessage::Drep(_)));
}

#[test]
fn destroy_discards_queued_events() {
    let mut t = T::new();
    let (h, req, tid) = t.connect();
    t.recv(tid, CmMessage::Rep(peer_rep(req.local_comm_id)));
    t.ep.destroy(t.now, h).unwrap();
    assert!(t.events().is_empty());
}

#[test]
fn destroying_a_listener_rejects_requests_nobody_saw() {
    let mut t = T::new();
    let l = t.ep.listen(SID, u64::MAX, 0).unwrap();
    t.recv(TID, CmMessage::Req(peer_req(PEER_ID, PEER_QPN)));
    t.ep.destroy(t.now, l).unwrap();
    assert!(t.events().is_empty());
    let CmMessage::Rej(rej) = t.sent_one().msg else {
        panic!()
    };
    assert_eq!(
        (rej.reason, rej.remote_comm_id),
        (RejReason::ConsumerDefined, PEER_ID)
    );
    assert_eq!(t.ep.cep_count(), 0);
    // And the service is free again: a new REQ is answered "no listener".
    t.recv(TID, CmMessage::Req(peer_req(PEER_ID + 1, PEER_QPN + 1)));
    assert!(matches!(
        t.sent_one().msg,
        CmMessage::Rej(Rej {
            reason: RejReason::InvalidServiceId,
            ..
        })
    ));
}

#[test]
fn sidr_exchange_both_sides() {
    // Active.
    let mut t = T::new();
    let p = SidrParams {
        dst: ip(PEER),
        service_id: cma::service_id(PortSpace::Udp, 7174),
        private_data: vec![1, 2, 3],
        timeout: 20,
        max_retries: 3,
    };
    let h = t.ep.sidr_request(t.now, &p).unwrap();
    let m = t.sent_one();
    let CmMessage::SidrReq(req) = m.msg else {
        panic!()
    };
    assert_eq!(req.service_id, p.service_id);
    let rep = SidrRep {
        request_id: req.request_id,
        status: SidrStatus::Success,
        qpn: 0x12,
        qkey: cma::RDMA_UDP_QKEY,
        ..SidrRep::default()
    };
    t.recv_from(OTHER, m.header.tid, CmMessage::SidrRep(rep.clone()));
    assert!(t.events().is_empty(), "from the wrong host");
    t.recv(m.header.tid, CmMessage::SidrRep(rep.clone()));
    let ev = t.events();
    assert!(
        matches!(ev.as_slice(), [(eh, CmEvent::SidrRepReceived { status: SidrStatus::Success, qpn: 0x12, qkey: 0x0123_4567, .. })] if *eh == h)
    );
    t.recv(m.header.tid, CmMessage::SidrRep(rep));
    assert!(t.events().is_empty(), "a duplicate SIDR_REP is ignored");

    // Timeout.
    let h = t.ep.sidr_request(t.now, &p).unwrap();
    t.advance(Duration::from_secs(30));
    assert_eq!(t.sent().len(), 4);
    assert_eq!(t.events(), vec![(h, CmEvent::TimedOut(TimedOut::SidrReq))]);

    // Passive.
    let mut t = T::new();
    let sidr = SidrReq {
        request_id: 0xAB,
        pkey: 0xFFFF,
        service_id: p.service_id,
        ..SidrReq::default()
    };
    t.recv(9, CmMessage::SidrReq(sidr.clone()));
    let CmMessage::SidrRep(r) = t.sent_one().msg else {
        panic!()
    };
    assert_eq!(
        (r.status, r.request_id),
        (SidrStatus::UnsupportedServiceId, 0xAB)
    );
    let l = t.ep.listen(p.service_id, u64::MAX, 0).unwrap();
    t.recv(9, CmMessage::SidrReq(sidr.clone()));
    let ev = t.events();
    let [(lh, CmEvent::SidrReqReceived { cep, .. })] = ev.as_slice() else {
        panic!("{ev:?}")
    };
    assert_eq!(*lh, l);
    t.recv(9, CmMessage::SidrReq(sidr));
    assert!(t.events().is_empty(), "duplicate dropped");
    t.ep.sidr_reply(
        *cep,
        &SidrReplyParams {
            status: SidrStatus::Success,
            qpn: 0x33,
            qkey: 7,
            private_data: vec![9],
        },
    )
    .unwrap();
    let m = t.sent_one();
    assert_eq!(m.header.tid, 9);
    let CmMessage::SidrRep(r) = m.msg else {
        panic!()
    };
    assert_eq!(
        (r.request_id, r.qpn, r.qkey, r.service_id),
        (0xAB, 0x33, 7, p.service_id)
    );
}

#[test]
fn lap_apr_ignored_and_class_port_info_answered_like_linux() {
    let mut t = T::new();
    let (h, id) = t.established_active();
    t.recv(
        1,
        CmMessage::Lap(Lap {
            local_comm_id: PEER_ID,
            remote_comm_id: id,
            ..Lap::default()
        }),
    );
    t.recv(
        2,
        CmMessage::Apr(cm::Apr {
            local_comm_id: PEER_ID,
            remote_comm_id: id,
            ..cm::Apr::default()
        }),
    );
    t.nothing_sent();
    assert!(t.events().is_empty());
    assert_eq!(t.ep.stats().rx_lap_apr_ignored, 2);
    assert_eq!(t.ep.state(h), Some(State::Established));
    let mut get = CmMad::send(0x42, CmMessage::ClassPortInfo(ClassPortInfo::default()));
    get.header.method = mad::method::GET;
    t.ep.handle_datagram(t.now, ip(PEER), &get.emit().unwrap());
    let m = t.sent_one();
    assert_eq!(
        (m.header.method, m.header.status, m.header.tid),
        (0x81, 0x000C, 0x42)
    );
}

#[test]
fn malformed_mads_are_counted_and_dropped() {
    let mut t = T::new();
    let (h, _) = t.established_active();
    t.ep.handle_datagram(t.now, ip(PEER), &[0u8; 10]);
    let mut bad = CmMad::send(1, CmMessage::Rtu(Rtu::default()))
        .emit()
        .unwrap();
    bad[2] = 1; // class version
    t.ep.handle_datagram(t.now, ip(PEER), &bad);
    assert_eq!(t.ep.stats().rx_malformed, 2);
    assert_eq!(t.ep.state(h), Some(State::Established));
}

#[test]
fn commands_in_the_wrong_state_are_refused() {
    let mut t = T::new();
    let (h, _, _) = t.connect();
    assert_eq!(
        t.ep.establish(h),
        Err(CmError::InvalidState(State::ReqSent))
    );
    assert_eq!(
        t.ep.disconnect(t.now, h, &[]),
        Err(CmError::InvalidState(State::ReqSent))
    );
    assert_eq!(
        t.ep.accept(t.now, h, &AcceptParams::default()),
        Err(CmError::InvalidState(State::ReqSent))
    );
    assert_eq!(
        t.ep.establish(CepHandle(std::num::NonZeroU64::new(999).unwrap())),
        Err(CmError::UnknownHandle)
    );
    let mut p = ConnectParams::new(ip(PEER), SID, 1);
    p.private_data = vec![0; 93];
    assert!(matches!(t.ep.connect(t.now, &p), Err(CmError::Wire(_))));
}

#[test]
fn stale_rep_is_rejected_again_for_each_copy_and_never_taken() {
    let mut t = T::new();
    let (old, _) = t.established_active(); // holds the peer's QPN 0x99
    let (h, req, tid) = t.connect();
    let mut rep = peer_rep(req.local_comm_id);
    rep.local_comm_id = 0x6666_0000; // a new connection of the peer, reusing QPN 0x99
    t.recv(tid, CmMessage::Rep(rep.clone()));
    let names: Vec<_> = t.sent().iter().map(|m| m.msg.name()).collect();
    assert_eq!(
        names,
        ["REJ", "DREQ"],
        "stale REP rejected, the old connection torn down"
    );
    assert_eq!(t.ep.state(h), Some(State::ReqSent));
    assert_eq!(
        t.ep.state(old),
        Some(State::DreqSent),
        "still holds QPN 0x99"
    );
    // Our REJ was lost and the peer (REP_SENT) sends its REP again: refused again, as
    // Linux's `cm_rep_handler` does while the QPN is held, and no second DREQ.
    let stale_rej = |t: &mut T| {
        let sent = t.sent();
        assert_eq!(
            sent.len(),
            1,
            "{:?}",
            sent.iter().map(|m| m.msg.name()).collect::<Vec<_>>()
        );
        let m = &sent[0];
        assert_eq!(m.header.tid, tid);
        let CmMessage::Rej(r) = &m.msg else {
            panic!("{m:?}")
        };
        assert_eq!(
            (
                r.reason,
                r.message_rejected,
                r.local_comm_id,
                r.remote_comm_id
            ),
            (
                RejReason::StaleConn,
                MsgCode::Rep,
                req.local_comm_id,
                0x6666_0000
            )
        );
    };
    t.recv(tid, CmMessage::Rep(rep.clone()));
    stale_rej(&mut t);
    assert_eq!(t.ep.state(h), Some(State::ReqSent));
    // The old connection goes away entirely.
    t.ep.destroy(t.now, old).unwrap();
    t.advance(Duration::from_secs(5));
    t.sent();
    t.events();
    // A later copy of the stale REP still must not establish a connection whose passive
    // side our REJ may have sent to timewait (Linux would take it now): refused again.
    t.recv(tid, CmMessage::Rep(rep));
    stale_rej(&mut t);
    assert!(t.events().is_empty());
    assert_eq!(t.ep.state(h), Some(State::ReqSent));
    assert!(t.ep.stats().rx_duplicates >= 2);
    assert_eq!(t.ep.stats().stale_rejects, 3);
}

/// A REP naming the QPN and CA GUID of a connection we hold with another host is stale and
/// refused, but that connection is not ended: as for a stale REQ, only its own peer may end it
/// so. Both values travel in the clear, and any host we connect to could otherwise end our
/// connection to any other (Linux's `cm_rep_handler` sends the DREQ regardless).
#[test]
fn a_stale_rep_ends_the_connection_it_names_only_from_that_connections_peer() {
    let mut t = T::new();
    let (old, _) = t.established_active(); // with PEER, holding its QPN 0x99
    let (h, req, tid) = t.connect_with(|p| p.dst = ip(OTHER));
    let mut rep = peer_rep(req.local_comm_id);
    rep.local_comm_id = 0x6666_0000; // OTHER claims PEER's QPN and CA GUID
    t.recv_from(OTHER, tid, CmMessage::Rep(rep));
    assert_eq!(t.names(), ["REJ"], "refused, and no DREQ to PEER");
    assert_eq!(t.ep.state(old), Some(State::Established));
    assert_eq!(t.ep.state(h), Some(State::ReqSent));
    assert_eq!(t.ep.stats().stale_rejects, 1);
}

/// A stale REP is rejected without an RTU even when the endpoint answers REPs itself
/// (`establish_on_rep`): the RTU goes out only for a REP that passed every check.
#[test]
fn a_stale_rep_gets_no_rtu_from_an_endpoint_that_answers_reps_itself() {
    let mut t = T::new();
    let _ = t.established_active(); // holds the peer's QPN
    let (h, req, tid) = t.connect_with(|p| p.establish_on_rep = true);
    let mut rep = peer_rep(req.local_comm_id);
    rep.local_comm_id = 0x6666_0000; // a new connection of the peer, reusing its QPN
    t.recv(tid, CmMessage::Rep(rep));
    let names: Vec<_> = t.sent().iter().map(|m| m.msg.name()).collect();
    assert_eq!(names, ["REJ", "DREQ"], "no RTU for a stale REP");
    assert_eq!(t.ep.state(h), Some(State::ReqSent));
    assert!(
        !t.events()
            .iter()
            .any(|(e, ev)| *e == h && matches!(ev, CmEvent::Established | CmEvent::RepReceived(_))),
        "nothing reported for the connecting endpoint"
    );
}

/// A destroy that comes after the engine answered the REP itself (`establish_on_rep`) but
/// before its events were taken: the connection is established on the wire (RTU sent), so
/// the destroy ends it with a DREQ, as from Established, where without the flag the same
/// moment (RepRcvd) gets a REJ; the events nobody took die with the handle. This is the
/// order a destroy racing the REP's handling in the id layer meets (Linux's in-kernel RTU
/// races the same way).
#[test]
fn a_destroy_after_a_rep_answered_by_the_engine_sends_a_dreq_and_reports_nothing() {
    let mut t = T::new();
    let (h, req, tid) = t.connect_with(|p| p.establish_on_rep = true);
    t.recv(tid, CmMessage::Rep(peer_rep(req.local_comm_id)));
    assert!(matches!(t.sent_one().msg, CmMessage::Rtu(_)));
    t.ep.destroy(t.now, h).unwrap();
    let m = t.sent_one();
    let CmMessage::Dreq(d) = m.msg else {
        panic!("{:?}", m.msg.name())
    };
    assert_eq!(
        (d.local_comm_id, d.remote_comm_id, d.remote_qpn),
        (req.local_comm_id, PEER_ID, PEER_QPN)
    );
    assert!(
        t.events().is_empty(),
        "the untaken REP and ESTABLISHED events died"
    );
    // The DREP ends nothing more; timewait passes without a word.
    t.recv(
        1,
        CmMessage::Drep(Drep {
            local_comm_id: PEER_ID,
            remote_comm_id: req.local_comm_id,
            ..Drep::default()
        }),
    );
    t.advance(Duration::from_secs(100));
    t.nothing_sent();
    assert!(t.events().is_empty());
    assert_eq!(t.ep.cep_count(), 0);

    // The same moment without the flag: RepRcvd, a REJ, no RTU.
    let mut t = T::new();
    let (h, req, tid) = t.connect();
    t.recv(tid, CmMessage::Rep(peer_rep(req.local_comm_id)));
    t.nothing_sent();
    t.ep.destroy(t.now, h).unwrap();
    assert!(matches!(t.sent_one().msg, CmMessage::Rej(_)));
    assert!(t.events().is_empty());
}

/// The events since the last call, but the half-open evictions (REP timeouts), whose
/// endpoints go to `evicted`.
fn events_but_evictions(t: &mut T, evicted: &mut Vec<CepHandle>) -> Vec<(CepHandle, CmEvent)> {
    let mut ev = t.events();
    ev.retain(|(h, e)| {
        let gone = matches!(e, CmEvent::TimedOut(TimedOut::Rep));
        if gone {
            evicted.push(*h);
        }
        !gone
    });
    ev
}

/// The half-open budget: accepted connections whose RTU never comes (a spoofed REQ flood)
/// stay within `max_half_open`; the oldest are given up as REP timeouts, without a REJ to the
/// (spoofed) peer, while a connection that confirms in time is untouched.
#[test]
fn half_open_budget_evicts_the_oldest_unconfirmed_accepts() {
    let mut t = T::with(|c| c.max_half_open = 16);
    let l = t.ep.listen(SID, u64::MAX, 0).unwrap();
    let mut accepted = Vec::new();
    let mut legit = None;
    let mut timeouts = Vec::new();
    for i in 0..100u32 {
        t.recv(
            TID + u64::from(i),
            CmMessage::Req(peer_req(PEER_ID + i, PEER_QPN + i)),
        );
        let ev = events_but_evictions(&mut t, &mut timeouts);
        let [(lh, CmEvent::ReqReceived { cep, .. })] = ev.as_slice() else {
            panic!("{ev:?}")
        };
        assert_eq!(*lh, l);
        t.ep.accept(t.now, *cep, &AcceptParams::default()).unwrap();
        let rep = t.sent();
        assert!(
            rep.iter().any(|m| matches!(m.msg, CmMessage::Rep(_))),
            "REQ {i} answered"
        );
        accepted.push(*cep);
        if i == 50 {
            // One real client among the flood: its RTU comes at once.
            let id = t.ep.local_comm_id(*cep).unwrap();
            t.recv(
                TID + u64::from(i),
                CmMessage::Rtu(Rtu {
                    local_comm_id: PEER_ID + i,
                    remote_comm_id: id,
                    ..Rtu::default()
                }),
            );
            // The accept's own eviction (one per accept over the budget) may come first.
            let ev = events_but_evictions(&mut t, &mut timeouts);
            assert_eq!(ev, vec![(*cep, CmEvent::Established)]);
            legit = Some(*cep);
        }
    }
    for (h, e) in t.events() {
        assert_eq!(e, CmEvent::TimedOut(TimedOut::Rep));
        timeouts.push(h);
    }
    let evicted = t.ep.stats().half_open_evictions;
    assert!(evicted >= 100 - 16 - 1, "evicted only {evicted}");
    assert_eq!(
        timeouts.len() as u64,
        evicted,
        "one REP timeout per eviction"
    );
    assert!(!timeouts.contains(legit.as_ref().unwrap()));
    let waiting = accepted
        .iter()
        .filter(|h| t.ep.state(**h) == Some(State::RepSent))
        .count();
    assert!(
        waiting <= 16,
        "{waiting} accepted connections still half-open"
    );
    // The newest accepts survive; the real client is established.
    assert_eq!(t.ep.state(accepted[99]), Some(State::RepSent));
    assert_eq!(t.ep.state(legit.unwrap()), Some(State::Established));
    // Evictions are REP timeouts to the owner and send nothing to the peer.
    assert_eq!(t.ep.state(accepted[0]), Some(State::Idle));
    t.nothing_sent();
}

/// Under the budget nothing is evicted, however many connections confirm over time.
#[test]
fn half_open_budget_leaves_confirmed_connections_alone() {
    let mut t = T::with(|c| c.max_half_open = 4);
    t.ep.listen(SID, u64::MAX, 0).unwrap();
    for i in 0..50u32 {
        t.recv(
            TID + u64::from(i),
            CmMessage::Req(peer_req(PEER_ID + i, PEER_QPN + i)),
        );
        let ev = t.events();
        let [(_, CmEvent::ReqReceived { cep, .. })] = ev.as_slice() else {
            panic!("{ev:?}")
        };
        t.ep.accept(t.now, *cep, &AcceptParams::default()).unwrap();
        t.sent();
        let id = t.ep.local_comm_id(*cep).unwrap();
        t.recv(
            TID + u64::from(i),
            CmMessage::Rtu(Rtu {
                local_comm_id: PEER_ID + i,
                remote_comm_id: id,
                ..Rtu::default()
            }),
        );
        assert_eq!(t.events(), vec![(*cep, CmEvent::Established)]);
    }
    assert_eq!(t.ep.stats().half_open_evictions, 0);
}

/// A queue that hovers just under the half-open budget (each accept's connection confirms
/// 60 accepts later, against a budget of 64) is neither walked every few accepts nor
/// trimmed: it was walked in full every ~4 accepts (each walk found ~60 live entries, under
/// the budget, and the next few accepts crossed it again: 484 walks here).
#[test]
fn a_queue_near_the_half_open_budget_is_not_walked_every_few_accepts() {
    const MAX: usize = 64;
    const LAG: usize = 60;
    const N: usize = 2000;
    let mut t = T::with(|c| c.max_half_open = MAX);
    t.ep.listen(SID, u64::MAX, 0).unwrap();
    let mut accepted = Vec::new();
    for i in 0..N as u32 {
        t.recv(
            TID + u64::from(i),
            CmMessage::Req(peer_req(PEER_ID + i, PEER_QPN + i)),
        );
        let ev = t.events();
        let Some(cep) = ev.iter().find_map(|(_, e)| match e {
            CmEvent::ReqReceived { cep, .. } => Some(*cep),
            _ => None,
        }) else {
            panic!("{ev:?}")
        };
        t.ep.accept(t.now, cep, &AcceptParams::default()).unwrap();
        t.sent();
        accepted.push((i, cep));
        if accepted.len() > LAG {
            let (j, old) = accepted.remove(0);
            if t.ep.state(old) == Some(State::RepSent) {
                let id = t.ep.local_comm_id(old).unwrap();
                t.recv(
                    TID + u64::from(j),
                    CmMessage::Rtu(Rtu {
                        local_comm_id: PEER_ID + j,
                        remote_comm_id: id,
                        ..Rtu::default()
                    }),
                );
                t.events();
            }
        }
    }
    let s = t.ep.stats();
    assert_eq!(
        s.half_open_evictions, 0,
        "under the budget nothing is given up"
    );
    assert!(
        s.half_open_compactions as usize <= N / (MAX / 8) + 1,
        "{} walks of the half-open queue for {N} accepts",
        s.half_open_compactions
    );
    let waiting = accepted
        .iter()
        .filter(|(_, h)| t.ep.state(*h) == Some(State::RepSent))
        .count();
    assert!(waiting <= MAX, "{waiting} half-open, over the budget");
}

#[test]
fn cep_states_counts_connection_endpoints_by_state() {
    let mut p = T::new();
    assert!(p.ep.cep_states().is_empty());
    let (_l, _child, _) = p.req_rcvd();
    let s = p.ep.cep_states();
    assert_eq!(
        s.get("ReqRcvd"),
        Some(&1),
        "listeners are not counted: {s:?}"
    );
    assert_eq!(s.values().sum::<usize>(), 1, "{s:?}");
    let mut a = T::new();
    let (h, _) = a.established_active();
    assert_eq!(a.ep.cep_states().get("Established"), Some(&1));
    // Destroyed while established: it finishes its duties as an orphan in timewait.
    a.ep.destroy(a.now, h).unwrap();
    let s = a.ep.cep_states();
    assert_eq!(s.get("Timewait (orphan)"), Some(&1), "{s:?}");
}

/// A burst of connections leaves no pile of dead timer entries: each REQ's retransmission
/// timer dies at the REP, and once the dead entries may be half the heap they are swept
/// (before, 5,000 established connections kept 5,000 entries until their deadlines came
/// round, and the heap's capacity after that).
#[test]
fn answered_retransmission_timers_do_not_pile_up() {
    let mut t = T::new();
    let n: u32 = 5000;
    let mut hs = Vec::new();
    for i in 0..n {
        let (h, req, tid) = t.connect();
        let rep = Rep {
            local_comm_id: 0x1000 + i,
            local_qpn: 0x100 + i,
            ..peer_rep(req.local_comm_id)
        };
        t.recv(tid, CmMessage::Rep(rep));
        t.ep.establish(h).unwrap();
        t.sent();
        t.events();
        hs.push(h);
    }
    for h in &hs {
        assert_eq!(t.ep.state(*h), Some(State::Established));
    }
    let timers = t.ep.table_sizes().4;
    assert!(
        timers < 2048,
        "{timers} timer entries for {n} established connections without timers"
    );
    // The sweep dropped dead entries only: a fresh connection's REQ is still retransmitted.
    let (h, _, _) = t.connect();
    t.advance(Duration::from_millis(6144));
    assert!(
        t.sent().iter().any(|m| matches!(m.msg, CmMessage::Req(_))),
        "the REQ of {h:?} was not retransmitted"
    );
}

/// A REQ naming a QPN (and CA GUID) of a connection still established is stale (IBTA
/// 12.9.8.3.3): refused, and the connection it names is ended with a DREQ, as Linux's
/// cm_req_handler does, but only when the REQ comes from that connection's peer. Both are
/// sent in the clear, so from anyone else it would let any host end anyone's connection.
#[test]
fn a_stale_req_ends_the_connection_it_names_only_from_that_connections_peer() {
    let mut t = T::new();
    let (c, _) = t.established_passive();
    t.recv_from(
        OTHER,
        TID + 1,
        CmMessage::Req(peer_req(PEER_ID + 1, PEER_QPN)),
    );
    let sent = t.sent();
    assert!(
        matches!(sent.as_slice(), [m] if matches!(&m.msg, CmMessage::Rej(r) if r.reason == RejReason::StaleConn)),
        "{sent:?}"
    );
    assert_eq!(t.ep.state(c), Some(State::Established));
    assert!(t.events().is_empty());
    // From its peer: refused, and the old connection goes down.
    t.recv(TID + 2, CmMessage::Req(peer_req(PEER_ID + 2, PEER_QPN)));
    let sent = t.sent();
    assert!(
        sent.iter()
            .any(|m| matches!(&m.msg, CmMessage::Rej(r) if r.reason == RejReason::StaleConn)),
        "{sent:?}"
    );
    assert!(
        sent.iter().any(|m| matches!(m.msg, CmMessage::Dreq(_))),
        "{sent:?}"
    );
    assert_ne!(t.ep.state(c), Some(State::Established));
}

/// Timewait lasts the path's ACK timeout, which on the passive side is the peer's REQ's:
/// its largest value (31: 4.096 µs × 2^31, 2.4 hours) must not hold the endpoint (and its
/// place in the tables) that long. At most 30 s.
#[test]
fn a_peers_largest_ack_timeout_does_not_make_timewait_last_hours() {
    let mut t = T::new();
    let mut req = peer_req(PEER_ID, PEER_QPN);
    req.primary_path.local_ack_timeout = 31;
    let (c, id) = t.established_passive_with(req);
    t.recv(0x77, dreq(PEER_ID, id, 0x22));
    t.events();
    t.ep.disconnect(t.now, c, &[]).unwrap();
    assert!(matches!(t.sent_one().msg, CmMessage::Drep(_)));
    assert_eq!(t.ep.state(c), Some(State::Timewait));
    t.advance(Duration::from_secs(30) + Duration::from_millis(1));
    assert_eq!(t.events(), vec![(c, CmEvent::TimewaitExit)]);
}

/// A REQ whose comm ID is 0 (the engine's mark for "peer not known yet") is refused with
/// REJ(INVALID_COMM_ID) and surfaces nothing: accepted, the connection could not be ended by
/// the peer's DREQ.
#[test]
fn a_req_with_comm_id_zero_is_rejected_invalid_comm_id() {
    let mut t = T::new();
    let _l = t.ep.listen(SID, u64::MAX, 0).unwrap();
    t.recv(TID, CmMessage::Req(peer_req(0, PEER_QPN)));
    let m = t.sent_one();
    let CmMessage::Rej(rej) = &m.msg else {
        panic!("{m:?}")
    };
    assert_eq!(
        (rej.reason, rej.message_rejected, rej.remote_comm_id),
        (RejReason::InvalidCommId, MsgCode::Req, 0)
    );
    assert_eq!(m.header.tid, TID);
    assert!(t.events().is_empty(), "no connect request surfaced");
    assert_eq!(t.ep.stats().invalid_comm_id_rejects, 1);
    // The same peer with a proper comm ID is served.
    t.recv(TID + 1, CmMessage::Req(peer_req(PEER_ID, PEER_QPN)));
    t.nothing_sent();
    assert!(matches!(
        t.events().as_slice(),
        [(_, CmEvent::ReqReceived { .. })]
    ));
}

/// A REP whose comm ID is 0 is refused with REJ(INVALID_COMM_ID), and our attempt ends as
/// rejected (idle, no retry of the REQ).
#[test]
fn a_rep_with_comm_id_zero_is_rejected_and_the_attempt_ends() {
    let mut t = T::new();
    let (h, req, tid) = t.connect();
    let mut rep = peer_rep(req.local_comm_id);
    rep.local_comm_id = 0;
    t.recv(tid, CmMessage::Rep(rep));
    let m = t.sent_one();
    let CmMessage::Rej(rej) = &m.msg else {
        panic!("{m:?}")
    };
    assert_eq!(
        (
            rej.reason,
            rej.message_rejected,
            rej.local_comm_id,
            rej.remote_comm_id
        ),
        (RejReason::InvalidCommId, MsgCode::Rep, req.local_comm_id, 0)
    );
    let ev = t.events();
    assert!(
        matches!(ev.as_slice(), [(eh, CmEvent::Rejected { reason: RejReason::InvalidCommId, .. })] if *eh == h),
        "{ev:?}"
    );
    assert_eq!(t.ep.state(h), Some(State::Idle));
    assert_eq!(t.ep.stats().invalid_comm_id_rejects, 1);
    t.advance(Duration::from_secs(120));
    t.nothing_sent();
    assert!(t.events().is_empty(), "no REQ retry, no timeout");
}

/// A REQ for a UC, RD or XRC connection: only RC is made here. Linux's rdma_cm refuses a
/// REQ whose QP type is not its listener's (`cma_ib_check_req_qp_type`), and ib_cm then
/// destroys the new id from REQ_RCVD: REJ(CONSUMER_DEFINED), local comm ID 0, nothing kept.
#[test]
fn a_req_for_another_transport_than_rc_is_refused_as_rdma_cm_does() {
    for tt in [
        cm::TransportType::Uc,
        cm::TransportType::Rd,
        cm::TransportType::Extended,
    ] {
        let mut t = T::new();
        let _l = t.ep.listen(SID, u64::MAX, 0).unwrap();
        let mut req = peer_req(PEER_ID, PEER_QPN);
        req.transport_type = tt;
        t.recv(TID, CmMessage::Req(req.clone()));
        assert!(t.events().is_empty(), "{tt:?} offered to the listener");
        let m = t.sent_one();
        assert_eq!(m.header.tid, TID);
        let CmMessage::Rej(r) = m.msg else {
            panic!("{m:?}")
        };
        assert_eq!(
            (
                r.reason,
                r.message_rejected,
                r.local_comm_id,
                r.remote_comm_id
            ),
            (RejReason::ConsumerDefined, MsgCode::Req, 0, PEER_ID),
            "{tt:?}"
        );
        assert_eq!(t.ep.cep_count(), 0, "{tt:?}: no endpoint kept for it");
        assert_eq!(t.ep.stats().transport_rejects, 1);
        // Nothing was kept: an RC REQ reusing the same comm ID and QPN is a new connection.
        req.transport_type = cm::TransportType::Rc;
        t.recv(TID, CmMessage::Req(req));
        assert!(matches!(
            t.events().as_slice(),
            [(_, CmEvent::ReqReceived { .. })]
        ));
    }
}

/// Linux's MAD layer answers a Get or Set that no agent takes (`generate_unmatched_resp`)
/// by echoing the whole MAD as GetResp with status 0x000C: ClassPortInfo of the CM class,
/// any attribute of another class; the CM agent takes only Sends. A CM-class Get or Set of
/// another attribute (a CM message) is dropped before (`validate_mad`): no answer.
#[test]
fn a_get_or_set_no_agent_takes_is_echoed_as_getresp_0x000c() {
    let mut t = T::new();
    let rtu = CmMad::send(0x42, CmMessage::Rtu(Rtu::default()))
        .emit()
        .unwrap();
    let mut cpi = CmMad::send(0x43, CmMessage::ClassPortInfo(ClassPortInfo::default()))
        .emit()
        .unwrap();
    cpi[24..40].copy_from_slice(&[0xA5; 16]); // a Set's data is echoed too
    let mut other_class = rtu;
    other_class[1] = 0x04; // performance management
    let mut cases = Vec::new();
    for (base, method) in [
        (cpi, mad::method::SET),
        (cpi, mad::method::GET),
        (other_class, mad::method::GET),
    ] {
        let mut m = base;
        m[3] = method;
        cases.push(m);
    }
    for m in &cases {
        t.ep.handle_datagram(t.now, ip(PEER), m);
        let x = t.ep.poll_transmit().expect("an answer");
        assert!(t.ep.poll_transmit().is_none());
        assert_eq!(x.dst, ip(PEER));
        let mut want = *m;
        want[3] = mad::method::GET_RESP;
        want[4..6].copy_from_slice(&[0x00, 0x0C]);
        assert_eq!(x.mad[..], want[..]);
    }
    assert_eq!(t.ep.stats().unsupported_get_set, cases.len() as u64);
    // Nothing else is answered: a GetResp, a Send of an unknown attribute, either subnet
    // management class (LID-routed, directed-route), another base version, a Get or Set of
    // a CM message or of an unknown CM attribute.
    let mut getresp = cases[0];
    getresp[3] = mad::method::GET_RESP;
    let mut unknown_send = rtu;
    unknown_send[16..18].copy_from_slice(&0x0099u16.to_be_bytes());
    let (mut smp_lid, mut smp_dr) = (cases[0], cases[0]);
    smp_lid[1] = 0x01;
    smp_dr[1] = 0x81;
    let mut v2 = cases[0];
    v2[0] = 2;
    let (mut get_rtu, mut set_unknown) = (rtu, unknown_send);
    get_rtu[3] = mad::method::GET;
    set_unknown[3] = mad::method::SET;
    let rx_before = t.ep.stats().rx_malformed;
    for m in [
        getresp,
        unknown_send,
        smp_lid,
        smp_dr,
        v2,
        get_rtu,
        set_unknown,
    ] {
        t.ep.handle_datagram(t.now, ip(PEER), &m);
        assert!(t.ep.poll_transmit().is_none(), "{:02x?}", &m[..4]);
    }
    assert!(t.events().is_empty(), "a Get of an RTU is not an RTU");
    assert!(t.ep.stats().rx_malformed > rx_before);
}

/// A flood of connections leaves the engine's tables at their peak size only while they are
/// used: once the connections are gone (timewait ended, or rejected with no timer at all)
/// the tables give their room back, down to what a table may keep whatever it holds (16 KiB
/// of room), however big the flood. Without it a daemon kept a flood's tables for
/// good.
#[test]
fn the_tables_give_back_a_floods_room() {
    const N: u32 = 20_000;
    const KEPT: usize = 128 << 10;
    // Active connections through disconnect and timewait, destroyed by the application.
    let mut t = T::new();
    let empty = t.ep.table_bytes();
    let mut conns = Vec::new();
    for i in 0..N {
        let (h, req, tid) = t.connect();
        let rep = Rep {
            local_comm_id: PEER_ID + i,
            local_qpn: PEER_QPN + i,
            ..peer_rep(req.local_comm_id)
        };
        t.recv(tid, CmMessage::Rep(rep));
        t.ep.establish(h).unwrap();
        t.sent();
        t.events();
        conns.push((h, req.local_comm_id, i));
    }
    let peak = t.ep.table_bytes();
    for (h, id, i) in conns {
        t.recv(0x77, dreq(PEER_ID + i, id, PEER_QPN + i));
        t.ep.disconnect(t.now, h, &[]).unwrap();
        t.ep.destroy(t.now, h).unwrap();
    }
    t.sent();
    t.events();
    assert_eq!(t.ep.cep_count(), N as usize, "all in timewait");
    t.advance(rcm_proto::ib::MAX_TIMEWAIT + Duration::from_secs(1));
    assert_eq!(t.ep.cep_count(), 0, "timewait ended");
    let after = t.ep.table_bytes();
    println!("disconnected: {after} bytes of room kept of a peak of {peak}");
    assert!(
        after <= KEPT && after * 8 < peak,
        "{after} bytes kept of a peak of {peak} (empty: {empty})"
    );

    // Passive requests rejected: no timer ever looks at the tables.
    let mut t = T::new();
    t.ep.listen(SID, u64::MAX, N as usize).unwrap();
    for i in 0..N {
        t.recv(
            TID + u64::from(i),
            CmMessage::Req(peer_req(PEER_ID + i, PEER_QPN + i)),
        );
    }
    let ceps: Vec<CepHandle> = t
        .events()
        .into_iter()
        .filter_map(|(_, e)| match e {
            CmEvent::ReqReceived { cep, .. } => Some(cep),
            _ => None,
        })
        .collect();
    assert_eq!(ceps.len(), N as usize);
    let peak = t.ep.table_bytes();
    for c in ceps {
        t.ep.reject(t.now, c, RejReason::ConsumerDefined, &[], &[])
            .unwrap();
        t.ep.destroy(t.now, c).unwrap();
    }
    t.sent();
    assert_eq!(t.ep.cep_count(), 0);
    let after = t.ep.table_bytes();
    println!("rejected: {after} bytes of room kept of a peak of {peak}");
    assert!(
        after <= KEPT && after * 8 < peak,
        "{after} bytes kept of a peak of {peak}"
    );
}
