//! `rcm decode`: CM traffic in a capture, one line per message.
//!
//! RoCEv2 (UDP port 4791): every ICRC is verified against the captured IP header, every MAD to
//! QP1 is decoded as a CM message. iWARP (TCP): each connection's streams are reassembled, the
//! MPA Request and Reply decoded, then FPDUs (CRC-32C verified when negotiated) with their
//! DDP/RDMAP headers. A corrupt or undecodable packet is reported on its own line, never a
//! crash.

use crate::capture::{
    self, Capture, CapturedPacket, FlowKey, FrameError, StreamEvent, TcpStreams, Transport,
};
use rcm_wire::cm::{CmMad, CmMessage};
use rcm_wire::cma::{self, CmaHdr, CMA_HDR_LEN};
use rcm_wire::mpa::{self, DdpBuffer, DdpRdmapHeader, FrameKind, MpaFrame, RdmapOpcode, Terminate};
use rcm_wire::roce::{self, GsiDatagram, RocePacket, ROCE_V2_UDP_PORT};
use rcm_wire::WireError;
use serde::Serialize;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::net::SocketAddr;

/// One decoded (or undecodable) message.
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    /// Frame number in the capture (1-based).
    pub frame: usize,
    /// Seconds since the first frame.
    pub time: f64,
    /// Sender.
    pub src: SocketAddr,
    /// Receiver.
    pub dst: SocketAddr,
    /// "roce", "iwarp" or "tcp".
    pub transport: &'static str,
    /// The message type as the IBTA / RFC names it (REQ, …, MPA_REQ, MPA_REP, FPDU kinds), or
    /// "MALFORMED" / "BAD_ICRC" / "BAD_CRC".
    #[serde(rename = "type")]
    pub kind: String,
    /// Short `key=value` summary of the important fields, in display order.
    #[serde(serialize_with = "ordered_map")]
    pub summary: Vec<(String, String)>,
    /// CRC verdict: "ok", "bad", or "off" (MPA CRC not negotiated).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub crc: Option<&'static str>,
    /// What was wrong, for corrupt packets.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Every field of the message, for `--verbose` and `--json`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<serde_json::Value>,
}

impl Record {
    /// Whether the record reports a corrupt packet.
    pub fn is_error(&self) -> bool {
        self.error.is_some()
    }

    /// The one-line text form.
    pub fn line(&self) -> String {
        let mut s = format!(
            "{:>5} {:>11.6} {} > {} {}",
            self.frame, self.time, self.src, self.dst, self.kind
        );
        for (k, v) in &self.summary {
            let _ = write!(s, " {k}={v}");
        }
        if let Some(c) = self.crc {
            let _ = write!(s, " crc={c}");
        }
        if let Some(e) = &self.error {
            let _ = write!(s, " error=\"{e}\"");
        }
        s
    }
}

fn ordered_map<S: serde::Serializer>(v: &[(String, String)], s: S) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let mut m = s.serialize_map(Some(v.len()))?;
    for (k, val) in v {
        m.serialize_entry(k, val)?;
    }
    m.end()
}

/// Totals over a capture.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Totals {
    /// Frames read.
    pub frames: usize,
    /// Records printed.
    pub records: usize,
    /// Records that report a corrupt or undecodable packet.
    pub errors: usize,
    /// Frames neither RoCEv2 nor TCP, skipped.
    pub skipped: usize,
}

/// Decodes a whole capture.
pub fn decode(cap: &Capture) -> (Vec<Record>, Totals) {
    let mut out = Vec::new();
    let mut totals = Totals {
        frames: cap.packets.len(),
        ..Totals::default()
    };
    let mut iwarp = IwarpDecoder::default();
    let t0 = cap.first_ts().unwrap_or_default();
    for pkt in &cap.packets {
        let time = pkt.ts.saturating_sub(t0).as_secs_f64();
        match &pkt.net {
            Err(FrameError::NotIp { .. } | FrameError::UnsupportedFamily(_)) => totals.skipped += 1,
            Err(e) => out.push(malformed(pkt.index, time, &e.to_string())),
            Ok(net) => match &net.transport {
                Transport::Udp {
                    src_port, dst_port, ..
                } if *dst_port == ROCE_V2_UDP_PORT || *src_port == ROCE_V2_UDP_PORT => {
                    decode_roce(pkt, time, &mut out);
                }
                Transport::Tcp { .. } => iwarp.push(pkt, time, &mut out),
                _ => totals.skipped += 1,
            },
        }
    }
    iwarp.finish(&mut out);
    out.sort_by_key(|r| r.frame);
    totals.records = out.len();
    totals.errors = out.iter().filter(|r| r.is_error()).count();
    (out, totals)
}

fn unspecified() -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], 0))
}

fn malformed(frame: usize, time: f64, why: &str) -> Record {
    Record {
        frame,
        time,
        src: unspecified(),
        dst: unspecified(),
        transport: "?",
        kind: "MALFORMED".into(),
        summary: Vec::new(),
        crc: None,
        error: Some(why.to_owned()),
        detail: None,
    }
}

fn hex32(v: u32) -> String {
    format!("{v:#010x}")
}

fn hex24(v: u32) -> String {
    format!("{v:#08x}")
}

/// Bytes up to the last non-zero one: the wire carries no private-data length, so this is
/// what a reader can tell of it.
fn used_len(pd: &[u8]) -> usize {
    pd.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1)
}

