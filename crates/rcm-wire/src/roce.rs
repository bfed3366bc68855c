//! RoCEv2 encapsulation: BTH, DETH, the invariant CRC, and whole GSI datagrams.
//!
//! A RoCEv2 packet is an InfiniBand transport packet (BTH, extended headers, payload, pad,
//! ICRC) carried as the payload of a UDP datagram to port 4791. The CM talks through the GSI
//! (QP1) with UD SEND Only packets: BTH + DETH + a 256-byte MAD + ICRC, 280 bytes of UDP
//! payload. Reference: wire-formats.md §1.

use crate::bits::Field;
use crate::{need, Result, WireError};
use std::net::{Ipv4Addr, Ipv6Addr};

/// UDP destination port of RoCEv2 (IANA; Linux `ROCE_V2_UDP_DPORT`).
pub const ROCE_V2_UDP_PORT: u16 = 4791;
/// The well-known Q_Key of the GSI (QP1), `IB_QP1_QKEY`.
pub const GSI_QKEY: u32 = 0x8001_0000;
/// The default full-member partition key.
pub const DEFAULT_PKEY: u16 = 0xFFFF;
/// QPN of the general services interface.
pub const GSI_QPN: u32 = 1;
/// Length of the Base Transport Header.
pub const BTH_LEN: usize = 12;
/// Length of the Datagram Extended Transport Header.
pub const DETH_LEN: usize = 8;
/// Length of the invariant CRC trailer.
pub const ICRC_LEN: usize = 4;
/// A MAD on the wire (base version 1) is always this long.
pub const MAD_LEN: usize = 256;
/// UDP payload of a GSI MAD datagram: BTH + DETH + MAD + ICRC.
pub const GSI_UDP_PAYLOAD_LEN: usize = BTH_LEN + DETH_LEN + MAD_LEN + ICRC_LEN;
/// The UDP source port rxe uses for QP1: `0xC000 + hash_32(1, 14)`.
pub const RXE_GSI_UDP_SPORT: u16 = 0xD872;

/// A BTH opcode: bits 7..5 name the transport, bits 4..0 the operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Opcode(pub u8);

impl Opcode {
    /// UD SEND Only: what every MAD travels as.
    pub const UD_SEND_ONLY: Opcode = Opcode(0x64);
    /// UD SEND Only with Immediate.
    pub const UD_SEND_ONLY_IMM: Opcode = Opcode(0x65);
    /// RC SEND Only.
    pub const RC_SEND_ONLY: Opcode = Opcode(0x04);
    /// RC Acknowledge.
    pub const RC_ACK: Opcode = Opcode(0x11);
    /// RoCEv2 congestion notification packet.
    pub const CNP: Opcode = Opcode(0x81);

    /// The transport prefix (bits 7..5).
    pub const fn transport(self) -> u8 {
        self.0 >> 5
    }

    /// The operation (bits 4..0).
    pub const fn operation(self) -> u8 {
        self.0 & 0x1F
    }

    /// A short name in IBTA terms, e.g. "UD SEND_ONLY" or "RC ACK".
    pub fn name(self) -> String {
        if self == Self::CNP {
            return "CNP".to_owned();
        }
        let t = match self.transport() {
            0 => "RC",
            1 => "UC",
            2 => "RD",
            3 => "UD",
            5 => "XRC",
            _ => return format!("opcode {:#04x}", self.0),
        };
        let op = match self.operation() {
            0x00 => "SEND_FIRST",
            0x01 => "SEND_MIDDLE",
            0x02 => "SEND_LAST",
            0x03 => "SEND_LAST_IMM",
            0x04 => "SEND_ONLY",
            0x05 => "SEND_ONLY_IMM",
            0x06 => "WRITE_FIRST",
            0x07 => "WRITE_MIDDLE",
            0x08 => "WRITE_LAST",
            0x09 => "WRITE_LAST_IMM",
            0x0A => "WRITE_ONLY",
            0x0B => "WRITE_ONLY_IMM",
            0x0C => "READ_REQUEST",
            0x0D => "READ_RESPONSE_FIRST",
            0x0E => "READ_RESPONSE_MIDDLE",
            0x0F => "READ_RESPONSE_LAST",
            0x10 => "READ_RESPONSE_ONLY",
            0x11 => "ACK",
            0x12 => "ATOMIC_ACK",
            0x13 => "CMP_SWAP",
            0x14 => "FETCH_ADD",
            0x16 => "SEND_LAST_INV",
            0x17 => "SEND_ONLY_INV",
            _ => return format!("{t} op {:#04x}", self.operation()),
        };
        format!("{t} {op}")
    }

    /// Bytes of extended transport headers between the BTH and the payload, or `None` for an
    /// opcode whose layout this crate does not know (the payload is then not located, but the
    /// ICRC can still be checked).
    pub fn ext_headers_len(self) -> Option<usize> {
        if self == Self::CNP {
            return Some(16);
        }
        let op = self.operation();
        let base = match self.transport() {
            0 | 1 => 0,
            3 => DETH_LEN,
            5 => 4, // XRCETH
            _ => return None,
        };
        // (RETH 16, AETH 4, ImmDt 4, IETH 4, AtomicETH 28, AtomicAckETH 8)
        let ext = match op {
            // SEND first/middle/last/only, WRITE middle/last, READ RESPONSE middle: nothing.
            0x00..=0x02 | 0x04 | 0x07 | 0x08 | 0x0E => 0,
            // ImmDt, IETH or AETH alone.
            0x03 | 0x05 | 0x09 | 0x0D | 0x0F..=0x11 | 0x16 | 0x17 => 4,
            // AETH + AtomicAckETH.
            0x12 => 12,
            // RETH.
            0x06 | 0x0A | 0x0C => 16,
            // RETH + ImmDt.
            0x0B => 20,
            // AtomicETH.
            0x13 | 0x14 => 28,
            _ => return None,
        };
        Some(base + ext)
    }
}

