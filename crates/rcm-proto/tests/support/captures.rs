//! The CM MADs of a capture in `testdata/captures/roce/`, in frame order.

use rcm_wire::roce::GsiDatagram;
use std::net::IpAddr;

/// Each frame's IPv4 source and MAD (zeros for frames that are not GSI datagrams, so that
/// indices stay frame numbers minus one).
pub fn gsi_mads(name: &str) -> Vec<(IpAddr, [u8; 256])> {
    let path = format!(
        "{}/../../testdata/captures/roce/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    let f = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut r = pcap_file::pcap::PcapReader::new(f).unwrap();
    let mut out = Vec::new();
    while let Some(p) = r.next_packet() {
        let d = p.unwrap().data.into_owned();
        let src = IpAddr::from([d[26], d[27], d[28], d[29]]);
        let udp_len = u16::from_be_bytes([d[38], d[39]]) as usize;
        let payload = &d[42..34 + udp_len];
        match GsiDatagram::parse(payload) {
            Ok(g) => out.push((src, *g.mad)),
            Err(_) => out.push((src, [0; 256])),
        }
    }
    out
}