fn kv(k: &str, v: impl std::fmt::Display) -> (String, String) {
    (k.to_owned(), v.to_string())
}

/// Decodes a RoCEv2 frame: one datagram, or a run of GSI datagrams sent as one segmented
/// send (`UDP_SEGMENT`) and captured before the kernel cut it, as a capture on the sending
/// host shows one. A run is told by its ICRCs: the whole carries none that verifies, and
/// every 280-byte piece verifies for the IP header the kernel gives it (IPv4 ID counted on
/// from the run's, lengths its own). Each piece is then a record of the frame.
fn decode_roce(pkt: &CapturedPacket, time: f64, out: &mut Vec<Record>) {
    let Ok(net) = &pkt.net else {
        out.push(malformed(pkt.index, time, "no IP"));
        return;
    };
    let Transport::Udp {
        header, payload, ..
    } = &net.transport
    else {
        out.push(malformed(pkt.index, time, "not UDP"));
        return;
    };
    let whole = decode_datagram(pkt.index, time, net, &net.ip.header, *header, payload);
    if whole.crc == Some("ok") {
        out.push(whole);
        return;
    }
    let Ok(run) = roce::split_gsi_run(&net.ip.header, header, payload) else {
        out.push(whole);
        return;
    };
    let n = run.len();
    let mut pieces = Vec::with_capacity(n);
    for (k, (ip, udp, piece)) in run.into_iter().enumerate() {
        let mut r = decode_datagram(pkt.index, time, net, &ip, udp, piece);
        if r.crc != Some("ok") {
            out.push(whole);
            return;
        }
        r.summary.push(kv("segment", format!("{}/{n}", k + 1)));
        pieces.push(r);
    }
    out.extend(pieces);
}

/// One RoCEv2 datagram with the IP and UDP headers it travelled under.
fn decode_datagram(
    frame: usize,
    time: f64,
    net: &crate::capture::NetPacket,
    ip_header: &[u8],
    header: [u8; 8],
    payload: &[u8],
) -> Record {
    let mut rec = Record {
        frame,
        time,
        src: net.src(),
        dst: net.dst(),
        transport: "roce",
        kind: String::new(),
        summary: Vec::new(),
        crc: None,
        error: None,
        detail: None,
    };
    let mut udp = Vec::with_capacity(8 + payload.len());
    udp.extend_from_slice(&header);
    udp.extend_from_slice(payload);
    let icrc = roce::verify_icrc(ip_header, &udp);
    rec.crc = Some(if icrc.is_ok() { "ok" } else { "bad" });
    let p = match RocePacket::parse(payload) {
        Ok(p) => p,
        Err(e) => {
            rec.kind = "MALFORMED".into();
            rec.error = Some(e.to_string());
            return rec;
        }
    };
    if p.bth.dest_qp == roce::GSI_QPN && p.bth.opcode == roce::Opcode::UD_SEND_ONLY {
        match GsiDatagram::parse(payload).and_then(|g| CmMad::parse(g.mad)) {
            Ok(mad) => {
                rec.kind = mad.msg.name().to_owned();
                rec.summary = cm_summary(&mad);
                rec.detail = serde_json::to_value(&mad).ok();
            }
            Err(e) => {
                rec.kind = "MALFORMED".into();
                rec.error = Some(format!("GSI MAD: {e}"));
            }
        }
    } else {
        rec.kind = p.bth.opcode.name().replace(' ', "_");
        rec.summary = vec![kv("qp", hex24(p.bth.dest_qp)), kv("psn", p.bth.psn)];
        if let Some(d) = p.deth {
            rec.summary.push(kv("src_qp", hex24(d.src_qp)));
            rec.summary.push(kv("qkey", hex32(d.qkey)));
        }
        if let Some(pl) = p.payload {
            rec.summary.push(kv("len", pl.len()));
        }
        rec.detail = serde_json::to_value((&p.bth, &p.deth)).ok();
    }
    if let Err(e) = icrc {
        rec.error = Some(e.to_string());
    }
    rec
}

fn cma_summary(s: &mut Vec<(String, String)>, sid: u64, pd: &[u8]) {
    if let Some((ps, port)) = cma::parse_service_id(sid) {
        s.push(kv("ps", ps.name()));
        s.push(kv("port", port));
        match CmaHdr::parse(pd) {
            Ok(h) => {
                s.push(kv("cma", format!("{}:{}>{}", h.src, h.src_port, h.dst)));
                s.push(kv(
                    "pd",
                    used_len(pd.get(CMA_HDR_LEN..).unwrap_or_default()),
                ));
            }
            Err(e) => s.push(kv("cma", format!("invalid({e})"))),
        }
    } else {
        s.push(kv("sid", format!("{sid:#018x}")));
        s.push(kv("pd", used_len(pd)));
    }
}

