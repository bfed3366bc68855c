//! SIDR (SIDR_REQ / SIDR_REP) against Linux's `cm.c` (with `cma.c` and `ucma.c` where they
//! decide what reaches the wire) and the Linux 6.1 captures in `testdata/captures/roce/`
//! (`b-sidr.pcap`: a kernel SIDR_REQ retried to a silent peer; `c1-veth2.pcap` frames 14/15:
//! a kernel SIDR_REQ and the kernel's SIDR_REP): the bytes, the retries, and what each side
//! does with a request it cannot serve.

#[path = "support/captures.rs"]
mod captures;
#[path = "support/harness.rs"]
mod harness;
#[path = "support/timers.rs"]
mod timers;
use harness::{ip, PEER, T};
use rcm_proto::ib::{
    CmEvent, Endpoint, EndpointConfig, RetryPolicy, SidrParams, SidrReplyParams, State, TimedOut,
};
use rcm_wire::cm::{CmMad, CmMessage, SidrRep, SidrReq, SidrStatus};
use rcm_wire::cma::{self, PortSpace};
use rcm_wire::tid;
use std::time::{Duration, Instant};

const SVC: u64 = cma::service_id(PortSpace::Udp, 7174);

fn sidr_req(request_id: u32) -> SidrReq {
    SidrReq {
        request_id,
        pkey: 0xFFFF,
        service_id: SVC,
        ..SidrReq::default()
    }
}

fn names(v: &[CmMad]) -> Vec<&'static str> {
    v.iter().map(|m| m.msg.name()).collect()
}

fn first_diff(ours: &[u8; 256], theirs: &[u8; 256]) -> Option<usize> {
    (0..256).find(|&i| ours[i] != theirs[i])
}

/// Linux: rdma_cm's listener backlog lives in ucma (`ucma_connect_event_handler`: no backlog
/// left → -ENOMEM). `cma_ib_req_handler` returns that error, `cm_sidr_req_handler` then calls
/// `cm_destroy_id(id, err)`, and for an id in SIDR_REQ_RCVD that sends SIDR_REP status 2
/// (IB_SIDR_REJECT) whatever `err` is: the -ENOMEM "do not reject, let the peer retry" case
/// exists only for REQ_RCVD. So a SIDR_REQ past a full backlog is answered at once with
/// REJECT (rdma_cm reports UNREACHABLE, status 2, on the asking side); dropped, as the engine
/// did before, the asking side retried 15 × 4 s before it timed out.
#[test]
fn a_sidr_req_past_a_full_backlog_is_answered_rejected() {
    let mut t = T::new();
    let l = t.ep.listen(SVC, u64::MAX, 1).unwrap();
    t.recv(0x11, CmMessage::SidrReq(sidr_req(0xA1)));
    assert!(t.sent().is_empty());
    // The first request holds the only backlog place (its event not yet taken).
    t.recv(0x22, CmMessage::SidrReq(sidr_req(0xB2)));
    let sent = t.sent();
    let rep = sent.iter().find_map(|m| match &m.msg {
        CmMessage::SidrRep(r) => Some((m.header.tid, r.clone())),
        _ => None,
    });
    let Some((tid, rep)) = rep else {
        panic!(
            "a SIDR_REQ past a full backlog gets SIDR_REP(REJECT), as from Linux; sent {:?}",
            names(&sent),
        );
    };
    assert_eq!(
        (
            tid,
            rep.request_id,
            rep.status,
            rep.service_id,
            rep.qpn,
            rep.qkey
        ),
        (0x22, 0xB2, SidrStatus::Rejected, SVC, 0, 0)
    );
    assert_eq!(t.ep.stats().sidr_backlog_rejects, 1);
    // Only the first request reached the listener.
    let ev = t.events();
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert_eq!(ev[0].0, l);
}

/// The SIDR_REQ of `sidr_request` is Linux's byte for byte (`cm_format_sidr_req`: request ID
/// = local comm ID, P_Key 0xFFFF, service ID, private data; TID from `cm_form_tid`), once the
/// comm ID and the TID built from it are set aside. Checked against both captures.
#[test]
fn sidr_req_bytes_match_the_captures() {
    for (file, frame, agent) in [("b-sidr.pcap", 0, 2), ("c1-veth2.pcap", 13, 4)] {
        let cap = captures::gsi_mads(file);
        let (src, linux) = cap[frame];
        let CmMessage::SidrReq(lreq) = CmMad::parse(&linux).unwrap().msg else {
            panic!("{file} frame {}", frame + 1)
        };
        let mut cfg = EndpointConfig::new(src, 1, 3);
        cfg.agent_id = agent;
        cfg.retry = RetryPolicy::Classic;
        let mut ep = Endpoint::new(cfg);
        let h = ep
            .sidr_request(
                Instant::now(),
                &SidrParams {
                    dst: ip(PEER),
                    service_id: lreq.service_id,
                    private_data: lreq.private_data.clone(),
                    timeout: 20,
                    max_retries: 15,
                },
            )
            .unwrap();
        let id = ep.local_comm_id(h).unwrap();
        let ours = ep.poll_transmit().unwrap().mad;
        let mut want = linux;
        want[24..28].copy_from_slice(&id.to_be_bytes());
        want[8..16].copy_from_slice(&tid::linux_tid(agent, id).to_be_bytes());
        assert_eq!(first_diff(&ours, &want), None, "{file}");
    }
}

