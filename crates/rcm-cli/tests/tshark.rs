//! tshark cross-check: for every message type tshark 4.0 dissects, build messages with our
//! encoder (seeded random field values), write them into a pcap, run `tshark -T fields` on it
//! and compare each field with what we put in, allowing for the dissector quirks listed in
//! wire-formats.md §6.3. Message types tshark only names (MRA, SIDR_REQ, SIDR_REP, LAP, APR,
//! ClassPortInfo) are checked by name and attribute ID, and decoded back with `rcm decode`.
//!
//! Without tshark the tests are skipped with a loud message on stderr, unless
//! `RCM_REQUIRE_TSHARK=1` is set (CI sets it), in which case they fail. `TSHARK=/path` picks
//! the binary; `RCM_TSHARK_KEEP=1` keeps the generated pcaps (under the temp directory) for
//! a look in Wireshark.

mod tshark_harness;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rcm_cli::netbuild::{ethernet_ip, ipv4_udp, ipv6_udp, TcpFlowBuilder};
use rcm_wire::cm::{
    ApStatus, Apr, ClassPortInfo, CmMad, CmMessage, Drep, Dreq, Lap, LapPath, Mra, MsgCode, Rej,
    RejReason, Rep, Req, ReqPath, Rtu, SidrRep, SidrReq, SidrStatus, TransportType,
};
use rcm_wire::cma::{self, CmaHdr, PortSpace};
use rcm_wire::mpa::{self, MpaFrame, Terminate};
use rcm_wire::roce::{emit_gsi, IpForIcrc, GSI_QKEY, ROCE_V2_UDP_PORT};
use rcm_wire::Gid;
use std::fmt::{Display, Write as _};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use tshark_harness::{hex, parse_num, write_pcap, Row, Tshark};

/// Random messages per message type.
const PER_TYPE: usize = 20;
/// REQs over IPv6 (in addition to the IPv4 ones).
const REQ_V6: usize = 5;
/// The iWARP listener port (rdma_cm's default; 4420 would be dissected as NVMe/TCP).
const IWARP_PORT: u16 = 7471;

// =============================================================================================
// tshark harness
// =============================================================================================

/// Heuristic sub-dissectors that could claim CM private data, RoCE or DDP payloads (tshark
/// 4.0 short names). Any the installed tshark does not know are dropped at start-up, since
/// tshark refuses unknown names.
const NOISY_HEURISTICS: &[&str] = &[
    "rpcrdma_iwarp",
    "rpcrdma_infiniband",
    "nvme_rdma",
    "nvme_rdma_cm_private",
    "iser_infiniband",
    "iser_ib_private",
    "smb_direct_iwarp",
    "smb_direct_infiniband",
    "lnet_ib",
    "lnet_ib_cm_private",
    "sdp_infiniband",
    "sdp_ib_private",
    "smcr_infiniband",
    "mellanox_eoib",
    "drbd_rdma",
];

/// The installed tshark (see `tshark_harness::tshark`).
fn tshark(test: &str) -> Option<&'static Tshark> {
    tshark_harness::tshark(test, NOISY_HEURISTICS)
}

// =============================================================================================
// Comparing tshark's fields with what we encoded
// =============================================================================================

/// `v` zero-padded to `len`: the private-data areas carry no length, tshark shows them whole.
fn padded(v: &[u8], len: usize) -> Vec<u8> {
    let mut p = v.to_vec();
    p.resize(len, 0);
    p
}

fn show_num(v: u64) -> String {
    format!("{v} ({v:#x})")
}

/// Collects every mismatch of a test, then fails once with all of them.
#[derive(Default)]
struct Mismatches(Vec<String>);

impl Mismatches {
    fn frame<'a>(&'a mut self, row: &'a Row, what: impl Display) -> FrameCheck<'a> {
        FrameCheck {
            row,
            ctx: format!("{what} (frame {})", row.frame),
            out: &mut self.0,
        }
    }

    fn push(&mut self, msg: String) {
        self.0.push(msg);
    }

    fn finish(self, test: &str, t: &Tshark) {
        assert!(
            self.0.is_empty(),
            "{test}: {} field(s) differ between our encoder and {}:\n  {}",
            self.0.len(),
            t.version_line,
            self.0.join("\n  ")
        );
    }
}

struct FrameCheck<'a> {
    row: &'a Row,
    ctx: String,
    out: &'a mut Vec<String>,
}

impl FrameCheck<'_> {
    fn fail(&mut self, field: &str, expected: &str, actual: &str) {
        let actual = if actual.is_empty() {
            "nothing (field absent)".to_owned()
        } else {
            format!("{actual:?}")
        };
        self.out.push(format!(
            "{}: {field}: expected {expected}, tshark shows {actual}",
            self.ctx
        ));
    }

    /// The field's single value equals `expected`.
    fn num(&mut self, field: &str, expected: impl Into<u64>) {
        let expected = expected.into();
        let actual = self.row.get(field).to_owned();
        if parse_num(&actual) != Some(expected) {
            self.fail(field, &show_num(expected), &actual);
        }
    }

    /// The field's single value is one of `allowed` (a tshark quirk, explained in `why`).
    fn num_any(&mut self, field: &str, allowed: &[u64], why: &str) {
        let actual = self.row.get(field).to_owned();
        if !parse_num(&actual).is_some_and(|v| allowed.contains(&v)) {
            let exp: Vec<String> = allowed.iter().map(|v| show_num(*v)).collect();
            self.fail(field, &format!("{} [{why}]", exp.join(" or ")), &actual);
        }
    }

    /// Every occurrence of the field, in order, equals `expected`.
    fn nums(&mut self, field: &str, expected: &[u64]) {
        let actual = self.row.get(field).to_owned();
        let got: Vec<Option<u64>> = if actual.is_empty() {
            Vec::new()
        } else {
            actual.split(',').map(parse_num).collect()
        };
        let want: Vec<Option<u64>> = expected.iter().copied().map(Some).collect();
        if got != want {
            let exp: Vec<String> = expected.iter().map(|v| show_num(*v)).collect();
            self.fail(field, &format!("[{}]", exp.join(", ")), &actual);
        }
    }

    /// A bytes field, shown by tshark as plain lower-case hex.
    fn bytes(&mut self, field: &str, expected: &[u8]) {
        let actual = self.row.get(field).to_owned();
        let want = hex(expected);
        if actual.replace(':', "").to_ascii_lowercase() != want {
            self.fail(field, &format!("{} bytes {want}", expected.len()), &actual);
        }
    }

    /// Every occurrence of a bytes field, in order.
    fn bytes_each(&mut self, field: &str, expected: &[&[u8]]) {
        let actual = self.row.get(field).to_owned();
        let want: Vec<String> = expected.iter().map(|b| hex(b)).collect();
        let got: Vec<String> = if actual.is_empty() {
            Vec::new()
        } else {
            actual
                .split(',')
                .map(|s| s.replace(':', "").to_ascii_lowercase())
                .collect()
        };
        if got != want {
            self.fail(field, &format!("[{}]", want.join(", ")), &actual);
        }
    }

    /// An address field (IPv4 dotted or IPv6 text).
    fn ip(&mut self, field: &str, expected: impl Into<IpAddr>) {
        let expected = expected.into();
        let actual = self.row.get(field).to_owned();
        if actual.parse::<IpAddr>().ok() != Some(expected) {
            self.fail(field, &expected.to_string(), &actual);
        }
    }

    /// The field's text contains `needle` (and, if given, not `unless`).
    fn contains(&mut self, field: &str, needle: &str, unless: Option<&str>) {
        let actual = self.row.get(field).to_owned();
        let ok = actual.contains(needle) && unless.is_none_or(|u| !actual.contains(u));
        if !ok {
            let mut exp = format!("text containing {needle:?}");
            if let Some(u) = unless {
                let _ = write!(exp, " but not {u:?}");
            }
            self.fail(field, &exp, &actual);
        }
    }

    /// The field is absent.
    fn absent(&mut self, field: &str) {
        let actual = self.row.get(field).to_owned();
        if !actual.is_empty() {
            self.fail(field, "no such field", &actual);
        }
    }
}

// =============================================================================================
// Random values and RoCEv2 frames
// =============================================================================================

fn bits(rng: &mut StdRng, n: u32) -> u32 {
    rng.gen::<u32>() & ((1u32 << n) - 1)
}

fn bits8(rng: &mut StdRng, n: u32) -> u8 {
    bits(rng, n) as u8
}

fn random_bytes(rng: &mut StdRng, max: usize) -> Vec<u8> {
    let len = rng.gen_range(0..=max);
    let mut v = vec![0u8; len];
    rng.fill(&mut v[..]);
    v
}

/// An address in 198.18.0.0/15 (the benchmarking range: nothing here is ever sent).
fn random_v4(rng: &mut StdRng) -> Ipv4Addr {
    Ipv4Addr::from(0xC612_0000 | (rng.gen::<u32>() & 0x1_FFFF))
}

/// An address in 2001:2::/48 (the IPv6 benchmarking range).
fn random_v6(rng: &mut StdRng) -> Ipv6Addr {
    Ipv6Addr::from((0x2001_0002_0000u128 << 80) | (rng.gen::<u128>() & ((1u128 << 80) - 1)))
}

fn random_gid(rng: &mut StdRng) -> Gid {
    Gid(rng.gen())
}