fn cm_summary(mad: &CmMad) -> Vec<(String, String)> {
    let mut s = Vec::new();
    let (l, r) = mad.msg.comm_ids();
    match &mad.msg {
        CmMessage::SidrReq(_) | CmMessage::SidrRep(_) => {
            s.push(kv("req_id", hex32(l.unwrap_or_default())));
        }
        _ => {
            if let Some(l) = l {
                s.push(kv("lcid", hex32(l)));
            }
            if let Some(r) = r {
                s.push(kv("rcid", hex32(r)));
            }
        }
    }
    match &mad.msg {
        CmMessage::Req(m) => {
            s.push(kv("qpn", hex24(m.local_qpn)));
            s.push(kv("psn", hex24(m.starting_psn)));
            cma_summary(&mut s, m.service_id, &m.private_data);
            s.push(kv(
                "flow_label",
                format!("{:#07x}", m.primary_path.flow_label),
            ));
        }
        CmMessage::Mra(m) => {
            s.push(kv("mraed", format!("{:?}", m.message_mraed)));
            s.push(kv("service_timeout", m.service_timeout));
        }
        CmMessage::Rej(m) => {
            s.push(kv("reason", format!("{}({:?})", m.reason.raw(), m.reason)));
            s.push(kv("rejected", format!("{:?}", m.message_rejected)));
            s.push(kv("ari_len", m.reject_info_length));
            s.push(kv("pd", used_len(&m.private_data)));
        }
        CmMessage::Rep(m) => {
            s.push(kv("qpn", hex24(m.local_qpn)));
            s.push(kv("psn", hex24(m.starting_psn)));
            s.push(kv("pd", used_len(&m.private_data)));
        }
        CmMessage::Rtu(m) => s.push(kv("pd", used_len(&m.private_data))),
        CmMessage::Dreq(m) => {
            s.push(kv("remote_qpn", hex24(m.remote_qpn)));
            s.push(kv("pd", used_len(&m.private_data)));
        }
        CmMessage::Drep(m) => s.push(kv("pd", used_len(&m.private_data))),
        CmMessage::SidrReq(m) => cma_summary(&mut s, m.service_id, &m.private_data),
        CmMessage::SidrRep(m) => {
            s.push(kv("status", format!("{}({:?})", m.status.raw(), m.status)));
            s.push(kv("qpn", hex24(m.qpn)));
            s.push(kv("qkey", hex32(m.qkey)));
            s.push(kv("pd", used_len(&m.private_data)));
        }
        CmMessage::Lap(m) => s.push(kv("remote_qpn", hex24(m.remote_qpn))),
        CmMessage::Apr(m) => s.push(kv(
            "status",
            format!("{}({:?})", m.ap_status.raw(), m.ap_status),
        )),
        CmMessage::ClassPortInfo(_) => {
            s.push(kv("method", format!("{:#04x}", mad.header.method)));
            s.push(kv("status", format!("{:#06x}", mad.header.status)));
        }
    }
    s.push(kv("tid", format!("{:#018x}", mad.header.tid)));
    s
}

/// What one direction of a TCP connection is expected to carry next.
#[derive(Debug, Default)]
enum Phase {
    /// Waiting for the MPA Request or Reply.
    #[default]
    Frame,
    /// FPDUs.
    Fpdus,
    /// Not (or no longer) decodable; the reason was reported.
    Dead,
    /// Not MPA at all (plain TCP: the stream did not start with "MPA "); skipped.
    NotMpa,
}

#[derive(Debug, Default)]
struct Direction {
    buf: Vec<u8>,
    /// Frame and time of the segment that delivered the first byte still in `buf`.
    at: Option<(usize, f64)>,
    phase: Phase,
    frame: Option<MpaFrame>,
}

/// Reassembles TCP streams and decodes MPA on them.
#[derive(Default)]
struct IwarpDecoder {
    streams: TcpStreams,
    dirs: HashMap<FlowKey, Direction>,
    times: HashMap<usize, f64>,
}

impl IwarpDecoder {
    fn push(&mut self, pkt: &CapturedPacket, time: f64, out: &mut Vec<Record>) {
        self.times.insert(pkt.index, time);
        let events = self.streams.push_packet(pkt);
        self.handle(events, out);
    }

    fn finish(&mut self, out: &mut Vec<Record>) {
        let events = self.streams.finish();
        self.handle(events, out);
        // What is left undecoded at the end (a frame cut by the end of the capture, FPDUs
        // whose peer's MPA frame never came) is said, not dropped silently.
        let mut left: Vec<(FlowKey, usize, f64, usize)> = self
            .dirs
            .iter()
            .filter(|(_, d)| !d.buf.is_empty() && matches!(d.phase, Phase::Frame | Phase::Fpdus))
            .map(|(f, d)| {
                let (i, t) = d.at.unwrap_or((0, 0.0));
                (*f, i, t, d.buf.len())
            })
            .collect();
        left.sort_by_key(|l| l.1);
        for (flow, index, time, len) in left {
            let mut r = self.tcp_record(flow, index, "MALFORMED");
            r.time = time;
            r.error = Some(format!(
                "{len} bytes at the end of the stream were not a whole MPA frame or FPDU"
            ));
            out.push(r);
        }
    }

    fn time_of(&self, index: usize) -> f64 {
        self.times.get(&index).copied().unwrap_or_default()
    }

    fn tcp_record(&self, flow: FlowKey, index: usize, kind: &str) -> Record {
        Record {
            frame: index,
            time: self.time_of(index),
            src: flow.src,
            dst: flow.dst,
            transport: "tcp",
            kind: kind.to_owned(),
            summary: Vec::new(),
            crc: None,
            error: None,
            detail: None,
        }
    }

