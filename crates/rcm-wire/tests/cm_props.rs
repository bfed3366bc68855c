//! Round-trip properties of every CM message `Repr`.
//!
//! Every bit of every CM message body is named by some field (reserved bits included), so
//! parsing is a bijection between 232-byte bodies and `Repr`s: bytes → Repr → bytes gives the
//! same bytes, and Repr → bytes → Repr the same Repr. ClassPortInfo covers only 72 of the 232
//! bytes; the rest goes out as zero.

use proptest::prelude::*;
use rcm_wire::cm::{self, attr, CmMad, CmMessage};
use rcm_wire::cma::{self, CmaHdr, PortSpace};
use rcm_wire::mad::{MadHeader, MAD_DATA_LEN};
use rcm_wire::WireError;

const ATTRS: [u16; 12] = attr::ALL;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn bytes_repr_bytes(idx in 0..ATTRS.len(), body in prop::collection::vec(any::<u8>(), MAD_DATA_LEN)) {
        let a = ATTRS[idx];
        let msg = CmMessage::parse(a, &body).unwrap();
        prop_assert_eq!(msg.attr_id(), a);
        let mut out = [0xAAu8; MAD_DATA_LEN];
        msg.emit(&mut out).unwrap();
        if a == attr::CLASS_PORT_INFO {
            prop_assert_eq!(&out[..72], &body[..72]);
            prop_assert!(out[72..].iter().all(|&b| b == 0));
        } else {
            prop_assert_eq!(&out[..], &body[..]);
        }
        // Repr -> bytes -> Repr.
        prop_assert_eq!(CmMessage::parse(a, &out).unwrap(), msg);
    }

    #[test]
    fn whole_mad_round_trip(idx in 1..ATTRS.len(), tid: u64, attr_mod: u32, body in prop::collection::vec(any::<u8>(), MAD_DATA_LEN)) {
        let msg = CmMessage::parse(ATTRS[idx], &body).unwrap();
        let mut mad = CmMad::send(tid, msg);
        mad.header.attr_mod = attr_mod;
        let bytes = mad.emit().unwrap();
        prop_assert_eq!(&bytes[24..], &body[..]);
        prop_assert_eq!(CmMad::parse(&bytes).unwrap(), mad);
    }

    #[test]
    fn short_private_data_is_zero_padded(len in 0usize..=92, fill: u8) {
        let req = cm::Req { private_data: vec![fill; len], ..cm::Req::default() };
        let mut out = [0xFFu8; MAD_DATA_LEN];
        CmMessage::Req(req).emit(&mut out).unwrap();
        prop_assert!(out[140..140 + len].iter().all(|&b| b == fill));
        prop_assert!(out[140 + len..].iter().all(|&b| b == 0));
    }

    #[test]
    fn cma_hdr_round_trip(v6: bool, a: [u8; 16], b: [u8; 16], port: u16, user in prop::collection::vec(any::<u8>(), 0..=56)) {
        let (src, dst) = if v6 {
            (std::net::IpAddr::from(a), std::net::IpAddr::from(b))
        } else {
            (std::net::IpAddr::from([a[0], a[1], a[2], a[3]]), std::net::IpAddr::from([b[0], b[1], b[2], b[3]]))
        };
        let h = CmaHdr { src_port: port, src, dst };
        let pd = h.with_user_data(&user, cma::limits::CONNECT).unwrap();
        prop_assert_eq!(CmaHdr::parse(&pd).unwrap(), h);
        prop_assert_eq!(&pd[36..], &user[..]);
    }

    #[test]
    fn service_id_round_trip(ps_idx in 0usize..4, port: u16) {
        let ps = [PortSpace::Tcp, PortSpace::Udp, PortSpace::Ib, PortSpace::Ipoib][ps_idx];
        prop_assert_eq!(cma::parse_service_id(cma::service_id(ps, port)), Some((ps, port)));
    }
}

#[test]
fn too_wide_values_and_too_long_data_are_refused() {
    let req = cm::Req {
        local_qpn: 1 << 24,
        ..cm::Req::default()
    };
    let mut out = [0u8; MAD_DATA_LEN];
    assert!(matches!(
        CmMessage::Req(req).emit(&mut out),
        Err(WireError::FieldOverflow { bits: 24, .. })
    ));
    let rej = cm::Rej {
        private_data: vec![0; 149],
        ..cm::Rej::default()
    };
    assert!(matches!(
        CmMessage::Rej(rej).emit(&mut out),
        Err(WireError::PrivateDataTooLong {
            len: 149,
            max: 148,
            ..
        })
    ));
    let mra = cm::Mra {
        message_mraed: cm::MsgCode::Unknown(4),
        ..cm::Mra::default()
    };
    assert!(CmMessage::Mra(mra).emit(&mut out).is_err());
}

#[test]
fn mad_header_checks() {
    let good = CmMad::send(1, CmMessage::Rtu(cm::Rtu::default()))
        .emit()
        .unwrap();
    CmMad::parse(&good).unwrap();
    for (at, val, field) in [
        (0, 2u8, "MAD base version"),
        (1, 0x04, "MAD class"),
        (2, 1, "CM class version"),
        (3, 0x01, "MAD method"),
        (17, 0x30, "CM attribute ID"),
    ] {
        let mut b = good;
        b[at] = val;
        match CmMad::parse(&b) {
            Err(WireError::BadField { field: f, .. }) => assert_eq!(f, field),
            other => panic!("byte {at}={val:#x}: {other:?}"),
        }
    }
    assert!(matches!(
        CmMad::parse(&good[..255]),
        Err(WireError::Truncated { .. })
    ));
    // ClassPortInfo travels as Get / GetResp, never as Send.
    let mut cpi = CmMad::send(1, CmMessage::ClassPortInfo(cm::ClassPortInfo::default()));
    assert!(CmMad::parse(&cpi.emit().unwrap()).is_err());
    cpi.header.method = rcm_wire::mad::method::GET;
    assert!(CmMad::parse(&cpi.emit().unwrap()).is_ok());
    let h = MadHeader::parse(&good).unwrap();
    assert!(!h.is_response());
}

#[test]
fn rej_reason_names_and_unknown_values() {
    use cm::RejReason;
    assert_eq!(RejReason::from_raw_value(8), RejReason::InvalidServiceId);
    assert_eq!(RejReason::from_raw_value(28), RejReason::ConsumerDefined);
    assert_eq!(RejReason::from_raw_value(34), RejReason::Unknown(34));
    assert_eq!(RejReason::Unknown(0x1234).raw(), 0x1234);
    assert_eq!(RejReason::StaleConn.raw(), 10);
}