const MAC_A: [u8; 6] = [0x02, 0x52, 0x43, 0x4d, 0x00, 0x01];
const MAC_B: [u8; 6] = [0x02, 0x52, 0x43, 0x4d, 0x00, 0x02];

/// One CM MAD as we sent it in a RoCEv2 frame.
struct SentMad {
    src: IpAddr,
    dst: IpAddr,
    sport: u16,
    psn: u32,
    mad: CmMad,
    frame: Vec<u8>,
}

impl SentMad {
    /// The ICRC as tshark shows it: the last 4 wire bytes read big-endian (§6.3-1).
    fn icrc_shown(&self) -> u32 {
        let n = self.frame.len();
        u32::from_be_bytes(self.frame[n - 4..].try_into().expect("4 bytes"))
    }

    fn body(&self) -> Vec<u8> {
        self.mad.emit().expect("emit MAD")[24..].to_vec()
    }
}

/// Builds the Ethernet frame of `mad` sent from `src` to `dst` over RoCEv2 (random source
/// port, PSN, TOS, TTL, IPv4 ID; the ICRC computed for exactly that IP header).
fn roce_frame(rng: &mut StdRng, src: IpAddr, dst: IpAddr, mad: CmMad) -> SentMad {
    let sport = rng.gen_range(0xC000..=0xFFFF);
    let psn = bits(rng, 24);
    let bytes = mad
        .emit()
        .unwrap_or_else(|e| panic!("our encoder refused {mad:?}: {e}"));
    let packet = match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let ident = rng.gen();
            let ip = IpForIcrc::V4 {
                src: s,
                dst: d,
                ident,
                dont_fragment: true,
            };
            let udp = emit_gsi(&ip, sport, psn, &bytes);
            ipv4_udp(
                s,
                d,
                sport,
                ROCE_V2_UDP_PORT,
                rng.gen(),
                rng.gen_range(1..=255),
                ident,
                &udp,
            )
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let udp = emit_gsi(&IpForIcrc::V6 { src: s, dst: d }, sport, psn, &bytes);
            ipv6_udp(
                s,
                d,
                sport,
                ROCE_V2_UDP_PORT,
                rng.gen(),
                bits(rng, 20),
                rng.gen_range(1..=255),
                &udp,
            )
        }
        _ => panic!("test bug: mixed address families"),
    };
    SentMad {
        src,
        dst,
        sport,
        psn,
        mad,
        frame: ethernet_ip(MAC_A, MAC_B, &packet),
    }
}

fn random_endpoints(rng: &mut StdRng, v6: bool) -> (IpAddr, IpAddr) {
    if v6 {
        (random_v6(rng).into(), random_v6(rng).into())
    } else {
        (random_v4(rng).into(), random_v4(rng).into())
    }
}

/// A CM Send MAD with a random TID and attribute modifier (ECE bits), as REQ/REP carry them.
fn random_mad(rng: &mut StdRng, msg: CmMessage) -> CmMad {
    let mut mad = CmMad::send(rng.gen(), msg);
    mad.header.attr_mod = rng.gen();
    mad
}

fn frames_of(sent: &[&SentMad]) -> Vec<(Duration, Vec<u8>)> {
    sent.iter()
        .zip(0u64..)
        .map(|(s, i)| {
            (
                Duration::from_secs(1_700_000_000) + Duration::from_millis(i * 3),
                s.frame.clone(),
            )
        })
        .collect()
}

/// Fields every RoCEv2 CM frame is checked on.
const ROCE_FIELDS: &[&str] = &[
    "_ws.col.Info",
    "_ws.malformed",
    "ip.src",
    "ip.dst",
    "ipv6.src",
    "ipv6.dst",
    "udp.srcport",
    "udp.dstport",
    "udp.length",
    "infiniband.bth.opcode",
    "infiniband.bth.se",
    "infiniband.bth.m",
    "infiniband.bth.padcnt",
    "infiniband.bth.tver",
    "infiniband.bth.p_key",
    "infiniband.bth.destqp",
    "infiniband.bth.a",
    "infiniband.bth.psn",
    "infiniband.deth.q_key",
    "infiniband.deth.srcqp",
    "infiniband.invariant.crc",
    "infiniband.mad.baseversion",
    "infiniband.mad.mgmtclass",
    "infiniband.mad.classversion",
    "infiniband.mad.method",
    "infiniband.mad.status",
    "infiniband.mad.classspecific",
    "infiniband.mad.transactionid",
    "infiniband.mad.attributeid",
    "infiniband.mad.attributemodifier",
];

/// Runs tshark on the frames with the common fields plus `extra`, checks the common ones and
/// returns the rows (one per sent MAD, in order).
fn tshark_roce(
    t: &Tshark,
    tag: &str,
    sent: &[&SentMad],
    extra: &[&str],
    m: &mut Mismatches,
) -> Vec<Row> {
    let file = write_pcap(tag, &frames_of(sent));
    let mut fields: Vec<&str> = ROCE_FIELDS.to_vec();
    fields.extend_from_slice(extra);
    let rows = t.fields(file.path(), &fields, false);
    assert_eq!(
        rows.len(),
        sent.len(),
        "{tag}: tshark printed {} frames, we wrote {}",
        rows.len(),
        sent.len()
    );
    for (i, (row, s)) in rows.iter().zip(sent).enumerate() {
        let name = s.mad.msg.name();
        let mut c = m.frame(row, format_args!("{name} #{i}"));
        check_roce_common(&mut c, s);
    }
    rows
}

fn check_roce_common(c: &mut FrameCheck<'_>, s: &SentMad) {
    c.absent("_ws.malformed");
    let (src, dst) = if s.src.is_ipv4() {
        ("ip.src", "ip.dst")
    } else {
        ("ipv6.src", "ipv6.dst")
    };
    c.ip(src, s.src);
    c.ip(dst, s.dst);
    c.num("udp.srcport", s.sport);
    c.num("udp.dstport", ROCE_V2_UDP_PORT);
    c.num("udp.length", 288u16);
    c.num("infiniband.bth.opcode", 100u8);
    c.num("infiniband.bth.se", 0u8);
    c.num("infiniband.bth.m", 0u8);
    c.num("infiniband.bth.padcnt", 0u8);
    c.num("infiniband.bth.tver", 0u8);
    c.num("infiniband.bth.p_key", 0xFFFFu16);
    c.num("infiniband.bth.destqp", 1u8);
    // AckReq set, as rxe sends every MAD on QP1 (see rcm-wire's bth_of_a_gsi_datagram).
    c.num("infiniband.bth.a", 1u8);
    c.num("infiniband.bth.psn", s.psn);
    c.num("infiniband.deth.q_key", GSI_QKEY);
    c.num("infiniband.deth.srcqp", 1u8);
    c.num("infiniband.invariant.crc", s.icrc_shown());
    let h = &s.mad.header;
    c.num("infiniband.mad.baseversion", h.base_version);
    c.num("infiniband.mad.mgmtclass", h.mgmt_class);
    c.num("infiniband.mad.classversion", h.class_version);
    c.num("infiniband.mad.method", h.method);
    c.num("infiniband.mad.status", h.status);
    c.num("infiniband.mad.classspecific", h.class_specific);
    c.num("infiniband.mad.transactionid", h.tid);
    c.num("infiniband.mad.attributeid", s.mad.msg.attr_id());
    c.num("infiniband.mad.attributemodifier", h.attr_mod);
}

// =============================================================================================
// REQ
// =============================================================================================

fn random_req_path(rng: &mut StdRng, local_gid: Gid, remote_gid: Gid, primary: bool) -> ReqPath {
    ReqPath {
        local_lid: rng.gen(),
        remote_lid: rng.gen(),
        local_gid,
        remote_gid,
        flow_label: bits(rng, 20),
        reserved0: 0,
        packet_rate: bits8(rng, 6),
        traffic_class: rng.gen(),
        hop_limit: rng.gen(),
        sl: bits8(rng, 4),
        subnet_local: rng.gen(),
        reserved1: 0,
        local_ack_timeout: bits8(rng, 5),
        sap_supported: !primary && rng.gen(),
        reserved2: 0,
    }
}

struct SentReq {
    sent: SentMad,
    req: Req,
    cma: CmaHdr,
    port: u16,
    user: Vec<u8>,
}

fn random_req(rng: &mut StdRng, v6: bool) -> SentReq {
    let (src, dst) = random_endpoints(rng, v6);
    let port = rng.gen();
    let cma = CmaHdr {
        src_port: rng.gen(),
        src,
        dst,
    };
    let user = random_bytes(rng, cma::limits::CONNECT);
    let req = Req {
        local_comm_id: rng.gen(),
        reserved0: 0,
        vendor_id: bits(rng, 24),
        service_id: cma::service_id(PortSpace::Tcp, port),
        local_ca_guid: rng.gen(),
        reserved1: 0,
        local_qkey: rng.gen(),
        local_qpn: bits(rng, 24),
        responder_resources: rng.gen(),
        local_eecn: bits(rng, 24),
        initiator_depth: rng.gen(),
        remote_eecn: bits(rng, 24),
        remote_cm_response_timeout: bits8(rng, 5),
        transport_type: TransportType::from_raw_value(bits8(rng, 2)),
        end_to_end_flow_control: rng.gen(),
        starting_psn: bits(rng, 24),
        local_cm_response_timeout: bits8(rng, 5),
        retry_count: bits8(rng, 3),
        pkey: rng.gen(),
        path_mtu: bits8(rng, 4),
        rdc_exists: rng.gen(),
        rnr_retry_count: bits8(rng, 3),
        max_cm_retries: bits8(rng, 4),
        srq: rng.gen(),
        extended_transport_type: bits8(rng, 3),
        private_data: cma
            .with_user_data(&user, cma::limits::CONNECT)
            .expect("cma_hdr"),
        primary_path: random_req_path(rng, Gid::from_ip(src), Gid::from_ip(dst), true),
        alternate_path: {
            let (l, r) = (random_gid(rng), random_gid(rng));
            random_req_path(rng, l, r, false)
        },
    };
    let mad = random_mad(rng, CmMessage::Req(req.clone()));
    SentReq {
        sent: roce_frame(rng, src, dst, mad),
        req,
        cma,
        port,
        user,
    }
}