    fn handle(&mut self, events: Vec<StreamEvent>, out: &mut Vec<Record>) {
        for ev in events {
            match ev {
                StreamEvent::Syn {
                    flow,
                    index,
                    with_ack,
                    ..
                } => {
                    // A new connection on this address pair (ports are reused): its MPA
                    // starts again, whatever the last one's stream was left in.
                    self.dirs.remove(&flow);
                    out.push(self.tcp_record(
                        flow,
                        index,
                        if with_ack { "TCP_SYN_ACK" } else { "TCP_SYN" },
                    ));
                }
                StreamEvent::Fin { flow, index, .. } => {
                    out.push(self.tcp_record(flow, index, "TCP_FIN"));
                }
                StreamEvent::Reset { flow, index, .. } => {
                    out.push(self.tcp_record(flow, index, "TCP_RST"));
                }
                StreamEvent::Gap {
                    flow, index, len, ..
                } => {
                    if self
                        .dirs
                        .get(&flow)
                        .is_some_and(|d| matches!(d.phase, Phase::NotMpa))
                    {
                        continue;
                    }
                    let mut r = self.tcp_record(flow, index, "MALFORMED");
                    r.error = Some(format!(
                        "{len} bytes missing from the capture; stream no longer decoded"
                    ));
                    out.push(r);
                    self.dirs.entry(flow).or_default().phase = Phase::Dead;
                }
                StreamEvent::Data(chunk) => {
                    let time = self.time_of(chunk.index);
                    let d = self.dirs.entry(chunk.flow).or_default();
                    if matches!(d.phase, Phase::Dead | Phase::NotMpa) {
                        continue;
                    }
                    if d.buf.is_empty() {
                        d.at = Some((chunk.index, time));
                    }
                    d.buf.extend_from_slice(&chunk.data);
                    self.drain(chunk.flow, chunk.index, time, out);
                    // The peer's FPDUs may have waited for this direction's MPA frame (a P2P
                    // RTR captured before the Reply): try them now.
                    let back = chunk.flow.reverse();
                    if let Some((i, t)) = self
                        .dirs
                        .get(&back)
                        .filter(|d| matches!(d.phase, Phase::Fpdus) && !d.buf.is_empty())
                        .and_then(|d| d.at)
                    {
                        self.drain(back, i, t, out);
                    }
                }
            }
        }
    }

    /// Decodes whatever complete frames `flow` now holds.
    fn drain(&mut self, flow: FlowKey, index: usize, time: f64, out: &mut Vec<Record>) {
        loop {
            let peer_frame = self.dirs.get(&flow.reverse()).and_then(|d| d.frame.clone());
            let Some(d) = self.dirs.get_mut(&flow) else {
                return;
            };
            let (first_index, first_time) = d.at.unwrap_or((index, time));
            let mut rec = Record {
                frame: first_index,
                time: first_time,
                src: flow.src,
                dst: flow.dst,
                transport: "iwarp",
                kind: String::new(),
                summary: Vec::new(),
                crc: None,
                error: None,
                detail: None,
            };
            let used = match d.phase {
                Phase::Dead | Phase::NotMpa => return,
                // Both keys start "MPA ": a stream that does not is some other TCP traffic,
                // said once and skipped; one that does but goes wrong after is corrupt MPA.
                Phase::Frame if !starts_like_mpa(&d.buf) => {
                    rec.transport = "tcp";
                    rec.kind = "TCP_DATA".into();
                    rec.summary
                        .push(kv("note", "not MPA (no MPA key): not decoded"));
                    d.phase = Phase::NotMpa;
                    d.buf = Vec::new();
                    out.push(rec);
                    return;
                }
                Phase::Frame => match MpaFrame::parse(&d.buf) {
                    Ok((f, used)) => {
                        rec.kind = match f.kind {
                            FrameKind::Request => "MPA_REQ",
                            FrameKind::Reply => "MPA_REP",
                        }
                        .to_owned();
                        rec.summary = mpa_summary(&f);
                        rec.detail = serde_json::to_value(&f).ok();
                        if let Err(e) = f.check_linux_limits() {
                            rec.summary
                                .push(kv("note", format!("beyond Linux limits: {e}")));
                        }
                        // R ends the stream in a Reply only: in a Request it means
                        // nothing (RFC 5044 §7.1; siw ignores it there).
                        d.phase = if f.kind == FrameKind::Reply && f.flags.reject {
                            Phase::Dead
                        } else {
                            Phase::Fpdus
                        };
                        d.frame = Some(f);
                        used
                    }
                    Err(WireError::Truncated { .. }) => return,
                    Err(e) => {
                        let Some((kind, len)) = short_enhanced(&d.buf) else {
                            rec.kind = "MALFORMED".into();
                            rec.error = Some(format!("not an MPA frame: {e}"));
                            d.phase = Phase::Dead;
                            out.push(rec);
                            return;
                        };
                        if d.buf.len() < len {
                            return;
                        }
                        rec.kind = match kind {
                            FrameKind::Request => "MPA_REQ",
                            FrameKind::Reply => "MPA_REP",
                        }
                        .to_owned();
                        let flags = mpa::MpaFlags::from_byte(d.buf[16]);
                        rec.summary = vec![
                            kv("rev", mpa::REVISION_2),
                            kv("flags", flag_names(flags)),
                            kv(
                                "note",
                                match kind {
                                    // siw_proc_mpareq rejects it with its own header.
                                    FrameKind::Request => {
                                        "enhanced without its IRD/ORD words: Linux rejects it"
                                    }
                                    FrameKind::Reply => {
                                        "enhanced reject without IRD/ORD words, as siw \
                                         answers a Request that lacks them"
                                    }
                                },
                            ),
                        ];
                        // Either way nothing follows on this stream.
                        d.phase = Phase::Dead;
                        len
                    }
                },
                Phase::Fpdus => {
                    let (Some(mine), Some(peer)) = (d.frame.as_ref(), peer_frame.as_ref()) else {
                        // FPDUs before the peer's frame (the P2P RTR can be that early): wait.
                        if d.buf.len() > 1 << 20 {
                            // Said, not dropped silently (a capture of one direction only).
                            rec.kind = "MALFORMED".into();
                            rec.error = Some(format!(
                                "{} bytes of FPDUs without the peer's MPA frame (is the other \
                                 direction in the capture?); stream no longer decoded",
                                d.buf.len()
                            ));
                            d.phase = Phase::Dead;
                            d.buf = Vec::new();
                            out.push(rec);
                        }
                        return;
                    };
                    if mine.flags.markers || peer.flags.markers {
                        rec.kind = "MALFORMED".into();
                        rec.error = Some("MPA markers negotiated; not decoded".into());
                        d.phase = Phase::Dead;
                        out.push(rec);
                        return;
                    }
                    let crc_on = mpa::crc_negotiated(mine, peer);
                    match mpa::Fpdu::parse(&d.buf) {
                        Ok((fpdu, used)) => {
                            rec.crc = Some(if !crc_on {
                                "off"
                            } else if fpdu.verify_crc().is_ok() {
                                "ok"
                            } else {
                                "bad"
                            });
                            if crc_on {
                                if let Err(e) = fpdu.verify_crc() {
                                    rec.error = Some(e.to_string());
                                }
                            }
                            describe_fpdu(fpdu.ulpdu, &mut rec);
                            used
                        }
                        Err(WireError::Truncated { .. }) => return,
                        Err(e) => {
                            rec.kind = "MALFORMED".into();
                            rec.error = Some(e.to_string());
                            d.phase = Phase::Dead;
                            out.push(rec);
                            return;
                        }
                    }
                }
            };
            d.buf.drain(..used);
            d.at = if d.buf.is_empty() {
                None
            } else {
                Some((index, time))
            };
            out.push(rec);
        }
    }
}

