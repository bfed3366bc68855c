//! The client library: the `rcm` API over a daemon's socket. [`fabric`] gives an
//! [`rcm::Fabric`] whose ids live in the daemon; the application code is the same as with
//! in-process devices.
//!
//! One connection is one daemon session; unless the daemon declines, what it writes for the
//! session comes through a ring in shared memory (`MAP_EVENTS`, see [`crate::shmchan`]),
//! the socket then bringing only doorbells and the daemon's end. A reader thread feeds its
//! events to the ids' sinks;
//! callbacks run on the fabric's own dispatcher threads, so they may make blocking calls, or
//! with [`rcm::CallbackMode::Inline`] on the reader itself, after each batch of events it
//! read (one thread hop less per event; the mode's rules for callbacks apply).
//! Calls go on *command channels*: further connections attached to the session, each used
//! by one calling thread at a time, which writes its command and reads the reply itself (a
//! reply then wakes one thread, not the reader and then the caller). When no channel can be
//! had, a call goes on the session's connection and the reader hands the reply over. What
//! goes on the session's connection (such calls, event credit, releases without a channel)
//! is written by a thread of its own, in order, so the reader never waits on a full socket.
//! Losing the daemon is a device removal for every id; a call waiting for its answer then
//! fails with `DeviceRemoved`, also when the reader is held by an inline callback (the
//! caller looks for the hang-up itself, every 100 ms).
//!
//! A thread with an [`rcm::Pipeline`] open writes its answerless calls (`bind`, which the
//! daemon's refusal then seals the id with, `resolve_addr`, `resolve_route`, `connect`,
//! `accept`, `establish`, `disconnect` of an id whose ESTABLISHED came, and `create_id`
//! under a handle it chooses) on a mapped channel it keeps, without waiting for their
//! answers; its later calls to the session go on that channel behind them, and the answers
//! are read (a failure becomes the id's error event) when the pipeline ends or before the
//! thread waits (docs/ucm-protocol.md §2.2).
//!
//! A thread that called one of the session's ids and then waits in
//! [`rcm::EventChannel::get_event`] reads the session's connection itself while it polls
//! (busy polling, [`rcm::remote::BusyPoll`]): it handles what came as the reader would, and
//! takes its own event without a hand-over from the reader, which stands aside until the
//! poll's deadline (one polling thread fewer on the CPUs). One thread at a time receives and
//! handles frames, so they are handled in the order they came.

use crate::proto::{
    self, decode_message, Answer, Command, Header, Limits, Message, SessionStats, WireError,
    WireEvent,
};
use crate::spin::{hung_up, send_all, SpinRead};
use rcm::remote::{Op, Provider, RemoteId, Reply, Sink};
use rcm::{Error, Event, Fabric, FabricConfig, PortSpace, QpAttr, QpState};
use std::io::{BufReader, Read};
use std::net::IpAddr;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard, Weak};

/// A thread writing pipelined calls yields its CPU once every this many commands of its
/// session (see `Inner::write_owed`).
const PIPELINE_YIELD_EVERY: u32 = 32;
/// Event credit granted to the daemon at a time.
const WINDOW: u32 = 4096;
/// Largest frame accepted from the daemon.
const MAX_FRAME: usize = 1 << 20;
/// Command channels a client opens at most (the daemon allows `daemon::MAX_CHANNELS`).
const CHANNELS: usize = 8;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

type Waiter = mpsc::SyncSender<Result<Answer, WireError>>;

/// What an answer on the session's connection is for.
enum Pending {
    /// A call waiting for it.
    Call(Waiter),
    /// The `DESTROY_ID` of this handle, which nobody waits for (see `Handle::release`).
    Release(u32),
}

/// The session's ids by handle, and the handles of ids destroyed whose events may still be
/// on their way (protocol §8): such a handle is not chosen for a new id until the events
/// handled have reached the count that its `DESTROY_ID` was answered with (`u64::MAX` while
/// that answer has not come), or a late event of the old id would go to the new one.
#[derive(Default)]
struct Sinks {
    live: foldhash::HashMap<u32, (Sink, Arc<IdCache>)>,
    draining: foldhash::HashMap<u32, u64>,
    /// `draining` is cleared of the handles that are free again when it grows to this.
    prune_at: usize,
}

impl Sinks {
    /// Whether `h` may not be chosen for a new id now that `seen` events were handled.
    fn holds(&self, h: u32, seen: u64) -> bool {
        self.live.contains_key(&h) || self.draining.get(&h).is_some_and(|&n| n > seen)
    }

    /// `h` drains until `seen` reaches `until`.
    fn drain_until(&mut self, h: u32, until: u64, seen: u64) {
        self.draining.insert(h, until);
        if self.draining.len() >= self.prune_at {
            self.draining.retain(|_, n| *n > seen);
            rcm_proto::room::shrink_map(&mut self.draining);
            self.prune_at = (2 * self.draining.len()).max(64);
        }
    }
}

struct Inner {
    /// Frames for the session's connection, written in order by its writer thread: whoever
    /// sends (the reader giving credit back, a release, a call without a channel) never
    /// blocks on the socket. The reader must not: if it did, with the daemon blocked writing
    /// to this client and the socket full both ways, the session would hang for good.
    out: mpsc::Sender<Vec<u8>>,
    /// By the sequence numbers and handles this session chose or the daemon handed out (a
    /// fast hash: neither is a value the daemon's other clients pick).
    pending: Mutex<foldhash::HashMap<u32, Pending>>,
    seq: AtomicU32,
    /// The next handle this client chooses for an id it creates, counted within
    /// `proto::CLIENT_HANDLES` and above.
    next_handle: AtomicU32,
    sinks: Mutex<Sinks>,
    /// `EVENT` frames handled since the session opened, each counted once its id's sink
    /// was looked for: the count that `DESTROY_ID`'s answer is compared with.
    events_seen: AtomicU64,
    alive: AtomicBool,
    token: u64,
    limits: Limits,
    stream: UnixStream,
    path: PathBuf,
    /// Command channels not in use.
    idle: Mutex<Vec<Chan>>,
    /// Command channels open (idle or in use).
    channels: AtomicUsize,
    /// Command channels attached and not failed: while there is one, a call that must not
    /// wait for the reader can wait for a channel to be idle instead (channel calls never
    /// need the reader).
    attached: AtomicUsize,
    /// The reader runs callbacks (`CallbackMode::Inline`): then no call may wait for an
    /// answer on the session's connection while a channel exists, since the reader may be
    /// held by a callback waiting for that caller (a lock of the application's, say).
    inline: bool,
    /// Callers waiting for an idle channel.
    idle_waiters: AtomicUsize,
    /// The reader waits for an idle channel: it goes first (other callers leave idle
    /// channels to it), or a busy session could keep it, and its events, waiting.
    reader_waiting: AtomicBool,
    idle_cond: Condvar,
    /// The reader thread, joined by `shutdown` so no callback it runs outlives that.
    reader: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Set when the daemon refused a channel: calls use the session's connection.
    no_channels: AtomicBool,
    /// Set when the daemon declined to map a channel: later ones stay on their sockets too.
    no_shm: AtomicBool,
    /// Command channels that were mapped into shared memory.
    mapped: AtomicUsize,
    /// No channel is attached before this (a refusal that may pass: the daemon's connection
    /// limit, a socket error), so calls meanwhile do not each knock and be turned away.
    attach_after: Mutex<Option<std::time::Instant>>,
    /// How long reading threads poll before they sleep.
    spin: std::time::Duration,
    /// What was read from the session's connection and not handled yet. Whoever holds it
    /// (the reader, or a thread waiting for an event that polls the session: see
    /// `BusyPoll for Inner`) receives and handles frames, so they are handled in the order
    /// they came; nobody waits for it (`try_lock`).
    rx: Mutex<RxSide>,
    /// Whether a waiter polls the session: the reader stands aside until its deadline.
    gate: rcm::remote::RxGate,
    /// The daemon's end was read by a polling waiter: the reader must not stand aside, it
    /// ends the session.
    ended: AtomicBool,
    /// Frames handled by polling waiters (see [`Client::busy_polled`]).
    polled: AtomicU64,
    /// The reader thread, unparked when it must stop standing aside.
    reader_thread: std::sync::OnceLock<std::thread::Thread>,
    /// This session, for the handles of the connect requests it delivers.
    me: Weak<Inner>,
}

/// The receive side of the session's connection (see `Inner::rx`).
struct RxSide {
    /// `buf[..filled]` was received and not handled (the start of a frame).
    buf: Vec<u8>,
    filled: usize,
    /// Events handled since credit was last given back.
    used: u32,
    /// The events ring, once the daemon mapped the session's events (`MAP_EVENTS`): what
    /// it writes for the session comes there, and the socket brings only doorbells and the
    /// daemon's end. `buf` then holds the frame taken last.
    ring: Option<rcm_shm::Consumer>,
    /// Looks at the ring that found nothing since the socket was last read.
    idle_looks: u32,
}

/// Looks at an empty events ring between two reads of the socket (for the daemon's end):
/// one system call per this many looks of a polling thread, instead of each.
const RING_LOOKS_PER_SOCKET_READ: u32 = 32;

/// Asks the daemon to write the session's events and replies into shared memory
/// (`MAP_EVENTS`, §2.3 of the protocol): the ring's consumer, or `None` when the daemon
/// declines (its choice, or a daemon that does not know the command) and the socket goes
/// on as before.
fn map_events(s: &UnixStream) -> rcm::Result<Option<rcm_shm::Consumer>> {
    send_all(s, &Command::MapEvents.encode(2))?;
    let (h, body, fd) = crate::shmchan::recv_with_fd(s, MAX_FRAME)?;
    match (decode_message(h.kind, &body), fd) {
        (Ok(Message::Ok(_)), Some(fd)) if h.seq == 2 => crate::shmchan::events_client(&fd)
            .map(Some)
            .map_err(|e| Error::Remote(format!("the daemon's shared memory: {e}"))),
        (Ok(Message::Err(e)), _) if h.seq == 2 => {
            tracing::debug!(error = %e, "the daemon keeps the session's events on its socket");
            Ok(None)
        }
        _ => Err(Error::Remote("unexpected answer to MapEvents".into())),
    }
}

