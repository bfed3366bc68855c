//! Reading packet captures: pcap/pcapng files into IP-level packets, and TCP stream reassembly.
//!
//! [`read_pcap`] (and [`read_pcap_from`], [`read_pcap_bytes`]) turn a classic pcap (micro- or
//! nanosecond, either byte order) or a pcapng file into a [`Capture`]: one [`CapturedPacket`] per
//! frame, each carrying either a decoded [`NetPacket`] (link layer, IP header, UDP/TCP) or the
//! [`FrameError`] that says why the frame could not be decoded. Nothing here panics on the bytes
//! of the file.
//!
//! [`TcpStreams`] reassembles TCP payloads, per direction, into in-order byte streams.
// The owner wires these items into `rcm decode` later; until then some are used only by tests.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::io::{self, Cursor, Read};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use pcap_file::pcap::PcapReader;
use pcap_file::pcapng::blocks::interface_description::{
    InterfaceDescriptionBlock, InterfaceDescriptionOption,
};
use pcap_file::pcapng::{Block, PcapNgReader};
use pcap_file::{PcapError, TsResolution};

/// Link type numbers (tcpdump.org `LINKTYPE_*`) understood by [`decode_frame`].
pub mod linktype {
    /// BSD loopback: a 4-byte address family in the capturing host's byte order.
    pub const NULL: u32 = 0;
    /// Ethernet II (with up to a few 802.1Q / 802.1ad tags).
    pub const ETHERNET: u32 = 1;
    /// Raw IP on some BSDs (DLT_RAW = 12).
    pub const RAW_12: u32 = 12;
    /// Raw IP on some BSDs (DLT_RAW = 14).
    pub const RAW_14: u32 = 14;
    /// Raw IP (LINKTYPE_RAW).
    pub const RAW: u32 = 101;
    /// OpenBSD loopback: a 4-byte address family in network byte order.
    pub const LOOP: u32 = 108;
    /// Linux "cooked" capture v1 (`tcpdump -i any`).
    pub const LINUX_SLL: u32 = 113;
    /// Raw IPv4.
    pub const IPV4: u32 = 228;
    /// Raw IPv6.
    pub const IPV6: u32 = 229;
    /// Linux "cooked" capture v2.
    pub const LINUX_SLL2: u32 = 276;
}

/// IP protocol number of TCP.
pub const IPPROTO_TCP: u8 = 6;
/// IP protocol number of UDP.
pub const IPPROTO_UDP: u8 = 17;
/// Ethertype of IPv4.
pub const ETHERTYPE_IPV4: u16 = 0x0800;
/// Ethertype of IPv6.
pub const ETHERTYPE_IPV6: u16 = 0x86DD;
/// Ethertype of an 802.1Q VLAN tag.
pub const ETHERTYPE_VLAN: u16 = 0x8100;
/// Ethertype of an 802.1ad (QinQ) service tag.
pub const ETHERTYPE_QINQ: u16 = 0x88A8;
/// Legacy QinQ tag ethertype.
const ETHERTYPE_QINQ_OLD: u16 = 0x9100;
/// Most VLAN tags accepted in one frame.
const MAX_VLAN_TAGS: usize = 4;

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// Why a whole capture file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// The file could not be opened or read.
    #[error("cannot read {}: {source}", path.display())]
    Open {
        /// The path given.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// An I/O error from the reader.
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
    /// The input is shorter than any capture file header.
    #[error("not a capture file: only {0} bytes")]
    TooShort(usize),
    /// The first four bytes are neither a pcap nor a pcapng magic number.
    #[error("not a pcap or pcapng file (magic 0x{0:08x})")]
    BadMagic(u32),
    /// The pcap global header or pcapng section header is invalid.
    #[error("invalid capture file header: {0}")]
    Header(PcapError),
    /// Writing a capture failed.
    #[error("cannot write capture: {0}")]
    Write(PcapError),
}

/// Why one frame could not be decoded down to UDP/TCP/other-over-IP.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// A header or the length announced by a header runs past the captured bytes.
    #[error("truncated {what}: need {need} bytes, have {have}")]
    Truncated {
        /// Which header or body.
        what: &'static str,
        /// Bytes needed.
        need: usize,
        /// Bytes available.
        have: usize,
    },
    /// The frame is well-formed at the link layer but does not carry IP (ARP, LLDP, RoCEv1, ...).
    #[error("not IP: ethertype 0x{ethertype:04x}")]
    NotIp {
        /// The (innermost) ethertype or SLL protocol.
        ethertype: u16,
        /// Offset in the frame of the payload that follows that ethertype.
        payload_offset: usize,
    },
    /// The capture's link type is not one [`decode_frame`] knows.
    #[error("unsupported link type {0}")]
    UnsupportedLinkType(u32),
    /// A loopback (NULL/LOOP) frame with an address family that is not IPv4/IPv6.
    #[error("loopback frame with unsupported address family {0}")]
    UnsupportedFamily(u32),
    /// An IPv4 fragment or an IPv6 packet with a Fragment header: transport not decodable.
    #[error("IP fragment (offset {offset} bytes, more fragments: {more})")]
    Fragment {
        /// Fragment offset in bytes.
        offset: u32,
        /// More-fragments flag.
        more: bool,
    },
    /// A header field holds an impossible value.
    #[error("malformed {0}")]
    Malformed(String),
}

fn need(what: &'static str, data: &[u8], n: usize) -> Result<(), FrameError> {
    if data.len() < n {
        Err(FrameError::Truncated {
            what,
            need: n,
            have: data.len(),
        })
    } else {
        Ok(())
    }
}

fn be16(d: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([d[at], d[at + 1]])
}

fn be32(d: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([d[at], d[at + 1], d[at + 2], d[at + 3]])
}

// ---------------------------------------------------------------------------------------------
// Decoded packet types
// ---------------------------------------------------------------------------------------------

/// One 802.1Q / 802.1ad tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VlanTag {
    /// Tag protocol identifier (0x8100, 0x88a8, 0x9100).
    pub tpid: u16,
    /// Tag control information: PCP (3 bits), DEI (1), VID (12).
    pub tci: u16,
}

impl VlanTag {
    /// The 12-bit VLAN ID.
    pub fn vid(self) -> u16 {
        self.tci & 0x0FFF
    }

    /// The 3-bit priority code point.
    pub fn pcp(self) -> u8 {
        (self.tci >> 13) as u8
    }
}

/// What the link layer said about a frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkInfo {
    /// The capture link type the frame was decoded with.
    pub linktype: u32,
    /// Source MAC (Ethernet; SLL/SLL2 when the link address is 6 bytes).
    pub src_mac: Option<[u8; 6]>,
    /// Destination MAC (Ethernet only).
    pub dst_mac: Option<[u8; 6]>,
    /// VLAN tags, outermost first.
    pub vlans: Vec<VlanTag>,
    /// The ethertype that announced the IP packet (None for raw IP and loopback).
    pub ethertype: Option<u16>,
    /// Length of the link-layer header (offset of the IP header in the frame).
    pub header_len: usize,
}

/// The IP header of a packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpInfo {
    /// The exact raw header bytes: IPv4 header including options (IHL × 4 bytes), or the 40-byte
    /// IPv6 base header (extension headers are in [`IpInfo::ext_headers`]).
    pub header: Vec<u8>,
    /// Raw IPv6 extension headers that were skipped (hop-by-hop, routing, destination options,
    /// AH); empty for IPv4.
    pub ext_headers: Vec<u8>,
    /// True if the IPv4 header has options or the IPv6 packet has extension headers.
    pub has_options: bool,
    /// Source address.
    pub src: IpAddr,
    /// Destination address.
    pub dst: IpAddr,
    /// IPv4 TTL or IPv6 hop limit.
    pub ttl: u8,
    /// IPv4 TOS or IPv6 traffic class (DSCP << 2 | ECN).
    pub tos: u8,
    /// IPv4 identification (None for IPv6).
    pub ident: Option<u16>,
    /// IPv4 Don't Fragment flag (false for IPv6).
    pub dont_fragment: bool,
    /// IPv6 flow label (None for IPv4).
    pub flow_label: Option<u32>,
    /// IPv4 header checksum field as found (None for IPv6).
    pub header_checksum: Option<u16>,
    /// The transport protocol number (after any IPv6 extension headers).
    pub protocol: u8,
    /// IP packet length from the header: IPv4 total length, or 40 + IPv6 payload length.
    /// Bytes of the frame after this (Ethernet padding) are not part of the packet.
    pub total_len: usize,
}

impl IpInfo {
    /// True for IPv4.
    pub fn is_ipv4(&self) -> bool {
        self.src.is_ipv4()
    }

    /// True if the IPv4 header checksum verifies (always true for IPv6, which has none).
    pub fn header_checksum_ok(&self) -> bool {
        if !self.is_ipv4() {
            return true;
        }
        let mut sum: u32 = 0;
        for pair in self.header.chunks(2) {
            let hi = pair[0];
            let lo = pair.get(1).copied().unwrap_or(0);
            sum += u32::from(u16::from_be_bytes([hi, lo]));
        }
        while sum > 0xFFFF {
            sum = (sum & 0xFFFF) + (sum >> 16);
        }
        sum == 0xFFFF
    }
}

/// TCP header flags (the low 8 bits of the flags field).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct TcpFlags(pub u8);

impl TcpFlags {
    /// FIN.
    pub const FIN: TcpFlags = TcpFlags(0x01);
    /// SYN.
    pub const SYN: TcpFlags = TcpFlags(0x02);
    /// RST.
    pub const RST: TcpFlags = TcpFlags(0x04);
    /// PSH.
    pub const PSH: TcpFlags = TcpFlags(0x08);
    /// ACK.
    pub const ACK: TcpFlags = TcpFlags(0x10);
    /// URG.
    pub const URG: TcpFlags = TcpFlags(0x20);

    /// True if every flag in `other` is set.
    pub fn contains(self, other: TcpFlags) -> bool {
        self.0 & other.0 == other.0
    }
    /// FIN set.
    pub fn fin(self) -> bool {
        self.contains(Self::FIN)
    }
    /// SYN set.
    pub fn syn(self) -> bool {
        self.contains(Self::SYN)
    }
    /// RST set.
    pub fn rst(self) -> bool {
        self.contains(Self::RST)
    }
    /// PSH set.
    pub fn psh(self) -> bool {
        self.contains(Self::PSH)
    }
    /// ACK set.
    pub fn ack(self) -> bool {
        self.contains(Self::ACK)
    }
}

impl std::ops::BitOr for TcpFlags {
    type Output = TcpFlags;
    fn bitor(self, rhs: TcpFlags) -> TcpFlags {
        TcpFlags(self.0 | rhs.0)
    }
}

impl fmt::Display for TcpFlags {
    /// Formats like tshark: `SYN, ACK`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const NAMES: [(u8, &str); 8] = [
            (0x80, "CWR"),
            (0x40, "ECE"),
            (0x20, "URG"),
            (0x10, "ACK"),
            (0x08, "PSH"),
            (0x04, "RST"),
            (0x02, "SYN"),
            (0x01, "FIN"),
        ];
        let mut first = true;
        // tshark order: FIN, SYN, RST, PSH, ACK, URG, ECE, CWR.
        for (bit, name) in NAMES.iter().rev() {
            if self.0 & bit != 0 {
                if !first {
                    f.write_str(", ")?;
                }
                f.write_str(name)?;
                first = false;
            }
        }
        Ok(())
    }
}

