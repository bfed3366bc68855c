//! Command channels in shared memory (§2.2 of `docs/ucm-protocol.md`).
//!
//! A call on a command channel's socket costs a send and a receive on each side, and each
//! look of a polling side is a receive too. Once a channel is mapped, its commands and
//! answers are the same frames, passed through two rings in a memfd that the daemon made,
//! sealed and sent with its answer to `MAP_CHANNEL`: while the other side polls, a call
//! makes no system call. The channel's socket stays, for two things: it is the lifeline
//! (either side's end is seen as the socket's hang-up, as before), and a side that stopped
//! polling sleeps in `poll(2)` on it, woken by a byte that the other side writes only when
//! the ring says it sleeps (the doorbell). A side never trusts what the other wrote in the
//! shared memory: see [`rcm_shm`].
//!
//! A session's own connection may move too (`MAP_EVENTS`, §2.3): then everything the daemon
//! writes for the session (events, and answers to commands sent there) goes through one ring,
//! [`EVENTS`], and the socket carries only the doorbell and the session's end.

use crate::spin::hung_up;
use rcm_shm::{Consumer, Producer, Region, RingAt};
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bytes of each ring's data area: a command and its answer are each under the daemon's
/// message limit (4 KiB by default); a daemon whose limit does not fit refuses to map.
pub const RING_BYTES: u32 = 64 * 1024;
/// The whole region: a page of control blocks, then the two rings' data.
pub const REGION_BYTES: usize = 4096 + 2 * RING_BYTES as usize;
/// Commands, client to daemon.
pub const COMMANDS: RingAt = RingAt {
    ctl: 0,
    data: 4096,
    cap: RING_BYTES,
};
/// Answers, daemon to client.
pub const ANSWERS: RingAt = RingAt {
    ctl: 256,
    data: 4096 + RING_BYTES as usize,
    cap: RING_BYTES,
};

/// Bytes of the events ring's data area (§2.3): a few thousand events.
pub const EVENTS_RING_BYTES: u32 = 256 * 1024;
/// A session's events region: a page for the control block, then the ring's data.
pub const EVENTS_REGION_BYTES: usize = 4096 + EVENTS_RING_BYTES as usize;
/// The events ring: what the daemon writes on the session's connection, daemon to client.
pub const EVENTS: RingAt = RingAt {
    ctl: 0,
    data: 4096,
    cap: EVENTS_RING_BYTES,
};

/// The daemon's end of a new events region, and the memfd to send to the client.
pub(crate) fn events_daemon() -> io::Result<(Producer, OwnedFd)> {
    let (r, fd) = Region::create("rcm-ucm-events", EVENTS_REGION_BYTES)?;
    Ok((Producer::new(Arc::new(r), EVENTS)?, fd))
}

/// The client's end of the events region the daemon sent.
pub(crate) fn events_client(fd: impl AsFd) -> io::Result<Consumer> {
    let r = Region::open(fd, EVENTS_REGION_BYTES)?;
    Consumer::new(Arc::new(r), EVENTS)
}

/// How long the daemon waits for room in a client's full answer ring before it gives the
/// channel up. A caller waits for each answer, and a pipelining client (`rcm::Pipeline`)
/// reads its answers while it waits for room, so the ring stays full only when the client
/// stops reading; the daemon's ring thread, which serves every client, must not wait long.
pub(crate) const FULL_FOR: Duration = Duration::from_secs(1);

/// How long a client waits for room in the daemon's full command ring. The daemon's ring
/// thread serves every client and may fall behind for a while under load: a second of that
/// must not end the session (every id's DEVICE_REMOVAL). A daemon gone is seen at once (the
/// hang-up), so this bounds only a daemon alive and stuck (stopped, say).
pub(crate) const DAEMON_FULL_FOR: Duration = Duration::from_secs(10);

/// A wait for room when this thread is held off polling.
pub(crate) const FULL_NAP: Duration = Duration::from_micros(100);