/// What one look at the session's connection found.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Look {
    /// Nothing to read, or another thread is reading.
    Nothing,
    /// Bytes were received; this many whole frames were handled.
    Got(usize),
    /// The daemon's end (or a socket or framing error): the session is over.
    Ended,
}

/// Looks (`look`: one batch of the events ring each) until the ring is empty: what a
/// consumed doorbell announced is all taken. The frames handled, or how it ended.
fn drain_after_doorbell(mut look: impl FnMut() -> Look) -> Look {
    let mut frames = 0;
    loop {
        match look() {
            Look::Got(n) => {
                frames += n;
                if n < RING_BATCH {
                    break;
                }
            }
            Look::Nothing => break,
            Look::Ended => return Look::Ended,
        }
    }
    if frames > 0 {
        Look::Got(frames)
    } else {
        Look::Nothing
    }
}

/// Bytes the session's receive buffer starts with (grown for a longer frame).
const RX_BUF: usize = 16 * 1024;
/// Frames taken from the events ring in one look, as one socket receive brings a batch.
const RING_BATCH: usize = 256;

impl Drop for Inner {
    /// The reader holds its own descriptor of the socket: shutting it down ends the session
    /// (at the daemon too) and the reader with it, as when a fabric shuts down.
    fn drop(&mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        self.end_reader();
    }
}

/// A session with a daemon; a [`Provider`] for [`Fabric::with_provider`].
///
/// One session serves one fabric: the fabric's shutdown (or its last handle's drop) ends
/// the session. Clones share the session, so a `Client` given to two fabrics is ended by
/// whichever shuts down first, and the other's ids then see `DeviceRemoval`; give each
/// fabric its own (as [`fabric`] and [`fabric_with`] do).
#[derive(Clone)]
pub struct Client(Arc<Inner>);

/// An rcm fabric served by the daemon at `path`.
pub fn fabric(path: impl AsRef<Path>) -> rcm::Result<Fabric> {
    fabric_with(path, FabricConfig::default())
}

/// Like [`fabric`], with a configuration (only `dispatcher_threads`, `spin` and
/// `callbacks` matter; see [`Client::connect_for`]).
pub fn fabric_with(path: impl AsRef<Path>, cfg: FabricConfig) -> rcm::Result<Fabric> {
    let c = Client::connect_for(path, &cfg)?;
    Ok(Fabric::with_provider(Arc::new(c), cfg))
}

/// The daemon socket named by the `RCM_DAEMON` environment variable, if set: how an
/// application picks the daemon over in-process devices by configuration alone.
pub fn daemon_from_env() -> Option<std::path::PathBuf> {
    std::env::var_os("RCM_DAEMON")
        .filter(|v| !v.is_empty())
        .map(Into::into)
}

/// How long a session makes its calls without a channel after an attach was turned away
/// for a reason that may pass.
const ATTACH_RETRY_AFTER: std::time::Duration = std::time::Duration::from_millis(100);

/// Sends the first command of a connection (`HELLO`, `ATTACH`). A daemon at its connection
/// limit answers and closes without reading it, so the send may fail (`EPIPE`) with the
/// daemon's refusal waiting to be read: that refusal is the error, not the broken pipe.
fn send_first(s: &UnixStream, frame: &[u8]) -> rcm::Result<()> {
    let Err(e) = send_all(s, frame) else {
        return Ok(());
    };
    let _ = s.set_read_timeout(Some(std::time::Duration::from_millis(100)));
    let mut body = Vec::new();
    if let Ok(h) = read_frame(&mut &*s, &mut body) {
        if let Ok(Message::Err(w)) = decode_message(h.kind, &body) {
            return Err(w.into_cm());
        }
    }
    Err(e.into())
}

fn read_frame(s: &mut impl Read, body: &mut Vec<u8>) -> std::io::Result<Header> {
    let mut hb = [0u8; 12];
    s.read_exact(&mut hb)?;
    let h = Header::parse(&hb)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))?;
    if h.frame_len() > MAX_FRAME {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "frame from the daemon is too long",
        ));
    }
    body.resize(h.body_len(), 0);
    s.read_exact(body)?;
    Ok(h)
}

impl Client {
    /// Opens a session with the daemon at `path`.
    pub fn connect(path: impl AsRef<Path>) -> rcm::Result<Client> {
        Self::connect_with(path, rcm::DEFAULT_SPIN)
    }

    /// Opens a session whose reading threads poll for `spin` before they sleep (see
    /// [`rcm::FabricConfig::spin`]).
    pub fn connect_with(path: impl AsRef<Path>, spin: std::time::Duration) -> rcm::Result<Client> {
        Self::open(path.as_ref(), spin, false)
    }

    /// Opens a session for a fabric with configuration `cfg`: its reading threads poll for
    /// `cfg.spin`, and with [`rcm::CallbackMode::Inline`] the session's reader runs the
    /// callbacks of the events it read itself, after each batch (a thread hop less per
    /// event), instead of handing them to the fabric's dispatcher threads. Every call of the
    /// session then goes on a command channel, waiting for one to be idle when all are busy
    /// (a channel's answer never needs the reader; the reader's own calls go first), so that
    /// no caller waits for the reader while a callback there waits for that caller. The
    /// mode's rules apply: a callback must not wait for another id's callback, and one that
    /// blocks holds back every event of the session. Until the session has a command
    /// channel (with a daemon that refuses them all: always), callbacks run on the
    /// dispatcher threads. A batch is what one receive brought; its callbacks run before the
    /// reader receives again, also when it ended inside a frame. Events that a thread waiting
    /// in `get_event` received itself (busy polling, see the module doc) run their callbacks
    /// on the dispatcher threads, never on that thread.
    pub fn connect_for(path: impl AsRef<Path>, cfg: &FabricConfig) -> rcm::Result<Client> {
        Self::open(
            path.as_ref(),
            cfg.spin,
            cfg.callbacks == rcm::CallbackMode::Inline,
        )
    }

    fn open(path: &Path, spin: std::time::Duration, inline: bool) -> rcm::Result<Client> {
        let mut s = UnixStream::connect(path)
            .map_err(|e| Error::Io(format!("daemon socket {}: {e}", path.display())))?;
        send_first(
            &s,
            &Command::Hello {
                min: proto::VERSION,
                max: proto::VERSION,
            }
            .encode(1),
        )?;
        let mut body = Vec::new();
        let h = read_frame(&mut s, &mut body)?;
        let (token, limits) = match decode_message(h.kind, &body) {
            Ok(Message::HelloOk { token, limits, .. }) => (token, limits),
            Ok(Message::Err(e)) => return Err(e.into_cm()),
            Ok(_) => return Err(Error::Remote("unexpected answer to Hello".into())),
            Err(e) => return Err(Error::Remote(format!("bad answer to Hello: {e}"))),
        };
        // Before the first credit, so that no event can be on the socket yet.
        let ring = map_events(&s)?;
        send_all(&s, &Command::GetEvent(WINDOW).encode(0))?;
        let (out, frames) = mpsc::channel::<Vec<u8>>();
        let wire = s.try_clone()?;
        std::thread::Builder::new()
            .name("rcm-ucm-out".into())
            .spawn(move || {
                // Ends when the session ends (every sender gone) or the socket fails; a failed
                // write shuts the connection down, so the reader sees the end and fails the
                // calls waiting for answers.
                for frame in frames {
                    if send_all(&wire, &frame).is_err() {
                        let _ = wire.shutdown(std::net::Shutdown::Both);
                        return;
                    }
                }
            })?;
        let stream = s.try_clone()?;
        let inner = Arc::new_cyclic(|me| Inner {
            out,
            pending: Mutex::new(foldhash::HashMap::default()),
            seq: AtomicU32::new(3),
            next_handle: AtomicU32::new(0),
            sinks: Mutex::new(Sinks::default()),
            events_seen: AtomicU64::new(0),
            alive: AtomicBool::new(true),
            token,
            limits,
            stream,
            path: path.to_owned(),
            idle: Mutex::new(Vec::new()),
            channels: AtomicUsize::new(0),
            attached: AtomicUsize::new(0),
            inline,
            idle_waiters: AtomicUsize::new(0),
            reader_waiting: AtomicBool::new(false),
            idle_cond: Condvar::new(),
            reader: Mutex::new(None),
            no_channels: AtomicBool::new(false),
            no_shm: AtomicBool::new(false),
            mapped: AtomicUsize::new(0),
            attach_after: Mutex::new(None),
            spin,
            rx: Mutex::new(RxSide {
                buf: vec![0; RX_BUF],
                filled: 0,
                used: 0,
                ring,
                idle_looks: 0,
            }),
            gate: rcm::remote::RxGate::new(),
            ended: AtomicBool::new(false),
            polled: AtomicU64::new(0),
            reader_thread: std::sync::OnceLock::new(),
            me: me.clone(),
        });
        let weak = Arc::downgrade(&inner);
        let h = std::thread::Builder::new()
            .name("rcm-ucm-client".into())
            .spawn(move || {
                rcm::remote::mark_provider_thread();
                ON_READER.with(|f| f.set(Weak::as_ptr(&weak).addr()));
                reader(&weak, &s, inline);
            })?;
        let _ = inner.reader_thread.set(h.thread().clone());
        *lock(&inner.reader) = Some(h);
        Ok(Client(inner))
    }

    /// Moves the counter by which the client chooses its ids' handles to `n` (taken within
    /// the client's range, `proto::CLIENT_HANDLES` and above): for tests that must see the
    /// counter come round to handles in use or destroyed, which otherwise takes 2^31 creates.
    #[doc(hidden)]
    pub fn set_handle_counter(&self, n: u32) {
        self.0.next_handle.store(n, Ordering::Relaxed);
    }

    /// Handles of destroyed ids that the client does not choose again yet: their destroys'
    /// answers have not come, or events they count have not been taken (protocol §8).
    #[doc(hidden)]
    pub fn handles_draining(&self) -> usize {
        let seen = self.0.events_seen.load(Ordering::Acquire);
        let sinks = lock(&self.0.sinks);
        sinks.draining.values().filter(|&&n| n > seen).count()
    }

