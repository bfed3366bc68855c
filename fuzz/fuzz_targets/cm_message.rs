//! One CM message body: the first two bytes (big-endian) pick the attribute ID, the rest is
//! the 232-byte MAD data. Accepted bodies round-trip; REQ and SIDR_REQ private data goes on
//! through the rdma_cm header parser.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rcm_wire::cm::{attr, ClassPortInfo, CmMessage};
use rcm_wire::cma::{self, CmaHdr};
use rcm_wire::mad::MAD_DATA_LEN;

fuzz_target!(|data: &[u8]| {
    let Some((id, body)) = data.split_first_chunk::<2>() else {
        return;
    };
    let attr_id = u16::from_be_bytes(*id);
    let Ok(msg) = CmMessage::parse(attr_id, body) else {
        return;
    };
    assert_eq!(msg.attr_id(), attr_id);
    let mut out = [0u8; MAD_DATA_LEN];
    msg.emit(&mut out)
        .expect("an accepted CM message re-encodes");
    assert_eq!(
        CmMessage::parse(attr_id, &out).as_ref(),
        Ok(&msg),
        "CmMessage parse -> emit -> parse"
    );
    let covered = if attr_id == attr::CLASS_PORT_INFO {
        ClassPortInfo::SIZE
    } else {
        MAD_DATA_LEN
    };
    assert_eq!(
        &out[..covered],
        &body[..covered],
        "CmMessage parse -> emit is exact"
    );
    let (pd, sid) = match &msg {
        CmMessage::Req(r) => (&r.private_data[..], r.service_id),
        CmMessage::SidrReq(r) => (&r.private_data[..], r.service_id),
        _ => return,
    };
    if let Ok(h) = CmaHdr::parse(pd) {
        let mut b = [0u8; cma::CMA_HDR_LEN];
        h.emit(&mut b).expect("an accepted cma_hdr re-encodes");
        assert_eq!(CmaHdr::parse(&b), Ok(h));
    }
    if let Some((ps, port)) = cma::parse_service_id(sid) {
        assert_eq!(cma::service_id(ps, port), sid);
    }
});
