//! How Linux builds CM transaction IDs (`cm.c: cm_form_tid`), so ours look like the kernel's.
//!
//! TID = (MAD agent id << 32) | low32, where low32 is the cm_id's local communication ID as
//! raw big-endian bytes reinterpreted in (little-endian) host order: on the wire the last four
//! TID bytes are the comm ID byte-reversed. REQ, DREQ, SIDR_REQ and LAP get a fresh TID; MRA,
//! REJ, REP and RTU reuse the REQ's, DREP the DREQ's, SIDR_REP the SIDR_REQ's, APR the LAP's;
//! a REJ made without a cm_id copies the received TID. Receivers treat the TID as opaque.

/// The MAD agent ids Linux allocates are limited to 24 bits (mlx4 SR-IOV owns the top byte).
pub const AGENT_ID_MASK: u32 = 0x00FF_FFFF;

/// The TID Linux would send for a message starting a transaction of the cm_id with
/// `local_comm_id`, from MAD agent `agent_id`.
pub fn linux_tid(agent_id: u32, local_comm_id: u32) -> u64 {
    (u64::from(agent_id & AGENT_ID_MASK) << 32) | u64::from(local_comm_id.swap_bytes())
}

/// The comm ID hidden in a Linux-built TID (meaningless for other senders).
pub fn comm_id_of_linux_tid(tid: u64) -> u32 {
    (tid as u32).swap_bytes()
}

#[cfg(test)]
mod tests {
    #[test]
    fn low_word_is_the_byte_reversed_comm_id() {
        let tid = super::linux_tid(1, 0x1122_3344);
        assert_eq!(tid.to_be_bytes(), [0, 0, 0, 1, 0x44, 0x33, 0x22, 0x11]);
        assert_eq!(super::comm_id_of_linux_tid(tid), 0x1122_3344);
        assert_eq!(super::linux_tid(0x1FF_FFFF, 0) >> 32, 0xFF_FFFF);
    }
}
