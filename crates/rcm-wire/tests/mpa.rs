//! MPA, FPDU, DDP/RDMAP and Terminate: the reference vectors (wire-formats.md §7.4), real siw
//! captures, error cases, and property tests.

use std::collections::HashMap;
use std::path::PathBuf;

use proptest::prelude::*;
use rcm_wire::mpa::{
    crc_negotiated, emit_fpdu, fpdu_len, fpdu_pad, llp_ecode, mpa_crc, parse_fpdu, send_ulpdu,
    term_etype, term_layer, terminate_ulpdu, DdpBuffer, DdpRdmapHeader, Enhanced, Fpdu, FrameKind,
    MpaFlags, MpaFrame, RdmapOpcode, ReadRequest, Terminate, ENHANCED_USER_MAX, MAX_PRIVATE_DATA,
    MPA_FRAME_HEADER_LEN, QN_SEND, QN_TERMINATE, REP_KEY, REQ_KEY, RFC_MAX_PRIVATE_DATA,
    TAGGED_HEADER_LEN, UNTAGGED_HEADER_LEN,
};
use rcm_wire::WireError;

fn hex(s: &str) -> Vec<u8> {
    s.split_whitespace()
        .map(|b| u8::from_str_radix(b, 16).expect("test vector hex"))
        .collect()
}

/// §7.4: siw-style MPA v2 Request, Enhanced flag, no CRC, IRD 16, ORD 16, user PD "ulp".
const V2_REQUEST: &str =
    "4d 50 41 20 49 44 20 52 65 71 20 46 72 61 6d 65 10 02 00 07 00 10 00 10 75 6c 70";
/// §7.4: untagged Send (QN 0, MSN 1, MO 0, "PING-DATA-123"), CRC on.
const SEND_FPDU: &str =
    "00 1f 41 43 00 00 00 00 00 00 00 00 00 00 00 01 00 00 00 00 50 49 4e 47 2d 44 41 54 \
                         41 2d 31 32 33 00 00 00 b8 2d 3b 90";
/// §7.4: Terminate (LLP, MPA, CRC error, QN 2, MSN 1), no copied headers.
const TERM_FPDU: &str =
    "00 16 41 47 00 00 00 00 00 00 00 02 00 00 00 01 00 00 00 00 20 02 00 00 7f e4 25 85";

fn is_truncated<T: std::fmt::Debug>(r: &Result<T, WireError>) -> bool {
    matches!(r, Err(WireError::Truncated { .. }))
}

// ---------------------------------------------------------------------------------------------
// §7.4 vectors
// ---------------------------------------------------------------------------------------------

#[test]
fn v2_request_vector_encodes_and_parses() {
    let bytes = hex(V2_REQUEST);
    let built = MpaFrame::request_v2(16, 16, b"ulp".to_vec());
    assert_eq!(built.to_vec().unwrap(), bytes);
    assert_eq!(built.buffer_len(), bytes.len());
    assert_eq!(built.pd_length(), 7);

    let (frame, used) = MpaFrame::parse(&bytes).unwrap();
    assert_eq!(used, bytes.len());
    assert_eq!(frame, built);
    assert_eq!(frame.kind, FrameKind::Request);
    assert_eq!(frame.revision, 2);
    assert!(
        frame.flags.enhanced && !frame.flags.crc && !frame.flags.markers && !frame.flags.reject
    );
    let e = frame.enhanced.unwrap();
    assert_eq!((e.ird, e.ord), (16, 16));
    assert!(
        !e.peer_to_peer && !e.zero_len_send_rtr && !e.zero_len_write_rtr && !e.zero_len_read_rtr
    );
    assert_eq!(frame.private_data, b"ulp");
    frame.check_linux_limits().unwrap();
}

#[test]
fn send_fpdu_vector_with_crc() {
    let bytes = hex(SEND_FPDU);
    let ulpdu = send_ulpdu(QN_SEND, 1, 0, b"PING-DATA-123");
    assert_eq!(ulpdu.len(), 31);
    let mut out = Vec::new();
    emit_fpdu(&ulpdu, true, &mut out).unwrap();
    assert_eq!(out, bytes);
    assert_eq!(fpdu_len(31), 40);
    assert_eq!(fpdu_pad(31), 3);

    // The CRC is CRC-32C over length + ULPDU + pad, least-significant byte first.
    assert_eq!(mpa_crc(&bytes[..36]), 0x903B_2DB8);
    assert_eq!(&bytes[36..], &[0xb8, 0x2d, 0x3b, 0x90]);

    let (got, used) = parse_fpdu(&bytes, true).unwrap();
    assert_eq!(used, 40);
    assert_eq!(got, &ulpdu[..]);
    let (fpdu, _) = Fpdu::parse(&bytes).unwrap();
    assert_eq!(fpdu.crc, 0x903B_2DB8);
    assert_eq!(fpdu.pad, &[0, 0, 0]);

    let (hdr, hlen) = DdpRdmapHeader::parse(got).unwrap();
    assert_eq!(hlen, UNTAGGED_HEADER_LEN);
    assert_eq!(hdr, DdpRdmapHeader::untagged(RdmapOpcode::Send, 0, 1, 0));
    assert!(hdr.last && !hdr.is_tagged());
    assert_eq!(&got[hlen..], b"PING-DATA-123");
}

#[test]
fn terminate_fpdu_vector_carries_a_good_crc() {
    let bytes = hex(TERM_FPDU);
    // The vector's CRC slot is not zero, and it is exactly the LSB-first CRC-32C of the rest:
    // the vector was made with CRC on.
    let crc = mpa_crc(&bytes[..24]);
    assert_eq!(crc, 0x8525_E47F);
    assert_eq!(&bytes[24..], &crc.to_le_bytes());

    let term = Terminate::llp(llp_ecode::CRC_ERROR);
    let ulpdu = terminate_ulpdu(QN_TERMINATE, 1, &term).unwrap();
    assert_eq!(ulpdu.len(), 22, "a minimal Terminate has ULPDU_Length 22");
    let mut out = Vec::new();
    emit_fpdu(&ulpdu, true, &mut out).unwrap();
    assert_eq!(out, bytes);
    let mut off = Vec::new();
    emit_fpdu(&ulpdu, false, &mut off).unwrap();
    assert_eq!(&off[..24], &bytes[..24]);
    assert_eq!(&off[24..], &[0, 0, 0, 0]);

    let (got, used) = parse_fpdu(&bytes, true).unwrap();
    assert_eq!(used, 28);
    let (hdr, hlen) = DdpRdmapHeader::parse(got).unwrap();
    assert_eq!(
        hdr,
        DdpRdmapHeader::untagged(RdmapOpcode::Terminate, QN_TERMINATE, 1, 0)
    );
    let parsed = Terminate::parse(&got[hlen..]).unwrap();
    assert_eq!(parsed, term);
    assert_eq!(parsed.layer, term_layer::LLP);
    assert_eq!(parsed.error_type, term_etype::LLP_MPA);
    assert_eq!(parsed.error_code, 2);
    assert_eq!(parsed.ddp_segment_length, None);
}