const REQ_FIELDS: &[&str] = &[
    "infiniband.cm.req",
    "infiniband.cm.req.serviceid",
    "infiniband.cm.req.serviceid.prefix",
    "infiniband.cm.req.serviceid.protocol",
    "infiniband.cm.req.serviceid.dport",
    "infiniband.cm.req.localcaguid",
    "infiniband.cm.req.localqkey",
    "infiniband.cm.req.localqpn",
    "infiniband.cm.req.responderres",
    "infiniband.cm.req.localeecn",
    "infiniband.cm.req.initdepth",
    "infiniband.cm.req.remoteeecn",
    "infiniband.cm.req.remoteresptout",
    "infiniband.cm.req.transpsvctype",
    "infiniband.cm.req.e2eflowctrl",
    "infiniband.cm.req.startpsn",
    "infiniband.cm.req.localresptout",
    "infiniband.cm.req.retrcount",
    "infiniband.cm.req.pkey",
    "infiniband.cm.req.pppmtu",
    "infiniband.cm.req.rdcexist",
    "infiniband.cm.req.rnrretrcount",
    "infiniband.cm.req.maxcmretr",
    "infiniband.cm.req.srq",
    "infiniband.cm.req.ext_transport",
    "infiniband.cm.req.prim_locallid",
    "infiniband.cm.req.prim_remotelid",
    "infiniband.cm.req.prim_localgid",
    "infiniband.cm.req.prim_remotegid",
    "infiniband.cm.req.prim_localgid_ipv4",
    "infiniband.cm.req.prim_remotegid_ipv4",
    "infiniband.cm.req.prim_flowlabel",
    "infiniband.cm.req.prim_pktrate",
    "infiniband.cm.req.prim_tfcclass",
    "infiniband.cm.req.prim_hoplim",
    "infiniband.cm.req.prim_sl",
    "infiniband.cm.req.prim_subnetlocal",
    "infiniband.cm.req.prim_localacktout",
    "infiniband.cm.req.alt_locallid",
    "infiniband.cm.req.alt_remotelid",
    "infiniband.cm.req.alt_localgid",
    "infiniband.cm.req.alt_remotegid",
    "infiniband.cm.req.alt_flowlabel",
    "infiniband.cm.req.alt_pktrate",
    "infiniband.cm.req.alt_tfcclass",
    "infiniband.cm.req.alt_hoplim",
    "infiniband.cm.req.alt_sl",
    "infiniband.cm.req.alt_subnetlocal",
    "infiniband.cm.req.alt_localacktout",
    "infiniband.cm.req.private",
    "infiniband.cm.req.ip_cm.majv",
    "infiniband.cm.req.ip_cm.minv",
    "infiniband.cm.req.ip_cm.ipv",
    "infiniband.cm.req.ip_cm.sport",
    "infiniband.cm.req.ip_cm.sip4",
    "infiniband.cm.req.ip_cm.dip4",
    "infiniband.cm.req.ip_cm.sip6",
    "infiniband.cm.req.ip_cm.dip6",
    "infiniband.cm.req.ip_cm.private",
];

/// A REQ path as tshark 4.0 reads it; `prefix` is "prim" or "alt", `over_v4` the outer family.
fn check_req_path(c: &mut FrameCheck<'_>, t: &Tshark, prefix: &str, p: &ReqPath, over_v4: bool) {
    let f = |name: &str| format!("infiniband.cm.req.{prefix}_{name}");
    c.num(&f("locallid"), p.local_lid);
    c.num(&f("remotelid"), p.remote_lid);
    if prefix == "alt" {
        // Alternate GIDs are plain bytes whatever the outer header.
        c.bytes(&f("localgid"), &p.local_gid.0);
        c.bytes(&f("remotegid"), &p.remote_gid.0);
    } else if over_v4 {
        // §6.3-5: under an IPv4 outer header only GID bytes 12..15 are shown.
        let v4 = |g: Gid| Ipv4Addr::new(g.0[12], g.0[13], g.0[14], g.0[15]);
        c.ip(&f("localgid_ipv4"), v4(p.local_gid));
        c.ip(&f("remotegid_ipv4"), v4(p.remote_gid));
    } else {
        c.ip(&f("localgid"), Ipv6Addr::from(p.local_gid.0));
        c.ip(&f("remotegid"), Ipv6Addr::from(p.remote_gid.0));
    }
    // §6.3-2: the flow label is read from a 3-byte item with mask 0xFFFFF000 (its top 12 bits
    // only), the packet rate from the first byte of that word, masked with 0x3F.
    let fl = u64::from(p.flow_label);
    let fl_quirk = fl >> 8;
    let rate_quirk = (fl >> 12) & 0x3F;
    let rate = u64::from(p.packet_rate);
    if t.is_4_0() {
        c.num_any(
            &f("flowlabel"),
            &[fl_quirk],
            "tshark 4.0 shows the top 12 bits, §6.3-2",
        );
        c.num_any(
            &f("pktrate"),
            &[rate_quirk],
            "tshark 4.0 reads byte 88/132 & 0x3F, §6.3-2",
        );
    } else {
        c.num_any(
            &f("flowlabel"),
            &[fl_quirk, fl],
            "4.0 quirk §6.3-2 or fixed",
        );
        c.num_any(
            &f("pktrate"),
            &[rate_quirk, rate],
            "4.0 quirk §6.3-2 or fixed",
        );
    }
    c.num(&f("tfcclass"), p.traffic_class);
    c.num(&f("hoplim"), p.hop_limit);
    c.num(&f("sl"), p.sl);
    c.num(&f("subnetlocal"), p.subnet_local);
    c.num(&f("localacktout"), p.local_ack_timeout);
}

#[test]
fn req_fields_match_tshark() {
    let Some(t) = tshark("req_fields_match_tshark") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(0x5245_5100);
    let mut sent: Vec<SentReq> = (0..PER_TYPE).map(|_| random_req(&mut rng, false)).collect();
    sent.extend((0..REQ_V6).map(|_| random_req(&mut rng, true)));
    let mut m = Mismatches::default();
    let mads: Vec<&SentMad> = sent.iter().map(|s| &s.sent).collect();
    let rows = tshark_roce(t, "req", &mads, REQ_FIELDS, &mut m);
    for (i, (row, s)) in rows.iter().zip(&sent).enumerate() {
        let over_v4 = s.sent.src.is_ipv4();
        let r = &s.req;
        let mut c = m.frame(
            row,
            format_args!("REQ #{i} ({})", if over_v4 { "IPv4" } else { "IPv6" }),
        );
        c.contains("_ws.col.Info", "ConnectRequest", None);
        // §6.3-3: the REQ's Local Communication ID is `infiniband.cm.req` itself.
        c.num("infiniband.cm.req", r.local_comm_id);
        c.num("infiniband.cm.req.serviceid", r.service_id);
        c.bytes("infiniband.cm.req.serviceid.prefix", &[0, 0, 0, 0, 1]);
        c.num("infiniband.cm.req.serviceid.protocol", 0x06u8);
        c.num("infiniband.cm.req.serviceid.dport", s.port);
        c.num("infiniband.cm.req.localcaguid", r.local_ca_guid);
        c.num("infiniband.cm.req.localqkey", r.local_qkey);
        c.num("infiniband.cm.req.localqpn", r.local_qpn);
        c.num("infiniband.cm.req.responderres", r.responder_resources);
        c.num("infiniband.cm.req.localeecn", r.local_eecn);
        c.num("infiniband.cm.req.initdepth", r.initiator_depth);
        c.num("infiniband.cm.req.remoteeecn", r.remote_eecn);
        c.num(
            "infiniband.cm.req.remoteresptout",
            r.remote_cm_response_timeout,
        );
        c.num("infiniband.cm.req.transpsvctype", r.transport_type.raw());
        c.num("infiniband.cm.req.e2eflowctrl", r.end_to_end_flow_control);
        c.num("infiniband.cm.req.startpsn", r.starting_psn);
        c.num(
            "infiniband.cm.req.localresptout",
            r.local_cm_response_timeout,
        );
        c.num("infiniband.cm.req.retrcount", r.retry_count);
        c.num("infiniband.cm.req.pkey", r.pkey);
        c.num("infiniband.cm.req.pppmtu", r.path_mtu);
        c.num("infiniband.cm.req.rdcexist", r.rdc_exists);
        c.num("infiniband.cm.req.rnrretrcount", r.rnr_retry_count);
        c.num("infiniband.cm.req.maxcmretr", r.max_cm_retries);
        c.num("infiniband.cm.req.srq", r.srq);
        c.num("infiniband.cm.req.ext_transport", r.extended_transport_type);
        check_req_path(&mut c, t, "prim", &r.primary_path, over_v4);
        check_req_path(&mut c, t, "alt", &r.alternate_path, over_v4);
        // An IP CM service ID: the private data is decoded as the cma_hdr, not shown raw.
        c.absent("infiniband.cm.req.private");
        c.num("infiniband.cm.req.ip_cm.majv", 0u8);
        c.num("infiniband.cm.req.ip_cm.minv", 0u8);
        c.num("infiniband.cm.req.ip_cm.ipv", if over_v4 { 4u8 } else { 6 });
        c.num("infiniband.cm.req.ip_cm.sport", s.cma.src_port);
        if over_v4 {
            c.ip("infiniband.cm.req.ip_cm.sip4", s.cma.src);
            c.ip("infiniband.cm.req.ip_cm.dip4", s.cma.dst);
            c.absent("infiniband.cm.req.ip_cm.sip6");
        } else {
            c.ip("infiniband.cm.req.ip_cm.sip6", s.cma.src);
            c.ip("infiniband.cm.req.ip_cm.dip6", s.cma.dst);
            c.absent("infiniband.cm.req.ip_cm.sip4");
        }
        c.bytes(
            "infiniband.cm.req.ip_cm.private",
            &padded(&s.user, cma::limits::CONNECT),
        );
    }
    m.finish("REQ", t);
}

