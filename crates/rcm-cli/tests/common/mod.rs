//! Helpers shared by the test files that run the `rcm` binary.
#![allow(dead_code)] // each test file uses its own subset

use rcm::PortSpace;
use rcm_wire::cm::{CmMad, CmMessage, Dreq, Req, ReqPath, TransportType};
use rcm_wire::cma::{self, CmaHdr};
use rcm_wire::Gid;
use std::net::Ipv4Addr;
use std::process::Command;

/// Runs `rcm` with `args`; returns (exit code, stdout, stderr).
pub fn rcm(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_rcm"))
        .args(args)
        .output()
        .expect("run rcm");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A REQ as rdma_cm sends it (TCP port space, cma_hdr for `src` → `dst`).
pub fn req_mad(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    port: u16,
    comm_id: u32,
    guid: u64,
    qpn: u32,
) -> [u8; 256] {
    let pd = CmaHdr {
        src_port: 40000,
        src: src.into(),
        dst: dst.into(),
    }
    .with_user_data(b"rcmf forged", cma::limits::CONNECT)
    .expect("cma_hdr");
    let req = Req {
        local_comm_id: comm_id,
        service_id: cma::service_id(PortSpace::Tcp, port),
        local_ca_guid: guid,
        local_qpn: qpn & 0xFF_FFFF,
        responder_resources: 1,
        initiator_depth: 1,
        remote_cm_response_timeout: 20,
        transport_type: TransportType::Rc,
        starting_psn: qpn & 0xFF_FFFF,
        local_cm_response_timeout: 20,
        retry_count: 7,
        pkey: 0xFFFF,
        path_mtu: 3,
        rnr_retry_count: 7,
        max_cm_retries: 15,
        primary_path: ReqPath {
            local_lid: 0xFFFF,
            remote_lid: 0xFFFF,
            local_gid: Gid::from_ip(src.into()),
            remote_gid: Gid::from_ip(dst.into()),
            hop_limit: 64,
            local_ack_timeout: 19,
            ..ReqPath::default()
        },
        private_data: pd,
        ..Req::default()
    };
    CmMad::send(u64::from(comm_id), CmMessage::Req(req))
        .emit()
        .expect("REQ encodes")
}

/// A DREQ for the connection `local` ↔ `remote` whose peer QP is `remote_qpn`.
pub fn dreq_mad(local: u32, remote: u32, remote_qpn: u32) -> [u8; 256] {
    let dreq = Dreq {
        local_comm_id: local,
        remote_comm_id: remote,
        remote_qpn: remote_qpn & 0xFF_FFFF,
        ..Dreq::default()
    };
    CmMad::send(u64::from(local), CmMessage::Dreq(dreq))
        .emit()
        .expect("DREQ encodes")
}
