//! iWARP connection setup and framing: MPA Request/Reply frames (RFC 5044, enhanced by
//! RFC 6581), FPDU framing with the MPA CRC-32C, and the DDP/RDMAP headers (RFC 5041 /
//! RFC 5040) that the connection manager needs: Send, Terminate, and the zero-length RTR
//! messages of peer-to-peer mode.
//!
//! Layouts follow `reference/wire-formats.md` §5 and are checked against real siw captures.
//!
//! # Streams and [`WireError::Truncated`]
//!
//! MPA runs over TCP, so a reader never knows where a frame ends until it has the length field.
//! Every parser here returns [`WireError::Truncated`] when, and only when, the bytes so far are a
//! valid prefix and more are needed: a stream reader keeps what it has, reads more, and calls the
//! parser again. Any other error means the stream is not (or no longer) valid MPA and the
//! connection should be torn down.
//!
//! # Encoding
//!
//! Encoders return `Result` instead of panicking: an output buffer that is too short gives
//! [`WireError::Truncated`], and a value that does not fit its field gives an error instead of
//! being silently masked. Whatever an encoder accepts, the matching parser reads back unchanged.
//!
//! # Markers
//!
//! MPA markers are not supported: nobody enables them (siw rejects them, cxgb4 has them off by
//! default). A Request or Reply with the M flag still parses, so a caller can see the flag and
//! reject the connection, but [`parse_fpdu`] assumes no markers are inserted in the stream.

use crate::{need, Result, WireError};

/// The 16-byte key that opens an MPA Request: ASCII "MPA ID Req Frame", no NUL.
pub const REQ_KEY: [u8; 16] = *b"MPA ID Req Frame";
/// The 16-byte key that opens an MPA Reply: ASCII "MPA ID Rep Frame", no NUL.
pub const REP_KEY: [u8; 16] = *b"MPA ID Rep Frame";
/// Bytes before the private data of a Request or Reply: key, flags, revision, PD_Length.
pub const MPA_FRAME_HEADER_LEN: usize = 20;
/// The private-data limit of Linux iWARP providers (`RDMA_MAX_PRIVATE_DATA`). In revision 2
/// it includes the 4 IRD/ORD bytes.
pub const MAX_PRIVATE_DATA: usize = 256;
/// The largest PD_Length RFC 5044 allows.
pub const RFC_MAX_PRIVATE_DATA: usize = 512;
/// User private data that fits a revision-2 enhanced frame under the Linux limit.
pub const ENHANCED_USER_MAX: usize = MAX_PRIVATE_DATA - ENHANCED_LEN;
/// Length of the RFC 6581 IRD/ORD words at the start of enhanced private data.
pub const ENHANCED_LEN: usize = 4;
/// The largest IRD or ORD an enhanced frame can carry (14 bits).
pub const IRD_ORD_MAX: u16 = 0x3FFF;
/// The MPA revision of RFC 5044.
pub const REVISION_1: u8 = 1;
/// The MPA revision of RFC 6581 (enhanced connection establishment).
pub const REVISION_2: u8 = 2;

const FLAG_MARKERS: u8 = 0x80;
const FLAG_CRC: u8 = 0x40;
const FLAG_REJECT: u8 = 0x20;
const FLAG_ENHANCED: u8 = 0x10;
const FLAG_GSO_EXP: u8 = 0x08;
const FLAG_RESERVED: u8 = 0x07;

const ENH_HIGH: u16 = 0x8000;
const ENH_LOW: u16 = 0x4000;

fn be16(buf: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([buf[at], buf[at + 1]])
}

fn be32(buf: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]])
}

fn be64(buf: &[u8], at: usize) -> u64 {
    (u64::from(be32(buf, at)) << 32) | u64::from(be32(buf, at + 4))
}

fn put(buf: &mut [u8], at: usize, bytes: &[u8]) {
    buf[at..at + bytes.len()].copy_from_slice(bytes);
}

fn check_width(field: &'static str, bits: u32, value: u64) -> Result<()> {
    if value >> bits == 0 {
        Ok(())
    } else {
        Err(WireError::FieldOverflow { field, bits, value })
    }
}

// ------------------------------------------------------------------------------------------
// MPA Request / Reply
// ------------------------------------------------------------------------------------------

/// Which of the two connection-setup frames a buffer holds, told apart by the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub enum FrameKind {
    /// Sent by the initiator ("MPA ID Req Frame").
    Request,
    /// Sent by the responder ("MPA ID Rep Frame"), accepting or (with R) rejecting.
    Reply,
}

impl FrameKind {
    /// The key that opens a frame of this kind.
    pub const fn key(self) -> &'static [u8; 16] {
        match self {
            FrameKind::Request => &REQ_KEY,
            FrameKind::Reply => &REP_KEY,
        }
    }
}

/// The flags byte (offset 16) of a Request or Reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct MpaFlags {
    /// M (0x80): this side wants to *receive* markers.
    pub markers: bool,
    /// C (0x40): this side wants CRC-32C; CRC is used both ways if either side sets it.
    pub crc: bool,
    /// R (0x20): the responder rejects the connection. Meaningful in a Reply only: in a
    /// Request it is zero when sent and not checked on receipt (RFC 5044 §7.1; siw's
    /// `siw_proc_mpareq` ignores it), so a received Request keeps it as it came and it
    /// means nothing there.
    pub reject: bool,
    /// `Res[0]` (0x10): RFC 6581 enhanced connection establishment.
    pub enhanced: bool,
    /// `Res[1]` (0x08): siw's experimental GSO flag; not standard.
    pub gso_exp: bool,
    /// The remaining reserved bits (0x07), kept so that parse → emit is exact.
    pub reserved: u8,
}

