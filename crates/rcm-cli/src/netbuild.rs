//! Building IP/UDP/TCP packets and Ethernet frames, and writing them to pcap files.
//!
//! Used by tests (to make frames that [`crate::capture`] reads back) and for `--pcap` output:
//! everything produced here carries correct IPv4 header and TCP checksums so that tshark
//! dissects it without complaint. UDP checksums are 0, as Linux rxe sends RoCEv2.
// The owner wires these items into the CLI later; until then some are used only by tests.

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use pcap_file::pcap::{PcapHeader, PcapPacket, PcapWriter};
use pcap_file::{DataLink, Endianness, TsResolution};

use crate::capture::{
    linktype, CaptureError, TcpFlags, VlanTag, ETHERTYPE_IPV4, ETHERTYPE_IPV6, IPPROTO_TCP,
    IPPROTO_UDP,
};

/// Minimum Ethernet frame length without the FCS.
pub const ETHERNET_MIN_FRAME: usize = 60;

// ---------------------------------------------------------------------------------------------
// Checksums
// ---------------------------------------------------------------------------------------------

/// The Internet checksum (RFC 1071) of the concatenation of `parts`: the one's complement of
/// the one's-complement sum of 16-bit big-endian words (an odd final byte is padded with 0).
pub fn internet_checksum(parts: &[&[u8]]) -> u16 {
    let mut sum: u64 = 0;
    let mut high: Option<u8> = None;
    for &b in parts.iter().flat_map(|p| p.iter()) {
        match high.take() {
            None => high = Some(b),
            Some(h) => sum += u64::from(u16::from_be_bytes([h, b])),
        }
    }
    if let Some(h) = high {
        sum += u64::from(h) << 8;
    }
    while sum > 0xFFFF {
        sum = (sum & 0xFFFF) + (sum >> 16);
    }
    !(sum as u16)
}

/// The TCP/UDP pseudo-header for `src`/`dst` (both must be the same family).
fn pseudo_header(src: IpAddr, dst: IpAddr, protocol: u8, len: usize) -> Vec<u8> {
    let mut p = Vec::with_capacity(40);
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            p.extend_from_slice(&s.octets());
            p.extend_from_slice(&d.octets());
            p.push(0);
            p.push(protocol);
            p.extend_from_slice(&(len as u16).to_be_bytes());
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            p.extend_from_slice(&s.octets());
            p.extend_from_slice(&d.octets());
            p.extend_from_slice(&(len as u32).to_be_bytes());
            p.extend_from_slice(&[0, 0, 0, protocol]);
        }
        _ => panic!("pseudo_header: mixed IPv4/IPv6 addresses {src} and {dst}"),
    }
    p
}

/// The TCP/UDP checksum of `segment` (header with its checksum field as given, plus payload)
/// under the pseudo-header for `src`/`dst`. With the checksum field zeroed this is the value to
/// store; over a segment whose checksum is correct it returns 0.
///
/// # Panics
/// If `src` and `dst` are of different families.
pub fn transport_checksum(src: IpAddr, dst: IpAddr, protocol: u8, segment: &[u8]) -> u16 {
    let ph = pseudo_header(src, dst, protocol, segment.len());
    internet_checksum(&[&ph, segment])
}

// ---------------------------------------------------------------------------------------------
// IP headers
// ---------------------------------------------------------------------------------------------

fn len16(what: &str, n: usize) -> u16 {
    u16::try_from(n).unwrap_or_else(|_| panic!("{what}: length {n} does not fit in 16 bits"))
}

/// A 20-byte IPv4 header (no options, DF set, correct header checksum) for a packet whose
/// payload (transport header + data) is `payload_len` bytes.
///
/// # Panics
/// If the total length exceeds 65535.
pub fn ipv4_header(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    protocol: u8,
    tos: u8,
    ttl: u8,
    ident: u16,
    payload_len: usize,
) -> [u8; 20] {
    let total = len16("IPv4 packet", 20 + payload_len);
    let mut h = [0u8; 20];
    h[0] = 0x45;
    h[1] = tos;
    h[2..4].copy_from_slice(&total.to_be_bytes());
    h[4..6].copy_from_slice(&ident.to_be_bytes());
    h[6] = 0x40; // DF
    h[8] = ttl;
    h[9] = protocol;
    h[12..16].copy_from_slice(&src.octets());
    h[16..20].copy_from_slice(&dst.octets());
    let c = internet_checksum(&[&h]);
    h[10..12].copy_from_slice(&c.to_be_bytes());
    h
}

/// A 40-byte IPv6 header for a payload of `payload_len` bytes.
///
/// # Panics
/// If the payload length exceeds 65535.
pub fn ipv6_header(
    src: Ipv6Addr,
    dst: Ipv6Addr,
    next_header: u8,
    traffic_class: u8,
    flow_label: u32,
    hop_limit: u8,
    payload_len: usize,
) -> [u8; 40] {
    let plen = len16("IPv6 payload", payload_len);
    let mut h = [0u8; 40];
    let word0 = (6u32 << 28) | (u32::from(traffic_class) << 20) | (flow_label & 0x000F_FFFF);
    h[0..4].copy_from_slice(&word0.to_be_bytes());
    h[4..6].copy_from_slice(&plen.to_be_bytes());
    h[6] = next_header;
    h[7] = hop_limit;
    h[8..24].copy_from_slice(&src.octets());
    h[24..40].copy_from_slice(&dst.octets());
    h
}

