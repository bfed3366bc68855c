//! IB CM messages as MADs: the message bodies, their attribute IDs, and a whole-MAD codec.
//!
//! Reference: wire-formats.md §2–§3, IBTA Vol 1 chapter 12.

pub(crate) mod layout;
mod msgs;

pub use layout::FieldValue;
pub use msgs::*;

use crate::mad::{self, MadHeader, MAD_DATA_LEN, MAD_HEADER_LEN};
use crate::roce::MAD_LEN;
use crate::{need, Result, WireError};

/// CM attribute IDs.
pub mod attr {
    /// ClassPortInfo.
    pub const CLASS_PORT_INFO: u16 = 0x0001;
    /// REQ.
    pub const REQ: u16 = 0x0010;
    /// MRA.
    pub const MRA: u16 = 0x0011;
    /// REJ.
    pub const REJ: u16 = 0x0012;
    /// REP.
    pub const REP: u16 = 0x0013;
    /// RTU.
    pub const RTU: u16 = 0x0014;
    /// DREQ.
    pub const DREQ: u16 = 0x0015;
    /// DREP.
    pub const DREP: u16 = 0x0016;
    /// SIDR_REQ.
    pub const SIDR_REQ: u16 = 0x0017;
    /// SIDR_REP.
    pub const SIDR_REP: u16 = 0x0018;
    /// LAP.
    pub const LAP: u16 = 0x0019;
    /// APR.
    pub const APR: u16 = 0x001A;
    /// Every CM attribute ID above, in numeric order.
    pub const ALL: [u16; 12] = [
        CLASS_PORT_INFO,
        REQ,
        MRA,
        REJ,
        REP,
        RTU,
        DREQ,
        DREP,
        SIDR_REQ,
        SIDR_REP,
        LAP,
        APR,
    ];
}

/// Private-data area of each message, in bytes (Linux `IB_CM_*_PRIVATE_DATA_SIZE`).
pub mod pd_size {
    /// REQ.
    pub const REQ: usize = 92;
    /// MRA.
    pub const MRA: usize = 222;
    /// REJ.
    pub const REJ: usize = 148;
    /// REJ additional rejection information.
    pub const REJ_ARI: usize = 72;
    /// REP.
    pub const REP: usize = 196;
    /// RTU.
    pub const RTU: usize = 224;
    /// DREQ.
    pub const DREQ: usize = 220;
    /// DREP.
    pub const DREP: usize = 224;
    /// LAP.
    pub const LAP: usize = 168;
    /// APR.
    pub const APR: usize = 148;
    /// SIDR_REQ.
    pub const SIDR_REQ: usize = 216;
    /// SIDR_REP.
    pub const SIDR_REP: usize = 136;
}

/// One CM message body.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(tag = "type"))]
#[allow(clippy::large_enum_variant)]
pub enum CmMessage {
    /// ClassPortInfo (Get, Set or GetResp).
    ClassPortInfo(ClassPortInfo),
    /// ConnectRequest.
    Req(Req),
    /// MsgRcptAck.
    Mra(Mra),
    /// ConnectReject.
    Rej(Rej),
    /// ConnectReply.
    Rep(Rep),
    /// ReadyToUse.
    Rtu(Rtu),
    /// DisconnectRequest.
    Dreq(Dreq),
    /// DisconnectReply.
    Drep(Drep),
    /// ServiceIDResReq.
    SidrReq(SidrReq),
    /// ServiceIDResReqResp.
    SidrRep(SidrRep),
    /// LoadAlternatePath.
    Lap(Lap),
    /// AlternatePathResponse.
    Apr(Apr),
}

impl CmMessage {
    /// The attribute ID that carries this message.
    pub fn attr_id(&self) -> u16 {
        match self {
            CmMessage::ClassPortInfo(_) => attr::CLASS_PORT_INFO,
            CmMessage::Req(_) => attr::REQ,
            CmMessage::Mra(_) => attr::MRA,
            CmMessage::Rej(_) => attr::REJ,
            CmMessage::Rep(_) => attr::REP,
            CmMessage::Rtu(_) => attr::RTU,
            CmMessage::Dreq(_) => attr::DREQ,
            CmMessage::Drep(_) => attr::DREP,
            CmMessage::SidrReq(_) => attr::SIDR_REQ,
            CmMessage::SidrRep(_) => attr::SIDR_REP,
            CmMessage::Lap(_) => attr::LAP,
            CmMessage::Apr(_) => attr::APR,
        }
    }