impl MpaFlags {
    /// Splits the flags byte; every bit is kept.
    pub const fn from_byte(b: u8) -> Self {
        MpaFlags {
            markers: b & FLAG_MARKERS != 0,
            crc: b & FLAG_CRC != 0,
            reject: b & FLAG_REJECT != 0,
            enhanced: b & FLAG_ENHANCED != 0,
            gso_exp: b & FLAG_GSO_EXP != 0,
            reserved: b & FLAG_RESERVED,
        }
    }

    /// The flags byte; `reserved` is masked to its 3 bits (an [`MpaFrame`] encoder rejects
    /// wider values before getting here).
    pub const fn to_byte(self) -> u8 {
        let mut b = self.reserved & FLAG_RESERVED;
        if self.markers {
            b |= FLAG_MARKERS;
        }
        if self.crc {
            b |= FLAG_CRC;
        }
        if self.reject {
            b |= FLAG_REJECT;
        }
        if self.enhanced {
            b |= FLAG_ENHANCED;
        }
        if self.gso_exp {
            b |= FLAG_GSO_EXP;
        }
        b
    }
}

/// The RFC 6581 IRD/ORD words: the first 4 bytes of private data in a revision-2 frame with the
/// Enhanced flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Enhanced {
    /// Inbound RDMA Read queue depth of the sender (14 bits).
    pub ird: u16,
    /// Outbound RDMA Read depth of the sender (14 bits).
    pub ord: u16,
    /// Peer-to-peer mode requested (Request) or accepted (Reply): 0x8000 of the first word.
    pub peer_to_peer: bool,
    /// The RTR may be a zero-length Send: 0x4000 of the first word.
    pub zero_len_send_rtr: bool,
    /// The RTR may be a zero-length RDMA Write: 0x8000 of the second word.
    pub zero_len_write_rtr: bool,
    /// The RTR may be a zero-length RDMA Read: 0x4000 of the second word.
    pub zero_len_read_rtr: bool,
}

impl Enhanced {
    /// IRD and ORD with no peer-to-peer or RTR bits, as siw sends by default.
    pub const fn new(ird: u16, ord: u16) -> Self {
        Enhanced {
            ird,
            ord,
            peer_to_peer: false,
            zero_len_send_rtr: false,
            zero_len_write_rtr: false,
            zero_len_read_rtr: false,
        }
    }

    /// Reads the 4 bytes at the start of `buf`.
    pub fn parse(buf: &[u8]) -> Result<Self> {
        need("MPA enhanced IRD/ORD", buf, ENHANCED_LEN)?;
        let a = be16(buf, 0);
        let b = be16(buf, 2);
        Ok(Enhanced {
            ird: a & IRD_ORD_MAX,
            ord: b & IRD_ORD_MAX,
            peer_to_peer: a & ENH_HIGH != 0,
            zero_len_send_rtr: a & ENH_LOW != 0,
            zero_len_write_rtr: b & ENH_HIGH != 0,
            zero_len_read_rtr: b & ENH_LOW != 0,
        })
    }

    /// The 4 bytes on the wire; IRD or ORD above [`IRD_ORD_MAX`] is an error because it would
    /// spill into the control bits.
    pub fn to_bytes(&self) -> Result<[u8; ENHANCED_LEN]> {
        check_width("MPA IRD", 14, self.ird.into())?;
        check_width("MPA ORD", 14, self.ord.into())?;
        let mut a = self.ird;
        let mut b = self.ord;
        if self.peer_to_peer {
            a |= ENH_HIGH;
        }
        if self.zero_len_send_rtr {
            a |= ENH_LOW;
        }
        if self.zero_len_write_rtr {
            b |= ENH_HIGH;
        }
        if self.zero_len_read_rtr {
            b |= ENH_LOW;
        }
        let [a0, a1] = a.to_be_bytes();
        let [b0, b1] = b.to_be_bytes();
        Ok([a0, a1, b0, b1])
    }

    /// Writes the 4 bytes at the start of `buf` and returns 4.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        let bytes = self.to_bytes()?;
        need("MPA enhanced IRD/ORD output", buf, ENHANCED_LEN)?;
        put(buf, 0, &bytes);
        Ok(ENHANCED_LEN)
    }
}

/// An MPA Request or Reply: the 20-byte header and its private data.
///
/// `enhanced` is present exactly when `revision` is 2 and `flags.enhanced` is set; that is how
/// the parser decides, and the encoder refuses a frame where they disagree. `private_data` is
/// the user's data, after the IRD/ORD words when those are present, so PD_Length on the wire is
/// `private_data.len()` plus 4 for an enhanced frame.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct MpaFrame {
    /// Request or Reply.
    pub kind: FrameKind,
    /// The flags byte.
    pub flags: MpaFlags,
    /// 1 (RFC 5044) or 2 (RFC 6581).
    pub revision: u8,
    /// The IRD/ORD words of an enhanced revision-2 frame.
    pub enhanced: Option<Enhanced>,
    /// User private data.
    pub private_data: Vec<u8>,
}

impl MpaFrame {
    /// A revision-1 Request without CRC or markers.
    pub fn request_v1(private_data: impl Into<Vec<u8>>) -> Self {
        Self::plain(FrameKind::Request, private_data.into())
    }

    /// A revision-2 enhanced Request, as siw sends it by default (no P2P, no CRC).
    pub fn request_v2(ird: u16, ord: u16, private_data: impl Into<Vec<u8>>) -> Self {
        Self::enhanced(
            FrameKind::Request,
            Enhanced::new(ird, ord),
            private_data.into(),
        )
    }

    /// A revision-1 accepting Reply.
    pub fn reply_v1(private_data: impl Into<Vec<u8>>) -> Self {
        Self::plain(FrameKind::Reply, private_data.into())
    }

