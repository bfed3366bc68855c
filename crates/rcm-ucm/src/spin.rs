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
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::io::Errno;
use rustix::net::{recv, RecvFlags};

/// A Unix stream whose reads poll for up to `spin` before blocking.
pub(crate) struct SpinRead {
    pub(crate) stream: UnixStream,
    pub(crate) spin: Duration,
    /// When set, a read still waiting at this instant fails with `TimedOut`.
    pub(crate) deadline: Option<Instant>,
}

impl SpinRead {
    pub(crate) fn new(stream: UnixStream, spin: Duration) -> Self {
        SpinRead {
            stream,
            spin,
            deadline: None,
        }
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
            let left = match self.deadline {
                None => None,
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => Some(Timespec {
                        tv_sec: i64::try_from(left.as_secs()).unwrap_or(i64::MAX),
                        tv_nsec: left.subsec_nanos().into(),
                    }),
                    _ => return Err(io::ErrorKind::TimedOut.into()),
                },
            };
            let mut fds = [PollFd::new(&self.stream, PollFlags::IN)];
            match poll(&mut fds, left.as_ref()) {
                Ok(_) | Err(Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
}

/// Writes all of `buf` to `stream` (blocking), with `MSG_NOSIGNAL`: a peer that went away
/// is an `EPIPE` error here, never a `SIGPIPE`, which by default kills the process. The
/// client library and an embedded daemon run inside programs that may not ignore it (Rust
/// binaries do; C hosts, or Rust ones that restore the default, do not).
pub(crate) fn send_all(stream: &UnixStream, mut buf: &[u8]) -> io::Result<()> {
    use rustix::net::{send, SendFlags};
    while !buf.is_empty() {
        match send(stream, buf, SendFlags::NOSIGNAL) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Whether the other end of `s` is gone (or this one was shut down), whatever is still
/// queued to be read: `POLLRDHUP` is set from the peer's close on, and `POLLHUP` once both
/// directions are shut.
pub(crate) fn hung_up(s: &UnixStream) -> bool {
    let mut fds = [PollFd::new(s, PollFlags::RDHUP)];
    let zero = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    matches!(poll(&mut fds, Some(&zero)), Ok(n) if n > 0)
        && fds[0]
            .revents()
            .intersects(PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR)
}
