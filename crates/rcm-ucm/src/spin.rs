//! Reading a command channel: poll briefly before sleeping.
//!
//! On a command channel one thread writes a command and waits for the answer, and the other
//! side usually answers within microseconds. Sleeping in `recv` costs a context switch on
//! each side per round trip (tens of microseconds on a small virtual machine, more than the
//! work itself), so a channel reader first polls without blocking for a bounded time.
//!
//! When it does sleep, it sleeps in `poll(2)` for input, not in a blocking `recv`: a Unix
//! stream socket has one wait queue for readers and writers, and each time the peer takes
//! data this side sent, the kernel wakes that queue for "writable". A thread asleep in
//! `recv` is woken by that too, runs, finds nothing and sleeps again; `poll` filters the
//! wake-up by the events asked for. The daemon's session reader sleeps on the socket its
//! events go out on, so without this every batch of events the client read woke it for
//! nothing (seen with `perf sched timehist`: a few µs of CPU and a context switch each, on
//! the path of the next hop on a two-CPU machine).

use std::io::{self, Read};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use rustix::event::{poll, PollFd, PollFlags};
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
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            match recv(&self.stream, &mut *buf, RecvFlags::DONTWAIT) {
                Ok((n, _)) => return Ok(n),
                Err(Errno::AGAIN | Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
            // Readable, hung up or in error: the next recv says which.
            let mut fds = [PollFd::new(&self.stream, PollFlags::IN)];
            match poll(&mut fds, None) {
                Ok(_) | Err(Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
}
