//! Hostile-input robustness: millions of random and mutated buffers through every decoder of
//! `rcm-wire`. None may panic, and whatever a decoder accepts must hold up: it re-encodes to the
//! bytes it came from (or at least parses back to the same value), never claims more bytes than
//! it was given, and a stream reader's verdicts do not depend on how the stream was chunked.
//!
//! Seeds are the real packets of `testdata/captures/` (UDP payloads to port 4791 with their IP
//! headers, and the TCP payloads of the siw connections) plus messages built with the encoders.
//! Mutations: bit flips, bytes set to 0, 0xFF or random, truncation, extension with garbage,
//! splicing two seeds, insertions and deletions, interesting integers, and targeted corruption of
//! length fields (UDP length, MPA PD_Length, FPDU ULPDU_Length), MAD attribute IDs and methods,
//! BTH and DDP/RDMAP control bytes.
//!
//! - `RCM_ROBUSTNESS_ITERS`: total mutated inputs across the tests (default 2,000,000); each
//!   input goes through several decoders.
//! - `RCM_ROBUSTNESS_SEED`: the RNG seed (default fixed, printed at the start of each test), to
//!   explore further or to replay a failure.
//!
//! `cargo test -p rcm-wire --test robustness -- --nocapture` shows, per decoder, how many inputs
//! it accepted, how many it refused as truncated, and how many it refused otherwise. The
//! coverage-guided counterpart is the cargo-fuzz project in `fuzz/`.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Instant;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use rcm_wire::cm::{self, attr, CmMad, CmMessage};
use rcm_wire::cma::{self, CmaHdr, PortSpace, CMA_HDR_LEN};
use rcm_wire::mad::{self, MadHeader, MAD_DATA_LEN, MAD_HEADER_LEN};
use rcm_wire::mpa::{
    self, DdpRdmapHeader, Enhanced, Fpdu, MpaFrame, RdmapOpcode, ReadRequest, Terminate,
    MPA_FRAME_HEADER_LEN,
};
use rcm_wire::roce::{self, Bth, Deth, GsiDatagram, IpForIcrc, RocePacket, BTH_LEN, ICRC_LEN};
use rcm_wire::{Gid, WireError};

const DEFAULT_TOTAL_ITERS: u64 = 2_000_000;
/// "rcm-wire" in ASCII.
const DEFAULT_SEED: u64 = 0x7263_6d2d_7769_7265;
/// Below this many iterations a test does not insist that every decoder both accepted and
/// refused something (a quick smoke run with a tiny `RCM_ROBUSTNESS_ITERS` may not get there).
const MIN_ITERS_FOR_BALANCE: u64 = 20_000;
/// Mutated buffers are cut to this length so that repeated extensions stay cheap.
const MAX_INPUT: usize = 4096;

const ATTRS: [u16; 12] = attr::ALL;

const INTERESTING_16: [u16; 20] = [
    0, 1, 2, 3, 4, 5, 7, 8, 16, 0x7F, 0x80, 0xFF, 0x100, 0x1FF, 0x200, 0x201, 0x7FFF, 0x8000,
    0xFFFE, 0xFFFF,
];

// ---------------------------------------------------------------------------------------------
// Configuration, counting, reporting
// ---------------------------------------------------------------------------------------------

fn env_u64(name: &str) -> Option<u64> {
    let raw = std::env::var(name).ok()?;
    let v = raw.trim().replace('_', "");
    let parsed = match v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16),
        None => v.parse(),
    };
    Some(parsed.unwrap_or_else(|e| panic!("{name}={raw:?} is not a number: {e}")))
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

fn is_trunc<T>(r: &Result<T, WireError>) -> bool {
    matches!(r, Err(WireError::Truncated { .. }))
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

/// How a decoder answered the inputs it was given.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    accepted: u64,
    truncated: u64,
    rejected: u64,
}

/// One test's RNG, iteration budget and per-decoder tallies.
struct Run {
    test: &'static str,
    seed: u64,
    iters: u64,
    rng: StdRng,
    tallies: BTreeMap<&'static str, Tally>,
    started: Instant,
}

impl Run {
    /// A run that takes `per_mille` thousandths of `RCM_ROBUSTNESS_ITERS`.
    fn new(test: &'static str, per_mille: u64) -> Self {
        let base = env_u64("RCM_ROBUSTNESS_SEED").unwrap_or(DEFAULT_SEED);
        let total = env_u64("RCM_ROBUSTNESS_ITERS").unwrap_or(DEFAULT_TOTAL_ITERS);
        let seed = base ^ fnv1a(test.as_bytes());
        let iters = if per_mille == 0 {
            0
        } else {
            (total * per_mille / 1000).max(1)
        };
        println!(
            "robustness/{test}: RCM_ROBUSTNESS_SEED={base:#018x} (test RNG seed {seed:#018x}), \
             {iters} of RCM_ROBUSTNESS_ITERS={total} iterations"
        );
        Run {
            test,
            seed,
            iters,
            rng: StdRng::seed_from_u64(seed),
            tallies: BTreeMap::new(),
            started: Instant::now(),
        }
    }

    fn count<T>(&mut self, decoder: &'static str, r: &Result<T, WireError>) {
        let t = self.tallies.entry(decoder).or_default();
        match r {
            Ok(_) => t.accepted += 1,
            Err(WireError::Truncated { .. }) => t.truncated += 1,
            Err(_) => t.rejected += 1,
        }
    }

    fn count_opt<T>(&mut self, decoder: &'static str, r: Option<&T>) {
        let t = self.tallies.entry(decoder).or_default();
        if r.is_some() {
            t.accepted += 1;
        } else {
            t.rejected += 1;
        }
    }