    /// A revision-2 enhanced accepting Reply carrying the responder's negotiated IRD/ORD.
    pub fn reply_v2(ird: u16, ord: u16, private_data: impl Into<Vec<u8>>) -> Self {
        Self::enhanced(
            FrameKind::Reply,
            Enhanced::new(ird, ord),
            private_data.into(),
        )
    }

    /// A revision-1 rejecting Reply (R set).
    pub fn reject_v1(private_data: impl Into<Vec<u8>>) -> Self {
        let mut f = Self::reply_v1(private_data);
        f.flags.reject = true;
        f
    }

    /// A revision-2 rejecting Reply. siw still sends the Enhanced flag and its IRD/ORD words in
    /// a reject (flags 0x30), so this does too.
    pub fn reject_v2(ird: u16, ord: u16, private_data: impl Into<Vec<u8>>) -> Self {
        let mut f = Self::reply_v2(ird, ord, private_data);
        f.flags.reject = true;
        f
    }

    fn plain(kind: FrameKind, private_data: Vec<u8>) -> Self {
        MpaFrame {
            kind,
            flags: MpaFlags::default(),
            revision: REVISION_1,
            enhanced: None,
            private_data,
        }
    }

    fn enhanced(kind: FrameKind, enhanced: Enhanced, private_data: Vec<u8>) -> Self {
        MpaFrame {
            kind,
            flags: MpaFlags {
                enhanced: true,
                ..MpaFlags::default()
            },
            revision: REVISION_2,
            enhanced: Some(enhanced),
            private_data,
        }
    }

    /// The PD_Length field: user data plus the IRD/ORD words when present.
    pub fn pd_length(&self) -> usize {
        self.private_data.len()
            + if self.enhanced.is_some() {
                ENHANCED_LEN
            } else {
                0
            }
    }

    /// Bytes the frame takes on the wire.
    pub fn buffer_len(&self) -> usize {
        MPA_FRAME_HEADER_LEN + self.pd_length()
    }

    /// Parses one frame from the start of `buf` and returns it with the number of bytes it
    /// took; bytes after it (the peer's first FPDU, say) are left alone.
    ///
    /// PD_Length may be up to [`RFC_MAX_PRIVATE_DATA`]; use [`MpaFrame::parse_with_limit`] or
    /// [`MpaFrame::check_linux_limits`] for the Linux limit. Errors:
    /// - [`WireError::Truncated`]: a valid prefix, read more and retry;
    /// - [`WireError::BadField`] `"MPA key"`: neither key (checked on as many bytes as there
    ///   are, so garbage fails fast); `"MPA revision"`: not 1 or 2 (revision 0, the legacy
    ///   Ammasso format, is not supported);
    /// - [`WireError::BadLength`]: PD_Length over the limit (from the header alone), or an
    ///   enhanced revision-2 frame with PD_Length below 4 (once the whole frame is in).
    pub fn parse(buf: &[u8]) -> Result<(Self, usize)> {
        Self::parse_with_limit(buf, RFC_MAX_PRIVATE_DATA)
    }

    /// As [`MpaFrame::parse`], with PD_Length (including the IRD/ORD words) limited to
    /// `max_pd`, e.g. [`MAX_PRIVATE_DATA`] to refuse what siw refuses.
    pub fn parse_with_limit(buf: &[u8], max_pd: usize) -> Result<(Self, usize)> {
        let kind = Self::key_kind(buf)?;
        need("MPA frame header", buf, MPA_FRAME_HEADER_LEN)?;
        let flags = MpaFlags::from_byte(buf[16]);
        let revision = buf[17];
        let pd_len = usize::from(be16(buf, 18));
        if revision != REVISION_1 && revision != REVISION_2 {
            return Err(WireError::BadField {
                field: "MPA revision",
                value: revision.into(),
            });
        }
        // Checked before waiting for the data, so a bogus length cannot stall a stream reader.
        if pd_len > max_pd {
            return Err(WireError::BadLength {
                what: "MPA PD_Length",
                detail: format!("{pd_len} bytes, at most {max_pd}"),
            });
        }
        let has_enhanced = revision == REVISION_2 && flags.enhanced;
        let total = MPA_FRAME_HEADER_LEN + pd_len;
        need("MPA frame", buf, total)?;
        // Judged once the whole frame is in (at most 3 bytes more), as siw reads a frame
        // before it looks at it: a responder answers such a Request with a reject Reply.
        if has_enhanced && pd_len < ENHANCED_LEN {
            return Err(WireError::BadLength {
                what: "MPA PD_Length",
                detail: format!(
                    "{pd_len} bytes in an enhanced frame, which needs at least {ENHANCED_LEN}"
                ),
            });
        }
        let pd = &buf[MPA_FRAME_HEADER_LEN..total];
        let (enhanced, user) = if has_enhanced {
            (Some(Enhanced::parse(pd)?), &pd[ENHANCED_LEN..])
        } else {
            (None, pd)
        };
        Ok((
            MpaFrame {
                kind,
                flags,
                revision,
                enhanced,
                private_data: user.to_vec(),
            },
            total,
        ))
    }

    /// Which key `buf` starts with, judging only the bytes present.
    fn key_kind(buf: &[u8]) -> Result<FrameKind> {
        let seen = &buf[..buf.len().min(REQ_KEY.len())];
        let req = REQ_KEY.starts_with(seen);
        let rep = REP_KEY.starts_with(seen);
        if !req && !rep {
            // The first bytes say most about what the peer sent instead ("HTTP/1.1", say).
            let mut first = [0u8; 8];
            for (d, s) in first.iter_mut().zip(seen) {
                *d = *s;
            }
            return Err(WireError::BadField {
                field: "MPA key",
                value: u64::from_be_bytes(first),
            });
        }
        if seen.len() < REQ_KEY.len() {
            // The keys differ only at byte 10, so a short prefix may still become either.
            return Err(WireError::Truncated {
                what: "MPA key",
                need: REQ_KEY.len(),
                got: seen.len(),
            });
        }
        Ok(if req {
            FrameKind::Request
        } else {
            FrameKind::Reply
        })
    }

