//! One IB CM endpoint under test, with its clock: hand-built MADs in, the MADs it sends
//! and the events it emits out. A test file declares this module beside `timers` and adds
//! its own scripted states to `T` in an `impl T` block of its own.

#![allow(dead_code)] // each test file uses its own part

use rcm_proto::ib::{
    AcceptParams, CepHandle, CmEvent, ConnectParams, Endpoint, EndpointConfig, RetryPolicy,
};
use rcm_wire::cm::{self, CmMad, CmMessage, Dreq, Rep, Req, Rtu};
use rcm_wire::cma::{self, CmaHdr, PortSpace};
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// The endpoint's address.
pub const ME: &str = "198.18.0.1";
/// The peer's address, where `T::recv` takes MADs from.
pub const PEER: &str = "198.18.0.2";
/// The endpoint's CA GUID.
pub const MY_GUID: u64 = 0x0101_0101_0101_0101;

/// The peer's CA GUID.
pub const PEER_GUID: u64 = 0x0202_0202_0202_0202;
/// The service an rdma_cm listener on TCP port 7471 has.
pub const SID: u64 = cma::service_id(PortSpace::Tcp, 7471);
/// A transaction ID the peer's MADs carry.
pub const TID: u64 = 0x0000_0004_4433_2211;
/// The peer's comm ID.
pub const PEER_ID: u32 = 0x5151_5151;
/// The peer's QPN.
pub const PEER_QPN: u32 = 0x99;

pub fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// One endpoint under test, with a clock.
pub struct T {
    pub ep: Endpoint,
    pub now: Instant,
}

impl T {
    /// An endpoint on `ME` with Linux's classic retries.
    pub fn new() -> Self {
        Self::with(|_| {})
    }

    /// [`T::new`] with its configuration changed by `f` first.
    pub fn with(f: impl FnOnce(&mut EndpointConfig)) -> Self {
        let mut cfg = EndpointConfig::new(ip(ME), MY_GUID, 7);
        cfg.retry = RetryPolicy::Classic;
        f(&mut cfg);
        T {
            ep: Endpoint::new(cfg),
            now: Instant::now(),
        }
    }

    pub fn recv_from(&mut self, from: &str, tid: u64, msg: CmMessage) {
        let mad = CmMad::send(tid, msg).emit().unwrap();
        self.ep.handle_datagram(self.now, ip(from), &mad);
    }

    pub fn recv(&mut self, tid: u64, msg: CmMessage) {
        self.recv_from(PEER, tid, msg);
    }

    /// Everything sent since the last call.
    pub fn sent(&mut self) -> Vec<CmMad> {
        std::iter::from_fn(|| self.ep.poll_transmit())
            .map(|t| CmMad::parse(&t.mad).unwrap())
            .collect()
    }

    /// The names of what was sent since the last call.
    pub fn names(&mut self) -> Vec<&'static str> {
        self.sent().iter().map(|m| m.msg.name()).collect()
    }

    pub fn sent_one(&mut self) -> CmMad {
        let v = self.sent();
        assert_eq!(
            v.len(),
            1,
            "expected one MAD, got {:?}",
            v.iter().map(|m| m.msg.name()).collect::<Vec<_>>()
        );
        v.into_iter().next().unwrap()
    }

    pub fn nothing_sent(&mut self) {
        let n = self.names();
        assert!(n.is_empty(), "unexpected {n:?}");
    }

    pub fn events(&mut self) -> Vec<(CepHandle, CmEvent)> {
        std::iter::from_fn(|| self.ep.poll_event()).collect()
    }

    pub fn advance(&mut self, d: Duration) {
        crate::timers::advance(&mut self.ep, &mut self.now, d);
    }
}

/// A REQ from the peer (comm ID `id`, QPN `qpn`) for `SID`, as rdma_cm builds it.
pub fn peer_req(id: u32, qpn: u32) -> Req {
    Req {
        local_comm_id: id,
        service_id: SID,
        local_ca_guid: PEER_GUID,
        local_qpn: qpn,
        remote_cm_response_timeout: 20,
        local_cm_response_timeout: 20,
        max_cm_retries: 15,
        pkey: 0xFFFF,
        primary_path: cm::ReqPath {
            local_ack_timeout: 19,
            hop_limit: 64,
            ..cm::ReqPath::default()
        },
        private_data: CmaHdr {
            src_port: 1234,
            src: ip(PEER),
            dst: ip(ME),
        }
        .with_user_data(b"hi", 56)
        .unwrap(),
        ..Req::default()
    }
}

impl T {
    // --- scripted states (Linux rdma_cm peers) ---

    pub fn connect(&mut self) -> (CepHandle, Req, u64) {
        self.connect_with(|_| {})
    }

