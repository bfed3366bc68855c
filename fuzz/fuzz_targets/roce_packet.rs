//! RoCEv2 datagrams: the input as a UDP payload to port 4791 (RocePacket, GsiDatagram, and
//! CmMad on a GSI MAD), and split into a fake IP header (first 20 or 40 bytes) and a UDP
//! datagram for the ICRC.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rcm_wire::cm::CmMad;
use rcm_wire::roce::{self, Bth, Deth, GsiDatagram, RocePacket, BTH_LEN, DETH_LEN, ICRC_LEN};
use rcm_wire::WireError;

fn udp_payload(payload: &[u8]) {
    let bth = Bth::parse(payload);
    if let Ok(b) = &bth {
        let mut out = [0u8; BTH_LEN];
        b.emit(&mut out);
        assert_eq!(&out[..], &payload[..BTH_LEN], "BTH parse -> emit is exact");
    }
    let deth_bytes = payload.get(BTH_LEN..).unwrap_or_default();
    if let Ok(d) = Deth::parse(deth_bytes) {
        let mut out = [0u8; DETH_LEN];
        d.emit(&mut out);
        assert_eq!(
            &out[..],
            &deth_bytes[..DETH_LEN],
            "DETH parse -> emit is exact"
        );
    }
    let pkt = RocePacket::parse(payload);
    if let Ok(p) = &pkt {
        assert_eq!(Ok(p.bth), bth);
        if let Some(body) = p.payload {
            let ext = p.bth.opcode.ext_headers_len().expect("payload located");
            assert_eq!(
                BTH_LEN + ext + body.len() + usize::from(p.bth.pad_count) + ICRC_LEN,
                payload.len(),
                "RocePacket accounts for every byte and claims none beyond"
            );
        }
    }
    if let Ok(g) = GsiDatagram::parse(payload) {
        assert!(pkt.is_ok());
        if let Ok(m) = CmMad::parse(&g.mad[..]) {
            let bytes = m.emit().expect("an accepted CM MAD re-encodes");
            assert_eq!(CmMad::parse(&bytes).as_ref(), Ok(&m), "CmMad round trip");
        }
    }
}

fuzz_target!(|data: &[u8]| {
    udp_payload(data);
    for ip_len in [20, 40] {
        let Some((ip, udp)) = data.split_at_checked(ip_len) else {
            continue;
        };
        let verdict = roce::verify_icrc(ip, udp);
        let computed = roce::icrc_for_raw_ip(ip, &udp[..udp.len().saturating_sub(ICRC_LEN)]);
        if udp.len() >= 8 + BTH_LEN + ICRC_LEN {
            let at = udp.len() - ICRC_LEN;
            let carried = u32::from_le_bytes([udp[at], udp[at + 1], udp[at + 2], udp[at + 3]]);
            match (&verdict, &computed) {
                (Ok(()), Ok(c)) => assert_eq!(*c, carried),
                (Err(WireError::BadCrc { .. }), Ok(c)) => assert_ne!(*c, carried),
                (Err(_), Err(_)) => {}
                other => panic!("verify_icrc and icrc_for_raw_ip disagree: {other:?}"),
            }
        }
        if let Some(payload) = udp.get(8..) {
            udp_payload(payload);
        }
    }
});