impl std::fmt::Display for Opcode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

mod bth {
    use crate::bits::Field;
    pub const OPCODE: Field = Field::new(0, 0, 8);
    pub const SE: Field = Field::new(1, 0, 1);
    pub const MIGREQ: Field = Field::new(1, 1, 1);
    pub const PAD: Field = Field::new(1, 2, 2);
    pub const TVER: Field = Field::new(1, 4, 4);
    pub const PKEY: Field = Field::new(2, 0, 16);
    pub const FECN: Field = Field::new(4, 0, 1);
    pub const BECN: Field = Field::new(4, 1, 1);
    pub const RESV6A: Field = Field::new(4, 2, 6);
    pub const DEST_QP: Field = Field::new(5, 0, 24);
    pub const ACK_REQ: Field = Field::new(8, 0, 1);
    pub const RESV7: Field = Field::new(8, 1, 7);
    pub const PSN: Field = Field::new(9, 0, 24);
}

/// The Base Transport Header (12 bytes), every bit kept so that parse → emit is exact.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Bth {
    /// Transport and operation.
    pub opcode: Opcode,
    /// Solicited event.
    pub solicited: bool,
    /// Migration request.
    pub mig_req: bool,
    /// Pad bytes after the payload (0..=3).
    pub pad_count: u8,
    /// Transport header version; must be 0.
    pub tver: u8,
    /// Partition key.
    pub pkey: u16,
    /// Forward explicit congestion notification (top bit of IBA Resv8a).
    pub fecn: bool,
    /// Backward explicit congestion notification.
    pub becn: bool,
    /// The 6 reserved bits of byte 4.
    pub resv6a: u8,
    /// Destination QP number (24 bits).
    pub dest_qp: u32,
    /// Acknowledge request.
    pub ack_req: bool,
    /// The 7 reserved bits of byte 8.
    pub resv7: u8,
    /// Packet sequence number (24 bits).
    pub psn: u32,
}

impl Bth {
    /// A BTH as rxe sends a GSI MAD: UD SEND Only to QP1 with the default P_Key and the
    /// AckReq bit set. rxe leaves AckReq clear on UD and UC QPs, but QP1 is of type GSI, so
    /// every MAD it sends has it (byte 8 = 0x80 in every capture of Linux's CM traffic).
    pub fn gsi(psn: u32) -> Self {
        Bth {
            opcode: Opcode::UD_SEND_ONLY,
            solicited: false,
            mig_req: false,
            pad_count: 0,
            tver: 0,
            pkey: DEFAULT_PKEY,
            fecn: false,
            becn: false,
            resv6a: 0,
            dest_qp: GSI_QPN,
            ack_req: true,
            resv7: 0,
            psn: psn & 0xFF_FFFF,
        }
    }

    /// Parses the first 12 bytes of `buf`. A non-zero TVer is an error, as rxe drops it.
    pub fn parse(buf: &[u8]) -> Result<Self> {
        need("BTH", buf, BTH_LEN)?;
        let tver = bth::TVER.get(buf) as u8;
        if tver != 0 {
            return Err(WireError::BadField {
                field: "BTH TVer",
                value: tver.into(),
            });
        }
        Ok(Bth {
            opcode: Opcode(bth::OPCODE.get(buf) as u8),
            solicited: bth::SE.get(buf) != 0,
            mig_req: bth::MIGREQ.get(buf) != 0,
            pad_count: bth::PAD.get(buf) as u8,
            tver,
            pkey: bth::PKEY.get(buf) as u16,
            fecn: bth::FECN.get(buf) != 0,
            becn: bth::BECN.get(buf) != 0,
            resv6a: bth::RESV6A.get(buf) as u8,
            dest_qp: bth::DEST_QP.get(buf) as u32,
            ack_req: bth::ACK_REQ.get(buf) != 0,
            resv7: bth::RESV7.get(buf) as u8,
            psn: bth::PSN.get(buf) as u32,
        })
    }

    /// Writes the header into the first 12 bytes of `buf`; out-of-range values are masked to
    /// their field width.
    pub fn emit(&self, buf: &mut [u8]) {
        bth::OPCODE.set(buf, self.opcode.0.into());
        bth::SE.set(buf, self.solicited.into());
        bth::MIGREQ.set(buf, self.mig_req.into());
        bth::PAD.set(buf, self.pad_count.into());
        bth::TVER.set(buf, self.tver.into());
        bth::PKEY.set(buf, self.pkey.into());
        bth::FECN.set(buf, self.fecn.into());
        bth::BECN.set(buf, self.becn.into());
        bth::RESV6A.set(buf, self.resv6a.into());
        bth::DEST_QP.set(buf, self.dest_qp.into());
        bth::ACK_REQ.set(buf, self.ack_req.into());
        bth::RESV7.set(buf, self.resv7.into());
        bth::PSN.set(buf, self.psn.into());
    }
}