/// Whether a TCP stream's first bytes could be an MPA Request or Reply ("MPA ID Re…").
fn starts_like_mpa(buf: &[u8]) -> bool {
    const COMMON: &[u8] = b"MPA ";
    let n = buf.len().min(COMMON.len());
    buf[..n] == COMMON[..n]
}

/// An MPA revision-2 frame with the Enhanced flag and fewer private-data bytes than its
/// IRD/ORD words take (which `MpaFrame::parse` refuses): siw's reject Reply to such a
/// Request has exactly that shape. Its kind and whole length.
fn short_enhanced(b: &[u8]) -> Option<(FrameKind, usize)> {
    let h = b.first_chunk::<{ mpa::MPA_FRAME_HEADER_LEN }>()?;
    let kind = [FrameKind::Request, FrameKind::Reply]
        .into_iter()
        .find(|k| h[..16] == *k.key())?;
    let pd_len = usize::from(u16::from_be_bytes([h[18], h[19]]));
    let short = h[17] == mpa::REVISION_2
        && mpa::MpaFlags::from_byte(h[16]).enhanced
        && pd_len < mpa::ENHANCED_LEN;
    short.then_some((kind, mpa::MPA_FRAME_HEADER_LEN + pd_len))
}

/// The flags set, as letters (`-` for none).
fn flag_names(f: mpa::MpaFlags) -> String {
    let mut flags = String::new();
    for (on, name) in [
        (f.markers, 'M'),
        (f.crc, 'C'),
        (f.reject, 'R'),
        (f.enhanced, 'E'),
        (f.gso_exp, 'G'),
    ] {
        if on {
            flags.push(name);
        }
    }
    if flags.is_empty() {
        flags.push('-');
    }
    flags
}

fn mpa_summary(f: &MpaFrame) -> Vec<(String, String)> {
    let mut s = vec![kv("rev", f.revision)];
    s.push(kv("flags", flag_names(f.flags)));
    if let Some(e) = &f.enhanced {
        s.push(kv("ird", e.ird));
        s.push(kv("ord", e.ord));
        if e.peer_to_peer {
            let mut rtr = Vec::new();
            for (on, name) in [
                (e.zero_len_send_rtr, "send"),
                (e.zero_len_write_rtr, "write"),
                (e.zero_len_read_rtr, "read"),
            ] {
                if on {
                    rtr.push(name);
                }
            }
            s.push(kv("p2p", rtr.join("|")));
        }
    }
    s.push(kv("pd", f.private_data.len()));
    s
}

