//! The one error type every decoder in this crate returns.

use thiserror::Error;

/// Why a buffer could not be decoded (or a value could not be encoded).
///
/// Decoders never panic: every malformed input maps to one of these.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum WireError {
    /// The buffer is shorter than the structure needs.
    #[error("truncated: {what} needs {need} bytes, got {got}")]
    Truncated {
        /// What was being decoded.
        what: &'static str,
        /// Bytes needed.
        need: usize,
        /// Bytes available.
        got: usize,
    },
    /// A length field disagrees with the buffer or exceeds a limit.
    #[error("bad length in {what}: {detail}")]
    BadLength {
        /// What was being decoded.
        what: &'static str,
        /// The offending numbers, in words.
        detail: String,
    },
    /// A field holds a value the protocol does not allow here.
    #[error("unexpected {field}: {value:#x}")]
    BadField {
        /// The field's name as the spec spells it.
        field: &'static str,
        /// The value seen.
        value: u64,
    },
    /// A CRC (RoCEv2 ICRC or MPA CRC-32C) does not match the bytes it covers.
    #[error("bad {what}: carried {carried:#010x}, computed {computed:#010x}")]
    BadCrc {
        /// Which CRC.
        what: &'static str,
        /// The value on the wire (as a little-endian u32).
        carried: u32,
        /// The value computed over the covered bytes.
        computed: u32,
    },
    /// Private data longer than the message's area (or the caller's limit).
    #[error("private data too long for {what}: {len} bytes, at most {max}")]
    PrivateDataTooLong {
        /// The message or operation.
        what: &'static str,
        /// Bytes given.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A value does not fit the width of the field it must be encoded into.
    #[error("{field} does not fit in {bits} bits: {value:#x}")]
    FieldOverflow {
        /// The field's name.
        field: &'static str,
        /// Its width on the wire.
        bits: u32,
        /// The value given.
        value: u64,
    },
}

/// Shorthand for results in this crate.
pub type Result<T, E = WireError> = core::result::Result<T, E>;

/// Fails with [`WireError::Truncated`] unless `buf` has at least `need` bytes.
pub(crate) fn need(what: &'static str, buf: &[u8], need: usize) -> Result<()> {
    if buf.len() < need {
        Err(WireError::Truncated {
            what,
            need,
            got: buf.len(),
        })
    } else {
        Ok(())
    }
}