const DETH_QKEY: Field = Field::new(0, 0, 32);
const DETH_RESV: Field = Field::new(4, 0, 8);
const DETH_SRC_QP: Field = Field::new(5, 0, 24);

/// The Datagram Extended Transport Header (8 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Deth {
    /// Queue key.
    pub qkey: u32,
    /// The reserved byte.
    pub reserved: u8,
    /// Source QP number (24 bits).
    pub src_qp: u32,
}

impl Deth {
    /// The DETH of a CM MAD: GSI Q_Key, from QP1.
    pub const GSI: Deth = Deth {
        qkey: GSI_QKEY,
        reserved: 0,
        src_qp: GSI_QPN,
    };

    /// Parses the first 8 bytes of `buf`.
    pub fn parse(buf: &[u8]) -> Result<Self> {
        need("DETH", buf, DETH_LEN)?;
        Ok(Deth {
            qkey: DETH_QKEY.get(buf) as u32,
            reserved: DETH_RESV.get(buf) as u8,
            src_qp: DETH_SRC_QP.get(buf) as u32,
        })
    }

    /// Writes the header into the first 8 bytes of `buf`.
    pub fn emit(&self, buf: &mut [u8]) {
        DETH_QKEY.set(buf, self.qkey.into());
        DETH_RESV.set(buf, self.reserved.into());
        DETH_SRC_QP.set(buf, self.src_qp.into());
    }
}

/// The outer IP header as the ICRC sees it. Only the fields the ICRC covers unmasked matter:
/// addresses, and for IPv4 the Identification and flags (DF). TOS, TTL, the IPv4 header
/// checksum and the IPv6 traffic class, flow label and hop limit are masked (§1.7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IpForIcrc {
    /// IPv4 without options.
    V4 {
        /// Source address.
        src: Ipv4Addr,
        /// Destination address.
        dst: Ipv4Addr,
        /// The Identification field. A Linux unconnected UDP socket with
        /// `IP_PMTUDISC_DO` sends 0, which is what makes the ICRC computable before sending.
        ident: u16,
        /// Don't-fragment flag (rxe and Linux with PMTU discovery set it).
        dont_fragment: bool,
    },
    /// IPv6 without extension headers.
    V6 {
        /// Source address.
        src: Ipv6Addr,
        /// Destination address.
        dst: Ipv6Addr,
    },
}

impl IpForIcrc {
    /// An IPv4 header as a Linux UDP socket with PMTU discovery sends it: ID 0, DF set.
    pub fn v4(src: Ipv4Addr, dst: Ipv4Addr) -> Self {
        IpForIcrc::V4 {
            src,
            dst,
            ident: 0,
            dont_fragment: true,
        }
    }

    /// Builds the header bytes for a UDP datagram of `udp_len` bytes (header included),
    /// with the variant fields already set to all-ones as the ICRC wants them.
    fn masked_header(&self, udp_len: u16, out: &mut [u8; 40]) -> usize {
        match *self {
            IpForIcrc::V4 {
                src,
                dst,
                ident,
                dont_fragment,
            } => {
                let total = udp_len.wrapping_add(20);
                out[..20].copy_from_slice(&[
                    0x45,
                    0xFF,
                    (total >> 8) as u8,
                    total as u8,
                    (ident >> 8) as u8,
                    ident as u8,
                    if dont_fragment { 0x40 } else { 0 },
                    0,
                    0xFF,
                    17,
                    0xFF,
                    0xFF,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                ]);
                out[12..16].copy_from_slice(&src.octets());
                out[16..20].copy_from_slice(&dst.octets());
                20
            }
            IpForIcrc::V6 { src, dst } => {
                out[..8].copy_from_slice(&[
                    0x6F,
                    0xFF,
                    0xFF,
                    0xFF,
                    (udp_len >> 8) as u8,
                    udp_len as u8,
                    17,
                    0xFF,
                ]);
                out[8..24].copy_from_slice(&src.octets());
                out[24..40].copy_from_slice(&dst.octets());
                40
            }
        }
    }
}

/// Computes the ICRC over a real captured IP header (20-byte IPv4 without options, or 40-byte
/// IPv6) and the UDP datagram that follows it (`udp`: UDP header, BTH, …, pad; the ICRC
/// itself excluded). Returns the value; it goes on the wire least-significant byte first.
pub fn icrc_for_raw_ip(ip_header: &[u8], udp: &[u8]) -> Result<u32> {
    let mut ip = [0u8; 40];
    let ip_len = match ip_header.first().map(|b| b >> 4) {
        Some(4) => {
            need("IPv4 header", ip_header, 20)?;
            if ip_header[0] & 0x0F != 5 {
                // rxe copies exactly 20 bytes: options cannot be covered.
                return Err(WireError::BadField {
                    field: "IPv4 IHL",
                    value: (ip_header[0] & 0xF).into(),
                });
            }
            ip[..20].copy_from_slice(&ip_header[..20]);
            ip[1] = 0xFF;
            ip[8] = 0xFF;
            ip[10] = 0xFF;
            ip[11] = 0xFF;
            20
        }
        Some(6) => {
            need("IPv6 header", ip_header, 40)?;
            ip.copy_from_slice(&ip_header[..40]);
            ip[0] |= 0x0F;
            ip[1] = 0xFF;
            ip[2] = 0xFF;
            ip[3] = 0xFF;
            ip[7] = 0xFF;
            40
        }
        Some(v) => {
            return Err(WireError::BadField {
                field: "IP version",
                value: v.into(),
            })
        }
        None => {
            return Err(WireError::Truncated {
                what: "IP header",
                need: 20,
                got: 0,
            })
        }
    };
    Ok(icrc_masked_ip(&ip[..ip_len], udp))
}