fn describe_fpdu(ulpdu: &[u8], rec: &mut Record) {
    match DdpRdmapHeader::parse(ulpdu) {
        Ok((h, hl)) => {
            let payload = ulpdu.get(hl..).unwrap_or_default();
            rec.kind = format!("FPDU_{}", opcode_name(h.opcode));
            match h.buffer {
                DdpBuffer::Untagged { qn, msn, mo, .. } => {
                    rec.summary.push(kv("qn", qn));
                    rec.summary.push(kv("msn", msn));
                    rec.summary.push(kv("mo", mo));
                }
                DdpBuffer::Tagged {
                    stag,
                    tagged_offset,
                } => {
                    rec.summary.push(kv("stag", hex32(stag)));
                    rec.summary.push(kv("to", tagged_offset));
                }
            }
            rec.summary.push(kv("last", u8::from(h.last)));
            rec.summary.push(kv("len", payload.len()));
            if h.opcode == RdmapOpcode::Terminate {
                match Terminate::parse(payload) {
                    Ok(t) => {
                        rec.summary.push(kv("layer", t.layer));
                        rec.summary.push(kv("etype", t.error_type));
                        rec.summary
                            .push(kv("ecode", format!("{:#04x}", t.error_code)));
                        rec.detail = serde_json::to_value((&h, &t)).ok();
                    }
                    Err(e) => rec.error = Some(format!("Terminate: {e}")),
                }
            } else {
                rec.detail = serde_json::to_value(h).ok();
            }
        }
        Err(e) => {
            rec.kind = "MALFORMED".into();
            rec.error = Some(format!("DDP/RDMAP: {e}"));
        }
    }
}

fn opcode_name(op: RdmapOpcode) -> String {
    match op {
        RdmapOpcode::RdmaWrite => "RDMA_WRITE".into(),
        RdmapOpcode::RdmaReadRequest => "RDMA_READ_REQ".into(),
        RdmapOpcode::RdmaReadResponse => "RDMA_READ_RESP".into(),
        RdmapOpcode::Send => "SEND".into(),
        RdmapOpcode::SendInvalidate => "SEND_INV".into(),
        RdmapOpcode::SendSe => "SEND_SE".into(),
        RdmapOpcode::SendSeInvalidate => "SEND_SE_INV".into(),
        RdmapOpcode::Terminate => "TERMINATE".into(),
        RdmapOpcode::Other(n) => format!("OP{n}"),
    }
}

/// `key = value` lines for every field of a record's detail, for `--verbose`.
pub fn verbose_lines(detail: &serde_json::Value) -> Vec<String> {
    fn walk(prefix: &str, v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    let p = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    walk(&p, v, out);
                }
            }
            serde_json::Value::Array(a) if a.iter().all(serde_json::Value::is_u64) => {
                let bytes = a.iter().filter_map(serde_json::Value::as_u64).fold(
                    String::new(),
                    |mut acc, b| {
                        let _ = write!(acc, "{b:02x}");
                        acc
                    },
                );
                out.push(format!(
                    "{prefix} = {}",
                    if bytes.is_empty() {
                        "(empty)".into()
                    } else {
                        bytes
                    }
                ));
            }
            serde_json::Value::Array(a) => {
                for (i, v) in a.iter().enumerate() {
                    walk(&format!("{prefix}[{i}]"), v, out);
                }
            }
            serde_json::Value::Number(n) => match n.as_u64() {
                Some(u) if u > 9 => out.push(format!("{prefix} = {u} ({u:#x})")),
                _ => out.push(format!("{prefix} = {n}")),
            },
            other => out.push(format!("{prefix} = {other}")),
        }
    }
    let mut out = Vec::new();
    walk("", detail, &mut out);
    out
}