    /// This session's token: another session of the same client takes an id from this one
    /// with `MigrateId` naming it.
    pub fn token(&self) -> u64 {
        self.0.token
    }

    /// The limits the daemon applies to this session.
    pub fn limits(&self) -> Limits {
        self.0.limits
    }

    /// This session's counters at the daemon.
    pub fn stats(&self) -> rcm::Result<SessionStats> {
        match self.0.request(&Command::Stats)? {
            Answer::Stats(s) => Ok(s),
            _ => Err(Error::Remote("unexpected answer to Stats".into())),
        }
    }

    /// Ids of this session whose events this client delivers (for leak checks): created and
    /// not yet destroyed, connect requests' children included.
    pub fn held_ids(&self) -> usize {
        lock(&self.0.sinks).live.len()
    }

    /// Command channels of this session that the daemon mapped into shared memory (see
    /// [`crate::shmchan`]); the others carry their calls on their sockets.
    pub fn mapped_channels(&self) -> usize {
        self.0.mapped.load(Ordering::Relaxed)
    }

    /// Whether the daemon writes this session's events (and replies) into shared memory
    /// (`MAP_EVENTS`, see [`crate::shmchan`]) rather than on its socket.
    pub fn events_mapped(&self) -> bool {
        lock(&self.0.rx).ring.is_some()
    }

    /// Whether the session is still up.
    pub fn is_alive(&self) -> bool {
        self.0.alive.load(Ordering::SeqCst)
    }

    /// Frames from the daemon (events and answers) that threads waiting in
    /// [`rcm::EventChannel::get_event`] received and handled themselves (busy polling, see
    /// [`rcm::remote::BusyPoll`]) instead of this session's reader thread.
    pub fn busy_polled(&self) -> u64 {
        self.0.polled.load(Ordering::Relaxed)
    }
}

impl Inner {
    fn next_seq(&self) -> u32 {
        loop {
            let s = self.seq.fetch_add(1, Ordering::Relaxed);
            if s != 0 {
                return s;
            }
        }
    }

    /// Queues a frame for the session's connection (see `Inner::out`).
    fn send(&self, frame: Vec<u8>) -> rcm::Result<()> {
        self.out.send(frame).map_err(|_| Error::DeviceRemoved)
    }