    /// The IBTA name: REQ, MRA, REJ, REP, RTU, DREQ, DREP, SIDR_REQ, SIDR_REP, LAP, APR,
    /// ClassPortInfo.
    pub fn name(&self) -> &'static str {
        attr_name(self.attr_id()).unwrap_or("?")
    }

    /// Parses the 232-byte body of attribute `attr_id`.
    pub fn parse(attr_id: u16, data: &[u8]) -> Result<Self> {
        Ok(match attr_id {
            attr::CLASS_PORT_INFO => CmMessage::ClassPortInfo(ClassPortInfo::parse_at(data, 0)?),
            attr::REQ => CmMessage::Req(Req::parse_at(data, 0)?),
            attr::MRA => CmMessage::Mra(Mra::parse_at(data, 0)?),
            attr::REJ => CmMessage::Rej(Rej::parse_at(data, 0)?),
            attr::REP => CmMessage::Rep(Rep::parse_at(data, 0)?),
            attr::RTU => CmMessage::Rtu(Rtu::parse_at(data, 0)?),
            attr::DREQ => CmMessage::Dreq(Dreq::parse_at(data, 0)?),
            attr::DREP => CmMessage::Drep(Drep::parse_at(data, 0)?),
            attr::SIDR_REQ => CmMessage::SidrReq(SidrReq::parse_at(data, 0)?),
            attr::SIDR_REP => CmMessage::SidrRep(SidrRep::parse_at(data, 0)?),
            attr::LAP => CmMessage::Lap(Lap::parse_at(data, 0)?),
            attr::APR => CmMessage::Apr(Apr::parse_at(data, 0)?),
            other => {
                return Err(WireError::BadField {
                    field: "CM attribute ID",
                    value: other.into(),
                })
            }
        })
    }

    /// Writes the body into `data` (at least 232 bytes; bytes outside the body's fields are
    /// zeroed first so reserved space goes out as 0).
    pub fn emit(&self, data: &mut [u8]) -> Result<()> {
        need("CM message body", data, MAD_DATA_LEN)?;
        data[..MAD_DATA_LEN].fill(0);
        match self {
            CmMessage::ClassPortInfo(m) => m.emit_at(data, 0),
            CmMessage::Req(m) => m.emit_at(data, 0),
            CmMessage::Mra(m) => m.emit_at(data, 0),
            CmMessage::Rej(m) => m.emit_at(data, 0),
            CmMessage::Rep(m) => m.emit_at(data, 0),
            CmMessage::Rtu(m) => m.emit_at(data, 0),
            CmMessage::Dreq(m) => m.emit_at(data, 0),
            CmMessage::Drep(m) => m.emit_at(data, 0),
            CmMessage::SidrReq(m) => m.emit_at(data, 0),
            CmMessage::SidrRep(m) => m.emit_at(data, 0),
            CmMessage::Lap(m) => m.emit_at(data, 0),
            CmMessage::Apr(m) => m.emit_at(data, 0),
        }
    }

    /// The private data area of the message (empty for ClassPortInfo).
    pub fn private_data(&self) -> &[u8] {
        match self {
            CmMessage::ClassPortInfo(_) => &[],
            CmMessage::Req(m) => &m.private_data,
            CmMessage::Mra(m) => &m.private_data,
            CmMessage::Rej(m) => &m.private_data,
            CmMessage::Rep(m) => &m.private_data,
            CmMessage::Rtu(m) => &m.private_data,
            CmMessage::Dreq(m) => &m.private_data,
            CmMessage::Drep(m) => &m.private_data,
            CmMessage::SidrReq(m) => &m.private_data,
            CmMessage::SidrRep(m) => &m.private_data,
            CmMessage::Lap(m) => &m.private_data,
            CmMessage::Apr(m) => &m.private_data,
        }
    }

    /// (local, remote) communication IDs, where the message has them. SIDR messages carry a
    /// request ID instead, returned as the local one.
    pub fn comm_ids(&self) -> (Option<u32>, Option<u32>) {
        match self {
            CmMessage::ClassPortInfo(_) => (None, None),
            CmMessage::Req(m) => (Some(m.local_comm_id), None),
            CmMessage::Mra(m) => (Some(m.local_comm_id), Some(m.remote_comm_id)),
            CmMessage::Rej(m) => (Some(m.local_comm_id), Some(m.remote_comm_id)),
            CmMessage::Rep(m) => (Some(m.local_comm_id), Some(m.remote_comm_id)),
            CmMessage::Rtu(m) => (Some(m.local_comm_id), Some(m.remote_comm_id)),
            CmMessage::Dreq(m) => (Some(m.local_comm_id), Some(m.remote_comm_id)),
            CmMessage::Drep(m) => (Some(m.local_comm_id), Some(m.remote_comm_id)),
            CmMessage::SidrReq(m) => (Some(m.request_id), None),
            CmMessage::SidrRep(m) => (Some(m.request_id), None),
            CmMessage::Lap(m) => (Some(m.local_comm_id), Some(m.remote_comm_id)),
            CmMessage::Apr(m) => (Some(m.local_comm_id), Some(m.remote_comm_id)),
        }
    }
}

