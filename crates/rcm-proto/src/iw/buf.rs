//! A byte queue for a stream: bytes are added at the back and taken from the front.

/// Room an emptied queue keeps for its next bytes: MPA frames of the CM and small messages
/// fit; a larger message's buffer is made for it and let go once it is taken.
pub const KEEP_BYTES: usize = 4 << 10;

/// Bytes received and not parsed yet, or queued and not written yet. What is taken from
/// the front only moves an offset; the buffer is compacted when bytes are added once half
/// of it is taken, so a stream of many small frames costs time linear in its length
/// (removing each from the front of a `Vec` moved the rest every time: quadratic).
#[derive(Debug, Default)]
pub struct ByteQueue {
    buf: Vec<u8>,
    off: usize,
}

impl ByteQueue {
    /// The bytes not taken yet, in order.
    pub fn bytes(&self) -> &[u8] {
        &self.buf[self.off..]
    }

    /// How many bytes are not taken yet.
    pub fn len(&self) -> usize {
        self.buf.len() - self.off
    }

    /// Whether every byte was taken.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Takes `n` bytes from the front (at most what there is).
    pub fn consume(&mut self, n: usize) {
        debug_assert!(n <= self.len());
        self.off = (self.off + n).min(self.buf.len());
        if self.off == self.buf.len() {
            self.clear();
        }
    }

    /// Adds `bytes` at the back.
    pub fn extend(&mut self, bytes: &[u8]) {
        if self.off > 0 && self.off >= self.buf.len() / 2 {
            self.buf.drain(..self.off);
            self.off = 0;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// Empties it, giving back an allocation larger than `KEEP_BYTES` (a burst is over):
    /// every stream has two of these, and one that once carried a big message kept its
    /// room for the connection's life (up to 64 KiB each before, 128 KiB a stream).
    pub fn clear(&mut self) {
        self.buf.clear();
        self.off = 0;
        if self.buf.capacity() > KEEP_BYTES {
            self.buf = Vec::new();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ByteQueue;

    #[test]
    fn bytes_come_out_in_order_whatever_the_pieces() {
        let mut q = ByteQueue::default();
        let mut want = Vec::new();
        let mut got = Vec::new();
        for i in 0..10_000u32 {
            let piece: Vec<u8> = (0..(i % 7)).map(|k| (i + k) as u8).collect();
            want.extend_from_slice(&piece);
            q.extend(&piece);
            let take = (i as usize % 5).min(q.len());
            got.extend_from_slice(&q.bytes()[..take]);
            q.consume(take);
        }
        got.extend_from_slice(q.bytes());
        let n = q.len();
        q.consume(n);
        assert_eq!(got, want);
        assert!(q.is_empty());
        assert_eq!(q.bytes(), b"");
    }

    /// Emptied, a queue keeps a small buffer for its next frames and lets a big message's go.
    #[test]
    fn an_emptied_queue_keeps_only_a_small_buffer() {
        let mut q = ByteQueue::default();
        q.extend(&[7; 1000]);
        let small = q.buf.capacity();
        q.consume(1000);
        assert_eq!(q.buf.capacity(), small, "a small buffer is kept");
        q.extend(&vec![7; 60_000]);
        q.consume(30_000);
        assert!(q.buf.capacity() >= 60_000, "not while bytes are left");
        q.consume(30_000);
        assert_eq!(q.buf.capacity(), 0, "a big message's buffer goes");
    }
}
