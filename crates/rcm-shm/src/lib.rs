//! Memory shared between two processes that do not trust each other, and the rings of
//! frames that a daemon and its client pass through it.
//!
//! A call through the `rcm daemon` on a Unix socket costs four system calls (a send and a
//! receive on each side) and, when a side polls, a receive per look: 3–4 µs on loopback,
//! more than the work of most calls. Two processes that map the same memory pass a frame by
//! writing it and moving an index, with no system call while the other side polls.
//!
//! [`Region`] is a mapping of a sealed memfd: the creator fixes its size for good (the seals
//! forbid shrinking, which would turn the other side's reads into `SIGBUS`), and every access
//! to it goes through atomics, since the other process may write any byte at any time. That
//! is the only `unsafe` of the crate (the mapping, and the atomic views of it). [`Producer`]
//! and [`Consumer`] are the two ends of a single-producer, single-consumer ring of frames in a
//! region; each keeps its own index in private memory and only publishes it, and checks every
//! value it reads from the peer (the peer's index, a frame's length) before using it: a
//! peer writing garbage makes [`Corrupt`] errors, never a panic, an endless loop or an
//! access outside the region.

use std::fmt;
use std::os::fd::{AsFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

/// A mapping of a sealed memfd shared with another process.
pub struct Region {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value until it is dropped; every access
// to it goes through atomics (`u32_at`, `bytes`, `words`), which may be used from any
// thread.
unsafe impl Send for Region {}
// SAFETY: as above: shared access is only through atomics.
unsafe impl Sync for Region {}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Region({} bytes)", self.len)
    }
}

/// The seals a region's memfd must carry: its size cannot change, nor can the seals.
fn required_seals() -> rustix::fs::SealFlags {
    use rustix::fs::SealFlags;
    SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL
}