    /// `connect` with its parameters changed by `f` first.
    pub fn connect_with(&mut self, f: impl FnOnce(&mut ConnectParams)) -> (CepHandle, Req, u64) {
        let mut p = ConnectParams::new(ip(PEER), SID, 0x11);
        p.private_data = b"hello".to_vec();
        f(&mut p);
        let h = self.ep.connect(self.now, &p).unwrap();
        let m = self.sent_one();
        let CmMessage::Req(r) = m.msg else {
            panic!("{m:?}")
        };
        (h, r, m.header.tid)
    }

    /// Active side in RepRcvd; returns (handle, our comm id, tid).
    pub fn rep_rcvd(&mut self) -> (CepHandle, u32, u64) {
        let (h, req, tid) = self.connect();
        self.recv(tid, CmMessage::Rep(peer_rep(req.local_comm_id)));
        let ev = self.events();
        assert!(
            matches!(ev.as_slice(), [(eh, CmEvent::RepReceived(_))] if *eh == h),
            "{ev:?}"
        );
        (h, req.local_comm_id, tid)
    }

    /// Active side Established.
    pub fn established_active(&mut self) -> (CepHandle, u32) {
        let (h, id, _) = self.rep_rcvd();
        self.ep.establish(h).unwrap();
        let m = self.sent_one();
        assert!(matches!(m.msg, CmMessage::Rtu(_)));
        assert_eq!(self.events(), vec![(h, CmEvent::Established)]);
        (h, id)
    }

    /// Passive side: a listener and a REQ received; returns (listener, child, our id).
    pub fn req_rcvd(&mut self) -> (CepHandle, CepHandle, u32) {
        self.req_rcvd_with(peer_req(PEER_ID, PEER_QPN))
    }

    /// [`T::req_rcvd`] with the peer's REQ `req`.
    pub fn req_rcvd_with(&mut self, req: Req) -> (CepHandle, CepHandle, u32) {
        let l = self.ep.listen(SID, u64::MAX, 0).unwrap();
        self.recv(TID, CmMessage::Req(req));
        let ev = self.events();
        let [(
            lh,
            CmEvent::ReqReceived {
                listener,
                cep,
                info,
            },
        )] = ev.as_slice()
        else {
            panic!("{ev:?}")
        };
        assert_eq!((*lh, *listener), (l, l));
        assert_eq!(info.remote_qpn, PEER_QPN);
        let id = self.ep.local_comm_id(*cep).unwrap();
        (l, *cep, id)
    }

    pub fn rep_sent(&mut self) -> (CepHandle, CepHandle, u32) {
        self.rep_sent_with(peer_req(PEER_ID, PEER_QPN))
    }

    pub fn rep_sent_with(&mut self, req: Req) -> (CepHandle, CepHandle, u32) {
        let (l, c, id) = self.req_rcvd_with(req);
        self.ep
            .accept(
                self.now,
                c,
                &AcceptParams {
                    qpn: 0x22,
                    ..AcceptParams::default()
                },
            )
            .unwrap();
        let m = self.sent_one();
        assert!(matches!(m.msg, CmMessage::Rep(_)));
        assert_eq!(m.header.tid, TID, "REP echoes the REQ's TID");
        (l, c, id)
    }

    /// The peer's DREQ (TID 0x77, naming our QPN `qpn`) for the established `h` with
    /// local comm ID `id`, and our disconnect answering it: `h` is in timewait. What was
    /// sent (the DREP).
    pub fn peer_disconnects(&mut self, h: CepHandle, id: u32, qpn: u32) -> Vec<CmMad> {
        self.recv(0x77, dreq(PEER_ID, id, qpn));
        self.events();
        self.ep.disconnect(self.now, h, &[]).unwrap();
        self.sent()
    }

    pub fn established_passive(&mut self) -> (CepHandle, u32) {
        self.established_passive_with(peer_req(PEER_ID, PEER_QPN))
    }

    pub fn established_passive_with(&mut self, req: Req) -> (CepHandle, u32) {
        let (_, c, id) = self.rep_sent_with(req);
        self.recv(
            TID,
            CmMessage::Rtu(Rtu {
                local_comm_id: PEER_ID,
                remote_comm_id: id,
                ..Rtu::default()
            }),
        );
        assert_eq!(self.events(), vec![(c, CmEvent::Established)]);
        (c, id)
    }
}

/// The peer's REP to our REQ (comm ID `our_id`).
pub fn peer_rep(our_id: u32) -> Rep {
    Rep {
        local_comm_id: PEER_ID,
        remote_comm_id: our_id,
        local_qpn: PEER_QPN,
        starting_psn: 0x123456,
        local_ca_guid: PEER_GUID,
        private_data: b"accepted".to_vec(),
        ..Rep::default()
    }
}

/// A DREQ from comm ID `from` to `to`, naming QPN `qpn`.
pub fn dreq(from: u32, to: u32, qpn: u32) -> CmMessage {
    CmMessage::Dreq(Dreq {
        local_comm_id: from,
        remote_comm_id: to,
        remote_qpn: qpn,
        ..Dreq::default()
    })
}