/// The transport layer of an IP packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transport {
    /// UDP.
    Udp {
        /// Source port.
        src_port: u16,
        /// Destination port.
        dst_port: u16,
        /// The UDP length field (header + payload).
        length_field: u16,
        /// The checksum field (0 = none, as Linux rxe sends for RoCEv2).
        checksum: u16,
        /// The raw 8-byte UDP header.
        header: [u8; 8],
        /// The payload, bounded by the UDP length field (not by the end of the frame).
        payload: Vec<u8>,
    },
    /// TCP.
    Tcp {
        /// Source port.
        src_port: u16,
        /// Destination port.
        dst_port: u16,
        /// Sequence number.
        seq: u32,
        /// Acknowledgement number.
        ack: u32,
        /// Flags.
        flags: TcpFlags,
        /// Receive window (unscaled).
        window: u16,
        /// Checksum field.
        checksum: u16,
        /// Raw header including options (data offset × 4 bytes).
        header: Vec<u8>,
        /// Segment payload, bounded by the IP length.
        payload: Vec<u8>,
    },
    /// Any other protocol.
    Other {
        /// IP protocol number / IPv6 next header.
        protocol: u8,
        /// Bytes after the IP header(s), bounded by the IP length.
        payload: Vec<u8>,
    },
}

/// A frame decoded down to the transport layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetPacket {
    /// Link-layer facts.
    pub link: LinkInfo,
    /// The IP header.
    pub ip: IpInfo,
    /// The transport layer.
    pub transport: Transport,
}

impl NetPacket {
    /// Source socket address (port 0 for [`Transport::Other`]).
    pub fn src(&self) -> SocketAddr {
        SocketAddr::new(self.ip.src, self.ports().0)
    }

    /// Destination socket address (port 0 for [`Transport::Other`]).
    pub fn dst(&self) -> SocketAddr {
        SocketAddr::new(self.ip.dst, self.ports().1)
    }

    /// (source, destination) ports, (0, 0) for [`Transport::Other`].
    pub fn ports(&self) -> (u16, u16) {
        match &self.transport {
            Transport::Udp {
                src_port, dst_port, ..
            }
            | Transport::Tcp {
                src_port, dst_port, ..
            } => (*src_port, *dst_port),
            Transport::Other { .. } => (0, 0),
        }
    }

    /// The UDP payload, if this is UDP.
    pub fn udp_payload(&self) -> Option<&[u8]> {
        match &self.transport {
            Transport::Udp { payload, .. } => Some(payload),
            _ => None,
        }
    }
}

/// One frame of a capture.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapturedPacket {
    /// 1-based frame number, as tshark counts.
    pub index: usize,
    /// Timestamp since the Unix epoch.
    pub ts: Duration,
    /// The link type of the interface the frame came from.
    pub linktype: u32,
    /// Length of the frame on the wire (may exceed `frame.len()` when snapped).
    pub orig_len: u32,
    /// The captured bytes.
    pub frame: Vec<u8>,
    /// The decoded packet, or why it could not be decoded.
    pub net: Result<NetPacket, FrameError>,
}

impl CapturedPacket {
    /// Time since `origin` (e.g. [`Capture::first_ts`]), zero if earlier.
    pub fn since(&self, origin: Duration) -> Duration {
        self.ts.saturating_sub(origin)
    }

    /// True if the capture snapped this frame (fewer bytes captured than were on the wire).
    pub fn is_snapped(&self) -> bool {
        (self.frame.len() as u64) < u64::from(self.orig_len)
    }
}

/// The container format a capture was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaptureFormat {
    /// Classic libpcap.
    Pcap {
        /// Nanosecond timestamps (magic 0xa1b23c4d).
        nanosecond: bool,
        /// Big-endian file.
        big_endian: bool,
        /// The global link type.
        linktype: u32,
    },
    /// pcapng.
    PcapNg,
}

/// A whole capture file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capture {
    /// The container format.
    pub format: CaptureFormat,
    /// Every packet record, in file order.
    pub packets: Vec<CapturedPacket>,
    /// Set if reading stopped early (the file is cut in the middle of a record, or a record is
    /// corrupt); the packets before that point are still in `packets`.
    pub warning: Option<String>,
}

impl Capture {
    /// Timestamp of the first packet.
    pub fn first_ts(&self) -> Option<Duration> {
        self.packets.first().map(|p| p.ts)
    }

    /// Time of `pkt` relative to the first packet (what tshark prints in its summary).
    pub fn relative(&self, pkt: &CapturedPacket) -> Duration {
        pkt.since(self.first_ts().unwrap_or_default())
    }
}

// ---------------------------------------------------------------------------------------------
// Reading files
// ---------------------------------------------------------------------------------------------

/// Reads a pcap or pcapng file.
pub fn read_pcap(path: impl AsRef<Path>) -> Result<Capture, CaptureError> {
    let path = path.as_ref();
    let file = std::fs::File::open(path).map_err(|source| CaptureError::Open {
        path: path.to_path_buf(),
        source,
    })?;
    read_pcap_from(io::BufReader::new(file))
}

/// Reads a pcap or pcapng capture held in memory.
pub fn read_pcap_bytes(bytes: &[u8]) -> Result<Capture, CaptureError> {
    read_pcap_from(bytes)
}

/// Reads a pcap or pcapng capture from any reader; the format is detected from the magic number.
pub fn read_pcap_from<R: Read>(mut reader: R) -> Result<Capture, CaptureError> {
    let mut magic = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match reader.read(&mut magic[got..]) {
            Ok(0) => return Err(CaptureError::TooShort(got)),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(CaptureError::Io(e)),
        }
    }
    let chained = Cursor::new(magic).chain(reader);
    match u32::from_be_bytes(magic) {
        0xA1B2_C3D4 | 0xD4C3_B2A1 | 0xA1B2_3C4D | 0x4D3C_B2A1 => read_classic(chained),
        0x0A0D_0D0A => read_ng(chained),
        other => Err(CaptureError::BadMagic(other)),
    }
}

fn header_error(e: PcapError) -> CaptureError {
    match e {
        PcapError::IoError(io) if io.kind() == io::ErrorKind::UnexpectedEof => {
            CaptureError::Header(PcapError::InvalidField("file ends inside the header"))
        }
        PcapError::IoError(io) => CaptureError::Io(io),
        other => CaptureError::Header(other),
    }
}

fn record_warning(e: &PcapError, after: usize) -> String {
    match e {
        PcapError::IoError(io) if io.kind() == io::ErrorKind::UnexpectedEof => {
            format!("file is cut short in the middle of a record after frame {after}")
        }
        other => format!("stopped reading after frame {after}: {other}"),
    }
}

fn make_packet(
    index: usize,
    ts: Duration,
    linktype: u32,
    orig_len: u32,
    frame: Vec<u8>,
) -> CapturedPacket {
    let net = decode_frame(linktype, &frame);
    CapturedPacket {
        index,
        ts,
        linktype,
        orig_len,
        frame,
        net,
    }
}

fn read_classic<R: Read>(reader: R) -> Result<Capture, CaptureError> {
    let mut rd = PcapReader::new(reader).map_err(header_error)?;
    let header = rd.header();
    let linktype = u32::from(header.datalink);
    let nanosecond = header.ts_resolution == TsResolution::NanoSecond;
    let format = CaptureFormat::Pcap {
        nanosecond,
        big_endian: header.endianness.is_big(),
        linktype,
    };
    let mut packets = Vec::new();
    let mut warning = None;
    while let Some(rec) = rd.next_raw_packet() {
        match rec {
            Ok(raw) => {
                let frac = u64::from(raw.ts_frac) * if nanosecond { 1 } else { 1000 };
                let ts = Duration::from_secs(u64::from(raw.ts_sec)) + Duration::from_nanos(frac);
                let index = packets.len() + 1;
                packets.push(make_packet(
                    index,
                    ts,
                    linktype,
                    raw.orig_len,
                    raw.data.into_owned(),
                ));
            }
            Err(e) => {
                warning = Some(record_warning(&e, packets.len()));
                break;
            }
        }
    }
    Ok(Capture {
        format,
        packets,
        warning,
    })
}

/// Converts a pcapng timestamp in interface units to a Duration, honouring `if_tsresol` and
/// `if_tsoffset`.
fn ng_timestamp(raw: u64, idb: Option<&InterfaceDescriptionBlock<'_>>) -> Duration {
    let mut resol: u8 = 6;
    let mut offset: i64 = 0;
    if let Some(idb) = idb {
        for opt in &idb.options {
            match opt {
                InterfaceDescriptionOption::IfTsResol(r) => resol = *r,
                InterfaceDescriptionOption::IfTsOffset(o) => {
                    offset = i64::from_ne_bytes(o.to_ne_bytes());
                }
                _ => {}
            }
        }
    }
    let units_per_sec: u128 = if resol & 0x80 != 0 {
        1u128 << u32::from((resol & 0x7F).min(100))
    } else {
        10u128.pow(u32::from(resol.min(30)))
    };
    let raw = u128::from(raw);
    let secs = raw / units_per_sec;
    let nanos = (raw % units_per_sec) * 1_000_000_000 / units_per_sec;
    let secs = u64::try_from(secs).unwrap_or(u64::MAX);
    let secs = if offset >= 0 {
        secs.saturating_add(offset.unsigned_abs())
    } else {
        secs.saturating_sub(offset.unsigned_abs())
    };
    // nanos < 1e9 by construction.
    Duration::new(secs, u32::try_from(nanos).unwrap_or(0))
}

fn read_ng<R: Read>(reader: R) -> Result<Capture, CaptureError> {
    let mut rd = PcapNgReader::new(reader).map_err(header_error)?;
    let mut packets = Vec::new();
    let mut warning = None;
    loop {
        // (interface id, raw timestamp units, original length, data)
        let rec: Option<(u32, Option<u64>, u32, Vec<u8>)> = match rd.next_block() {
            None => break,
            Some(Err(e)) => {
                warning = Some(record_warning(&e, packets.len()));
                break;
            }
            Some(Ok(Block::EnhancedPacket(epb))) => {
                let raw_ts = u64::try_from(epb.timestamp.as_nanos()).unwrap_or(u64::MAX);
                Some((
                    epb.interface_id,
                    Some(raw_ts),
                    epb.original_len,
                    epb.data.into_owned(),
                ))
            }
            Some(Ok(Block::SimplePacket(spb))) => {
                let mut data = spb.data.into_owned();
                // The block's data includes padding to 4 bytes; the original length bounds it.
                if let Ok(orig) = usize::try_from(spb.original_len) {
                    data.truncate(orig);
                }
                Some((0, None, spb.original_len, data))
            }
            Some(Ok(Block::Packet(pb))) => Some((
                u32::from(pb.interface_id),
                Some(pb.timestamp),
                pb.original_len,
                pb.data.into_owned(),
            )),
            Some(Ok(_)) => None,
        };
        let Some((iface, raw_ts, orig_len, data)) = rec else {
            continue;
        };
        let idb = usize::try_from(iface)
            .ok()
            .and_then(|i| rd.interfaces().get(i));
        let Some(idb) = idb else {
            warning = Some(format!(
                "stopped reading after frame {}: packet refers to undeclared interface {iface}",
                packets.len()
            ));
            break;
        };
        let linktype = u32::from(idb.linktype);
        let ts = raw_ts.map_or(Duration::ZERO, |t| ng_timestamp(t, Some(idb)));
        let index = packets.len() + 1;
        packets.push(make_packet(index, ts, linktype, orig_len, data));
    }
    Ok(Capture {
        format: CaptureFormat::PcapNg,
        packets,
        warning,
    })
}

// ---------------------------------------------------------------------------------------------
// Frame decoding
// ---------------------------------------------------------------------------------------------

/// What follows the link-layer header.
enum L3 {
    /// An ethertype (IPv4/IPv6 expected).
    Ether(u16),
    /// Raw IP: decide from the version nibble.
    AnyIp,
    /// Loopback address family.
    Family(u32),
}