// ---------------------------------------------------------------------------------------------
// CRC-32C
// ---------------------------------------------------------------------------------------------

#[test]
fn crc32c_check_value() {
    assert_eq!(mpa_crc(b"123456789"), 0xE306_9283);
    assert_eq!(mpa_crc(b""), 0);
}

#[test]
fn crc32c_matches_the_crc_crate_on_random_inputs() {
    use rand::{Rng, SeedableRng};
    let iscsi = crc::Crc::<u32>::new(&crc::CRC_32_ISCSI);
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x4D50_4100);
    for _ in 0..2000 {
        let len = rng.gen_range(0..3000);
        let data: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
        assert_eq!(mpa_crc(&data), iscsi.checksum(&data), "len {len}");
    }
}

// ---------------------------------------------------------------------------------------------
// Real siw traffic
// ---------------------------------------------------------------------------------------------

fn capture_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/captures/iwarp")
        .join(name)
}

fn read_capture(name: &str) -> Vec<u8> {
    let path = capture_path(name);
    std::fs::read(&path)
        .unwrap_or_else(|e| panic!("golden capture {} is missing: {e}", path.display()))
}

#[test]
fn real_siw_request_round_trips() {
    let bytes = read_capture("e2-mpa-request.bin");
    assert_eq!(bytes.len(), 24);
    let (frame, used) = MpaFrame::parse(&bytes).unwrap();
    assert_eq!(used, 24);
    assert_eq!(frame.kind, FrameKind::Request);
    assert_eq!(frame.revision, 2);
    assert_eq!(
        frame.flags,
        MpaFlags {
            enhanced: true,
            ..MpaFlags::default()
        }
    );
    assert_eq!(frame.enhanced, Some(Enhanced::new(1, 1)));
    assert!(frame.private_data.is_empty());
    assert_eq!(frame, MpaFrame::request_v2(1, 1, Vec::new()));
    assert_eq!(frame.to_vec().unwrap(), bytes);
    frame.check_linux_limits().unwrap();
    for cut in 0..bytes.len() {
        assert!(
            is_truncated(&MpaFrame::parse(&bytes[..cut])),
            "prefix {cut}"
        );
    }
}

/// One direction of a TCP connection: the bytes in order, and whether this side opened it.
struct Stream {
    initiator: bool,
    data: Vec<u8>,
    next_seq: Option<u32>,
}

/// The TCP payload streams of an Ethernet/IPv4 capture, keyed by (source port, destination
/// port). Retransmitted bytes are dropped; a gap fails the test.
fn tcp_streams(name: &str) -> HashMap<(u16, u16), Stream> {
    let file = std::fs::File::open(capture_path(name))
        .unwrap_or_else(|e| panic!("capture {name} missing: {e}"));
    let mut reader = pcap_file::pcap::PcapReader::new(file).unwrap();
    let mut streams: HashMap<(u16, u16), Stream> = HashMap::new();
    while let Some(pkt) = reader.next_packet() {
        let pkt = pkt.unwrap();
        let eth = &pkt.data[..];
        if eth.len() < 14 || eth[12..14] != [0x08, 0x00] {
            continue;
        }
        let ip = &eth[14..];
        let ihl = usize::from(ip[0] & 0x0F) * 4;
        let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
        if ip[9] != 6 {
            continue;
        }
        let tcp = &ip[ihl..total];
        let sport = u16::from_be_bytes([tcp[0], tcp[1]]);
        let dport = u16::from_be_bytes([tcp[2], tcp[3]]);
        let seq = u32::from_be_bytes([tcp[4], tcp[5], tcp[6], tcp[7]]);
        let doff = usize::from(tcp[12] >> 4) * 4;
        let flags = tcp[13];
        let (syn, ack) = (flags & 0x02 != 0, flags & 0x10 != 0);
        let payload = &tcp[doff..];
        let s = streams.entry((sport, dport)).or_insert(Stream {
            initiator: false,
            data: Vec::new(),
            next_seq: None,
        });
        if syn {
            s.initiator = !ack;
            s.next_seq = Some(seq.wrapping_add(1));
            continue;
        }
        let Some(next) = s.next_seq else { continue };
        if payload.is_empty() {
            continue;
        }
        // Bytes of this segment already taken (a retransmission); a segment starting past
        // `next` would leave a hole.
        let behind = next.wrapping_sub(seq);
        assert!(behind < 1 << 31, "gap in {name} stream {sport}->{dport}");
        let Some(new) = payload.get(behind as usize..).filter(|n| !n.is_empty()) else {
            continue;
        };
        s.data.extend_from_slice(new);
        s.next_seq = Some(next.wrapping_add(new.len() as u32));
    }
    streams
}

#[derive(Debug, Default, PartialEq, Eq)]
struct Seen {
    fpdus: usize,
    sends: usize,
    zero_len_writes: usize,
    terminates: usize,
}

/// Walks the FPDUs of one direction: each must parse, re-encode to the same bytes, and carry a
/// valid DDP/RDMAP header that also re-encodes exactly.
fn walk_fpdus(mut rest: &[u8], crc_on: bool) -> Seen {
    let mut seen = Seen::default();
    while !rest.is_empty() {
        let (ulpdu, used) = parse_fpdu(rest, crc_on).unwrap();
        let mut again = Vec::new();
        emit_fpdu(ulpdu, crc_on, &mut again).unwrap();
        assert_eq!(
            again,
            &rest[..used],
            "FPDU re-encodes byte-exact (zero pad, CRC or 0)"
        );
        let (hdr, hlen) = DdpRdmapHeader::parse(ulpdu).unwrap();
        assert_eq!(hdr.to_vec().unwrap(), &ulpdu[..hlen]);
        match hdr.opcode {
            RdmapOpcode::Send => seen.sends += 1,
            RdmapOpcode::RdmaWrite if ulpdu.len() == TAGGED_HEADER_LEN => seen.zero_len_writes += 1,
            RdmapOpcode::Terminate => {
                let t = Terminate::parse(&ulpdu[hlen..]).unwrap();
                assert_eq!(t.to_vec().unwrap(), &ulpdu[hlen..]);
                seen.terminates += 1;
            }
            other => panic!("unexpected opcode {other:?}"),
        }
        seen.fpdus += 1;
        rest = &rest[used..];
    }
    seen
}

struct Connection {
    request: MpaFrame,
    reply: Option<MpaFrame>,
    initiator_fpdus: Seen,
    responder_fpdus: Seen,
}

