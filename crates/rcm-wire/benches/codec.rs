//! Encode/decode micro-benchmarks: the CM hot path is one REQ parsed and one built per
//! connection, each expected well under a microsecond.

#![allow(missing_docs)] // criterion_group! generates an undocumented pub fn.

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use rcm_wire::cm::{CmMad, CmMessage, Req, ReqPath, TransportType};
use rcm_wire::cma::{self, CmaHdr, PortSpace};
use rcm_wire::roce::{self, GsiDatagram, IpForIcrc};
use rcm_wire::Gid;
use std::net::Ipv4Addr;

fn sample_req() -> CmMad {
    let (src, dst) = (Ipv4Addr::LOCALHOST, Ipv4Addr::new(127, 0, 0, 2));
    let hdr = CmaHdr {
        src_port: 40000,
        src: src.into(),
        dst: dst.into(),
    };
    CmMad::send(
        0x0000_0001_4433_2211,
        CmMessage::Req(Req {
            local_comm_id: 0x1122_3344,
            service_id: cma::service_id(PortSpace::Tcp, 7471),
            local_ca_guid: 0x0002_C903_00A1_B2C3,
            local_qpn: 0x123,
            responder_resources: 4,
            initiator_depth: 3,
            remote_cm_response_timeout: 20,
            transport_type: TransportType::Rc,
            starting_psn: 0xABCDEF,
            local_cm_response_timeout: 20,
            retry_count: 7,
            pkey: 0xFFFF,
            path_mtu: 3,
            rnr_retry_count: 6,
            max_cm_retries: 15,
            primary_path: ReqPath {
                local_lid: 0xFFFF,
                remote_lid: 0xFFFF,
                local_gid: Gid::from_ip(src.into()),
                remote_gid: Gid::from_ip(dst.into()),
                hop_limit: 64,
                local_ack_timeout: 18,
                ..ReqPath::default()
            },
            private_data: hdr.with_user_data(b"bench", cma::limits::CONNECT).unwrap(),
            ..Req::default()
        }),
    )
}

fn bench(c: &mut Criterion) {
    let req = sample_req();
    let ip = IpForIcrc::v4(Ipv4Addr::LOCALHOST, Ipv4Addr::new(127, 0, 0, 2));
    let mad = req.emit().unwrap();
    let datagram = roce::emit_gsi(&ip, roce::RXE_GSI_UDP_SPORT, 0, &mad);

    c.bench_function("req_build_mad", |b| {
        b.iter(|| black_box(&req).emit().unwrap());
    });
    c.bench_function("req_build_datagram_with_icrc", |b| {
        b.iter(|| {
            let mad = black_box(&req).emit().unwrap();
            roce::emit_gsi(&ip, roce::RXE_GSI_UDP_SPORT, 0, &mad)
        });
    });
    c.bench_function("req_parse_mad", |b| {
        b.iter(|| CmMad::parse(black_box(&mad)).unwrap());
    });
    c.bench_function("req_parse_datagram", |b| {
        b.iter(|| {
            let g = GsiDatagram::parse(black_box(&datagram)).unwrap();
            CmMad::parse(g.mad).unwrap()
        });
    });
    let udp: Vec<u8> = [&[0xd8, 0x72, 0x12, 0xb7, 0x01, 0x20, 0, 0][..], &datagram].concat();
    c.bench_function("icrc_verify_gsi", |b| {
        b.iter(|| roce::icrc(&ip, black_box(&udp[..udp.len() - 4])));
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