/// Computes the ICRC for a datagram to be sent: `ip` describes the outer header the kernel
/// will write; `udp` is the UDP header (its length field already counting the ICRC) followed
/// by BTH … pad (no ICRC).
pub fn icrc(ip: &IpForIcrc, udp: &[u8]) -> u32 {
    let mut hdr = [0u8; 40];
    // The IP length fields count the ICRC too: take them from the UDP length field.
    let udp_len = match udp {
        [_, _, _, _, hi, lo, ..] => u16::from_be_bytes([*hi, *lo]),
        _ => udp.len() as u16,
    };
    let n = ip.masked_header(udp_len, &mut hdr);
    icrc_masked_ip(&hdr[..n], udp)
}

/// The ICRC given an IP header whose variant fields are already all-ones.
fn icrc_masked_ip(masked_ip: &[u8], udp: &[u8]) -> u32 {
    // A CM datagram is a few hundred bytes: laid out whole in one buffer, the CRC runs in
    // one pass of the fast (carry-less multiply) kernel, where the six pieces below each
    // took the byte-table path of short inputs, most of the cost.
    const WHOLE: usize = 512;
    let (ip_len, udp_len) = (masked_ip.len(), udp.len());
    if ip_len <= 40 && udp_len >= 13 && 8 + ip_len + udp_len <= WHOLE {
        let mut b = [0u8; WHOLE];
        b[..8].fill(0xFF);
        b[8..8 + ip_len].copy_from_slice(masked_ip);
        let u = 8 + ip_len;
        b[u..u + udp_len].copy_from_slice(udp);
        // The UDP checksum and the BTH's FECN, BECN and Resv6a are variant.
        b[u + 6] = 0xFF;
        b[u + 7] = 0xFF;
        b[u + 12] = 0xFF;
        return crc32fast::hash(&b[..u + udp_len]);
    }
    icrc_in_pieces(masked_ip, udp)
}

/// [`icrc_masked_ip`] for any lengths, feeding the CRC piece by piece.
fn icrc_in_pieces(masked_ip: &[u8], udp: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    // The 8-byte pseudo LRH that RoCEv2 lacks, all ones.
    h.update(&[0xFF; 8]);
    h.update(masked_ip);
    let udp_hdr_len = udp.len().min(8);
    let mut udp_hdr = [0u8; 8];
    udp_hdr[..udp_hdr_len].copy_from_slice(&udp[..udp_hdr_len]);
    udp_hdr[6] = 0xFF;
    udp_hdr[7] = 0xFF;
    h.update(&udp_hdr[..udp_hdr_len]);
    let rest = &udp[udp_hdr_len..];
    if rest.len() > 4 {
        let mut bth4 = [0u8; 5];
        bth4.copy_from_slice(&rest[..5]);
        bth4[4] = 0xFF; // FECN, BECN and Resv6a are variant.
        h.update(&bth4);
        h.update(&rest[5..]);
    } else {
        h.update(rest);
    }
    h.finalize()
}

/// A parsed RoCEv2 UDP payload: headers, the payload, and the ICRC as carried.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RocePacket<'a> {
    /// Base transport header.
    pub bth: Bth,
    /// DETH, for UD opcodes.
    pub deth: Option<Deth>,
    /// Extended headers after the BTH (including the DETH), raw.
    pub ext_headers: &'a [u8],
    /// Payload, without pad; `None` when the opcode's header layout is unknown.
    pub payload: Option<&'a [u8]>,
    /// The ICRC as carried (read little-endian).
    pub icrc: u32,
}

impl<'a> RocePacket<'a> {
    /// Parses the payload of a UDP datagram to port 4791. The length must come from the UDP
    /// length field (Ethernet padding removed).
    pub fn parse(udp_payload: &'a [u8]) -> Result<Self> {
        need("RoCEv2 packet", udp_payload, BTH_LEN + ICRC_LEN)?;
        let bth = Bth::parse(udp_payload)?;
        let body_end = udp_payload.len() - ICRC_LEN;
        let icrc_bytes: [u8; 4] =
            udp_payload[body_end..]
                .try_into()
                .map_err(|_| WireError::Truncated {
                    what: "ICRC",
                    need: 4,
                    got: 0,
                })?;
        let icrc = u32::from_le_bytes(icrc_bytes);
        let body = &udp_payload[BTH_LEN..body_end];
        let Some(ext_len) = bth.opcode.ext_headers_len() else {
            return Ok(RocePacket {
                bth,
                deth: None,
                ext_headers: &[],
                payload: None,
                icrc,
            });
        };
        need("RoCEv2 extended headers", body, ext_len)?;
        let deth = if bth.opcode.transport() == 3 {
            Some(Deth::parse(body)?)
        } else {
            None
        };
        let pad = usize::from(bth.pad_count);
        if body.len() - ext_len < pad {
            return Err(WireError::BadLength {
                what: "RoCEv2 packet",
                detail: format!(
                    "pad count {pad} exceeds payload of {}",
                    body.len() - ext_len
                ),
            });
        }
        Ok(RocePacket {
            bth,
            deth,
            ext_headers: &body[..ext_len],
            payload: Some(&body[ext_len..body.len() - pad]),
            icrc,
        })
    }
}