    /// An idle command channel, or a new one while fewer than [`CHANNELS`] are open.
    fn channel(&self) -> Option<Chan> {
        if let Some(c) = lock(&self.idle).pop() {
            return Some(c);
        }
        if self.no_channels.load(Ordering::Relaxed) {
            return None;
        }
        if lock(&self.attach_after).is_some_and(|t| std::time::Instant::now() < t) {
            return None;
        }
        if self.channels.fetch_add(1, Ordering::SeqCst) >= CHANNELS {
            self.channels.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        match self.attach() {
            Ok(c) => {
                self.attached.fetch_add(1, Ordering::SeqCst);
                Some(c)
            }
            Err(e) => {
                tracing::debug!(error = %e, "no command channel; this call shares the session's connection");
                // The daemon's refusal (its limit, or an older daemon) is for good; a socket
                // error (say, a full accept queue) or the daemon's connection limit is tried
                // again by a later call.
                if matches!(
                    e,
                    Error::Io(_) | Error::LimitExceeded(rcm::remote::Limit::Connections)
                ) {
                    *lock(&self.attach_after) =
                        Some(std::time::Instant::now() + ATTACH_RETRY_AFTER);
                } else {
                    self.no_channels.store(true, Ordering::Relaxed);
                }
                self.channels.fetch_sub(1, Ordering::SeqCst);
                None
            }
        }
    }

    fn attach(&self) -> rcm::Result<Chan> {
        let s = UnixStream::connect(&self.path)?;
        send_first(
            &s,
            &Command::Attach {
                min: proto::VERSION,
                max: proto::VERSION,
                token: self.token,
            }
            .encode(1),
        )?;
        let mut r = BufReader::with_capacity(4096, SpinRead::new(s, self.spin));
        let mut body = Vec::new();
        let h = read_frame(&mut r, &mut body)?;
        match decode_message(h.kind, &body) {
            Ok(Message::Ok(_)) => {}
            Ok(Message::Err(e)) => return Err(e.into_cm()),
            _ => return Err(Error::Remote("unexpected answer to Attach".into())),
        }
        let mut shm = None;
        if !self.no_shm.load(Ordering::Relaxed) {
            shm = self.map(&r)?;
            if shm.is_none() {
                self.no_shm.store(true, Ordering::Relaxed);
            } else {
                self.mapped.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(Chan {
            sock: r,
            shm,
            owed: std::collections::VecDeque::new(),
            alive: true,
        })
    }

    /// Asks the daemon to carry a new channel's calls in shared memory (`MAP_CHANNEL`, see
    /// [`crate::shmchan`]): `None` when it declines (its choice, or a daemon that does not
    /// know the command), and the channel stays on its socket.
    fn map(&self, r: &BufReader<SpinRead>) -> rcm::Result<Option<crate::shmchan::ShmEnd>> {
        // The daemon sends nothing on a channel unasked: the reader holds no bytes, and the
        // answer (with the descriptor) is read from the socket itself.
        if !r.buffer().is_empty() {
            return Err(Error::Remote("unasked bytes on a command channel".into()));
        }
        let s = &r.get_ref().stream;
        send_all(s, &Command::MapChannel.encode(2))?;
        let (h, body, fd) = crate::shmchan::recv_with_fd(s, MAX_FRAME)?;
        match (decode_message(h.kind, &body), fd) {
            (Ok(Message::Ok(_)), Some(fd)) => {
                let end = crate::shmchan::ShmEnd::client(s.try_clone()?, &fd, self.spin)
                    .map_err(|e| Error::Remote(format!("the daemon's shared memory: {e}")))?;
                Ok(Some(end))
            }
            (Ok(Message::Err(e)), _) => {
                tracing::debug!(error = %e, "the daemon keeps command channels on their sockets");
                Ok(None)
            }
            _ => Err(Error::Remote("unexpected answer to MapChannel".into())),
        }
    }

    /// One call on a command channel: write, then read the reply on the same connection.
    fn call_on(&self, mut ch: Chan, cmd: &Command) -> rcm::Result<Answer> {
        let r = self.call_with(&mut ch, cmd);
        self.give_back(ch);
        r
    }

    /// A channel goes back to the idle list, unless it failed (then it is forgotten).
    fn give_back(&self, ch: Chan) {
        if !ch.alive {
            return;
        }
        lock(&self.idle).push(ch);
        self.wake_idle_waiter();
    }

    /// One call on a channel this thread has: write, then read the reply (and, on the way,
    /// the answers owed to its pipelined calls). A channel that fails is marked dead.
    fn call_with(&self, ch: &mut Chan, cmd: &Command) -> rcm::Result<Answer> {
        let seq = self.next_seq();
        let frame = cmd.encode(seq);
        if ch.shm.is_some()
            && rcm_shm::Producer::footprint(frame.len()) > crate::shmchan::RING_BYTES as usize
        {
            // Over the daemon's message limit too (it maps channels only when its limit fits
            // a ring): its answer on a socket, given here; the channel is left as it was.
            return Err(Error::LimitExceeded(rcm::remote::Limit::MessageSize));
        }
        let mut body = Vec::new();
        let r = if ch.shm.is_some() {
            self.call_mapped(ch, &frame, seq, &mut body)
        } else {
            send_all(&ch.sock.get_ref().stream, &frame).and_then(|()| loop {
                let h = read_frame(&mut ch.sock, &mut body)?;
                if h.seq == seq {
                    break Ok(h);
                }
            })
        };
        let Ok(h) = r else {
            self.chan_failed(ch);
            return Err(Error::DeviceRemoved);
        };
        match decode_message(h.kind, &body) {
            Ok(Message::Ok(a)) => Ok(a),
            Ok(Message::Err(e)) => Err(e.into_cm()),
            Ok(_) => Err(Error::Remote("unexpected answer to a command".into())),
            Err(e) => Err(Error::Remote(format!("bad answer from the daemon: {e}"))),
        }
    }

    /// A channel failed: the daemon is gone or closed the session (the reader sees it too).
    /// What its pipelined calls were owed is lost with the session, whose ids each get a
    /// `DeviceRemoval`.
    fn chan_failed(&self, ch: &mut Chan) {
        if !std::mem::replace(&mut ch.alive, false) {
            return;
        }
        let owed = !ch.owed.is_empty();
        ch.owed.clear();
        self.channels.fetch_sub(1, Ordering::SeqCst);
        self.attached.fetch_sub(1, Ordering::SeqCst);
        // Each waiter looks again: with no channel left, each gives up.
        self.wake_idle_waiters(true);
        if owed && self.alive.load(Ordering::SeqCst) {
            // Pipelined calls went without their answers: which of them the daemon carried
            // out (the rest went with the channel's ring) is not known, so neither is what it
            // holds for this session (ids created, ids not destroyed, connects made whose
            // refusal was to come as an event). The session ends, as when the daemon is
            // lost: the daemon destroys all it held for it, and every id hears
            // DEVICE_REMOVAL.
            tracing::warn!(
                "a command channel failed with pipelined calls unanswered: ending the session"
            );
            let _ = self.stream.shutdown(std::net::Shutdown::Both);
        }
    }

    /// One call through a mapped channel: the command into the ring, then the answers out
    /// of the other until the one with its sequence number (its body into `body`); those
    /// owed to earlier pipelined calls come first and are handled on the way.
    fn call_mapped(
        &self,
        ch: &mut Chan,
        frame: &[u8],
        seq: u32,
        body: &mut Vec<u8>,
    ) -> std::io::Result<Header> {
        self.push_frame(ch, frame)?;
        self.read_answers(ch, Until::Answer(seq), body)?
            .ok_or_else(|| std::io::ErrorKind::InvalidData.into())
    }

    /// Reads a mapped channel's answers, handling those owed to pipelined calls on the way,
    /// until `until`: the header of the answer it names (its body into `body`), else `None`
    /// (`body` then holds whatever was read last).
    fn read_answers(
        &self,
        ch: &mut Chan,
        until: Until,
        body: &mut Vec<u8>,
    ) -> std::io::Result<Option<Header>> {
        loop {
            if until == Until::Settled && ch.owed.is_empty() {
                return Ok(None);
            }
            let Some(end) = ch.shm.as_mut() else {
                return Err(std::io::ErrorKind::NotConnected.into());
            };
            let f = if until == Until::Empty {
                match end.try_recv(MAX_FRAME)? {
                    Some(f) => f,
                    None => return Ok(None),
                }
            } else {
                end.recv(MAX_FRAME)?
            };
            let h = answer_head(f)?;
            // Copied out of the ring (whose end `ch` holds) into the caller's buffer, which
            // an owed answer may use too: the one named, read last, is what it keeps.
            body.clear();
            body.extend_from_slice(&f[12..]);
            if until == Until::Answer(h.seq) {
                return Ok(Some(h));
            }
            self.owed_answer(ch, h, body);
        }
    }

    /// Writes a command into a mapped channel's ring. While the ring is full, the answers
    /// that came are taken (a daemon whose answer ring is full takes no more commands from
    /// the channel, so a thread that has pipelined many calls must read while it writes).
    fn push_frame(&self, ch: &mut Chan, frame: &[u8]) -> std::io::Result<()> {
        if ch.owed.is_empty() {
            return match ch.shm.as_mut() {
                Some(end) => end.send(frame),
                None => Err(std::io::ErrorKind::NotConnected.into()),
            };
        }
        let limit = ch
            .shm
            .as_ref()
            .map_or(crate::shmchan::DAEMON_FULL_FOR, |end| end.full_for);
        let mut wait = crate::shmchan::RoomWait::new(limit);
        loop {
            let Some(end) = ch.shm.as_mut() else {
                return Err(std::io::ErrorKind::NotConnected.into());
            };
            if end.try_send(frame)? {
                return Ok(());
            }
            if self.take_answers(ch)? > 0 {
                wait.restart();
                continue;
            }
            match ch.shm.as_ref() {
                Some(end) => wait.turn(&end.stream)?,
                None => return Err(std::io::ErrorKind::NotConnected.into()),
            }
        }
    }

    /// Takes the answers a mapped channel holds now: how many of them were owed.
    fn take_answers(&self, ch: &mut Chan) -> std::io::Result<usize> {
        let before = ch.owed.len();
        self.read_answers(ch, Until::Empty, &mut Vec::new())?;
        Ok(before - ch.owed.len())
    }

    /// The answer to a pipelined call: nothing to do when it succeeded; a failure is
    /// delivered as the id's error event (see `rcm::Pipeline`). An answer owed to no call
    /// is ignored, as a stale one always was.
    fn owed_answer(&self, ch: &mut Chan, h: Header, body: &[u8]) {
        let Some(pos) = ch.owed.iter().position(|o| o.seq == h.seq) else {
            return;
        };
        // Answers come in order: any owed before this one got theirs (or never will).
        let Some(o) = ch.owed.drain(..=pos).next_back() else {
            return;
        };
        if matches!(o.kind, OwedKind::Release) {
            let r = match decode_message(h.kind, body) {
                Ok(Message::Ok(a)) => Ok(a),
                Ok(Message::Err(e)) => Err(e.into_cm()),
                _ => Err(Error::Remote("unexpected answer to a command".into())),
            };
            return self.settle_release(o.handle, &r);
        }
        let err = match decode_message(h.kind, body) {
            Ok(Message::Ok(_)) => return,
            Ok(Message::Err(e)) => e.into_cm(),
            Ok(_) => Error::Remote("unexpected answer to a command".into()),
            Err(e) => Error::Remote(format!("bad answer from the daemon: {e}")),
        };
        let ev = match o.kind {
            // Settled above.
            OwedKind::Release => return,
            OwedKind::Addr => Event::AddrError(err),
            OwedKind::Route => Event::RouteError(err),
            OwedKind::Connect | OwedKind::Create => Event::ConnectError(err),
        };
        // Released meanwhile: nobody to tell.
        let sink = lock(&self.sinks)
            .live
            .get(&o.handle)
            .map(|(s, _)| s.clone());
        if let Some(s) = sink {
            s.event(ev);
        }
    }

    /// Which error event a failed `op` on an id (of which `known` was learnt) becomes when it
    /// is pipelined; `None` for a call that returns something, or whose failure has no event
    /// to come as (see `rcm::Pipeline`).
    fn owed_kind(op: &Op, known: &IdCache) -> Option<OwedKind> {
        match op {
            // A refused bind seals the id (`Command::BindOrSeal`): the calls written behind
            // it are refused too, not carried out on an id bound elsewhere or not at all.
            Op::Bind(_) | Op::ResolveAddr { .. } => Some(OwedKind::Addr),
            Op::ResolveRoute => Some(OwedKind::Route),
            Op::Connect(_) | Op::Accept(_) | Op::Establish => Some(OwedKind::Connect),
            // Once established, a connection's disconnect succeeds (also when it is going
            // down already) unless its device is gone, which the id hears of anyway
            // (DEVICE_REMOVAL): its CONNECT_ERROR loses nothing and adds no surprise. Before,
            // a refusal says the connection is still being set up, which no event would.
            Op::Disconnect if known.was_established() => Some(OwedKind::Connect),
            _ => None,
        }
    }

    /// Writes `cmd` (about `handle`) on the channel this thread holds for its pipelined
    /// calls, taking one if need be, without waiting for its answer: `None` when it must go
    /// the usual way (the session is over, or no mapped channel can be had).
    fn write_owed(&self, cmd: &Command, handle: u32, kind: OwedKind) -> Option<rcm::Result<()>> {
        if !self.alive.load(Ordering::SeqCst) {
            return None;
        }
        let seq = self.next_seq();
        let frame = cmd.encode(seq);
        if rcm_shm::Producer::footprint(frame.len()) > crate::shmchan::RING_BYTES as usize {
            return None;
        }
        let mut ch = match self.take_held() {
            Some(ch) => ch,
            None => match self.acquire(self.on_reader()) {
                Some(ch) if ch.shm.is_some() => ch,
                // A socket channel: the usual way, on it.
                Some(ch) => {
                    self.give_back(ch);
                    return None;
                }
                None => return None,
            },
        };
        // The answers that came meanwhile are taken at each call (one look), so the daemon
        // finds room for the next ones while this thread goes on writing.
        if self.take_answers(&mut ch).is_err() || self.push_frame(&mut ch, &frame).is_err() {
            self.chan_failed(&mut ch);
            return Some(Err(Error::DeviceRemoved));
        }
        ch.owed.push_back(Owed { seq, handle, kind });
        // A thread writing calls without waiting is CPU-bound: a daemon thread sharing its
        // CPU got it back only at the scheduler's tick, took its yields for stolen, and
        // slept instead of polling for milliseconds (`rcm::yield_to_pollers`; one to six
        // such hold-offs a 10,000-connection burst through a daemon, none in seven of eight
        // runs with this yield). One yield every 32 commands costs ~15 ns a command.
        if seq % PIPELINE_YIELD_EVERY == 0 {
            std::thread::yield_now();
        }
        self.hold(ch);
        if let Some(me) = self.me.upgrade() {
            rcm::remote::owe(me);
        }
        Some(Ok(()))
    }

    /// The channel this thread holds for its pipelined calls to this session, if any.
    fn take_held(&self) -> Option<Chan> {
        let me = std::ptr::from_ref(self).addr();
        HELD.try_with(|h| {
            let mut h = h.borrow_mut();
            let k = h.0.iter().position(|(s, _, _)| *s == me)?;
            Some(h.0.swap_remove(k).2)
        })
        .ok()
        .flatten()
    }

    /// Whether this thread holds a channel of this session for its pipelined calls.
    fn holds_channel(&self) -> bool {
        let me = std::ptr::from_ref(self).addr();
        HELD.try_with(|h| h.borrow().0.iter().any(|(s, _, _)| *s == me))
            .unwrap_or(false)
    }

    /// Keeps `ch` with this thread until its pipeline completes (see `Pipelined for Inner`).
    fn hold(&self, ch: Chan) {
        let me = std::ptr::from_ref(self).addr();
        let mut ch = Some(ch);
        let _ = HELD.try_with(|h| {
            if let Some(ch) = ch.take() {
                h.borrow_mut().0.push((me, self.me.clone(), ch));
            }
        });
        // The thread is ending: the answers are awaited now.
        if let Some(ch) = ch {
            self.settle(ch);
        }
    }

    /// Reads a channel's answers until none is owed, and gives it back.
    fn settle(&self, mut ch: Chan) {
        if self
            .read_answers(&mut ch, Until::Settled, &mut Vec::new())
            .is_err()
        {
            self.chan_failed(&mut ch);
        }
        self.give_back(ch);
    }

    /// The session is over: the reader, which may be standing aside for a waiter's poll
    /// (see `reader`), ends it now instead of at the poll's deadline.
    fn end_reader(&self) {
        self.ended.store(true, Ordering::SeqCst);
        if let Some(t) = self.reader_thread.get() {
            t.unpark();
        }
    }

    /// A channel went back to the idle list: one waiter is woken to take it.
    fn wake_idle_waiter(&self) {
        self.wake_idle_waiters(false);
    }

    /// Wakes one thread waiting for an idle channel, or with `all` every one (channels
    /// failed, the session ended: each must look whether it can still wait; or the reader,
    /// done waiting, leaves what came back meanwhile to the others). One is
    /// enough for a channel given back: waking every waiter for it (more calling threads
    /// than channels) had all of them take turns on the CPU to find it gone, and 16 calling
    /// threads made a third of the connections a second that 8 did through one daemon. All
    /// are woken while the reader waits too, since a caller woken alone would leave the
    /// channel to the reader and wait again without waking it.
    fn wake_idle_waiters(&self, all: bool) {
        if self.idle_waiters.load(Ordering::SeqCst) > 0 {
            // Taken so a waiter between its check and its wait cannot miss this.
            drop(lock(&self.idle));
            if all || self.reader_waiting.load(Ordering::SeqCst) {
                self.idle_cond.notify_all();
            } else {
                self.idle_cond.notify_one();
            }
        }
    }

    /// Whether the calling thread is this session's reader.
    fn on_reader(&self) -> bool {
        ON_READER.with(|r| r.get() == std::ptr::from_ref(self).addr())
    }

    /// A command channel for a call, or `None` for the session's connection. A call on the
    /// reader (a callback it runs), and while the reader runs callbacks any call, waits for
    /// an idle channel when every one is busy: its answer on the session's connection would
    /// need the reader. The reader goes first. `None` for such a call means the session has
    /// no channel (left): the caller on the reader then fails.
    fn acquire(&self, on_reader: bool) -> Option<Chan> {
        loop {
            if on_reader || !self.reader_waiting.load(Ordering::SeqCst) {
                if let Some(c) = self.channel() {
                    return Some(c);
                }
            }
            let attached = self.attached.load(Ordering::SeqCst) > 0;
            if !(on_reader || self.inline) || !attached || !self.alive.load(Ordering::SeqCst) {
                return None;
            }
            self.idle_waiters.fetch_add(1, Ordering::SeqCst);
            if on_reader {
                self.reader_waiting.store(true, Ordering::SeqCst);
            }
            let mut idle = lock(&self.idle);
            while (idle.is_empty() || (!on_reader && self.reader_waiting.load(Ordering::SeqCst)))
                && self.attached.load(Ordering::SeqCst) > 0
                && self.alive.load(Ordering::SeqCst)
            {
                idle = self
                    .idle_cond
                    .wait(idle)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
            }
            drop(idle);
            self.idle_waiters.fetch_sub(1, Ordering::SeqCst);
            if on_reader {
                // The others may take what the reader leaves: all of them look, since
                // several channels may have come back while the reader waited and each
                // of those woke callers only to wait again.
                self.reader_waiting.store(false, Ordering::SeqCst);
                self.wake_idle_waiters(true);
            }
        }
    }

    fn request(&self, cmd: &Command) -> rcm::Result<Answer> {
        if !self.alive.load(Ordering::SeqCst) {
            return Err(Error::DeviceRemoved);
        }
        // After this thread's pipelined calls, on their channel: in order behind them.
        if let Some(mut ch) = self.take_held() {
            let r = self.call_with(&mut ch, cmd);
            if ch.owed.is_empty() {
                self.give_back(ch);
            } else {
                self.hold(ch);
            }
            return r;
        }
        let on_reader = self.on_reader();
        if let Some(ch) = self.acquire(on_reader) {
            return self.call_on(ch, cmd);
        }
        if on_reader {
            return Err(if self.alive.load(Ordering::SeqCst) {
                Error::Remote(
                    "no command channel for a call from a callback on the session's reader".into(),
                )
            } else {
                Error::DeviceRemoved
            });
        }
        let seq = self.next_seq();
        let (tx, rx) = mpsc::sync_channel(1);
        {
            let mut p = lock(&self.pending);
            // Checked under the lock the reader drains with, so no waiter is left behind.
            if !self.alive.load(Ordering::SeqCst) {
                return Err(Error::DeviceRemoved);
            }
            p.insert(seq, Pending::Call(tx));
        }
        if let Err(e) = self.send(cmd.encode(seq)) {
            lock(&self.pending).remove(&seq);
            return Err(e);
        }
        // A reply usually comes within tens of microseconds: look for it briefly before
        // sleeping, since waking a sleeping thread costs about as much again.
        let mut got = None;
        rcm::spin_until(self.spin, || match rx.try_recv() {
            Ok(r) => {
                got = Some(r.map_err(WireError::into_cm));
                true
            }
            Err(mpsc::TryRecvError::Disconnected) => {
                got = Some(Err(Error::DeviceRemoved));
                true
            }
            Err(mpsc::TryRecvError::Empty) => false,
        });
        if let Some(r) = got {
            return r;
        }
        loop {
            match rx.recv_timeout(HANGUP_CHECK) {
                Ok(r) => return r.map_err(WireError::into_cm),
                Err(mpsc::RecvTimeoutError::Disconnected) => return Err(Error::DeviceRemoved),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            }
            // The reader fails this wait when it reads the daemon's end, unless it is held
            // meanwhile: with inline callbacks, by a callback that waits for a lock this
            // caller holds (a call lands here when the session's channels died with the
            // daemon and none attaches). So the caller looks for the hang-up itself.
            if hung_up(&self.stream) {
                lock(&self.pending).remove(&seq);
                return Err(Error::DeviceRemoved);
            }
        }
    }
}

/// A command channel: its socket and, once mapped, its rings in shared memory (then the
/// socket is only the lifeline and doorbell).
struct Chan {
    sock: BufReader<SpinRead>,
    shm: Option<crate::shmchan::ShmEnd>,
    /// The pipelined calls written on it whose answers have not been read, oldest first.
    owed: std::collections::VecDeque<Owed>,
    /// False once it failed (it is then dropped, not given back).
    alive: bool,
}

/// The header of an answer read from a mapped channel, checked against its length.
fn answer_head(f: &[u8]) -> std::io::Result<Header> {
    let Some(hb) = f.first_chunk::<12>() else {
        return Err(std::io::ErrorKind::InvalidData.into());
    };
    let h = Header::parse(hb)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))?;
    if f.len() != h.frame_len() {
        return Err(std::io::ErrorKind::InvalidData.into());
    }
    Ok(h)
}

/// The channels a thread holds for its pipelined calls (see `HELD`). A thread ends holding
/// one only when its pipeline never ended (a guard leaked with `mem::forget`): its answers
/// are then awaited as the thread ends (the daemon might otherwise drop the channel, closed
/// with calls unserved in it) and the channel goes back to its session.
struct HeldChans(Vec<(usize, Weak<Inner>, Chan)>);

impl Drop for HeldChans {
    fn drop(&mut self) {
        for (_, inner, ch) in self.0.drain(..) {
            if let Some(inner) = inner.upgrade() {
                inner.settle(ch);
            }
        }
    }
}

/// How far `Inner::read_answers` reads.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Until {
    /// To the answer with this sequence number, waiting for it.
    Answer(u32),
    /// Until no pipelined call is owed its answer, waiting for them.
    Settled,
    /// What is there now.
    Empty,
}