// =============================================================================================
// REP, RTU, REJ, DREQ, DREP
// =============================================================================================

#[test]
fn rep_fields_match_tshark() {
    let Some(t) = tshark("rep_fields_match_tshark") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(0x5245_5000);
    let mut reps = Vec::new();
    let mut sent = Vec::new();
    for _ in 0..PER_TYPE {
        let rep = Rep {
            local_comm_id: rng.gen(),
            remote_comm_id: rng.gen(),
            local_qkey: rng.gen(),
            local_qpn: bits(&mut rng, 24),
            vendor_id_h: rng.gen(),
            local_eecn: bits(&mut rng, 24),
            vendor_id_m: rng.gen(),
            starting_psn: bits(&mut rng, 24),
            vendor_id_l: rng.gen(),
            responder_resources: rng.gen(),
            initiator_depth: rng.gen(),
            target_ack_delay: bits8(&mut rng, 5),
            failover_accepted: bits8(&mut rng, 2),
            end_to_end_flow_control: rng.gen(),
            rnr_retry_count: bits8(&mut rng, 3),
            srq: rng.gen(),
            reserved0: 0,
            local_ca_guid: rng.gen(),
            private_data: random_bytes(&mut rng, cma::limits::ACCEPT),
        };
        let (src, dst) = random_endpoints(&mut rng, false);
        let mad = random_mad(&mut rng, CmMessage::Rep(rep.clone()));
        sent.push(roce_frame(&mut rng, src, dst, mad));
        reps.push(rep);
    }
    let fields = [
        "infiniband.cm.rep",
        "infiniband.cm.rep.remotecommid",
        "infiniband.cm.rep.localqkey",
        "infiniband.cm.rep.localqpn",
        "infiniband.cm.rep.localeecn",
        "infiniband.cm.rep.startpsn",
        "infiniband.cm.rep.respres",
        "infiniband.cm.rep.initdepth",
        "infiniband.cm.rep.tgtackdelay",
        "infiniband.cm.rep.failoveracc",
        "infiniband.cm.rep.e2eflowctrl",
        "infiniband.cm.rep.rnrretrcount",
        "infiniband.cm.rep.srq",
        "infiniband.cm.rep.reserved",
        "infiniband.cm.rep.localcaguid",
        "infiniband.cm.rep.private",
    ];
    let mut m = Mismatches::default();
    let refs: Vec<&SentMad> = sent.iter().collect();
    let rows = tshark_roce(t, "rep", &refs, &fields, &mut m);
    for (i, (row, r)) in rows.iter().zip(&reps).enumerate() {
        let mut c = m.frame(row, format_args!("REP #{i}"));
        c.contains("_ws.col.Info", "ConnectReply", None);
        // §6.3-3: the REP's Local Communication ID is `infiniband.cm.rep` itself.
        c.num("infiniband.cm.rep", r.local_comm_id);
        c.num("infiniband.cm.rep.remotecommid", r.remote_comm_id);
        c.num("infiniband.cm.rep.localqkey", r.local_qkey);
        c.num("infiniband.cm.rep.localqpn", r.local_qpn);
        c.num("infiniband.cm.rep.localeecn", r.local_eecn);
        c.num("infiniband.cm.rep.startpsn", r.starting_psn);
        c.num("infiniband.cm.rep.respres", r.responder_resources);
        c.num("infiniband.cm.rep.initdepth", r.initiator_depth);
        c.num("infiniband.cm.rep.tgtackdelay", r.target_ack_delay);
        c.num("infiniband.cm.rep.failoveracc", r.failover_accepted);
        c.num("infiniband.cm.rep.e2eflowctrl", r.end_to_end_flow_control);
        c.num("infiniband.cm.rep.rnrretrcount", r.rnr_retry_count);
        c.num("infiniband.cm.rep.srq", r.srq);
        c.num("infiniband.cm.rep.reserved", r.reserved0);
        c.num("infiniband.cm.rep.localcaguid", r.local_ca_guid);
        c.bytes(
            "infiniband.cm.rep.private",
            &padded(&r.private_data, cma::limits::ACCEPT),
        );
    }
    m.finish("REP", t);
}

#[test]
fn rtu_dreq_drep_fields_match_tshark() {
    let Some(t) = tshark("rtu_dreq_drep_fields_match_tshark") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(0x5254_5500);
    let mut sent = Vec::new();
    for i in 0..3 * PER_TYPE {
        let msg = match i % 3 {
            0 => CmMessage::Rtu(Rtu {
                local_comm_id: rng.gen(),
                remote_comm_id: rng.gen(),
                private_data: random_bytes(&mut rng, 224),
            }),
            1 => CmMessage::Dreq(Dreq {
                local_comm_id: rng.gen(),
                remote_comm_id: rng.gen(),
                remote_qpn: bits(&mut rng, 24),
                reserved0: 0,
                private_data: random_bytes(&mut rng, cma::limits::DISCONNECT),
            }),
            _ => CmMessage::Drep(Drep {
                local_comm_id: rng.gen(),
                remote_comm_id: rng.gen(),
                private_data: random_bytes(&mut rng, 224),
            }),
        };
        let (src, dst) = random_endpoints(&mut rng, false);
        let mad = random_mad(&mut rng, msg);
        sent.push(roce_frame(&mut rng, src, dst, mad));
    }
    let fields = [
        "infiniband.cm.rtu.localcommid",
        "infiniband.cm.rtu.remotecommid",
        "infiniband.cm.rtu.private",
        "infiniband.cm.dreq.localcommid",
        "infiniband.cm.dreq.remotecommid",
        "infiniband.cm.req.remoteqpneecn",
        "infiniband.cm.dreq.private",
        "infiniband.cm.drsp.localcommid",
        "infiniband.cm.drsp.remotecommid",
        "infiniband.cm.drsp.private",
    ];
    let mut m = Mismatches::default();
    let refs: Vec<&SentMad> = sent.iter().collect();
    let rows = tshark_roce(t, "rtu-dreq-drep", &refs, &fields, &mut m);
    for (i, (row, s)) in rows.iter().zip(&sent).enumerate() {
        let mut c = m.frame(row, format_args!("{} #{}", s.mad.msg.name(), i / 3));
        match &s.mad.msg {
            CmMessage::Rtu(r) => {
                c.contains("_ws.col.Info", "ReadyToUse", None);
                c.num("infiniband.cm.rtu.localcommid", r.local_comm_id);
                c.num("infiniband.cm.rtu.remotecommid", r.remote_comm_id);
                c.bytes("infiniband.cm.rtu.private", &padded(&r.private_data, 224));
            }
            CmMessage::Dreq(r) => {
                c.contains("_ws.col.Info", "DisconnectRequest", None);
                c.num("infiniband.cm.dreq.localcommid", r.local_comm_id);
                c.num("infiniband.cm.dreq.remotecommid", r.remote_comm_id);
                // §6.3-3: the DREQ's Remote QPN is registered under a `req` name.
                c.num("infiniband.cm.req.remoteqpneecn", r.remote_qpn);
                c.bytes("infiniband.cm.dreq.private", &padded(&r.private_data, 220));
            }
            CmMessage::Drep(r) => {
                c.contains("_ws.col.Info", "DisconnectReply", None);
                // §6.3-3: `drsp`, not `drep`.
                c.num("infiniband.cm.drsp.localcommid", r.local_comm_id);
                c.num("infiniband.cm.drsp.remotecommid", r.remote_comm_id);
                c.bytes("infiniband.cm.drsp.private", &padded(&r.private_data, 224));
            }
            _ => unreachable!(),
        }
    }
    m.finish("RTU/DREQ/DREP", t);
}