/// Builds the UDP payload of a UD packet (BTH, DETH, payload, pad, ICRC) for a datagram from
/// `sport` to port 4791, computing the ICRC against `ip`. The BTH pad count is set here.
pub fn emit_ud(ip: &IpForIcrc, sport: u16, bth: &Bth, deth: &Deth, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    emit_ud_into(&mut out, ip, sport, bth, deth, payload);
    out.drain(..8);
    out
}

/// [`emit_ud`] into `out`, whose capacity is reused (a sender keeps one buffer rather than
/// allocating per packet): `out` is cleared, then holds the UDP header the ICRC covers
/// followed by the UDP payload, which is returned.
pub fn emit_ud_into<'a>(
    out: &'a mut Vec<u8>,
    ip: &IpForIcrc,
    sport: u16,
    bth: &Bth,
    deth: &Deth,
    payload: &[u8],
) -> &'a [u8] {
    let pad = payload.len().wrapping_neg() & 3;
    let len = BTH_LEN + DETH_LEN + payload.len() + pad + ICRC_LEN;
    out.clear();
    out.resize(8 + len, 0);
    let udp_len = out.len() as u16;
    out[0..2].copy_from_slice(&sport.to_be_bytes());
    out[2..4].copy_from_slice(&ROCE_V2_UDP_PORT.to_be_bytes());
    out[4..6].copy_from_slice(&udp_len.to_be_bytes());
    let mut bth = *bth;
    bth.pad_count = pad as u8;
    bth.emit(&mut out[8..]);
    deth.emit(&mut out[8 + BTH_LEN..]);
    let p = 8 + BTH_LEN + DETH_LEN;
    out[p..p + payload.len()].copy_from_slice(payload);
    let crc_at = out.len() - ICRC_LEN;
    let crc = icrc(ip, &out[..crc_at]);
    out[crc_at..].copy_from_slice(&crc.to_le_bytes());
    &out[8..]
}

/// Builds the 280-byte UDP payload of a GSI MAD datagram as rxe sends it.
pub fn emit_gsi(ip: &IpForIcrc, sport: u16, psn: u32, mad: &[u8; MAD_LEN]) -> Vec<u8> {
    emit_ud(ip, sport, &Bth::gsi(psn), &Deth::GSI, mad)
}

/// [`emit_gsi`] into a reused buffer (see [`emit_ud_into`]); returns the UDP payload.
pub fn emit_gsi_into<'a>(
    out: &'a mut Vec<u8>,
    ip: &IpForIcrc,
    sport: u16,
    psn: u32,
    mad: &[u8; MAD_LEN],
) -> &'a [u8] {
    emit_ud_into(out, ip, sport, &Bth::gsi(psn), &Deth::GSI, mad)
}

/// A GSI MAD datagram received from the network: the BTH, DETH and the 256-byte MAD.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GsiDatagram<'a> {
    /// Base transport header.
    pub bth: Bth,
    /// Datagram header.
    pub deth: Deth,
    /// The MAD, exactly 256 bytes.
    pub mad: &'a [u8; MAD_LEN],
    /// The ICRC as carried.
    pub icrc: u32,
}

impl<'a> GsiDatagram<'a> {
    /// Parses a UDP payload that must be a MAD for QP1: UD SEND Only, destination QP 1 and
    /// the GSI Q_Key (rxe drops QP1 packets with another Q_Key). The ICRC is not checked here
    /// (a UDP socket cannot see the IPv4 ID it covers); see [`verify_icrc`].
    pub fn parse(udp_payload: &'a [u8]) -> Result<Self> {
        Self::from_packet(&RocePacket::parse(udp_payload)?)
    }

    /// [`GsiDatagram::parse`] of a packet already parsed (a receiver that sorts packets by
    /// their destination QP parses each once).
    pub fn from_packet(p: &RocePacket<'a>) -> Result<Self> {
        if p.bth.opcode != Opcode::UD_SEND_ONLY {
            return Err(WireError::BadField {
                field: "BTH opcode (GSI)",
                value: p.bth.opcode.0.into(),
            });
        }
        if p.bth.dest_qp != GSI_QPN {
            return Err(WireError::BadField {
                field: "BTH DestQP (GSI)",
                value: p.bth.dest_qp.into(),
            });
        }
        let deth = p.deth.ok_or(WireError::Truncated {
            what: "DETH",
            need: DETH_LEN,
            got: 0,
        })?;
        if deth.qkey != GSI_QKEY {
            return Err(WireError::BadField {
                field: "DETH Q_Key (GSI)",
                value: deth.qkey.into(),
            });
        }
        let payload = p.payload.unwrap_or_default();
        let mad: &[u8; MAD_LEN] = payload.try_into().map_err(|_| WireError::BadLength {
            what: "GSI MAD",
            detail: format!("payload is {} bytes, a MAD is {MAD_LEN}", payload.len()),
        })?;
        Ok(GsiDatagram {
            bth: p.bth,
            deth,
            mad,
            icrc: p.icrc,
        })
    }
}