/// A pipelined call whose answer is still owed (see `rcm::Pipeline`).
struct Owed {
    seq: u32,
    handle: u32,
    kind: OwedKind,
}

/// Which error event a failed pipelined call becomes.
#[derive(Clone, Copy)]
enum OwedKind {
    /// `ADDR_ERROR` (`bind`, `resolve_addr`).
    Addr,
    /// `ROUTE_ERROR` (`resolve_route`).
    Route,
    /// `CONNECT_ERROR` (`connect`, `accept`, `establish`, and `disconnect` once established).
    Connect,
    /// None: a release (`DESTROY_ID`), whose id has no sink left.
    Release,
    /// `CONNECT_ERROR` (`create_id` under a handle of the client's: the daemon holds no
    /// such id then, so each later call of the id fails, and destroy is all that is left).
    Create,
}

impl rcm::remote::Pipelined for Inner {
    fn complete(&self) {
        if let Some(ch) = self.take_held() {
            self.settle(ch);
        }
    }
}

/// How often a call waiting for its answer on the session's connection looks for the
/// daemon's hang-up (see `Inner::request`).
const HANGUP_CHECK: std::time::Duration = std::time::Duration::from_millis(100);

/// The next handle of the client's range (`proto::CLIENT_HANDLES` and above) from `counter`
/// that `held` does not name: after the counter wraps, one an id of this client still holds
/// is skipped.
fn client_handle(counter: &AtomicU32, held: impl Fn(u32) -> bool) -> u32 {
    loop {
        let n = counter.fetch_add(1, Ordering::Relaxed);
        let h = proto::CLIENT_HANDLES | (n & !proto::CLIENT_HANDLES);
        if !held(h) {
            return h;
        }
    }
}

impl Inner {
    /// A handle for a new id: the next of the client's range that no id holds and no
    /// destroyed id's events may still come for (see `Sinks`).
    fn choose_handle(&self, sinks: &mut Sinks) -> u32 {
        let seen = self.events_seen.load(Ordering::Acquire);
        let h = client_handle(&self.next_handle, |h| sinks.holds(h, seen));
        sinks.draining.remove(&h);
        h
    }
}

impl Client {
    /// `create_id` in a pipeline: under a handle chosen here, its command written without
    /// waiting for the answer (a refusal becomes the id's CONNECT_ERROR). `None` when it
    /// must go the usual way (no mapped channel can be had).
    fn create_owed(&self, ps: PortSpace, sink: &Sink) -> Option<rcm::Result<Arc<dyn RemoteId>>> {
        let known = Arc::new(IdCache::default());
        let h = {
            let mut sinks = lock(&self.0.sinks);
            if !self.0.alive.load(Ordering::SeqCst) {
                return Some(Err(Error::DeviceRemoved));
            }
            self.0.choose_handle(&mut sinks)
        };
        let written = self
            .0
            .write_owed(&Command::CreateIdAs(ps, h), h, OwedKind::Create);
        if let Some(Ok(())) = written {
            // Filed once the command went, not before: a write that fails may end the session
            // (`chan_failed`), whose end gives every filed sink its DEVICE_REMOVAL, and an id
            // whose create failed must hear nothing. Nothing comes for it before its first
            // call, and a refusal of the create is an owed answer only this thread reads,
            // after this. A session that ended meanwhile (its sinks already given their
            // removals) is this create's failure.
            let mut sinks = lock(&self.0.sinks);
            if !self.0.alive.load(Ordering::SeqCst) {
                return Some(Err(Error::DeviceRemoved));
            }
            sinks.live.insert(h, (sink.clone(), known.clone()));
            return Some(Ok(Arc::new(Handle {
                client: Arc::downgrade(&self.0),
                wire: h,
                known,
                released: AtomicBool::new(false),
            })));
        }
        match written {
            Some(Err(e)) => Some(Err(e)),
            _ => None,
        }
    }
}