/// The IBTA name of a CM attribute ID.
pub fn attr_name(attr_id: u16) -> Option<&'static str> {
    Some(match attr_id {
        attr::CLASS_PORT_INFO => "ClassPortInfo",
        attr::REQ => "REQ",
        attr::MRA => "MRA",
        attr::REJ => "REJ",
        attr::REP => "REP",
        attr::RTU => "RTU",
        attr::DREQ => "DREQ",
        attr::DREP => "DREP",
        attr::SIDR_REQ => "SIDR_REQ",
        attr::SIDR_REP => "SIDR_REP",
        attr::LAP => "LAP",
        attr::APR => "APR",
        _ => return None,
    })
}

/// A whole CM MAD: the common header and the message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct CmMad {
    /// The MAD header (its attribute ID agrees with `msg`).
    pub header: MadHeader,
    /// The message.
    pub msg: CmMessage,
}

impl CmMad {
    /// A CM Send MAD carrying `msg` with transaction ID `tid`.
    pub fn send(tid: u64, msg: CmMessage) -> Self {
        CmMad {
            header: MadHeader::cm_send(msg.attr_id(), tid),
            msg,
        }
    }

    /// Parses a 256-byte MAD as the CM class. Fails for another class, base version or class
    /// version, a method the attribute does not use (Send for CM messages; Get, Set or
    /// GetResp for ClassPortInfo), or an unknown attribute.
    pub fn parse(buf: &[u8]) -> Result<Self> {
        need("CM MAD", buf, MAD_LEN)?;
        let header = MadHeader::parse(buf)?;
        if header.base_version != mad::BASE_VERSION {
            return Err(WireError::BadField {
                field: "MAD base version",
                value: header.base_version.into(),
            });
        }
        if header.mgmt_class != mad::MGMT_CLASS_CM {
            return Err(WireError::BadField {
                field: "MAD class",
                value: header.mgmt_class.into(),
            });
        }
        if header.class_version != mad::CM_CLASS_VERSION {
            return Err(WireError::BadField {
                field: "CM class version",
                value: header.class_version.into(),
            });
        }
        let method_ok = if header.attr_id == attr::CLASS_PORT_INFO {
            matches!(
                header.method,
                mad::method::GET | mad::method::SET | mad::method::GET_RESP
            )
        } else {
            header.method == mad::method::SEND
        };
        if !method_ok {
            return Err(WireError::BadField {
                field: "MAD method",
                value: header.method.into(),
            });
        }
        let msg = CmMessage::parse(header.attr_id, &buf[MAD_HEADER_LEN..MAD_LEN])?;
        Ok(CmMad { header, msg })
    }

    /// Writes the 256-byte MAD. The header's attribute ID is taken from the message.
    pub fn emit(&self) -> Result<[u8; MAD_LEN]> {
        let mut out = [0u8; MAD_LEN];
        self.emit_into(&mut out)?;
        Ok(out)
    }

    /// [`CmMad::emit`] into `out` (all of it written: what the message leaves unused is
    /// zero), for a caller that keeps the MAD where it will be sent from.
    pub fn emit_into(&self, out: &mut [u8; MAD_LEN]) -> Result<()> {
        out.fill(0);
        let mut header = self.header;
        header.attr_id = self.msg.attr_id();
        header.emit(out);
        self.msg.emit(&mut out[MAD_HEADER_LEN..])
    }
}