    /// Fails unless the frame can be encoded so that [`MpaFrame::parse`] reads it back
    /// unchanged: revision 1 or 2, `enhanced` present exactly for revision 2
    /// with the Enhanced flag, IRD/ORD within 14 bits, reserved flags within 3 bits, and
    /// PD_Length at most [`RFC_MAX_PRIVATE_DATA`].
    pub fn check(&self) -> Result<()> {
        if self.revision != REVISION_1 && self.revision != REVISION_2 {
            return Err(WireError::BadField {
                field: "MPA revision",
                value: self.revision.into(),
            });
        }
        check_width("MPA reserved flags", 3, self.flags.reserved.into())?;
        let wants_enhanced = self.revision == REVISION_2 && self.flags.enhanced;
        if self.enhanced.is_some() != wants_enhanced {
            return Err(WireError::BadField {
                field: "MPA enhanced flag",
                value: self.flags.to_byte().into(),
            });
        }
        if let Some(e) = &self.enhanced {
            e.to_bytes()?;
        }
        if self.pd_length() > RFC_MAX_PRIVATE_DATA {
            return Err(WireError::PrivateDataTooLong {
                what: "MPA frame",
                len: self.pd_length(),
                max: RFC_MAX_PRIVATE_DATA,
            });
        }
        Ok(())
    }

    /// Fails unless the frame is within what Linux providers accept: PD_Length (IRD/ORD words
    /// included) at most [`MAX_PRIVATE_DATA`], which leaves [`ENHANCED_USER_MAX`] user bytes in
    /// an enhanced frame.
    pub fn check_linux_limits(&self) -> Result<()> {
        if self.pd_length() > MAX_PRIVATE_DATA {
            // Reported in user bytes, the number the caller controls.
            let max = if self.enhanced.is_some() {
                ENHANCED_USER_MAX
            } else {
                MAX_PRIVATE_DATA
            };
            return Err(WireError::PrivateDataTooLong {
                what: "MPA frame (Linux)",
                len: self.private_data.len(),
                max,
            });
        }
        Ok(())
    }

    /// Writes the frame at the start of `buf` and returns its length. Fails as
    /// [`MpaFrame::check`] does, or with [`WireError::Truncated`] if `buf` is too short.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        self.check()?;
        let total = self.buffer_len();
        need("MPA frame output", buf, total)?;
        put(buf, 0, self.kind.key());
        buf[16] = self.flags.to_byte();
        buf[17] = self.revision;
        // check() bounds pd_length by 512, so it fits 16 bits.
        put(buf, 18, &(self.pd_length() as u16).to_be_bytes());
        let mut at = MPA_FRAME_HEADER_LEN;
        if let Some(e) = &self.enhanced {
            at += e.emit(&mut buf[at..])?;
        }
        put(buf, at, &self.private_data);
        Ok(total)
    }

    /// The frame as a new vector.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0; self.buffer_len()];
        self.emit(&mut v)?;
        Ok(v)
    }
}

/// Whether FPDUs carry a CRC after this Request and Reply: yes if either side set C.
pub fn crc_negotiated(req: &MpaFrame, rep: &MpaFrame) -> bool {
    req.flags.crc || rep.flags.crc
}

// ------------------------------------------------------------------------------------------
// CRC and FPDU framing
// ------------------------------------------------------------------------------------------

/// The MPA CRC-32C (Castagnoli, as iSCSI) of `bytes`. On the wire it goes least-significant
/// byte first: `mpa_crc(b).to_le_bytes()`.
pub fn mpa_crc(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

/// Length of the ULPDU_Length field that opens every FPDU.
pub const FPDU_LEN_FIELD: usize = 2;
/// Length of the CRC slot that closes every FPDU (present even when CRC is off).
pub const FPDU_CRC_LEN: usize = 4;
/// The largest ULPDU an FPDU can carry (ULPDU_Length is 16 bits).
pub const MAX_ULPDU: usize = u16::MAX as usize;

/// Pad bytes after a ULPDU of `ulpdu_len` bytes, so that length field + ULPDU + pad is a
/// multiple of 4.
pub const fn fpdu_pad(ulpdu_len: usize) -> usize {
    (4 - (FPDU_LEN_FIELD + ulpdu_len) % 4) % 4
}

/// Bytes an FPDU carrying `ulpdu_len` bytes takes on the wire (no markers).
pub const fn fpdu_len(ulpdu_len: usize) -> usize {
    FPDU_LEN_FIELD + ulpdu_len + fpdu_pad(ulpdu_len) + FPDU_CRC_LEN
}

/// Appends one FPDU carrying `ulpdu` to `out`: length, ULPDU, zero pad, then the CRC-32C
/// when `crc_on`, else 0 as Linux sends. Fails if the ULPDU is longer than [`MAX_ULPDU`].
pub fn emit_fpdu(ulpdu: &[u8], crc_on: bool, out: &mut Vec<u8>) -> Result<()> {
    let len = u16::try_from(ulpdu.len()).map_err(|_| WireError::BadLength {
        what: "MPA ULPDU_Length",
        detail: format!("{} bytes, at most {MAX_ULPDU}", ulpdu.len()),
    })?;
    let start = out.len();
    out.reserve(fpdu_len(ulpdu.len()));
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(ulpdu);
    out.resize(out.len() + fpdu_pad(ulpdu.len()), 0);
    let crc = if crc_on { mpa_crc(&out[start..]) } else { 0 };
    out.extend_from_slice(&crc.to_le_bytes());
    Ok(())
}

/// One FPDU as it lies in a buffer, CRC not yet judged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fpdu<'a> {
    /// The DDP/RDMAP header and payload.
    pub ulpdu: &'a [u8],
    /// The pad bytes (Linux sends zeros; any value is accepted).
    pub pad: &'a [u8],
    /// The CRC slot read least-significant byte first, so it compares with [`mpa_crc`].
    pub crc: u32,
}