impl Provider for Client {
    fn create_id(&self, ps: PortSpace, sink: Sink) -> rcm::Result<Arc<dyn RemoteId>> {
        if rcm::remote::pipelining() {
            if let Some(r) = self.create_owed(ps, &sink) {
                return r;
            }
        }
        // The handle is chosen here too, not by the daemon: only this side knows which
        // handles still have events of a destroyed id on their way (see `Sinks`).
        let known = Arc::new(IdCache::default());
        let h = {
            let mut sinks = lock(&self.0.sinks);
            // The reader marks the session dead before it takes the sinks (each then gets its
            // DeviceRemoval): an id made after that would never hear of it.
            if !self.0.alive.load(Ordering::SeqCst) {
                return Err(Error::DeviceRemoved);
            }
            self.0.choose_handle(&mut sinks)
        };
        match self.0.request(&Command::CreateIdAs(ps, h)) {
            Ok(Answer::Handle(got)) if got == h => {}
            Err(e) => return Err(e),
            Ok(_) => return Err(Error::Remote("unexpected answer to CreateId".into())),
        }
        // Filed once the daemon answered, not before: a session that ends while the answer
        // is awaited gives every filed sink its DEVICE_REMOVAL, and an id whose create then
        // fails must hear nothing. No event can come for `h` before its first operation,
        // which follows this; the counter keeps `h` from any other create meanwhile. A
        // session that ended after the answer (its sinks already given their removals) is
        // this create's failure.
        {
            let mut sinks = lock(&self.0.sinks);
            if !self.0.alive.load(Ordering::SeqCst) {
                return Err(Error::DeviceRemoved);
            }
            sinks.live.insert(h, (sink, known.clone()));
        }
        Ok(Arc::new(Handle {
            client: Arc::downgrade(&self.0),
            wire: h,
            known,
            released: AtomicBool::new(false),
        }))
    }

    fn busy_polled(&self) -> u64 {
        self.0.polled.load(Ordering::Relaxed)
    }

    fn device_addrs(&self) -> Vec<IpAddr> {
        match self.0.request(&Command::Devices) {
            Ok(Answer::Devices(d)) => d,
            _ => Vec::new(),
        }
    }

    fn shutdown(&self) {
        let _ = self.0.stream.shutdown(std::net::Shutdown::Both);
        self.0.end_reader();
        // The reader ends with the connection; the callbacks it runs end with it, before the
        // fabric's shutdown returns. (rcm never calls this on the reader: shutdowns started
        // on provider threads move to a thread of their own.)
        if !self.0.on_reader() {
            if let Some(h) = lock(&self.0.reader).take() {
                let _ = h.join();
            }
        }
    }
}

/// What this client learnt of an id from its events.
///
/// The QP attributes the daemon sent with the id's latest event (see `proto::Message::Event`),
/// from which `init_qp_attr` is answered here. Once the connection may have moved on (any
/// other event, or a call that changes it) they are forgotten for good and every later
/// `init_qp_attr` asks the daemon, which knows. An answer from here is the one the daemon
/// would have given before any event still on its way: the same as a call that came first.
///
/// And whether its ESTABLISHED was delivered: from then on a `disconnect` can only succeed
/// or find the id's device gone, so in an `rcm::Pipeline` it goes without its answer.
#[derive(Default)]
struct IdCache {
    qp: Mutex<QpKnown>,
    established: AtomicBool,
}

#[derive(Default)]
enum QpKnown {
    /// No attributes yet: ask the daemon.
    #[default]
    Unknown,
    Known(QpAttr),
    /// A `connect` or `accept` was called: ask the daemon until an event brings attributes
    /// for a later state than INIT (an earlier event's INIT attributes, still being read,
    /// describe the id before the call).
    Outdated,
    /// The connection may have moved on: ask the daemon from now on.
    Stale,
}

impl IdCache {
    /// An event arrived, with or without attributes: before it is handed on.
    fn event(&self, ev: &Event, qp: Option<QpAttr>) {
        // A connection's: a UD id's ESTABLISHED (SIDR resolved) makes no connection to
        // disconnect (`disconnect` refuses it, which a pipelined call would turn into a
        // surprise CONNECT_ERROR).
        if matches!(ev, Event::Established { ud: None, .. }) {
            self.established.store(true, Ordering::SeqCst);
        }
        self.attrs(qp);
    }

    /// An event arrived with these attributes or none.
    fn attrs(&self, qp: Option<QpAttr>) {
        let mut k = lock(&self.qp);
        *k = match (qp, &*k) {
            (_, QpKnown::Stale) | (None, _) => QpKnown::Stale,
            (Some(a), QpKnown::Outdated) if a.qp_state == Some(QpState::Init) => QpKnown::Outdated,
            (Some(a), _) => QpKnown::Known(a),
        };
    }

    /// A call that may change what `init_qp_attr` answers.
    fn forget(&self) {
        *lock(&self.qp) = QpKnown::Stale;
    }

    /// A call that changes what `init_qp_attr` answers until the id's next event brings
    /// new attributes: `connect` and `accept` make the CM connection that INIT's access
    /// flags come from (and `accept` may change the responder resources they depend on).
    fn outdate(&self) {
        let mut k = lock(&self.qp);
        if !matches!(*k, QpKnown::Stale) {
            *k = QpKnown::Outdated;
        }
    }

    /// Whether the id's connection's ESTABLISHED was delivered.
    fn was_established(&self) -> bool {
        self.established.load(Ordering::SeqCst)
    }

    fn answer(&self, state: QpState) -> Option<QpAttr> {
        match &*lock(&self.qp) {
            QpKnown::Known(a) => a.for_state(state),
            _ => None,
        }
    }
}

/// An id held by the daemon.
struct Handle {
    client: Weak<Inner>,
    /// The id's handle in the session.
    wire: u32,
    known: Arc<IdCache>,
    /// Set (under the sinks lock) when released: a connect request's child can be released
    /// by its first callback before the reader has filed its sink, which then must not be.
    released: AtomicBool,
}

impl RemoteId for Handle {
    fn call(&self, op: Op) -> rcm::Result<Reply> {
        match op {
            Op::InitQpAttr(s) => {
                if let Some(a) = self.known.answer(s) {
                    return Ok(Reply::QpAttr(a));
                }
            }
            // These end the connection the attributes describe. The other calls set it up
            // and leave what is known valid (INIT needs only the addresses; a child's RTS
            // attributes come with its ESTABLISHED, after accept).
            Op::Disconnect | Op::Reject(_) | Op::DestroyQp => self.known.forget(),
            Op::Connect(_) | Op::Accept(_) => self.known.outdate(),
            _ => {}
        }
        let c = self.client.upgrade().ok_or(Error::DeviceRemoved)?;
        let kind = Inner::owed_kind(&op, &self.known).filter(|_| rcm::remote::pipelining());
        let cmd = Command::Call(self.wire, op);
        if let Some(k) = kind {
            // Written without waiting, a bind seals the id if refused; waited for (below, when
            // no mapped channel can be had), a refused bind is the call's error and leaves
            // the id as it was.
            let sealing = match &cmd {
                Command::Call(h, Op::Bind(a)) => Some(Command::BindOrSeal(*h, *a)),
                _ => None,
            };
            if let Some(r) = c.write_owed(sealing.as_ref().unwrap_or(&cmd), self.wire, k) {
                return r.map(|()| Reply::Done);
            }
        }
        match c.request(&cmd)? {
            Answer::Reply(r) => Ok(r),
            _ => Err(Error::Remote("unexpected answer to a call".into())),
        }
    }

    fn release(&self) {
        let Some(c) = self.client.upgrade() else {
            return;
        };
        {
            let mut sinks = lock(&c.sinks);
            self.released.store(true, Ordering::SeqCst);
            sinks.live.remove(&self.wire);
            rcm_proto::room::shrink_map(&mut sinks.live);
            if self.wire >= proto::CLIENT_HANDLES {
                // Until the destroy's answer says how far its events go.
                let seen = c.events_seen.load(Ordering::Acquire);
                sinks.drain_until(self.wire, u64::MAX, seen);
            }
        }
        if !c.alive.load(Ordering::SeqCst) {
            return;
        }
        let cmd = Command::DestroyId(self.wire);
        // In a pipeline (see `rcm::Pipeline`), and on the reader while it runs a batch of
        // inline callbacks (a burst's connections destroyed by their callbacks), it goes
        // behind the thread's calls without waiting: this thread's later calls come after
        // it, and its answer is read when the pipeline or the batch ends.
        let on_reader = c.on_reader();
        if (rcm::remote::pipelining()
            || c.holds_channel()
            || (on_reader && rcm::remote::running_callbacks_here()))
            && c.write_owed(&cmd, self.wire, OwedKind::Release).is_some()
        {
            return;
        }
        // Otherwise done when this returns, wherever it goes, so the client's next call (say,
        // a create at the id limit, or a listen on the port this id held) comes after it:
        // sent on the session's connection without waiting, a call that then finds an idle
        // channel could overtake it.
        if !on_reader || c.holds_channel() {
            let r = c.request(&cmd);
            c.settle_release(self.wire, &r);
            return;
        }
        // On the reader, which cannot wait for an answer on the session's connection: a
        // channel, or (none attaches) written there without waiting, its answer settled by
        // the reader when it comes, in order with the session's other calls while they have
        // no channel either. (When the refusal was one that passes, the daemon's connection
        // limit or a socket error, a call made after a later attach can still overtake it.)
        if let Some(ch) = c.acquire(true) {
            let r = c.call_on(ch, &cmd);
            c.settle_release(self.wire, &r);
            return;
        }
        let seq = c.next_seq();
        lock(&c.pending).insert(seq, Pending::Release(self.wire));
        if c.send(cmd.encode(seq)).is_err() {
            lock(&c.pending).remove(&seq);
        }
    }

    fn busy_poll(&self) -> Option<Weak<dyn rcm::remote::BusyPoll>> {
        Some(self.client.clone())
    }
}

