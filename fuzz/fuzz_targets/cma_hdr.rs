//! The rdma_cm private-data header, and the first 8 bytes as an rdma_cm service ID.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rcm_wire::cma::{self, CmaHdr, CMA_HDR_LEN};

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = CmaHdr::parse(data) {
        assert_eq!(data[0], cma::CMA_VERSION);
        let mut out = [0u8; CMA_HDR_LEN];
        h.emit(&mut out).expect("an accepted cma_hdr re-encodes");
        assert_eq!(CmaHdr::parse(&out), Ok(h), "cma_hdr parse -> emit -> parse");
    }
    if let Some(b) = data.first_chunk::<8>() {
        let sid = u64::from_be_bytes(*b);
        if let Some((ps, port)) = cma::parse_service_id(sid) {
            assert_eq!(cma::service_id(ps, port), sid);
        }
    }
});
