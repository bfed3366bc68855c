//! `rcm decode` on every shipped capture prints the sequence tshark saw (its one-line
//! summaries, shipped beside each pcap, are the oracle), verifies every CRC, and reports
//! corrupt input as such.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn captures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/captures")
}

mod common;

use common::rcm;

/// Our name for what tshark's Info column says, or None for lines we do not print
/// (bare ACKs) and tshark misdissections.
fn expected_kind(info: &str) -> Option<&'static str> {
    let table: &[(&str, &str)] = &[
        ("CM: ConnectRequest", "REQ"),
        ("CM: ConnectReply", "REP"),
        ("CM: ReadyToUse", "RTU"),
        ("CM: ConnectReject", "REJ"),
        ("CM: MsgRcptAck", "MRA"),
        ("CM: DisconnectRequest", "DREQ"),
        ("CM: DisconnectReply", "DREP"),
        ("CM: ServiceIDResReqResp", "SIDR_REP"),
        ("CM: ServiceIDResReq", "SIDR_REQ"),
        ("RC Send Only", "RC_SEND_ONLY"),
        ("RC Acknowledge", "RC_ACK"),
        ("RC RDMA Read Request", "RC_READ_REQUEST"),
        ("RC RDMA Read Response Only", "RC_READ_RESPONSE_ONLY"),
        ("RC RDMA Write Only", "RC_WRITE_ONLY"),
        ("UD Send Only Immediate", "UD_SEND_ONLY_IMM"),
        ("MPA Request Frame", "MPA_REQ"),
        ("MPA Reply Frame", "MPA_REP"),
        ("DDP/RDMA", ""), // refined below
        ("[SYN, ACK]", "TCP_SYN_ACK"),
        ("[SYN]", "TCP_SYN"),
        ("[FIN, ACK]", "TCP_FIN"),
        ("[RST, ACK]", "TCP_RST"),
    ];
    // tshark 4.0 hands one UD payload of f1-ipv6 to a LAPB heuristic; any kind of ours goes.
    if info.contains("Invalid LAPB frame") {
        return Some("*");
    }
    if info.contains("DDP/RDMA") {
        return Some(if info.contains(" Write ") {
            "FPDU_RDMA_WRITE"
        } else {
            "FPDU_SEND"
        });
    }
    table
        .iter()
        .find(|(k, _)| info.contains(k))
        .map(|(_, v)| *v)
}

fn tshark_view(summary: &Path) -> BTreeMap<usize, &'static str> {
    let text =
        std::fs::read_to_string(summary).unwrap_or_else(|e| panic!("{}: {e}", summary.display()));
    let mut m = BTreeMap::new();
    for line in text.lines() {
        let frame: usize = line.split_whitespace().next().unwrap().parse().unwrap();
        if let Some(k) = expected_kind(line) {
            m.insert(frame, k);
        }
    }
    m
}

fn our_view(pcap: &Path) -> BTreeMap<usize, BTreeSet<String>> {
    let (code, out, err) = rcm(&["decode", pcap.to_str().unwrap()]);
    assert_eq!(code, 0, "{}: exit {code}\n{out}\n{err}", pcap.display());
    assert!(err.contains(" 0 corrupt"), "{err}");
    let mut m = BTreeMap::<usize, BTreeSet<String>>::new();
    for line in out.lines() {
        let mut f = line.split_whitespace();
        let frame: usize = f.next().unwrap().parse().unwrap();
        let kind = f.nth(4).unwrap().to_owned();
        assert!(!line.contains("crc=bad"), "{line}");
        m.entry(frame).or_default().insert(kind);
    }
    m
}

#[test]
fn every_capture_decodes_as_tshark_sees_it() {
    let mut checked = 0;
    for sub in ["roce", "iwarp"] {
        let dir = captures().join(sub);
        let mut pcaps: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "pcap"))
            .collect();
        pcaps.sort();
        for pcap in pcaps {
            let theirs = tshark_view(&pcap.with_extension("summary.txt"));
            let ours = our_view(&pcap);
            for (frame, kind) in &theirs {
                let got = ours.get(frame).cloned().unwrap_or_default();
                assert!(
                    *kind == "*" || got.contains(*kind),
                    "{} frame {frame}: tshark {kind}, we {got:?}",
                    pcap.display()
                );
            }
            for (frame, kinds) in &ours {
                assert!(
                    theirs.contains_key(frame),
                    "{}: frame {frame} {kinds:?} unknown to tshark",
                    pcap.display()
                );
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 12, "expected 5 RoCE and 7 iWARP captures");
}