/// Verifies the ICRC of a captured packet: `ip_header` is the raw IP header, `udp` the whole
/// UDP datagram (header and payload, ICRC last).
pub fn verify_icrc(ip_header: &[u8], udp: &[u8]) -> Result<()> {
    need("RoCEv2 UDP datagram", udp, 8 + BTH_LEN + ICRC_LEN)?;
    let at = udp.len() - ICRC_LEN;
    check_icrc(&udp[at..], icrc_for_raw_ip(ip_header, &udp[..at])?)
}

/// Compares the ICRC `carried` (its 4 bytes, least significant first) with `computed`.
fn check_icrc(carried: &[u8], computed: u32) -> Result<()> {
    let carried = match carried {
        [a, b, c, d] => u32::from_le_bytes([*a, *b, *c, *d]),
        _ => {
            return Err(WireError::Truncated {
                what: "ICRC",
                need: ICRC_LEN,
                got: carried.len(),
            })
        }
    };
    if carried == computed {
        Ok(())
    } else {
        Err(WireError::BadCrc {
            what: "ICRC",
            carried,
            computed,
        })
    }
}

/// Verifies the ICRC of a RoCEv2 datagram received over IPv6 from `src` (UDP source port
/// `sport`) to `dst`, given its UDP payload (BTH … ICRC). A UDP socket cannot see an IPv4
/// header's ID, which the ICRC covers, but everything the IPv6 ICRC covers is known to the
/// receiver: its variant fields (traffic class, flow label, hop limit) are masked, and the
/// lengths follow from the payload's. The destination port is taken as 4791 (a sender on
/// another port computes its ICRCs as if on 4791, as rcm's test fabrics do).
pub fn verify_icrc_v6(src: Ipv6Addr, sport: u16, dst: Ipv6Addr, payload: &[u8]) -> Result<()> {
    need("RoCEv2 UDP payload", payload, BTH_LEN + ICRC_LEN)?;
    let Ok(udp_len) = u16::try_from(8 + payload.len()) else {
        return Err(WireError::BadField {
            field: "UDP length",
            value: payload.len() as u64,
        });
    };
    let at = payload.len() - ICRC_LEN;
    let mut small = [0u8; 512];
    let mut large = Vec::new();
    let udp: &mut [u8] = if 8 + at <= small.len() {
        &mut small[..8 + at]
    } else {
        large.resize(8 + at, 0);
        &mut large
    };
    udp[0..2].copy_from_slice(&sport.to_be_bytes());
    udp[2..4].copy_from_slice(&ROCE_V2_UDP_PORT.to_be_bytes());
    udp[4..6].copy_from_slice(&udp_len.to_be_bytes());
    udp[8..].copy_from_slice(&payload[..at]);
    check_icrc(&payload[at..], icrc(&IpForIcrc::V6 { src, dst }, udp))
}

/// The IP and UDP headers of the `k`th datagram, `len` bytes of UDP payload, that the kernel
/// cuts a segmented send (`UDP_SEGMENT`) into, from the headers of the whole run as a capture
/// or a raw socket on the sending host sees it: lengths are the piece's own, and an IPv4 ID
/// counts on from the run's (`inet_gso_segment`), which matters because the ICRC covers it.
pub fn segment_headers(
    ip_header: &[u8],
    udp_header: &[u8],
    k: usize,
    len: usize,
) -> Result<(Vec<u8>, [u8; 8])> {
    let too_long = || WireError::BadLength {
        what: "segment of a UDP run",
        detail: format!("{len} bytes of payload do not fit an IP header"),
    };
    need("UDP header", udp_header, 8)?;
    let udp_len = u16::try_from(8 + len).map_err(|_| too_long())?;
    let mut ip = ip_header.to_vec();
    match ip.first().map(|b| b >> 4) {
        Some(4) => {
            need("IPv4 header", &ip, 20)?;
            let ihl = usize::from(ip[0] & 0x0F) * 4;
            let total = u16::try_from(ihl + 8 + len).map_err(|_| too_long())?;
            ip[2..4].copy_from_slice(&total.to_be_bytes());
            let id = u16::from_be_bytes([ip[4], ip[5]]).wrapping_add(k as u16);
            ip[4..6].copy_from_slice(&id.to_be_bytes());
        }
        Some(6) => {
            need("IPv6 header", &ip, 40)?;
            ip[4..6].copy_from_slice(&udp_len.to_be_bytes());
        }
        v => {
            return Err(WireError::BadField {
                field: "IP version",
                value: v.unwrap_or(0).into(),
            })
        }
    }
    let mut udp = [0u8; 8];
    udp.copy_from_slice(&udp_header[..8]);
    udp[4..6].copy_from_slice(&udp_len.to_be_bytes());
    Ok((ip, udp))
}

/// One datagram of a segmented run: the IP and UDP headers the kernel gives it, and its
/// payload.
pub type RunPiece<'a> = (Vec<u8>, [u8; 8], &'a [u8]);