fn udp_datagram(sport: u16, dport: u16, payload: &[u8]) -> Vec<u8> {
    let len = len16("UDP datagram", 8 + payload.len());
    let mut d = Vec::with_capacity(8 + payload.len());
    d.extend_from_slice(&sport.to_be_bytes());
    d.extend_from_slice(&dport.to_be_bytes());
    d.extend_from_slice(&len.to_be_bytes());
    d.extend_from_slice(&[0, 0]); // checksum 0
    d.extend_from_slice(payload);
    d
}

/// An IPv4 packet (DF set, correct header checksum) carrying a UDP datagram with checksum 0.
///
/// # Panics
/// If the packet would exceed 65535 bytes.
#[allow(clippy::too_many_arguments)]
pub fn ipv4_udp(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    sport: u16,
    dport: u16,
    tos: u8,
    ttl: u8,
    ident: u16,
    payload: &[u8],
) -> Vec<u8> {
    let udp = udp_datagram(sport, dport, payload);
    let mut p = ipv4_header(src, dst, IPPROTO_UDP, tos, ttl, ident, udp.len()).to_vec();
    p.extend_from_slice(&udp);
    p
}

/// An IPv6 packet carrying a UDP datagram with checksum 0 (as Linux rxe sends RoCEv2).
///
/// # Panics
/// If the payload would exceed 65535 bytes.
#[allow(clippy::too_many_arguments)]
pub fn ipv6_udp(
    src: Ipv6Addr,
    dst: Ipv6Addr,
    sport: u16,
    dport: u16,
    traffic_class: u8,
    flow_label: u32,
    hop_limit: u8,
    payload: &[u8],
) -> Vec<u8> {
    let udp = udp_datagram(sport, dport, payload);
    let mut p = ipv6_header(
        src,
        dst,
        IPPROTO_UDP,
        traffic_class,
        flow_label,
        hop_limit,
        udp.len(),
    )
    .to_vec();
    p.extend_from_slice(&udp);
    p
}

// ---------------------------------------------------------------------------------------------
// TCP
// ---------------------------------------------------------------------------------------------

/// The fields of a TCP segment to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpSegment<'a> {
    /// Source port.
    pub src_port: u16,
    /// Destination port.
    pub dst_port: u16,
    /// Sequence number.
    pub seq: u32,
    /// Acknowledgement number (sent as is, whether or not ACK is set).
    pub ack: u32,
    /// Flags.
    pub flags: TcpFlags,
    /// Window.
    pub window: u16,
    /// Raw TCP options (padded with zero bytes to a multiple of 4; at most 40 bytes).
    pub options: &'a [u8],
    /// Payload.
    pub payload: &'a [u8],
}

/// The TCP MSS option (kind 2) announcing `mss`.
pub fn tcp_mss_option(mss: u16) -> [u8; 4] {
    let m = mss.to_be_bytes();
    [2, 4, m[0], m[1]]
}

/// The bytes of a TCP segment with a correct checksum for the `src`/`dst` pseudo-header.
///
/// # Panics
/// If the options exceed 40 bytes or the addresses are of different families.
pub fn tcp_segment(src: IpAddr, dst: IpAddr, seg: &TcpSegment<'_>) -> Vec<u8> {
    let opt_len = seg.options.len().div_ceil(4) * 4;
    assert!(opt_len <= 40, "TCP options longer than 40 bytes");
    let hlen = 20 + opt_len;
    let mut t = Vec::with_capacity(hlen + seg.payload.len());
    t.extend_from_slice(&seg.src_port.to_be_bytes());
    t.extend_from_slice(&seg.dst_port.to_be_bytes());
    t.extend_from_slice(&seg.seq.to_be_bytes());
    t.extend_from_slice(&seg.ack.to_be_bytes());
    t.push(((hlen / 4) as u8) << 4);
    t.push(seg.flags.0);
    t.extend_from_slice(&seg.window.to_be_bytes());
    t.extend_from_slice(&[0, 0, 0, 0]); // checksum, urgent pointer
    t.extend_from_slice(seg.options);
    t.resize(hlen, 0);
    t.extend_from_slice(seg.payload);
    let c = transport_checksum(src, dst, IPPROTO_TCP, &t);
    t[16..18].copy_from_slice(&c.to_be_bytes());
    t
}

/// An IPv4 packet (DF set, TOS 0) carrying `seg` with correct IP and TCP checksums.
///
/// # Panics
/// If the packet would exceed 65535 bytes.
pub fn ipv4_tcp(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    ttl: u8,
    ident: u16,
    seg: &TcpSegment<'_>,
) -> Vec<u8> {
    let tcp = tcp_segment(IpAddr::V4(src), IpAddr::V4(dst), seg);
    let mut p = ipv4_header(src, dst, IPPROTO_TCP, 0, ttl, ident, tcp.len()).to_vec();
    p.extend_from_slice(&tcp);
    p
}