#[test]
fn mra_capture_prints_the_expected_sequence() {
    let (code, out, _) = rcm(&[
        "decode",
        captures().join("roce/f1-mra.pcap").to_str().unwrap(),
    ]);
    assert_eq!(code, 0);
    let kinds: Vec<&str> = out
        .lines()
        .map(|l| l.split_whitespace().nth(5).unwrap())
        .filter(|k| !k.starts_with("RC_"))
        .collect();
    assert_eq!(kinds, ["REQ", "REQ", "MRA", "REP", "RTU", "DREQ", "DREP"]);
    assert!(out.contains("mraed=Req service_timeout=24"), "{out}");
}

#[test]
fn json_lines_carry_every_field() {
    let (code, out, _) = rcm(&[
        "decode",
        "--json",
        captures().join("roce/c1-veth2.pcap").to_str().unwrap(),
    ]);
    assert_eq!(code, 0);
    let recs: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(recs.len(), 19);
    let rej = recs.iter().find(|r| r["type"] == "REJ").unwrap();
    assert_eq!(rej["detail"]["msg"]["reason"], "InvalidServiceId");
    assert_eq!(rej["summary"]["reason"], "8(InvalidServiceId)");
    let req = &recs[0];
    assert_eq!(req["type"], "REQ");
    assert_eq!(req["crc"], "ok");
    assert_eq!(req["summary"]["ps"], "tcp");
    assert_eq!(req["summary"]["cma"], "198.18.2.1:56349>198.18.2.2");
}

#[test]
fn verbose_lists_every_field() {
    let (code, out, _) = rcm(&[
        "decode",
        "-v",
        captures().join("roce/c1-veth2.pcap").to_str().unwrap(),
    ]);
    assert_eq!(code, 0);
    for field in [
        "msg.primary_path.flow_label = 705714 (0xac4b2)",
        "msg.local_qpn = 17 (0x11)",
        "msg.max_cm_retries = 15",
    ] {
        assert!(out.contains(field), "missing {field}");
    }
}