/// The kernel's SIDR_REP (c1-veth2 frame 15) to the kernel's SIDR_REQ (frame 14) is what the
/// engine sends for the same request answered with the same QPN and Q_Key: every byte, TID
/// (the SIDR_REQ's), request ID echoed, service ID copied, status 0, vendor ID 0.
#[test]
fn sidr_rep_bytes_match_the_capture() {
    let cap = captures::gsi_mads("c1-veth2.pcap");
    let (a_ip, req_l) = cap[13];
    let (b_ip, rep_l) = cap[14];
    let CmMessage::SidrRep(lrep) = CmMad::parse(&rep_l).unwrap().msg else {
        panic!()
    };
    let mut ep = Endpoint::new(EndpointConfig::new(b_ip, 2, 5));
    let now = Instant::now();
    ep.listen(SVC, u64::MAX, 0).unwrap();
    ep.handle_datagram(now, a_ip, &req_l);
    let Some((
        _,
        CmEvent::SidrReqReceived {
            cep, private_data, ..
        },
    )) = ep.poll_event()
    else {
        panic!()
    };
    assert_eq!(
        private_data.len(),
        216,
        "the whole area, as cm_format_sidr_req_event"
    );
    ep.sidr_reply(
        cep,
        &SidrReplyParams {
            status: SidrStatus::Success,
            qpn: lrep.qpn,
            qkey: lrep.qkey,
            private_data: Vec::new(),
        },
    )
    .unwrap();
    let t = ep.poll_transmit().unwrap();
    assert_eq!(t.dst, a_ip);
    assert_eq!(first_diff(&t.mad, &rep_l), None);
    assert_eq!(ep.state(cep), Some(State::Idle));
}

/// `cma_resolve_ib_udp` asks for 1 << (20 − 8) ms and 15 retries; the MAD layer resends the
/// same MAD (same TID, b-sidr.pcap) at that fixed interval (the capture: 4.17 s, 4.36 s, the
/// REQ's 2 × packet life time is not added for SIDR), then `cm_process_send_error` moves
/// SIDR_REQ_SENT to IDLE with IB_CM_SIDR_REQ_ERROR.
#[test]
fn sidr_req_retries_and_timeout_match_linux() {
    let mut t = T::new();
    let h =
        t.ep.sidr_request(
            t.now,
            &SidrParams {
                dst: ip(PEER),
                service_id: SVC,
                private_data: vec![],
                timeout: 20,
                max_retries: 15,
            },
        )
        .unwrap();
    let first = t.ep.poll_transmit().unwrap().mad;
    let mut n = 1;
    for _ in 0..15 {
        t.advance(Duration::from_millis(4095));
        assert!(t.ep.poll_transmit().is_none());
        t.advance(Duration::from_millis(1));
        assert_eq!(t.ep.poll_transmit().unwrap().mad, first);
        n += 1;
    }
    assert_eq!(n, 16);
    assert!(t.events().is_empty());
    t.advance(Duration::from_millis(4096));
    assert_eq!(t.events(), vec![(h, CmEvent::TimedOut(TimedOut::SidrReq))]);
    assert_eq!(t.ep.state(h), Some(State::Idle));
    assert!(t.sent().is_empty());
}