std::thread_local! {
    /// The channels this thread holds for its pipelined calls, by session (the address of
    /// its `Inner`; the `Weak` keeps that address from being reused by another session while
    /// the entry lives): until its pipeline completes, its calls to that session go there,
    /// in order behind them.
    static HELD: std::cell::RefCell<HeldChans> =
        const { std::cell::RefCell::new(HeldChans(Vec::new())) };
    /// On a session's reader thread, the address of its session's `Inner`: a call of that
    /// session must not wait there for an answer on the session's connection (this thread
    /// reads them). 0 elsewhere.
    static ON_READER: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The session's reader thread. `inline`: run the callbacks of each batch of events here
/// (see [`Client::connect_for`]); a batch is what one receive brought.
///
/// While a thread waiting for an event polls the session (busy polling), the reader stands
/// aside until that poll's deadline, so one polling thread fewer shares the CPUs: the
/// waiter receives, handles, and takes its event itself (see `BusyPoll for Inner`).
fn reader(weak: &Weak<Inner>, s: &UnixStream, inline: bool) {
    let mut nap = std::time::Duration::ZERO;
    loop {
        let Some(c) = weak.upgrade() else { return };
        if !c.ended.load(Ordering::SeqCst) {
            let left = c.gate.polled_left();
            if !left.is_zero() {
                drop(c);
                nap = rcm::remote::next_nap(nap, left);
                std::thread::park_timeout(nap);
                continue;
            }
        }
        nap = std::time::Duration::ZERO;
        // Opened before the receive, so the deliveries of the batch land here and their
        // callbacks run when it closes, before this thread reads again. Decided at each
        // receive, not once before the spin: the first command channel may attach while
        // this polls, and the batch after that must run here too (on a dispatcher, a
        // callback's call could reach the daemon before this thread, still handling the
        // batch, found the session over, and wait on a channel that never answers).
        let mut here = None;
        let mut look = Look::Nothing;
        // Polls a while before sleeping, as the fabric's threads do: a sleeping reader adds
        // a wake-up (tens of µs) to every event.
        rcm::spin_until(c.spin, || {
            if here.is_none() && inline && c.attached.load(Ordering::SeqCst) > 0 {
                here = Some(rcm::CallbacksHere::begin());
            }
            look = c.receive(false);
            look != Look::Nothing || !c.gate.polled_left().is_zero()
        });
        if look == Look::Ended {
            // The waiting calls fail before the last batch's callbacks run, so that calls
            // those make fail as DeviceRemoved too.
            c.fail_calls();
            drop(here);
            break;
        }
        drop(here);
        if matches!(look, Look::Got(_)) {
            continue;
        }
        if !c.gate.polled_left().is_zero() {
            continue;
        }
        if !c.prepare_sleep() {
            continue;
        }
        // Asleep without a hold on the session, so dropping the client still ends it (its
        // `Drop` shuts the socket down, which wakes this). Readable or hung up: the next
        // receive says which (a waiter may have taken it meanwhile).
        drop(c);
        wait_readable(s);
        if let Some(c) = weak.upgrade() {
            c.awake();
        }
    }
    // The daemon is gone: a device removal for every id.
    let Some(c) = weak.upgrade() else { return };
    c.fail_calls();
    // No attribute answer outlives this: a removed id's calls fail in rcm before they get here.
    let sinks: Vec<Sink> = lock(&c.sinks).live.drain().map(|(_, (s, _))| s).collect();
    for s in sinks {
        s.event(Event::DeviceRemoval);
    }
}

/// Sleeps until `s` is readable, hung up or in error (`poll(2)`: a thread asleep in `recv`
/// would also be woken each time the daemon takes what this side wrote; see `spin`).
fn wait_readable(s: &UnixStream) {
    use rustix::event::{poll, PollFd, PollFlags};
    let mut fds = [PollFd::new(s, PollFlags::IN)];
    let _ = poll(&mut fds, None);
}

impl Inner {
    /// An answer read on the session's connection goes where it is awaited.
    fn answered(&self, p: Pending, r: Result<Answer, WireError>) {
        match p {
            Pending::Call(w) => {
                let _ = w.send(r);
            }
            Pending::Release(h) => self.settle_release(h, &r.map_err(WireError::into_cm)),
        }
    }

    /// The answer to the `DESTROY_ID` of handle `h` (see `Sinks`): the handle is free again
    /// once the events handled reach the count it names; at once when the daemon did not
    /// hold it (nothing of it can be on its way). Without either (the session failed, or a
    /// bad answer) it stays out of use for the session's life.
    fn settle_release(&self, h: u32, r: &rcm::Result<Answer>) {
        if h < proto::CLIENT_HANDLES {
            return;
        }
        let until = match r {
            Ok(Answer::Released { events }) => *events,
            Err(Error::Destroyed) => 0,
            _ => return,
        };
        let mut sinks = lock(&self.sinks);
        if sinks.draining.get(&h) != Some(&u64::MAX) {
            return;
        }
        let seen = self.events_seen.load(Ordering::Acquire);
        if seen >= until {
            sinks.draining.remove(&h);
        } else {
            sinks.drain_until(h, until, seen);
        }
    }

    /// The session is over: calls waiting for their answers fail, and later ones at once.
    fn fail_calls(&self) {
        {
            let mut p = lock(&self.pending);
            self.alive.store(false, Ordering::SeqCst);
            p.clear();
        }
        self.wake_idle_waiters(true);
    }

    /// Receives what the session's connection holds (without waiting) and handles the whole
    /// frames, unless another thread is doing so. What the last receive ended inside of
    /// (the start of a frame) waits for the next. `by_waiter`: a busy-polling waiter is
    /// receiving (the frames it handles count in `polled`, those of the last receive too).
    fn receive(&self, by_waiter: bool) -> Look {
        let Ok(mut rx) = self.rx.try_lock() else {
            return Look::Nothing;
        };
        let rx = &mut *rx;
        if self.ended.load(Ordering::SeqCst) {
            return Look::Ended;
        }
        let look = if rx.ring.is_some() {
            self.receive_ring(rx, by_waiter)
        } else {
            self.receive_socket(rx, by_waiter)
        };
        if look == Look::Ended {
            self.ended.store(true, Ordering::SeqCst);
            // However it ended (a broken ring, a bad frame, the daemon gone), the connection
            // is closed here: when what was read ended it, the daemon then ends the
            // session and its ids now, not when the application drops the fabric; and a
            // reader asleep on the socket wakes (an unpark does not end its poll(2)) to
            // deliver every id its DeviceRemoval.
            let _ = self.stream.shutdown(std::net::Shutdown::Both);
        }
        look
    }

    /// `receive` from the events ring: the frames it holds (a batch at most), and the
    /// socket read when the ring was empty for a while (or after a sleep: see `awake`).
    fn receive_ring(&self, rx: &mut RxSide, by_waiter: bool) -> Look {
        let RxSide {
            buf,
            used,
            ring,
            idle_looks,
            ..
        } = rx;
        let Some(ring) = ring.as_mut() else {
            return Look::Ended;
        };
        let mut frames = 0;
        while frames < RING_BATCH {
            match ring.pop(buf, MAX_FRAME) {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "the daemon's events ring is broken");
                    self.fail_calls();
                    return Look::Ended;
                }
            }
            let head = frame_head(buf);
            let Ok(Some((h, total))) = head else {
                self.fail_calls();
                return Look::Ended;
            };
            if total != buf.len() || !self.handle_frame(h, &buf[12..], used) {
                self.fail_calls();
                return Look::Ended;
            }
            frames += 1;
        }
        if by_waiter {
            self.polled.fetch_add(frames as u64, Ordering::Relaxed);
        }
        if frames > 0 {
            *idle_looks = 0;
            return Look::Got(frames);
        }
        *idle_looks += 1;
        if *idle_looks < RING_LOOKS_PER_SOCKET_READ {
            return Look::Nothing;
        }
        *idle_looks = 0;
        match crate::shmchan::take_doorbells(&self.stream) {
            // The doorbell may have been rung for the reader asleep on the socket, and a
            // waiter that reads it here takes the wake-up the reader would have had: every
            // frame it announced (published before it) is taken now, the whole ring, not one
            // batch (a waiter whose event was in the first batch stops polling, and the
            // rest waited in the ring, nobody rung for, until the daemon's next frame). A
            // frame published after the ring was found empty rings anew.
            Some(true) => drain_after_doorbell(|| self.receive_ring(rx, by_waiter)),
            Some(false) => Look::Nothing,
            None => Look::Ended,
        }
    }

    /// `receive` from the socket.
    fn receive_socket(&self, rx: &mut RxSide, by_waiter: bool) -> Look {
        match rustix::net::recv(
            &self.stream,
            &mut rx.buf[rx.filled..],
            rustix::net::RecvFlags::DONTWAIT,
        ) {
            Ok((0, _)) => Look::Ended,
            Ok((n, _)) => {
                rx.filled += n;
                let (frames, go_on) = self.handle_frames(rx);
                if by_waiter {
                    self.polled.fetch_add(frames as u64, Ordering::Relaxed);
                }
                if go_on {
                    Look::Got(frames)
                } else {
                    Look::Ended
                }
            }
            Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => Look::Nothing,
            Err(_) => Look::Ended,
        }
    }

    /// About to sleep on the socket: with an events ring, marks it asleep so that the
    /// daemon rings the doorbell for the next frame. False when the reader must not sleep
    /// now: a frame came meanwhile, or another thread is receiving.
    fn prepare_sleep(&self) -> bool {
        let Ok(rx) = self.rx.try_lock() else {
            return false;
        };
        rx.ring
            .as_ref()
            .is_none_or(rcm_shm::Consumer::prepare_sleep)
    }

    /// Back from a sleep: the daemon need not ring any more, and the next look reads the
    /// socket (the doorbell's bytes, or the daemon's end).
    fn awake(&self) {
        let mut rx = lock(&self.rx);
        if let Some(r) = rx.ring.as_ref() {
            r.awake();
            rx.idle_looks = RING_LOOKS_PER_SOCKET_READ;
        }
    }

    /// Handles the whole frames at the start of `rx.buf` and keeps the rest; returns how
    /// many, and false when the session is over (a frame that cannot be one, or credit that
    /// cannot be given back).
    fn handle_frames(&self, rx: &mut RxSide) -> (usize, bool) {
        if ends_in_a_bad_frame(&rx.buf[..rx.filled]) {
            // Known before the frames ahead of it are handled: their callbacks (on a
            // dispatcher, at once) may make calls, which must then fail instead of going to
            // a command channel that may never answer.
            self.fail_calls();
        }
        let mut at = 0;
        let mut frames = 0;
        let ok = loop {
            let rest = &rx.buf[at..rx.filled];
            let Ok(head) = frame_head(rest) else {
                break false;
            };
            let Some((h, total)) = head else {
                break true;
            };
            if rest.len() < total {
                if total > rx.buf.len() {
                    rx.buf.resize(total, 0);
                }
                break true;
            }
            if !self.handle_frame(h, &rest[12..total], &mut rx.used) {
                break false;
            }
            at += total;
            frames += 1;
        };
        rx.buf.copy_within(at..rx.filled, 0);
        rx.filled -= at;
        (frames, ok)
    }

    /// Handles one frame from the daemon; false when the session cannot go on.
    fn handle_frame(&self, h: Header, body: &[u8], used: &mut u32) -> bool {
        let msg = match decode_message(h.kind, body) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, kind = h.kind, "undecodable frame from the daemon");
                if h.kind == proto::kind::EVENT {
                    // It used a credit like any event: given back, or the window shrinks.
                    // And it has its place among the events (see `events_seen`).
                    self.events_seen.fetch_add(1, Ordering::Release);
                    *used += 1;
                } else if let Some(p) = lock(&self.pending).remove(&h.seq) {
                    // The call it answers fails instead of waiting for ever.
                    let why = format!("bad answer from the daemon: {e}");
                    self.answered(p, Err(WireError::Cm(Error::Remote(why))));
                }
                return give_credit(self, used);
            }
        };
        match msg {
            Message::Ok(a) => {
                if let Some(p) = lock(&self.pending).remove(&h.seq) {
                    self.answered(p, Ok(a));
                }
            }
            Message::Err(e) => {
                if let Some(p) = lock(&self.pending).remove(&h.seq) {
                    self.answered(p, Err(e));
                }
            }
            Message::HelloOk { .. } => {}
            Message::Event { handle, event, qp } => {
                deliver(self, handle, event, qp);
                self.events_seen.fetch_add(1, Ordering::Release);
                *used += 1;
                return give_credit(self, used);
            }
        }
        true
    }
}

