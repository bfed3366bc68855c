//! `rcm bench --serial --breakdown`: where a one-at-a-time connect's time goes, hop by hop,
//! from stamps taken in the run itself (`rcm::trace`) on the client's and the server's
//! devices of the embedded run.
//!
//! A connect is the REQ's and the REP's trips through the kernel (each a `sendto` on
//! loopback, as the polling round trip it is compared with) and rcm's work at each end.
//! The segments split it at the moments the stamps mark, so per connection they add up
//! to the time from just before `connect` to the event in hand (its latency, give or take
//! the two clock readings around it); their medians need not add up to the median latency.

use rcm::{trace, Device, Fabric};
use serde::Serialize;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// The segments, in the order the connect goes through them, with both ends in this
/// process (the embedded run).
pub const SEGMENTS: [&str; 8] = [
    "client: connect() until its REQ goes to sendto",
    "REQ: sendto until the server's device has received it",
    "server: its engine takes the REQ",
    "server: CONNECT_REQUEST until accept()",
    "server: accept() until its REP goes to sendto",
    "REP: sendto until the client's device has received it",
    "client: its engine takes the REP",
    "client: until the bench has the event that ends the connect",
];

/// The two segments of [`SEGMENTS`] that are the datagrams' trips; the others are rcm's
/// work (and the bench's, in the last).
pub const TRIPS: [usize; 2] = [1, 5];

/// The segments with the server in another process (`--server`, maybe on another host):
/// the client's, and what lies between its REQ and the REP.
pub const CLIENT_SEGMENTS: [&str; 4] = [
    "client: connect() until its REQ goes to sendto",
    "REQ sendto until the REP is received: the network both ways and the server",
    "client: its engine takes the REP",
    "client: until the bench has the event that ends the connect",
];

/// The segment of [`CLIENT_SEGMENTS`] that is not the client's work.
pub const AWAY: usize = 1;

/// [`Breakdown::ends`] with both ends in this process.
pub const BOTH_ENDS: &str = "both ends";
/// [`Breakdown::ends`] with the server in another process.
pub const CLIENT_END: &str = "client end";

/// One segment's median.
#[derive(Debug, Clone, Serialize)]
pub struct Segment {
    /// What it spans.
    pub segment: &'static str,
    /// Its median over the traced connections, microseconds.
    pub p50_us: f64,
}

/// The breakdown of a run.
#[derive(Debug, Clone, Serialize)]
pub struct Breakdown {
    /// Whose segments: "both ends" (the embedded run, [`SEGMENTS`]) or "client end" (the
    /// server in another process, [`CLIENT_SEGMENTS`]).
    pub ends: &'static str,
    /// Connections whose every stamp was taken, in order (the medians are theirs).
    pub connections: usize,
    /// Connections left out: a stamp missing or out of order (a datagram that was not
    /// theirs came first, say).
    pub left_out: usize,
    /// The segments' medians, in the connect's order.
    pub segments: Vec<Segment>,
}

impl Breakdown {
    /// Whether the server's segments are in (both ends in this process).
    pub fn both_ends(&self) -> bool {
        self.ends == BOTH_ENDS
    }

    /// The segments that are not this process's work: the datagrams' trips, or with the
    /// client end only everything from its REQ to the REP.
    fn away(&self) -> &'static [usize] {
        if self.both_ends() {
            &TRIPS
        } else {
            std::slice::from_ref(&AWAY)
        }
    }

    /// The medians of the segments that are not this process's work, added.
    pub fn away_us(&self) -> f64 {
        self.away()
            .iter()
            .filter_map(|&i| self.segments.get(i))
            .map(|s| s.p50_us)
            .sum()
    }

    /// The medians of the other segments (rcm's work, and the bench's), added.
    pub fn work_us(&self) -> f64 {
        let away = self.away();
        self.segments
            .iter()
            .enumerate()
            .filter(|(i, _)| !away.contains(i))
            .map(|(_, s)| s.p50_us)
            .sum()
    }
}

/// Takes the stamps of each connect of a one-at-a-time run. Turns `rcm::trace` on while
/// it lives.
pub struct Tracer {
    client: Device,
    /// The server's device when it is this process's.
    server: Option<Device>,
    rows: Mutex<Vec<Vec<u64>>>,
    left_out: AtomicU64,
}

