//! An MPA stream reader fed arbitrary bytes in arbitrary chunks: a Request or Reply, then
//! FPDUs, waiting whenever a parser says Truncated. Because Truncated means "a valid prefix,
//! read more", the chunked reader must read exactly what a reader given everything at once does.
//!
//! Input: byte 0 = number n (0..=15) of chunk-size bytes that follow; the sizes are used in
//! turn, cyclically (0 counts as 1); the rest is the stream.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rcm_wire::mpa::{self, MpaFrame};
use rcm_wire::WireError;

#[derive(Debug, PartialEq)]
enum Event {
    Frame(MpaFrame),
    Ulpdu(Vec<u8>),
    /// The error's variant and the field or structure it names (the numbers in it may depend
    /// on how much had arrived, such as the key bytes seen so far).
    Fatal(&'static str, &'static str),
}

fn fatal(e: &WireError) -> Event {
    match e {
        WireError::Truncated { what, .. } => Event::Fatal("Truncated", what),
        WireError::BadLength { what, .. } => Event::Fatal("BadLength", what),
        WireError::BadField { field, .. } => Event::Fatal("BadField", field),
        WireError::BadCrc { what, .. } => Event::Fatal("BadCrc", what),
        WireError::PrivateDataTooLong { what, .. } => Event::Fatal("PrivateDataTooLong", what),
        WireError::FieldOverflow { field, .. } => Event::Fatal("FieldOverflow", field),
    }
}

#[derive(Default)]
struct Reader {
    buf: Vec<u8>,
    consumed: usize,
    crc_on: Option<bool>,
    events: Vec<Event>,
    dead: bool,
}

impl Reader {
    fn feed(&mut self, chunk: &[u8]) {
        if self.dead {
            return;
        }
        self.buf.extend_from_slice(chunk);
        loop {
            let avail = &self.buf[self.consumed..];
            let step = match self.crc_on {
                None => MpaFrame::parse(avail).map(|(f, n)| (Event::Frame(f), n)),
                Some(crc) => {
                    mpa::parse_fpdu(avail, crc).map(|(u, n)| (Event::Ulpdu(u.to_vec()), n))
                }
            };
            match step {
                Ok((ev, n)) => {
                    assert!(n > 0, "accepted without consuming anything");
                    assert!(n <= avail.len(), "claims {n} of {} bytes", avail.len());
                    if let Event::Frame(f) = &ev {
                        self.crc_on = Some(f.flags.crc);
                    }
                    self.events.push(ev);
                    self.consumed += n;
                }
                Err(WireError::Truncated { .. }) => return,
                Err(e) => {
                    self.events.push(fatal(&e));
                    self.dead = true;
                    return;
                }
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let n = usize::from(n & 0x0F).min(rest.len());
    let (sizes, stream) = rest.split_at(n);

    let mut whole = Reader::default();
    whole.feed(stream);

    let mut chunked = Reader::default();
    let mut at = 0;
    let mut k = 0;
    while at < stream.len() {
        let size = sizes
            .get(k % sizes.len().max(1))
            .map_or(1, |&s| usize::from(s).max(1));
        let end = (at + size).min(stream.len());
        chunked.feed(&stream[at..end]);
        at = end;
        k += 1;
    }
    assert_eq!(
        chunked.events, whole.events,
        "chunking changed what was read"
    );
    assert_eq!(chunked.consumed, whole.consumed);
    assert_eq!(chunked.dead, whole.dead);
});