    /// Runs one iteration's decoding and checks; on a panic (a decoder's or a failed property)
    /// prints the input in hex with the iteration and seed, then lets the panic go on.
    fn guard(&mut self, i: u64, inputs: &[(&str, &[u8])], body: impl FnOnce(&mut Self)) {
        let (test, seed) = (self.test, self.seed);
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| body(self))) {
            let mut msg =
                format!("robustness/{test}: iteration {i} (test RNG seed {seed:#018x}) failed on:");
            for (name, bytes) in inputs {
                let _ = write!(msg, "\n  {name} ({} bytes): {}", bytes.len(), hex(bytes));
            }
            eprintln!("{msg}");
            resume_unwind(p);
        }
    }

    /// Prints the table and checks that each decoder in `balanced` both accepted and refused
    /// inputs, so that a decoder refusing everything (or nothing) does not pass unnoticed.
    fn finish(&self, balanced: &[&str]) {
        let secs = self.started.elapsed().as_secs_f64();
        let calls: u64 = self
            .tallies
            .values()
            .map(|t| t.accepted + t.truncated + t.rejected)
            .sum();
        let mut out = format!(
            "robustness/{}: {} inputs, {calls} decoder calls in {secs:.2} s\n  {:<34} {:>10} {:>10} {:>10}\n",
            self.test, self.iters, "decoder", "accepted", "truncated", "rejected"
        );
        for (name, t) in &self.tallies {
            let _ = writeln!(
                out,
                "  {name:<34} {:>10} {:>10} {:>10}",
                t.accepted, t.truncated, t.rejected
            );
        }
        print!("{out}");
        if self.iters >= MIN_ITERS_FOR_BALANCE {
            for name in balanced {
                let t = self.tallies.get(name).copied().unwrap_or_default();
                assert!(t.accepted > 0, "{name} accepted nothing: {t:?}");
                assert!(
                    t.truncated + t.rejected > 0,
                    "{name} refused nothing: {t:?}"
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Mutations
// ---------------------------------------------------------------------------------------------

fn random_bytes(rng: &mut StdRng, max: usize) -> Vec<u8> {
    let mut v = vec![0u8; rng.gen_range(0..=max)];
    rng.fill(&mut v[..]);
    v
}

/// How many mutations to stack on one seed: mostly one or two, sometimes none (so the decoders'
/// accepting paths stay exercised), sometimes many.
fn op_count(rng: &mut StdRng) -> usize {
    match rng.gen_range(0..20) {
        0 => 0,
        1..=9 => 1,
        10..=14 => 2,
        15..=17 => 3,
        _ => rng.gen_range(4..=10),
    }
}

/// Sets the big-endian 16-bit field at `at` to a value likely to confuse a length check.
fn corrupt_be16(rng: &mut StdRng, buf: &mut [u8], at: usize) {
    if buf.len() < at + 2 {
        return;
    }
    let cur = be16(buf, at);
    let v = match rng.gen_range(0..5) {
        0 | 1 => *INTERESTING_16.choose(rng).unwrap(),
        2 => cur.wrapping_add(rng.gen_range(1..=8)),
        3 => cur.wrapping_sub(rng.gen_range(1..=8)),
        _ => rng.gen(),
    };
    buf[at..at + 2].copy_from_slice(&v.to_be_bytes());
}

/// One format-blind mutation.
fn mutate_generic(rng: &mut StdRng, buf: &mut Vec<u8>, donors: &[Vec<u8>]) {
    let len = buf.len();
    match rng.gen_range(0..11) {
        0 | 1 if len > 0 => {
            let i = rng.gen_range(0..len);
            buf[i] ^= 1 << rng.gen_range(0..8);
        }
        2 if len > 0 => {
            let i = rng.gen_range(0..len);
            buf[i] = match rng.gen_range(0..3) {
                0 => 0,
                1 => 0xFF,
                _ => rng.gen(),
            };
        }
        3 => {
            let n = rng.gen_range(0..=len);
            buf.truncate(n);
        }
        4 => {
            let n = rng.gen_range(1..=64);
            match rng.gen_range(0..3) {
                0 => buf.resize(len + n, 0),
                1 => buf.resize(len + n, 0xFF),
                _ => buf.extend((0..n).map(|_| rng.gen::<u8>())),
            }
        }
        5 if !donors.is_empty() => {
            // Splice: a prefix of this buffer, then a suffix of another seed.
            let other = donors.choose(rng).unwrap();
            let cut = rng.gen_range(0..=len);
            let from = rng.gen_range(0..=other.len());
            buf.truncate(cut);
            buf.extend_from_slice(&other[from..]);
        }
        6 if len >= 2 => {
            let at = rng.gen_range(0..len - 1);
            let v = *INTERESTING_16.choose(rng).unwrap();
            let bytes = if rng.gen() {
                v.to_be_bytes()
            } else {
                v.to_le_bytes()
            };
            buf[at..at + 2].copy_from_slice(&bytes);
        }
        7 => {
            let at = rng.gen_range(0..=len);
            let n = rng.gen_range(1..=16);
            let ins: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
            buf.splice(at..at, ins);
        }
        8 if len > 0 => {
            let at = rng.gen_range(0..len);
            let n = rng.gen_range(1..=(len - at).min(32));
            buf.drain(at..at + n);
        }
        9 if len >= 4 => {
            // Overwrite a run with random bytes.
            let at = rng.gen_range(0..len);
            let n = rng.gen_range(1..=(len - at).min(16));
            rng.fill(&mut buf[at..at + n]);
        }
        _ if len >= 2 => {
            // Copy a chunk of the buffer over another place in it.
            let n = rng.gen_range(1..=len.min(32));
            let from = rng.gen_range(0..=len - n);
            let to = rng.gen_range(0..=len - n);
            buf.copy_within(from..from + n, to);
        }
        _ => buf.push(rng.gen()),
    }
}

/// Applies a stack of mutations, each either generic or `specific` (format-aware).
fn mutate(
    rng: &mut StdRng,
    buf: &mut Vec<u8>,
    donors: &[Vec<u8>],
    specific: &dyn Fn(&mut StdRng, &mut Vec<u8>),
) {
    for _ in 0..op_count(rng) {
        if rng.gen_bool(0.4) {
            specific(rng, buf);
        } else {
            mutate_generic(rng, buf, donors);
        }
    }
    buf.truncate(MAX_INPUT);
}

/// MAD-aware mutations of the MAD starting at `base`: attribute-ID swaps (the body of one
/// message read as another), methods, classes and versions.
fn mutate_mad_fields(rng: &mut StdRng, buf: &mut [u8], base: usize) {
    let Some(m) = buf.get_mut(base..) else {
        return;
    };
    if m.len() < MAD_HEADER_LEN {
        return;
    }
    match rng.gen_range(0..4) {
        0 => {
            let a = if rng.gen_bool(0.8) {
                *ATTRS.choose(rng).unwrap()
            } else {
                rng.gen()
            };
            m[16..18].copy_from_slice(&a.to_be_bytes());
        }
        1 => m[3] = *[0, 1, 2, 3, 5, 6, 7, 0x81, 0x83, 0xFF].choose(rng).unwrap(),
        2 => {
            let i = rng.gen_range(0..3);
            m[i] = match i {
                0 => *[0, 1, 2, 0x80].choose(rng).unwrap(),
                1 => *[0, 1, 7, 0x81].choose(rng).unwrap(),
                _ => *[0, 1, 2, 3].choose(rng).unwrap(),
            };
        }
        _ => {
            // A well-formed CM header over another message's body.
            let a = *ATTRS.choose(rng).unwrap();
            m[..3].copy_from_slice(&[mad::BASE_VERSION, mad::MGMT_CLASS_CM, mad::CM_CLASS_VERSION]);
            m[3] = if a == attr::CLASS_PORT_INFO {
                *[mad::method::GET, mad::method::SET, mad::method::GET_RESP]
                    .choose(rng)
                    .unwrap()
            } else {
                mad::method::SEND
            };
            m[16..18].copy_from_slice(&a.to_be_bytes());
        }
    }
}

/// UDP/BTH/DETH-aware mutations of a UDP datagram carrying RoCEv2.
fn mutate_udp_fields(rng: &mut StdRng, udp: &mut Vec<u8>) {
    let len = udp.len();
    match rng.gen_range(0..7) {
        0 => corrupt_be16(rng, udp, 4), // UDP length
        1 if len > 8 => {
            udp[8] = *[
                0x64,
                0x65,
                0x04,
                0x00,
                0x0A,
                0x0C,
                0x10,
                0x11,
                0x12,
                0x13,
                0x81,
                0xA4,
                0x40,
                0x60 | rng.gen_range(0..32u8),
                rng.gen(),
            ]
            .choose(rng)
            .unwrap();
        }
        2 if len > 9 => {
            // BTH byte 1: SE, MigReq, pad count, TVer.
            udp[9] = if rng.gen() {
                rng.gen_range(0..4u8) << 4
            } else {
                rng.gen()
            };
        }
        3 if len >= 8 + 8 => {
            let qp: [u8; 3] = if rng.gen() { [0, 0, 1] } else { rng.gen() };
            udp[13..16].copy_from_slice(&qp);
        }
        4 if len >= 8 + 24 => {
            let qkey = if rng.gen() { roce::GSI_QKEY } else { rng.gen() };
            udp[20..24].copy_from_slice(&qkey.to_be_bytes());
        }
        5 => mutate_mad_fields(rng, udp, 8 + BTH_LEN + roce::DETH_LEN),
        _ => mutate_generic(rng, udp, &[]),
    }
}

/// IP-header-aware mutations: version and IHL, length fields, a cut header.
fn mutate_ip_fields(rng: &mut StdRng, ip: &mut Vec<u8>) {
    match rng.gen_range(0..4) {
        0 if !ip.is_empty() => {
            ip[0] = *[
                0x45,
                0x46,
                0x4F,
                0x44,
                0x60,
                0x6F,
                0x00,
                0x50,
                0xF0,
                rng.gen(),
            ]
            .choose(rng)
            .unwrap();
        }
        1 => {
            let at = if ip.first().is_some_and(|b| b >> 4 == 6) {
                4
            } else {
                2
            };
            corrupt_be16(rng, ip, at);
        }
        2 => {
            let n = *[0, 1, 19, 20, 39, 40, rng.gen_range(0..=ip.len())]
                .choose(rng)
                .unwrap();
            ip.truncate(n);
        }
        _ => mutate_generic(rng, ip, &[]),
    }
}

/// MPA Request/Reply-aware mutations: PD_Length, flags, revision, key, IRD/ORD.
fn mutate_frame_fields(rng: &mut StdRng, buf: &mut Vec<u8>) {
    if buf.len() < MPA_FRAME_HEADER_LEN {
        mutate_generic(rng, buf, &[]);
        return;
    }
    match rng.gen_range(0..5) {
        0 | 1 => corrupt_be16(rng, buf, 18), // PD_Length
        2 => {
            buf[16] = if rng.gen() {
                buf[16] ^ (1 << rng.gen_range(0..8))
            } else {
                rng.gen()
            };
        }
        3 => buf[17] = *[0, 1, 2, 3, 0xFF, rng.gen()].choose(rng).unwrap(),
        _ => {
            if rng.gen() {
                // "Req" <-> "Rep": byte 10 is where the two keys differ.
                buf[10] = if buf[10] == b'q' { b'p' } else { b'q' };
            } else if buf.len() >= MPA_FRAME_HEADER_LEN + 4 {
                let at = rng.gen_range(MPA_FRAME_HEADER_LEN..MPA_FRAME_HEADER_LEN + 4);
                buf[at] = rng.gen();
            }
        }
    }
}

/// FPDU-aware mutations at the FPDU starting at one of `starts`: ULPDU_Length, the DDP and
/// RDMAP control bytes.
fn mutate_fpdu_fields(rng: &mut StdRng, buf: &mut [u8], starts: &[usize]) {
    let at = starts.choose(rng).copied().unwrap_or(0);
    match rng.gen_range(0..4) {
        0 | 1 => corrupt_be16(rng, buf, at), // ULPDU_Length
        2 => {
            if let Some(b) = buf.get_mut(at + 2) {
                *b = match rng.gen_range(0..4) {
                    0 => *b ^ 0x80, // T
                    1 => *b ^ 0x40, // L
                    2 => (*b & !3) | rng.gen_range(0..4u8),
                    _ => rng.gen(),
                };
            }
        }
        _ => {
            if let Some(b) = buf.get_mut(at + 3) {
                *b = match rng.gen_range(0..3) {
                    0 => 0x40 | rng.gen_range(0..16u8),
                    1 => (*b & 0x3F) | (rng.gen_range(0..4u8) << 6),
                    _ => rng.gen(),
                };
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Seeds: real captures and encoder output
// ---------------------------------------------------------------------------------------------

/// A RoCEv2 datagram with the IP header it arrived under (the ICRC covers both).
#[derive(Debug, Clone)]
struct RoceSeed {
    ip: Vec<u8>,
    udp: Vec<u8>,
}

/// A run of FPDUs, whether they carry a CRC, and where each starts.
#[derive(Debug, Clone)]
struct FpduSeed {
    bytes: Vec<u8>,
    crc_on: bool,
    starts: Vec<usize>,
}

/// One direction of an MPA connection: a Request or Reply, then FPDUs.
#[derive(Debug, Clone)]
struct StreamSeed {
    bytes: Vec<u8>,
    fpdu_starts: Vec<usize>,
}

#[derive(Default)]
struct Seeds {
    roce: Vec<RoceSeed>,
    udp_donors: Vec<Vec<u8>>,
    mads: Vec<Vec<u8>>,
    cma: Vec<Vec<u8>>,
    service_ids: Vec<u64>,
    frames: Vec<Vec<u8>>,
    fpdus: Vec<FpduSeed>,
    fpdu_donors: Vec<Vec<u8>>,
    ulpdus: Vec<Vec<u8>>,
    streams: Vec<StreamSeed>,
    captured_roce: usize,
    captured_tcp_segments: usize,
    captured_streams: usize,
}

fn captures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/captures")
}

fn pcap_files(sub: &str) -> Vec<PathBuf> {
    let dir = captures_dir().join(sub);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "pcap"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no captures in {}", dir.display());
    files
}

/// Every IPv4/IPv6 packet of an Ethernet capture as (IP header, IP payload, protocol).
fn ip_packets(path: &Path) -> Vec<(Vec<u8>, Vec<u8>, u8)> {
    let f = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut r =
        pcap_file::pcap::PcapReader::new(f).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut out = Vec::new();
    while let Some(pkt) = r.next_packet() {
        let pkt = pkt.unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let d = &pkt.data[..];
        if d.len() < 14 {
            continue;
        }
        let l3 = &d[14..];
        match be16(d, 12) {
            0x0800 if l3.len() >= 20 => {
                let ihl = usize::from(l3[0] & 0x0F) * 4;
                let total = usize::from(be16(l3, 2)).min(l3.len());
                if ihl >= 20 && total >= ihl {
                    out.push((l3[..ihl].to_vec(), l3[ihl..total].to_vec(), l3[9]));
                }
            }
            0x86DD if l3.len() >= 40 => {
                let end = (40 + usize::from(be16(l3, 4))).min(l3.len());
                out.push((l3[..40].to_vec(), l3[40..end].to_vec(), l3[6]));
            }
            _ => {}
        }
    }
    out
}

/// The RoCEv2 datagrams (UDP to port 4791) of a capture.
fn roce_datagrams(path: &Path) -> Vec<RoceSeed> {
    ip_packets(path)
        .into_iter()
        .filter(|(_, l4, proto)| *proto == 17 && l4.len() >= 8 && be16(l4, 2) == 4791)
        .map(|(ip, mut udp, _)| {
            udp.truncate(usize::from(be16(&udp, 4)).max(8));
            RoceSeed { ip, udp }
        })
        .collect()
}

/// The TCP segments' payloads of a capture, and each direction's byte stream (in sequence
/// order, retransmissions dropped).
fn tcp_payloads(path: &Path) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    let mut segments = Vec::new();
    let mut order: Vec<Vec<u8>> = Vec::new();
    let mut streams: HashMap<Vec<u8>, (Option<u32>, Vec<u8>)> = HashMap::new();
    for (ip, tcp, proto) in ip_packets(path) {
        if proto != 6 || tcp.len() < 20 {
            continue;
        }
        let addrs = if ip.len() == 40 {
            &ip[8..40]
        } else {
            &ip[12..20]
        };
        let mut key = addrs.to_vec();
        key.extend_from_slice(&tcp[..4]);
        let seq = u32::from_be_bytes([tcp[4], tcp[5], tcp[6], tcp[7]]);
        let doff = usize::from(tcp[12] >> 4) * 4;
        let syn = tcp[13] & 0x02 != 0;
        let payload = tcp.get(doff..).unwrap_or_default();
        if !streams.contains_key(&key) {
            order.push(key.clone());
        }
        let (next, data) = streams.entry(key).or_insert((None, Vec::new()));
        if syn {
            *next = Some(seq.wrapping_add(1));
            continue;
        }
        if payload.is_empty() {
            continue;
        }
        segments.push(payload.to_vec());
        let Some(n) = *next else { continue };
        let behind = n.wrapping_sub(seq) as usize;
        if behind >= payload.len() {
            continue; // a retransmission, or a segment past a hole
        }
        data.extend_from_slice(&payload[behind..]);
        *next = Some(n.wrapping_add((payload.len() - behind) as u32));
    }
    let streams = order
        .into_iter()
        .map(|k| streams.remove(&k).unwrap().1)
        .filter(|d| !d.is_empty())
        .collect();
    (segments, streams)
}

/// Where each FPDU of `buf` starts, as far as they parse (CRC not judged).
fn fpdu_starts(buf: &[u8]) -> Vec<usize> {
    let mut starts = Vec::new();
    let mut at = 0;
    while at < buf.len() {
        starts.push(at);
        match Fpdu::parse(&buf[at..]) {
            Ok((_, n)) => at += n,
            Err(_) => break,
        }
    }
    starts
}

/// Whether every FPDU of `buf` parses with its CRC checked.
fn all_crcs_check(buf: &[u8]) -> bool {
    let mut rest = buf;
    while !rest.is_empty() {
        match mpa::parse_fpdu(rest, true) {
            Ok((_, n)) => rest = &rest[n..],
            Err(_) => return false,
        }
    }
    true
}

/// The ULPDUs of a run of FPDUs.
fn ulpdus_of(buf: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut rest = buf;
    while let Ok((u, n)) = mpa::parse_fpdu(rest, false) {
        out.push(u.to_vec());
        rest = &rest[n..];
    }
    out
}

fn random_addrs(rng: &mut StdRng, v6: bool) -> (IpAddr, IpAddr) {
    if v6 {
        (
            IpAddr::V6(Ipv6Addr::from(rng.gen::<[u8; 16]>())),
            IpAddr::V6(Ipv6Addr::from(rng.gen::<[u8; 16]>())),
        )
    } else {
        (
            IpAddr::V4(Ipv4Addr::from(rng.gen::<[u8; 4]>())),
            IpAddr::V4(Ipv4Addr::from(rng.gen::<[u8; 4]>())),
        )
    }
}

/// CM MADs built with the encoders: every attribute with zero and random bodies, and rdma_cm
/// REQ / SIDR_REQ / SIDR_REP messages carrying a cma_hdr over IPv4 and IPv6.
fn built_mads(rng: &mut StdRng) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for &a in &ATTRS {
        for k in 0..4 {
            let mut body = [0u8; MAD_DATA_LEN];
            if k > 0 {
                rng.fill(&mut body[..]);
            }
            let msg = CmMessage::parse(a, &body).expect("every 232-byte body parses");
            let mut m = CmMad::send(rng.gen(), msg);
            m.header.attr_mod = if k == 3 { rng.gen() } else { 0 };
            if a == attr::CLASS_PORT_INFO {
                m.header.method =
                    [mad::method::GET, mad::method::SET, mad::method::GET_RESP][k % 3];
            }
            out.push(m.emit().expect("a parsed message re-encodes").to_vec());
        }
    }
    for v6 in [false, true] {
        let (src, dst) = random_addrs(rng, v6);
        let pd = CmaHdr {
            src_port: rng.gen(),
            src,
            dst,
        }
        .with_user_data(b"robustness", cma::limits::CONNECT)
        .unwrap();
        let req = cm::Req {
            local_comm_id: rng.gen(),
            service_id: cma::service_id(PortSpace::Tcp, 7471),
            local_ca_guid: rng.gen(),
            local_qpn: rng.gen_range(0..1 << 24),
            starting_psn: rng.gen_range(0..1 << 24),
            pkey: 0xFFFF,
            path_mtu: 3,
            primary_path: cm::ReqPath {
                local_lid: 0xFFFF,
                remote_lid: 0xFFFF,
                local_gid: Gid::from_ip(src),
                remote_gid: Gid::from_ip(dst),
                hop_limit: 64,
                ..cm::ReqPath::default()
            },
            private_data: pd.clone(),
            ..cm::Req::default()
        };
        out.push(
            CmMad::send(rng.gen(), CmMessage::Req(req))
                .emit()
                .unwrap()
                .to_vec(),
        );
        let sidr = cm::SidrReq {
            request_id: rng.gen(),
            pkey: 0xFFFF,
            service_id: cma::service_id(PortSpace::Udp, 7174),
            private_data: pd,
            ..cm::SidrReq::default()
        };
        out.push(
            CmMad::send(rng.gen(), CmMessage::SidrReq(sidr))
                .emit()
                .unwrap()
                .to_vec(),
        );
        let rep = cm::SidrRep {
            request_id: rng.gen(),
            qpn: rng.gen_range(0..1 << 24),
            service_id: cma::service_id(PortSpace::Udp, 7174),
            qkey: cma::RDMA_UDP_QKEY,
            ..cm::SidrRep::default()
        };
        out.push(
            CmMad::send(rng.gen(), CmMessage::SidrRep(rep))
                .emit()
                .unwrap()
                .to_vec(),
        );
    }
    out
}

/// Wraps `payload` in a UD datagram as rxe would send it, under a raw IP header whose masked
/// fields (TOS/traffic class, TTL/hop limit, checksums) hold random values.
fn built_datagram(rng: &mut StdRng, v6: bool, bth: &Bth, deth: &Deth, payload: &[u8]) -> RoceSeed {
    let (src, dst) = random_addrs(rng, v6);
    let sport = rng.gen::<u16>() | 0xC000;
    let ident: u16 = rng.gen();
    let icrc_ip = match (src, dst) {
        (IpAddr::V4(src), IpAddr::V4(dst)) => IpForIcrc::V4 {
            src,
            dst,
            ident,
            dont_fragment: true,
        },
        (IpAddr::V6(src), IpAddr::V6(dst)) => IpForIcrc::V6 { src, dst },
        _ => unreachable!(),
    };
    let body = roce::emit_ud(&icrc_ip, sport, bth, deth, payload);
    let udp_len = (8 + body.len()) as u16;
    let mut udp = Vec::with_capacity(usize::from(udp_len));
    udp.extend_from_slice(&sport.to_be_bytes());
    udp.extend_from_slice(&roce::ROCE_V2_UDP_PORT.to_be_bytes());
    udp.extend_from_slice(&udp_len.to_be_bytes());
    udp.extend_from_slice(&rng.gen::<u16>().to_be_bytes());
    udp.extend_from_slice(&body);
    let ip = match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let total = udp_len + 20;
            let mut h = vec![
                0x45,
                rng.gen(),
                (total >> 8) as u8,
                total as u8,
                (ident >> 8) as u8,
                ident as u8,
                0x40,
                0,
                rng.gen(),
                17,
                rng.gen(),
                rng.gen(),
            ];
            h.extend_from_slice(&s.octets());
            h.extend_from_slice(&d.octets());
            h
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let mut h = vec![
                0x60 | rng.gen_range(0..16u8),
                rng.gen(),
                rng.gen(),
                rng.gen(),
                (udp_len >> 8) as u8,
                udp_len as u8,
                17,
                rng.gen(),
            ];
            h.extend_from_slice(&s.octets());
            h.extend_from_slice(&d.octets());
            h
        }
        _ => unreachable!(),
    };
    roce::verify_icrc(&ip, &udp).unwrap_or_else(|e| {
        panic!(
            "send-side ICRC disagrees with the raw-header one: {e}\n{}",
            hex(&udp)
        )
    });
    RoceSeed { ip, udp }
}

/// MPA Requests and Replies built with the encoders, over the range of PD lengths and flags.
fn built_frames(rng: &mut StdRng) -> Vec<MpaFrame> {
    let mut v = Vec::new();
    for pd_len in [0usize, 1, 3, 4, 5, 56, 252, 256, 508, 512] {
        let pd = random_bytes_exact(rng, pd_len);
        v.push(MpaFrame::request_v1(pd.clone()));
        v.push(MpaFrame::reply_v1(pd.clone()));
        v.push(MpaFrame::reject_v1(pd.clone()));
        if pd_len <= mpa::RFC_MAX_PRIVATE_DATA - mpa::ENHANCED_LEN {
            let (ird, ord) = (
                rng.gen_range(0..=mpa::IRD_ORD_MAX),
                rng.gen_range(0..=mpa::IRD_ORD_MAX),
            );
            v.push(MpaFrame::request_v2(ird, ord, pd.clone()));
            v.push(MpaFrame::reply_v2(ird, ord, pd.clone()));
            v.push(MpaFrame::reject_v2(ird, ord, pd));
        }
    }
    let mut p2p = MpaFrame::request_v2(16, 16, b"p2p".to_vec());
    p2p.flags.crc = true;
    p2p.enhanced = Some(Enhanced {
        peer_to_peer: true,
        zero_len_write_rtr: true,
        zero_len_send_rtr: true,
        zero_len_read_rtr: true,
        ..Enhanced::new(mpa::IRD_ORD_MAX, 1)
    });
    v.push(p2p);
    for reserved in 0..8 {
        let mut f = MpaFrame::reply_v1(vec![reserved; usize::from(reserved)]);
        f.flags.reserved = reserved;
        f.flags.markers = reserved & 1 != 0;
        f.flags.crc = reserved & 2 != 0;
        f.flags.gso_exp = reserved & 4 != 0;
        v.push(f);
    }
    // Revision 1 with the Enhanced flag: the flag is kept, no IRD/ORD words are read.
    let mut f = MpaFrame::request_v1(b"v1+E".to_vec());
    f.flags.enhanced = true;
    v.push(f);
    v
}

fn random_bytes_exact(rng: &mut StdRng, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    rng.fill(&mut v[..]);
    v
}

/// ULPDUs built with the encoders: Sends, Terminates of every shape, tagged RDMA Writes (the
/// zero-length RTR), Read Requests, reserved bits and undefined opcodes.
fn built_ulpdus(rng: &mut StdRng) -> Vec<Vec<u8>> {
    let mut v = Vec::new();
    for n in [0usize, 1, 2, 3, 4, 100, 1000] {
        v.push(mpa::send_ulpdu(
            mpa::QN_SEND,
            rng.gen(),
            0,
            &random_bytes_exact(rng, n),
        ));
    }
    for code in 0..=8 {
        v.push(mpa::terminate_ulpdu(mpa::QN_TERMINATE, 1, &Terminate::llp(code)).unwrap());
    }
    let offending = DdpRdmapHeader::untagged(RdmapOpcode::Send, 0, 7, 0)
        .to_vec()
        .unwrap();
    for (m, d, r) in [
        (true, false, false),
        (false, true, true),
        (true, true, true),
    ] {
        let t = Terminate {
            layer: mpa::term_layer::DDP,
            error_type: mpa::term_etype::DDP_UNTAGGED_BUFFER,
            error_code: rng.gen(),
            m,
            d,
            r,
            reserved: rng.gen_range(0..0x2000),
            ddp_segment_length: Some(rng.gen()),
            copied_headers: if d { offending.clone() } else { Vec::new() },
        };
        v.push(mpa::terminate_ulpdu(mpa::QN_TERMINATE, 2, &t).unwrap());
    }
    let mut write = DdpRdmapHeader::tagged(RdmapOpcode::RdmaWrite, rng.gen(), rng.gen())
        .to_vec()
        .unwrap();
    v.push(write.clone());
    write.extend_from_slice(&random_bytes_exact(rng, 37));
    v.push(write);
    let mut rr = DdpRdmapHeader::untagged(RdmapOpcode::RdmaReadRequest, mpa::QN_READ_REQUEST, 1, 0)
        .to_vec()
        .unwrap();
    rr.extend_from_slice(
        &ReadRequest {
            sink_stag: rng.gen(),
            sink_to: rng.gen(),
            size: rng.gen(),
            source_stag: rng.gen(),
            source_to: rng.gen(),
        }
        .to_bytes(),
    );
    v.push(rr);
    let odd = DdpRdmapHeader {
        last: false,
        ddp_reserved: 0x0F,
        rdmap_reserved: 3,
        opcode: RdmapOpcode::Other(9),
        buffer: mpa::DdpBuffer::Untagged {
            rsvd_ulp: rng.gen(),
            qn: rng.gen(),
            msn: rng.gen(),
            mo: rng.gen(),
        },
    };
    v.push(odd.to_vec().unwrap());
    v
}

fn framed(ulpdus: &[&[u8]], crc_on: bool) -> FpduSeed {
    let mut bytes = Vec::new();
    let mut starts = Vec::new();
    for u in ulpdus {
        starts.push(bytes.len());
        mpa::emit_fpdu(u, crc_on, &mut bytes).unwrap();
    }
    FpduSeed {
        bytes,
        crc_on,
        starts,
    }
}

fn build_seeds() -> Seeds {
    let mut rng = StdRng::seed_from_u64(0x5EED_5EED);
    let mut s = Seeds::default();

    // RoCEv2: every datagram of the captures.
    for path in pcap_files("roce") {
        s.roce.extend(roce_datagrams(&path));
    }
    s.captured_roce = s.roce.len();
    for d in &s.roce {
        let payload = &d.udp[8..];
        if let Ok(g) = GsiDatagram::parse(payload) {
            s.mads.push(g.mad.to_vec());
        }
    }
    // The encoders' MADs, alone and as GSI datagrams; and UD datagrams with pad.
    let built = built_mads(&mut rng);
    for (k, m) in built.iter().enumerate() {
        let bth = Bth::gsi(rng.gen());
        s.roce
            .push(built_datagram(&mut rng, k % 2 == 1, &bth, &Deth::GSI, m));
    }
    s.mads.extend(built);
    for n in [0usize, 1, 2, 3, 5, 64, 255] {
        let bth = Bth {
            dest_qp: rng.gen_range(2..1 << 24),
            solicited: rng.gen(),
            ..Bth::gsi(rng.gen())
        };
        let deth = Deth {
            qkey: cma::RDMA_UDP_QKEY,
            reserved: 0,
            src_qp: rng.gen_range(0..1 << 24),
        };
        let payload = random_bytes_exact(&mut rng, n);
        s.roce
            .push(built_datagram(&mut rng, n % 2 == 0, &bth, &deth, &payload));
    }
    s.udp_donors = s.roce.iter().map(|d| d.udp.clone()).collect();

    // rdma_cm: the cma_hdr-bearing private data and the service IDs of the MADs.
    for m in &s.mads {
        if let Ok(mad) = CmMad::parse(m) {
            match &mad.msg {
                CmMessage::Req(r) => {
                    s.cma.push(r.private_data.clone());
                    s.service_ids.push(r.service_id);
                }
                CmMessage::SidrReq(r) => {
                    s.cma.push(r.private_data.clone());
                    s.service_ids.push(r.service_id);
                }
                CmMessage::SidrRep(r) => s.service_ids.push(r.service_id),
                _ => {}
            }
        }
    }
    for ps in [
        PortSpace::Ipoib,
        PortSpace::Tcp,
        PortSpace::Udp,
        PortSpace::Ib,
    ] {
        for port in [0, 1, ps.default_port(), 0xFFFF, rng.gen()] {
            s.service_ids.push(cma::service_id(ps, port));
        }
    }
    for v6 in [false, true] {
        let (src, dst) = random_addrs(&mut rng, v6);
        let h = CmaHdr {
            src_port: rng.gen(),
            src,
            dst,
        };
        s.cma.push(h.with_user_data(&[], 0).unwrap());
        let user = random_bytes_exact(&mut rng, cma::limits::CONNECT_UD);
        s.cma
            .push(h.with_user_data(&user, cma::limits::CONNECT_UD).unwrap());
    }

    // iWARP: each direction's stream starts with a Request or Reply; FPDUs follow.
    let raw = std::fs::read(captures_dir().join("iwarp/e2-mpa-request.bin")).unwrap();
    s.frames.push(raw);
    for path in pcap_files("iwarp") {
        let (segments, streams) = tcp_payloads(&path);
        s.captured_tcp_segments += segments.len();
        s.captured_streams += streams.len();
        for seg in segments {
            s.fpdu_donors.push(seg.clone());
            s.frames.push(seg);
        }
        for st in streams {
            s.frames.push(st.clone());
            let Ok((_, n)) = MpaFrame::parse_with_limit(&st, usize::MAX) else {
                continue;
            };
            let rest = &st[n..];
            if !rest.is_empty() {
                s.ulpdus.extend(ulpdus_of(rest));
                s.fpdus.push(FpduSeed {
                    bytes: rest.to_vec(),
                    crc_on: all_crcs_check(rest),
                    starts: fpdu_starts(rest),
                });
            }
            s.streams.push(StreamSeed {
                fpdu_starts: fpdu_starts(rest).iter().map(|a| a + n).collect(),
                bytes: st,
            });
        }
    }
    let frames = built_frames(&mut rng);
    let ulpdus = built_ulpdus(&mut rng);
    for u in &ulpdus {
        for crc_on in [false, true] {
            s.fpdus.push(framed(&[u], crc_on));
        }
    }
    for _ in 0..16 {
        let crc_on = rng.gen();
        let picked: Vec<&[u8]> = (0..rng.gen_range(2..=4))
            .map(|_| ulpdus.choose(&mut rng).unwrap().as_slice())
            .collect();
        s.fpdus.push(framed(&picked, crc_on));
    }
    for f in &frames {
        let bytes = f.to_vec().expect("a built frame encodes");
        s.frames.push(bytes.clone());
        // The same frame followed by FPDUs, as a stream reader would see it.
        let picked: Vec<&[u8]> = (0..rng.gen_range(0..=3))
            .map(|_| ulpdus.choose(&mut rng).unwrap().as_slice())
            .collect();
        let tail = framed(&picked, f.flags.crc);
        let mut st = bytes.clone();
        st.extend_from_slice(&tail.bytes);
        s.streams.push(StreamSeed {
            fpdu_starts: tail.starts.iter().map(|a| a + bytes.len()).collect(),
            bytes: st,
        });
    }
    s.ulpdus.extend(ulpdus);
    s.fpdu_donors
        .extend(s.fpdus.iter().map(|f| f.bytes.clone()));
    s
}

fn seeds() -> &'static Seeds {
    static SEEDS: OnceLock<Seeds> = OnceLock::new();
    SEEDS.get_or_init(build_seeds)
}

// ---------------------------------------------------------------------------------------------
// Decoding with properties
// ---------------------------------------------------------------------------------------------

/// The UDP payload a receiver would hand on: bounded by the UDP length field when trusted (as
/// a capture reader does), else everything after the header.
fn udp_payload(udp: &[u8], trust_len_field: bool) -> &[u8] {
    if udp.len() < 8 {
        return &[];
    }
    let end = if trust_len_field {
        usize::from(be16(udp, 4)).clamp(8, udp.len())
    } else {
        udp.len()
    };
    &udp[8..end]
}

fn decode_roce(run: &mut Run, ip: &[u8], udp: &[u8], payload: &[u8]) {
    let verdict = roce::verify_icrc(ip, udp);
    run.count("roce::verify_icrc", &verdict);
    let computed = roce::icrc_for_raw_ip(ip, &udp[..udp.len().saturating_sub(ICRC_LEN)]);
    run.count("roce::icrc_for_raw_ip", &computed);
    if udp.len() >= 8 + BTH_LEN + ICRC_LEN {
        // verify_icrc is exactly "the carried ICRC equals icrc_for_raw_ip".
        let at = udp.len() - ICRC_LEN;
        let carried = u32::from_le_bytes([udp[at], udp[at + 1], udp[at + 2], udp[at + 3]]);
        match (&verdict, &computed) {
            (Ok(()), Ok(c)) => assert_eq!(*c, carried),
            (
                Err(WireError::BadCrc {
                    carried: a,
                    computed: b,
                    ..
                }),
                Ok(c),
            ) => {
                assert_eq!((*a, *b), (carried, *c));
                assert_ne!(carried, *c);
            }
            (Err(_), Err(_)) => {}
            other => panic!("verify_icrc and icrc_for_raw_ip disagree: {other:?}"),
        }
    }

    let bth = Bth::parse(payload);
    run.count("roce::Bth::parse", &bth);
    if let Ok(b) = &bth {
        let mut out = [0u8; BTH_LEN];
        b.emit(&mut out);
        assert_eq!(&out[..], &payload[..BTH_LEN], "BTH parse -> emit is exact");
    }
    let deth_bytes = payload.get(BTH_LEN..).unwrap_or_default();
    let deth = Deth::parse(deth_bytes);
    run.count("roce::Deth::parse", &deth);
    if let Ok(d) = &deth {
        let mut out = [0u8; roce::DETH_LEN];
        d.emit(&mut out);
        assert_eq!(
            &out[..],
            &deth_bytes[..roce::DETH_LEN],
            "DETH parse -> emit is exact"
        );
    }

    let pkt = RocePacket::parse(payload);
    run.count("roce::RocePacket::parse", &pkt);
    if let Ok(p) = &pkt {
        assert_eq!(Ok(p.bth), bth);
        let at = payload.len() - ICRC_LEN;
        assert_eq!(
            p.icrc,
            u32::from_le_bytes([
                payload[at],
                payload[at + 1],
                payload[at + 2],
                payload[at + 3]
            ])
        );
        match (p.payload, p.bth.opcode.ext_headers_len()) {
            (Some(body), Some(ext)) => {
                assert_eq!(p.ext_headers.len(), ext);
                let pad = usize::from(p.bth.pad_count);
                assert_eq!(
                    BTH_LEN + ext + body.len() + pad + ICRC_LEN,
                    payload.len(),
                    "RocePacket accounts for every byte, claims none beyond"
                );
                assert_eq!(p.deth.is_some(), p.bth.opcode.transport() == 3);
                if let Some(d) = p.deth {
                    assert_eq!(Ok(d), deth);
                }
            }
            (None, None) => assert!(p.ext_headers.is_empty() && p.deth.is_none()),
            other => panic!("payload located for an unknown layout or vice versa: {other:?}"),
        }
    }

    let gsi = GsiDatagram::parse(payload);
    run.count("roce::GsiDatagram::parse", &gsi);
    if let Ok(g) = &gsi {
        let p = pkt.as_ref().expect("a GSI datagram is a RoCE packet");
        assert_eq!(g.bth.opcode, roce::Opcode::UD_SEND_ONLY);
        assert_eq!(g.bth.dest_qp, roce::GSI_QPN);
        assert_eq!(g.deth.qkey, roce::GSI_QKEY);
        assert_eq!(
            payload.len(),
            roce::GSI_UDP_PAYLOAD_LEN + usize::from(p.bth.pad_count)
        );
        decode_mad(run, &g.mad[..]);
    }
}

fn decode_mad(run: &mut Run, buf: &[u8]) {
    let header = MadHeader::parse(buf);
    run.count("mad::MadHeader::parse", &header);
    if let Ok(h) = &header {
        let mut out = [0u8; MAD_HEADER_LEN];
        h.emit(&mut out);
        assert_eq!(
            &out[..],
            &buf[..MAD_HEADER_LEN],
            "MAD header parse -> emit is exact"
        );
    }
    let parsed = CmMad::parse(buf);
    run.count("cm::CmMad::parse", &parsed);
    if let Ok(m) = &parsed {
        // (a) an accepted MAD re-encodes, and the encoding parses back to the same value.
        let bytes = m.emit().expect("(a): an accepted CM MAD re-encodes");
        let again = CmMad::parse(&bytes).expect("(a): the re-encoded MAD parses");
        assert_eq!(&again, m, "(a): CmMad parse -> emit -> parse");
        assert_eq!(Ok(m.header), header);
        // Every bit of a CM message body is a field, so the bytes come back too (ClassPortInfo
        // covers only 72 of the 232 body bytes; the rest goes out as zero).
        if m.header.attr_id == attr::CLASS_PORT_INFO {
            let end = MAD_HEADER_LEN + cm::ClassPortInfo::SIZE;
            assert_eq!(&bytes[..end], &buf[..end]);
            assert!(bytes[end..].iter().all(|&b| b == 0));
        } else {
            assert_eq!(
                &bytes[..],
                &buf[..roce::MAD_LEN],
                "CmMad parse -> emit is exact"
            );
        }
        match &m.msg {
            CmMessage::Req(r) => {
                decode_cma(run, &r.private_data);
                decode_service_id(run, r.service_id);
            }
            CmMessage::SidrReq(r) => {
                decode_cma(run, &r.private_data);
                decode_service_id(run, r.service_id);
            }
            CmMessage::SidrRep(r) => decode_service_id(run, r.service_id),
            _ => {}
        }
    }
    if let Ok(h) = header {
        // The body as the header's attribute, whatever the class checks said.
        decode_cm_message(run, h.attr_id, &buf[MAD_HEADER_LEN..]);
    }
}

fn decode_cm_message(run: &mut Run, attr_id: u16, data: &[u8]) {
    let parsed = CmMessage::parse(attr_id, data);
    run.count("cm::CmMessage::parse", &parsed);
    if let Ok(msg) = &parsed {
        assert_eq!(msg.attr_id(), attr_id);
        assert!(cm::attr_name(attr_id).is_some());
        let mut out = [0u8; MAD_DATA_LEN];
        msg.emit(&mut out)
            .expect("an accepted CM message re-encodes");
        assert_eq!(
            CmMessage::parse(attr_id, &out).as_ref(),
            Ok(msg),
            "CmMessage parse -> emit -> parse"
        );
        let covered = if attr_id == attr::CLASS_PORT_INFO {
            cm::ClassPortInfo::SIZE
        } else {
            MAD_DATA_LEN
        };
        assert_eq!(&out[..covered], &data[..covered]);
    }
}

fn decode_cma(run: &mut Run, pd: &[u8]) {
    let parsed = CmaHdr::parse(pd);
    run.count("cma::CmaHdr::parse", &parsed);
    if let Ok(h) = &parsed {
        assert_eq!(pd[0], cma::CMA_VERSION);
        assert_eq!(h.src_port, be16(pd, 2));
        let v6 = match pd[1] >> 4 {
            4 => false,
            6 => true,
            other => panic!("cma_hdr accepted with IP version {other}"),
        };
        assert_eq!(h.src.is_ipv6(), v6);
        assert_eq!(h.dst.is_ipv6(), v6);
        let mut out = [0u8; CMA_HDR_LEN];
        h.emit(&mut out).expect("an accepted cma_hdr re-encodes");
        assert_eq!(
            CmaHdr::parse(&out).as_ref(),
            Ok(h),
            "cma_hdr parse -> emit -> parse"
        );
        if v6 {
            assert_eq!(&out[4..CMA_HDR_LEN], &pd[4..CMA_HDR_LEN]);
        } else {
            assert_eq!(&out[16..20], &pd[16..20]);
            assert_eq!(&out[32..36], &pd[32..36]);
        }
    }
}

fn decode_service_id(run: &mut Run, sid: u64) {
    let parsed = cma::parse_service_id(sid);
    run.count_opt("cma::parse_service_id", parsed.as_ref());
    match parsed {
        Some((ps, port)) => assert_eq!(cma::service_id(ps, port), sid),
        None => assert!(sid >> 32 != 0 || PortSpace::from_value((sid >> 16) as u16).is_none()),
    }
}

/// PD_Length limits handed to `parse_with_limit`: around the RFC and Linux limits and the
/// enhanced minimum, plus none at all.
const LIMITS: [usize; 11] = [0, 3, 4, 5, 255, 256, 257, 511, 512, 513, usize::MAX];

fn decode_frame(run: &mut Run, buf: &[u8], limit: usize) {
    let parsed = MpaFrame::parse(buf);
    run.count("mpa::MpaFrame::parse", &parsed);
    if let Ok((f, n)) = &parsed {
        // (b) and (c): no more bytes than given, and the frame re-encodes to exactly them.
        assert!(
            *n <= buf.len(),
            "(c): MpaFrame claims {n} of {} bytes",
            buf.len()
        );
        assert_eq!(*n, MPA_FRAME_HEADER_LEN + f.pd_length());
        assert_eq!(usize::from(be16(buf, 18)), f.pd_length());
        assert!(f.pd_length() <= mpa::RFC_MAX_PRIVATE_DATA);
        let bytes = f.to_vec().expect("(b): an accepted frame re-encodes");
        assert_eq!(
            &bytes[..],
            &buf[..*n],
            "(b): MpaFrame parse -> emit is exact"
        );
        assert_eq!(
            MpaFrame::parse(&bytes).as_ref(),
            Ok(&(f.clone(), *n)),
            "(b): MpaFrame parse -> emit -> parse"
        );
        assert_eq!(
            f.check_linux_limits().is_ok(),
            f.pd_length() <= mpa::MAX_PRIVATE_DATA
        );
        assert_eq!(
            f.enhanced.is_some(),
            f.revision == mpa::REVISION_2 && f.flags.enhanced
        );
    }
    let limited = MpaFrame::parse_with_limit(buf, limit);
    run.count("mpa::MpaFrame::parse_with_limit", &limited);
    let unlimited = MpaFrame::parse_with_limit(buf, usize::MAX);
    // A limit only ever turns an accepted frame whose PD_Length exceeds it into an error.
    match (&limited, &unlimited) {
        (Ok(a), Ok(b)) => {
            assert_eq!(a, b);
            assert!(a.0.pd_length() <= limit);
        }
        (Err(_), Ok((f, _))) => assert!(f.pd_length() > limit, "limit {limit} refused {f:?}"),
        (Ok(_), Err(e)) => panic!("accepted under limit {limit}, refused with none: {e}"),
        (Err(_), Err(_)) => {}
    }
    if let Ok((f, n)) = &unlimited {
        assert!(
            *n <= buf.len(),
            "(c): MpaFrame claims {n} of {} bytes",
            buf.len()
        );
        if f.pd_length() <= mpa::RFC_MAX_PRIVATE_DATA {
            assert_eq!(f.to_vec().as_deref(), Ok(&buf[..*n]));
        } else {
            assert!(f.to_vec().is_err(), "PD_Length over the RFC limit encoded");
        }
    }
    let enh_bytes = buf.get(MPA_FRAME_HEADER_LEN..).unwrap_or_default();
    let enh = Enhanced::parse(enh_bytes);
    run.count("mpa::Enhanced::parse", &enh);
    if let Ok(e) = &enh {
        assert_eq!(e.to_bytes().as_ref().map(|b| &b[..]), Ok(&enh_bytes[..4]));
    }
}

/// Walks a run of FPDUs as a receiver would, checking every accepted one.
fn decode_fpdus(run: &mut Run, buf: &[u8], crc_on: bool) {
    let mut rest = buf;
    loop {
        let split = Fpdu::parse(rest);
        run.count("mpa::Fpdu::parse", &split);
        let with_crc = mpa::parse_fpdu(rest, true);
        run.count("mpa::parse_fpdu (CRC on)", &with_crc);
        let without = mpa::parse_fpdu(rest, false);
        run.count("mpa::parse_fpdu (CRC off)", &without);
        let Ok((f, n)) = split else {
            let e = split.err();
            assert_eq!(with_crc.err(), e);
            assert_eq!(without.err(), e);
            return;
        };
        let ulen = usize::from(be16(rest, 0));
        assert!(
            n <= rest.len(),
            "(c): FPDU claims {n} of {} bytes",
            rest.len()
        );
        assert_eq!(n, mpa::fpdu_len(ulen));
        assert_eq!(n % 4, 0);
        assert_eq!(f.ulpdu, &rest[2..2 + ulen]);
        assert_eq!(f.pad, &rest[2 + ulen..n - mpa::FPDU_CRC_LEN]);
        assert_eq!(f.pad.len(), mpa::fpdu_pad(ulen));
        assert_eq!(without, Ok((f.ulpdu, n)));
        let crc_ok = f.computed_crc() == f.crc;
        assert_eq!(f.verify_crc().is_ok(), crc_ok);
        match &with_crc {
            Ok(r) => {
                assert!(crc_ok);
                assert_eq!(*r, (f.ulpdu, n));
            }
            Err(WireError::BadCrc { carried, .. }) => {
                assert!(!crc_ok);
                assert_eq!(*carried, f.crc);
            }
            Err(e) => panic!("parse_fpdu with CRC: {e} on a splittable FPDU"),
        }
        let zero_pad = f.pad.iter().all(|&b| b == 0);
        if zero_pad && (crc_ok || f.crc == 0) {
            let mut again = Vec::new();
            mpa::emit_fpdu(f.ulpdu, crc_ok, &mut again).unwrap();
            assert_eq!(&again[..], &rest[..n], "FPDU parse -> emit is exact");
        }
        decode_ulpdu(run, f.ulpdu);
        if crc_on && !crc_ok {
            return; // a receiver with CRC on tears the stream down here
        }
        rest = &rest[n..];
        if rest.is_empty() {
            return;
        }
    }
}

fn decode_ulpdu(run: &mut Run, ulpdu: &[u8]) {
    let parsed = DdpRdmapHeader::parse(ulpdu);
    run.count("mpa::DdpRdmapHeader::parse", &parsed);
    let payload = match &parsed {
        Ok((h, hl)) => {
            assert!(
                *hl <= ulpdu.len(),
                "(c): DDP header claims {hl} of {}",
                ulpdu.len()
            );
            assert_eq!(*hl, h.buffer_len());
            assert_eq!(
                h.to_vec().as_deref(),
                Ok(&ulpdu[..*hl]),
                "DDP/RDMAP parse -> emit is exact"
            );
            &ulpdu[*hl..]
        }
        // Still give the payload decoders something shaped like a payload.
        Err(_) => ulpdu.get(mpa::UNTAGGED_HEADER_LEN..).unwrap_or_default(),
    };
    let term = Terminate::parse(payload);
    run.count("mpa::Terminate::parse", &term);
    if let Ok(t) = &term {
        assert_eq!(
            t.buffer_len(),
            payload.len(),
            "Terminate takes the whole payload"
        );
        assert_eq!(t.ddp_segment_length.is_some(), t.m || t.d);
        assert_eq!(
            t.to_vec().as_deref(),
            Ok(payload),
            "Terminate parse -> emit is exact"
        );
    }
    let rr = ReadRequest::parse(payload);
    run.count("mpa::ReadRequest::parse", &rr);
    if let Ok(r) = &rr {
        assert_eq!(&r.to_bytes()[..], &payload[..ReadRequest::LEN]);
    }
}

// ---------------------------------------------------------------------------------------------
// The stream reader
// ---------------------------------------------------------------------------------------------

/// What a stream reader got out of the bytes: frames, ULPDUs, and at most one fatal error
/// (its variant and the field or structure it names; the numbers in it may legitimately
/// depend on how much had arrived, e.g. the key bytes seen so far).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Event {
    Frame(MpaFrame),
    Ulpdu(Vec<u8>),
    Fatal(&'static str, &'static str),
}

fn fatal(e: &WireError) -> Event {
    match e {
        WireError::Truncated { what, .. } => Event::Fatal("Truncated", what),
        WireError::BadLength { what, .. } => Event::Fatal("BadLength", what),
        WireError::BadField { field, .. } => Event::Fatal("BadField", field),
        WireError::BadCrc { what, .. } => Event::Fatal("BadCrc", what),
        WireError::PrivateDataTooLong { what, .. } => Event::Fatal("PrivateDataTooLong", what),
        WireError::FieldOverflow { field, .. } => Event::Fatal("FieldOverflow", field),
    }
}

/// A minimal MPA receiver: a Request or Reply first, then FPDUs (CRC as the frame asked),
/// waiting whenever a parser says `Truncated`.
#[derive(Default)]
struct StreamReader {
    buf: Vec<u8>,
    consumed: usize,
    crc_on: Option<bool>,
    events: Vec<Event>,
    dead: bool,
}

impl StreamReader {
    fn feed(&mut self, run: &mut Run, chunk: &[u8]) {
        if self.dead {
            return;
        }
        self.buf.extend_from_slice(chunk);
        loop {
            let avail = &self.buf[self.consumed..];
            let step = match self.crc_on {
                None => {
                    let r = MpaFrame::parse(avail);
                    run.count("mpa::MpaFrame::parse", &r);
                    r.map(|(f, n)| (Event::Frame(f), n))
                }
                Some(crc) => {
                    let r = mpa::parse_fpdu(avail, crc);
                    run.count("mpa::parse_fpdu", &r);
                    r.map(|(u, n)| (Event::Ulpdu(u.to_vec()), n))
                }
            };
            match step {
                Ok((ev, n)) => {
                    assert!(n > 0, "a parser accepted without consuming: no progress");
                    assert!(
                        n <= avail.len(),
                        "(c): claimed {n} of {} bytes",
                        avail.len()
                    );
                    if let Event::Frame(f) = &ev {
                        self.crc_on = Some(f.flags.crc);
                    }
                    self.events.push(ev);
                    self.consumed += n;
                }
                Err(WireError::Truncated { .. }) => return,
                Err(e) => {
                    self.events.push(fatal(&e));
                    self.dead = true;
                    return;
                }
            }
        }
    }
}

fn read_stream(run: &mut Run, chunks: &[&[u8]]) -> StreamReader {
    let mut r = StreamReader::default();
    for c in chunks {
        r.feed(run, c);
    }
    r
}

// ---------------------------------------------------------------------------------------------
// The tests
// ---------------------------------------------------------------------------------------------

#[test]
fn roce_datagrams_survive_hostile_input() {
    let s = seeds();
    let mut run = Run::new("roce", 250);
    println!(
        "robustness/roce: {} datagrams ({} captured), {} of them GSI MADs",
        s.roce.len(),
        s.captured_roce,
        s.mads.len()
    );
    for i in 0..run.iters {
        let rng = &mut run.rng;
        let (ip, udp) = if rng.gen_ratio(1, 20) {
            let mut ip = random_bytes(rng, 48);
            if let Some(b) = ip.first_mut() {
                *b = *[0x45, 0x60, *b].choose(rng).unwrap();
            }
            (ip, random_bytes(rng, 400))
        } else {
            let seed = s.roce.choose(rng).unwrap();
            let (mut ip, mut udp) = (seed.ip.clone(), seed.udp.clone());
            if rng.gen_ratio(1, 5) {
                for _ in 0..op_count(rng) {
                    mutate_ip_fields(rng, &mut ip);
                }
            }
            if rng.gen_ratio(9, 10) {
                mutate(rng, &mut udp, &s.udp_donors, &mutate_udp_fields);
            }
            (ip, udp)
        };
        let trust_len = rng.gen_bool(0.7);
        run.guard(i, &[("ip", &ip), ("udp", &udp)], |run| {
            decode_roce(run, &ip, &udp, udp_payload(&udp, trust_len));
        });
    }
    run.finish(&[
        "roce::verify_icrc",
        "roce::icrc_for_raw_ip",
        "roce::Bth::parse",
        "roce::Deth::parse",
        "roce::RocePacket::parse",
        "roce::GsiDatagram::parse",
        "cm::CmMad::parse",
        "cm::CmMessage::parse",
    ]);
}

#[test]
fn cm_mads_survive_hostile_input() {
    let s = seeds();
    let mut run = Run::new("cm_mad", 200);
    for i in 0..run.iters {
        let rng = &mut run.rng;
        let buf = if rng.gen_ratio(1, 20) {
            let mut b = random_bytes(rng, 300);
            if b.len() >= MAD_HEADER_LEN && rng.gen() {
                mutate_mad_fields(rng, &mut b, 0);
            }
            b
        } else {
            let mut b = s.mads.choose(rng).unwrap().clone();
            mutate(rng, &mut b, &s.mads, &|r, b| mutate_mad_fields(r, b, 0));
            b
        };
        let other_attr = if rng.gen_bool(0.9) {
            *ATTRS.choose(rng).unwrap()
        } else {
            rng.gen()
        };
        run.guard(i, &[("mad", &buf)], |run| {
            decode_mad(run, &buf);
            // The body read as another message, as an attribute-ID swap would have it.
            decode_cm_message(
                run,
                other_attr,
                buf.get(MAD_HEADER_LEN..).unwrap_or_default(),
            );
        });
    }
    run.finish(&[
        "mad::MadHeader::parse",
        "cm::CmMad::parse",
        "cm::CmMessage::parse",
        "cma::CmaHdr::parse",
        "cma::parse_service_id",
    ]);
}

#[test]
fn cma_headers_and_service_ids_survive_hostile_input() {
    let s = seeds();
    let mut run = Run::new("cma", 100);
    for i in 0..run.iters {
        let rng = &mut run.rng;
        let pd = if rng.gen_ratio(1, 10) {
            let mut b = random_bytes(rng, 64);
            if let Some(v) = b.first_mut() {
                *v = 0;
            }
            b
        } else {
            let mut b = s.cma.choose(rng).unwrap().clone();
            mutate(
                rng,
                &mut b,
                &s.cma,
                &|r: &mut StdRng, b: &mut Vec<u8>| match (r.gen_range(0..3), b.len()) {
                    (0, 1..) => b[0] = *[0, 1, 0xFF, r.gen()].choose(r).unwrap(),
                    (1, 2..) => {
                        b[1] = (*[4u8, 6, 0, 5, 15, r.gen_range(0..16)].choose(r).unwrap() << 4)
                            | r.gen_range(0..16u8);
                    }
                    _ => {
                        let n = *[0, 35, 36, 37, r.gen_range(0..=b.len())].choose(r).unwrap();
                        b.truncate(n);
                    }
                },
            );
            b
        };
        let sid = match rng.gen_range(0..4) {
            0 => rng.gen(),
            1 => rng.gen::<u32>().into(),
            2 => {
                let ps = *[0x0002u64, 0x0106, 0x0111, 0x013F].choose(rng).unwrap();
                (rng.gen_range(0..4u64) << 32) | (ps << 16) | u64::from(rng.gen::<u16>())
            }
            _ => s.service_ids.choose(rng).unwrap() ^ (1u64 << rng.gen_range(0..64u32)),
        };
        run.guard(
            i,
            &[("pd", &pd), ("service_id", &sid.to_be_bytes())],
            |run| {
                decode_cma(run, &pd);
                decode_service_id(run, sid);
            },
        );
    }
    run.finish(&["cma::CmaHdr::parse", "cma::parse_service_id"]);
}

#[test]
fn mpa_frames_survive_hostile_input() {
    let s = seeds();
    let mut run = Run::new("mpa_frame", 200);
    println!(
        "robustness/mpa_frame: {} frame seeds ({} captured TCP segments, {} captured streams)",
        s.frames.len(),
        s.captured_tcp_segments,
        s.captured_streams
    );
    for i in 0..run.iters {
        let rng = &mut run.rng;
        let buf = if rng.gen_ratio(1, 20) {
            let mut b = random_bytes(rng, 600);
            if rng.gen() {
                // A valid key, so the rest of the header is judged too.
                let key = if rng.gen() {
                    &mpa::REQ_KEY
                } else {
                    &mpa::REP_KEY
                };
                let n = b.len().min(16);
                b[..n].copy_from_slice(&key[..n]);
            }
            b
        } else {
            let mut b = s.frames.choose(rng).unwrap().clone();
            mutate(rng, &mut b, &s.frames, &mutate_frame_fields);
            b
        };
        let limit = if rng.gen() {
            *LIMITS.choose(rng).unwrap()
        } else {
            rng.gen_range(0..700)
        };
        run.guard(i, &[("frame", &buf)], |run| decode_frame(run, &buf, limit));
    }
    run.finish(&[
        "mpa::MpaFrame::parse",
        "mpa::MpaFrame::parse_with_limit",
        "mpa::Enhanced::parse",
    ]);
}

#[test]
fn fpdus_and_ddp_rdmap_survive_hostile_input() {
    let s = seeds();
    let mut run = Run::new("fpdu", 200);
    for i in 0..run.iters {
        let rng = &mut run.rng;
        match rng.gen_range(0..10) {
            0..=5 => {
                let seed = s.fpdus.choose(rng).unwrap();
                let mut b = seed.bytes.clone();
                mutate(rng, &mut b, &s.fpdu_donors, &|r, b| {
                    mutate_fpdu_fields(r, b, &seed.starts);
                });
                let crc_on = if rng.gen_ratio(9, 10) {
                    seed.crc_on
                } else {
                    !seed.crc_on
                };
                run.guard(i, &[("fpdus", &b)], |run| decode_fpdus(run, &b, crc_on));
            }
            6..=8 => {
                let mut u = s.ulpdus.choose(rng).unwrap().clone();
                mutate(rng, &mut u, &s.ulpdus, &|r, b| {
                    mutate_fpdu_fields(r, b, &[]);
                });
                // Mutated at offset 0 as if it were an FPDU; shift so the DDP bytes get it too.
                if rng.gen() && u.len() > 2 {
                    u.rotate_left(2);
                }
                run.guard(i, &[("ulpdu", &u)], |run| decode_ulpdu(run, &u));
            }
            _ => {
                let b = random_bytes(rng, 300);
                let crc_on = rng.gen();
                run.guard(i, &[("random", &b)], |run| {
                    decode_fpdus(run, &b, crc_on);
                    decode_ulpdu(run, &b);
                });
            }
        }
    }
    run.finish(&[
        "mpa::Fpdu::parse",
        "mpa::parse_fpdu (CRC on)",
        "mpa::parse_fpdu (CRC off)",
        "mpa::DdpRdmapHeader::parse",
        "mpa::Terminate::parse",
        "mpa::ReadRequest::parse",
    ]);
}

/// `Truncated` means "a valid prefix, read more": so a stream reader must reach the same frames,
/// ULPDUs and verdict whether the bytes come all at once or in chunks of any size.
#[test]
fn mpa_stream_reader_does_not_depend_on_chunking() {
    let s = seeds();
    let mut run = Run::new("mpa_stream", 50);
    for i in 0..run.iters {
        let rng = &mut run.rng;
        let seed = s.streams.choose(rng).unwrap();
        let mut b = seed.bytes.clone();
        mutate(rng, &mut b, &s.frames, &|r, b| {
            if r.gen() {
                mutate_frame_fields(r, b);
            } else {
                mutate_fpdu_fields(r, b, &seed.fpdu_starts);
            }
        });
        let mut cuts = Vec::new();
        let mut at = 0;
        let style = rng.gen_range(0..6);
        while at < b.len() {
            let n = match style {
                0 => 1,
                1 => rng.gen_range(1..=4),
                2 => *[1, 2, 3, 4, 8, 16, 19, 20, 21].choose(rng).unwrap(),
                3 => rng.gen_range(1..=64),
                _ => rng.gen_range(1..=b.len()),
            };
            at = (at + n).min(b.len());
            cuts.push(at);
        }
        run.guard(i, &[("stream", &b)], |run| {
            let whole = read_stream(run, &[&b]);
            let mut chunks = Vec::with_capacity(cuts.len());
            let mut from = 0;
            for &c in &cuts {
                chunks.push(&b[from..c]);
                from = c;
            }
            let chunked = read_stream(run, &chunks);
            assert_eq!(
                chunked.events, whole.events,
                "chunking changed what was read"
            );
            assert_eq!(chunked.consumed, whole.consumed);
            assert_eq!(chunked.dead, whole.dead);
        });
    }
    run.finish(&["mpa::MpaFrame::parse", "mpa::parse_fpdu"]);
}

/// (d) CRC-32 detects every single-bit error, so flipping any bit the ICRC covers must fail
/// verification; flipping a masked (variant) bit must not change the verdict. Exhaustive over
/// every bit of every seed datagram and its IP header.
#[test]
fn icrc_catches_every_single_bit_flip_outside_the_masked_fields() {
    let s = seeds();
    let mut rng = StdRng::seed_from_u64(env_u64("RCM_ROBUSTNESS_SEED").unwrap_or(DEFAULT_SEED));
    let (mut covered, mut masked) = (0u64, 0u64);
    for (k, seed) in s.roce.iter().enumerate() {
        let (mut ip, mut udp) = (seed.ip.clone(), seed.udp.clone());
        roce::verify_icrc(&ip, &udp).unwrap_or_else(|e| panic!("seed {k} does not verify: {e}"));
        let v6 = ip[0] >> 4 == 6;
        // Bits of each byte that the ICRC replaces with ones.
        let ip_mask = |i: usize| -> u8 {
            match (v6, i) {
                (true, 0) => 0x0F,                                    // traffic class, high
                (true, 1..=3 | 7) | (false, 1 | 8 | 10 | 11) => 0xFF, // TC, flow label, hop limit; TOS, TTL, checksum
                _ => 0,
            }
        };
        let udp_mask = |i: usize| -> u8 {
            match i {
                6 | 7 | 12 => 0xFF, // UDP checksum; BTH byte 4 (FECN, BECN, Resv6a)
                _ => 0,
            }
        };
        for (part, mask) in [(0, &ip_mask as &dyn Fn(usize) -> u8), (1, &udp_mask)] {
            let len = if part == 0 { ip.len() } else { udp.len() };
            for byte in 0..len {
                for bit in 0..8 {
                    let flip = 1u8 << bit;
                    if part == 0 {
                        ip[byte] ^= flip;
                    } else {
                        udp[byte] ^= flip;
                    }
                    let r = roce::verify_icrc(&ip, &udp);
                    if part == 0 {
                        ip[byte] ^= flip;
                    } else {
                        udp[byte] ^= flip;
                    }
                    let where_ = if part == 0 {
                        "IP header"
                    } else {
                        "UDP datagram"
                    };
                    if mask(byte) & flip != 0 {
                        masked += 1;
                        assert!(
                            r.is_ok(),
                            "seed {k}: masked bit {bit} of {where_} byte {byte} changed the verdict: {r:?}"
                        );
                    } else {
                        covered += 1;
                        assert!(
                            r.is_err(),
                            "seed {k}: flipping bit {bit} of {where_} byte {byte} still verifies"
                        );
                    }
                }
            }
        }
        // Every masked field at once, to random values.
        for _ in 0..32 {
            let (mut ip2, mut udp2) = (ip.clone(), udp.clone());
            for (i, b) in ip2.iter_mut().enumerate() {
                *b ^= rng.gen::<u8>() & ip_mask(i);
            }
            for (i, b) in udp2.iter_mut().enumerate() {
                *b ^= rng.gen::<u8>() & udp_mask(i);
            }
            assert!(
                roce::verify_icrc(&ip2, &udp2).is_ok(),
                "seed {k}: masked fields changed the verdict"
            );
            masked += 1;
        }
    }
    println!(
        "robustness/icrc: {} datagrams, {covered} covered single-bit flips all refused, \
         {masked} masked-field changes all still verified",
        s.roce.len()
    );
    assert!(covered > 100_000);
}

/// (c) for every prefix of every seed: a decoder either says `Truncated` (for the framed
/// parsers, exactly while the prefix is shorter than what the whole buffer parses to) or
/// accepts without claiming more than it was given.
#[test]
fn every_prefix_of_every_seed_is_truncated_or_self_consistent() {
    let s = seeds();
    let mut run = Run::new("prefixes", 0);

    for seed in &s.roce {
        let payload = &seed.udp[8..];
        let whole = RocePacket::parse(payload).is_ok();
        for cut in 0..=seed.udp.len() {
            let udp = &seed.udp[..cut];
            run.guard(u64::try_from(cut).unwrap(), &[("udp", &seed.udp)], |run| {
                decode_roce(run, &seed.ip, udp, udp_payload(udp, false));
            });
        }
        assert!(whole, "a seed datagram parses");
    }
    for m in &s.mads {
        for cut in 0..m.len() {
            let p = &m[..cut];
            run.guard(u64::try_from(cut).unwrap(), &[("mad", m)], |run| {
                let r = CmMad::parse(p);
                run.count("cm::CmMad::parse", &r);
                assert!(is_trunc(&r), "CmMad accepted {cut} bytes");
                let h = MadHeader::parse(p);
                run.count("mad::MadHeader::parse", &h);
                assert_eq!(is_trunc(&h), cut < MAD_HEADER_LEN);
                if let Ok(hdr) = h {
                    let body = &p[MAD_HEADER_LEN..];
                    let msg = CmMessage::parse(hdr.attr_id, body);
                    run.count("cm::CmMessage::parse", &msg);
                    let size = if hdr.attr_id == attr::CLASS_PORT_INFO {
                        cm::ClassPortInfo::SIZE
                    } else {
                        MAD_DATA_LEN
                    };
                    if cm::attr_name(hdr.attr_id).is_some() {
                        assert_eq!(is_trunc(&msg), body.len() < size);
                    }
                }
            });
        }
    }
    for pd in &s.cma {
        let whole = CmaHdr::parse(pd);
        for cut in 0..=pd.len() {
            let r = CmaHdr::parse(&pd[..cut]);
            run.count("cma::CmaHdr::parse", &r);
            if cut < CMA_HDR_LEN {
                assert!(is_trunc(&r));
            } else {
                assert_eq!(r, whole);
            }
        }
    }
    for f in &s.frames {
        let whole = MpaFrame::parse_with_limit(f, usize::MAX);
        for cut in 0..=f.len() {
            let p = &f[..cut];
            run.guard(u64::try_from(cut).unwrap(), &[("frame", f)], |run| {
                decode_frame(run, p, usize::MAX);
                let r = MpaFrame::parse_with_limit(p, usize::MAX);
                if let Ok((_, n)) = &whole {
                    if cut < *n {
                        assert!(is_trunc(&r), "prefix {cut} of a {n}-byte frame: {r:?}");
                    } else {
                        assert_eq!(&r, &whole);
                    }
                }
            });
        }
    }
    for seed in &s.fpdus {
        let whole = Fpdu::parse(&seed.bytes).map(|(_, n)| n);
        for cut in 0..=seed.bytes.len() {
            let p = &seed.bytes[..cut];
            run.guard(
                u64::try_from(cut).unwrap(),
                &[("fpdus", &seed.bytes)],
                |run| {
                    decode_fpdus(run, p, seed.crc_on);
                    let r = mpa::parse_fpdu(p, seed.crc_on);
                    if let Ok(n) = &whole {
                        assert_eq!(is_trunc(&r), cut < *n, "prefix {cut} of a {n}-byte FPDU");
                    }
                },
            );
        }
    }
    for u in &s.ulpdus {
        let whole = DdpRdmapHeader::parse(u);
        for cut in 0..=u.len() {
            let p = &u[..cut];
            run.guard(u64::try_from(cut).unwrap(), &[("ulpdu", u)], |run| {
                decode_ulpdu(run, p);
                let r = DdpRdmapHeader::parse(p);
                if let Ok((h, hl)) = &whole {
                    if cut < *hl {
                        assert!(is_trunc(&r), "prefix {cut} of a {hl}-byte header");
                    } else {
                        assert_eq!(r, Ok((*h, *hl)));
                    }
                }
            });
        }
    }
    run.finish(&[]);
}