#[test]
fn rej_fields_match_tshark() {
    let Some(t) = tshark("rej_fields_match_tshark") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(0x5245_4A00);
    let mut rejs = Vec::new();
    let mut sent = Vec::new();
    for i in 0..PER_TYPE {
        let ari_len = rng.gen_range(0..=72usize);
        let mut ari = vec![0u8; ari_len];
        rng.fill(&mut ari[..]);
        // Mostly the codes Linux sends, plus any 16-bit value.
        let reason = match i % 4 {
            0 => RejReason::ConsumerDefined,
            1 => RejReason::Timeout,
            2 => RejReason::from_raw_value(rng.gen_range(1..=35)),
            _ => RejReason::from_raw_value(rng.gen()),
        };
        let rej = Rej {
            local_comm_id: rng.gen(),
            remote_comm_id: rng.gen(),
            message_rejected: MsgCode::from_raw_value(bits8(&mut rng, 2)),
            reserved0: 0,
            reject_info_length: ari_len as u8,
            reserved1: 0,
            reason,
            ari,
            private_data: random_bytes(&mut rng, cma::limits::REJECT),
        };
        let (src, dst) = random_endpoints(&mut rng, false);
        let mad = random_mad(&mut rng, CmMessage::Rej(rej.clone()));
        sent.push(roce_frame(&mut rng, src, dst, mad));
        rejs.push(rej);
    }
    let fields = [
        "infiniband.cm.rej.localcommid",
        "infiniband.cm.rej.remotecommid",
        "infiniband.cm.rej.msgrej",
        "infiniband.cm.rej.rejinfolen",
        "infiniband.cm.rej.reason",
        "infiniband.cm.rej.ari",
        "infiniband.cm.rej.private",
    ];
    let mut m = Mismatches::default();
    let refs: Vec<&SentMad> = sent.iter().collect();
    let rows = tshark_roce(t, "rej", &refs, &fields, &mut m);
    for (i, (row, r)) in rows.iter().zip(&rejs).enumerate() {
        let mut c = m.frame(row, format_args!("REJ #{i}"));
        c.contains("_ws.col.Info", "ConnectReject", None);
        c.num("infiniband.cm.rej.localcommid", r.local_comm_id);
        c.num("infiniband.cm.rej.remotecommid", r.remote_comm_id);
        c.num("infiniband.cm.rej.msgrej", r.message_rejected.raw());
        c.num("infiniband.cm.rej.rejinfolen", r.reject_info_length);
        c.num("infiniband.cm.rej.reason", r.reason.raw());
        c.bytes("infiniband.cm.rej.ari", &padded(&r.ari, 72));
        c.bytes(
            "infiniband.cm.rej.private",
            &padded(&r.private_data, cma::limits::REJECT),
        );
    }
    m.finish("REJ", t);
}

// =============================================================================================
// Messages tshark 4.0 names but does not dissect; `rcm decode` reads them back
// =============================================================================================

fn random_lap_path(rng: &mut StdRng) -> LapPath {
    LapPath {
        local_lid: rng.gen(),
        remote_lid: rng.gen(),
        local_gid: Gid::from_ip(random_v6(rng).into()),
        remote_gid: Gid::from_ip(random_v4(rng).into()),
        flow_label: bits(rng, 20),
        reserved0: 0,
        traffic_class: rng.gen(),
        hop_limit: rng.gen(),
        reserved1: 0,
        packet_rate: bits8(rng, 6),
        sl: bits8(rng, 4),
        subnet_local: rng.gen(),
        reserved2: 0,
        local_ack_timeout: bits8(rng, 5),
        reserved3: 0,
    }
}

fn random_additional_info(rng: &mut StdRng) -> (u8, Vec<u8>) {
    let len = rng.gen_range(0..=72usize);
    let mut v = vec![0u8; len];
    rng.fill(&mut v[..]);
    (len as u8, v)
}

fn random_class_port_info(rng: &mut StdRng) -> ClassPortInfo {
    ClassPortInfo {
        base_version: 1,
        class_version: 2,
        capability_mask: rng.gen(),
        capability_mask2: bits(rng, 27),
        resp_time_value: bits8(rng, 5),
        redirect_gid: random_gid(rng),
        redirect_tc: rng.gen(),
        redirect_sl: bits8(rng, 4),
        redirect_fl: bits(rng, 20),
        redirect_lid: rng.gen(),
        redirect_pkey: rng.gen(),
        reserved0: 0,
        redirect_qp: bits(rng, 24),
        redirect_qkey: rng.gen(),
        trap_gid: random_gid(rng),
        trap_tc: rng.gen(),
        trap_sl: bits8(rng, 4),
        trap_fl: bits(rng, 20),
        trap_lid: rng.gen(),
        trap_pkey: rng.gen(),
        trap_hl: rng.gen(),
        trap_qp: bits(rng, 24),
        trap_qkey: rng.gen(),
    }
}

/// One random message of each type tshark does not dissect, in turn.
fn random_undissected(rng: &mut StdRng, i: usize) -> CmMad {
    let msg = match i % 6 {
        0 => CmMessage::Mra(Mra {
            local_comm_id: rng.gen(),
            remote_comm_id: rng.gen(),
            message_mraed: MsgCode::from_raw_value(rng.gen_range(0..=2)),
            reserved0: 0,
            service_timeout: bits8(rng, 5),
            reserved1: 0,
            private_data: random_bytes(rng, 222),
        }),
        1 => {
            let v6 = rng.gen();
            let (src, dst) = random_endpoints(rng, v6);
            let cma = CmaHdr {
                src_port: rng.gen(),
                src,
                dst,
            };
            let user = random_bytes(rng, cma::limits::CONNECT_UD);
            CmMessage::SidrReq(SidrReq {
                request_id: rng.gen(),
                pkey: rng.gen(),
                reserved0: 0,
                service_id: cma::service_id(PortSpace::Udp, rng.gen()),
                private_data: cma
                    .with_user_data(&user, cma::limits::CONNECT_UD)
                    .expect("cma_hdr"),
            })
        }
        2 => {
            let (additional_info_length, additional_info) = random_additional_info(rng);
            CmMessage::SidrRep(SidrRep {
                request_id: rng.gen(),
                status: SidrStatus::from_raw_value(rng.gen_range(0..=5)),
                additional_info_length,
                vendor_id_h: rng.gen(),
                qpn: bits(rng, 24),
                vendor_id_l: rng.gen(),
                service_id: cma::service_id(PortSpace::Ib, rng.gen()),
                qkey: rng.gen(),
                additional_info,
                private_data: random_bytes(rng, cma::limits::ACCEPT_UD),
            })
        }
        3 => CmMessage::Lap(Lap {
            local_comm_id: rng.gen(),
            remote_comm_id: rng.gen(),
            reserved0: 0,
            remote_qpn: bits(rng, 24),
            remote_cm_response_timeout: bits8(rng, 5),
            reserved1: 0,
            reserved2: 0,
            private_data: random_bytes(rng, 168),
            alternate_path: random_lap_path(rng),
        }),
        4 => {
            let (additional_info_length, additional_info) = random_additional_info(rng);
            CmMessage::Apr(Apr {
                local_comm_id: rng.gen(),
                remote_comm_id: rng.gen(),
                additional_info_length,
                ap_status: ApStatus::from_raw_value(rng.gen_range(0..=13)),
                reserved0: 0,
                additional_info,
                private_data: random_bytes(rng, 148),
            })
        }
        _ => CmMessage::ClassPortInfo(random_class_port_info(rng)),
    };
    let mut mad = random_mad(rng, msg);
    if let CmMessage::ClassPortInfo(_) = mad.msg {
        mad.header.attr_mod = 0;
        if rng.gen() {
            mad.header.method = rcm_wire::mad::method::GET;
        } else {
            // What Linux answers a CM ClassPortInfo Get with (§2).
            mad.header.method = rcm_wire::mad::method::GET_RESP;
            mad.header.status = rcm_wire::mad::status::METHOD_ATTR_UNSUPPORTED;
        }
    }
    mad
}

/// tshark's Info-column name for a CM attribute (§6.2).
fn info_name(msg: &CmMessage) -> &'static str {
    match msg {
        CmMessage::ClassPortInfo(_) => "ClassPortInfo",
        CmMessage::Req(_) => "ConnectRequest",
        CmMessage::Mra(_) => "MsgRcptAck",
        CmMessage::Rej(_) => "ConnectReject",
        CmMessage::Rep(_) => "ConnectReply",
        CmMessage::Rtu(_) => "ReadyToUse",
        CmMessage::Dreq(_) => "DisconnectRequest",
        CmMessage::Drep(_) => "DisconnectReply",
        CmMessage::SidrReq(_) => "ServiceIDResReq",
        CmMessage::SidrRep(_) => "ServiceIDResReqResp",
        CmMessage::Lap(_) => "LoadAlternatePath",
        CmMessage::Apr(_) => "AlternatePathResponse",
    }
}