/// An IPv6 packet (traffic class 0, flow label 0) carrying `seg` with a correct TCP checksum.
///
/// # Panics
/// If the payload would exceed 65535 bytes.
pub fn ipv6_tcp(src: Ipv6Addr, dst: Ipv6Addr, hop_limit: u8, seg: &TcpSegment<'_>) -> Vec<u8> {
    let tcp = tcp_segment(IpAddr::V6(src), IpAddr::V6(dst), seg);
    let mut p = ipv6_header(src, dst, IPPROTO_TCP, 0, 0, hop_limit, tcp.len()).to_vec();
    p.extend_from_slice(&tcp);
    p
}

// ---------------------------------------------------------------------------------------------
// Link layer
// ---------------------------------------------------------------------------------------------

/// An Ethernet II frame (no FCS, no padding). Arguments are source first; on the wire the
/// destination MAC comes first, then the source MAC, the ethertype and the payload.
pub fn ethernet(src_mac: [u8; 6], dst_mac: [u8; 6], ethertype: u16, payload: &[u8]) -> Vec<u8> {
    ethernet_vlan(src_mac, dst_mac, &[], ethertype, payload)
}

/// An Ethernet II frame with VLAN tags (outermost first) before the ethertype.
pub fn ethernet_vlan(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    tags: &[VlanTag],
    ethertype: u16,
    payload: &[u8],
) -> Vec<u8> {
    let mut f = Vec::with_capacity(14 + 4 * tags.len() + payload.len());
    f.extend_from_slice(&dst_mac);
    f.extend_from_slice(&src_mac);
    for t in tags {
        f.extend_from_slice(&t.tpid.to_be_bytes());
        f.extend_from_slice(&t.tci.to_be_bytes());
    }
    f.extend_from_slice(&ethertype.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// The ethertype for an IP packet from its version nibble (0x0800 or 0x86DD).
///
/// # Panics
/// If the packet is empty or its version is neither 4 nor 6.
pub fn ip_ethertype(ip_packet: &[u8]) -> u16 {
    match ip_packet.first().map(|b| b >> 4) {
        Some(4) => ETHERTYPE_IPV4,
        Some(6) => ETHERTYPE_IPV6,
        v => panic!("ip_ethertype: not an IP packet (version {v:?})"),
    }
}

/// An Ethernet II frame carrying an IP packet, the ethertype picked from the IP version.
///
/// # Panics
/// If `ip_packet` is not IPv4 or IPv6.
pub fn ethernet_ip(src_mac: [u8; 6], dst_mac: [u8; 6], ip_packet: &[u8]) -> Vec<u8> {
    ethernet(src_mac, dst_mac, ip_ethertype(ip_packet), ip_packet)
}

/// Pads a frame with zeros to the 60-byte Ethernet minimum, as a NIC does on the wire.
pub fn pad_ethernet(mut frame: Vec<u8>) -> Vec<u8> {
    if frame.len() < ETHERNET_MIN_FRAME {
        frame.resize(ETHERNET_MIN_FRAME, 0);
    }
    frame
}

/// A Linux cooked (SLL, link type 113) frame: packet type (0 = to us, 4 = outgoing),
/// ARPHRD_ETHER, the sender's MAC, the protocol (ethertype) and the payload.
pub fn linux_sll(packet_type: u16, src_mac: [u8; 6], ethertype: u16, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(16 + payload.len());
    f.extend_from_slice(&packet_type.to_be_bytes());
    f.extend_from_slice(&1u16.to_be_bytes()); // ARPHRD_ETHER
    f.extend_from_slice(&6u16.to_be_bytes());
    f.extend_from_slice(&src_mac);
    f.extend_from_slice(&[0, 0]);
    f.extend_from_slice(&ethertype.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// A Linux cooked v2 (SLL2, link type 276) frame.
pub fn linux_sll2(
    ethertype: u16,
    ifindex: u32,
    packet_type: u8,
    src_mac: [u8; 6],
    payload: &[u8],
) -> Vec<u8> {
    let mut f = Vec::with_capacity(20 + payload.len());
    f.extend_from_slice(&ethertype.to_be_bytes());
    f.extend_from_slice(&[0, 0]);
    f.extend_from_slice(&ifindex.to_be_bytes());
    f.extend_from_slice(&1u16.to_be_bytes()); // ARPHRD_ETHER
    f.push(packet_type);
    f.push(6);
    f.extend_from_slice(&src_mac);
    f.extend_from_slice(&[0, 0]);
    f.extend_from_slice(payload);
    f
}

// ---------------------------------------------------------------------------------------------
// pcap output
// ---------------------------------------------------------------------------------------------

/// Snap length written in pcap headers (frames longer than this cannot be written).
pub const PCAP_SNAPLEN: u32 = 262_144;

/// A classic pcap writer (Ethernet link type by default) over any `Write`.
pub struct PcapOut<W: Write> {
    writer: PcapWriter<W>,
}

impl<W: Write> PcapOut<W> {
    /// A little-endian, microsecond-resolution pcap with Ethernet link type; writes the header.
    pub fn new(writer: W) -> Result<Self, CaptureError> {
        Self::with_options(
            writer,
            linktype::ETHERNET,
            TsResolution::MicroSecond,
            Endianness::Little,
        )
    }

    /// A pcap with the given link type, timestamp resolution and byte order; writes the header.
    pub fn with_options(
        writer: W,
        linktype: u32,
        ts_resolution: TsResolution,
        endianness: Endianness,
    ) -> Result<Self, CaptureError> {
        let header = PcapHeader {
            snaplen: PCAP_SNAPLEN,
            datalink: DataLink::from(linktype),
            ts_resolution,
            endianness,
            ..PcapHeader::default()
        };
        let writer = PcapWriter::with_header(writer, header).map_err(CaptureError::Write)?;
        Ok(PcapOut { writer })
    }

    /// Appends one frame with its timestamp (since the Unix epoch), captured in full.
    pub fn write_frame(&mut self, ts: Duration, frame: &[u8]) -> Result<(), CaptureError> {
        let len = u32::try_from(frame.len()).unwrap_or(u32::MAX);
        self.write_snapped(ts, len, frame)
    }

    /// Appends one frame whose on-wire length `orig_len` may exceed the captured bytes.
    pub fn write_snapped(
        &mut self,
        ts: Duration,
        orig_len: u32,
        frame: &[u8],
    ) -> Result<(), CaptureError> {
        self.writer
            .write_packet(&PcapPacket::new(ts, orig_len, frame))
            .map_err(CaptureError::Write)?;
        Ok(())
    }

    /// Flushes and returns the inner writer.
    pub fn into_inner(self) -> Result<W, CaptureError> {
        let mut w = self.writer.into_writer();
        w.flush()?;
        Ok(w)
    }
}

// ---------------------------------------------------------------------------------------------
// Whole TCP conversations
// ---------------------------------------------------------------------------------------------

/// One end of a [`TcpFlowBuilder`] conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    /// The side that sends the SYN.
    Client,
    /// The side that answers it.
    Server,
}

impl Peer {
    /// The other side.
    pub fn other(self) -> Peer {
        match self {
            Peer::Client => Peer::Server,
            Peer::Server => Peer::Client,
        }
    }

    fn idx(self) -> usize {
        match self {
            Peer::Client => 0,
            Peer::Server => 1,
        }
    }
}

/// Builds a realistic TCP conversation as Ethernet frames: handshake (with MSS options), data
/// each way (split at the MSS, each burst acknowledged by the peer), and a FIN/ACK close.
///
/// ```ignore
/// let mut b = TcpFlowBuilder::new(client, server);
/// b.handshake().client_send(b"MPA ID Req Frame...").server_send(reply).close();
/// for (ts, frame) in b.frames() { out.write_frame(*ts, frame)?; }
/// ```
#[derive(Debug, Clone)]
pub struct TcpFlowBuilder {
    addr: [SocketAddr; 2],
    mac: [[u8; 6]; 2],
    isn: [u32; 2],
    next: [u32; 2],
    ident: [u16; 2],
    window: u16,
    mss: u16,
    ttl: u8,
    ts: Duration,
    step: Duration,
    frames: Vec<(Duration, Vec<u8>)>,
}

impl TcpFlowBuilder {
    /// A conversation between `client` and `server` (same address family), with default ISNs,
    /// locally administered MACs, MSS 1448, and frames 100 µs apart from 2023-11-14T22:13:20Z.
    ///
    /// # Panics
    /// If the two addresses are of different families.
    pub fn new(client: SocketAddr, server: SocketAddr) -> Self {
        assert_eq!(
            client.is_ipv4(),
            server.is_ipv4(),
            "TcpFlowBuilder: client and server must be the same address family"
        );
        TcpFlowBuilder {
            addr: [client, server],
            mac: [
                [0x02, 0x00, 0x00, 0x00, 0x00, 0x01],
                [0x02, 0x00, 0x00, 0x00, 0x00, 0x02],
            ],
            isn: [0x1000_0000, 0x2000_0000],
            next: [0x1000_0000, 0x2000_0000],
            ident: [0x1000, 0x2000],
            window: 64240,
            mss: 1448,
            ttl: 64,
            ts: Duration::from_secs(1_700_000_000),
            step: Duration::from_micros(100),
            frames: Vec::new(),
        }
    }

    /// Sets the initial sequence numbers (before [`TcpFlowBuilder::handshake`]).
    #[must_use]
    pub fn isns(mut self, client: u32, server: u32) -> Self {
        self.isn = [client, server];
        self.next = [client, server];
        self
    }

    /// Sets the MAC addresses.
    #[must_use]
    pub fn macs(mut self, client: [u8; 6], server: [u8; 6]) -> Self {
        self.mac = [client, server];
        self
    }

    /// Sets the first timestamp and the spacing between frames.
    #[must_use]
    pub fn start(mut self, ts: Duration, step: Duration) -> Self {
        self.ts = ts;
        self.step = step;
        self
    }

    /// Sets the maximum segment size data is split at (at least 1).
    #[must_use]
    pub fn mss(mut self, mss: u16) -> Self {
        self.mss = mss.max(1);
        self
    }

    /// The address of `peer`.
    pub fn addr(&self, peer: Peer) -> SocketAddr {
        self.addr[peer.idx()]
    }

    /// The sequence number `peer` will send next.
    pub fn next_seq(&self, peer: Peer) -> u32 {
        self.next[peer.idx()]
    }

    /// Appends one segment from `from` with explicit sequence/ack numbers and flags, without
    /// touching the builder's sequence state (for retransmissions, reordering, RSTs...).
    pub fn raw_segment(
        &mut self,
        from: Peer,
        seq: u32,
        ack: u32,
        flags: TcpFlags,
        options: &[u8],
        payload: &[u8],
    ) -> &mut Self {
        let (i, j) = (from.idx(), from.other().idx());
        let seg = TcpSegment {
            src_port: self.addr[i].port(),
            dst_port: self.addr[j].port(),
            seq,
            ack,
            flags,
            window: self.window,
            options,
            payload,
        };
        let ip = match (self.addr[i].ip(), self.addr[j].ip()) {
            (IpAddr::V4(s), IpAddr::V4(d)) => ipv4_tcp(s, d, self.ttl, self.ident[i], &seg),
            (IpAddr::V6(s), IpAddr::V6(d)) => ipv6_tcp(s, d, self.ttl, &seg),
            _ => unreachable!("families checked in new()"),
        };
        self.ident[i] = self.ident[i].wrapping_add(1);
        let frame = ethernet_ip(self.mac[i], self.mac[j], &ip);
        self.frames.push((self.ts, frame));
        self.ts += self.step;
        self
    }

    /// Appends a segment from `from` at its current sequence number, acknowledging everything
    /// the other side sent, and advances `from`'s sequence number (SYN and FIN count one).
    pub fn segment(&mut self, from: Peer, flags: TcpFlags, payload: &[u8]) -> &mut Self {
        let (i, j) = (from.idx(), from.other().idx());
        let seq = self.next[i];
        let ack = if flags.ack() { self.next[j] } else { 0 };
        let mss_opt = tcp_mss_option(self.mss);
        let options: &[u8] = if flags.syn() { &mss_opt } else { &[] };
        self.raw_segment(from, seq, ack, flags, options, payload);
        let consumed = payload.len() as u32 + u32::from(flags.syn()) + u32::from(flags.fin());
        self.next[i] = seq.wrapping_add(consumed);
        self
    }

    /// SYN, SYN/ACK, ACK.
    pub fn handshake(&mut self) -> &mut Self {
        self.next = self.isn;
        self.segment(Peer::Client, TcpFlags::SYN, &[])
            .segment(Peer::Server, TcpFlags::SYN | TcpFlags::ACK, &[])
            .segment(Peer::Client, TcpFlags::ACK, &[])
    }

    /// A SYN answered by RST/ACK (connection refused).
    pub fn refused(&mut self) -> &mut Self {
        self.next = self.isn;
        self.segment(Peer::Client, TcpFlags::SYN, &[]);
        let ack = self.next[Peer::Client.idx()];
        self.raw_segment(
            Peer::Server,
            0,
            ack,
            TcpFlags::RST | TcpFlags::ACK,
            &[],
            &[],
        )
    }

    /// `from` sends `data` (split at the MSS, PSH on the last segment), then the peer ACKs.
    pub fn send(&mut self, from: Peer, data: &[u8]) -> &mut Self {
        let chunks: Vec<&[u8]> = data.chunks(usize::from(self.mss)).collect();
        let n = chunks.len();
        for (k, chunk) in chunks.into_iter().enumerate() {
            let flags = if k + 1 == n {
                TcpFlags::ACK | TcpFlags::PSH
            } else {
                TcpFlags::ACK
            };
            self.segment(from, flags, chunk);
        }
        if n > 0 {
            self.segment(from.other(), TcpFlags::ACK, &[]);
        }
        self
    }

    /// The client sends `data`, the server ACKs.
    pub fn client_send(&mut self, data: &[u8]) -> &mut Self {
        self.send(Peer::Client, data)
    }

    /// The server sends `data`, the client ACKs.
    pub fn server_send(&mut self, data: &[u8]) -> &mut Self {
        self.send(Peer::Server, data)
    }

    /// `from` sends FIN/ACK, the peer ACKs it (a half close).
    pub fn fin(&mut self, from: Peer) -> &mut Self {
        self.segment(from, TcpFlags::FIN | TcpFlags::ACK, &[])
            .segment(from.other(), TcpFlags::ACK, &[])
    }

    /// Graceful close started by the client: FIN/ACK, FIN/ACK, ACK.
    pub fn close(&mut self) -> &mut Self {
        self.segment(Peer::Client, TcpFlags::FIN | TcpFlags::ACK, &[])
            .segment(Peer::Server, TcpFlags::FIN | TcpFlags::ACK, &[])
            .segment(Peer::Client, TcpFlags::ACK, &[])
    }

    /// `from` aborts with RST/ACK.
    pub fn reset(&mut self, from: Peer) -> &mut Self {
        self.segment(from, TcpFlags::RST | TcpFlags::ACK, &[])
    }

    /// The frames so far, with their timestamps.
    pub fn frames(&self) -> &[(Duration, Vec<u8>)] {
        &self.frames
    }

    /// Consumes the builder, returning the frames.
    pub fn into_frames(self) -> Vec<(Duration, Vec<u8>)> {
        self.frames
    }

    /// Writes every frame to `out`.
    pub fn write_to<W: Write>(&self, out: &mut PcapOut<W>) -> Result<(), CaptureError> {
        for (ts, frame) in &self.frames {
            out.write_frame(*ts, frame)?;
        }
        Ok(())
    }

    /// The whole conversation as an in-memory Ethernet pcap.
    pub fn to_pcap(&self) -> Result<Vec<u8>, CaptureError> {
        let mut out = PcapOut::new(Vec::new())?;
        self.write_to(&mut out)?;
        out.into_inner()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capture::{
        read_pcap, read_pcap_bytes, tcp_stream_events, Capture, FlowKey, StreamEvent, Transport,
    };
    use std::path::Path;

    const MAC_A: [u8; 6] = [0x02, 0, 0, 0, 0, 0xA];
    const MAC_B: [u8; 6] = [0x02, 0, 0, 0, 0, 0xB];

    fn shared(rel: &str) -> Capture {
        let p = Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../testdata/captures"
        ))
        .join(rel);
        read_pcap(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    }

    #[test]
    fn ipv4_header_known_answer_and_checksum() {
        // The classic example header: 4500 0073 0000 4000 4011 b861 c0a8 0001 c0a8 00c7.
        let h = ipv4_header(
            Ipv4Addr::new(192, 168, 0, 1),
            Ipv4Addr::new(192, 168, 0, 199),
            17,
            0,
            64,
            0,
            0x73 - 20,
        );
        assert_eq!(
            h,
            [
                0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0xb8, 0x61, 0xc0, 0xa8,
                0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7
            ]
        );
        for (tos, ttl, ident, len) in [
            (0, 1, 0, 0),
            (0xFF, 255, 0xFFFF, 65_515),
            (0x68, 64, 0x1234, 300),
        ] {
            let h = ipv4_header(
                Ipv4Addr::new(198, 18, 0, 1),
                Ipv4Addr::BROADCAST,
                6,
                tos,
                ttl,
                ident,
                len,
            );
            // One's-complement sum over the header including its checksum is 0xFFFF.
            let mut sum: u32 = h
                .chunks(2)
                .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
                .sum();
            while sum > 0xFFFF {
                sum = (sum & 0xFFFF) + (sum >> 16);
            }
            assert_eq!(sum, 0xFFFF);
            assert_eq!(internet_checksum(&[&h]), 0);
        }
    }

    #[test]
    fn internet_checksum_odd_and_split() {
        let data: Vec<u8> = (1..=37u8).collect();
        let whole = internet_checksum(&[&data]);
        assert_eq!(
            internet_checksum(&[&data[..5], &data[5..6], &data[6..]]),
            whole
        );
        assert_eq!(internet_checksum(&[]), 0xFFFF);
        assert_eq!(internet_checksum(&[&[0xFF, 0xFF]]), 0);
    }

    #[test]
    fn tcp_checksums_verify() {
        for payload in [&b""[..], b"x", b"odd length payload!", &[0xFF; 1000]] {
            let seg = TcpSegment {
                src_port: 60813,
                dst_port: 7471,
                seq: 0xDEAD_BEEF,
                ack: 0x0102_0304,
                flags: TcpFlags::ACK | TcpFlags::PSH,
                window: 501,
                options: &[1, 1, 8, 10, 0, 0, 0, 1, 0, 0, 0, 2],
                payload,
            };
            let (s4, d4) = (Ipv4Addr::new(198, 18, 4, 1), Ipv4Addr::new(198, 18, 4, 2));
            let p = ipv4_tcp(s4, d4, 64, 9, &seg);
            assert_eq!(internet_checksum(&[&p[..20]]), 0);
            assert_eq!(
                transport_checksum(s4.into(), d4.into(), IPPROTO_TCP, &p[20..]),
                0
            );
            assert_eq!(p.len(), 20 + 32 + payload.len());

            let (s6, d6): (Ipv6Addr, Ipv6Addr) =
                ("2001:2::1".parse().unwrap(), "2001:2::2".parse().unwrap());
            let p = ipv6_tcp(s6, d6, 64, &seg);
            assert_eq!(
                transport_checksum(s6.into(), d6.into(), IPPROTO_TCP, &p[40..]),
                0
            );
            let mut broken = p[40..].to_vec();
            broken[30] ^= 1;
            assert_ne!(
                transport_checksum(s6.into(), d6.into(), IPPROTO_TCP, &broken),
                0
            );
        }
    }

    #[test]
    fn ethernet_layout() {
        let f = ethernet(MAC_A, MAC_B, 0x0800, b"x");
        assert_eq!(&f[..6], &MAC_B, "destination first");
        assert_eq!(&f[6..12], &MAC_A);
        assert_eq!(&f[12..14], &[0x08, 0x00]);
        assert_eq!(f.len(), 15);
        assert_eq!(pad_ethernet(f.clone()).len(), 60);
        assert_eq!(pad_ethernet(vec![0; 70]).len(), 70);
        let ip6 = ipv6_udp(Ipv6Addr::LOCALHOST, Ipv6Addr::LOCALHOST, 1, 2, 0, 0, 1, b"");
        assert_eq!(&ethernet_ip(MAC_A, MAC_B, &ip6)[12..14], &[0x86, 0xDD]);
        let tagged = ethernet_vlan(
            MAC_A,
            MAC_B,
            &[VlanTag {
                tpid: 0x8100,
                tci: 0x2005,
            }],
            0x0800,
            b"",
        );
        assert_eq!(&tagged[12..18], &[0x81, 0x00, 0x20, 0x05, 0x08, 0x00]);
        assert_eq!(tcp_mss_option(1460), [2, 4, 0x05, 0xB4]);
    }

    /// Re-encoding every real RoCEv2 frame from its decoded fields gives the original bytes.
    #[test]
    fn rebuilds_real_roce_frames_exactly() {
        for name in [
            "roce/b-req.pcap",
            "roce/c1-veth2.pcap",
            "roce/f1-ipv6.pcap",
            "roce/f1-mra.pcap",
            "roce/b-sidr.pcap",
        ] {
            let cap = shared(name);
            for p in &cap.packets {
                let net = p.net.as_ref().unwrap();
                let Transport::Udp {
                    src_port,
                    dst_port,
                    payload,
                    ..
                } = &net.transport
                else {
                    panic!("{name} #{}: not UDP", p.index)
                };
                let ip = match (net.ip.src, net.ip.dst) {
                    (IpAddr::V4(s), IpAddr::V4(d)) => ipv4_udp(
                        s,
                        d,
                        *src_port,
                        *dst_port,
                        net.ip.tos,
                        net.ip.ttl,
                        net.ip.ident.unwrap(),
                        payload,
                    ),
                    (IpAddr::V6(s), IpAddr::V6(d)) => ipv6_udp(
                        s,
                        d,
                        *src_port,
                        *dst_port,
                        net.ip.tos,
                        net.ip.flow_label.unwrap(),
                        net.ip.ttl,
                        payload,
                    ),
                    _ => unreachable!(),
                };
                let frame = ethernet_ip(net.link.src_mac.unwrap(), net.link.dst_mac.unwrap(), &ip);
                let frame = if p.frame.len() == ETHERNET_MIN_FRAME {
                    pad_ethernet(frame)
                } else {
                    frame
                };
                assert_eq!(frame, p.frame, "{name} #{}", p.index);
            }
        }
    }

    /// Re-encoding every real iWARP TCP segment from its decoded fields gives the original bytes,
    /// except the TCP checksum: siw's senders left offload-partial checksums in these captures,
    /// so ours is checked against the values tshark 4.0 calculates instead.
    #[test]
    fn rebuilds_real_tcp_frames_exactly() {
        const V2_UCMATOSE_TSHARK: [u16; 17] = [
            0x414d, 0x4c28, 0x7772, 0x09be, 0x773b, 0x097b, 0x76ff, 0x0a71, 0x7669, 0x09de, 0x75e0,
            0x0964, 0x08e6, 0x74de, 0x74d7, 0x74d2, 0x74ca,
        ];
        const CLOSED_PORT_TSHARK: [u16; 2] = [0xd035, 0x0ed4];
        let mut n = 0;
        for (name, tshark) in [
            ("iwarp/e1-v2-ucmatose.pcap", &V2_UCMATOSE_TSHARK[..]),
            ("iwarp/e1-closed-port.pcap", &CLOSED_PORT_TSHARK[..]),
            ("iwarp/e2-mpa-timeout.pcap", &[][..]),
        ] {
            let cap = shared(name);
            for p in &cap.packets {
                let net = p.net.as_ref().unwrap();
                let Transport::Tcp {
                    src_port,
                    dst_port,
                    seq,
                    ack,
                    flags,
                    window,
                    header,
                    payload,
                    ..
                } = &net.transport
                else {
                    panic!("{name} #{}: not TCP", p.index)
                };
                assert_eq!(net.ip.tos, 0);
                assert_eq!(&header[18..20], &[0, 0], "urgent pointer");
                let seg = TcpSegment {
                    src_port: *src_port,
                    dst_port: *dst_port,
                    seq: *seq,
                    ack: *ack,
                    flags: *flags,
                    window: *window,
                    options: &header[20..],
                    payload,
                };
                let (IpAddr::V4(s), IpAddr::V4(d)) = (net.ip.src, net.ip.dst) else {
                    unreachable!()
                };
                let ip = ipv4_tcp(s, d, net.ip.ttl, net.ip.ident.unwrap(), &seg);
                let frame = ethernet_ip(net.link.src_mac.unwrap(), net.link.dst_mac.unwrap(), &ip);
                // TCP checksum at Ethernet 14 + IPv4 20 + 16.
                let ours = u16::from_be_bytes([frame[50], frame[51]]);
                if let Some(&want) = tshark.get(p.index - 1) {
                    assert_eq!(ours, want, "{name} #{}", p.index);
                }
                let mut masked = p.frame[..frame.len()].to_vec();
                masked[50..52].copy_from_slice(&frame[50..52]);
                assert_eq!(frame, masked, "{name} #{}", p.index);
                n += 1;
            }
        }
        assert!(n > 20);
    }

    #[test]
    fn tcp_flow_builder_round_trips() {
        let client: SocketAddr = "[2001:2::1]:50000".parse().unwrap();
        let server: SocketAddr = "[2001:2::2]:7471".parse().unwrap();
        let mut b = TcpFlowBuilder::new(client, server)
            .macs(MAC_A, MAC_B)
            .mss(8)
            .start(Duration::from_secs(10), Duration::from_millis(1));
        b.handshake()
            .client_send(b"MPA ID Req Frame")
            .server_send(b"MPA ID Rep Frame")
            .close();
        // 3 + (2 data + ack) + (2 data + ack) + 3
        assert_eq!(b.frames().len(), 12);
        assert_eq!(b.addr(Peer::Client), client);
        let bytes = b.to_pcap().unwrap();
        let cap = read_pcap_bytes(&bytes).unwrap();
        assert_eq!(cap.packets.len(), 12);
        assert_eq!(cap.packets[11].ts, Duration::from_millis(10_011));
        // Every segment acknowledges exactly what the peer has sent so far.
        let mut sent = std::collections::HashMap::new();
        for p in &cap.packets {
            let net = p.net.as_ref().unwrap();
            let Transport::Tcp {
                seq,
                ack,
                flags,
                payload,
                header,
                ..
            } = &net.transport
            else {
                panic!()
            };
            let me = net.src();
            let peer = net.dst();
            if flags.syn() {
                assert_eq!(&header[20..24], &tcp_mss_option(8));
            }
            if let Some(&expect) = sent.get(&me) {
                assert_eq!(*seq, expect, "#{}", p.index);
            }
            if flags.ack() {
                assert_eq!(Some(ack), sent.get(&peer), "#{}", p.index);
            }
            let used = payload.len() as u32 + u32::from(flags.syn()) + u32::from(flags.fin());
            sent.insert(me, seq.wrapping_add(used));
            let ip = &p.frame[14..];
            assert_eq!(
                transport_checksum(net.ip.src, net.ip.dst, IPPROTO_TCP, &ip[40..]),
                0
            );
        }
        let ev = tcp_stream_events(&cap.packets);
        let text = |flow: FlowKey| -> Vec<u8> {
            ev.iter()
                .filter_map(|e| match e {
                    StreamEvent::Data(c) if c.flow == flow => Some(c.data.clone()),
                    _ => None,
                })
                .flatten()
                .collect()
        };
        let c2s = FlowKey {
            src: client,
            dst: server,
        };
        assert_eq!(text(c2s), b"MPA ID Req Frame");
        assert_eq!(text(c2s.reverse()), b"MPA ID Rep Frame");
    }

    #[test]
    fn tcp_flow_builder_refused_reset_and_raw() {
        let client: SocketAddr = "198.18.4.1:40000".parse().unwrap();
        let server: SocketAddr = "198.18.4.2:7471".parse().unwrap();
        let mut b = TcpFlowBuilder::new(client, server);
        b.refused();
        let cap = read_pcap_bytes(&b.to_pcap().unwrap()).unwrap();
        assert_eq!(cap.packets.len(), 2);
        let ev = tcp_stream_events(&cap.packets);
        assert!(matches!(ev[0], StreamEvent::Syn { .. }));
        assert!(matches!(ev[1], StreamEvent::Reset { index: 2, .. }));

        let mut b = TcpFlowBuilder::new(client, server).isns(1, 2);
        b.handshake();
        let next = b.next_seq(Peer::Client);
        assert_eq!(next, 2);
        // Out of order then the hole, built by hand; then a FIN from the server only.
        b.raw_segment(Peer::Client, next + 3, 3, TcpFlags::ACK, &[], b"def")
            .raw_segment(Peer::Client, next, 3, TcpFlags::ACK, &[], b"abc")
            .fin(Peer::Server)
            .reset(Peer::Client);
        let cap = read_pcap_bytes(&b.to_pcap().unwrap()).unwrap();
        let ev = tcp_stream_events(&cap.packets);
        let data: Vec<u8> = ev
            .iter()
            .filter_map(|e| match e {
                StreamEvent::Data(c) => Some(c.data.clone()),
                _ => None,
            })
            .flatten()
            .collect();
        assert_eq!(data, b"abcdef");
        assert_eq!(
            ev.iter()
                .filter(|e| matches!(e, StreamEvent::Fin { .. }))
                .count(),
            1
        );
        assert!(matches!(ev.last(), Some(StreamEvent::Reset { .. })));
        assert_eq!(b.into_frames().len(), 3 + 2 + 2 + 1);
    }
}
