//! The daemon protocol's decoders (`rcm_ucm::proto`), which read whatever a local client
//! (or, for messages, the daemon) writes. The first two input bytes pick the frame kind
//! (little-endian), the rest is the body; the whole input is also tried as a frame. Checks:
//! no panic, and whatever a decoder accepts re-encodes under the same kind and decodes to
//! the same value. The seeded counterpart in CI is `decoders_never_panic_and_round_trip` in
//! `crates/rcm-ucm/tests/proto_fuzz.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rcm_ucm::proto::{decode_command, decode_message, split_frame, Header};

fuzz_target!(|data: &[u8]| {
    if let Ok((h, body)) = split_frame(data) {
        assert_eq!(h.len as usize, data.len() - 4);
        let _ = decode_command(h.kind, body);
        let _ = decode_message(h.kind, body);
    }
    if let Some(hb) = data.first_chunk::<12>() {
        if let Ok(h) = Header::parse(hb) {
            assert!(h.body_len() <= h.len as usize);
        }
    }
    let Some((k, body)) = data.split_first_chunk::<2>() else {
        return;
    };
    let kind = u16::from_le_bytes(*k);
    if let Ok(c) = decode_command(kind, body) {
        let frame = c.encode(7);
        let (h, b) = split_frame(&frame).expect("an encoded command splits");
        assert_eq!(h.kind, kind, "{c:?} re-encodes under another kind");
        assert_eq!(decode_command(h.kind, b).as_ref(), Ok(&c), "{c:?} round trip");
    }
    if let Ok(m) = decode_message(kind, body) {
        let frame = m.encode(7);
        let (h, b) = split_frame(&frame).expect("an encoded message splits");
        assert_eq!(h.kind, kind, "{m:?} re-encodes under another kind");
        assert_eq!(decode_message(h.kind, b).as_ref(), Ok(&m), "{m:?} round trip");
    }
});
