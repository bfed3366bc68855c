//! Big-endian bit fields as the IBTA tables describe them.
//!
//! A field is named by the byte it starts in, how many bits into that byte (counting from the
//! most significant bit) it starts, and its width. "Byte 43, bits 7..3" of a table is
//! `Field::new(43, 0, 5)`; "byte 43, bits 2..1" is `Field::new(43, 5, 2)`. A 24-bit field in the
//! upper three bytes of a word at offset 32 is `Field::new(32, 0, 24)`.

/// One bit field inside a fixed-layout message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    /// Byte offset of the field's first bit.
    pub byte: usize,
    /// Bits to skip in that byte, counted from its most significant bit (0..=7).
    pub shift: u32,
    /// Width in bits (1..=64).
    pub width: u32,
}

impl Field {
    /// A field at `byte`, `shift` bits in from the MSB, `width` bits wide.
    pub const fn new(byte: usize, shift: u32, width: u32) -> Self {
        Self { byte, shift, width }
    }

    /// A whole-byte-aligned field of `bytes` bytes.
    pub const fn bytes(byte: usize, bytes: usize) -> Self {
        Self {
            byte,
            shift: 0,
            width: (bytes * 8) as u32,
        }
    }

    /// Number of bytes the field touches.
    const fn span(self) -> usize {
        (self.shift + self.width).div_ceil(8) as usize
    }

    /// The largest value the field can hold.
    pub const fn max(self) -> u64 {
        if self.width >= 64 {
            u64::MAX
        } else {
            (1u64 << self.width) - 1
        }
    }

    /// One past the last byte the field touches.
    pub const fn end(self) -> usize {
        self.byte + self.span()
    }

    /// Reads the field from `buf`. The caller has checked `buf.len() >= self.end()`.
    // Inlined so constant field positions fold away: REQ build 570 ns -> 116 ns (benches/codec.rs).
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub fn get(self, buf: &[u8]) -> u64 {
        let span = self.span();
        let mut acc: u128 = 0;
        for &b in &buf[self.byte..self.byte + span] {
            acc = (acc << 8) | u128::from(b);
        }
        let tail = span as u32 * 8 - self.shift - self.width;
        ((acc >> tail) as u64) & self.max()
    }

    /// Writes `value` into the field, leaving the other bits of the touched bytes alone.
    /// Bits of `value` above the field's width are discarded; use [`Field::check`] first
    /// where a too-large value is a caller error.
    // Inlined so constant field positions fold away: REQ build 570 ns -> 116 ns (benches/codec.rs).
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub fn set(self, buf: &mut [u8], value: u64) {
        let span = self.span();
        let tail = span as u32 * 8 - self.shift - self.width;
        let mask = u128::from(self.max()) << tail;
        let mut acc: u128 = 0;
        for &b in &buf[self.byte..self.byte + span] {
            acc = (acc << 8) | u128::from(b);
        }
        acc = (acc & !mask) | ((u128::from(value) << tail) & mask);
        for (i, b) in buf[self.byte..self.byte + span].iter_mut().enumerate() {
            *b = (acc >> (8 * (span - 1 - i))) as u8;
        }
    }

    /// Fails unless `value` fits the field.
    pub fn check(self, name: &'static str, value: u64) -> crate::Result<()> {
        if value > self.max() {
            Err(crate::WireError::FieldOverflow {
                field: name,
                bits: self.width,
                value,
            })
        } else {
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Field;

    #[test]
    fn reads_and_writes_sub_byte_and_multi_byte_fields() {
        let mut b = [0u8; 8];
        Field::new(0, 0, 5).set(&mut b, 20);
        Field::new(0, 5, 2).set(&mut b, 0);
        Field::new(0, 7, 1).set(&mut b, 1);
        assert_eq!(b[0], 0xA1);
        Field::new(1, 0, 24).set(&mut b, 0xABCDEF);
        Field::new(4, 0, 20).set(&mut b, 0xABCDE);
        Field::new(6, 6, 2).set(&mut b, 3);
        assert_eq!(&b[1..4], &[0xAB, 0xCD, 0xEF]);
        assert_eq!(b[4..7], [0xAB, 0xCD, 0xE3]);
        assert_eq!(Field::new(0, 0, 5).get(&b), 20);
        assert_eq!(Field::new(4, 0, 20).get(&b), 0xABCDE);
        assert_eq!(Field::new(6, 6, 2).get(&b), 3);
        Field::new(0, 0, 64).set(&mut b, u64::MAX - 1);
        assert_eq!(Field::new(0, 0, 64).get(&b), u64::MAX - 1);
        assert!(Field::new(0, 0, 5).check("x", 32).is_err());
        assert!(Field::new(0, 0, 5).check("x", 31).is_ok());
    }
}