impl Region {
    /// A new region of `len` bytes (a multiple of the page size, 4096), zeroed, and the
    /// sealed memfd behind it, to be passed to the other process.
    pub fn create(name: &str, len: usize) -> std::io::Result<(Region, OwnedFd)> {
        use rustix::fs::{fcntl_add_seals, ftruncate, memfd_create, MemfdFlags};
        if len == 0 || len % 4096 != 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "a region's length is a non-zero multiple of 4096",
            ));
        }
        let fd = memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        ftruncate(&fd, len as u64)?;
        fcntl_add_seals(&fd, required_seals())?;
        let r = Self::map(&fd, len)?;
        Ok((r, fd))
    }

    /// Maps the region behind `fd`, which the other process created: refused unless it is
    /// exactly `len` bytes and sealed so that its size can never change.
    pub fn open(fd: impl AsFd, len: usize) -> std::io::Result<Region> {
        let fd = fd.as_fd();
        let seals = rustix::fs::fcntl_get_seals(fd)?;
        if !seals.contains(required_seals()) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "the shared memory is not sealed against resizing",
            ));
        }
        let size = rustix::fs::fstat(fd)?.st_size;
        if u64::try_from(size).ok() != Some(len as u64) || len == 0 || len % 4096 != 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("the shared memory is {size} bytes, not {len}"),
            ));
        }
        Self::map(fd, len)
    }

    fn map(fd: impl AsFd, len: usize) -> std::io::Result<Region> {
        use rustix::mm::{mmap, MapFlags, ProtFlags};
        // SAFETY: a new mapping at an address the kernel picks (null hint), so it aliases no
        // memory of this process; `len` is the file's sealed size, so no page of the mapping
        // lies past the file's end (no SIGBUS on access).
        let p = unsafe {
            mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd,
                0,
            )
        }?;
        let ptr = NonNull::new(p.cast::<u8>())
            .ok_or_else(|| std::io::Error::other("mmap returned a null mapping"))?;
        Ok(Region { ptr, len })
    }

    /// The region's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a region has at least one page.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The 32-bit word at byte offset `off` (a multiple of 4 inside the region).
    ///
    /// # Panics
    /// When `off` is misaligned or out of the region: offsets are the program's layout
    /// constants, never values read from the peer.
    pub fn u32_at(&self, off: usize) -> &AtomicU32 {
        assert!(off % 4 == 0 && off + 4 <= self.len, "word offset {off}");
        // The mapping is page-aligned and `off` a multiple of 4: the cast is aligned.
        #[allow(clippy::cast_ptr_alignment)]
        // SAFETY: in bounds and 4-aligned (the mapping is page-aligned) as just checked;
        // AtomicU32 has u32's layout, and the memory is only ever accessed atomically here, so
        // the other process's concurrent writes are not data races of this one.
        unsafe {
            &*self.ptr.as_ptr().add(off).cast::<AtomicU32>()
        }
    }

    /// The bytes `off..off + n` (inside the region).
    ///
    /// # Panics
    /// When the range leaves the region (the ring computes it from its own checked values).
    pub fn bytes(&self, off: usize, n: usize) -> &[AtomicU8] {
        assert!(
            off.checked_add(n).is_some_and(|e| e <= self.len),
            "byte range {off}+{n}"
        );
        // SAFETY: in bounds as just checked; AtomicU8 has u8's layout and alignment; all
        // access is atomic (see `u32_at`).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(off).cast::<AtomicU8>(), n) }
    }

    /// The `n` 64-bit words from byte offset `off` (a multiple of 8; inside the region).
    ///
    /// # Panics
    /// When `off` is misaligned or the words leave the region (see `bytes`).
    pub fn words(&self, off: usize, n: usize) -> &[AtomicU64] {
        assert!(
            off % 8 == 0
                && n.checked_mul(8)
                    .and_then(|b| b.checked_add(off))
                    .is_some_and(|e| e <= self.len),
            "word range {off}+{n}x8"
        );
        // The mapping is page-aligned and `off` a multiple of 8: the cast is aligned.
        #[allow(clippy::cast_ptr_alignment)]
        // SAFETY: in bounds and 8-aligned as just checked; AtomicU64 has u64's layout; all
        // access is atomic (see `u32_at`).
        unsafe {
            std::slice::from_raw_parts(self.ptr.as_ptr().add(off).cast::<AtomicU64>(), n)
        }
    }

    /// Writes `src` at byte offset `off`, eight bytes a store where the offsets allow (atomic
    /// stores are never merged: a byte at a time, a push and pop of a 200-byte frame took
    /// 113–117 ns on one thread, 63 ns this way). [`Region::load`] splits a range the same
    /// way, so the two ends of a ring access each byte of a frame with the same width.
    pub fn store(&self, off: usize, src: &[u8]) {
        let (head, words, tail) = split_at_words(off, src.len());
        let bytes = self.bytes(off, src.len());
        for (d, s) in bytes[..head].iter().zip(src) {
            d.store(*s, Ordering::Relaxed);
        }
        if words > 0 {
            let mid = &src[head..head + 8 * words];
            for (d, s) in self
                .words(off + head, words)
                .iter()
                .zip(mid.chunks_exact(8))
            {
                let mut w = [0u8; 8];
                w.copy_from_slice(s);
                d.store(u64::from_ne_bytes(w), Ordering::Relaxed);
            }
        }
        let rest = head + 8 * words;
        for (d, s) in bytes[rest..].iter().zip(&src[rest..rest + tail]) {
            d.store(*s, Ordering::Relaxed);
        }
    }

    /// Reads the bytes at byte offset `off` into `out` (see [`Region::store`]).
    pub fn load(&self, off: usize, out: &mut [u8]) {
        let (head, words, _) = split_at_words(off, out.len());
        let bytes = self.bytes(off, out.len());
        let (a, b) = out.split_at_mut(head);
        for (d, s) in a.iter_mut().zip(bytes) {
            *d = s.load(Ordering::Relaxed);
        }
        let (mid, c) = b.split_at_mut(8 * words);
        if words > 0 {
            for (d, s) in mid.chunks_exact_mut(8).zip(self.words(off + head, words)) {
                d.copy_from_slice(&s.load(Ordering::Relaxed).to_ne_bytes());
            }
        }
        for (d, s) in c.iter_mut().zip(&bytes[head + 8 * words..]) {
            *d = s.load(Ordering::Relaxed);
        }
    }
}

