//! The engine's REQ → REP → RTU → DREQ → DREP match what Linux 6.1 put on the wire
//! (`testdata/captures/roce/c1-veth2.pcap`, frames 1, 2, 3, 12, 13) byte for byte, once the
//! values each side picks for itself (comm IDs, and the TIDs built from them) are set aside.
//! QPNs, PSNs and GUIDs are given the capture's values so they compare too; the flow label
//! is rdma_cm's port hash, computed here as the kernel does.

#[path = "support/captures.rs"]
mod captures;
use rcm_proto::ib::{AcceptParams, CmEvent, ConnectParams, Endpoint, EndpointConfig, RetryPolicy};
use rcm_wire::cm::{CmMad, CmMessage};
use rcm_wire::cma::{self, CmaHdr};
use rcm_wire::tid;
use std::time::Instant;

/// Compares two MADs, naming the first differing byte.
fn same(what: &str, ours: &[u8; 256], theirs: &[u8; 256]) {
    if let Some(i) = (0..256).find(|&i| ours[i] != theirs[i]) {
        panic!(
            "{what}: byte {i} (MAD offset; data offset {}) differs: ours {:#04x}, Linux {:#04x}\nours:  {:02x?}\nlinux: {:02x?}",
            i as isize - 24,
            ours[i],
            theirs[i],
            CmMad::parse(ours).map(|m| m.msg),
            CmMad::parse(theirs).map(|m| m.msg)
        );
    }
}

/// Writes `id` over a comm-ID field at MAD data offset `at`.
fn put_id(m: &mut [u8; 256], at: usize, id: u32) {
    m[24 + at..24 + at + 4].copy_from_slice(&id.to_be_bytes());
}

fn put_tid(m: &mut [u8; 256], t: u64) {
    m[8..16].copy_from_slice(&t.to_be_bytes());
}

#[test]
fn handshake_and_teardown_bytes_match_linux() {
    let cap = captures::gsi_mads("c1-veth2.pcap");
    let (req_l, rep_l, rtu_l, dreq_l, drep_l) =
        (cap[0].1, cap[1].1, cap[2].1, cap[11].1, cap[12].1);
    let CmMessage::Req(lreq) = CmMad::parse(&req_l).unwrap().msg else {
        panic!()
    };
    let CmMessage::Rep(lrep) = CmMad::parse(&rep_l).unwrap().msg else {
        panic!()
    };
    let (a_ip, b_ip) = (cap[0].0, cap[1].0);
    let now = Instant::now();

    let mut a_cfg = EndpointConfig::new(a_ip, lreq.local_ca_guid, 11);
    a_cfg.agent_id = 4;
    a_cfg.retry = RetryPolicy::Classic;
    let mut b_cfg = EndpointConfig::new(b_ip, lrep.local_ca_guid, 12);
    b_cfg.agent_id = 6;
    let mut a = Endpoint::new(a_cfg);
    let mut b = Endpoint::new(b_cfg);

    // What ucmatose asked rdma_cm for, and what rdma_cm derived.
    let hdr = CmaHdr::parse(&lreq.private_data).unwrap();
    let mut p = ConnectParams::new(
        b_ip,
        cma::service_id(cma::PortSpace::Tcp, 7471),
        lreq.local_qpn,
    );
    p.starting_psn = Some(lreq.starting_psn);
    p.retry_count = 5;
    p.rnr_retry_count = 0;
    p.path.flow_label = (u32::from(hdr.src_port) * 31 + 7471) & 0xF_FFFF;
    p.private_data = hdr.with_user_data(&[0; 56], cma::limits::CONNECT).unwrap();

    let l = b.listen(p.service_id, u64::MAX, 0).unwrap();
    let ha = a.connect(now, &p).unwrap();
    let a_id = a.local_comm_id(ha).unwrap();
    let req = a.poll_transmit().unwrap();
    assert_eq!(req.dst, b_ip);
    let mut want = req_l;
    put_id(&mut want, 0, a_id);
    put_tid(&mut want, tid::linux_tid(4, a_id));
    same("REQ", &req.mad, &want);

    b.handle_datagram(now, a_ip, &req.mad);
    let Some((_, CmEvent::ReqReceived { cep: hb, .. })) = b.poll_event() else {
        panic!()
    };
    assert_ne!(hb, l);
    let b_id = b.local_comm_id(hb).unwrap();
    b.accept(
        now,
        hb,
        &AcceptParams {
            qpn: lrep.local_qpn,
            starting_psn: Some(lrep.starting_psn),
            responder_resources: 1,
            initiator_depth: 1,
            rnr_retry_count: 7,
            ..AcceptParams::default()
        },
    )
    .unwrap();
    let rep = b.poll_transmit().unwrap();
    let mut want = rep_l;
    put_id(&mut want, 0, b_id);
    put_id(&mut want, 4, a_id);
    put_tid(&mut want, tid::linux_tid(4, a_id));
    same("REP", &rep.mad, &want);

    a.handle_datagram(now, b_ip, &rep.mad);
    assert!(matches!(a.poll_event(), Some((_, CmEvent::RepReceived(_)))));
    a.establish(ha).unwrap();
    let rtu = a.poll_transmit().unwrap();
    let mut want = rtu_l;
    put_id(&mut want, 0, a_id);
    put_id(&mut want, 4, b_id);
    put_tid(&mut want, tid::linux_tid(4, a_id));
    same("RTU", &rtu.mad, &want);
    b.handle_datagram(now, a_ip, &rtu.mad);
    assert!(matches!(b.poll_event(), Some((_, CmEvent::Established))));

    // In the capture the passive side disconnects.
    b.disconnect(now, hb, &[]).unwrap();
    let dreq = b.poll_transmit().unwrap();
    let mut want = dreq_l;
    put_id(&mut want, 0, b_id);
    put_id(&mut want, 4, a_id);
    put_tid(&mut want, tid::linux_tid(6, b_id));
    same("DREQ", &dreq.mad, &want);

    a.handle_datagram(now, b_ip, &dreq.mad);
    while let Some((_, ev)) = a.poll_event() {
        if matches!(ev, CmEvent::DreqReceived { .. }) {
            break;
        }
    }
    a.disconnect(now, ha, &[]).unwrap();
    let drep = a.poll_transmit().unwrap();
    let mut want = drep_l;
    put_id(&mut want, 0, a_id);
    put_id(&mut want, 4, b_id);
    put_tid(&mut want, tid::linux_tid(6, b_id));
    same("DREP", &drep.mad, &want);
}
