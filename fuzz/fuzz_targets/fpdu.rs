//! A run of FPDUs: the first byte's low bit says whether CRC is on, the rest is the stream.
//! Each FPDU goes through Fpdu::parse and parse_fpdu, its ULPDU through DdpRdmapHeader, and the
//! payload through Terminate and ReadRequest; what is accepted must re-encode exactly.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rcm_wire::mpa::{self, DdpRdmapHeader, Fpdu, ReadRequest, Terminate};

fuzz_target!(|data: &[u8]| {
    let Some((&flags, mut rest)) = data.split_first() else {
        return;
    };
    let crc_on = flags & 1 != 0;
    while !rest.is_empty() {
        let split = Fpdu::parse(rest);
        let framed = mpa::parse_fpdu(rest, crc_on);
        let Ok((f, n)) = split else {
            assert!(framed.is_err());
            return;
        };
        assert!(n <= rest.len(), "claims {n} of {} bytes", rest.len());
        assert_eq!(n, mpa::fpdu_len(f.ulpdu.len()));
        if crc_on {
            assert_eq!(framed.is_ok(), f.verify_crc().is_ok());
        } else {
            assert_eq!(framed, Ok((f.ulpdu, n)));
        }
        if let Ok((h, hl)) = DdpRdmapHeader::parse(f.ulpdu) {
            assert!(hl <= f.ulpdu.len());
            assert_eq!(h.to_vec().as_deref(), Ok(&f.ulpdu[..hl]), "DDP/RDMAP exact");
            let payload = &f.ulpdu[hl..];
            if let Ok(t) = Terminate::parse(payload) {
                assert_eq!(t.to_vec().as_deref(), Ok(payload), "Terminate exact");
            }
            if let Ok(r) = ReadRequest::parse(payload) {
                assert_eq!(&r.to_bytes()[..], &payload[..ReadRequest::LEN]);
            }
        }
        if framed.is_err() {
            return;
        }
        rest = &rest[n..];
    }
});