impl<'a> Fpdu<'a> {
    /// Splits the FPDU at the start of `buf` and returns it with its length on the wire.
    /// [`WireError::Truncated`] means the whole FPDU has not arrived yet.
    pub fn parse(buf: &'a [u8]) -> Result<(Self, usize)> {
        need("MPA FPDU length", buf, FPDU_LEN_FIELD)?;
        let ulpdu_len = usize::from(be16(buf, 0));
        let total = fpdu_len(ulpdu_len);
        need("MPA FPDU", buf, total)?;
        let ulpdu_end = FPDU_LEN_FIELD + ulpdu_len;
        let crc_at = total - FPDU_CRC_LEN;
        let crc = u32::from_le_bytes([
            buf[crc_at],
            buf[crc_at + 1],
            buf[crc_at + 2],
            buf[crc_at + 3],
        ]);
        Ok((
            Fpdu {
                ulpdu: &buf[FPDU_LEN_FIELD..ulpdu_end],
                pad: &buf[ulpdu_end..crc_at],
                crc,
            },
            total,
        ))
    }

    /// The CRC-32C of the bytes the CRC covers: length field, ULPDU and pad.
    pub fn computed_crc(&self) -> u32 {
        // A parsed Fpdu's ULPDU came from a 16-bit length, so this cast does not truncate.
        let len = (self.ulpdu.len() as u16).to_be_bytes();
        let crc = crc32c::crc32c_append(mpa_crc(&len), self.ulpdu);
        crc32c::crc32c_append(crc, self.pad)
    }

    /// Fails with [`WireError::BadCrc`] unless the carried CRC matches the bytes.
    pub fn verify_crc(&self) -> Result<()> {
        let computed = self.computed_crc();
        if computed == self.crc {
            Ok(())
        } else {
            Err(WireError::BadCrc {
                what: "MPA CRC",
                carried: self.crc,
                computed,
            })
        }
    }
}

/// Reads one FPDU from the start of `buf` and returns its ULPDU and the bytes it took.
///
/// With `crc_on` the CRC must match ([`WireError::BadCrc`] otherwise); without, the CRC slot
/// is ignored. Pad bytes are not checked. [`WireError::Truncated`] means read more and retry.
pub fn parse_fpdu(buf: &[u8], crc_on: bool) -> Result<(&[u8], usize)> {
    let (fpdu, used) = Fpdu::parse(buf)?;
    if crc_on {
        fpdu.verify_crc()?;
    }
    Ok((fpdu.ulpdu, used))
}

// ------------------------------------------------------------------------------------------
// DDP / RDMAP
// ------------------------------------------------------------------------------------------

/// The DDP version (DV) every segment must carry.
pub const DDP_VERSION: u8 = 1;
/// The RDMAP version (RV) every message must carry.
pub const RDMAP_VERSION: u8 = 1;
/// Length of the untagged DDP header with the RDMAP control byte.
pub const UNTAGGED_HEADER_LEN: usize = 18;
/// Length of the tagged DDP header with the RDMAP control byte.
pub const TAGGED_HEADER_LEN: usize = 14;
/// Untagged queue for Send messages.
pub const QN_SEND: u32 = 0;
/// Untagged queue for RDMA Read Requests.
pub const QN_READ_REQUEST: u32 = 1;
/// Untagged queue for Terminate.
pub const QN_TERMINATE: u32 = 2;

const DDP_TAGGED: u8 = 0x80;
const DDP_LAST: u8 = 0x40;
const DDP_RSVD_SHIFT: u8 = 2;

/// The RDMAP operation (4 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub enum RdmapOpcode {
    /// 0: RDMA Write (tagged).
    RdmaWrite,
    /// 1: RDMA Read Request (untagged, queue 1).
    RdmaReadRequest,
    /// 2: RDMA Read Response (tagged).
    RdmaReadResponse,
    /// 3: Send.
    Send,
    /// 4: Send with Invalidate.
    SendInvalidate,
    /// 5: Send with Solicited Event.
    SendSe,
    /// 6: Send with Solicited Event and Invalidate.
    SendSeInvalidate,
    /// 7: Terminate (untagged, queue 2).
    Terminate,
    /// 8..=15: not defined by RFC 5040 (RFC 7306 uses some); kept as seen.
    Other(u8),
}

impl RdmapOpcode {
    /// The opcode in the low 4 bits of `bits` (the high bits are ignored).
    pub const fn from_bits(bits: u8) -> Self {
        match bits & 0x0F {
            0 => RdmapOpcode::RdmaWrite,
            1 => RdmapOpcode::RdmaReadRequest,
            2 => RdmapOpcode::RdmaReadResponse,
            3 => RdmapOpcode::Send,
            4 => RdmapOpcode::SendInvalidate,
            5 => RdmapOpcode::SendSe,
            6 => RdmapOpcode::SendSeInvalidate,
            7 => RdmapOpcode::Terminate,
            n => RdmapOpcode::Other(n),
        }
    }

    /// The 4-bit value. `Other` is returned as held; see [`DdpRdmapHeader::emit`] for what the
    /// encoder accepts.
    pub const fn bits(self) -> u8 {
        match self {
            RdmapOpcode::RdmaWrite => 0,
            RdmapOpcode::RdmaReadRequest => 1,
            RdmapOpcode::RdmaReadResponse => 2,
            RdmapOpcode::Send => 3,
            RdmapOpcode::SendInvalidate => 4,
            RdmapOpcode::SendSe => 5,
            RdmapOpcode::SendSeInvalidate => 6,
            RdmapOpcode::Terminate => 7,
            RdmapOpcode::Other(n) => n,
        }
    }
}

