//! Reading a command channel: poll briefly before sleeping.
//!
//! On a command channel one thread writes a command and waits for the answer, and the other
//! side usually answers within microseconds. Sleeping in `recv` costs a context switch on
//! each side per round trip (tens of microseconds on a small virtual machine, more than the
//! work itself), so a channel reader first polls without blocking for a bounded time.

use std::io::{self, Read};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use rustix::io::Errno;
use rustix::net::{recv, RecvFlags};

/// A Unix stream whose reads poll for up to `spin` before blocking.
pub(crate) struct SpinRead {
    pub(crate) stream: UnixStream,
    pub(crate) spin: Duration,
}

impl SpinRead {
    pub(crate) fn new(stream: UnixStream, spin: Duration) -> Self {
        SpinRead { stream, spin }
    }
}

impl Read for SpinRead {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if !self.spin.is_zero() && !buf.is_empty() {
            let mut got = None;
            rcm::spin_until(self.spin, || {
                match recv(&self.stream, &mut *buf, RecvFlags::DONTWAIT) {
                    Ok((n, _)) => got = Some(Ok(n)),
                    Err(Errno::AGAIN | Errno::INTR) => {}
                    Err(e) => got = Some(Err(e.into())),
                }
                got.is_some()
            });
            if let Some(r) = got {
                return r;
            }
        }
        self.stream.read(buf)
    }
}
