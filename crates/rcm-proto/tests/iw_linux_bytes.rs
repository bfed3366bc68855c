//! The iWARP engine against real Linux 6.1 siw traffic (`testdata/captures/iwarp/`, see
//! `captures/README.md`): the MPA Request and Reply we emit, our RTR frame in peer-to-peer mode
//! and our Send FPDUs (with and without CRC) equal siw's bytes; siw's bytes fed to our engine
//! give the events the kernel's peer saw; and our MPA reply timer matches the kernel's.

use rcm_proto::iw::{
    AcceptParams, Cep, CepConfig, CloseReason, ConnectError, ConnectParams, ConnectReply, Event,
    MpaVersion, RtrKind, RtrModes, State, TcpAction,
};
use rcm_wire::mpa::{self, DdpRdmapHeader, MpaFrame, RdmapOpcode};
use std::time::{Duration, Instant};

fn capture_path(name: &str) -> String {
    format!(
        "{}/../../testdata/captures/iwarp/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

/// One TCP connection of a capture: the bytes each way, in order, and when the first FIN and
/// the first payload went out.
#[derive(Default, Debug)]
struct Conn {
    client_port: u16,
    client: Vec<u8>,
    server: Vec<u8>,
    first_payload_ts: Option<Duration>,
    first_fin_ts: Option<Duration>,
}

/// Reassembles the TCP streams of an Ethernet/IPv4 capture (no loss or reordering in these).
fn tcp_streams(name: &str) -> Vec<Conn> {
    let path = capture_path(name);
    let f = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut r = pcap_file::pcap::PcapReader::new(f).unwrap();
    let mut conns: Vec<Conn> = Vec::new();
    while let Some(p) = r.next_packet() {
        let p = p.unwrap();
        let d = &p.data;
        assert_eq!(u16::from_be_bytes([d[12], d[13]]), 0x0800, "IPv4 only");
        let ip = &d[14..];
        let ihl = usize::from(ip[0] & 0x0F) * 4;
        let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
        assert_eq!(ip[9], 6, "TCP only");
        let tcp = &ip[ihl..total];
        let sport = u16::from_be_bytes([tcp[0], tcp[1]]);
        let dport = u16::from_be_bytes([tcp[2], tcp[3]]);
        let off = usize::from(tcp[12] >> 4) * 4;
        let flags = tcp[13];
        let payload = &tcp[off..];
        let (syn, ack, fin) = (flags & 0x02 != 0, flags & 0x10 != 0, flags & 0x01 != 0);
        if syn && !ack {
            conns.push(Conn {
                client_port: sport,
                ..Conn::default()
            });
        }
        let Some(c) = conns
            .iter_mut()
            .find(|c| c.client_port == sport || c.client_port == dport)
        else {
            continue;
        };
        if !payload.is_empty() && c.first_payload_ts.is_none() {
            c.first_payload_ts = Some(p.timestamp);
        }
        if fin && c.first_fin_ts.is_none() {
            c.first_fin_ts = Some(p.timestamp);
        }
        if c.client_port == sport {
            c.client.extend_from_slice(payload);
        } else {
            c.server.extend_from_slice(payload);
        }
    }
    conns
}

/// Splits a stream of FPDUs into whole FPDUs.
fn fpdus(mut s: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    while !s.is_empty() {
        let (_, used) = mpa::Fpdu::parse(s).unwrap();
        out.push(s[..used].to_vec());
        s = &s[used..];
    }
    out
}

/// The payload of a Send FPDU.
fn send_payload(fpdu: &[u8]) -> Vec<u8> {
    let (f, _) = mpa::Fpdu::parse(fpdu).unwrap();
    let (h, n) = DdpRdmapHeader::parse(f.ulpdu).unwrap();
    assert_eq!(h.opcode, RdmapOpcode::Send);
    f.ulpdu[n..].to_vec()
}

/// The connect parameters that reproduce a captured Request.
fn params_of(req: &MpaFrame) -> ConnectParams {
    let e = req.enhanced;
    ConnectParams {
        version: if req.revision == 1 {
            MpaVersion::V1
        } else {
            MpaVersion::V2
        },
        ird: e.map_or(1, |e| e.ird),
        ord: e.map_or(1, |e| e.ord),
        p2p: e.filter(|e| e.peer_to_peer).map(|e| RtrModes {
            send: e.zero_len_send_rtr,
            write: e.zero_len_write_rtr,
            read: e.zero_len_read_rtr,
        }),
        crc: req.flags.crc,
        private_data: req.private_data.clone(),
    }
}

fn all_transmits(c: &mut Cep) -> Vec<u8> {
    std::iter::from_fn(|| c.poll_transmit()).flatten().collect()
}

fn all_events(c: &mut Cep) -> Vec<Event> {
    std::iter::from_fn(|| c.poll_event()).collect()
}

#[test]
fn our_default_request_is_the_kernels() {
    let want = std::fs::read(capture_path("e2-mpa-request.bin")).unwrap();
    let mut a = Cep::active(CepConfig::default());
    a.connect(Instant::now(), &ConnectParams::default())
        .unwrap();
    assert_eq!(all_transmits(&mut a), want);
}

/// Replays one ucmatose connection through both of our endpoints and compares every byte we
/// emit with what siw emitted in the same role.
fn replay_ucmatose(name: &str, p2p: bool, crc: bool) {
    let conns = tcp_streams(name);
    assert_eq!(conns.len(), 1, "{name}");
    let c = &conns[0];
    let now = Instant::now();

    let (req, req_len) = MpaFrame::parse(&c.client).unwrap();
    let (rep, rep_len) = MpaFrame::parse(&c.server).unwrap();
    assert_eq!(req.flags.crc, crc, "{name}: capture not as described");

    // Active side: our Request is the kernel's.
    let mut a = Cep::active(CepConfig::default());
    a.connect(now, &params_of(&req)).unwrap();
    assert_eq!(
        all_transmits(&mut a),
        &c.client[..req_len],
        "{name}: Request"
    );

    // Passive side: fed the kernel's Request, our Reply is the kernel's.
    let mut b = Cep::passive(now, CepConfig::default());
    b.on_bytes(now, &c.client[..req_len]);
    let ev = all_events(&mut b);
    let [Event::ConnectRequest(r)] = &ev[..] else {
        panic!("{name}: {ev:?}")
    };
    assert_eq!(r.p2p.is_some(), p2p);
    b.accept(now, &AcceptParams::default()).unwrap();
    assert_eq!(all_transmits(&mut b), &c.server[..rep_len], "{name}: Reply");
    assert_eq!(
        b.state(),
        if p2p {
            State::ConnRecv
        } else {
            State::Established
        }
    );

    // The kernel's Reply completes our connect; in peer-to-peer mode our RTR follows, equal to
    // the kernel's zero-length Write.
    a.on_bytes(now, &c.server[..rep_len]);
    let ev = all_events(&mut a);
    let [Event::ConnectReply(ConnectReply::Accepted(n))] = &ev[..] else {
        panic!("{name}: {ev:?}")
    };
    assert_eq!((n.revision, n.crc, n.ird, n.ord), (rep.revision, crc, 1, 1));
    let client_fpdus = fpdus(&c.client[req_len..]);
    let server_fpdus = fpdus(&c.server[rep_len..]);
    let mut client_sends = &client_fpdus[..];
    if p2p {
        assert_eq!(n.rtr, Some(RtrKind::Write));
        assert_eq!(all_transmits(&mut a), client_fpdus[0], "{name}: RTR");
        client_sends = &client_fpdus[1..];
    } else {
        assert!(a.poll_transmit().is_none());
    }

    // The rest of each stream: the kernel's Sends reach our endpoints as messages (CRC
    // checked when negotiated), and our Sends of the same payloads are the same bytes.
    for f in &client_fpdus {
        b.on_bytes(now, f);
    }
    let got_b: Vec<Event> = all_events(&mut b);
    if p2p {
        assert!(matches!(got_b[0], Event::Established(ref n) if n.rtr == Some(RtrKind::Write)));
    } else {
        assert!(matches!(got_b[0], Event::Established(_)));
    }
    let want_b: Vec<Event> = client_sends
        .iter()
        .map(|f| Event::Message(send_payload(f)))
        .collect();
    assert_eq!(&got_b[1..], &want_b[..], "{name}");
    for f in &server_fpdus {
        a.on_bytes(now, f);
    }
    let want_a: Vec<Event> = server_fpdus
        .iter()
        .map(|f| Event::Message(send_payload(f)))
        .collect();
    assert_eq!(all_events(&mut a), want_a, "{name}");
    assert_eq!(want_a.len(), 2);

    for f in &server_fpdus {
        b.send(now, &send_payload(f)).unwrap();
        assert_eq!(&all_transmits(&mut b), f, "{name}: server Send");
    }
    for f in client_sends {
        a.send(now, &send_payload(f)).unwrap();
        assert_eq!(&all_transmits(&mut a), f, "{name}: client Send");
    }

    // The server closed first (FIN): our active side reports Disconnect, then Close.
    a.on_tcp_closed(now, true);
    assert_eq!(
        all_events(&mut a),
        vec![Event::Disconnect, Event::Close(CloseReason::Graceful)]
    );
    assert_eq!(a.poll_tcp_action(), Some(TcpAction::Close));
}

#[test]
fn ucmatose_v2_bytes_match_siw() {
    replay_ucmatose("e1-v2-ucmatose.pcap", false, false);
}

#[test]
fn ucmatose_v1_bytes_match_siw() {
    replay_ucmatose("e1-v1-ucmatose.pcap", false, false);
}

#[test]
fn ucmatose_crc_bytes_match_siw() {
    replay_ucmatose("e1-crc-ucmatose.pcap", false, true);
}

#[test]
fn ucmatose_p2p_bytes_match_siw() {
    replay_ucmatose("e1-p2p-ucmatose.pcap", true, false);
}

#[test]
fn reject_bytes_match_siw() {
    let conns = tcp_streams("e1-v2-reject.pcap");
    assert_eq!(conns.len(), 2);
    let now = Instant::now();
    let mut rejected = 0;
    for c in &conns {
        let (req, req_len) = MpaFrame::parse(&c.client).unwrap();
        let (rep, rep_len) = MpaFrame::parse(&c.server).unwrap();
        assert_eq!(rep_len, c.server.len());
        if !rep.flags.reject {
            continue;
        }
        rejected += 1;
        let mut b = Cep::passive(now, CepConfig::default());
        b.on_bytes(now, &c.client[..req_len]);
        assert!(matches!(all_events(&mut b)[..], [Event::ConnectRequest(_)]));
        b.reject(now, &rep.private_data).unwrap();
        assert_eq!(all_transmits(&mut b), c.server, "reject Reply");
        assert_eq!(b.poll_tcp_action(), Some(TcpAction::Close));
        assert_eq!(b.poll_event(), None);

        let mut a = Cep::active(CepConfig::default());
        a.connect(now, &params_of(&req)).unwrap();
        assert_eq!(all_transmits(&mut a), c.client);
        a.on_bytes(now, &c.server);
        assert_eq!(
            all_events(&mut a),
            vec![Event::ConnectReply(ConnectReply::Rejected {
                revision: 2,
                private_data: Vec::new()
            })]
        );
    }
    assert_eq!(rejected, 1);
}

#[test]
fn mpa_reply_timeout_matches_the_kernel() {
    let conns = tcp_streams("e2-mpa-timeout.pcap");
    let c = &conns[0];
    // The kernel sent its Request, heard nothing, and sent a FIN about 10 s later.
    let waited = c
        .first_fin_ts
        .unwrap()
        .checked_sub(c.first_payload_ts.unwrap())
        .unwrap();
    let t0 = Instant::now();
    let mut a = Cep::active(CepConfig::default());
    a.connect(t0, &ConnectParams::default()).unwrap();
    assert_eq!(all_transmits(&mut a), c.client);
    let deadline = a.poll_timeout().unwrap() - t0;
    assert!(
        waited
            .checked_sub(deadline)
            .is_some_and(|d| d < Duration::from_millis(200)),
        "ours {deadline:?}, the kernel's {waited:?}"
    );
    a.on_timer(t0 + deadline);
    assert_eq!(
        all_events(&mut a),
        vec![Event::ConnectReply(ConnectReply::Error(
            ConnectError::Timeout
        ))]
    );
    // A FIN, as the kernel sent.
    assert_eq!(a.poll_tcp_action(), Some(TcpAction::Close));
}