/// The header of the frame `rest` starts with and the frame's whole length, `None` when
/// `rest` is shorter than a header; an error for a frame that cannot be one (a header that
/// does not parse, or a length over the limit).
fn frame_head(rest: &[u8]) -> Result<Option<(Header, usize)>, ()> {
    let Some(hb) = rest.first_chunk::<12>() else {
        return Ok(None);
    };
    let h = Header::parse(hb).map_err(|_| ())?;
    let total = h.frame_len();
    if total > MAX_FRAME {
        return Err(());
    }
    Ok(Some((h, total)))
}

/// Whether the frames in `buf` come to one that cannot be one before they end.
fn ends_in_a_bad_frame(buf: &[u8]) -> bool {
    let mut rest = buf;
    loop {
        match frame_head(rest) {
            Err(()) => return true,
            Ok(None) => return false,
            Ok(Some((_, total))) => match rest.get(total..) {
                Some(next) => rest = next,
                None => return false,
            },
        }
    }
}

/// A thread waiting in `get_event` after calling one of this session's ids polls the
/// session's connection: it receives and handles what the daemon sent (its own event, and
/// whatever else came: other ids' events go where the reader would have put them, answers
/// to the calls waiting for them), and the reader stands aside meanwhile.
impl rcm::remote::BusyPoll for Inner {
    fn begin(&self, spin: std::time::Duration) {
        // Also once the session is over: the reader then ends it whatever the gate says.
        self.gate.polled_for(spin);
    }

    fn end(&self) {
        self.gate.poll_ended();
    }

    fn kick(&self) {
        if self.gate.polled_left().is_zero() {
            // The reader may be parked standing aside: back to the socket now.
            if let Some(t) = self.reader_thread.get() {
                t.unpark();
            }
        }
    }

    fn poll(&self) -> bool {
        if !self.alive.load(Ordering::Relaxed) {
            return false;
        }
        // As on the reader: a call that the handling makes (a child's release, when its
        // listener is gone) must not wait for an answer on this connection, which only the
        // thread holding `rx` reads.
        let before = ON_READER.with(|r| r.replace(std::ptr::from_ref(self).addr()));
        let look = self.receive(true);
        ON_READER.with(|r| r.set(before));
        match look {
            Look::Got(_) => true,
            Look::Ended => {
                // The reader ends the session: it must not go on standing aside.
                self.end_reader();
                false
            }
            Look::Nothing => false,
        }
    }
}

/// Gives the daemon back the credit of the events taken, a quarter window at a time; false
/// when the session cannot be written to.
fn give_credit(c: &Inner, used: &mut u32) -> bool {
    if *used < WINDOW / 4 {
        return true;
    }
    if c.send(Command::GetEvent(*used).encode(0)).is_err() {
        return false;
    }
    *used = 0;
    true
}

/// Hands an event to its id. The QP attributes that came with it are in place before the
/// event can be seen, since seeing it is what makes an application ask for them.
fn deliver(c: &Inner, handle: u32, event: WireEvent, qp: Option<QpAttr>) {
    if let WireEvent::ConnectRequest {
        listener,
        private_data,
        param,
        ud,
    } = event
    {
        let cache = Arc::new(IdCache::default());
        cache.attrs(qp);
        let child = Arc::new(Handle {
            client: c.me.clone(),
            wire: handle,
            known: cache.clone(),
            released: AtomicBool::new(false),
        });
        let lsink = lock(&c.sinks).live.get(&listener).map(|(s, _)| s.clone());
        match lsink {
            Some(ls) => {
                // Filed before the request can be seen: a call on the child pipelined by its
                // first callback, and refused, comes back as the child's error event.
                let file = |cs: &rcm::remote::Sink| {
                    let mut sinks = lock(&c.sinks);
                    if !child.released.load(Ordering::SeqCst) {
                        sinks.live.insert(handle, (cs.clone(), cache));
                    }
                };
                ls.connect_request(child.clone(), private_data, param, ud, file);
            }
            // The listener was destroyed here already: the daemon rejects the request.
            None => child.release(),
        }
        return;
    }
    let sink = lock(&c.sinks).live.get(&handle).cloned();
    if let (Some((s, cache)), Some(ev)) = (sink, event.into_event()) {
        cache.event(&ev, qp);
        s.event(ev);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_handles_stay_in_their_range_and_skip_held_ones_after_the_counter_wraps() {
        let c = AtomicU32::new(0);
        assert_eq!(client_handle(&c, |_| false), proto::CLIENT_HANDLES);
        assert_eq!(client_handle(&c, |_| false), proto::CLIENT_HANDLES + 1);
        // The last of the range, then (wrapped) the first again, which is held: skipped.
        c.store(!proto::CLIENT_HANDLES, Ordering::Relaxed);
        assert_eq!(client_handle(&c, |_| false), u32::MAX);
        let held = |h| h == proto::CLIENT_HANDLES;
        assert_eq!(client_handle(&c, held), proto::CLIENT_HANDLES + 1);
        // The counter's own top bit changes nothing.
        c.store(u32::MAX, Ordering::Relaxed);
        assert_eq!(client_handle(&c, |_| false), u32::MAX);
        assert_eq!(client_handle(&c, |_| false), proto::CLIENT_HANDLES);
    }

    /// A doorbell a waiter takes announced frames that may be more than one look's batch:
    /// the looks go on until one finds fewer than a batch (the ring empty), each counted;
    /// a session that ends meanwhile ends the drain.
    #[test]
    fn a_consumed_doorbell_drains_the_whole_ring() {
        let mut queued = 600usize;
        let mut looks = 0;
        let got = drain_after_doorbell(|| {
            looks += 1;
            let n = queued.min(RING_BATCH);
            queued -= n;
            if n == 0 {
                Look::Nothing
            } else {
                Look::Got(n)
            }
        });
        assert!(matches!(got, Look::Got(600)), "{got:?}");
        assert_eq!((queued, looks), (0, 3));
        // A batch exactly full looks once more, and an empty ring is Nothing.
        let mut sizes = vec![0, RING_BATCH].into_iter().rev();
        let got = drain_after_doorbell(|| match sizes.next() {
            Some(0) | None => Look::Nothing,
            Some(n) => Look::Got(n),
        });
        assert!(matches!(got, Look::Got(n) if n == RING_BATCH), "{got:?}");
        assert!(matches!(
            drain_after_doorbell(|| Look::Nothing),
            Look::Nothing
        ));
        let mut first = true;
        let got = drain_after_doorbell(|| {
            if std::mem::take(&mut first) {
                Look::Got(RING_BATCH)
            } else {
                Look::Ended
            }
        });
        assert!(matches!(got, Look::Ended), "{got:?}");
    }

    #[test]
    fn a_refusal_read_after_a_broken_pipe_is_the_error() {
        // The daemon's side answered and closed before the first command was written.
        let (a, b) = UnixStream::pair().expect("pair");
        let refusal = Message::Err(WireError::Cm(Error::LimitExceeded(
            rcm::remote::Limit::Connections,
        )))
        .encode(0);
        send_all(&b, &refusal).expect("refusal");
        drop(b);
        let hello = Command::Hello {
            min: proto::VERSION,
            max: proto::VERSION,
        }
        .encode(1);
        assert!(matches!(
            send_first(&a, &hello),
            Err(Error::LimitExceeded(rcm::remote::Limit::Connections))
        ));
        // Nothing to read: the send's own error.
        let (a, b) = UnixStream::pair().expect("pair");
        drop(b);
        assert!(matches!(send_first(&a, &hello), Err(Error::Io(_))));
    }
}