/// One side of a mapped channel.
pub(crate) struct ShmEnd {
    tx: Producer,
    rx: Consumer,
    /// The channel's socket: lifeline and doorbell.
    pub(crate) stream: UnixStream,
    /// How long a wait polls the ring before it sleeps.
    spin: Duration,
    /// How long a send waits for room in a full ring ([`FULL_FOR`], [`DAEMON_FULL_FOR`]).
    pub(crate) full_for: Duration,
    /// The last frame received.
    buf: Vec<u8>,
    /// When the last frame went out to a side that was not asleep (no doorbell), until the
    /// wait for its answer begins: see `look_unyielding`.
    sent: Option<Instant>,
    /// Waits for an answer left to begin with a yield, after one whose answer did not come
    /// in time without (see `look_unyielding`).
    unyielding_off: u8,
    /// Answers found by `look_unyielding` (for the tests).
    #[cfg(test)]
    unyielding_got: u32,
}

/// How soon a polling daemon takes a command: a command not taken by then finds the daemon's
/// ring thread not running (descheduled, or sharing this CPU), so its caller yields.
const TAKEN_WITHIN: Duration = Duration::from_micros(2);

/// How long a caller looks for its answer without yielding once its command was taken.
const ANSWER_WITHIN: Duration = Duration::from_micros(5);

/// How many waits after one that found no answer in time begin with a yield.
const UNYIELDING_OFF: u8 = 32;

/// How many waits after one whose command was taken but whose answer came late begin with
/// a yield: the daemon runs, but was busy.
const LATE_OFF: u8 = 4;

fn corrupt(e: rcm_shm::Corrupt) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

impl ShmEnd {
    /// The daemon's side of a new mapping, and the memfd to send to the client. A ring thread
    /// polls it (`try_recv`), so it never waits in `recv` and has no spin of its own.
    pub(crate) fn daemon(stream: UnixStream) -> io::Result<(ShmEnd, OwnedFd)> {
        let (r, fd) = Region::create("rcm-ucm-channel", REGION_BYTES)?;
        let r = Arc::new(r);
        let end = ShmEnd {
            tx: Producer::new(r.clone(), ANSWERS)?,
            rx: Consumer::new(r, COMMANDS)?,
            stream,
            spin: Duration::ZERO,
            full_for: FULL_FOR,
            buf: Vec::new(),
            sent: None,
            unyielding_off: 0,
            #[cfg(test)]
            unyielding_got: 0,
        };
        Ok((end, fd))
    }

    /// The client's side, on the memfd the daemon sent.
    pub(crate) fn client(stream: UnixStream, fd: impl AsFd, spin: Duration) -> io::Result<ShmEnd> {
        let r = Arc::new(Region::open(fd, REGION_BYTES)?);
        Ok(ShmEnd {
            tx: Producer::new(r.clone(), COMMANDS)?,
            rx: Consumer::new(r, ANSWERS)?,
            stream,
            spin,
            full_for: DAEMON_FULL_FOR,
            buf: Vec::new(),
            sent: None,
            unyielding_off: 0,
            #[cfg(test)]
            unyielding_got: 0,
        })
    }

    /// Sends one frame, ringing the doorbell if the other side sleeps. A full ring is waited
    /// on for up to `full_for`; then the error is `TimedOut`, or `BrokenPipe` as soon as
    /// the other side is seen gone.
    pub(crate) fn send(&mut self, frame: &[u8]) -> io::Result<()> {
        let mut wait = RoomWait::new(self.full_for);
        while !self.try_send(frame)? {
            wait.turn(&self.stream)?;
        }
        Ok(())
    }

    /// Writes one frame if the ring has room now, ringing the doorbell if the other side
    /// sleeps; false (nothing written) when it has not.
    pub(crate) fn try_send(&mut self, frame: &[u8]) -> io::Result<bool> {
        let rang = push_and_ring(&mut self.tx, &self.stream, frame)?;
        self.sent = (rang == Some(false) && !self.spin.is_zero()).then(Instant::now);
        Ok(rang.is_some())
    }

    /// The next frame (up to `max` bytes) if one is there now.
    pub(crate) fn try_recv(&mut self, max: usize) -> io::Result<Option<&[u8]>> {
        Ok(self
            .rx
            .pop(&mut self.buf, max)
            .map_err(corrupt)?
            .then_some(&self.buf[..]))
    }

    /// Whether a frame waits to be read (the other side's command, on the daemon's end).
    pub(crate) fn has_command(&self) -> bool {
        self.rx.has_data()
    }