/// The buffer model of a DDP segment and its fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub enum DdpBuffer {
    /// T = 1: data placed at an advertised buffer (RDMA Write, Read Response).
    Tagged {
        /// Data sink STag.
        stag: u32,
        /// Tagged offset.
        tagged_offset: u64,
    },
    /// T = 0: data placed in the next buffer of a queue (Send*, Read Request, Terminate).
    Untagged {
        /// The 32 bits after the RDMAP control byte: the Invalidate STag of a Send with
        /// Invalidate, else reserved (0).
        rsvd_ulp: u32,
        /// Queue number.
        qn: u32,
        /// Message sequence number (per queue, from 1).
        msn: u32,
        /// Message offset of this segment.
        mo: u32,
    },
}

/// The DDP header with the RDMAP control byte, every bit kept so that parse → emit is exact.
///
/// The versions are not fields: anything but 1 fails to parse, and the encoder always writes 1.
/// The parser does not check that the opcode suits the buffer model (a tagged Send, say); that
/// is the receiver's business, answered with a Terminate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct DdpRdmapHeader {
    /// L: last segment of the message.
    pub last: bool,
    /// DDP control bits 5..2 (reserved, 4 bits).
    pub ddp_reserved: u8,
    /// RDMAP control bits 5..4 (reserved, 2 bits).
    pub rdmap_reserved: u8,
    /// The RDMAP operation.
    pub opcode: RdmapOpcode,
    /// Tagged or untagged, with the fields of each.
    pub buffer: DdpBuffer,
}

impl DdpRdmapHeader {
    /// A last-segment untagged header with zero reserved fields.
    pub const fn untagged(opcode: RdmapOpcode, qn: u32, msn: u32, mo: u32) -> Self {
        DdpRdmapHeader {
            last: true,
            ddp_reserved: 0,
            rdmap_reserved: 0,
            opcode,
            buffer: DdpBuffer::Untagged {
                rsvd_ulp: 0,
                qn,
                msn,
                mo,
            },
        }
    }

    /// A last-segment tagged header with zero reserved fields.
    pub const fn tagged(opcode: RdmapOpcode, stag: u32, tagged_offset: u64) -> Self {
        DdpRdmapHeader {
            last: true,
            ddp_reserved: 0,
            rdmap_reserved: 0,
            opcode,
            buffer: DdpBuffer::Tagged {
                stag,
                tagged_offset,
            },
        }
    }

    /// Whether this is a tagged (T = 1) header.
    pub const fn is_tagged(&self) -> bool {
        matches!(self.buffer, DdpBuffer::Tagged { .. })
    }

    /// Bytes the header takes: 14 tagged, 18 untagged.
    pub const fn buffer_len(&self) -> usize {
        if self.is_tagged() {
            TAGGED_HEADER_LEN
        } else {
            UNTAGGED_HEADER_LEN
        }
    }

    /// Parses the header at the start of a ULPDU and returns it with its length; the payload
    /// follows. A DDP or RDMAP version other than 1 is [`WireError::BadField`].
    pub fn parse(buf: &[u8]) -> Result<(Self, usize)> {
        need("DDP/RDMAP control", buf, 2)?;
        let ddp = buf[0];
        let rdmap = buf[1];
        if ddp & 0x03 != DDP_VERSION {
            return Err(WireError::BadField {
                field: "DDP version",
                value: (ddp & 0x03).into(),
            });
        }
        if rdmap >> 6 != RDMAP_VERSION {
            return Err(WireError::BadField {
                field: "RDMAP version",
                value: (rdmap >> 6).into(),
            });
        }
        let tagged = ddp & DDP_TAGGED != 0;
        let buffer = if tagged {
            need("DDP tagged header", buf, TAGGED_HEADER_LEN)?;
            DdpBuffer::Tagged {
                stag: be32(buf, 2),
                tagged_offset: be64(buf, 6),
            }
        } else {
            need("DDP untagged header", buf, UNTAGGED_HEADER_LEN)?;
            DdpBuffer::Untagged {
                rsvd_ulp: be32(buf, 2),
                qn: be32(buf, 6),
                msn: be32(buf, 10),
                mo: be32(buf, 14),
            }
        };
        let header = DdpRdmapHeader {
            last: ddp & DDP_LAST != 0,
            ddp_reserved: (ddp >> DDP_RSVD_SHIFT) & 0x0F,
            rdmap_reserved: (rdmap >> 4) & 0x03,
            opcode: RdmapOpcode::from_bits(rdmap),
            buffer,
        };
        Ok((header, header.buffer_len()))
    }