/// Frames start at whole words: an index found published elsewhere is no index of this ring.
fn misaligned(index: u32) -> std::io::Result<()> {
    if index % 8 == 0 {
        Ok(())
    } else {
        Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "a ring index that is not a multiple of 8",
        ))
    }
}

/// A frame's header word: its length, tagged with the ring index it starts at (inverted, so
/// that zeroed memory is no header of index 0).
fn header(index: u32, len: u32) -> u64 {
    (u64::from(!index) << 32) | u64::from(len)
}

/// How `n` bytes from offset `off` split into bytes before the first 8-aligned offset,
/// whole words, and bytes after the last.
fn split_at_words(off: usize, n: usize) -> (usize, usize, usize) {
    let head = ((8 - off % 8) % 8).min(n);
    let words = (n - head) / 8;
    (head, words, n - head - 8 * words)
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once; no reference into it outlives
        // `self` (they borrow it).
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// The peer broke the ring's rules (an index out of range, a frame longer than what was
/// published or than the limit): the ring cannot be used any more.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Corrupt(pub &'static str);

impl fmt::Display for Corrupt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "shared ring corrupt: {}", self.0)
    }
}

impl std::error::Error for Corrupt {}

/// Where one ring lies in a region: its control block (three words, each on a cache line of
/// its own: the producer's published index, the consumer's, the consumer's sleeping flag) and
/// its data area of `cap` bytes (a power of two).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingAt {
    /// Byte offset of the control block (192 bytes, 64-aligned).
    pub ctl: usize,
    /// Byte offset of the data area (8-aligned).
    pub data: usize,
    /// Size of the data area: a power of two, at least 8 and at most 2^30.
    pub cap: u32,
}

const TAIL: usize = 0;
const HEAD: usize = 64;
const ASLEEP: usize = 128;
/// Bytes of a ring's control block.
pub const CTL_BYTES: usize = 192;

impl RingAt {
    fn check(&self, r: &Region) -> std::io::Result<()> {
        let ok = self.cap.is_power_of_two()
            && self.cap >= 8
            && self.cap <= 1 << 30
            && self.data % 8 == 0
            && self.ctl % 64 == 0
            && self.ctl + CTL_BYTES <= r.len()
            && self.data + self.cap as usize <= r.len()
            && (self.data >= self.ctl + CTL_BYTES || self.data + self.cap as usize <= self.ctl);
        if ok {
            Ok(())
        } else {
            Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "ring layout does not fit the region",
            ))
        }
    }
}

/// The writing end of a ring: frames go in whole, each at an index that is a multiple of 8
/// as a header word (the frame's length in its low 32 bits, the inverted index in its high
/// ones; native byte order) and its bytes, padded to whole words. The header is written
/// last: a consumer polls the word at its index, in the cache line the frame's first bytes
/// share, instead of the producer's index, one cache line away (a ping-pong of 100-byte
/// frames between two CPUs: 850–925 ns a round trip that way, 500–650 this way).
pub struct Producer {
    r: Arc<Region>,
    at: RingAt,
    /// What this end published: kept here, the shared copy is only written.
    tail: u32,
    /// The consumer's index as last read: the shared one is read again only when this
    /// leaves too little room. Each read of it is a cache line the consumer wrote, moved
    /// over from the consumer's CPU, and makes the consumer's next write move it back.
    head_seen: u32,
}

/// The reading end of a ring.
pub struct Consumer {
    r: Arc<Region>,
    at: RingAt,
    /// What this end consumed: kept here, the shared copy is only written.
    head: u32,
}

impl Producer {
    /// The producer of the ring at `at` in `r`. The ring must be new (both indices zero) or
    /// this end's own from before: it starts at the index it finds published.
    pub fn new(r: Arc<Region>, at: RingAt) -> std::io::Result<Producer> {
        at.check(&r)?;
        let tail = r.u32_at(at.ctl + TAIL).load(Ordering::Acquire);
        misaligned(tail)?;
        // No room known until the consumer's index is read (at the first push).
        let head_seen = tail.wrapping_sub(at.cap);
        Ok(Producer {
            r,
            at,
            tail,
            head_seen,
        })
    }