fn connections(name: &str) -> Vec<Connection> {
    let streams = tcp_streams(name);
    let mut out = Vec::new();
    let mut keys: Vec<_> = streams
        .keys()
        .copied()
        .filter(|k| streams[k].initiator)
        .collect();
    keys.sort_unstable();
    for (ip, rp) in keys {
        let init = &streams[&(ip, rp)];
        let (request, rused) = MpaFrame::parse_with_limit(&init.data, MAX_PRIVATE_DATA).unwrap();
        assert_eq!(request.kind, FrameKind::Request);
        assert_eq!(request.to_vec().unwrap(), &init.data[..rused]);
        let resp = streams.get(&(rp, ip)).map_or(&[][..], |s| &s.data[..]);
        if resp.is_empty() {
            assert_eq!(
                rused,
                init.data.len(),
                "initiator sent FPDUs without a Reply"
            );
            out.push(Connection {
                request,
                reply: None,
                initiator_fpdus: Seen::default(),
                responder_fpdus: Seen::default(),
            });
            continue;
        }
        let (reply, pused) = MpaFrame::parse_with_limit(resp, MAX_PRIVATE_DATA).unwrap();
        assert_eq!(reply.kind, FrameKind::Reply);
        assert_eq!(reply.to_vec().unwrap(), &resp[..pused]);
        let crc_on = crc_negotiated(&request, &reply);
        let initiator_fpdus = walk_fpdus(&init.data[rused..], crc_on);
        let responder_fpdus = walk_fpdus(&resp[pused..], crc_on);
        out.push(Connection {
            request,
            reply: Some(reply),
            initiator_fpdus,
            responder_fpdus,
        });
    }
    out
}

fn two_sends() -> Seen {
    Seen {
        fpdus: 2,
        sends: 2,
        ..Seen::default()
    }
}

#[test]
fn capture_v2_ucmatose() {
    let c = connections("e1-v2-ucmatose.pcap");
    assert_eq!(c.len(), 1);
    let c = &c[0];
    assert_eq!(c.request, MpaFrame::request_v2(1, 1, Vec::new()));
    assert_eq!(c.reply, Some(MpaFrame::reply_v2(1, 1, Vec::new())));
    assert_eq!(c.initiator_fpdus, two_sends());
    assert_eq!(c.responder_fpdus, two_sends());
}

#[test]
fn capture_v1_ucmatose() {
    let c = connections("e1-v1-ucmatose.pcap");
    assert_eq!(c.len(), 1);
    let c = &c[0];
    assert_eq!(c.request, MpaFrame::request_v1(Vec::new()));
    assert_eq!(c.reply, Some(MpaFrame::reply_v1(Vec::new())));
    assert_eq!(c.initiator_fpdus, two_sends());
    assert_eq!(c.responder_fpdus, two_sends());
}

#[test]
fn capture_crc_negotiated_and_every_crc_checks() {
    let c = connections("e1-crc-ucmatose.pcap");
    assert_eq!(c.len(), 1);
    let c = &c[0];
    let reply = c.reply.as_ref().unwrap();
    assert!(c.request.flags.crc && reply.flags.crc);
    assert_eq!(c.request.to_vec().unwrap()[16], 0x50);
    assert!(crc_negotiated(&c.request, reply));
    // walk_fpdus ran with CRC on, so every CRC was verified.
    assert_eq!(c.initiator_fpdus, two_sends());
    assert_eq!(c.responder_fpdus, two_sends());
}

#[test]
fn capture_crc_is_rejected_when_a_byte_is_flipped() {
    let streams = tcp_streams("e1-crc-ucmatose.pcap");
    let resp = streams.values().find(|s| !s.initiator).unwrap();
    let (_, used) = MpaFrame::parse(&resp.data).unwrap();
    let mut fpdu = resp.data[used..].to_vec();
    parse_fpdu(&fpdu, true).unwrap();
    fpdu[30] ^= 0x01;
    assert!(matches!(
        parse_fpdu(&fpdu, true),
        Err(WireError::BadCrc {
            what: "MPA CRC",
            ..
        })
    ));
    assert!(
        parse_fpdu(&fpdu, false).is_ok(),
        "with CRC off the slot is not checked"
    );
}

#[test]
fn capture_peer_to_peer_rtr() {
    let c = connections("e1-p2p-ucmatose.pcap");
    assert_eq!(c.len(), 1);
    let c = &c[0];
    let req = c.request.enhanced.unwrap();
    assert_eq!(
        req,
        Enhanced {
            ird: 1,
            ord: 1,
            peer_to_peer: true,
            zero_len_send_rtr: false,
            zero_len_write_rtr: true,
            zero_len_read_rtr: true
        }
    );
    let rep = c.reply.as_ref().unwrap().enhanced.unwrap();
    assert_eq!(
        rep,
        Enhanced {
            ird: 1,
            ord: 1,
            peer_to_peer: true,
            zero_len_send_rtr: false,
            zero_len_write_rtr: true,
            zero_len_read_rtr: false
        }
    );
    assert_eq!(
        c.initiator_fpdus,
        Seen {
            fpdus: 3,
            sends: 2,
            zero_len_writes: 1,
            terminates: 0
        }
    );
    assert_eq!(c.responder_fpdus, two_sends());
}

#[test]
fn capture_reject() {
    let c = connections("e1-v2-reject.pcap");
    assert_eq!(c.len(), 2);
    for c in &c {
        let reply = c.reply.as_ref().unwrap();
        assert_eq!(c.request, MpaFrame::request_v2(1, 1, Vec::new()));
        assert_eq!(reply.enhanced, Some(Enhanced::new(1, 1)));
        assert_eq!(c.initiator_fpdus, Seen::default());
        assert_eq!(c.responder_fpdus, Seen::default());
    }
    // One connection is accepted; the other is rejected with flags 0x30.
    let rejects: Vec<_> = c
        .iter()
        .map(|c| c.reply.as_ref().unwrap())
        .filter(|r| r.flags.reject)
        .collect();
    assert_eq!(rejects.len(), 1);
    assert_eq!(*rejects[0], MpaFrame::reject_v2(1, 1, Vec::new()));
    assert_eq!(rejects[0].to_vec().unwrap()[16], 0x30);
}