fn rcm_decode_json(file: &Path) -> (i32, Vec<serde_json::Value>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_rcm"))
        .arg("decode")
        .arg("--json")
        .arg(file)
        .output()
        .expect("run rcm decode");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines = stdout
        .lines()
        .map(|l| {
            serde_json::from_str(l).unwrap_or_else(|e| panic!("rcm decode --json line {l:?}: {e}"))
        })
        .collect();
    (
        out.status.code().unwrap_or(-1),
        lines,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Compares `rcm decode --json` field `key` of `obj` with `expected`.
fn json_eq(
    m: &mut Mismatches,
    ctx: &str,
    obj: &serde_json::Value,
    key: &str,
    expected: &serde_json::Value,
) {
    let got = key.split('.').fold(obj, |v, k| &v[k]);
    if got != expected {
        m.push(format!(
            "{ctx}: rcm decode --json {key}: expected {expected}, got {got}"
        ));
    }
}

#[test]
fn undissected_messages_are_named_by_tshark_and_decoded_by_rcm() {
    let Some(t) = tshark("undissected_messages_are_named_by_tshark_and_decoded_by_rcm") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(0x4D52_4100);
    let mut sent = Vec::new();
    for i in 0..6 * PER_TYPE {
        let mad = random_undissected(&mut rng, i);
        let (src, dst) = random_endpoints(&mut rng, i % 5 == 4);
        sent.push(roce_frame(&mut rng, src, dst, mad));
    }
    let refs: Vec<&SentMad> = sent.iter().collect();
    let file = write_pcap("undissected", &frames_of(&refs));
    let mut fields: Vec<&str> = ROCE_FIELDS.to_vec();
    fields.extend_from_slice(&["infiniband.mad.data", "infiniband.cm.req"]);
    let rows = t.fields(file.path(), &fields, false);
    assert_eq!(rows.len(), sent.len(), "tshark frame count");
    let mut m = Mismatches::default();
    for (i, (row, s)) in rows.iter().zip(&sent).enumerate() {
        let name = s.mad.msg.name();
        let mut c = m.frame(row, format_args!("{name} #{}", i / 6));
        check_roce_common(&mut c, s);
        let info = info_name(&s.mad.msg);
        let unless = (info == "ServiceIDResReq").then_some("ServiceIDResReqResp");
        c.contains("_ws.col.Info", info, unless);
        // Not dissected: the 232 bytes after the MAD header are ours, untouched.
        c.bytes("infiniband.mad.data", &s.body());
        c.absent("infiniband.cm.req");
    }

    // Our own decoder on the same capture.
    let (code, lines, stderr) = rcm_decode_json(file.path());
    assert_eq!(code, 0, "rcm decode exit status; stderr:\n{stderr}");
    assert_eq!(lines.len(), sent.len(), "rcm decode: one line per frame");
    for (i, (j, s)) in lines.iter().zip(&sent).enumerate() {
        let ctx = format!("{} #{} (frame {})", s.mad.msg.name(), i / 6, i + 1);
        json_eq(&mut m, &ctx, j, "type", &s.mad.msg.name().into());
        json_eq(&mut m, &ctx, j, "crc", &"ok".into());
        json_eq(
            &mut m,
            &ctx,
            j,
            "detail.header.tid",
            &s.mad.header.tid.into(),
        );
        json_eq(
            &mut m,
            &ctx,
            j,
            "detail.header.method",
            &s.mad.header.method.into(),
        );
        let msg = &j["detail"]["msg"];
        let mut f = |key: &str, v: serde_json::Value| json_eq(&mut m, &ctx, msg, key, &v);
        let pd = |v: &[u8], n: usize| serde_json::Value::from(padded(v, n));
        match &s.mad.msg {
            CmMessage::Mra(x) => {
                f("type", "Mra".into());
                f("local_comm_id", x.local_comm_id.into());
                f("remote_comm_id", x.remote_comm_id.into());
                f("service_timeout", x.service_timeout.into());
                f("private_data", pd(&x.private_data, 222));
            }
            CmMessage::SidrReq(x) => {
                f("type", "SidrReq".into());
                f("request_id", x.request_id.into());
                f("pkey", x.pkey.into());
                f("service_id", x.service_id.into());
                f("private_data", pd(&x.private_data, 216));
            }
            CmMessage::SidrRep(x) => {
                f("type", "SidrRep".into());
                f("request_id", x.request_id.into());
                f("qpn", x.qpn.into());
                f("qkey", x.qkey.into());
                f("service_id", x.service_id.into());
                f("additional_info_length", x.additional_info_length.into());
                f("private_data", pd(&x.private_data, 136));
            }
            CmMessage::Lap(x) => {
                f("type", "Lap".into());
                f("local_comm_id", x.local_comm_id.into());
                f("remote_qpn", x.remote_qpn.into());
                f(
                    "alternate_path.flow_label",
                    x.alternate_path.flow_label.into(),
                );
                f(
                    "alternate_path.traffic_class",
                    x.alternate_path.traffic_class.into(),
                );
                f(
                    "alternate_path.packet_rate",
                    x.alternate_path.packet_rate.into(),
                );
                f(
                    "alternate_path.local_gid",
                    x.alternate_path.local_gid.to_string().into(),
                );
                f("private_data", pd(&x.private_data, 168));
            }
            CmMessage::Apr(x) => {
                f("type", "Apr".into());
                f("local_comm_id", x.local_comm_id.into());
                f("remote_comm_id", x.remote_comm_id.into());
                f("additional_info_length", x.additional_info_length.into());
                f("additional_info", pd(&x.additional_info, 72));
                f("private_data", pd(&x.private_data, 148));
            }
            CmMessage::ClassPortInfo(x) => {
                f("type", "ClassPortInfo".into());
                f("capability_mask", x.capability_mask.into());
                f("resp_time_value", x.resp_time_value.into());
                f("redirect_qp", x.redirect_qp.into());
                f("redirect_fl", x.redirect_fl.into());
                f("trap_qkey", x.trap_qkey.into());
                f("trap_gid", x.trap_gid.to_string().into());
            }
            other => panic!("test bug: {other:?}"),
        }
    }
    m.finish("MRA/SIDR_REQ/SIDR_REP/LAP/APR/ClassPortInfo", t);
}
// =============================================================================================
// iWARP: MPA Request/Reply, FPDUs, Terminate
// =============================================================================================

/// What one TCP data segment of a built flow carries, for comparison with tshark.
enum Expect {
    /// An MPA Request or Reply frame.
    Frame(MpaFrame),
    /// One or more FPDUs (all with CRC or all without): their ULPDUs.
    Fpdus { crc: bool, ulpdus: Vec<Vec<u8>> },
}

/// A built TCP conversation and, for each data segment, its frame number (1-based) and what
/// it carries.
struct Flow {
    segments: Vec<(usize, Expect)>,
    frames: Vec<(Duration, Vec<u8>)>,
}

impl Flow {
    /// Appends another flow's frames, renumbering its segments.
    fn append(&mut self, other: Flow) {
        let base = self.frames.len();
        self.frames.extend(other.frames);
        self.segments
            .extend(other.segments.into_iter().map(|(n, e)| (n + base, e)));
    }
}

struct FlowBuilder {
    b: TcpFlowBuilder,
    segments: Vec<(usize, Expect)>,
}

impl FlowBuilder {
    fn new(client_port: u16, start: Duration) -> Self {
        let client = SocketAddr::from(([198, 18, 0, 1], client_port));
        let server = SocketAddr::from(([198, 18, 0, 2], IWARP_PORT));
        let mut b = TcpFlowBuilder::new(client, server)
            .start(start, Duration::from_micros(100))
            .isns(
                u32::from(client_port).wrapping_mul(7919),
                0x5EED_0000 | u32::from(client_port),
            );
        b.handshake();
        FlowBuilder {
            b,
            segments: Vec::new(),
        }
    }

    fn send(&mut self, from_client: bool, bytes: &[u8], e: Expect) {
        assert!(
            bytes.len() <= 1448,
            "test bug: keep each send within one segment"
        );
        // The data segment is the next frame; the peer's ACK follows it.
        let frame_no = self.b.frames().len() + 1;
        if from_client {
            self.b.client_send(bytes);
        } else {
            self.b.server_send(bytes);
        }
        self.segments.push((frame_no, e));
    }

    fn mpa(&mut self, from_client: bool, f: &MpaFrame) {
        let bytes = f
            .to_vec()
            .unwrap_or_else(|e| panic!("our encoder refused {f:?}: {e}"));
        self.send(from_client, &bytes, Expect::Frame(f.clone()));
    }

    /// Sends FPDUs carrying `ulpdus` in one TCP segment.
    fn fpdus(&mut self, from_client: bool, crc: bool, ulpdus: Vec<Vec<u8>>) {
        let mut wire = Vec::new();
        for u in &ulpdus {
            mpa::emit_fpdu(u, crc, &mut wire).expect("FPDU");
        }
        self.send(from_client, &wire, Expect::Fpdus { crc, ulpdus });
    }

    fn finish(mut self) -> Flow {
        self.b.close();
        Flow {
            segments: self.segments,
            frames: self.b.into_frames(),
        }
    }
}

const MPA_FIELDS: &[&str] = &[
    "_ws.col.Info",
    "_ws.malformed",
    "_ws.expert.message",
    "iwarp_mpa.key.req",
    "iwarp_mpa.key.rep",
    "iwarp_mpa.marker_flag",
    "iwarp_mpa.crc_flag",
    "iwarp_mpa.rej_flag",
    "iwarp_mpa.res",
    "iwarp_mpa.rev",
    "iwarp_mpa.pdlength",
    "iwarp_mpa.privatedata",
    "iwarp_mpa.ulpdulength",
    "iwarp_mpa.pad",
    "iwarp_mpa.crc",
    "iwarp_mpa.crc_check",
    "iwarp_ddp.tagged_flag",
    "iwarp_ddp.last_flag",
    "iwarp_ddp.dv",
    "iwarp_ddp.rsvdulp",
    "iwarp_ddp.qn",
    "iwarp_ddp.msn",
    "iwarp_ddp.mo",
    "iwarp_rdma.version",
    "iwarp_rdma.opcode",
    "iwarp_rdma.term_layer",
    "iwarp_rdma.term_etype_rdma",
    "iwarp_rdma.term_etype_ddp",
    "iwarp_rdma.term_etype_llp",
    "iwarp_rdma.term_errcode_rdma",
    "iwarp_rdma.term_errcode_ddp_untagged",
    "iwarp_rdma.term_errcode_llp",
    "iwarp_rdma.term_hdrct_m",
    "iwarp_rdma.hdrct_d",
    "iwarp_rdma.hdrct_r",
    "iwarp_rdma.term_rsvd",
    "iwarp_rdma.term_ddp_seg_len",
    "iwarp_rdma.term_ddp_h",
    "iwarp_rdma.term_rdma_h",
];

fn be32(b: &[u8], at: usize) -> u64 {
    u64::from(u32::from_be_bytes(
        b[at..at + 4].try_into().expect("4 bytes"),
    ))
}

/// Checks an MPA Request/Reply segment. tshark 4.0 knows revision 1 only: a v2 frame's
/// Enhanced flag shows in `res` and its IRD/ORD words open `privatedata` (§6.4).
fn check_mpa_frame(c: &mut FrameCheck<'_>, t: &Tshark, f: &MpaFrame) {
    let wire = f.to_vec().expect("MPA frame");
    let (key, other) = match f.kind {
        mpa::FrameKind::Request => ("iwarp_mpa.key.req", "iwarp_mpa.key.rep"),
        mpa::FrameKind::Reply => ("iwarp_mpa.key.rep", "iwarp_mpa.key.req"),
    };
    c.contains(
        "_ws.col.Info",
        match f.kind {
            mpa::FrameKind::Request => "MPA Request Frame",
            mpa::FrameKind::Reply => "MPA Reply Frame",
        },
        None,
    );
    c.bytes(key, f.kind.key());
    c.absent(other);
    c.num("iwarp_mpa.marker_flag", f.flags.markers);
    c.num("iwarp_mpa.crc_flag", f.flags.crc);
    c.num("iwarp_mpa.rej_flag", f.flags.reject);
    c.num("iwarp_mpa.res", f.flags.to_byte() & 0x1F);
    c.num("iwarp_mpa.rev", f.revision);
    c.num("iwarp_mpa.pdlength", f.pd_length() as u64);
    if f.enhanced.is_some() && t.version >= (4, 6) {
        // 4.6 decodes the IRD/ORD words itself; not checked here.
        return;
    }
    // Everything after the 20-byte header, IRD/ORD words included.
    if f.pd_length() == 0 {
        c.absent("iwarp_mpa.privatedata");
    } else {
        c.bytes("iwarp_mpa.privatedata", &wire[mpa::MPA_FRAME_HEADER_LEN..]);
    }
}

/// The Terminate fields tshark shows, per FPDU, gathered so each field's occurrences can be
/// compared in order.
#[derive(Default)]
struct TermFields<'a> {
    layer: Vec<u64>,
    etype: [Vec<u64>; 3],
    ecode: [Vec<u64>; 3],
    m: Vec<u64>,
    d: Vec<u64>,
    r: Vec<u64>,
    rsvd: Vec<u64>,
    seg_len: Vec<&'a [u8]>,
    ddp_h: Vec<&'a [u8]>,
    rdma_h: Vec<&'a [u8]>,
}

impl<'a> TermFields<'a> {
    /// `p`: a Terminate payload (after the 18-byte untagged header).
    fn push(&mut self, p: &'a [u8]) {
        let layer = usize::from(p[0] >> 4).min(2);
        self.layer.push(u64::from(p[0] >> 4));
        self.etype[layer].push(u64::from(p[0] & 0x0F));
        self.ecode[layer].push(u64::from(p[1]));
        let hdrct = u16::from_be_bytes([p[2], p[3]]);
        self.m.push(u64::from(hdrct >> 15));
        self.d.push(u64::from((hdrct >> 14) & 1));
        self.r.push(u64::from((hdrct >> 13) & 1));
        self.rsvd.push(u64::from(hdrct & 0x1FFF));
        let mut at = 4;
        if hdrct & 0xC000 != 0 {
            self.seg_len.push(&p[at..at + 2]);
            at += 2;
        }
        if hdrct & 0x4000 != 0 {
            // The copied DDP header: 14 bytes tagged, 18 untagged.
            let len = if p[at] & 0x80 != 0 { 14 } else { 18 };
            self.ddp_h.push(&p[at..at + len]);
            at += len;
        }
        if hdrct & 0x2000 != 0 {
            // The copied RDMAP header: an RDMA Read Request's 28 bytes.
            self.rdma_h.push(&p[at..at + 28]);
        }
    }

    fn check(&self, c: &mut FrameCheck<'_>) {
        c.nums("iwarp_rdma.term_layer", &self.layer);
        c.nums("iwarp_rdma.term_etype_rdma", &self.etype[0]);
        c.nums("iwarp_rdma.term_etype_ddp", &self.etype[1]);
        c.nums("iwarp_rdma.term_etype_llp", &self.etype[2]);
        c.nums("iwarp_rdma.term_errcode_rdma", &self.ecode[0]);
        c.nums("iwarp_rdma.term_errcode_ddp_untagged", &self.ecode[1]);
        c.nums("iwarp_rdma.term_errcode_llp", &self.ecode[2]);
        c.nums("iwarp_rdma.term_hdrct_m", &self.m);
        c.nums("iwarp_rdma.hdrct_d", &self.d);
        c.nums("iwarp_rdma.hdrct_r", &self.r);
        c.nums("iwarp_rdma.term_rsvd", &self.rsvd);
        c.bytes_each("iwarp_rdma.term_ddp_seg_len", &self.seg_len);
        c.bytes_each("iwarp_rdma.term_ddp_h", &self.ddp_h);
        c.bytes_each("iwarp_rdma.term_rdma_h", &self.rdma_h);
    }
}

/// Checks a segment of FPDUs carrying untagged ULPDUs (Sends, Terminates).
fn check_fpdus(c: &mut FrameCheck<'_>, crc: bool, ulpdus: &[Vec<u8>]) {
    let n = ulpdus.len();
    let mut crcs = Vec::new();
    let mut pads = Vec::new();
    let mut term = TermFields::default();
    for u in ulpdus {
        let mut wire = Vec::new();
        mpa::emit_fpdu(u, crc, &mut wire).expect("FPDU");
        crcs.push(be32(&wire, wire.len() - 4));
        let pad = mpa::fpdu_pad(u.len());
        if pad > 0 {
            pads.push(vec![0u8; pad]);
        }
        if u[1] & 0x0F == 7 {
            term.push(&u[mpa::UNTAGGED_HEADER_LEN..]);
        }
    }
    let lens: Vec<u64> = ulpdus.iter().map(|u| u.len() as u64).collect();
    c.nums("iwarp_mpa.ulpdulength", &lens);
    if crc {
        // §6.4: with CRC on, `crc_check` holds the received CRC read big-endian (the verdict
        // is in the label only; see the -V check).
        c.nums("iwarp_mpa.crc_check", &crcs);
        c.absent("iwarp_mpa.crc");
    } else {
        c.nums("iwarp_mpa.crc", &vec![0; n]);
        c.absent("iwarp_mpa.crc_check");
    }
    let pads: Vec<&[u8]> = pads.iter().map(Vec::as_slice).collect();
    c.bytes_each("iwarp_mpa.pad", &pads);
    // Untagged header: DDP ctrl, RDMAP ctrl, RsvdULP (4), QN, MSN, MO.
    c.nums("iwarp_ddp.tagged_flag", &vec![0; n]);
    c.nums("iwarp_ddp.last_flag", &vec![1; n]);
    c.nums("iwarp_ddp.dv", &vec![1; n]);
    let rsvdulp: Vec<&[u8]> = ulpdus.iter().map(|u| &u[1..6]).collect();
    c.bytes_each("iwarp_ddp.rsvdulp", &rsvdulp);
    let at = |off: usize| -> Vec<u64> { ulpdus.iter().map(|u| be32(u, off)).collect() };
    c.nums("iwarp_ddp.qn", &at(6));
    c.nums("iwarp_ddp.msn", &at(10));
    c.nums("iwarp_ddp.mo", &at(14));
    c.nums("iwarp_rdma.version", &vec![1; n]);
    let opcodes: Vec<u64> = ulpdus.iter().map(|u| u64::from(u[1] & 0x0F)).collect();
    c.nums("iwarp_rdma.opcode", &opcodes);
    term.check(c);
}

/// Random Sends in both directions (some segments carrying two FPDUs).
fn random_sends(rng: &mut StdRng, f: &mut FlowBuilder, crc: bool, count: usize) {
    let mut msn = [rng.gen_range(1..1000u32), rng.gen_range(1..1000u32)];
    for i in 0..count {
        let from_client = i % 2 == 0;
        let side = usize::from(!from_client);
        let per_segment = if i % 5 == 3 { 2 } else { 1 };
        let ulpdus = (0..per_segment)
            .map(|_| {
                let payload = random_bytes(rng, 300);
                let u = mpa::send_ulpdu(mpa::QN_SEND, msn[side], 0, &payload);
                msn[side] += 1;
                u
            })
            .collect();
        f.fpdus(from_client, crc, ulpdus);
    }
}

/// A revision-1 flow with CRC: Request (C set), Reply (C as `reply_crc`; CRC is used if
/// either side asks), Sends both ways, then Terminates of each layer.
fn mpa_v1_flow(rng: &mut StdRng, client_port: u16, start: Duration, reply_crc: bool) -> Flow {
    let mut f = FlowBuilder::new(client_port, start);
    let mut req = MpaFrame::request_v1(random_bytes(rng, mpa::MAX_PRIVATE_DATA));
    req.flags.crc = true;
    let mut rep = MpaFrame::reply_v1(random_bytes(rng, mpa::MAX_PRIVATE_DATA));
    rep.flags.crc = reply_crc;
    assert!(mpa::crc_negotiated(&req, &rep));
    f.mpa(true, &req);
    f.mpa(false, &rep);
    random_sends(rng, &mut f, true, PER_TYPE);

    // RDMAP layer (remote operation error), copying an RDMA Read Request: DDP header and the
    // 28-byte RDMAP header.
    let rr_header = mpa::DdpRdmapHeader::untagged(
        mpa::RdmapOpcode::RdmaReadRequest,
        mpa::QN_READ_REQUEST,
        rng.gen(),
        0,
    )
    .to_vec()
    .expect("DDP header");
    let rr = mpa::ReadRequest {
        sink_stag: rng.gen(),
        sink_to: rng.gen(),
        size: rng.gen(),
        source_stag: rng.gen(),
        source_to: rng.gen(),
    };
    let mut copied = rr_header.clone();
    copied.extend_from_slice(&rr.to_bytes());
    let rdmap = Terminate {
        layer: mpa::term_layer::RDMAP,
        error_type: mpa::term_etype::RDMAP_REMOTE_OPERATION,
        error_code: rng.gen_range(0..=9),
        m: true,
        d: true,
        r: true,
        reserved: 0,
        ddp_segment_length: Some((copied.len()) as u16),
        copied_headers: copied,
    };
    // DDP layer (untagged buffer error), copying the offending Send's DDP header.
    let bad = mpa::send_ulpdu(mpa::QN_SEND, rng.gen(), rng.gen(), b"offending");
    let ddp = Terminate {
        layer: mpa::term_layer::DDP,
        error_type: mpa::term_etype::DDP_UNTAGGED_BUFFER,
        error_code: rng.gen_range(1..=6),
        m: true,
        d: true,
        r: false,
        reserved: 0,
        ddp_segment_length: Some(bad.len() as u16),
        copied_headers: bad[..mpa::UNTAGGED_HEADER_LEN].to_vec(),
    };
    // LLP layer (MPA), nothing copied, as siw sends on a CRC error.
    let llp = Terminate::llp(rng.gen_range(1..=7));
    let term = |t: &Terminate, msn: u32| {
        mpa::terminate_ulpdu(mpa::QN_TERMINATE, msn, t)
            .unwrap_or_else(|e| panic!("our encoder refused {t:?}: {e}"))
    };
    f.fpdus(false, true, vec![term(&rdmap, 1)]);
    f.fpdus(false, true, vec![term(&ddp, 2)]);
    f.fpdus(true, true, vec![term(&llp, 1)]);
    f.finish()
}

/// The expert-info summary of `tshark -z expert` (tshark 4.0 files the MPA Res/Rev warnings
/// there only: they are added without a tree item, so no `_ws.expert` field carries them).
fn expert_summary(t: &Tshark, file: &Path) -> String {
    let mut cmd = t.base_command(file);
    cmd.args(["-q", "-z", "expert"]);
    Tshark::run(&mut cmd)
}

fn check_segments(t: &Tshark, rows: &[Row], flow: &Flow, m: &mut Mismatches) {
    for (frame_no, e) in &flow.segments {
        let row = &rows[frame_no - 1];
        assert_eq!(row.frame, *frame_no, "tshark frame numbering");
        let what = match e {
            Expect::Frame(f) => format!("MPA {:?} rev {}", f.kind, f.revision),
            Expect::Fpdus { ulpdus, .. } => format!("segment of {} FPDU(s)", ulpdus.len()),
        };
        let mut c = m.frame(row, what);
        c.absent("_ws.malformed");
        c.absent("_ws.expert.message");
        match e {
            Expect::Frame(f) => check_mpa_frame(&mut c, t, f),
            Expect::Fpdus { crc, ulpdus } => {
                let name = match ulpdus[0][1] & 0x0F {
                    3 => "Send [last DDP segment]",
                    7 => "Terminate [last DDP segment]",
                    _ => unreachable!("test bug: only Sends and Terminates are built"),
                };
                c.contains("_ws.col.Info", name, None);
                check_fpdus(&mut c, *crc, ulpdus);
            }
        }
    }
}

#[test]
fn mpa_v1_crc_ddp_rdmap_fields_match_tshark() {
    let Some(t) = tshark("mpa_v1_crc_ddp_rdmap_fields_match_tshark") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(0x4D50_4131);
    let t0 = Duration::from_secs(1_700_000_000);
    let mut flow = mpa_v1_flow(&mut rng, 40001, t0, true);
    flow.append(mpa_v1_flow(
        &mut rng,
        40002,
        t0 + Duration::from_secs(1),
        false,
    ));
    let fpdus: usize = flow
        .segments
        .iter()
        .map(|(_, e)| match e {
            Expect::Frame(_) => 0,
            Expect::Fpdus { ulpdus, .. } => ulpdus.len(),
        })
        .sum();

    let file = write_pcap("mpa-v1", &flow.frames);
    let rows = t.fields(file.path(), MPA_FIELDS, false);
    assert_eq!(rows.len(), flow.frames.len(), "tshark frame count");
    let mut m = Mismatches::default();
    check_segments(t, &rows, &flow, &mut m);

    // The CRC verdict is only in the label text (§6.4).
    let text = t.verbose(file.path());
    let good = text.matches("(Good CRC32)").count();
    let bad: Vec<&str> = text.lines().filter(|l| l.contains("Bad CRC32")).collect();
    if !bad.is_empty() || good != fpdus {
        m.push(format!(
            "tshark -V: expected {fpdus} \"Good CRC32\" and no \"Bad CRC32\"; found {good} good, \
             bad: {bad:?}"
        ));
    }
    if text.contains("Malformed Packet") {
        m.push("tshark -V: a Malformed Packet".to_owned());
    }
    let expert = expert_summary(t, file.path());
    for warning in ["Res field is NOT set", "Rev field is NOT set", "Malformed"] {
        if expert.contains(warning) {
            m.push(format!(
                "tshark -z expert: unexpected {warning:?} on revision-1 flows:\n{expert}"
            ));
        }
    }
    m.finish("MPA v1 / DDP / RDMAP", t);
}

#[test]
fn mpa_v2_enhanced_frames_in_tshark() {
    let Some(t) = tshark("mpa_v2_enhanced_frames_in_tshark") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(0x4D50_4132);
    let mut f = FlowBuilder::new(40003, Duration::from_secs(1_700_000_000));
    let mut req = MpaFrame::request_v2(
        rng.gen_range(0..=mpa::IRD_ORD_MAX),
        rng.gen_range(0..=mpa::IRD_ORD_MAX),
        random_bytes(&mut rng, mpa::ENHANCED_USER_MAX),
    );
    // cxgb4-style peer-to-peer with an RDMA Read RTR.
    let e = req.enhanced.as_mut().expect("enhanced");
    e.peer_to_peer = true;
    e.zero_len_read_rtr = true;
    let rep = MpaFrame::reply_v2(
        rng.gen_range(0..=mpa::IRD_ORD_MAX),
        rng.gen_range(0..=mpa::IRD_ORD_MAX),
        random_bytes(&mut rng, mpa::ENHANCED_USER_MAX),
    );
    f.mpa(true, &req);
    f.mpa(false, &rep);
    // siw's default: no CRC, so the CRC slot carries 0.
    random_sends(&mut rng, &mut f, false, 4);
    let flow = f.finish();

    let file = write_pcap("mpa-v2", &flow.frames);
    let rows = t.fields(file.path(), MPA_FIELDS, false);
    assert_eq!(rows.len(), flow.frames.len(), "tshark frame count");
    let mut m = Mismatches::default();
    check_segments(t, &rows, &flow, &mut m);
    // Explicitly: the IRD/ORD words are the first 4 private-data bytes tshark 4.0 shows.
    if t.version < (4, 6) {
        for (frame_no, e) in &flow.segments {
            let Expect::Frame(fr) = e else { continue };
            let words = fr.enhanced.expect("enhanced").to_bytes().expect("IRD/ORD");
            let row = &rows[frame_no - 1];
            let pd = row.get("iwarp_mpa.privatedata").to_owned();
            if !pd.starts_with(&hex(&words)) {
                m.frame(row, format_args!("MPA {:?} rev 2", fr.kind)).fail(
                    "iwarp_mpa.privatedata",
                    &format!("to start with our IRD/ORD words {}", hex(&words)),
                    &pd,
                );
            }
        }
    }
    if t.is_4_0() {
        // §6.4: 4.0 has no RFC 6581, so the Request's Enhanced flag and revision 2 are flagged.
        let expert = expert_summary(t, file.path());
        for warning in [
            "Res field is NOT set to zero as required by RFC 5044",
            "Rev field is NOT set to one as required by RFC 5044",
        ] {
            if !expert.contains(warning) {
                m.push(format!(
                    "tshark -z expert: expected the warning {warning:?} for a revision-2 \
                     Request, got:\n{expert}"
                ));
            }
        }
    }
    m.finish("MPA v2", t);
}
