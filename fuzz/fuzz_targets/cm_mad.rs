//! A 256-byte CM MAD: the common header and CmMad::parse, with the round trip
//! parse -> emit -> parse giving the same value.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rcm_wire::cm::{attr, ClassPortInfo, CmMad};
use rcm_wire::mad::{MadHeader, MAD_HEADER_LEN};
use rcm_wire::roce::MAD_LEN;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = MadHeader::parse(data) {
        let mut out = [0u8; MAD_HEADER_LEN];
        h.emit(&mut out);
        assert_eq!(
            &out[..],
            &data[..MAD_HEADER_LEN],
            "MAD header parse -> emit is exact"
        );
    }
    if let Ok(m) = CmMad::parse(data) {
        let bytes = m.emit().expect("an accepted CM MAD re-encodes");
        assert_eq!(
            CmMad::parse(&bytes).as_ref(),
            Ok(&m),
            "CmMad parse -> emit -> parse"
        );
        // Every bit of a CM body is a field (ClassPortInfo covers 72 of the 232 bytes).
        let end = if m.header.attr_id == attr::CLASS_PORT_INFO {
            MAD_HEADER_LEN + ClassPortInfo::SIZE
        } else {
            MAD_LEN
        };
        assert_eq!(&bytes[..end], &data[..end], "CmMad parse -> emit is exact");
    }
});
