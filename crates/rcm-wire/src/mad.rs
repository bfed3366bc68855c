//! The MAD common header (24 bytes), IBTA Vol 1 §13.4.2. Reference: wire-formats.md §2.

use crate::bits::Field;
use crate::{need, Result};

/// Length of the common MAD header.
pub const MAD_HEADER_LEN: usize = 24;
/// Length of the class data that follows it in a 256-byte MAD.
pub const MAD_DATA_LEN: usize = 232;
/// Base version of every IB MAD (OPA's 0x80 aside).
pub const BASE_VERSION: u8 = 1;
/// Management class of the communication manager.
pub const MGMT_CLASS_CM: u8 = 0x07;
/// CM class version (IBTA 1.2+, Linux `IB_CM_CLASS_VERSION`).
pub const CM_CLASS_VERSION: u8 = 2;

/// MAD methods (bit 7 of the byte is the response bit, kept separately).
pub mod method {
    /// Get.
    pub const GET: u8 = 0x01;
    /// Set.
    pub const SET: u8 = 0x02;
    /// Send: every CM message but ClassPortInfo.
    pub const SEND: u8 = 0x03;
    /// Trap.
    pub const TRAP: u8 = 0x05;
    /// Report.
    pub const REPORT: u8 = 0x06;
    /// TrapRepress.
    pub const TRAP_REPRESS: u8 = 0x07;
    /// GetResp: Get with the response bit.
    pub const GET_RESP: u8 = 0x81;
}

/// MAD status values used by the CM.
pub mod status {
    /// Busy.
    pub const BUSY: u16 = 0x0001;
    /// Redirect required.
    pub const REDIRECT: u16 = 0x0002;
    /// Bad base or class version.
    pub const BAD_VERSION: u16 = 0x0004;
    /// Method not supported.
    pub const METHOD_UNSUPPORTED: u16 = 0x0008;
    /// Method/attribute combination not supported: what Linux answers an unmatched Get/Set.
    pub const METHOD_ATTR_UNSUPPORTED: u16 = 0x000C;
    /// Invalid attribute or attribute modifier value.
    pub const INVALID_ATTR_VALUE: u16 = 0x001C;
}

const BASE: Field = Field::new(0, 0, 8);
const CLASS: Field = Field::new(1, 0, 8);
const CLASS_VER: Field = Field::new(2, 0, 8);
const METHOD: Field = Field::new(3, 0, 8);
const STATUS: Field = Field::new(4, 0, 16);
const CLASS_SPECIFIC: Field = Field::new(6, 0, 16);
const TID: Field = Field::new(8, 0, 64);
const ATTR_ID: Field = Field::new(16, 0, 16);
const RESERVED: Field = Field::new(18, 0, 16);
const ATTR_MOD: Field = Field::new(20, 0, 32);

/// The common MAD header. `method` holds the whole byte 3, response bit included, so a
/// GetResp is `0x81`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct MadHeader {
    /// Base version (1).
    pub base_version: u8,
    /// Management class (0x07 for the CM).
    pub mgmt_class: u8,
    /// Class version (2 for the CM).
    pub class_version: u8,
    /// Method, with the response bit as bit 7.
    pub method: u8,
    /// Status.
    pub status: u16,
    /// Class-specific field.
    pub class_specific: u16,
    /// Transaction ID, opaque: echo it as received.
    pub tid: u64,
    /// Attribute ID (the CM message type).
    pub attr_id: u16,
    /// Reserved.
    pub reserved: u16,
    /// Attribute modifier (ECE option bits in REQ/REP since Linux 5.9).
    pub attr_mod: u32,
}

impl MadHeader {
    /// A CM Send header for `attr_id` with transaction ID `tid`.
    pub fn cm_send(attr_id: u16, tid: u64) -> Self {
        MadHeader {
            base_version: BASE_VERSION,
            mgmt_class: MGMT_CLASS_CM,
            class_version: CM_CLASS_VERSION,
            method: method::SEND,
            status: 0,
            class_specific: 0,
            tid,
            attr_id,
            reserved: 0,
            attr_mod: 0,
        }
    }

    /// Whether the response bit (bit 7 of the method byte) is set.
    pub fn is_response(&self) -> bool {
        self.method & 0x80 != 0
    }

    /// Parses the first 24 bytes of `buf`. No field is judged here; the class parser decides.
    pub fn parse(buf: &[u8]) -> Result<Self> {
        need("MAD header", buf, MAD_HEADER_LEN)?;
        Ok(MadHeader {
            base_version: BASE.get(buf) as u8,
            mgmt_class: CLASS.get(buf) as u8,
            class_version: CLASS_VER.get(buf) as u8,
            method: METHOD.get(buf) as u8,
            status: STATUS.get(buf) as u16,
            class_specific: CLASS_SPECIFIC.get(buf) as u16,
            tid: TID.get(buf),
            attr_id: ATTR_ID.get(buf) as u16,
            reserved: RESERVED.get(buf) as u16,
            attr_mod: ATTR_MOD.get(buf) as u32,
        })
    }

    /// Writes the header into the first 24 bytes of `buf`.
    pub fn emit(&self, buf: &mut [u8]) {
        BASE.set(buf, self.base_version.into());
        CLASS.set(buf, self.mgmt_class.into());
        CLASS_VER.set(buf, self.class_version.into());
        METHOD.set(buf, self.method.into());
        STATUS.set(buf, self.status.into());
        CLASS_SPECIFIC.set(buf, self.class_specific.into());
        TID.set(buf, self.tid);
        ATTR_ID.set(buf, self.attr_id.into());
        RESERVED.set(buf, self.reserved.into());
        ATTR_MOD.set(buf, self.attr_mod.into());
    }
}