/// `cm_sidr_req_handler`: no listener → SIDR_REP(UNSUPPORTED) with the request's TID, request
/// ID and service ID, no id kept; a repeat while the id is in SIDR_REQ_RCVD is dropped
/// (`cm_insert_remote_sidr`); once answered (`cm_send_sidr_rep_locked` erases the entry) a
/// repeat is a new request; a destroyed id in SIDR_REQ_RCVD answers REJECT (`cm_destroy_id`).
#[test]
fn passive_sidr_paths_match_linux() {
    let mut t = T::new();
    t.recv(0x51, CmMessage::SidrReq(sidr_req(7)));
    let s = t.sent();
    let CmMessage::SidrRep(r) = &s[0].msg else {
        panic!("{:?}", names(&s))
    };
    assert_eq!(
        (
            s.len(),
            s[0].header.tid,
            r.request_id,
            r.status,
            r.service_id
        ),
        (1, 0x51, 7, SidrStatus::UnsupportedServiceId, SVC)
    );
    assert_eq!(t.ep.table_sizes().3, 0);

    let l = t.ep.listen(SVC, u64::MAX, 0).unwrap();
    t.recv(0x52, CmMessage::SidrReq(sidr_req(8)));
    let ev = t.events();
    let [(lh, CmEvent::SidrReqReceived { cep, .. })] = ev.as_slice() else {
        panic!("{ev:?}")
    };
    assert_eq!(*lh, l);
    t.recv(0x52, CmMessage::SidrReq(sidr_req(8)));
    assert!(t.sent().is_empty() && t.events().is_empty());
    t.ep.sidr_reply(
        *cep,
        &SidrReplyParams {
            status: SidrStatus::Success,
            qpn: 0x0100_0012,
            qkey: cma::RDMA_UDP_QKEY,
            private_data: vec![],
        },
    )
    .unwrap();
    let s = t.sent();
    let CmMessage::SidrRep(r) = &s[0].msg else {
        panic!()
    };
    assert_eq!(
        (r.qpn, r.qkey),
        (0x12, cma::RDMA_UDP_QKEY),
        "QPN is 24 bits"
    );
    // The answer lost, the peer retries: a new request.
    t.recv(0x52, CmMessage::SidrReq(sidr_req(8)));
    let ev = t.events();
    let [(_, CmEvent::SidrReqReceived { cep: again, .. })] = ev.as_slice() else {
        panic!("{ev:?}")
    };
    assert_ne!(again, cep);
    t.ep.destroy(t.now, *again).unwrap();
    let s = t.sent();
    let CmMessage::SidrRep(r) = &s[0].msg else {
        panic!()
    };
    assert_eq!(
        (s[0].header.tid, r.request_id, r.status, r.qpn, r.qkey),
        (0x52, 8, SidrStatus::Rejected, 0, 0)
    );

    // Listener destroyed with a request it never saw: REJECT, as ucma destroying the
    // unreported CONNECT_REQUEST's id.
    t.recv(0x53, CmMessage::SidrReq(sidr_req(9)));
    t.ep.destroy(t.now, l).unwrap();
    let s = t.sent();
    assert!(
        matches!(&s[..], [m] if matches!(&m.msg, CmMessage::SidrRep(r) if r.status == SidrStatus::Rejected && r.request_id == 9))
    );
    assert!(t.events().is_empty());
    // And the next one finds no listener.
    t.recv(0x54, CmMessage::SidrReq(sidr_req(10)));
    assert!(
        matches!(&t.sent()[..], [m] if matches!(&m.msg, CmMessage::SidrRep(r) if r.status == SidrStatus::UnsupportedServiceId))
    );
}

/// `cm_destroy_id` in SIDR_REQ_SENT: cancel the MAD, nothing on the wire, no event; a late
/// SIDR_REP finds nothing. A SIDR_REP with a status other than success is still
/// IB_CM_SIDR_REP_RECEIVED with that status, QPN and Q_Key as sent.
#[test]
fn active_destroy_and_status_match_linux() {
    let mut t = T::new();
    let p = SidrParams {
        dst: ip(PEER),
        service_id: SVC,
        private_data: vec![],
        timeout: 20,
        max_retries: 15,
    };
    let h = t.ep.sidr_request(t.now, &p).unwrap();
    let id = t.ep.local_comm_id(h).unwrap();
    t.sent();
    t.ep.destroy(t.now, h).unwrap();
    assert!(t.sent().is_empty());
    t.advance(Duration::from_secs(120));
    assert!(t.sent().is_empty() && t.events().is_empty());
    t.recv(
        1,
        CmMessage::SidrRep(SidrRep {
            request_id: id,
            ..SidrRep::default()
        }),
    );
    assert!(t.events().is_empty());
    assert_eq!(t.ep.table_sizes(), (0, 0, 0, 0, 0));

    let h = t.ep.sidr_request(t.now, &p).unwrap();
    let id = t.ep.local_comm_id(h).unwrap();
    t.sent();
    t.recv(
        1,
        CmMessage::SidrRep(SidrRep {
            request_id: id,
            status: SidrStatus::Unknown(9),
            qpn: 0x34,
            qkey: 5,
            ..SidrRep::default()
        }),
    );
    let ev = t.events();
    assert!(
        matches!(ev.as_slice(), [(eh, CmEvent::SidrRepReceived { status: SidrStatus::Unknown(9), qpn: 0x34, qkey: 5, private_data })] if *eh == h && private_data.len() == 136),
        "{ev:?}"
    );
    t.advance(Duration::from_secs(120));
    assert!(t.sent().is_empty(), "the SIDR_REQ is no longer retried");
}