    /// Bytes a frame of `len` bytes takes in the ring: its header word and its bytes,
    /// rounded up to whole words.
    pub fn footprint(len: usize) -> usize {
        8 + len.div_ceil(8) * 8
    }

    /// Writes `frame`. `Ok(None)`: no room now (the consumer has not caught up);
    /// `Ok(Some(wake))`: written, and `wake` says the consumer is asleep (or about to be) and
    /// must be woken by other means.
    pub fn push(&mut self, frame: &[u8]) -> Result<Option<bool>, Corrupt> {
        let cap = self.at.cap;
        let need = Self::footprint(frame.len());
        if need > cap as usize {
            return Err(Corrupt("a frame longer than the ring"));
        }
        // `head_seen` is a checked value of the consumer's index, which only grows: the
        // room it leaves is at most what there is.
        if ((cap - self.tail.wrapping_sub(self.head_seen)) as usize) < need {
            let head = self.r.u32_at(self.at.ctl + HEAD).load(Ordering::Acquire);
            let used = self.tail.wrapping_sub(head);
            if used > cap {
                return Err(Corrupt("the consumer's index is past the producer's"));
            }
            self.head_seen = head;
            if ((cap - used) as usize) < need {
                return Ok(None);
            }
        }
        let len = u32::try_from(frame.len()).map_err(|_| Corrupt("a frame over 4 GiB"))?;
        self.write(self.tail.wrapping_add(8), frame);
        // The slot after the frame, where a consumer that caught up looks next, is cleared
        // before the frame is published: it holds an earlier lap's bytes (a payload's, which
        // a remote peer may have shaped like the header that slot would get now). Where the
        // frame ends a lap after the consumer's index last seen, that slot is the one the
        // index named: a frame's start, whose header is tagged a lap earlier and matches no
        // index the consumer will look for.
        let next = self.tail.wrapping_add(need as u32);
        if next.wrapping_sub(self.head_seen) < cap {
            let at = self.at.data + (next as usize & (cap as usize - 1));
            if let Some(w) = self.r.words(at, 1).first() {
                w.store(0, Ordering::Relaxed);
            }
        }
        // The header last, its bytes released with it: a consumer that finds it tagged with
        // its own index has the whole frame.
        let at = self.at.data + (self.tail as usize & (self.at.cap as usize - 1));
        if let Some(w) = self.r.words(at, 1).first() {
            w.store(header(self.tail, len), Ordering::Release);
        }
        self.tail = self.tail.wrapping_add(need as u32);
        // Published, then the sleeping flag read: with the consumer's flag written before it
        // looks at this index (both SeqCst), one of the two sees the other's write, so a
        // consumer never sleeps on a frame nobody wakes it for.
        self.r
            .u32_at(self.at.ctl + TAIL)
            .store(self.tail, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let asleep = self.r.u32_at(self.at.ctl + ASLEEP).load(Ordering::SeqCst) != 0;
        Ok(Some(asleep))
    }

    /// Whether the consumer took everything this end wrote (its index caught up): on a ring
    /// whose consumer polls, a sign that it is running now.
    pub fn taken(&self) -> bool {
        self.r.u32_at(self.at.ctl + HEAD).load(Ordering::Acquire) == self.tail
    }

    fn write(&self, at: u32, bytes: &[u8]) {
        let cap = self.at.cap as usize;
        let start = (at as usize) & (cap - 1);
        let first = bytes.len().min(cap - start);
        let (a, b) = bytes.split_at(first);
        self.r.store(self.at.data + start, a);
        self.r.store(self.at.data, b);
    }
}

impl Consumer {
    /// The consumer of the ring at `at` in `r` (see [`Producer::new`]).
    pub fn new(r: Arc<Region>, at: RingAt) -> std::io::Result<Consumer> {
        at.check(&r)?;
        let head = r.u32_at(at.ctl + HEAD).load(Ordering::Acquire);
        misaligned(head)?;
        Ok(Consumer { r, at, head })
    }