#[test]
fn capture_mpa_timeout_has_only_a_request() {
    let c = connections("e2-mpa-timeout.pcap");
    assert_eq!(c.len(), 1);
    assert_eq!(c[0].request, MpaFrame::request_v2(1, 1, Vec::new()));
    assert!(c[0].reply.is_none());
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

#[test]
fn every_prefix_is_truncated() {
    let req = hex(V2_REQUEST);
    for cut in 0..req.len() {
        assert!(
            is_truncated(&MpaFrame::parse(&req[..cut])),
            "request prefix {cut}"
        );
    }
    for v in [SEND_FPDU, TERM_FPDU] {
        let f = hex(v);
        for cut in 0..f.len() {
            assert!(
                is_truncated(&parse_fpdu(&f[..cut], true)),
                "FPDU prefix {cut}"
            );
            assert!(
                is_truncated(&parse_fpdu(&f[..cut], false)),
                "FPDU prefix {cut}"
            );
            assert!(is_truncated(&Fpdu::parse(&f[..cut])), "FPDU prefix {cut}");
        }
    }
    let untagged = DdpRdmapHeader::untagged(RdmapOpcode::Send, 0, 1, 0)
        .to_vec()
        .unwrap();
    let tagged = DdpRdmapHeader::tagged(RdmapOpcode::RdmaWrite, 0x1234, 99)
        .to_vec()
        .unwrap();
    for h in [untagged, tagged] {
        for cut in 0..h.len() {
            assert!(
                is_truncated(&DdpRdmapHeader::parse(&h[..cut])),
                "DDP prefix {cut}"
            );
        }
    }
    let t = Terminate {
        m: true,
        ddp_segment_length: Some(40),
        ..Terminate::llp(1)
    }
    .to_vec()
    .unwrap();
    for cut in 0..t.len() {
        assert!(
            is_truncated(&Terminate::parse(&t[..cut])),
            "Terminate prefix {cut}"
        );
    }
    let rr = ReadRequest {
        size: 5,
        ..ReadRequest::default()
    }
    .to_bytes();
    for cut in 0..rr.len() {
        assert!(
            is_truncated(&ReadRequest::parse(&rr[..cut])),
            "Read Request prefix {cut}"
        );
    }
    for cut in 0..4 {
        assert!(is_truncated(&Enhanced::parse(&[0, 1, 0, 1][..cut])));
    }
}

#[test]
fn truncated_means_need_more() {
    let req = hex(V2_REQUEST);
    assert_eq!(
        MpaFrame::parse(&req[..5]),
        Err(WireError::Truncated {
            what: "MPA key",
            need: 16,
            got: 5
        })
    );
    assert_eq!(
        MpaFrame::parse(&req[..18]),
        Err(WireError::Truncated {
            what: "MPA frame header",
            need: 20,
            got: 18
        })
    );
    assert_eq!(
        MpaFrame::parse(&req[..25]),
        Err(WireError::Truncated {
            what: "MPA frame",
            need: 27,
            got: 25
        })
    );
    let f = hex(SEND_FPDU);
    assert_eq!(
        parse_fpdu(&f[..39], true),
        Err(WireError::Truncated {
            what: "MPA FPDU",
            need: 40,
            got: 39
        })
    );
}

#[test]
fn a_frame_followed_by_an_fpdu_in_one_read() {
    let mut stream = hex(V2_REQUEST);
    stream.extend(hex(SEND_FPDU));
    let (frame, used) = MpaFrame::parse(&stream).unwrap();
    assert_eq!(frame.private_data, b"ulp");
    assert_eq!(used, 27);
    let (ulpdu, used2) = parse_fpdu(&stream[used..], true).unwrap();
    assert_eq!(used + used2, stream.len());
    assert_eq!(&ulpdu[18..], b"PING-DATA-123");
}

#[test]
fn wrong_key() {
    let good = hex(V2_REQUEST);
    for i in 0..16 {
        let mut bad = good.clone();
        bad[i] ^= 0x20;
        // Byte 10 flipped from 'q' gives 'Q', neither key.
        let r = MpaFrame::parse(&bad);
        assert!(
            matches!(
                r,
                Err(WireError::BadField {
                    field: "MPA key",
                    ..
                })
            ),
            "byte {i}: {r:?}"
        );
        // Garbage fails as soon as it is seen, without waiting for 20 bytes.
        let r = MpaFrame::parse(&bad[..=i]);
        assert!(
            matches!(
                r,
                Err(WireError::BadField {
                    field: "MPA key",
                    ..
                })
            ),
            "prefix {i}: {r:?}"
        );
    }
    assert_eq!(
        MpaFrame::parse(b"HTTP/1.1 400 Bad Request\r\n"),
        Err(WireError::BadField {
            field: "MPA key",
            value: u64::from_be_bytes(*b"HTTP/1.1")
        })
    );
    let mut rep = good.clone();
    rep[..16].copy_from_slice(&REP_KEY);
    assert_eq!(MpaFrame::parse(&rep).unwrap().0.kind, FrameKind::Reply);
    assert_eq!(&REQ_KEY, b"MPA ID Req Frame");
}

fn frame_with(flags: u8, rev: u8, pd_len: u16, pd: &[u8]) -> Vec<u8> {
    let mut v = REQ_KEY.to_vec();
    v.push(flags);
    v.push(rev);
    v.extend_from_slice(&pd_len.to_be_bytes());
    v.extend_from_slice(pd);
    v
}

#[test]
fn private_data_length_limits() {
    let pd = vec![0xAB; 600];
    let r = MpaFrame::parse(&frame_with(0, 1, 513, &pd[..513]));
    assert!(
        matches!(
            r,
            Err(WireError::BadLength {
                what: "MPA PD_Length",
                ..
            })
        ),
        "{r:?}"
    );
    // Refused from the header alone: no waiting for 513 bytes that should never come.
    let r = MpaFrame::parse(&frame_with(0, 1, 513, &[]));
    assert!(matches!(r, Err(WireError::BadLength { .. })), "{r:?}");
    let r = MpaFrame::parse(&frame_with(0, 1, 0xFFFF, &[]));
    assert!(matches!(r, Err(WireError::BadLength { .. })), "{r:?}");

    let (f, used) = MpaFrame::parse(&frame_with(0, 1, 512, &pd[..512])).unwrap();
    assert_eq!((f.private_data.len(), used), (512, 532));
    assert!(matches!(
        f.check_linux_limits(),
        Err(WireError::PrivateDataTooLong { max: 256, .. })
    ));
    let r = MpaFrame::parse_with_limit(&frame_with(0, 1, 257, &pd[..257]), MAX_PRIVATE_DATA);
    assert!(matches!(r, Err(WireError::BadLength { .. })), "{r:?}");
    MpaFrame::parse_with_limit(&frame_with(0, 1, 256, &pd[..256]), MAX_PRIVATE_DATA).unwrap();

    // v2: the IRD/ORD words count, so 252 user bytes is the Linux maximum.
    MpaFrame::request_v2(1, 1, vec![0; ENHANCED_USER_MAX])
        .check_linux_limits()
        .unwrap();
    let r = MpaFrame::request_v2(1, 1, vec![0; ENHANCED_USER_MAX + 1]).check_linux_limits();
    assert_eq!(
        r,
        Err(WireError::PrivateDataTooLong {
            what: "MPA frame (Linux)",
            len: 253,
            max: 252
        })
    );
    MpaFrame::request_v2(1, 1, vec![0; RFC_MAX_PRIVATE_DATA - 4])
        .to_vec()
        .unwrap();
    let r = MpaFrame::request_v2(1, 1, vec![0; RFC_MAX_PRIVATE_DATA - 3]).to_vec();
    assert!(
        matches!(
            r,
            Err(WireError::PrivateDataTooLong {
                len: 513,
                max: 512,
                ..
            })
        ),
        "{r:?}"
    );

    // Enhanced v2 frame too short to hold IRD/ORD: judged once all of it is in (a responder
    // answers it with a reject Reply, as siw does), every length from 0 to 3.
    for len in 0..4u16 {
        let whole = frame_with(0x10, 2, len, &[0, 1, 0][..usize::from(len)]);
        let r = MpaFrame::parse(&whole);
        assert!(matches!(r, Err(WireError::BadLength { .. })), "{r:?}");
        let r = MpaFrame::parse(&whole[..whole.len() - 1]);
        assert!(matches!(r, Err(WireError::Truncated { .. })), "{r:?}");
    }
    // Without the Enhanced flag, or in revision 1, the same bytes are plain private data.
    let (f, _) = MpaFrame::parse(&frame_with(0x00, 2, 3, &[0, 1, 0])).unwrap();
    assert_eq!(
        (f.enhanced, f.private_data.as_slice()),
        (None, &[0, 1, 0][..])
    );
    let (f, _) = MpaFrame::parse(&frame_with(0x10, 1, 4, &[0, 1, 0, 1])).unwrap();
    assert!(f.flags.enhanced && f.enhanced.is_none());
    assert_eq!(f.to_vec().unwrap(), frame_with(0x10, 1, 4, &[0, 1, 0, 1]));
}

#[test]
fn revision_must_be_1_or_2() {
    for rev in [0u8, 3, 4, 0xFF] {
        assert_eq!(
            MpaFrame::parse(&frame_with(0, rev, 0, &[])),
            Err(WireError::BadField {
                field: "MPA revision",
                value: rev.into()
            })
        );
        let f = MpaFrame {
            revision: rev,
            ..MpaFrame::request_v1(Vec::new())
        };
        assert!(matches!(
            f.to_vec(),
            Err(WireError::BadField {
                field: "MPA revision",
                ..
            })
        ));
    }
    for rev in [1u8, 2] {
        MpaFrame::parse(&frame_with(0, rev, 0, &[])).unwrap();
    }
}

/// R means something in a Reply only: in a Request it is "not checked on receipt" (RFC
/// 5044 §7.1, as siw's `siw_proc_mpareq`), so a Request with it parses, keeping the bit so
/// that parse -> emit stays exact. (It was refused as a malformed frame.)
#[test]
fn reject_flag_is_not_checked_in_a_request() {
    let bytes = frame_with(0x20, 1, 0, &[]);
    let (f, used) = MpaFrame::parse(&bytes).expect("a Request with R parses");
    assert_eq!(
        (f.kind, f.flags.reject, used),
        (FrameKind::Request, true, 20)
    );
    assert_eq!(f.to_vec().unwrap(), bytes, "and re-encodes as it came");

    let rej = MpaFrame::reject_v1(b"busy".to_vec());
    let bytes = rej.to_vec().unwrap();
    assert_eq!(&bytes[..16], &REP_KEY);
    assert_eq!(&bytes[16..20], &[0x20, 1, 0, 4]);
    assert_eq!(MpaFrame::parse(&bytes).unwrap().0, rej);
}

#[test]
fn markers_flag_still_parses() {
    let (f, _) = MpaFrame::parse(&frame_with(0x80 | 0x40 | 0x08 | 0x05, 1, 0, &[])).unwrap();
    assert_eq!(
        f.flags,
        MpaFlags {
            markers: true,
            crc: true,
            reject: false,
            enhanced: false,
            gso_exp: true,
            reserved: 5
        }
    );
    assert_eq!(f.to_vec().unwrap()[16], 0xCD);
}

#[test]
fn encoder_refuses_what_the_parser_would_not_read_back() {
    let mut f = MpaFrame::request_v2(1, 1, Vec::new());
    f.enhanced = None;
    assert!(matches!(
        f.to_vec(),
        Err(WireError::BadField {
            field: "MPA enhanced flag",
            ..
        })
    ));
    let mut f = MpaFrame::request_v1(Vec::new());
    f.enhanced = Some(Enhanced::new(1, 1));
    assert!(f.to_vec().is_err());
    let f = MpaFrame::request_v2(0x4000, 1, Vec::new());
    assert_eq!(
        f.to_vec(),
        Err(WireError::FieldOverflow {
            field: "MPA IRD",
            bits: 14,
            value: 0x4000
        })
    );
    let f = MpaFrame::request_v2(1, 0xFFFF, Vec::new());
    assert!(matches!(
        f.to_vec(),
        Err(WireError::FieldOverflow {
            field: "MPA ORD",
            ..
        })
    ));
    let mut f = MpaFrame::request_v1(Vec::new());
    f.flags.reserved = 8;
    assert!(matches!(f.to_vec(), Err(WireError::FieldOverflow { .. })));

    let f = MpaFrame::request_v2(16, 16, b"ulp".to_vec());
    let mut short = [0u8; 26];
    assert!(matches!(
        f.emit(&mut short),
        Err(WireError::Truncated { .. })
    ));
    let mut big = [0xEEu8; 40];
    assert_eq!(f.emit(&mut big), Ok(27));
    assert_eq!(&big[..27], &hex(V2_REQUEST)[..]);
    assert_eq!(
        &big[27..],
        &[0xEE; 13],
        "emit leaves the rest of the buffer alone"
    );

    let h = DdpRdmapHeader {
        ddp_reserved: 16,
        ..DdpRdmapHeader::untagged(RdmapOpcode::Send, 0, 1, 0)
    };
    assert!(matches!(h.to_vec(), Err(WireError::FieldOverflow { .. })));
    let h = DdpRdmapHeader {
        rdmap_reserved: 4,
        ..DdpRdmapHeader::untagged(RdmapOpcode::Send, 0, 1, 0)
    };
    assert!(matches!(h.to_vec(), Err(WireError::FieldOverflow { .. })));
    let h = DdpRdmapHeader::untagged(RdmapOpcode::Other(3), 0, 1, 0);
    assert!(matches!(
        h.to_vec(),
        Err(WireError::BadField {
            field: "RDMAP opcode",
            value: 3
        })
    ));
    DdpRdmapHeader::untagged(RdmapOpcode::Other(8), 0, 1, 0)
        .to_vec()
        .unwrap();

    let t = Terminate {
        m: true,
        ..Terminate::llp(1)
    };
    assert!(t.to_vec().is_err(), "M set but no segment length");
    let t = Terminate {
        ddp_segment_length: Some(4),
        ..Terminate::llp(1)
    };
    assert!(t.to_vec().is_err(), "segment length without M or D");
    assert!(Terminate {
        layer: 16,
        ..Terminate::llp(1)
    }
    .to_vec()
    .is_err());
    assert!(Terminate {
        error_type: 16,
        ..Terminate::llp(1)
    }
    .to_vec()
    .is_err());
    assert!(Terminate {
        reserved: 0x2000,
        ..Terminate::llp(1)
    }
    .to_vec()
    .is_err());
    assert!(terminate_ulpdu(
        2,
        1,
        &Terminate {
            layer: 16,
            ..Terminate::llp(1)
        }
    )
    .is_err());

    let too_long = vec![0u8; 65536];
    let mut out = Vec::new();
    assert!(matches!(
        emit_fpdu(&too_long, true, &mut out),
        Err(WireError::BadLength { .. })
    ));
    emit_fpdu(&too_long[..65535], true, &mut out).unwrap();
    assert_eq!(out.len(), fpdu_len(65535));
    parse_fpdu(&out, true).unwrap();
}

#[test]
fn crc_mismatch() {
    let mut f = hex(SEND_FPDU);
    f[39] ^= 0xFF;
    assert_eq!(
        parse_fpdu(&f, true),
        Err(WireError::BadCrc {
            what: "MPA CRC",
            carried: 0x6F3B_2DB8,
            computed: 0x903B_2DB8
        })
    );
    assert!(parse_fpdu(&f, false).is_ok());

    // A peer that sends 0 (CRC off) while we expect CRC.
    let mut out = Vec::new();
    emit_fpdu(&send_ulpdu(0, 1, 0, b"PING-DATA-123"), false, &mut out).unwrap();
    assert_eq!(&out[36..], &[0, 0, 0, 0]);
    assert!(matches!(
        parse_fpdu(&out, true),
        Err(WireError::BadCrc { carried: 0, .. })
    ));

    // Damage in the payload or the pad is caught too.
    for at in [5, 20, 33] {
        let mut g = hex(SEND_FPDU);
        g[at] ^= 0x01;
        assert!(
            matches!(parse_fpdu(&g, true), Err(WireError::BadCrc { .. })),
            "byte {at}"
        );
    }
}

#[test]
fn non_zero_pad_is_accepted() {
    let mut f = hex(SEND_FPDU);
    f[33..36].copy_from_slice(&[1, 2, 3]);
    let (ulpdu, _) = parse_fpdu(&f, false).unwrap();
    assert_eq!(&ulpdu[18..], b"PING-DATA-123");
    // With CRC on the pad is covered, so a CRC computed over it still checks.
    let crc = mpa_crc(&f[..36]);
    f[36..].copy_from_slice(&crc.to_le_bytes());
    let (fpdu, _) = Fpdu::parse(&f).unwrap();
    assert_eq!(fpdu.pad, &[1, 2, 3]);
    assert_eq!(fpdu.computed_crc(), crc);
    parse_fpdu(&f, true).unwrap();
}

#[test]
fn fpdu_sizes() {
    assert_eq!((fpdu_pad(0), fpdu_len(0)), (2, 8));
    assert_eq!(
        (fpdu_pad(14), fpdu_len(14)),
        (0, 20),
        "zero-length RDMA Write RTR"
    );
    assert_eq!((fpdu_pad(22), fpdu_len(22)), (0, 28), "minimal Terminate");
    assert_eq!(
        (fpdu_pad(118), fpdu_len(118)),
        (0, 124),
        "siw ucmatose Send"
    );
    for n in 0..64 {
        assert_eq!((2 + n + fpdu_pad(n)) % 4, 0);
        assert!(fpdu_pad(n) < 4);
    }
}

#[test]
fn ddp_and_rdmap_versions_are_checked() {
    let mut h = DdpRdmapHeader::untagged(RdmapOpcode::Send, 0, 1, 0)
        .to_vec()
        .unwrap();
    assert_eq!(&h[..2], &[0x41, 0x43]);
    for dv in [0u8, 2, 3] {
        h[0] = 0x40 | dv;
        assert_eq!(
            DdpRdmapHeader::parse(&h),
            Err(WireError::BadField {
                field: "DDP version",
                value: dv.into()
            })
        );
        // Known from the first two bytes: no need to wait for the rest.
        assert!(matches!(
            DdpRdmapHeader::parse(&h[..2]),
            Err(WireError::BadField { .. })
        ));
    }
    h[0] = 0x41;
    for rv in [0u8, 2, 3] {
        h[1] = (rv << 6) | 3;
        assert_eq!(
            DdpRdmapHeader::parse(&h),
            Err(WireError::BadField {
                field: "RDMAP version",
                value: rv.into()
            })
        );
    }
}

#[test]
fn ddp_header_fields() {
    // The zero-length RDMA Write RTR of the p2p capture: tagged, last, STag 0, TO 0.
    let w = DdpRdmapHeader::tagged(RdmapOpcode::RdmaWrite, 0, 0)
        .to_vec()
        .unwrap();
    assert_eq!(w, [0xC1, 0x40, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    let h = DdpRdmapHeader {
        last: false,
        ddp_reserved: 0xF,
        rdmap_reserved: 3,
        opcode: RdmapOpcode::SendSeInvalidate,
        buffer: DdpBuffer::Untagged {
            rsvd_ulp: 0xDEAD_BEEF,
            qn: 0,
            msn: 7,
            mo: 0x100,
        },
    };
    let b = h.to_vec().unwrap();
    assert_eq!(
        hex("3d 76 de ad be ef 00 00 00 00 00 00 00 07 00 00 01 00"),
        b
    );
    assert_eq!(DdpRdmapHeader::parse(&b).unwrap(), (h, 18));
    for n in 0..16u8 {
        assert_eq!(RdmapOpcode::from_bits(n).bits(), n);
    }
    assert_eq!(RdmapOpcode::from_bits(7), RdmapOpcode::Terminate);
    assert_eq!(RdmapOpcode::from_bits(9), RdmapOpcode::Other(9));
}

#[test]
fn terminate_with_copied_headers() {
    // A DDP error that copies the offending segment's length and its 18-byte header.
    let offending = DdpRdmapHeader::untagged(RdmapOpcode::Send, 5, 9, 0)
        .to_vec()
        .unwrap();
    let t = Terminate {
        layer: term_layer::DDP,
        error_type: term_etype::DDP_UNTAGGED_BUFFER,
        error_code: 1,
        m: true,
        d: true,
        r: true,
        reserved: 0,
        ddp_segment_length: Some(18),
        copied_headers: offending.clone(),
    };
    let b = t.to_vec().unwrap();
    assert_eq!(&b[..6], &[0x12, 0x01, 0xE0, 0x00, 0x00, 0x12]);
    assert_eq!(&b[6..], &offending[..]);
    assert_eq!(Terminate::parse(&b).unwrap(), t);
    // Only D set still carries the length.
    let t = Terminate {
        m: false,
        r: false,
        ..t
    };
    let b = t.to_vec().unwrap();
    assert_eq!(&b[2..6], &[0x40, 0x00, 0x00, 0x12]);
    assert_eq!(Terminate::parse(&b).unwrap(), t);
    // R alone does not.
    let t = Terminate {
        r: true,
        ..Terminate::llp(llp_ecode::INVALID_REQ_REP)
    };
    assert_eq!(t.to_vec().unwrap(), [0x20, 0x04, 0x20, 0x00]);
    assert_eq!(llp_ecode::NO_MATCHING_RTR, 7);
    assert_eq!(llp_ecode::INSUFFICIENT_IRD, 6);
}

#[test]
fn crc_negotiation() {
    let plain = MpaFrame::request_v1(Vec::new());
    let mut crc = plain.clone();
    crc.flags.crc = true;
    assert!(!crc_negotiated(&plain, &plain));
    assert!(crc_negotiated(&crc, &plain));
    assert!(crc_negotiated(&plain, &crc));
    assert!(crc_negotiated(&crc, &crc));
}

#[test]
fn header_len_constant() {
    assert_eq!(MPA_FRAME_HEADER_LEN, 20);
    assert_eq!(MAX_PRIVATE_DATA, 256);
    assert_eq!(RFC_MAX_PRIVATE_DATA, 512);
    assert_eq!(ENHANCED_USER_MAX, 252);
}

// ---------------------------------------------------------------------------------------------
// Properties
// ---------------------------------------------------------------------------------------------

fn arb_enhanced() -> impl Strategy<Value = Enhanced> {
    (0..=0x3FFFu16, 0..=0x3FFFu16, any::<[bool; 4]>()).prop_map(|(ird, ord, b)| Enhanced {
        ird,
        ord,
        peer_to_peer: b[0],
        zero_len_send_rtr: b[1],
        zero_len_write_rtr: b[2],
        zero_len_read_rtr: b[3],
    })
}

/// Any frame the encoder accepts.
fn arb_frame() -> impl Strategy<Value = MpaFrame> {
    (
        any::<bool>(),
        any::<u8>(),
        1..=2u8,
        arb_enhanced(),
        proptest::collection::vec(any::<u8>(), 0..=RFC_MAX_PRIVATE_DATA - 4),
    )
        .prop_map(|(is_req, flag_byte, revision, e, pd)| {
            let kind = if is_req {
                FrameKind::Request
            } else {
                FrameKind::Reply
            };
            let mut flags = MpaFlags::from_byte(flag_byte);
            if kind == FrameKind::Request {
                flags.reject = false;
            }
            let enhanced = (revision == 2 && flags.enhanced).then_some(e);
            MpaFrame {
                kind,
                flags,
                revision,
                enhanced,
                private_data: pd,
            }
        })
}

/// Any frame at all, most of which the encoder must refuse.
fn arb_any_frame() -> impl Strategy<Value = MpaFrame> {
    (
        any::<bool>(),
        any::<[bool; 5]>(),
        any::<u8>(),
        prop_oneof![Just(1u8), Just(2u8), any::<u8>()],
        proptest::option::of((any::<u16>(), any::<u16>(), any::<[bool; 4]>())),
        proptest::collection::vec(any::<u8>(), 0..=520),
    )
        .prop_map(|(is_req, f, reserved, revision, e, pd)| MpaFrame {
            kind: if is_req {
                FrameKind::Request
            } else {
                FrameKind::Reply
            },
            flags: MpaFlags {
                markers: f[0],
                crc: f[1],
                reject: f[2],
                enhanced: f[3],
                gso_exp: f[4],
                reserved,
            },
            revision,
            enhanced: e.map(|(ird, ord, b)| Enhanced {
                ird,
                ord,
                peer_to_peer: b[0],
                zero_len_send_rtr: b[1],
                zero_len_write_rtr: b[2],
                zero_len_read_rtr: b[3],
            }),
            private_data: pd,
        })
}

fn arb_opcode() -> impl Strategy<Value = RdmapOpcode> {
    (0..16u8).prop_map(RdmapOpcode::from_bits)
}

fn arb_ddp() -> impl Strategy<Value = DdpRdmapHeader> {
    let buffer = prop_oneof![
        (any::<u32>(), any::<u64>()).prop_map(|(stag, tagged_offset)| DdpBuffer::Tagged {
            stag,
            tagged_offset
        }),
        (any::<u32>(), any::<u32>(), any::<u32>(), any::<u32>()).prop_map(
            |(rsvd_ulp, qn, msn, mo)| DdpBuffer::Untagged {
                rsvd_ulp,
                qn,
                msn,
                mo
            }
        ),
    ];
    (any::<bool>(), 0..16u8, 0..4u8, arb_opcode(), buffer).prop_map(
        |(last, ddp_reserved, rdmap_reserved, opcode, buffer)| DdpRdmapHeader {
            last,
            ddp_reserved,
            rdmap_reserved,
            opcode,
            buffer,
        },
    )
}

fn arb_terminate() -> impl Strategy<Value = Terminate> {
    (
        0..16u8,
        0..16u8,
        any::<u8>(),
        any::<[bool; 3]>(),
        0..=0x1FFFu16,
        any::<u16>(),
        proptest::collection::vec(any::<u8>(), 0..64),
    )
        .prop_map(
            |(layer, error_type, error_code, [m, d, r], reserved, seg, copied_headers)| Terminate {
                layer,
                error_type,
                error_code,
                m,
                d,
                r,
                reserved,
                ddp_segment_length: (m || d).then_some(seg),
                copied_headers,
            },
        )
}

fn arb_read_request() -> impl Strategy<Value = ReadRequest> {
    (
        any::<u32>(),
        any::<u64>(),
        any::<u32>(),
        any::<u32>(),
        any::<u64>(),
    )
        .prop_map(
            |(sink_stag, sink_to, size, source_stag, source_to)| ReadRequest {
                sink_stag,
                sink_to,
                size,
                source_stag,
                source_to,
            },
        )
}

/// Bytes that get past the key check often enough to exercise the rest of the parser.
fn mpa_like_bytes() -> impl Strategy<Value = Vec<u8>> {
    (
        any::<bool>(),
        any::<u8>(),
        0..4u8,
        0..600u16,
        proptest::collection::vec(any::<u8>(), 0..600),
    )
        .prop_map(|(req, flags, rev, pd_len, tail)| {
            let mut v = if req {
                REQ_KEY.to_vec()
            } else {
                REP_KEY.to_vec()
            };
            v.push(flags);
            v.push(rev);
            v.extend_from_slice(&pd_len.to_be_bytes());
            v.extend_from_slice(&tail);
            v
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn mpa_frame_round_trips(f in arb_frame(), trailer in proptest::collection::vec(any::<u8>(), 0..8)) {
        let mut bytes = f.to_vec().unwrap();
        prop_assert_eq!(bytes.len(), f.buffer_len());
        let len = bytes.len();
        bytes.extend_from_slice(&trailer);
        prop_assert_eq!(MpaFrame::parse(&bytes), Ok((f.clone(), len)));
        for cut in 0..len {
            prop_assert!(is_truncated(&MpaFrame::parse(&bytes[..cut])), "prefix {}", cut);
        }
    }

    #[test]
    fn mpa_encoder_accepts_exactly_what_reads_back(f in arb_any_frame()) {
        match f.to_vec() {
            Ok(bytes) => {
                prop_assert_eq!(MpaFrame::parse(&bytes), Ok((f.clone(), bytes.len())));
            }
            Err(e) => {
                prop_assert_eq!(f.check(), Err(e));
            }
        }
    }

    #[test]
    fn ddp_header_round_trips(h in arb_ddp(), payload in proptest::collection::vec(any::<u8>(), 0..32)) {
        let mut bytes = h.to_vec().unwrap();
        let len = bytes.len();
        prop_assert_eq!(len, if h.is_tagged() { TAGGED_HEADER_LEN } else { UNTAGGED_HEADER_LEN });
        bytes.extend_from_slice(&payload);
        prop_assert_eq!(DdpRdmapHeader::parse(&bytes), Ok((h, len)));
        for cut in 0..len {
            prop_assert!(is_truncated(&DdpRdmapHeader::parse(&bytes[..cut])));
        }
    }

    #[test]
    fn terminate_round_trips(t in arb_terminate(), qn in any::<u32>(), msn in any::<u32>(), crc_on in any::<bool>()) {
        let bytes = t.to_vec().unwrap();
        prop_assert_eq!(bytes.len(), t.buffer_len());
        prop_assert_eq!(Terminate::parse(&bytes), Ok(t.clone()));
        // And inside a whole FPDU.
        let mut fpdu = Vec::new();
        emit_fpdu(&terminate_ulpdu(qn, msn, &t).unwrap(), crc_on, &mut fpdu).unwrap();
        let (ulpdu, used) = parse_fpdu(&fpdu, crc_on).unwrap();
        prop_assert_eq!(used, fpdu.len());
        let (h, hlen) = DdpRdmapHeader::parse(ulpdu).unwrap();
        prop_assert_eq!(h, DdpRdmapHeader::untagged(RdmapOpcode::Terminate, qn, msn, 0));
        prop_assert_eq!(Terminate::parse(&ulpdu[hlen..]), Ok(t));
    }

    #[test]
    fn read_request_round_trips(r in arb_read_request()) {
        let b = r.to_bytes();
        prop_assert_eq!(ReadRequest::parse(&b), Ok(r));
        let mut out = [0u8; 30];
        prop_assert_eq!(r.emit(&mut out), Ok(28));
        prop_assert_eq!(&out[..28], &b[..]);
    }

    #[test]
    fn fpdu_round_trips(
        qn in any::<u32>(), msn in any::<u32>(), mo in any::<u32>(),
        payload in proptest::collection::vec(any::<u8>(), 0..300),
        crc_on in any::<bool>(),
        flip in any::<prop::sample::Index>(),
    ) {
        let ulpdu = send_ulpdu(qn, msn, mo, &payload);
        let mut bytes = vec![0xAA; 3];
        emit_fpdu(&ulpdu, crc_on, &mut bytes).unwrap();
        let bytes = bytes.split_off(3);
        prop_assert_eq!(bytes.len(), fpdu_len(ulpdu.len()));
        prop_assert_eq!(bytes.len() % 4, 0);
        prop_assert_eq!(parse_fpdu(&bytes, crc_on), Ok((&ulpdu[..], bytes.len())));
        let (h, hlen) = DdpRdmapHeader::parse(&ulpdu).unwrap();
        prop_assert_eq!(h, DdpRdmapHeader::untagged(RdmapOpcode::Send, qn, msn, mo));
        prop_assert_eq!(&ulpdu[hlen..], &payload[..]);
        for cut in 0..bytes.len() {
            prop_assert!(is_truncated(&parse_fpdu(&bytes[..cut], crc_on)));
        }
        if crc_on {
            // Any single-bit error after the length field is caught by the CRC.
            let at = 2 + flip.index(bytes.len() - 2);
            let mut bad = bytes.clone();
            bad[at] ^= 0x10;
            let is_bad_crc = matches!(parse_fpdu(&bad, true), Err(WireError::BadCrc { .. }));
            prop_assert!(is_bad_crc);
        }
    }

    #[test]
    fn crc_agrees_with_the_crc_crate(data in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let iscsi = crc::Crc::<u32>::new(&crc::CRC_32_ISCSI);
        prop_assert_eq!(mpa_crc(&data), iscsi.checksum(&data));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    /// Arbitrary input never panics, and whatever parses re-encodes to exactly the bytes read.
    #[test]
    fn parsers_never_panic_and_are_exact(
        raw in proptest::collection::vec(any::<u8>(), 0..700),
        mpa_like in mpa_like_bytes(),
        crc_on in any::<bool>(),
    ) {
        for buf in [&raw[..], &mpa_like[..]] {
            if let Ok((f, n)) = MpaFrame::parse(buf) {
                prop_assert_eq!(f.to_vec().unwrap(), &buf[..n]);
            }
            if let Ok((f, n)) = MpaFrame::parse_with_limit(buf, MAX_PRIVATE_DATA) {
                prop_assert!(f.check_linux_limits().is_ok());
                prop_assert!(n <= MPA_FRAME_HEADER_LEN + MAX_PRIVATE_DATA);
            }
            if let Ok((u, n)) = parse_fpdu(buf, crc_on) {
                prop_assert!(n <= buf.len());
                prop_assert_eq!(n, fpdu_len(u.len()));
            }
            if let Ok((h, n)) = DdpRdmapHeader::parse(buf) {
                prop_assert_eq!(h.to_vec().unwrap(), &buf[..n]);
            }
            if let Ok(t) = Terminate::parse(buf) {
                prop_assert_eq!(t.to_vec().unwrap(), buf);
            }
            if let Ok(e) = Enhanced::parse(buf) {
                prop_assert_eq!(&e.to_bytes().unwrap()[..], &buf[..4]);
            }
            if let Ok(r) = ReadRequest::parse(buf) {
                prop_assert_eq!(&r.to_bytes()[..], &buf[..28]);
            }
        }
    }
}