fn ethertype_after_tags(
    frame: &[u8],
    mut at: usize,
    mut ethertype: u16,
    vlans: &mut Vec<VlanTag>,
) -> Result<(u16, usize), FrameError> {
    while matches!(
        ethertype,
        ETHERTYPE_VLAN | ETHERTYPE_QINQ | ETHERTYPE_QINQ_OLD
    ) {
        if vlans.len() >= MAX_VLAN_TAGS {
            return Err(FrameError::Malformed(format!(
                "link header: more than {MAX_VLAN_TAGS} VLAN tags"
            )));
        }
        need("VLAN tag", frame, at + 4)?;
        vlans.push(VlanTag {
            tpid: ethertype,
            tci: be16(frame, at),
        });
        ethertype = be16(frame, at + 2);
        at += 4;
    }
    Ok((ethertype, at))
}

fn mac(frame: &[u8], at: usize) -> [u8; 6] {
    let mut m = [0u8; 6];
    m.copy_from_slice(&frame[at..at + 6]);
    m
}

fn decode_link(linktype: u32, frame: &[u8]) -> Result<(LinkInfo, L3), FrameError> {
    let mut link = LinkInfo {
        linktype,
        src_mac: None,
        dst_mac: None,
        vlans: Vec::new(),
        ethertype: None,
        header_len: 0,
    };
    let l3 = match linktype {
        linktype::ETHERNET => {
            need("Ethernet header", frame, 14)?;
            link.dst_mac = Some(mac(frame, 0));
            link.src_mac = Some(mac(frame, 6));
            let first = be16(frame, 12);
            if first < 0x0600 {
                // 802.3 length field: LLC/SNAP, not IP for our purposes.
                return Err(FrameError::NotIp {
                    ethertype: first,
                    payload_offset: 14,
                });
            }
            let (et, at) = ethertype_after_tags(frame, 14, first, &mut link.vlans)?;
            link.ethertype = Some(et);
            link.header_len = at;
            L3::Ether(et)
        }
        linktype::LINUX_SLL => {
            need("Linux SLL header", frame, 16)?;
            let halen = be16(frame, 4);
            if halen == 6 {
                link.src_mac = Some(mac(frame, 6));
            }
            let (et, at) = ethertype_after_tags(frame, 16, be16(frame, 14), &mut link.vlans)?;
            link.ethertype = Some(et);
            link.header_len = at;
            L3::Ether(et)
        }
        linktype::LINUX_SLL2 => {
            need("Linux SLL2 header", frame, 20)?;
            if frame[11] == 6 {
                link.src_mac = Some(mac(frame, 12));
            }
            let (et, at) = ethertype_after_tags(frame, 20, be16(frame, 0), &mut link.vlans)?;
            link.ethertype = Some(et);
            link.header_len = at;
            L3::Ether(et)
        }
        linktype::RAW | linktype::RAW_12 | linktype::RAW_14 => L3::AnyIp,
        linktype::IPV4 => L3::Ether(ETHERTYPE_IPV4),
        linktype::IPV6 => L3::Ether(ETHERTYPE_IPV6),
        linktype::NULL | linktype::LOOP => {
            need("loopback header", frame, 4)?;
            let b = [frame[0], frame[1], frame[2], frame[3]];
            let family = if linktype == linktype::LOOP {
                u32::from_be_bytes(b)
            } else if b[0] == 0 && b[1] == 0 {
                // Host byte order of the capturing machine: families are < 65536, so zero
                // high bytes first means big-endian.
                u32::from_be_bytes(b)
            } else {
                u32::from_le_bytes(b)
            };
            link.header_len = 4;
            L3::Family(family)
        }
        other => return Err(FrameError::UnsupportedLinkType(other)),
    };
    Ok((link, l3))
}

/// Decodes one frame of the given link type down to the transport layer.
pub fn decode_frame(linktype: u32, frame: &[u8]) -> Result<NetPacket, FrameError> {
    let (link, l3) = decode_link(linktype, frame)?;
    let at = link.header_len;
    let rest = frame.get(at..).unwrap_or_default();
    let version = match l3 {
        L3::Ether(ETHERTYPE_IPV4) | L3::Family(2) => 4,
        L3::Ether(ETHERTYPE_IPV6) | L3::Family(10 | 24 | 28 | 30) => 6,
        L3::Ether(ethertype) => {
            return Err(FrameError::NotIp {
                ethertype,
                payload_offset: at,
            })
        }
        L3::AnyIp => {
            need("IP header", rest, 1)?;
            rest[0] >> 4
        }
        L3::Family(f) => return Err(FrameError::UnsupportedFamily(f)),
    };
    let (ip, transport) = decode_ip(version, rest)?;
    Ok(NetPacket {
        link,
        ip,
        transport,
    })
}

/// Decodes an IP packet (starting at its header) of the given version (4 or 6).
pub fn decode_ip(version: u8, data: &[u8]) -> Result<(IpInfo, Transport), FrameError> {
    let (ip, body) = match version {
        4 => decode_ipv4(data)?,
        6 => decode_ipv6(data)?,
        v => return Err(FrameError::Malformed(format!("IP header: version {v}"))),
    };
    let transport = decode_transport(ip.protocol, body)?;
    Ok((ip, transport))
}

fn decode_ipv4(data: &[u8]) -> Result<(IpInfo, &[u8]), FrameError> {
    need("IPv4 header", data, 20)?;
    let version = data[0] >> 4;
    if version != 4 {
        return Err(FrameError::Malformed(format!(
            "IPv4 header: version field is {version}"
        )));
    }
    let ihl = usize::from(data[0] & 0x0F) * 4;
    if ihl < 20 {
        return Err(FrameError::Malformed(format!(
            "IPv4 header: header length {ihl} < 20"
        )));
    }
    need("IPv4 header (with options)", data, ihl)?;
    let total_len = usize::from(be16(data, 2));
    if total_len < ihl {
        return Err(FrameError::Malformed(format!(
            "IPv4 header: total length {total_len} < header length {ihl}"
        )));
    }
    need("IPv4 packet", data, total_len)?;
    let frag = be16(data, 6);
    let more = frag & 0x2000 != 0;
    let offset = u32::from(frag & 0x1FFF) * 8;
    if more || offset != 0 {
        return Err(FrameError::Fragment { offset, more });
    }
    let ip = IpInfo {
        header: data[..ihl].to_vec(),
        ext_headers: Vec::new(),
        has_options: ihl > 20,
        src: IpAddr::V4(Ipv4Addr::new(data[12], data[13], data[14], data[15])),
        dst: IpAddr::V4(Ipv4Addr::new(data[16], data[17], data[18], data[19])),
        ttl: data[8],
        tos: data[1],
        ident: Some(be16(data, 4)),
        dont_fragment: frag & 0x4000 != 0,
        flow_label: None,
        header_checksum: Some(be16(data, 10)),
        protocol: data[9],
        total_len,
    };
    Ok((ip, &data[ihl..total_len]))
}

fn decode_ipv6(data: &[u8]) -> Result<(IpInfo, &[u8]), FrameError> {
    need("IPv6 header", data, 40)?;
    let version = data[0] >> 4;
    if version != 6 {
        return Err(FrameError::Malformed(format!(
            "IPv6 header: version field is {version}"
        )));
    }
    let word0 = be32(data, 0);
    let payload_len = usize::from(be16(data, 4));
    let total_len = 40 + payload_len;
    need("IPv6 packet", data, total_len)?;
    let packet = &data[..total_len];
    let mut next = data[6];
    let mut at = 40;
    loop {
        match next {
            // Hop-by-hop, routing, destination options: (len + 1) × 8 bytes.
            0 | 43 | 60 => {
                need("IPv6 extension header", packet, at + 2)?;
                let len = (usize::from(packet[at + 1]) + 1) * 8;
                need("IPv6 extension header", packet, at + len)?;
                next = packet[at];
                at += len;
            }
            // Authentication header: (len + 2) × 4 bytes.
            51 => {
                need("IPv6 authentication header", packet, at + 2)?;
                let len = (usize::from(packet[at + 1]) + 2) * 4;
                need("IPv6 authentication header", packet, at + len)?;
                next = packet[at];
                at += len;
            }
            44 => {
                need("IPv6 fragment header", packet, at + 8)?;
                let fo = be16(packet, at + 2);
                return Err(FrameError::Fragment {
                    offset: u32::from(fo & 0xFFF8),
                    more: fo & 1 != 0,
                });
            }
            _ => break,
        }
    }
    let mut src = [0u8; 16];
    src.copy_from_slice(&data[8..24]);
    let mut dst = [0u8; 16];
    dst.copy_from_slice(&data[24..40]);
    let ip = IpInfo {
        header: data[..40].to_vec(),
        ext_headers: packet[40..at].to_vec(),
        has_options: at > 40,
        src: IpAddr::V6(Ipv6Addr::from(src)),
        dst: IpAddr::V6(Ipv6Addr::from(dst)),
        ttl: data[7],
        tos: ((word0 >> 20) & 0xFF) as u8,
        ident: None,
        dont_fragment: false,
        flow_label: Some(word0 & 0x000F_FFFF),
        header_checksum: None,
        protocol: next,
        total_len,
    };
    Ok((ip, &packet[at..]))
}

fn decode_transport(protocol: u8, body: &[u8]) -> Result<Transport, FrameError> {
    match protocol {
        IPPROTO_UDP => {
            need("UDP header", body, 8)?;
            let length_field = be16(body, 4);
            let len = usize::from(length_field);
            if len < 8 {
                return Err(FrameError::Malformed(format!(
                    "UDP header: length field {len} < 8"
                )));
            }
            if len > body.len() {
                return Err(FrameError::Malformed(format!(
                    "UDP header: length field {len} exceeds the {} bytes the IP header allows",
                    body.len()
                )));
            }
            let mut header = [0u8; 8];
            header.copy_from_slice(&body[..8]);
            Ok(Transport::Udp {
                src_port: be16(body, 0),
                dst_port: be16(body, 2),
                length_field,
                checksum: be16(body, 6),
                header,
                payload: body[8..len].to_vec(),
            })
        }
        IPPROTO_TCP => {
            need("TCP header", body, 20)?;
            let doff = usize::from(body[12] >> 4) * 4;
            if doff < 20 {
                return Err(FrameError::Malformed(format!(
                    "TCP header: data offset {doff} < 20"
                )));
            }
            need("TCP header (with options)", body, doff)?;
            Ok(Transport::Tcp {
                src_port: be16(body, 0),
                dst_port: be16(body, 2),
                seq: be32(body, 4),
                ack: be32(body, 8),
                flags: TcpFlags(body[13]),
                window: be16(body, 14),
                checksum: be16(body, 16),
                header: body[..doff].to_vec(),
                payload: body[doff..].to_vec(),
            })
        }
        protocol => Ok(Transport::Other {
            protocol,
            payload: body.to_vec(),
        }),
    }
}

// ---------------------------------------------------------------------------------------------
// TCP stream reassembly
// ---------------------------------------------------------------------------------------------

/// One direction of a TCP connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FlowKey {
    /// Sender.
    pub src: SocketAddr,
    /// Receiver.
    pub dst: SocketAddr,
}

impl FlowKey {
    /// The opposite direction.
    pub fn reverse(self) -> FlowKey {
        FlowKey {
            src: self.dst,
            dst: self.src,
        }
    }
}

impl fmt::Display for FlowKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} -> {}", self.src, self.dst)
    }
}