    /// Marks this end asleep unless a frame came meanwhile (then false, not marked); see
    /// [`Consumer::prepare_sleep`].
    pub(crate) fn prepare_sleep(&self) -> bool {
        self.rx.prepare_sleep()
    }

    /// Back from a sleep (or not going to sleep after all).
    pub(crate) fn awake(&self) {
        self.rx.awake();
    }

    /// Waits for the next frame (up to `max` bytes): polls the ring for the spin, then sleeps
    /// on the socket until the doorbell or the other side's end.
    pub(crate) fn recv(&mut self, max: usize) -> io::Result<&[u8]> {
        let mut got = self.look_unyielding(max);
        if matches!(got, Ok(false)) {
            rcm::spin_until(self.spin, || {
                got = self.rx.pop(&mut self.buf, max);
                !matches!(got, Ok(false))
            });
        }
        loop {
            if got.map_err(corrupt)? {
                return Ok(&self.buf);
            }
            if self.rx.prepare_sleep() {
                let r = sleep_on(&self.stream);
                self.rx.awake();
                r?;
            }
            got = self.rx.pop(&mut self.buf, max);
        }
    }

    /// The first part of the wait for the answer to a command just sent to a polling side:
    /// looks at the ring without yielding, for as long as that side is seen to run (it took
    /// the command within `TAKEN_WITHIN`) and up to `ANSWER_WITHIN`. A polling wait yields
    /// between its looks, and on a CPU shared with other pollers (a client's threads waiting
    /// for their calls and events) each yield is a context switch to one of them, which looks
    /// once and yields back: through the daemon a connection's calls made ~25 such yields in
    /// a burst (`perf stat`). A command not taken in time (the daemon's thread was not
    /// running, as when it shares this CPU) makes the next `UNYIELDING_OFF` waits yield from
    /// the start, so that a CPU shared with the daemon loses little to this; one taken whose
    /// answer came late (the daemon was busy), the next `LATE_OFF`.
    fn look_unyielding(&mut self, max: usize) -> Result<bool, rcm_shm::Corrupt> {
        let Some(sent) = self.sent.take() else {
            return Ok(false);
        };
        if self.unyielding_off > 0 {
            self.unyielding_off -= 1;
            return Ok(false);
        }
        if !rcm::spin_allowed() {
            return Ok(false);
        }
        loop {
            if self.rx.pop(&mut self.buf, max)? {
                #[cfg(test)]
                {
                    self.unyielding_got += 1;
                }
                return Ok(true);
            }
            let waited = sent.elapsed();
            if waited >= TAKEN_WITHIN && !self.tx.taken() {
                self.unyielding_off = UNYIELDING_OFF;
                return Ok(false);
            }
            if waited >= ANSWER_WITHIN {
                self.unyielding_off = LATE_OFF;
                return Ok(false);
            }
            std::hint::spin_loop();
        }
    }
}

/// A writer's wait for room in the other side's ring: since when it has waited.
pub(crate) struct RoomWait {
    since: Option<Instant>,
    limit: Duration,
}

impl RoomWait {
    /// A wait that gives up after `limit` without room.
    pub(crate) fn new(limit: Duration) -> Self {
        RoomWait { since: None, limit }
    }

    /// One turn of the wait, after a write found no room: `BrokenPipe` as soon as the
    /// other side (`s`'s peer) has hung up, `TimedOut` once no room came for its limit;
    /// else this thread yields before the next try.
    pub(crate) fn turn(&mut self, s: &UnixStream) -> io::Result<()> {
        let t0 = *self.since.get_or_insert_with(Instant::now);
        if hung_up(s) {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the other side hung up with its ring full",
            ));
        }
        if t0.elapsed() > self.limit {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the other side does not read its ring",
            ));
        }
        // Beside a CPU-bound process a yield waits a scheduler tick each time; held off
        // polling (see `rcm::yield_to_pollers`), this thread sleeps a little instead.
        if !rcm::spin_allowed() || !rcm::yield_to_pollers() {
            std::thread::sleep(FULL_NAP);
        }
        Ok(())
    }

    /// The other side moved (it answered): the limit counts anew from the next turn.
    pub(crate) fn restart(&mut self) {
        self.since = None;
    }
}