    /// Whether a frame (or garbage) waits: the word at this end's index is a header tagged
    /// with it, or the producer's index is ahead of this end's (see `tail_ahead`).
    pub fn has_data(&self) -> bool {
        self.frame_len(Ordering::Relaxed).is_some()
            || self.tail_ahead(self.r.u32_at(self.at.ctl + TAIL).load(Ordering::Acquire))
    }

    /// Whether the producer's index `tail` says more than this end took. At or behind this
    /// end's index (by at most the ring's size) it says nothing: this end takes frames by
    /// their headers, before the producer publishes the index past them.
    fn tail_ahead(&self, tail: u32) -> bool {
        self.head.wrapping_sub(tail) > self.at.cap
    }

    /// The length the header at this end's index gives, when it is tagged with the index.
    fn frame_len(&self, order: Ordering) -> Option<u32> {
        let at = self.at.data + (self.head as usize & (self.at.cap as usize - 1));
        let h = self.r.words(at, 1).first()?.load(order);
        ((h >> 32) as u32 == !self.head).then_some(h as u32)
    }

    /// Takes the next frame into `out` (replacing its contents): `Ok(false)` when there is
    /// none. A frame longer than `max` bytes is an error: the ring is not used any more.
    pub fn pop(&mut self, out: &mut Vec<u8>, max: usize) -> Result<bool, Corrupt> {
        // A frame is found by its header, in the cache line its first bytes share: the
        // producer's index is read only on an empty look, to tell garbage from nothing.
        let len = if let Some(len) = self.frame_len(Ordering::Acquire) {
            len
        } else {
            let tail = self.r.u32_at(self.at.ctl + TAIL).load(Ordering::Acquire);
            if !self.tail_ahead(tail) {
                return Ok(false);
            }
            if tail.wrapping_sub(self.head) > self.at.cap {
                return Err(Corrupt("the producer's index is out of range"));
            }
            // The producer writes a frame's header before it publishes its index, so the
            // header is there now.
            self.frame_len(Ordering::Acquire)
                .ok_or(Corrupt("a frame published without its header"))?
        };
        let len = len as usize;
        if len > max {
            return Err(Corrupt("a frame over the limit"));
        }
        let need = Producer::footprint(len);
        if need > self.at.cap as usize {
            return Err(Corrupt("a frame longer than the ring"));
        }
        out.clear();
        out.resize(len, 0);
        self.read(self.head.wrapping_add(8), out);
        self.head = self.head.wrapping_add(need as u32);
        self.r
            .u32_at(self.at.ctl + HEAD)
            .store(self.head, Ordering::Release);
        Ok(true)
    }

    fn read(&self, at: u32, out: &mut [u8]) {
        let cap = self.at.cap as usize;
        let start = (at as usize) & (cap - 1);
        let first = out.len().min(cap - start);
        let (a, b) = out.split_at_mut(first);
        self.r.load(self.at.data + start, a);
        self.r.load(self.at.data, b);
    }

    /// About to sleep until woken: marks this end asleep, then looks once more. False (and
    /// not marked) when a frame came meanwhile: do not sleep. After a sleep, call [`awake`].
    ///
    /// [`awake`]: Consumer::awake
    pub fn prepare_sleep(&self) -> bool {
        let flag = self.r.u32_at(self.at.ctl + ASLEEP);
        flag.store(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        // An index behind this end's is nothing to wait for (see `tail_ahead`; the producer
        // reads the flag after it publishes, and wakes this end for nothing then). Any other,
        // or a header here, is a frame (or a broken ring, which the next look reports).
        let tail = self.r.u32_at(self.at.ctl + TAIL).load(Ordering::SeqCst);
        if self.tail_ahead(tail) || self.frame_len(Ordering::SeqCst).is_some() {
            flag.store(0, Ordering::SeqCst);
            return false;
        }
        true
    }

    /// Back from a sleep: producers need not wake this end.
    pub fn awake(&self) {
        self.r
            .u32_at(self.at.ctl + ASLEEP)
            .store(0, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests;