/// Newly in-order bytes of one direction of a TCP connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamChunk {
    /// The direction.
    pub flow: FlowKey,
    /// Frame number of the segment that carried these bytes.
    pub index: usize,
    /// Timestamp of that segment.
    pub ts: Duration,
    /// Stream offset of `data[0]` (0 = first byte after the SYN, or first byte seen).
    pub offset: u64,
    /// The bytes.
    pub data: Vec<u8>,
}

/// Something that happened on one direction of a TCP connection, in stream order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEvent {
    /// A SYN with a new initial sequence number: a new stream starts in this direction.
    Syn {
        /// The direction.
        flow: FlowKey,
        /// Frame number.
        index: usize,
        /// Timestamp.
        ts: Duration,
        /// Initial sequence number.
        isn: u32,
        /// True for a SYN/ACK (so `flow.src` is the server).
        with_ack: bool,
    },
    /// In-order data.
    Data(StreamChunk),
    /// Bytes that were never captured and were skipped (the out-of-order buffer overflowed, or
    /// [`TcpStreams::finish`] flushed past a hole).
    Gap {
        /// The direction.
        flow: FlowKey,
        /// Frame number of the segment that triggered the skip (0 from `finish`).
        index: usize,
        /// Its timestamp.
        ts: Duration,
        /// Stream offset of the first missing byte.
        offset: u64,
        /// Number of missing bytes.
        len: u64,
    },
    /// The FIN, once every byte before it has been delivered.
    Fin {
        /// The direction.
        flow: FlowKey,
        /// Frame number of the FIN segment.
        index: usize,
        /// Its timestamp.
        ts: Duration,
        /// Stream length at the FIN.
        offset: u64,
    },
    /// A RST from `flow.src`.
    Reset {
        /// The direction.
        flow: FlowKey,
        /// Frame number.
        index: usize,
        /// Timestamp.
        ts: Duration,
    },
}

impl StreamEvent {
    /// The direction the event belongs to.
    pub fn flow(&self) -> FlowKey {
        match self {
            StreamEvent::Data(c) => c.flow,
            StreamEvent::Syn { flow, .. }
            | StreamEvent::Gap { flow, .. }
            | StreamEvent::Fin { flow, .. }
            | StreamEvent::Reset { flow, .. } => *flow,
        }
    }

    /// The frame number the event is attributed to.
    pub fn index(&self) -> usize {
        match self {
            StreamEvent::Data(c) => c.index,
            StreamEvent::Syn { index, .. }
            | StreamEvent::Gap { index, .. }
            | StreamEvent::Fin { index, .. }
            | StreamEvent::Reset { index, .. } => *index,
        }
    }
}

/// A TCP segment as [`TcpStreams::push`] takes it.
#[derive(Debug, Clone, Copy)]
pub struct Segment<'a> {
    /// Frame number.
    pub index: usize,
    /// Timestamp.
    pub ts: Duration,
    /// Sender.
    pub src: SocketAddr,
    /// Receiver.
    pub dst: SocketAddr,
    /// Sequence number.
    pub seq: u32,
    /// Flags.
    pub flags: TcpFlags,
    /// Payload.
    pub payload: &'a [u8],
}

#[derive(Debug, Clone)]
struct Pending {
    index: usize,
    ts: Duration,
    data: Vec<u8>,
}

#[derive(Debug, Clone, Default)]
struct FlowState {
    /// Order of first appearance (for deterministic `finish`).
    order: usize,
    /// ISN of the SYN that started the stream, if seen.
    isn: Option<u32>,
    /// That SYN had no ACK: this direction is the client's.
    initiator: bool,
    /// Sequence number of the next in-order byte (None before any segment).
    next: Option<u32>,
    /// Stream offset of the next in-order byte.
    offset: u64,
    /// Out-of-order data keyed by stream offset.
    pending: BTreeMap<u64, Pending>,
    pending_bytes: usize,
    /// Stream offset of the FIN and the frame that carried it.
    fin: Option<(u64, usize, Duration)>,
    fin_reported: bool,
}

/// Default bound on buffered out-of-order bytes per direction.
pub const DEFAULT_MAX_PENDING: usize = 1 << 20;

/// Reassembles TCP segments, fed in capture order, into in-order byte streams per direction.
///
/// Retransmitted and overlapping bytes are trimmed (first copy wins); out-of-order segments are
/// buffered (up to a bound per direction, then the hole is reported as a [`StreamEvent::Gap`])
/// and released when the hole fills. A SYN consumes one sequence number; without a SYN the
/// stream starts at the first sequence number seen. A SYN with a different ISN starts a new
/// stream on the same addresses. Sequence comparisons wrap.
#[derive(Debug, Clone)]
pub struct TcpStreams {
    flows: HashMap<FlowKey, FlowState>,
    max_pending: usize,
}

impl Default for TcpStreams {
    fn default() -> Self {
        Self::new()
    }
}

impl TcpStreams {
    /// A reassembler with the default out-of-order bound ([`DEFAULT_MAX_PENDING`]).
    pub fn new() -> Self {
        Self::with_max_pending(DEFAULT_MAX_PENDING)
    }

    /// A reassembler that buffers at most `max_pending` out-of-order bytes per direction.
    pub fn with_max_pending(max_pending: usize) -> Self {
        TcpStreams {
            flows: HashMap::new(),
            max_pending,
        }
    }

    /// Feeds a captured packet; non-TCP and undecodable packets yield nothing.
    pub fn push_packet(&mut self, pkt: &CapturedPacket) -> Vec<StreamEvent> {
        let Ok(net) = &pkt.net else {
            return Vec::new();
        };
        let Transport::Tcp {
            seq,
            flags,
            payload,
            ..
        } = &net.transport
        else {
            return Vec::new();
        };
        self.push(Segment {
            index: pkt.index,
            ts: pkt.ts,
            src: net.src(),
            dst: net.dst(),
            seq: *seq,
            flags: *flags,
            payload,
        })
    }

    /// Feeds one TCP segment and returns what became known, in stream order.
    pub fn push(&mut self, seg: Segment<'_>) -> Vec<StreamEvent> {
        let flow = FlowKey {
            src: seg.src,
            dst: seg.dst,
        };
        let order = self.flows.len();
        let max_pending = self.max_pending;
        let st = self.flows.entry(flow).or_insert_with(|| FlowState {
            order,
            ..FlowState::default()
        });
        let mut out = Vec::new();

        if seg.flags.rst() {
            out.push(StreamEvent::Reset {
                flow,
                index: seg.index,
                ts: seg.ts,
            });
            return out;
        }

        let mut data_seq = seg.seq;
        if seg.flags.syn() {
            data_seq = seg.seq.wrapping_add(1);
            if st.isn != Some(seg.seq) {
                *st = FlowState {
                    order: st.order,
                    isn: Some(seg.seq),
                    initiator: !seg.flags.ack(),
                    next: Some(data_seq),
                    ..FlowState::default()
                };
                out.push(StreamEvent::Syn {
                    flow,
                    index: seg.index,
                    ts: seg.ts,
                    isn: seg.seq,
                    with_ack: seg.flags.ack(),
                });
            }
        }
        let next = *st.next.get_or_insert(data_seq);

        // Position of the segment in stream offsets (may be negative: before the stream start).
        #[allow(clippy::cast_possible_wrap)] // deliberate: the wrapped difference is signed
        let rel = i64::from(data_seq.wrapping_sub(next) as i32);
        let start = i128::from(st.offset) + i128::from(rel);
        let end = start + seg.payload.len() as i128;

        if seg.flags.fin() && st.fin.is_none() && end >= 0 {
            st.fin = Some((u64::try_from(end).unwrap_or(0), seg.index, seg.ts));
        }

        let cur = i128::from(st.offset);
        if end > cur {
            if start <= cur {
                let skip = usize::try_from(cur - start).unwrap_or(0);
                st.deliver(flow, seg.index, seg.ts, &seg.payload[skip..], &mut out);
            } else {
                let key = u64::try_from(start).unwrap_or(0);
                let keep = st
                    .pending
                    .get(&key)
                    .is_none_or(|p| p.data.len() < seg.payload.len());
                if keep {
                    if let Some(old) = st.pending.insert(
                        key,
                        Pending {
                            index: seg.index,
                            ts: seg.ts,
                            data: seg.payload.to_vec(),
                        },
                    ) {
                        st.pending_bytes -= old.data.len();
                    }
                    st.pending_bytes += seg.payload.len();
                }
            }
        }
        st.drain(flow, &mut out);
        while st.pending_bytes > max_pending {
            st.skip_hole(flow, seg.index, seg.ts, &mut out);
            st.drain(flow, &mut out);
        }
        st.check_fin(flow, &mut out);
        out
    }

    /// Flushes every direction at the end of the capture: buffered data past holes is released
    /// (each hole reported as a [`StreamEvent::Gap`]) and pending FINs are reported.
    pub fn finish(&mut self) -> Vec<StreamEvent> {
        let mut keys: Vec<(usize, FlowKey)> =
            self.flows.iter().map(|(k, s)| (s.order, *k)).collect();
        keys.sort();
        let mut out = Vec::new();
        for (_, flow) in keys {
            let Some(st) = self.flows.get_mut(&flow) else {
                continue;
            };
            while !st.pending.is_empty() {
                st.skip_hole(flow, 0, Duration::ZERO, &mut out);
                st.drain(flow, &mut out);
            }
            st.check_fin(flow, &mut out);
        }
        out
    }

    /// True if a SYN without ACK was seen from `flow.src` (it is the client).
    pub fn is_initiator(&self, flow: FlowKey) -> bool {
        self.flows.get(&flow).is_some_and(|s| s.initiator)
    }

    /// Every direction seen so far, in order of first appearance.
    pub fn flows(&self) -> Vec<FlowKey> {
        let mut keys: Vec<(usize, FlowKey)> =
            self.flows.iter().map(|(k, s)| (s.order, *k)).collect();
        keys.sort();
        keys.into_iter().map(|(_, k)| k).collect()
    }
}

impl FlowState {
    fn deliver(
        &mut self,
        flow: FlowKey,
        index: usize,
        ts: Duration,
        data: &[u8],
        out: &mut Vec<StreamEvent>,
    ) {
        if data.is_empty() {
            return;
        }
        out.push(StreamEvent::Data(StreamChunk {
            flow,
            index,
            ts,
            offset: self.offset,
            data: data.to_vec(),
        }));
        self.advance(data.len() as u64);
    }

    fn advance(&mut self, n: u64) {
        self.offset += n;
        // Sequence numbers wrap modulo 2^32.
        let n32 = (n & 0xFFFF_FFFF) as u32;
        self.next = Some(self.next.unwrap_or(0).wrapping_add(n32));
    }

    /// Releases buffered segments that have become in-order.
    fn drain(&mut self, flow: FlowKey, out: &mut Vec<StreamEvent>) {
        while let Some(entry) = self.pending.first_entry() {
            if *entry.key() > self.offset {
                break;
            }
            let key = *entry.key();
            let p = entry.remove();
            self.pending_bytes -= p.data.len();
            let end = key + p.data.len() as u64;
            if end > self.offset {
                let skip = usize::try_from(self.offset - key).unwrap_or(0);
                self.deliver(flow, p.index, p.ts, &p.data[skip..], out);
            }
        }
    }

    /// Gives up on the hole before the first buffered segment.
    fn skip_hole(&mut self, flow: FlowKey, index: usize, ts: Duration, out: &mut Vec<StreamEvent>) {
        let Some((&key, _)) = self.pending.first_key_value() else {
            return;
        };
        if key > self.offset {
            out.push(StreamEvent::Gap {
                flow,
                index,
                ts,
                offset: self.offset,
                len: key - self.offset,
            });
            self.advance(key - self.offset);
        }
    }

