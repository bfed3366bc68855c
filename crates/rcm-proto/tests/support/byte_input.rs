//! The input of a byte-driven engine run (`engine_bytes/driver.rs`, `iw_bytes/driver.rs`),
//! read front to back; past its end every read is zero, so any input is a whole run.
// Each driver uses its own subset of the readers.
#![allow(dead_code)]

pub struct Bytes<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Bytes<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Bytes { data, at: 0 }
    }

    pub fn more(&self) -> bool {
        self.at < self.data.len()
    }

    pub fn u8(&mut self) -> u8 {
        let b = self.data.get(self.at).copied().unwrap_or(0);
        self.at += 1;
        b
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_be_bytes([self.u8(), self.u8()])
    }

    pub fn u64(&mut self) -> u64 {
        (0..8).fold(0, |v, _| v << 8 | u64::from(self.u8()))
    }

    pub fn bit(&mut self) -> bool {
        self.u8() & 1 == 1
    }

    /// Up to `n` bytes of the input (fewer at its end).
    pub fn take(&mut self, n: usize) -> &'a [u8] {
        let start = self.at.min(self.data.len());
        let end = (start + n).min(self.data.len());
        self.at = self.at.max(end);
        &self.data[start..end]
    }

    /// Private data of at most `max` bytes, its length chosen by the input.
    pub fn pd(&mut self, max: usize) -> Vec<u8> {
        let n = usize::from(self.u8()) % (max + 1);
        vec![0xA5; n]
    }

    /// One of `n` things (0 when there are none).
    pub fn pick(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            usize::from(self.u16()) % n
        }
    }
}