/// Flips bytes in a copy of a capture and checks the damage is reported, not crashed on.
#[test]
fn corrupt_packets_are_reported() {
    let src = std::fs::read(captures().join("roce/c1-veth2.pcap")).unwrap();
    let dir = std::env::temp_dir().join(format!("rcm-decode-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Frame 1 record starts after the 24-byte file header and a 16-byte record header; its
    // MAD data (the REQ's local QPN) lies at frame offset 14 + 20 + 8 + 12 + 8 + 24 + 32.
    let mut bad = src.clone();
    bad[24 + 16 + 14 + 20 + 8 + 12 + 8 + 24 + 32] ^= 0xFF;
    let p = dir.join("bad-icrc.pcap");
    std::fs::write(&p, &bad).unwrap();
    let (code, out, err) = rcm(&["decode", p.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}{err}");
    let first = out.lines().next().unwrap();
    assert!(
        first.contains("REQ") && first.contains("crc=bad") && first.contains("bad ICRC"),
        "{first}"
    );
    assert!(err.contains(" 1 corrupt"), "{err}");

    // A MAD whose class byte is wrong: reported MALFORMED (and its ICRC is bad too).
    let mut bad = src.clone();
    bad[24 + 16 + 14 + 20 + 8 + 12 + 8 + 1] = 0x04;
    std::fs::write(&p, &bad).unwrap();
    let (code, out, _) = rcm(&["decode", p.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(out.lines().next().unwrap().contains("MALFORMED"), "{out}");

    // A file cut in the middle of a record: what came before is decoded, a warning says so,
    // and the status is not a clean 0 (the last frame was not decoded).
    std::fs::write(&p, &src[..src.len() - 100]).unwrap();
    let (code, out, err) = rcm(&["decode", p.to_str().unwrap()]);
    assert_eq!(code, 1, "{err}");
    assert_eq!(out.lines().count(), 18);
    assert!(err.contains("warning"), "{err}");

    // Not a capture at all.
    std::fs::write(&p, b"this is not a pcap file at all").unwrap();
    let (code, _, err) = rcm(&["decode", p.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(err.starts_with("rcm decode: "), "{err}");
    let (code, _, err) = rcm(&["decode", "/nonexistent/x.pcap"]);
    assert_eq!(code, 2);
    assert!(err.contains("/nonexistent/x.pcap"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A run of REPs that `rcm bench --listen` sent in one segmented send (`UDP_SEGMENT`),
/// captured on the sending host's veth before the kernel cut it (the Linux kernel's rxe
/// accepted every REP): decode shows each REP with its ICRC verified for the IP header the
/// kernel gave it; a run with one REP damaged is one corrupt frame, not 25 messages.
#[test]
fn a_segmented_send_captured_before_it_was_cut_decodes_as_its_datagrams() {
    let run =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/segmented/rep-run.pcap");
    let (code, out, err) = rcm(&["decode", run.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    let frame = |n: &str| -> Vec<&str> {
        out.lines()
            .filter(|l| l.split_whitespace().next() == Some(n))
            .collect()
    };
    let first = frame("1");
    assert_eq!(first.len(), 25, "{out}");
    for (k, l) in first.iter().enumerate() {
        assert!(l.contains(" REP ") && l.contains("crc=ok"), "{l}");
        assert!(l.contains(&format!("segment={}/25", k + 1)), "{l}");
    }
    assert_eq!(frame("2").len(), 2);
    assert_eq!(frame("3").len(), 1);
    assert!(!frame("3")[0].contains("segment="));
    assert!(err.contains("28 messages, 0 corrupt"), "{err}");

    // One byte of the third REP's MAD changed: the frame is one corrupt record.
    let mut bad = std::fs::read(&run).unwrap();
    // pcap header 24, record header 16, Ethernet 14, IPv4 20, UDP 8, two datagrams 560,
    // then into the third one's BTH+DETH (20) and MAD.
    bad[24 + 16 + 14 + 20 + 8 + 2 * 280 + 20 + 40] ^= 0xFF;
    let dir = std::env::temp_dir().join(format!("rcm-decode-seg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("bad-run.pcap");
    std::fs::write(&p, &bad).unwrap();
    let (code, out, err) = rcm(&["decode", p.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}{err}");
    let first: Vec<&str> = out
        .lines()
        .filter(|l| l.split_whitespace().next() == Some("1"))
        .collect();
    assert_eq!(first.len(), 1, "{out}");
    assert!(first[0].contains("crc=bad"), "{}", first[0]);
    assert!(err.contains(" 1 corrupt"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The pcap records of `file` (global header, then each record with its 16-byte header).
fn pcap_records(bytes: &[u8]) -> (Vec<u8>, Vec<Vec<u8>>) {
    let mut at = 24;
    let mut recs = Vec::new();
    while at + 16 <= bytes.len() {
        let caplen = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap()) as usize;
        recs.push(bytes[at..at + 16 + caplen].to_vec());
        at += 16 + caplen;
    }
    (bytes[..24].to_vec(), recs)
}

/// FPDUs captured before the peer's MPA frame they depend on (the P2P RTR ahead of the
/// Reply it answers) wait, and are decoded once that frame is: they were held and never
/// printed.
#[test]
fn fpdus_captured_before_the_peers_frame_are_decoded_after_it() {
    let bytes = std::fs::read(captures().join("iwarp/e1-p2p-ucmatose.pcap")).unwrap();
    let (head, mut recs) = pcap_records(&bytes);
    // Frame 8 (the RTR, a zero-length RDMA Write) moves ahead of frame 6 (the MPA Reply),
    // and the capture ends at frame 11: nothing later on the RTR's direction decodes it.
    recs.truncate(11);
    let rtr = recs.remove(7);
    recs.insert(5, rtr);
    let path = std::env::temp_dir().join(format!("rcm-rtr-first-{}.pcap", std::process::id()));
    std::fs::write(&path, [head, recs.concat()].concat()).unwrap();
    let (code, out, err) = rcm(&["decode", path.to_str().unwrap()]);
    let _ = std::fs::remove_file(&path);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("MPA_REP"), "{out}");
    assert!(
        out.contains("FPDU_RDMA_WRITE"),
        "the early RTR was decoded: {out}"
    );
    assert_eq!(out.matches("FPDU_SEND").count(), 2, "{out}");
}