    fn check_fin(&mut self, flow: FlowKey, out: &mut Vec<StreamEvent>) {
        if self.fin_reported {
            return;
        }
        if let Some((at, index, ts)) = self.fin {
            if self.offset >= at {
                self.fin_reported = true;
                // The FIN consumes one sequence number (the stream offset stays).
                self.next = Some(self.next.unwrap_or(0).wrapping_add(1));
                out.push(StreamEvent::Fin {
                    flow,
                    index,
                    ts,
                    offset: self.offset,
                });
            }
        }
    }
}

/// Runs [`TcpStreams`] over a whole capture (including [`TcpStreams::finish`]).
pub fn tcp_stream_events(packets: &[CapturedPacket]) -> Vec<StreamEvent> {
    let mut streams = TcpStreams::new();
    let mut out = Vec::new();
    for p in packets {
        out.extend(streams.push_packet(p));
    }
    out.extend(streams.finish());
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netbuild::{
        ethernet, ethernet_ip, ethernet_vlan, ipv4_tcp, ipv4_udp, ipv6_udp, linux_sll, linux_sll2,
        pad_ethernet, PcapOut, TcpFlowBuilder, TcpSegment,
    };
    use pcap_file::{Endianness, TsResolution};
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};
    use std::borrow::Cow;

    const MAC_A: [u8; 6] = [0x02, 0, 0, 0, 0, 0xA];
    const MAC_B: [u8; 6] = [0x02, 0, 0, 0, 0, 0xB];
    const V4_A: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
    const V4_B: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);

    fn v6(last: u16) -> Ipv6Addr {
        Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, last)
    }

    fn ts(secs: u64, micros: u64) -> Duration {
        Duration::from_secs(secs) + Duration::from_micros(micros)
    }

    /// A unique temporary file path, removed on drop.
    struct TempFile(PathBuf);
    impl TempFile {
        fn new(name: &str) -> Self {
            TempFile(
                std::env::temp_dir().join(format!("rcm-capture-{}-{name}", std::process::id())),
            )
        }
    }
    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn pcap_of(linktype: u32, frames: &[(Duration, Vec<u8>)]) -> Vec<u8> {
        let mut out = PcapOut::with_options(
            Vec::new(),
            linktype,
            TsResolution::MicroSecond,
            Endianness::Little,
        )
        .unwrap();
        for (t, f) in frames {
            out.write_frame(*t, f).unwrap();
        }
        out.into_inner().unwrap()
    }

    fn one(linktype: u32, frame: Vec<u8>) -> CapturedPacket {
        let cap = read_pcap_bytes(&pcap_of(linktype, &[(ts(1, 0), frame)])).unwrap();
        assert_eq!(cap.packets.len(), 1);
        assert!(cap.warning.is_none());
        cap.packets.into_iter().next().unwrap()
    }

    fn udp_parts(t: &Transport) -> (u16, u16, u16, u16, [u8; 8], Vec<u8>) {
        match t {
            Transport::Udp {
                src_port,
                dst_port,
                length_field,
                checksum,
                header,
                payload,
            } => (
                *src_port,
                *dst_port,
                *length_field,
                *checksum,
                *header,
                payload.clone(),
            ),
            other => panic!("not UDP: {other:?}"),
        }
    }

    #[test]
    fn ipv4_udp_roundtrip_through_file() {
        let payload: Vec<u8> = (0..=255u8).collect();
        let ip = ipv4_udp(V4_A, V4_B, 49152, 4791, 0x68, 64, 0x1234, &payload);
        let frame = ethernet_ip(MAC_A, MAC_B, &ip);
        let tmp = TempFile::new("udp4.pcap");
        {
            let f = std::fs::File::create(&tmp.0).unwrap();
            let mut out = PcapOut::new(f).unwrap();
            out.write_frame(ts(1_795_944_793, 580_065), &frame).unwrap();
            out.write_frame(ts(1_795_944_794, 1), &frame).unwrap();
            out.into_inner().unwrap();
        }
        let cap = read_pcap(&tmp.0).unwrap();
        assert_eq!(
            cap.format,
            CaptureFormat::Pcap {
                nanosecond: false,
                big_endian: false,
                linktype: 1
            }
        );
        assert!(cap.warning.is_none());
        assert_eq!(cap.packets.len(), 2);
        let p = &cap.packets[0];
        assert_eq!(p.index, 1);
        assert_eq!(cap.packets[1].index, 2);
        assert_eq!(p.ts, ts(1_795_944_793, 580_065));
        assert_eq!(cap.relative(&cap.packets[1]), Duration::new(0, 419_936_000));
        assert_eq!(p.frame, frame);
        assert_eq!(p.linktype, linktype::ETHERNET);
        assert!(!p.is_snapped());
        let net = p.net.as_ref().unwrap();
        assert_eq!(net.link.src_mac, Some(MAC_A));
        assert_eq!(net.link.dst_mac, Some(MAC_B));
        assert_eq!(net.link.ethertype, Some(ETHERTYPE_IPV4));
        assert_eq!(net.link.header_len, 14);
        assert!(net.link.vlans.is_empty());
        assert_eq!(net.ip.header, ip[..20].to_vec());
        assert!(net.ip.is_ipv4());
        assert!(!net.ip.has_options);
        assert!(net.ip.header_checksum_ok());
        assert_eq!(net.ip.src, IpAddr::V4(V4_A));
        assert_eq!(net.ip.dst, IpAddr::V4(V4_B));
        assert_eq!(net.ip.ttl, 64);
        assert_eq!(net.ip.tos, 0x68);
        assert_eq!(net.ip.ident, Some(0x1234));
        assert!(net.ip.dont_fragment);
        assert_eq!(net.ip.flow_label, None);
        assert_eq!(net.ip.protocol, IPPROTO_UDP);
        assert_eq!(net.ip.total_len, 20 + 8 + 256);
        assert_eq!(net.src(), "198.18.0.1:49152".parse().unwrap());
        assert_eq!(net.dst(), "198.18.0.2:4791".parse().unwrap());
        let (sp, dp, len, csum, hdr, pl) = udp_parts(&net.transport);
        assert_eq!((sp, dp, len, csum), (49152, 4791, 264, 0));
        assert_eq!(hdr.to_vec(), ip[20..28].to_vec());
        assert_eq!(pl, payload);
        assert_eq!(net.udp_payload(), Some(&payload[..]));
    }

    #[test]
    fn ethernet_padding_is_not_payload() {
        let ip = ipv4_udp(V4_A, V4_B, 1, 4791, 0, 64, 7, b"abcd");
        let frame = pad_ethernet(ethernet_ip(MAC_A, MAC_B, &ip));
        assert_eq!(frame.len(), 60);
        let p = one(linktype::ETHERNET, frame);
        let net = p.net.unwrap();
        assert_eq!(net.ip.total_len, 32);
        let (_, _, len, _, _, pl) = udp_parts(&net.transport);
        assert_eq!(len, 12);
        assert_eq!(pl, b"abcd");

        // Same over IPv6: 62-byte packet, padding irrelevant but the payload-length rule holds.
        let ip6 = ipv6_udp(v6(1), v6(2), 1, 4791, 0, 0, 64, b"xy");
        let mut frame6 = ethernet_ip(MAC_A, MAC_B, &ip6);
        frame6.extend_from_slice(&[0xEE; 6]);
        let net = one(linktype::ETHERNET, frame6).net.unwrap();
        assert_eq!(net.udp_payload(), Some(&b"xy"[..]));
        assert_eq!(net.ip.total_len, 50);
    }

    #[test]
    fn ipv6_fields() {
        let ip = ipv6_udp(v6(1), v6(2), 55410, 4791, 0xB8, 0xABCDE, 63, &[1, 2, 3]);
        let net = one(linktype::ETHERNET, ethernet_ip(MAC_A, MAC_B, &ip))
            .net
            .unwrap();
        assert_eq!(net.link.ethertype, Some(ETHERTYPE_IPV6));
        assert_eq!(net.ip.header, ip[..40].to_vec());
        assert!(!net.ip.is_ipv4());
        assert!(net.ip.header_checksum_ok());
        assert_eq!(net.ip.src, IpAddr::V6(v6(1)));
        assert_eq!(net.ip.dst, IpAddr::V6(v6(2)));
        assert_eq!(net.ip.tos, 0xB8);
        assert_eq!(net.ip.flow_label, Some(0xABCDE));
        assert_eq!(net.ip.ttl, 63);
        assert_eq!(net.ip.ident, None);
        assert_eq!(net.ip.header_checksum, None);
        assert!(net.ip.ext_headers.is_empty());
        let (sp, dp, len, csum, _, pl) = udp_parts(&net.transport);
        assert_eq!((sp, dp, len, csum), (55410, 4791, 11, 0));
        assert_eq!(pl, [1, 2, 3]);
    }

    #[test]
    fn ipv6_extension_headers_and_fragments() {
        let ip = ipv6_udp(v6(1), v6(2), 5, 4791, 0, 0, 64, b"hello");
        // Insert a hop-by-hop header (8 bytes: next=UDP, len=0, PadN 6).
        let mut with_hbh = ip[..40].to_vec();
        with_hbh[6] = 0;
        with_hbh[4..6].copy_from_slice(&((ip.len() - 40 + 8) as u16).to_be_bytes());
        with_hbh.extend_from_slice(&[IPPROTO_UDP, 0, 1, 4, 0, 0, 0, 0]);
        with_hbh.extend_from_slice(&ip[40..]);
        let net = one(linktype::RAW, with_hbh.clone()).net.unwrap();
        assert!(net.ip.has_options);
        assert_eq!(net.ip.ext_headers, vec![IPPROTO_UDP, 0, 1, 4, 0, 0, 0, 0]);
        assert_eq!(net.ip.protocol, IPPROTO_UDP);
        assert_eq!(net.udp_payload(), Some(&b"hello"[..]));

        // A fragment header instead.
        let mut frag = with_hbh.clone();
        frag[6] = 44;
        frag[41] = 0; // fragment header's reserved byte; offset 0, M=1
        frag[42..44].copy_from_slice(&1u16.to_be_bytes());
        let err = one(linktype::RAW, frag).net.unwrap_err();
        assert_eq!(
            err,
            FrameError::Fragment {
                offset: 0,
                more: true
            }
        );

        // Extension header running past the packet.
        let mut bad = with_hbh;
        bad[41] = 200;
        assert!(matches!(
            one(linktype::RAW, bad).net,
            Err(FrameError::Truncated { .. })
        ));
    }

    #[test]
    fn ipv4_options_and_fragments() {
        let ip = ipv4_udp(V4_A, V4_B, 5, 4791, 0, 64, 1, b"data");
        // Rebuild with 4 bytes of options (NOP NOP NOP EOL).
        let mut opt = ip[..20].to_vec();
        opt[0] = 0x46;
        opt[2..4].copy_from_slice(&((ip.len() + 4) as u16).to_be_bytes());
        opt.extend_from_slice(&[1, 1, 1, 0]);
        opt.extend_from_slice(&ip[20..]);
        let net = one(linktype::RAW, opt.clone()).net.unwrap();
        assert!(net.ip.has_options);
        assert_eq!(net.ip.header.len(), 24);
        assert_eq!(net.ip.header, opt[..24].to_vec());
        assert!(!net.ip.header_checksum_ok()); // we did not fix it up
        assert_eq!(net.udp_payload(), Some(&b"data"[..]));

        let mut frag = ip.clone();
        frag[6] = 0x20; // MF
        assert_eq!(
            one(linktype::RAW, frag).net.unwrap_err(),
            FrameError::Fragment {
                offset: 0,
                more: true
            }
        );
        let mut frag = ip.clone();
        frag[6] = 0x00;
        frag[7] = 3;
        assert_eq!(
            one(linktype::RAW, frag).net.unwrap_err(),
            FrameError::Fragment {
                offset: 24,
                more: false
            }
        );
        let mut bad = ip.clone();
        bad[0] = 0x44;
        assert!(matches!(
            one(linktype::RAW, bad).net,
            Err(FrameError::Malformed(_))
        ));
        let mut bad = ip.clone();
        bad[24..26].copy_from_slice(&100u16.to_be_bytes()); // UDP length > IP payload
        assert!(matches!(
            one(linktype::RAW, bad).net,
            Err(FrameError::Malformed(_))
        ));
        let mut bad = ip;
        bad[24..26].copy_from_slice(&7u16.to_be_bytes());
        assert!(matches!(
            one(linktype::RAW, bad).net,
            Err(FrameError::Malformed(_))
        ));
    }

    #[test]
    fn vlan_tags() {
        let ip = ipv4_udp(V4_A, V4_B, 5, 4791, 0, 64, 1, b"vlan");
        let one_tag = [VlanTag {
            tpid: ETHERTYPE_VLAN,
            tci: (3 << 13) | 0x064,
        }];
        let net = one(
            linktype::ETHERNET,
            ethernet_vlan(MAC_A, MAC_B, &one_tag, ETHERTYPE_IPV4, &ip),
        )
        .net
        .unwrap();
        assert_eq!(net.link.vlans, one_tag);
        assert_eq!(net.link.vlans[0].vid(), 100);
        assert_eq!(net.link.vlans[0].pcp(), 3);
        assert_eq!(net.link.header_len, 18);
        assert_eq!(net.udp_payload(), Some(&b"vlan"[..]));

        let two = [
            VlanTag {
                tpid: ETHERTYPE_QINQ,
                tci: 10,
            },
            VlanTag {
                tpid: ETHERTYPE_VLAN,
                tci: 20,
            },
        ];
        let net = one(
            linktype::ETHERNET,
            pad_ethernet(ethernet_vlan(MAC_A, MAC_B, &two, ETHERTYPE_IPV4, &ip)),
        )
        .net
        .unwrap();
        assert_eq!(net.link.vlans, two);
        assert_eq!(net.link.header_len, 22);
        assert_eq!(net.ip.header, ip[..20].to_vec());
        assert_eq!(net.udp_payload(), Some(&b"vlan"[..]));

        let many = [one_tag[0]; 5];
        assert!(matches!(
            one(
                linktype::ETHERNET,
                ethernet_vlan(MAC_A, MAC_B, &many, ETHERTYPE_IPV4, &ip)
            )
            .net,
            Err(FrameError::Malformed(_))
        ));
    }

    #[test]
    fn not_ip_frames() {
        let arp = pad_ethernet(ethernet(MAC_A, MAC_B, 0x0806, &[0; 28]));
        assert_eq!(
            one(linktype::ETHERNET, arp).net.unwrap_err(),
            FrameError::NotIp {
                ethertype: 0x0806,
                payload_offset: 14
            }
        );
        let llc = pad_ethernet(ethernet(MAC_A, MAC_B, 46, &[0; 46]));
        assert!(matches!(
            one(linktype::ETHERNET, llc).net,
            Err(FrameError::NotIp { ethertype: 46, .. })
        ));
        assert_eq!(
            decode_frame(147, &[0; 64]).unwrap_err(),
            FrameError::UnsupportedLinkType(147)
        );
    }

    #[test]
    fn linux_cooked_captures() {
        let ip = ipv4_udp(V4_A, V4_B, 7, 4791, 0, 64, 1, b"sll");
        let p = one(
            linktype::LINUX_SLL,
            linux_sll(4, MAC_A, ETHERTYPE_IPV4, &ip),
        );
        assert_eq!(p.linktype, linktype::LINUX_SLL);
        let net = p.net.unwrap();
        assert_eq!(net.link.src_mac, Some(MAC_A));
        assert_eq!(net.link.dst_mac, None);
        assert_eq!(net.link.header_len, 16);
        assert_eq!(net.udp_payload(), Some(&b"sll"[..]));

        let ip6 = ipv6_udp(v6(1), v6(2), 7, 4791, 0, 0, 64, b"sll2");
        let net = one(
            linktype::LINUX_SLL2,
            linux_sll2(ETHERTYPE_IPV6, 3, 0, MAC_B, &ip6),
        )
        .net
        .unwrap();
        assert_eq!(net.link.src_mac, Some(MAC_B));
        assert_eq!(net.link.header_len, 20);
        assert_eq!(net.ip.src, IpAddr::V6(v6(1)));
        assert_eq!(net.udp_payload(), Some(&b"sll2"[..]));

        // SLL with a VLAN tag left in.
        let mut inner = vec![0x00, 0x05];
        inner.extend_from_slice(&ETHERTYPE_IPV4.to_be_bytes());
        inner.extend_from_slice(&ip);
        let net = one(
            linktype::LINUX_SLL,
            linux_sll(0, MAC_A, ETHERTYPE_VLAN, &inner),
        )
        .net
        .unwrap();
        assert_eq!(net.link.vlans[0].vid(), 5);
        assert_eq!(net.udp_payload(), Some(&b"sll"[..]));
    }

    #[test]
    fn raw_and_loopback_linktypes() {
        let ip4 = ipv4_udp(V4_A, V4_B, 7, 4791, 0, 64, 1, b"raw4");
        let ip6 = ipv6_udp(v6(1), v6(2), 7, 4791, 0, 0, 64, b"raw6");
        for lt in [linktype::RAW, linktype::RAW_12, linktype::RAW_14] {
            assert_eq!(
                one(lt, ip4.clone()).net.unwrap().udp_payload(),
                Some(&b"raw4"[..])
            );
            assert_eq!(
                one(lt, ip6.clone()).net.unwrap().udp_payload(),
                Some(&b"raw6"[..])
            );
        }
        assert!(one(linktype::IPV4, ip4.clone()).net.is_ok());
        assert!(one(linktype::IPV6, ip6.clone()).net.is_ok());
        // Version mismatch with the link type.
        assert!(matches!(
            one(linktype::IPV4, ip6.clone()).net,
            Err(FrameError::Malformed(_))
        ));

        let with_af = |af: [u8; 4], ip: &[u8]| {
            let mut f = af.to_vec();
            f.extend_from_slice(ip);
            f
        };
        // Little-endian AF_INET, big-endian AF_INET6 variants.
        let net = one(linktype::NULL, with_af(2u32.to_le_bytes(), &ip4))
            .net
            .unwrap();
        assert_eq!(net.link.header_len, 4);
        assert_eq!(net.udp_payload(), Some(&b"raw4"[..]));
        for af in [10u32, 24, 28, 30] {
            let net = one(linktype::NULL, with_af(af.to_le_bytes(), &ip6))
                .net
                .unwrap();
            assert_eq!(net.udp_payload(), Some(&b"raw6"[..]));
            let net = one(linktype::NULL, with_af(af.to_be_bytes(), &ip6))
                .net
                .unwrap();
            assert_eq!(net.udp_payload(), Some(&b"raw6"[..]));
        }
        assert!(one(linktype::LOOP, with_af(2u32.to_be_bytes(), &ip4))
            .net
            .is_ok());
        assert_eq!(
            one(linktype::NULL, with_af(7u32.to_le_bytes(), &ip4))
                .net
                .unwrap_err(),
            FrameError::UnsupportedFamily(7)
        );
    }

    #[test]
    fn truncated_frames_give_reasons() {
        let seg = TcpSegment {
            src_port: 1,
            dst_port: 2,
            seq: 3,
            ack: 4,
            flags: TcpFlags::ACK,
            window: 100,
            options: &[1, 1, 1, 1],
            payload: b"payload",
        };
        let frames = [
            ethernet_ip(
                MAC_A,
                MAC_B,
                &ipv4_udp(V4_A, V4_B, 1, 4791, 0, 64, 1, b"abcdef"),
            ),
            ethernet_ip(
                MAC_A,
                MAC_B,
                &ipv6_udp(v6(1), v6(2), 1, 4791, 0, 0, 64, b"abcdef"),
            ),
            ethernet_ip(MAC_A, MAC_B, &ipv4_tcp(V4_A, V4_B, 64, 1, &seg)),
            ethernet_vlan(
                MAC_A,
                MAC_B,
                &[VlanTag {
                    tpid: ETHERTYPE_VLAN,
                    tci: 1,
                }],
                ETHERTYPE_IPV4,
                &ipv4_udp(V4_A, V4_B, 1, 4791, 0, 64, 1, b"abcdef"),
            ),
        ];
        for frame in &frames {
            assert!(decode_frame(linktype::ETHERNET, frame).is_ok());
            for cut in 0..frame.len() {
                let err = decode_frame(linktype::ETHERNET, &frame[..cut]).unwrap_err();
                assert!(
                    matches!(err, FrameError::Truncated { .. }),
                    "cut at {cut}: {err}"
                );
                assert!(!err.to_string().is_empty());
            }
        }
        // Through a file, with orig_len larger than what was captured (snaplen).
        let frame = &frames[0];
        let mut out = PcapOut::new(Vec::new()).unwrap();
        out.write_snapped(ts(5, 0), frame.len() as u32, &frame[..40])
            .unwrap();
        let cap = read_pcap_bytes(&out.into_inner().unwrap()).unwrap();
        let p = &cap.packets[0];
        assert!(p.is_snapped());
        assert_eq!(
            p.net.as_ref().unwrap_err().to_string(),
            "truncated IPv4 packet: need 34 bytes, have 26"
        );
    }

    #[test]
    fn random_bytes_never_panic() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let lts = [0, 1, 12, 14, 101, 108, 113, 228, 229, 276, 9999];
        let ip = ipv4_udp(V4_A, V4_B, 1, 4791, 0, 64, 1, b"abcdef");
        let good = ethernet_ip(MAC_A, MAC_B, &ip);
        for _ in 0..20_000 {
            let len = rng.gen_range(0..120);
            let mut f: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            if rng.gen_bool(0.5) && len > 0 {
                // Start from something plausible and corrupt a few bytes.
                f = good.clone();
                for _ in 0..rng.gen_range(1..4) {
                    let i = rng.gen_range(0..f.len());
                    f[i] = rng.gen();
                }
                f.truncate(rng.gen_range(0..=f.len()));
            }
            for lt in lts {
                let _ = decode_frame(lt, &f);
            }
        }
        // Corrupted capture files: never panic, either an error or packets (+ maybe a warning).
        let file = pcap_of(
            linktype::ETHERNET,
            &[(ts(1, 0), good.clone()), (ts(2, 0), good.clone())],
        );
        for _ in 0..3000 {
            let mut f = file.clone();
            let i = rng.gen_range(0..f.len());
            f[i] = rng.gen();
            f.truncate(rng.gen_range(0..=f.len()));
            let _ = read_pcap_bytes(&f);
        }
    }

    #[test]
    fn nanosecond_big_endian_pcap() {
        let ip = ipv4_udp(V4_A, V4_B, 1, 4791, 0, 64, 1, b"ns");
        let frame = ethernet_ip(MAC_A, MAC_B, &ip);
        let mut out = PcapOut::with_options(
            Vec::new(),
            linktype::ETHERNET,
            TsResolution::NanoSecond,
            Endianness::Big,
        )
        .unwrap();
        out.write_frame(Duration::new(1_700_000_000, 123_456_789), &frame)
            .unwrap();
        let bytes = out.into_inner().unwrap();
        assert_eq!(&bytes[..4], &[0xA1, 0xB2, 0x3C, 0x4D]);
        let cap = read_pcap_bytes(&bytes).unwrap();
        assert_eq!(
            cap.format,
            CaptureFormat::Pcap {
                nanosecond: true,
                big_endian: true,
                linktype: 1
            }
        );
        assert_eq!(cap.packets[0].ts, Duration::new(1_700_000_000, 123_456_789));
        assert_eq!(
            cap.packets[0].net.as_ref().unwrap().udp_payload(),
            Some(&b"ns"[..])
        );
    }

    #[test]
    fn pcapng_with_tsresol() {
        use pcap_file::pcapng::blocks::enhanced_packet::EnhancedPacketBlock;
        use pcap_file::pcapng::blocks::simple_packet::SimplePacketBlock;
        use pcap_file::pcapng::PcapNgWriter;
        use pcap_file::DataLink;

        let ip4 = ipv4_udp(V4_A, V4_B, 1, 4791, 0, 64, 1, b"ng-eth");
        let eth = ethernet_ip(MAC_A, MAC_B, &ip4);
        let ip6 = ipv6_udp(v6(1), v6(2), 1, 4791, 0, 0, 64, b"ng-sll");
        let sll = linux_sll(0, MAC_B, ETHERTYPE_IPV6, &ip6);

        let mut w = PcapNgWriter::new(Vec::new()).unwrap();
        // Interface 0: Ethernet, default resolution (microseconds).
        w.write_pcapng_block(InterfaceDescriptionBlock::new(DataLink::ETHERNET, 0))
            .unwrap();
        // Interface 1: SLL, nanoseconds.
        w.write_pcapng_block(InterfaceDescriptionBlock {
            linktype: DataLink::LINUX_SLL,
            snaplen: 0,
            options: vec![InterfaceDescriptionOption::IfTsResol(9)],
        })
        .unwrap();
        // Interface 2: Ethernet, 2^-10 s units and a +100 s offset.
        w.write_pcapng_block(InterfaceDescriptionBlock {
            linktype: DataLink::ETHERNET,
            snaplen: 0,
            options: vec![
                InterfaceDescriptionOption::IfTsResol(0x80 | 0x0A),
                InterfaceDescriptionOption::IfTsOffset(100),
            ],
        })
        .unwrap();
        // The library stores the raw 64-bit unit count as "nanoseconds".
        let epb = |iface: u32, raw: u64, data: &[u8]| EnhancedPacketBlock {
            interface_id: iface,
            timestamp: Duration::from_nanos(raw),
            original_len: data.len() as u32,
            data: Cow::Owned(data.to_vec()),
            options: vec![],
        };
        w.write_pcapng_block(epb(0, 1_700_000_000_123_456, &eth))
            .unwrap();
        w.write_pcapng_block(epb(1, 1_700_000_001_000_000_007, &sll))
            .unwrap();
        w.write_pcapng_block(epb(2, 1024 * 5 + 512, &eth)).unwrap();
        w.write_pcapng_block(SimplePacketBlock {
            original_len: eth.len() as u32,
            data: Cow::Owned(eth.clone()),
        })
        .unwrap();
        let bytes = w.into_inner();

        let cap = read_pcap_bytes(&bytes).unwrap();
        assert_eq!(cap.format, CaptureFormat::PcapNg);
        assert!(cap.warning.is_none(), "{:?}", cap.warning);
        assert_eq!(cap.packets.len(), 4);
        let p = &cap.packets;
        assert_eq!(p[0].ts, Duration::new(1_700_000_000, 123_456_000));
        assert_eq!(p[0].linktype, linktype::ETHERNET);
        assert_eq!(
            p[0].net.as_ref().unwrap().udp_payload(),
            Some(&b"ng-eth"[..])
        );
        assert_eq!(p[1].ts, Duration::new(1_700_000_001, 7));
        assert_eq!(p[1].linktype, linktype::LINUX_SLL);
        assert_eq!(
            p[1].net.as_ref().unwrap().udp_payload(),
            Some(&b"ng-sll"[..])
        );
        assert_eq!(p[2].ts, Duration::new(105, 500_000_000));
        assert_eq!(p[3].ts, Duration::ZERO);
        assert_eq!(p[3].frame, eth);
        assert_eq!(p.iter().map(|p| p.index).collect::<Vec<_>>(), [1, 2, 3, 4]);
    }

    #[test]
    fn file_level_errors_and_truncation() {
        assert!(matches!(
            read_pcap_bytes(&[]),
            Err(CaptureError::TooShort(0))
        ));
        assert!(matches!(
            read_pcap_bytes(&[0xD4, 0xC3]),
            Err(CaptureError::TooShort(2))
        ));
        assert!(matches!(
            read_pcap_bytes(b"GET / HTTP/1.1\r\n"),
            Err(CaptureError::BadMagic(0x4745_5420))
        ));
        assert!(matches!(
            read_pcap_bytes(&[0xD4, 0xC3, 0xB2, 0xA1, 2, 0]),
            Err(CaptureError::Header(_))
        ));
        assert!(matches!(
            read_pcap("/nonexistent/rcm/x.pcap"),
            Err(CaptureError::Open { .. })
        ));

        let ip = ipv4_udp(V4_A, V4_B, 1, 4791, 0, 64, 1, b"abc");
        let frame = ethernet_ip(MAC_A, MAC_B, &ip);
        let file = pcap_of(
            linktype::ETHERNET,
            &[(ts(1, 0), frame.clone()), (ts(2, 0), frame.clone())],
        );
        // Cut inside the second record's data.
        let cut = &file[..file.len() - 5];
        let cap = read_pcap_bytes(cut).unwrap();
        assert_eq!(cap.packets.len(), 1);
        let w = cap.warning.unwrap();
        assert!(w.contains("cut short"), "{w}");
        // Header only: no packets, no warning.
        let cap = read_pcap_bytes(&file[..24]).unwrap();
        assert!(cap.packets.is_empty());
        assert!(cap.warning.is_none());
    }

    #[test]
    fn tcp_flags() {
        let f = TcpFlags::SYN | TcpFlags::ACK;
        assert_eq!(f.to_string(), "SYN, ACK");
        assert!(f.syn() && f.ack() && !f.fin() && !f.rst() && !f.psh());
        assert_eq!(
            TcpFlags(0xFF).to_string(),
            "FIN, SYN, RST, PSH, ACK, URG, ECE, CWR"
        );
        assert!(TcpFlags(0x18).psh());
        assert!(TcpFlags(0x30).contains(TcpFlags::URG));
        assert_eq!(TcpFlags::default().to_string(), "");
    }

    // ---------------------------------------------------------------- TCP reassembly

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    struct Feed {
        streams: TcpStreams,
        events: Vec<StreamEvent>,
        n: usize,
    }

    impl Feed {
        fn new(max_pending: usize) -> Self {
            Feed {
                streams: TcpStreams::with_max_pending(max_pending),
                events: Vec::new(),
                n: 0,
            }
        }
        fn seg(
            &mut self,
            src: &str,
            dst: &str,
            seq: u32,
            flags: TcpFlags,
            payload: &[u8],
        ) -> Vec<StreamEvent> {
            self.n += 1;
            let ev = self.streams.push(Segment {
                index: self.n,
                ts: Duration::from_millis(self.n as u64),
                src: sa(src),
                dst: sa(dst),
                seq,
                flags,
                payload,
            });
            self.events.extend(ev.clone());
            ev
        }
        fn finish(&mut self) {
            let ev = self.streams.finish();
            self.events.extend(ev);
        }
        fn stream(&self, src: &str, dst: &str) -> Vec<u8> {
            let flow = FlowKey {
                src: sa(src),
                dst: sa(dst),
            };
            let mut out = Vec::new();
            for e in &self.events {
                if let StreamEvent::Data(c) = e {
                    if c.flow == flow {
                        assert_eq!(c.offset, out.len() as u64, "chunks are contiguous");
                        out.extend_from_slice(&c.data);
                    }
                }
            }
            out
        }
    }

    const C: &str = "10.0.0.1:40000";
    const S: &str = "10.0.0.2:7471";
    const A: TcpFlags = TcpFlags::ACK;

    #[test]
    fn reassembly_out_of_order_duplicate_overlap() {
        let mut f = Feed::new(DEFAULT_MAX_PENDING);
        let isn = 1000;
        let ev = f.seg(C, S, isn, TcpFlags::SYN, b"");
        assert!(matches!(
            ev[..],
            [StreamEvent::Syn {
                isn: 1000,
                with_ack: false,
                ..
            }]
        ));
        f.seg(S, C, 5000, TcpFlags::SYN | A, b"");
        let d = isn + 1;
        // Bytes 0..26 of the alphabet.
        let abc = b"abcdefghijklmnopqrstuvwxyz";
        assert!(f.seg(C, S, d + 12, A, &abc[12..20]).is_empty()); // out of order: buffered
        let ev = f.seg(C, S, d, A, &abc[0..10]);
        assert_eq!(ev.len(), 1);
        let ev = f.seg(C, S, d + 5, A, &abc[5..15]); // overlaps both sides
        assert_eq!(ev.len(), 2, "new bytes 10..15 then buffered 15..20: {ev:?}");
        match &ev[..] {
            [StreamEvent::Data(a), StreamEvent::Data(b)] => {
                assert_eq!((a.offset, &a.data[..]), (10, &abc[10..15]));
                assert_eq!(a.index, 5);
                assert_eq!((b.offset, &b.data[..]), (15, &abc[15..20]));
                assert_eq!(b.index, 3, "buffered bytes keep their own frame");
            }
            other => panic!("{other:?}"),
        }
        assert!(f.seg(C, S, d, A, &abc[0..20]).is_empty()); // full retransmission
        assert!(f.seg(C, S, d + 3, A, &abc[3..4]).is_empty());
        f.seg(C, S, d + 20, A, &abc[20..26]);
        assert!(f.seg(C, S, d - 1, A, b"").is_empty()); // keepalive-like
        assert_eq!(f.stream(C, S), abc);
        assert!(f.stream(S, C).is_empty());
        assert!(f.streams.is_initiator(FlowKey {
            src: sa(C),
            dst: sa(S)
        }));
        assert!(!f.streams.is_initiator(FlowKey {
            src: sa(S),
            dst: sa(C)
        }));
        assert_eq!(f.streams.flows().len(), 2);
    }

    #[test]
    fn reassembly_wraps_sequence_numbers() {
        let mut f = Feed::new(DEFAULT_MAX_PENDING);
        let isn = u32::MAX - 4; // data starts at u32::MAX - 3, wraps after 4 bytes
        f.seg(C, S, isn, TcpFlags::SYN, b"");
        let d = isn.wrapping_add(1);
        let data: Vec<u8> = (0..40u8).collect();
        f.seg(C, S, d.wrapping_add(10), A, &data[10..20]);
        f.seg(C, S, d.wrapping_add(2), A, &data[2..12]);
        f.seg(C, S, d, A, &data[0..3]);
        f.seg(C, S, d.wrapping_add(20), A | TcpFlags::FIN, &data[20..40]);
        f.seg(C, S, d.wrapping_add(40), A | TcpFlags::FIN, b""); // retransmitted FIN
        assert_eq!(f.stream(C, S), data);
        let fins: Vec<_> = f
            .events
            .iter()
            .filter(|e| matches!(e, StreamEvent::Fin { .. }))
            .collect();
        assert_eq!(fins.len(), 1);
        assert!(matches!(
            fins[0],
            StreamEvent::Fin {
                offset: 40,
                index: 5,
                ..
            }
        ));
    }

    #[test]
    fn reassembly_fin_waits_for_hole() {
        let mut f = Feed::new(DEFAULT_MAX_PENDING);
        f.seg(C, S, 0, TcpFlags::SYN, b"");
        f.seg(C, S, 6, A | TcpFlags::FIN, b"world");
        assert!(!f
            .events
            .iter()
            .any(|e| matches!(e, StreamEvent::Fin { .. })));
        let ev = f.seg(C, S, 1, A, b"hello");
        assert_eq!(ev.len(), 3, "{ev:?}");
        assert!(matches!(
            ev[2],
            StreamEvent::Fin {
                offset: 10,
                index: 2,
                ..
            }
        ));
        assert_eq!(f.stream(C, S), b"helloworld");
    }

    #[test]
    fn reassembly_without_syn_rst_and_reuse() {
        let mut f = Feed::new(DEFAULT_MAX_PENDING);
        // Capture starts mid-connection.
        f.seg(C, S, 777_777, A, b"mid");
        f.seg(C, S, 777_780, A, b"stream");
        assert_eq!(f.stream(C, S), b"midstream");
        assert!(!f.streams.is_initiator(FlowKey {
            src: sa(C),
            dst: sa(S)
        }));
        let ev = f.seg(S, C, 1, TcpFlags::RST | A, b"ignored");
        assert!(matches!(ev[..], [StreamEvent::Reset { index: 3, .. }]));
        assert_eq!(
            ev[0].flow(),
            FlowKey {
                src: sa(S),
                dst: sa(C)
            }
        );
        assert_eq!(ev[0].index(), 3);

        // Same ports reused: a SYN with a new ISN restarts the stream at offset 0.
        let mut g = Feed::new(DEFAULT_MAX_PENDING);
        g.seg(C, S, 100, TcpFlags::SYN, b"");
        g.seg(C, S, 100, TcpFlags::SYN, b""); // retransmitted SYN: no new event
        g.seg(C, S, 101, A, b"first");
        g.seg(C, S, 9000, TcpFlags::SYN, b"");
        let ev = g.seg(C, S, 9001, A, b"second");
        assert!(matches!(&ev[..], [StreamEvent::Data(c)] if c.offset == 0 && c.data == b"second"));
        let syns = g
            .events
            .iter()
            .filter(|e| matches!(e, StreamEvent::Syn { .. }))
            .count();
        assert_eq!(syns, 2);
    }

    #[test]
    fn reassembly_bounded_buffer_and_finish() {
        let mut f = Feed::new(100);
        f.seg(C, S, 0, TcpFlags::SYN, b"");
        let data: Vec<u8> = (0..=255u8).cycle().take(300).collect();
        // Bytes 0..10 never arrive.
        for start in (10..300).step_by(50) {
            let end = (start + 50).min(300);
            f.seg(C, S, 1 + start as u32, A, &data[start..end]);
        }
        let gaps: Vec<_> = f
            .events
            .iter()
            .filter_map(|e| match e {
                StreamEvent::Gap { offset, len, .. } => Some((*offset, *len)),
                _ => None,
            })
            .collect();
        assert_eq!(gaps, [(0, 10)]);
        let chunks: Vec<(u64, usize)> = f
            .events
            .iter()
            .filter_map(|e| match e {
                StreamEvent::Data(c) => Some((c.offset, c.data.len())),
                _ => None,
            })
            .collect();
        assert_eq!(chunks.first(), Some(&(10, 50)));
        let got: Vec<u8> = f
            .events
            .iter()
            .filter_map(|e| match e {
                StreamEvent::Data(c) => Some(c.data.clone()),
                _ => None,
            })
            .flatten()
            .collect();
        assert_eq!(got, &data[10..]);

        // finish() releases data past a hole and reports a pending FIN.
        let mut g = Feed::new(DEFAULT_MAX_PENDING);
        g.seg(C, S, 0, TcpFlags::SYN, b"");
        g.seg(C, S, 1, A, b"abc");
        g.seg(C, S, 7, A | TcpFlags::FIN, b"ghi");
        g.finish();
        let tail: Vec<_> = g.events.iter().skip(2).cloned().collect();
        assert!(
            matches!(
                tail[0],
                StreamEvent::Gap {
                    offset: 3,
                    len: 3,
                    index: 0,
                    ..
                }
            ),
            "{tail:?}"
        );
        assert!(matches!(&tail[1], StreamEvent::Data(c) if c.data == b"ghi" && c.offset == 6));
        assert!(matches!(tail[2], StreamEvent::Fin { offset: 9, .. }));
    }

    #[test]
    fn reassembly_random_segmentation() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(42);
        for round in 0..200 {
            let len = rng.gen_range(0..5000);
            let data: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            let isn: u32 = if round % 3 == 0 {
                u32::MAX - rng.gen_range(0..3000)
            } else {
                rng.gen()
            };
            let d = isn.wrapping_add(1);
            // Random (overlapping) segments covering everything, plus duplicates.
            let mut segs = Vec::new();
            let mut at = 0usize;
            while at < len {
                let n = rng.gen_range(1..600).min(len - at);
                segs.push((at, at + n));
                if rng.gen_bool(0.3) {
                    let back = rng.gen_range(0..=at);
                    segs.push((
                        back,
                        (at + n)
                            .min(back + rng.gen_range(1..900))
                            .max(back + 1)
                            .min(len),
                    ));
                }
                at += n;
            }
            segs.shuffle(&mut rng);
            let mut f = Feed::new(DEFAULT_MAX_PENDING);
            f.seg(C, S, isn, TcpFlags::SYN, b"");
            for (s, e) in segs {
                f.seg(C, S, d.wrapping_add(s as u32), A, &data[s..e]);
            }
            f.finish();
            assert_eq!(f.stream(C, S), data, "round {round}");
            assert!(!f
                .events
                .iter()
                .any(|e| matches!(e, StreamEvent::Gap { .. })));
        }
    }

    #[test]
    fn reassembly_from_built_flow() {
        let client = sa("198.18.4.1:60813");
        let server = sa("198.18.4.2:7471");
        let big: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
        let mut b = TcpFlowBuilder::new(client, server).isns(u32::MAX - 100, 77);
        b.handshake()
            .client_send(b"MPA ID Req Frame....")
            .server_send(b"MPA ID Rep Frame....")
            .client_send(&big)
            .close();
        let cap = read_pcap_bytes(&b.to_pcap().unwrap()).unwrap();
        let events = tcp_stream_events(&cap.packets);
        let c2s = FlowKey {
            src: client,
            dst: server,
        };
        let data = |flow: FlowKey| -> Vec<u8> {
            events
                .iter()
                .filter_map(|e| match e {
                    StreamEvent::Data(c) if c.flow == flow => Some(c.data.clone()),
                    _ => None,
                })
                .flatten()
                .collect()
        };
        let mut want = b"MPA ID Req Frame....".to_vec();
        want.extend_from_slice(&big);
        assert_eq!(data(c2s), want);
        assert_eq!(data(c2s.reverse()), b"MPA ID Rep Frame....");
        let fins = events
            .iter()
            .filter(|e| matches!(e, StreamEvent::Fin { .. }))
            .count();
        assert_eq!(fins, 2);
        assert!(matches!(
            events[0],
            StreamEvent::Syn {
                with_ack: false,
                ..
            }
        ));
        assert!(matches!(events[1], StreamEvent::Syn { with_ack: true, .. }));
    }

    // ---------------------------------------------------------------- real captures

    fn shared_captures(sub: &str) -> Vec<PathBuf> {
        let dir = Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../testdata/captures"
        ))
        .join(sub);
        let mut out: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("capture directory {} is missing: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "pcap"))
            .collect();
        out.sort();
        assert!(!out.is_empty(), "no pcaps in {}", dir.display());
        out
    }

    /// Relative timestamps as tshark's summary prints them (second column).
    fn summary_times(pcap: &Path) -> Vec<String> {
        let txt = std::fs::read_to_string(pcap.with_extension("summary.txt")).unwrap();
        txt.lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| l.split_whitespace().nth(1).unwrap().to_string())
            .collect()
    }

    #[test]
    fn real_roce_captures() {
        let mut frames = 0;
        for path in shared_captures("roce") {
            let cap = read_pcap(&path).unwrap();
            let name = path.display();
            assert!(cap.warning.is_none(), "{name}: {:?}", cap.warning);
            assert!(!cap.packets.is_empty(), "{name}");
            let times = summary_times(&path);
            assert_eq!(
                times.len(),
                cap.packets.len(),
                "{name}: frame count vs summary"
            );
            for (p, t) in cap.packets.iter().zip(&times) {
                let rel = cap.relative(p);
                assert_eq!(
                    &format!("{}.{:06}", rel.as_secs(), rel.subsec_micros()),
                    t,
                    "{name} #{}",
                    p.index
                );
                let net = p
                    .net
                    .as_ref()
                    .unwrap_or_else(|e| panic!("{name} #{}: {e}", p.index));
                assert!(net.ip.header_checksum_ok(), "{name} #{}", p.index);
                let (sp, dp, len, _, _, pl) = udp_parts(&net.transport);
                assert!(
                    sp == 4791 || dp == 4791,
                    "{name} #{}: ports {sp} {dp}",
                    p.index
                );
                assert_eq!(pl.len(), usize::from(len) - 8, "{name} #{}", p.index);
                frames += 1;
            }
        }
        assert!(frames > 50);
    }

    #[test]
    fn real_iwarp_captures() {
        let mut exchanges = 0;
        let request_bin = std::fs::read(Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../testdata/captures/iwarp/e2-mpa-request.bin"
        )))
        .unwrap();
        for path in shared_captures("iwarp") {
            let name = path.display().to_string();
            let cap = read_pcap(&path).unwrap();
            assert!(cap.warning.is_none(), "{name}: {:?}", cap.warning);
            assert_eq!(summary_times(&path).len(), cap.packets.len(), "{name}");
            for p in &cap.packets {
                let net = p
                    .net
                    .as_ref()
                    .unwrap_or_else(|e| panic!("{name} #{}: {e}", p.index));
                assert!(
                    matches!(net.transport, Transport::Tcp { .. }),
                    "{name} #{}",
                    p.index
                );
            }
            let mut streams = TcpStreams::new();
            let mut events = Vec::new();
            for p in &cap.packets {
                events.extend(streams.push_packet(p));
            }
            events.extend(streams.finish());
            assert!(
                !events.iter().any(|e| matches!(e, StreamEvent::Gap { .. })),
                "{name}"
            );
            let first_data = |client: bool| {
                events.iter().find_map(|e| match e {
                    StreamEvent::Data(c) if streams.is_initiator(c.flow) == client => {
                        Some(c.clone())
                    }
                    _ => None,
                })
            };
            if name.contains("closed-port") {
                assert!(
                    first_data(true).is_none() && first_data(false).is_none(),
                    "{name}"
                );
                assert!(
                    events
                        .iter()
                        .any(|e| matches!(e, StreamEvent::Reset { .. })),
                    "{name}"
                );
                continue;
            }
            let req = first_data(true).unwrap_or_else(|| panic!("{name}: no client data"));
            assert!(
                req.data.starts_with(b"MPA ID Req Frame"),
                "{name}: {:?}",
                &req.data
            );
            if name.contains("mpa-timeout") {
                assert_eq!(req.data, request_bin, "{name}");
                assert!(
                    first_data(false).is_none(),
                    "{name}: the peer never replies"
                );
            } else {
                let rep = first_data(false).unwrap_or_else(|| panic!("{name}: no server data"));
                assert!(rep.data.starts_with(b"MPA ID Rep Frame"), "{name}");
                assert!(rep.index > req.index);
            }
            assert!(
                events.iter().any(|e| matches!(e, StreamEvent::Fin { .. })),
                "{name}"
            );
            exchanges += 1;
        }
        assert!(exchanges >= 6, "{exchanges}");
    }
}