/// Writes one frame into `p` if it has room now, ringing the doorbell on `s` if the consumer
/// sleeps; false (nothing written) when it has not. The one way a producer writes, on a
/// channel's ring and on a session's events ring alike.
pub(crate) fn push_ringing(p: &mut Producer, s: &UnixStream, frame: &[u8]) -> io::Result<bool> {
    Ok(push_and_ring(p, s, frame)?.is_some())
}

/// [`push_ringing`], saying more: `None` when nothing was written, else whether the doorbell
/// was rung (the consumer sleeps).
fn push_and_ring(p: &mut Producer, s: &UnixStream, frame: &[u8]) -> io::Result<Option<bool>> {
    let pushed = p.push(frame).map_err(corrupt)?;
    if pushed == Some(true) {
        ring(s)?;
    }
    Ok(pushed)
}

/// Rings the doorbell: one byte on the channel's socket. One the socket cannot take now is
/// not needed: bytes are waiting there already.
fn ring(s: &UnixStream) -> io::Result<()> {
    match rustix::net::send(
        s,
        &[1],
        rustix::net::SendFlags::DONTWAIT | rustix::net::SendFlags::NOSIGNAL,
    ) {
        Ok(_) | Err(rustix::io::Errno::AGAIN) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Reads what a channel's socket holds without waiting: doorbell bytes are dropped. False
/// when the other side is gone (end of stream or an error).
pub(crate) fn drain_doorbells(s: &UnixStream) -> bool {
    take_doorbells(s).is_some()
}

/// Most reads of one drain. A peer rings once per sleep of ours, so a few bytes at most wait
/// here; one that keeps writing must not hold the reader in this loop (the daemon's ring
/// thread serves every client's channels and looks at its stop flag between drains): what
/// is left waits for the next drain.
const DRAIN_READS: usize = 16;

/// [`drain_doorbells`], saying whether a doorbell was read: `Some(true)` when one was (a
/// frame published before it is in the ring now), `None` when the other side is gone.
pub(crate) fn take_doorbells(s: &UnixStream) -> Option<bool> {
    let mut b = [0u8; 64];
    let mut rang = false;
    for _ in 0..DRAIN_READS {
        match rustix::net::recv(s, &mut b, rustix::net::RecvFlags::DONTWAIT) {
            Ok((0, _)) => return None,
            Ok(_) => rang = true,
            Err(rustix::io::Errno::INTR) => {}
            Err(rustix::io::Errno::AGAIN) => return Some(rang),
            Err(_) => return None,
        }
    }
    Some(rang)
}

/// Sleeps until the socket has a byte (the doorbell: all are read) or the other side is gone
/// (an error).
fn sleep_on(s: &UnixStream) -> io::Result<()> {
    use rustix::event::{poll, PollFd, PollFlags};
    let mut fds = [PollFd::new(s, PollFlags::IN)];
    match poll(&mut fds, None) {
        Ok(_) | Err(rustix::io::Errno::INTR) => {}
        Err(e) => return Err(e.into()),
    }
    if drain_doorbells(s) {
        Ok(())
    } else {
        Err(io::ErrorKind::UnexpectedEof.into())
    }
}

/// Writes `frame` whole with `fd` attached (`SCM_RIGHTS`, with the first bytes).
pub(crate) fn send_with_fd(s: &UnixStream, frame: &[u8], fd: impl AsFd) -> io::Result<()> {
    use rustix::net::{sendmsg, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    use std::mem::MaybeUninit;
    let fds = [fd.as_fd()];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(io::Error::other("no room for the descriptor"));
    }
    let n = loop {
        match sendmsg(
            s,
            &[io::IoSlice::new(frame)],
            &mut control,
            SendFlags::NOSIGNAL,
        ) {
            Ok(n) => break n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    };
    crate::spin::send_all(s, &frame[n..])
}

/// Reads one frame from `s` (a 12-byte header, then its body) and the descriptor that came
/// with its first bytes, if any. Nothing else may be queued on the socket before it.
pub(crate) fn recv_with_fd(
    s: &UnixStream,
    max: usize,
) -> io::Result<(crate::proto::Header, Vec<u8>, Option<OwnedFd>)> {
    use rustix::net::{recvmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    use std::io::Read;
    use std::mem::MaybeUninit;
    let mut hb = [0u8; 12];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let n = loop {
        match recvmsg(
            s,
            &mut [io::IoSliceMut::new(&mut hb)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(m) => break m.bytes,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    };
    let mut fd = None;
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = m {
            for f in fds {
                // One is expected; any more are closed here.
                fd.get_or_insert(f);
            }
        }
    }
    if n == 0 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    let mut r = s;
    r.read_exact(&mut hb[n..])?;
    let h = crate::proto::Header::parse(&hb)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
    if h.body_len() > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "an answer longer than the limit",
        ));
    }
    let mut body = vec![0u8; h.body_len()];
    r.read_exact(&mut body)?;
    Ok((h, body, fd))
}

#[cfg(test)]
mod tests {
    use super::{ShmEnd, FULL_FOR, LATE_OFF, UNYIELDING_OFF};
    use std::os::unix::net::UnixStream;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    /// A daemon's end and a client's end of one mapped channel, the client's command ring
    /// filled with `frame`s until no more goes in; returns how many went in.
    fn full_channel(frame: &[u8]) -> (ShmEnd, ShmEnd, usize) {
        let (daemon, mut client) = channel(Duration::ZERO);
        let mut n = 0;
        while client.try_send(frame).unwrap() {
            n += 1;
        }
        assert!(n > 0);
        (daemon, client, n)
    }

    /// A send into a full ring waits for room and goes in once the other side reads; the
    /// frames come out whole and in order.
    #[test]
    fn a_send_into_a_full_ring_goes_in_once_the_reader_makes_room() {
        let frame = [7u8; 1000];
        let (mut daemon, mut client, n) = full_channel(&frame);
        let reader = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            let mut got = 0;
            let deadline = Instant::now() + Duration::from_secs(30);
            while got < n + 1 && Instant::now() < deadline {
                match daemon.try_recv(4096).unwrap() {
                    Some(f) => {
                        assert_eq!(f, &[7u8; 1000][..]);
                        got += 1;
                    }
                    None => std::thread::yield_now(),
                }
            }
            got
        });
        client.send(&frame).unwrap();
        assert_eq!(reader.join().unwrap(), n + 1);
    }

    /// A client that does not read its answers: the daemon's send gives up after
    /// `FULL_FOR` with `TimedOut`, and the ring holds what it held.
    #[test]
    fn a_send_into_a_ring_nobody_reads_gives_up_with_timed_out() {
        let frame = [1u8; 1000];
        let (mut daemon, mut client) = channel(Duration::ZERO);
        let mut n = 0;
        while daemon.try_send(&frame).unwrap() {
            n += 1;
        }
        let t0 = Instant::now();
        let e = daemon.send(&frame).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
        assert!(t0.elapsed() >= FULL_FOR);
        let mut left = 0;
        while client.try_recv(4096).unwrap().is_some() {
            left += 1;
        }
        assert_eq!(left, n);
    }

    /// A daemon that takes no commands for longer than the daemon's own limit (busy with
    /// other clients, or descheduled) does not make the client give its channel up: the
    /// client's send waits, and goes in once the daemon reads again.
    #[test]
    fn a_client_waits_out_a_daemon_stalled_past_a_second() {
        let frame = [3u8; 1000];
        let (mut daemon, mut client, n) = full_channel(&frame);
        let reader = std::thread::spawn(move || {
            std::thread::sleep(FULL_FOR + Duration::from_millis(500));
            let mut got = 0;
            let deadline = Instant::now() + Duration::from_secs(30);
            while got < n + 1 && Instant::now() < deadline {
                if daemon.try_recv(4096).unwrap().is_some() {
                    got += 1;
                }
            }
            got
        });
        client
            .send(&frame)
            .expect("the send waits for the stalled daemon");
        assert_eq!(reader.join().unwrap(), n + 1);
    }

    /// The other side is gone: the send fails with `BrokenPipe` rather than waiting for
    /// room that will never come.
    #[test]
    fn a_send_into_the_full_ring_of_a_hung_up_side_is_a_broken_pipe() {
        let frame = [2u8; 1000];
        let (daemon, mut client, _) = full_channel(&frame);
        drop(daemon);
        let e = client.send(&frame).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe);
    }

    /// A daemon's end and a client's end of one mapped channel, the client polling for `spin`.
    fn channel(spin: Duration) -> (ShmEnd, ShmEnd) {
        let (a, b) = UnixStream::pair().unwrap();
        let (daemon, fd) = ShmEnd::daemon(a).unwrap();
        let client = ShmEnd::client(b, &fd, spin).unwrap();
        (daemon, client)
    }

    /// Two CPUs this process may run on, if it may run on two.
    fn two_cpus() -> Option<(usize, usize)> {
        let set = rustix::thread::sched_getaffinity(None).ok()?;
        let mut cpus = (0..rustix::thread::CpuSet::MAX_CPU).filter(|&c| set.is_set(c));
        Some((cpus.next()?, cpus.next()?))
    }

    fn pin(cpu: usize) {
        let mut set = rustix::thread::CpuSet::new();
        set.set(cpu);
        rustix::thread::sched_setaffinity(None, &set).expect("pin");
    }

    /// Holds the echo of `with_echo` between two commands. A flag alone would race: an echo
    /// that had just looked at it could still take the next command.
    #[derive(Default)]
    struct Pause {
        asked: AtomicBool,
        held: AtomicBool,
    }

    impl Pause {
        /// Returns once the echo has stopped taking commands.
        fn hold(&self) {
            self.asked.store(true, Ordering::SeqCst);
            while !self.held.load(Ordering::SeqCst) {
                std::hint::spin_loop();
            }
        }

        /// Returns once the echo takes commands again (so that the next `hold` waits for
        /// it to stop anew).
        fn release(&self) {
            self.asked.store(false, Ordering::SeqCst);
            while self.held.load(Ordering::SeqCst) {
                std::hint::spin_loop();
            }
        }
    }

    /// Sets its flag when dropped: the echo stops however the test's part ends (a failed
    /// assertion must fail the test, not leave the scope waiting for the echo).
    struct StopOnDrop<'a>(&'a AtomicBool);

    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }

    /// Runs `f` while another thread (on `cpu`) answers every command on `daemon` with its
    /// own bytes, polling without a pause and showing its CPU's pollers that it is of this
    /// process, as a ring thread does; it takes nothing while `pause` holds it.
    fn with_echo<R>(daemon: ShmEnd, cpu: Option<usize>, pause: &Pause, f: impl FnOnce() -> R) -> R {
        with_echo_slow(daemon, cpu, pause, &AtomicBool::new(false), f)
    }

    /// [`with_echo`], whose echo, while `slow` is set, takes a command at once but answers
    /// it 200 µs later (a daemon that runs but is busy).
    fn with_echo_slow<R>(
        mut daemon: ShmEnd,
        cpu: Option<usize>,
        pause: &Pause,
        slow: &AtomicBool,
        f: impl FnOnce() -> R,
    ) -> R {
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                if let Some(c) = cpu {
                    pin(c);
                }
                while !stop.load(Ordering::Relaxed) {
                    rcm::look_here();
                    if pause.asked.load(Ordering::SeqCst) {
                        pause.held.store(true, Ordering::SeqCst);
                        std::hint::spin_loop();
                        continue;
                    }
                    pause.held.store(false, Ordering::SeqCst);
                    if let Some(frame) = daemon.try_recv(4096).unwrap() {
                        let frame = frame.to_vec();
                        if slow.load(Ordering::Relaxed) {
                            let t = Instant::now();
                            while t.elapsed() < Duration::from_micros(200) {
                                std::hint::spin_loop();
                            }
                        }
                        assert!(daemon.try_send(&frame).unwrap());
                    } else {
                        std::hint::spin_loop();
                    }
                }
                // Stopped (the test's part ended, maybe failed): no `release` waits on it.
                pause.held.store(false, Ordering::SeqCst);
            });
            let _stop = StopOnDrop(&stop);
            f()
        })
    }

    /// One call: `frame` out, its echo back.
    fn call(client: &mut ShmEnd, frame: &[u8]) {
        assert!(client.try_send(frame).unwrap());
        assert_eq!(client.recv(64).unwrap(), frame);
    }

    /// With the daemon's side polling on another CPU, answers are found without a yield; a
    /// command it does not take in time (its thread not running: here, paused) is waited
    /// for as before, and the next UNYIELDING_OFF waits start with a yield, though the
    /// answers then come as fast.
    #[test]
    fn a_command_not_taken_at_once_turns_the_unyielding_look_off_for_a_while() {
        let Some((here, there)) = two_cpus() else {
            eprintln!("skipped: this process may run on one CPU only");
            return;
        };
        pin(here);
        let (daemon, mut client) = channel(Duration::from_millis(1));
        let pause = Pause::default();
        with_echo(daemon, Some(there), &pause, || {
            turns_off_for(&mut client, UNYIELDING_OFF, |client| {
                pause.hold();
                assert!(client.try_send(b"late").unwrap());
                std::thread::scope(|s| {
                    s.spawn(|| {
                        std::thread::sleep(Duration::from_millis(20));
                        pause.release();
                    });
                    assert_eq!(client.recv(64).unwrap(), b"late");
                });
            });
        });
    }

    /// Runs `late` (one call whose wait should turn the unyielding look off for `n` waits)
    /// after a call found unyielding, then checks those `n` waits. The echo's CPU is shared
    /// with whatever else runs on the machine, and an echo descheduled for a few µs at the
    /// wrong moment turns the look off for another count (UNYIELDING_OFF where a busy echo
    /// gave LATE_OFF; none when this thread was the one held off until the answer was
    /// there): such a try is let run out and made again, a few times at most.
    fn turns_off_for(client: &mut ShmEnd, n: u8, mut late: impl FnMut(&mut ShmEnd)) {
        let mut seen = Vec::new();
        for _ in 0..5 {
            let got = until_unyielding(client);
            late(client);
            if client.unyielding_off == n {
                waits_yield_first(client, n, got);
                return;
            }
            seen.push(client.unyielding_off);
            for k in 0..client.unyielding_off {
                call(client, &[k; 8]);
            }
        }
        panic!("the look was off for {seen:?} waits, never for {n}");
    }

    /// Calls until one answer is found without a yield (the echo's thread may take a while
    /// to start) and no late answer left the look off: how many were found so.
    fn until_unyielding(client: &mut ShmEnd) -> u32 {
        let calls = 100_000u32;
        let mut k = 0;
        while (client.unyielding_got == 0 || client.unyielding_off > 0) && k < calls {
            call(client, &k.to_le_bytes());
            k += 1;
        }
        assert!(
            client.unyielding_got > 0,
            "no answer of {calls} found without a yield"
        );
        assert_eq!(client.unyielding_off, 0);
        client.unyielding_got
    }

    /// The look is off for exactly `n` waits: each of them starts with a yield (none is
    /// found without one, past `got`), and it is on again after them.
    fn waits_yield_first(client: &mut ShmEnd, n: u8, got: u32) {
        assert_eq!(client.unyielding_off, n);
        for k in 0..n {
            call(client, &[k; 8]);
            assert_eq!(client.unyielding_got, got, "wait {k} started with a yield");
        }
        assert_eq!(client.unyielding_off, 0);
    }

    /// A command the daemon's side takes at once but answers late (it runs, but is busy) is
    /// still answered, and turns the unyielding look off for the next LATE_OFF waits only.
    #[test]
    fn a_command_taken_but_answered_late_turns_the_look_off_for_fewer_waits() {
        let Some((here, there)) = two_cpus() else {
            eprintln!("skipped: this process may run on one CPU only");
            return;
        };
        pin(here);
        let (daemon, mut client) = channel(Duration::from_millis(1));
        let slow = AtomicBool::new(false);
        with_echo_slow(daemon, Some(there), &Pause::default(), &slow, || {
            turns_off_for(&mut client, LATE_OFF, |client| {
                slow.store(true, Ordering::Relaxed);
                call(client, b"busy");
                slow.store(false, Ordering::Relaxed);
            });
        });
    }

    /// A client that does not poll (spin zero) never looks without yielding: its waits sleep.
    #[test]
    fn a_client_that_does_not_poll_does_not_look_unyielding() {
        let (daemon, mut client) = channel(Duration::ZERO);
        with_echo(daemon, None, &Pause::default(), || {
            for k in 0..200u32 {
                call(&mut client, &k.to_le_bytes());
            }
        });
        assert_eq!(client.unyielding_got, 0);
    }
}