    /// Writes the header at the start of `buf` and returns its length. Fails if a reserved
    /// field is wider than its bits, or if `opcode` is `Other` with a value outside 8..=15
    /// (0..=7 would read back as a named opcode).
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        check_width("DDP reserved", 4, self.ddp_reserved.into())?;
        check_width("RDMAP reserved", 2, self.rdmap_reserved.into())?;
        if let RdmapOpcode::Other(n) = self.opcode {
            if !(8..=15).contains(&n) {
                return Err(WireError::BadField {
                    field: "RDMAP opcode",
                    value: n.into(),
                });
            }
        }
        let len = self.buffer_len();
        need("DDP/RDMAP header output", buf, len)?;
        let mut ddp = DDP_VERSION | (self.ddp_reserved << DDP_RSVD_SHIFT);
        if self.last {
            ddp |= DDP_LAST;
        }
        if self.is_tagged() {
            ddp |= DDP_TAGGED;
        }
        buf[0] = ddp;
        buf[1] = (RDMAP_VERSION << 6) | (self.rdmap_reserved << 4) | self.opcode.bits();
        match self.buffer {
            DdpBuffer::Tagged {
                stag,
                tagged_offset,
            } => {
                put(buf, 2, &stag.to_be_bytes());
                put(buf, 6, &tagged_offset.to_be_bytes());
            }
            DdpBuffer::Untagged {
                rsvd_ulp,
                qn,
                msn,
                mo,
            } => {
                put(buf, 2, &rsvd_ulp.to_be_bytes());
                put(buf, 6, &qn.to_be_bytes());
                put(buf, 10, &msn.to_be_bytes());
                put(buf, 14, &mo.to_be_bytes());
            }
        }
        Ok(len)
    }

    /// The header as a new vector.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0; self.buffer_len()];
        self.emit(&mut v)?;
        Ok(v)
    }
}

/// The 28-byte payload of an RDMA Read Request (after the untagged header, queue 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct ReadRequest {
    /// Data sink STag.
    pub sink_stag: u32,
    /// Data sink tagged offset.
    pub sink_to: u64,
    /// RDMA Read message size.
    pub size: u32,
    /// Data source STag.
    pub source_stag: u32,
    /// Data source tagged offset.
    pub source_to: u64,
}

impl ReadRequest {
    /// Length of the payload.
    pub const LEN: usize = 28;

    /// Parses the first 28 bytes of `buf`.
    pub fn parse(buf: &[u8]) -> Result<Self> {
        need("RDMA Read Request", buf, Self::LEN)?;
        Ok(ReadRequest {
            sink_stag: be32(buf, 0),
            sink_to: be64(buf, 4),
            size: be32(buf, 12),
            source_stag: be32(buf, 16),
            source_to: be64(buf, 20),
        })
    }

    /// The 28 bytes on the wire.
    pub fn to_bytes(&self) -> [u8; Self::LEN] {
        let mut b = [0; Self::LEN];
        put(&mut b, 0, &self.sink_stag.to_be_bytes());
        put(&mut b, 4, &self.sink_to.to_be_bytes());
        put(&mut b, 12, &self.size.to_be_bytes());
        put(&mut b, 16, &self.source_stag.to_be_bytes());
        put(&mut b, 20, &self.source_to.to_be_bytes());
        b
    }

    /// Writes the 28 bytes at the start of `buf` and returns 28.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        need("RDMA Read Request output", buf, Self::LEN)?;
        put(buf, 0, &self.to_bytes());
        Ok(Self::LEN)
    }
}

// ------------------------------------------------------------------------------------------
// Terminate
// ------------------------------------------------------------------------------------------

/// Terminate layers (the top 4 bits of the Terminate control word).
pub mod term_layer {
    /// RDMAP.
    pub const RDMAP: u8 = 0;
    /// DDP.
    pub const DDP: u8 = 1;
    /// The lower-layer protocol, MPA.
    pub const LLP: u8 = 2;
}

/// Terminate error types, per layer.
pub mod term_etype {
    /// RDMAP: catastrophic.
    pub const RDMAP_CATASTROPHIC: u8 = 0;
    /// RDMAP: remote protection error.
    pub const RDMAP_REMOTE_PROTECTION: u8 = 1;
    /// RDMAP: remote operation error.
    pub const RDMAP_REMOTE_OPERATION: u8 = 2;
    /// DDP: catastrophic.
    pub const DDP_CATASTROPHIC: u8 = 0;
    /// DDP: tagged buffer error.
    pub const DDP_TAGGED_BUFFER: u8 = 1;
    /// DDP: untagged buffer error.
    pub const DDP_UNTAGGED_BUFFER: u8 = 2;
    /// LLP: the only type, MPA.
    pub const LLP_MPA: u8 = 0;
}

/// Terminate error codes of the LLP (MPA) layer.
pub mod llp_ecode {
    /// TCP stream lost.
    pub const TCP_STREAM_LOST: u8 = 1;
    /// CRC error.
    pub const CRC_ERROR: u8 = 2;
    /// Marker or FPDU start error.
    pub const MARKER_ERROR: u8 = 3;
    /// Invalid Request or Reply frame.
    pub const INVALID_REQ_REP: u8 = 4;
    /// Local catastrophic error.
    pub const LOCAL_CATASTROPHIC: u8 = 5;
    /// Insufficient IRD (RFC 6581).
    pub const INSUFFICIENT_IRD: u8 = 6;
    /// No matching RTR (RFC 6581).
    pub const NO_MATCHING_RTR: u8 = 7;
}

const TERM_M: u16 = 0x8000;
const TERM_D: u16 = 0x4000;
const TERM_R: u16 = 0x2000;
const TERM_RESERVED: u16 = 0x1FFF;
const TERM_CTRL_LEN: usize = 4;
const TERM_SEG_LEN_LEN: usize = 2;

/// The payload of an RDMAP Terminate, after its 18-byte untagged header.
///
/// The DDP Segment Length is on the wire exactly when M or D is set, so `ddp_segment_length`
/// must be `Some` exactly then (the parser guarantees it; the encoder checks it).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Terminate {
    /// The layer that found the error (4 bits); see [`term_layer`].
    pub layer: u8,
    /// The error type within that layer (4 bits); see [`term_etype`].
    pub error_type: u8,
    /// The error code; see [`llp_ecode`] for the LLP layer.
    pub error_code: u8,
    /// M: the DDP Segment Length is valid.
    pub m: bool,
    /// D: a copy of the offending DDP header follows.
    pub d: bool,
    /// R: a copy of the offending RDMAP header follows.
    pub r: bool,
    /// The 13 reserved bits of the control word.
    pub reserved: u16,
    /// DDP Segment Length of the offending segment, present if M or D.
    pub ddp_segment_length: Option<u16>,
    /// The copied offending headers: everything after the fixed fields.
    pub copied_headers: Vec<u8>,
}