/// Reads and decodes a capture file.
pub fn decode_file(
    path: &std::path::Path,
) -> Result<(Vec<Record>, Totals, Option<String>), capture::CaptureError> {
    let cap = capture::read_pcap(path)?;
    let (recs, totals) = decode(&cap);
    Ok((recs, totals, cap.warning.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcm_wire::cm::Rtu;
    use rcm_wire::roce::{emit_gsi, emit_ud, Bth, Deth, IpForIcrc, Opcode};
    use std::net::{Ipv4Addr, Ipv6Addr};

    /// A classic pcap (raw IP link type) holding `packets`.
    fn pcap(packets: &[Vec<u8>]) -> Vec<u8> {
        let mut f = 0xa1b2_c3d4u32.to_le_bytes().to_vec();
        f.extend_from_slice(&2u16.to_le_bytes());
        f.extend_from_slice(&4u16.to_le_bytes());
        for w in [0u32, 0, 65535, 101] {
            f.extend_from_slice(&w.to_le_bytes());
        }
        for (k, p) in packets.iter().enumerate() {
            for w in [k as u32, 0, p.len() as u32, p.len() as u32] {
                f.extend_from_slice(&w.to_le_bytes());
            }
            f.extend_from_slice(p);
        }
        f
    }

    fn rtu_mad(k: u32) -> [u8; 256] {
        CmMad::send(
            0x100 + u64::from(k),
            CmMessage::Rtu(Rtu {
                local_comm_id: 0x1000 + k,
                remote_comm_id: 0x2000 + k,
                ..Rtu::default()
            }),
        )
        .emit()
        .expect("an RTU")
    }

    /// An IP packet from port 4791 to 4791 carrying `payload` (one UDP datagram or a run).
    fn ip_packet(v6: bool, ident: u16, payload: &[u8]) -> Vec<u8> {
        let udp_len = (8 + payload.len()) as u16;
        let mut p = if v6 {
            let mut h = vec![0x60, 0, 0, 0];
            h.extend_from_slice(&udp_len.to_be_bytes());
            h.extend_from_slice(&[17, 64]);
            h.extend_from_slice(&Ipv6Addr::LOCALHOST.octets());
            h.extend_from_slice(&Ipv6Addr::LOCALHOST.octets());
            h
        } else {
            let mut h = vec![0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, 17, 0, 0];
            h[2..4].copy_from_slice(&(20 + udp_len).to_be_bytes());
            h[4..6].copy_from_slice(&ident.to_be_bytes());
            h.extend_from_slice(&[127, 0, 0, 2, 127, 0, 0, 1]);
            h
        };
        p.extend_from_slice(&ROCE_V2_UDP_PORT.to_be_bytes());
        p.extend_from_slice(&ROCE_V2_UDP_PORT.to_be_bytes());
        p.extend_from_slice(&udp_len.to_be_bytes());
        p.extend_from_slice(&[0, 0]);
        p.extend_from_slice(payload);
        p
    }

    /// A run of three RTUs as one segmented send leaves its socket: datagram `k`'s ICRC
    /// computed for IPv4 ID `k` (IPv6 has no ID).
    fn run(v6: bool) -> Vec<u8> {
        let mut payload = Vec::new();
        for k in 0..3u16 {
            let ip = if v6 {
                IpForIcrc::V6 {
                    src: Ipv6Addr::LOCALHOST,
                    dst: Ipv6Addr::LOCALHOST,
                }
            } else {
                IpForIcrc::V4 {
                    src: Ipv4Addr::new(127, 0, 0, 2),
                    dst: Ipv4Addr::LOCALHOST,
                    ident: k,
                    dont_fragment: true,
                }
            };
            payload.extend(emit_gsi(&ip, ROCE_V2_UDP_PORT, 7, &rtu_mad(u32::from(k))));
        }
        ip_packet(v6, 0, &payload)
    }

    /// Plain TCP in a capture (the bench's TCP baseline, an HTTP request) is not iWARP: its
    /// connections are listed, its data said once per direction and skipped, and nothing is
    /// corrupt; an MPA stream beside it still decodes, and one that starts "MPA " but goes
    /// wrong is still corrupt.
    #[test]
    fn plain_tcp_is_skipped_not_reported_corrupt() {
        use crate::netbuild::TcpFlowBuilder;
        let mut plain = TcpFlowBuilder::new(
            "127.0.0.2:40000".parse().unwrap(),
            "127.0.0.1:80".parse().unwrap(),
        );
        plain
            .handshake()
            .client_send(b"GET / HTTP/1.1\r\n\r\n")
            .server_send(b"HTTP/1.1 200 OK\r\n\r\n")
            .client_send(b"more of the same connection")
            .close();
        let mut broken = TcpFlowBuilder::new(
            "127.0.0.2:40001".parse().unwrap(),
            "127.0.0.1:7471".parse().unwrap(),
        );
        broken
            .handshake()
            .client_send(b"MPA ID Rxq Frame and then some bytes")
            .close();
        for (flow, corrupt) in [(&plain, 0), (&broken, 1)] {
            let cap = crate::capture::read_pcap_bytes(&flow.to_pcap().unwrap()).unwrap();
            let (recs, totals) = decode(&cap);
            assert_eq!(totals.errors, corrupt, "{recs:#?}");
            let data: Vec<_> = recs.iter().filter(|r| r.kind == "TCP_DATA").collect();
            if corrupt == 0 {
                assert_eq!(data.len(), 2, "one per direction: {recs:#?}");
                assert!(data.iter().all(|r| !r.is_error()));
                assert!(recs.iter().any(|r| r.kind == "TCP_SYN"));
            } else {
                assert!(data.is_empty(), "{recs:#?}");
                assert!(recs.iter().any(|r| r.kind == "MALFORMED"), "{recs:#?}");
            }
        }
    }

    /// A capture of one direction only: the initiator's Request and then more than 1 MiB of
    /// FPDUs that cannot be decoded without the peer's Reply. They are reported (they were
    /// dropped without a word past 1 MiB, and the capture decoded "clean").
    #[test]
    fn fpdus_without_the_peers_frame_are_reported_not_dropped() {
        use crate::netbuild::TcpFlowBuilder;
        let mut b = TcpFlowBuilder::new(
            "127.0.0.2:40002".parse().unwrap(),
            "127.0.0.1:7471".parse().unwrap(),
        );
        let req = rcm_wire::mpa::MpaFrame::request_v2(1, 1, b"x".to_vec())
            .to_vec()
            .unwrap();
        b.handshake()
            .client_send(&req)
            .client_send(&vec![0u8; (1 << 20) + 4096]);
        let cap = crate::capture::read_pcap_bytes(&b.to_pcap().unwrap()).unwrap();
        let (recs, totals) = decode(&cap);
        assert_eq!(
            totals.errors,
            1,
            "{:?}",
            recs.iter().map(Record::line).collect::<Vec<_>>()
        );
        let bad = recs.iter().find(|r| r.is_error()).unwrap();
        assert!(
            bad.error
                .as_deref()
                .unwrap_or("")
                .contains("without the peer's MPA frame"),
            "{}",
            bad.line()
        );
    }

    /// R in a Request means nothing (RFC 5044 §7.1): the initiator's stream goes on being
    /// decoded. It was taken for a reject and the rest of that direction skipped unsaid:
    /// here 1 MiB of FPDUs without the peer's frame, which must be reported.
    #[test]
    fn the_reject_flag_in_a_request_does_not_end_its_stream() {
        use crate::netbuild::TcpFlowBuilder;
        let mut b = TcpFlowBuilder::new(
            "127.0.0.2:40003".parse().unwrap(),
            "127.0.0.1:7471".parse().unwrap(),
        );
        let mut req = rcm_wire::mpa::MpaFrame::request_v2(1, 1, b"x".to_vec())
            .to_vec()
            .unwrap();
        req[16] |= 0x20;
        b.handshake()
            .client_send(&req)
            .client_send(&vec![0u8; (1 << 20) + 4096]);
        let cap = crate::capture::read_pcap_bytes(&b.to_pcap().unwrap()).unwrap();
        let (recs, totals) = decode(&cap);
        let lines: Vec<_> = recs.iter().map(Record::line).collect();
        assert!(recs.iter().any(|r| r.kind == "MPA_REQ"), "{lines:?}");
        assert_eq!(totals.errors, 1, "the FPDUs are reported: {lines:?}");
    }

    /// siw answers an enhanced Request without IRD/ORD words with its own header: Reply
    /// key, R and E set, revision 2, no private data. That is a reject Reply, not garbage.
    #[test]
    fn a_short_enhanced_reject_reply_is_a_reply_not_malformed() {
        use crate::netbuild::TcpFlowBuilder;
        let mut b = TcpFlowBuilder::new(
            "127.0.0.2:40004".parse().unwrap(),
            "127.0.0.1:7471".parse().unwrap(),
        );
        let mut req = rcm_wire::mpa::REQ_KEY.to_vec();
        req.extend_from_slice(&[0x10, 2, 0, 0]);
        let mut rep = rcm_wire::mpa::REP_KEY.to_vec();
        rep.extend_from_slice(&[0x30, 2, 0, 0]);
        b.handshake().client_send(&req).server_send(&rep);
        let cap = crate::capture::read_pcap_bytes(&b.to_pcap().unwrap()).unwrap();
        let (recs, totals) = decode(&cap);
        let lines: Vec<_> = recs.iter().map(Record::line).collect();
        assert_eq!(totals.errors, 0, "{lines:?}");
        let rep = recs
            .iter()
            .find(|r| r.kind == "MPA_REP")
            .expect("the Reply");
        assert!(
            rep.summary.iter().any(|(k, v)| k == "flags" && v == "RE"),
            "{lines:?}"
        );
        assert!(recs.iter().any(|r| r.kind == "MPA_REQ"), "{lines:?}");
    }

    fn decoded(packets: &[Vec<u8>]) -> (Vec<Record>, Totals) {
        let cap = crate::capture::read_pcap_bytes(&pcap(packets)).expect("a capture");
        decode(&cap)
    }

    #[test]
    fn a_run_of_datagrams_in_one_frame_is_each_of_them_for_both_families() {
        for v6 in [false, true] {
            let (recs, totals) = decoded(&[run(v6)]);
            assert_eq!(totals.errors, 0, "v6={v6}: {:?}", recs[0].error);
            assert_eq!(recs.len(), 3, "v6={v6}");
            for (k, r) in recs.iter().enumerate() {
                assert_eq!(r.kind, "RTU", "v6={v6}");
                assert_eq!(r.crc, Some("ok"), "v6={v6}");
                assert!(
                    r.summary.contains(&kv("segment", format!("{}/3", k + 1))),
                    "v6={v6}: {:?}",
                    r.summary
                );
                assert!(
                    r.summary.contains(&kv("lcid", hex32(0x1000 + k as u32))),
                    "v6={v6}: {:?}",
                    r.summary
                );
            }
        }
    }

    /// IPv4: a run whose datagrams all carry the ICRC for ID 0 (not what the kernel sends
    /// after cutting it) is one corrupt frame.
    #[test]
    fn a_run_whose_icrcs_ignore_the_ids_is_one_corrupt_frame() {
        let ip = IpForIcrc::v4(Ipv4Addr::new(127, 0, 0, 2), Ipv4Addr::LOCALHOST);
        let mut payload = Vec::new();
        for k in 0..3 {
            payload.extend(emit_gsi(&ip, ROCE_V2_UDP_PORT, 7, &rtu_mad(k)));
        }
        let (recs, totals) = decoded(&[ip_packet(false, 0, &payload)]);
        assert_eq!(recs.len(), 1);
        assert_eq!(totals.errors, 1);
        assert_eq!(recs[0].crc, Some("bad"));
    }

    /// A single UD datagram whose length happens to be a multiple of 280 and whose ICRC
    /// verifies whole is one datagram, not cut.
    #[test]
    fn a_whole_datagram_of_a_runs_length_is_not_cut() {
        let ip = IpForIcrc::v4(Ipv4Addr::new(127, 0, 0, 2), Ipv4Addr::LOCALHOST);
        let bth = Bth {
            opcode: Opcode::UD_SEND_ONLY,
            dest_qp: 0x42,
            ..Bth::gsi(1)
        };
        let deth = Deth {
            qkey: 0x1234,
            src_qp: 0x43,
            ..Deth::GSI
        };
        let len = 2 * roce::GSI_UDP_PAYLOAD_LEN - roce::BTH_LEN - roce::DETH_LEN - roce::ICRC_LEN;
        let payload = emit_ud(&ip, ROCE_V2_UDP_PORT, &bth, &deth, &vec![0xAB; len]);
        assert_eq!(payload.len(), 2 * roce::GSI_UDP_PAYLOAD_LEN);
        let (recs, totals) = decoded(&[ip_packet(false, 0, &payload)]);
        assert_eq!(totals.errors, 0, "{:?}", recs[0].error);
        assert_eq!(recs.len(), 1);
        assert_eq!(recs[0].kind, "UD_SEND_ONLY");
    }
}
