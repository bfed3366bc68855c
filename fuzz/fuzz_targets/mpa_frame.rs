//! An MPA Request or Reply: MpaFrame::parse with the round trip to the same bytes and value,
//! parse_with_limit agreeing with it, and the RFC 6581 IRD/ORD words.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rcm_wire::mpa::{self, Enhanced, MpaFrame, MPA_FRAME_HEADER_LEN};

fuzz_target!(|data: &[u8]| {
    let parsed = MpaFrame::parse(data);
    if let Ok((f, n)) = &parsed {
        assert!(*n <= data.len(), "claims {n} of {} bytes", data.len());
        let bytes = f.to_vec().expect("an accepted frame re-encodes");
        assert_eq!(&bytes[..], &data[..*n], "MpaFrame parse -> emit is exact");
        assert_eq!(
            MpaFrame::parse(&bytes).as_ref(),
            Ok(&(f.clone(), *n)),
            "MpaFrame parse -> emit -> parse"
        );
    }
    for limit in [mpa::ENHANCED_LEN, mpa::MAX_PRIVATE_DATA, usize::MAX] {
        let limited = MpaFrame::parse_with_limit(data, limit);
        if let Ok((f, n)) = &limited {
            assert!(*n <= data.len());
            assert!(f.pd_length() <= limit);
        }
        // With a limit at or under the RFC's, parse accepts whatever parse_with_limit does.
        if limit <= mpa::RFC_MAX_PRIVATE_DATA {
            if let Ok(ok) = limited {
                assert_eq!(parsed.as_ref(), Ok(&ok));
            }
        }
    }
    let enh = data.get(MPA_FRAME_HEADER_LEN..).unwrap_or_default();
    if let Ok(e) = Enhanced::parse(enh) {
        assert_eq!(&e.to_bytes().expect("IRD/ORD re-encode")[..], &enh[..4]);
    }
});