/// The datagrams of a run of GSI datagrams sent in one segmented send and seen whole (a
/// capture or a raw socket on the sending host): `payload` cut every
/// [`GSI_UDP_PAYLOAD_LEN`] bytes, each piece under its own headers ([`segment_headers`]).
/// An error when `payload` is not two or more whole GSI datagrams or the headers cannot be
/// rewritten. Whether it really was a run is for the caller to tell, by each piece's ICRC.
pub fn split_gsi_run<'a>(
    ip_header: &[u8],
    udp_header: &[u8],
    payload: &'a [u8],
) -> Result<Vec<RunPiece<'a>>> {
    let seg = GSI_UDP_PAYLOAD_LEN;
    if payload.len() <= seg || payload.len() % seg != 0 {
        return Err(WireError::BadLength {
            what: "run of GSI datagrams",
            detail: format!("{} bytes are not two or more of {seg}", payload.len()),
        });
    }
    payload
        .chunks(seg)
        .enumerate()
        .map(|(k, piece)| {
            let (ip, udp) = segment_headers(ip_header, udp_header, k, piece.len())?;
            Ok((ip, udp, piece))
        })
        .collect()
}

/// `rdma_calc_flow_label(lqpn, rqpn)`: a 20-bit flow label symmetric in the two QPNs.
pub fn calc_flow_label(lqpn: u32, rqpn: u32) -> u32 {
    let mut v = u64::from(lqpn) * u64::from(rqpn);
    v ^= v >> 20;
    v ^= v >> 40;
    (v & 0xFFFFF) as u32
}

/// `rdma_flow_label_to_udp_sport`: folds a flow label into the 0xC000.. source-port range.
pub fn flow_label_to_udp_sport(fl: u32) -> u16 {
    let fl_low = fl & 0x3FFF;
    let fl_high = (fl & 0xFC000) >> 14;
    ((fl_low ^ fl_high) as u16) | 0xC000
}

/// `rdma_get_udp_sport`: the UDP source port for a flow label, or for a QPN pair when the
/// flow label is 0.
pub fn udp_sport(fl: u32, lqpn: u32, rqpn: u32) -> u16 {
    let fl = if fl == 0 {
        calc_flow_label(lqpn, rqpn)
    } else {
        fl
    };
    flow_label_to_udp_sport(fl)
}