impl Tracer {
    /// A tracer of the connects from `client`'s device, a RoCEv2 device of `fabric`, to
    /// `server`, whose device may be of `fabric` too (then both ends are traced); `None` if
    /// the client's device is not (a daemon's) or is iWARP.
    pub fn new(fabric: &Fabric, client: IpAddr, server: IpAddr) -> Option<Tracer> {
        let client = fabric.device(client).filter(|d| !d.is_iwarp())?;
        let server = fabric.device(server).filter(|d| !d.is_iwarp());
        trace::enable(true);
        Some(Tracer {
            client,
            server,
            rows: Mutex::new(Vec::new()),
            left_out: AtomicU64::new(0),
        })
    }

    /// A connect is about to be called.
    pub fn begin(&self) {
        trace::begin();
    }

    /// The connect ended (its event is in hand): its stamps make a row.
    pub fn end(&self) {
        let end = trace::now();
        let c = self.client.trace();
        let points: Vec<Option<u64>> = match &self.server {
            Some(server) => {
                let s = server.trace();
                vec![
                    c.send,
                    s.received,
                    s.handled,
                    trace::accept_time(),
                    s.send,
                    c.received,
                    c.handled,
                ]
            }
            None => vec![c.send, c.received, c.handled],
        };
        let Some(start) = trace::started() else {
            self.left_out.fetch_add(1, Ordering::Relaxed);
            return;
        };
        match segments(start, &points, end) {
            Some(row) => self
                .rows
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(row),
            None => {
                self.left_out.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// The medians of the rows so far.
    pub fn breakdown(&self) -> Breakdown {
        let rows = self
            .rows
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (ends, names): (&'static str, &[&'static str]) = if self.server.is_some() {
            (BOTH_ENDS, &SEGMENTS)
        } else {
            (CLIENT_END, &CLIENT_SEGMENTS)
        };
        let segments = names
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let mut us: Vec<f64> = rows
                    .iter()
                    .filter_map(|r| r.get(i))
                    .map(|&ns| ns as f64 / 1e3)
                    .collect();
                Segment {
                    segment: name,
                    p50_us: crate::bench::median(&mut us),
                }
            })
            .collect();
        Breakdown {
            ends,
            connections: rows.len(),
            left_out: usize::try_from(self.left_out.load(Ordering::Relaxed)).unwrap_or(usize::MAX),
            segments,
        }
    }
}

impl Drop for Tracer {
    fn drop(&mut self) {
        trace::enable(false);
    }
}

/// The segments' lengths (ns) of one connect that started at `start` and ended at `end`
/// with the stamps `points` between, in the connect's order; `None` when a stamp is missing
/// or out of order. They add up to `end - start`.
fn segments(start: u64, points: &[Option<u64>], end: u64) -> Option<Vec<u64>> {
    let mut at = Vec::with_capacity(points.len() + 2);
    at.push(start);
    for p in points {
        at.push((*p)?);
    }
    at.push(end);
    if at.windows(2).any(|w| w[1] < w[0]) {
        return None;
    }
    Some(at.windows(2).map(|w| w[1] - w[0]).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The stamps of a connect from 100 to 400 ns, every one taken and in order.
    const POINTS: [Option<u64>; 7] = [
        Some(110),
        Some(150),
        Some(160),
        Some(200),
        Some(230),
        Some(300),
        Some(320),
    ];

    #[test]
    fn the_segments_of_a_connect_add_up_to_its_latency() {
        let row = segments(100, &POINTS, 400).expect("complete and in order");
        assert_eq!(row, [10, 40, 10, 40, 30, 70, 20, 80]);
        assert_eq!(row.iter().sum::<u64>(), 300);
    }

    #[test]
    fn the_client_ends_segments_are_its_work_and_the_time_away() {
        let row = segments(100, &[Some(110), Some(300), Some(320)], 400).expect("in order");
        assert_eq!(row, [10, 190, 20, 80]);
        let b = Breakdown {
            ends: CLIENT_END,
            connections: 1,
            left_out: 0,
            segments: CLIENT_SEGMENTS
                .iter()
                .zip(row)
                .map(|(segment, ns)| Segment {
                    segment,
                    p50_us: ns as f64 / 1e3,
                })
                .collect(),
        };
        assert!(!b.both_ends());
        assert!((b.away_us() - 0.19).abs() < 1e-9, "{}", b.away_us());
        assert!((b.work_us() - 0.11).abs() < 1e-9, "{}", b.work_us());
    }

    #[test]
    fn a_connect_with_a_stamp_missing_or_out_of_order_is_left_out() {
        let mut pts = POINTS;
        pts[3] = None;
        assert_eq!(segments(100, &pts, 400), None);
        pts[3] = Some(140);
        assert_eq!(
            segments(100, &pts, 400),
            None,
            "accept before the REQ was handled"
        );
        pts[3] = Some(200);
        assert_eq!(
            segments(100, &pts, 310),
            None,
            "ended before the REP was handled"
        );
    }
}