impl Terminate {
    /// An LLP (MPA) Terminate with `error_code` (see [`llp_ecode`]) and nothing copied.
    pub const fn llp(error_code: u8) -> Self {
        Terminate {
            layer: term_layer::LLP,
            error_type: term_etype::LLP_MPA,
            error_code,
            m: false,
            d: false,
            r: false,
            reserved: 0,
            ddp_segment_length: None,
            copied_headers: Vec::new(),
        }
    }

    /// Bytes the payload takes.
    pub fn buffer_len(&self) -> usize {
        let seg = if self.m || self.d {
            TERM_SEG_LEN_LEN
        } else {
            0
        };
        TERM_CTRL_LEN + seg + self.copied_headers.len()
    }

    /// Parses a whole Terminate payload; every byte after the fixed fields is taken as copied
    /// headers, so pass exactly the payload.
    pub fn parse(buf: &[u8]) -> Result<Self> {
        need("RDMAP Terminate", buf, TERM_CTRL_LEN)?;
        let hdrct = be16(buf, 2);
        let m = hdrct & TERM_M != 0;
        let d = hdrct & TERM_D != 0;
        let (ddp_segment_length, rest) = if m || d {
            need(
                "RDMAP Terminate DDP segment length",
                buf,
                TERM_CTRL_LEN + TERM_SEG_LEN_LEN,
            )?;
            (
                Some(be16(buf, TERM_CTRL_LEN)),
                TERM_CTRL_LEN + TERM_SEG_LEN_LEN,
            )
        } else {
            (None, TERM_CTRL_LEN)
        };
        Ok(Terminate {
            layer: buf[0] >> 4,
            error_type: buf[0] & 0x0F,
            error_code: buf[1],
            m,
            d,
            r: hdrct & TERM_R != 0,
            reserved: hdrct & TERM_RESERVED,
            ddp_segment_length,
            copied_headers: buf[rest..].to_vec(),
        })
    }

    /// Writes the payload at the start of `buf` and returns its length. Fails if a field is
    /// wider than its bits or `ddp_segment_length` disagrees with M/D.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        check_width("Terminate layer", 4, self.layer.into())?;
        check_width("Terminate error type", 4, self.error_type.into())?;
        check_width("Terminate reserved", 13, self.reserved.into())?;
        let mut hdrct = self.reserved;
        if self.m {
            hdrct |= TERM_M;
        }
        if self.d {
            hdrct |= TERM_D;
        }
        if self.r {
            hdrct |= TERM_R;
        }
        if self.ddp_segment_length.is_some() != (self.m || self.d) {
            return Err(WireError::BadField {
                field: "Terminate Hdrct (M/D vs segment length)",
                value: hdrct.into(),
            });
        }
        let len = self.buffer_len();
        need("RDMAP Terminate output", buf, len)?;
        buf[0] = (self.layer << 4) | self.error_type;
        buf[1] = self.error_code;
        put(buf, 2, &hdrct.to_be_bytes());
        let mut at = TERM_CTRL_LEN;
        if let Some(seg) = self.ddp_segment_length {
            put(buf, at, &seg.to_be_bytes());
            at += TERM_SEG_LEN_LEN;
        }
        put(buf, at, &self.copied_headers);
        Ok(len)
    }

    /// The payload as a new vector.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0; self.buffer_len()];
        self.emit(&mut v)?;
        Ok(v)
    }
}

// ------------------------------------------------------------------------------------------
// Whole ULPDUs
// ------------------------------------------------------------------------------------------

/// The ULPDU of a single-segment untagged Send (DDP 0x41, RDMAP 0x43) carrying `payload`.
/// Frame it with [`emit_fpdu`].
pub fn send_ulpdu(qn: u32, msn: u32, mo: u32, payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(UNTAGGED_HEADER_LEN + payload.len());
    v.extend_from_slice(&untagged_last_header(RdmapOpcode::Send, 0, qn, msn, mo));
    v.extend_from_slice(payload);
    v
}

/// An untagged last-segment header with zero reserved bits. Written directly rather than
/// through [`DdpRdmapHeader::emit`] because nothing here can be out of range, so callers need
/// not handle an error that cannot happen.
fn untagged_last_header(
    opcode: RdmapOpcode,
    rsvd_ulp: u32,
    qn: u32,
    msn: u32,
    mo: u32,
) -> [u8; UNTAGGED_HEADER_LEN] {
    let mut h = [0u8; UNTAGGED_HEADER_LEN];
    h[0] = DDP_LAST | DDP_VERSION;
    h[1] = (RDMAP_VERSION << 6) | (opcode.bits() & 0x0F);
    put(&mut h, 2, &rsvd_ulp.to_be_bytes());
    put(&mut h, 6, &qn.to_be_bytes());
    put(&mut h, 10, &msn.to_be_bytes());
    put(&mut h, 14, &mo.to_be_bytes());
    h
}

/// The ULPDU of a Terminate (DDP 0x41, RDMAP 0x47, MO 0) on queue `qn` (normally
/// [`QN_TERMINATE`]) with message number `msn`. Fails as [`Terminate::emit`] does.
pub fn terminate_ulpdu(qn: u32, msn: u32, term: &Terminate) -> Result<Vec<u8>> {
    let mut v = vec![0; UNTAGGED_HEADER_LEN + term.buffer_len()];
    term.emit(&mut v[UNTAGGED_HEADER_LEN..])?;
    put(
        &mut v,
        0,
        &untagged_last_header(RdmapOpcode::Terminate, 0, qn, msn, 0),
    );
    Ok(v)
}