/// The source port rxe picks for a QP at creation: `0xC000 + (hash_32(qpn, 14) & 0x3FFF)`.
pub fn rxe_qp_sport(qpn: u32) -> u16 {
    let h = qpn.wrapping_mul(0x61C8_8647) >> 18;
    0xC000 + (h & 0x3FFF) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_one_pass_icrc_equals_the_piecewise_one_at_every_length() {
        // Every UDP length the one-pass layout takes, and past it, for both IP versions.
        for ip_len in [20usize, 40] {
            let ip: Vec<u8> = (0..ip_len).map(|i| (i * 7 + 3) as u8).collect();
            for udp_len in 0..=520 {
                let udp: Vec<u8> = (0..udp_len).map(|i| (i * 13 + 1) as u8).collect();
                assert_eq!(
                    icrc_masked_ip(&ip, &udp),
                    icrc_in_pieces(&ip, &udp),
                    "ip {ip_len}, udp {udp_len}"
                );
            }
        }
    }

    #[test]
    fn emitting_into_a_reused_buffer_gives_the_same_bytes() {
        let ip = IpForIcrc::v4([198, 18, 0, 1].into(), [198, 18, 0, 2].into());
        let mut buf = Vec::new();
        for psn in [1u32, 2, 0xFF_FFFF] {
            let mad = [psn as u8; MAD_LEN];
            let want = emit_gsi(&ip, 49152, psn, &mad);
            assert_eq!(emit_gsi_into(&mut buf, &ip, 49152, psn, &mad), &want[..]);
        }
        // A shorter UD payload after a longer one: no stale tail, pad and length right.
        let ud = emit_ud(&ip, 49152, &Bth::gsi(7), &Deth::GSI, &[5; 13]);
        assert_eq!(
            emit_ud_into(&mut buf, &ip, 49152, &Bth::gsi(7), &Deth::GSI, &[5; 13]),
            &ud[..]
        );
        assert_eq!(ud.len(), BTH_LEN + DETH_LEN + 16 + ICRC_LEN);
    }

    #[test]
    fn helper_vectors_match_the_reference() {
        assert_eq!(calc_flow_label(0x123, 0x456), 0x4EDC2);
        assert_eq!(udp_sport(0, 0x123, 0x456), 0xEDD1);
        assert_eq!(udp_sport(0, 0x11, 0x12), 0xC132);
        assert_eq!(flow_label_to_udp_sport(0xABCDE), 0xFCF4);
        assert_eq!(rxe_qp_sport(1), RXE_GSI_UDP_SPORT);
    }

    #[test]
    fn connectx4_cnp_icrc() {
        // Real hardware CNP from scapy's tests (wire-formats.md §1.7, §7.3).
        let pkt: Vec<u8> = [
            &[
                0x45, 0xc2, 0x00, 0x3c, 0x71, 0x8c, 0x40, 0x00, 0x40, 0x11, 0x91, 0x61,
            ][..],
            &[0x0a, 0x00, 0x11, 0x01, 0x0a, 0x00, 0x12, 0x01],
            &[0x00, 0x00, 0x12, 0xb7, 0x00, 0x28, 0x00, 0x00],
            &[0x81, 0x00, 0xff, 0xff, 0x40, 0x00, 0x01, 0x18, 0, 0, 0, 0],
            &[0; 16],
            &[0x82, 0xfd, 0x00, 0x2a],
        ]
        .concat();
        verify_icrc(&pkt[..20], &pkt[20..]).unwrap();
        let mut bad = pkt.clone();
        bad[40] ^= 1;
        assert!(matches!(
            verify_icrc(&bad[..20], &bad[20..]),
            Err(WireError::BadCrc { .. })
        ));
        // Variant fields do not change it.
        let mut tweaked = pkt.clone();
        tweaked[1] = 0; // TOS
        tweaked[8] = 3; // TTL
        tweaked[32] = 0x80; // BTH byte 4 (FECN/BECN)
        tweaked[26] = 0x12; // UDP checksum
        verify_icrc(&tweaked[..20], &tweaked[20..]).unwrap();
        let p = RocePacket::parse(&pkt[28..]).unwrap();
        assert_eq!(p.bth.opcode, Opcode::CNP);
        assert!(p.bth.becn);
        assert_eq!(p.bth.dest_qp, 0x118);
    }

    #[test]
    fn bth_round_trip_keeps_every_bit() {
        let raw = [
            0x64,
            0xF0 & !0x0F | 0x80,
            0x12,
            0x34,
            0xFF,
            0xAB,
            0xCD,
            0xEF,
            0xFF,
            1,
            2,
            3,
        ];
        let b = Bth::parse(&raw).unwrap();
        let mut out = [0u8; 12];
        b.emit(&mut out);
        assert_eq!(out, raw);
        let mut tver = raw;
        tver[1] |= 1;
        assert!(Bth::parse(&tver).is_err());
    }

    #[test]
    fn segment_headers_give_each_piece_its_lengths_and_the_next_ipv4_id() {
        let mut v4 = [0u8; 20];
        v4[0] = 0x45;
        v4[2..4].copy_from_slice(&(20u16 + 8 + 3 * 280).to_be_bytes());
        v4[4..6].copy_from_slice(&0xFFFEu16.to_be_bytes());
        v4[8] = 64;
        v4[9] = 17;
        let udp = [0x12, 0x34, 0x12, 0xB7, 0x03, 0x50, 0, 0];
        let (ip, u) = segment_headers(&v4, &udp, 0, 280).unwrap();
        assert_eq!(&ip[2..4], &308u16.to_be_bytes());
        assert_eq!(&ip[4..6], &0xFFFEu16.to_be_bytes());
        assert_eq!(&ip[6..], &v4[6..], "only length and ID change");
        assert_eq!(u, [0x12, 0x34, 0x12, 0xB7, 0x01, 0x20, 0, 0]);
        // The ID counts on and wraps, as the kernel's 16-bit counter does.
        let (ip, _) = segment_headers(&v4, &udp, 2, 280).unwrap();
        assert_eq!(&ip[4..6], &0u16.to_be_bytes());

        let mut v6 = [0u8; 40];
        v6[0] = 0x60;
        v6[4..6].copy_from_slice(&(8u16 + 2 * 280).to_be_bytes());
        v6[6] = 17;
        let (ip, u) = segment_headers(&v6, &udp, 1, 280).unwrap();
        assert_eq!(&ip[4..6], &288u16.to_be_bytes());
        assert_eq!(&ip[..4], &v6[..4]);
        assert_eq!(&ip[6..], &v6[6..]);
        assert_eq!(&u[4..6], &288u16.to_be_bytes());
    }

    #[test]
    fn segment_headers_refuse_what_they_cannot_rewrite() {
        let udp = [0u8; 8];
        assert!(
            segment_headers(&[0x45; 10], &udp, 0, 280).is_err(),
            "short IPv4"
        );
        assert!(
            segment_headers(&[0x60; 20], &udp, 0, 280).is_err(),
            "short IPv6"
        );
        assert!(
            segment_headers(&[0x50; 40], &udp, 0, 280).is_err(),
            "version 5"
        );
        assert!(segment_headers(&[], &udp, 0, 280).is_err(), "no header");
        let mut v4 = [0u8; 20];
        v4[0] = 0x45;
        assert!(
            segment_headers(&v4, &udp[..4], 0, 280).is_err(),
            "short UDP"
        );
        assert!(segment_headers(&v4, &udp, 0, 70_000).is_err(), "too long");
    }

    #[test]
    fn split_gsi_run_cuts_whole_gsi_datagrams_only() {
        let mut v4 = [0u8; 20];
        v4[0] = 0x45;
        v4[4..6].copy_from_slice(&7u16.to_be_bytes());
        let udp = [0u8; 8];
        let payload: Vec<u8> = (0..3 * GSI_UDP_PAYLOAD_LEN).map(|i| i as u8).collect();
        let pieces = split_gsi_run(&v4, &udp, &payload).unwrap();
        assert_eq!(pieces.len(), 3);
        for (k, (ip, u, piece)) in pieces.iter().enumerate() {
            assert_eq!(&ip[4..6], &(7 + k as u16).to_be_bytes());
            assert_eq!(&u[4..6], &(8 + GSI_UDP_PAYLOAD_LEN as u16).to_be_bytes());
            assert_eq!(
                *piece,
                &payload[k * GSI_UDP_PAYLOAD_LEN..][..GSI_UDP_PAYLOAD_LEN]
            );
        }
        let one = &payload[..GSI_UDP_PAYLOAD_LEN];
        assert!(
            split_gsi_run(&v4, &udp, one).is_err(),
            "one datagram is no run"
        );
        let ragged = &payload[..=2 * GSI_UDP_PAYLOAD_LEN];
        assert!(
            split_gsi_run(&v4, &udp, ragged).is_err(),
            "not whole datagrams"
        );
    }
}
