//! `rcm daemon`: owns the devices of a host's addresses and serves client processes over a
//! Unix socket, the way the kernel's ucma serves them through `/dev/infiniband/rdma_cm`.
//!
//! One client connection is one *session* (ucma's file). Each session has a table of the ids
//! it holds, named by handles that mean nothing outside it, and one queue of events. The
//! daemon's own rcm ids deliver events through a handler that finds the owning session
//! through a per-id cell; that cell is what `migrate_id` switches, under the cell's lock,
//! so an event is queued either entirely before or entirely after a migration.
//!
//! A session may also have command channels: further connections, attached by its token,
//! whose commands act on the session (protocol §2.1). Each connection has its own reader;
//! a channel moved into shared memory (§2.2) is served by one of a few ring threads instead,
//! its reader only holding the connection open until that thread lets it go.
//!
//! Lock order: an id's cell, then session tables (lower `order` first), then a session's
//! wire, then session output queues (same order). The wire is only ever *tried* by an rcm
//! callback thread, never waited for. Nothing that can wait for a callback (destroy) runs
//! under any of them.

use crate::proto::{
    self, decode_command, Answer, Command, Header, Limits, Message, SessionStats, WireError,
    WireEvent,
};
use crate::spin::{hung_up, send_all, SpinRead};
use rcm::remote::{Limit, Op, Reply};
use rcm::{CmId, Event, Fabric, FabricConfig, Flow, QpAttr, QpState};
use rustix::io::Errno;
use rustix::net::{send, SendFlags};
use std::collections::{HashMap, VecDeque};
use std::io::Read;
use std::net::IpAddr;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

/// Which transport the daemon's devices speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// RoCEv2: IB CM MADs over UDP.
    Roce,
    /// iWARP: MPA over TCP.
    Iwarp,
}

/// How a daemon is set up.
#[derive(Debug, Clone)]
pub struct DaemonConfig {
    /// The Unix socket path clients connect to.
    pub socket: PathBuf,
    /// The addresses whose devices the daemon owns.
    pub binds: Vec<IpAddr>,
    /// Their transport.
    pub transport: Transport,
    /// The fabric's configuration (UDP port, retries, dispatcher threads).
    pub fabric: FabricConfig,
    /// Per-session limits.
    pub limits: Limits,
    /// Permissions of the socket file (0o660 by default: owner and group).
    pub mode: u32,
    /// Command channels one session may have open at once ([`MAX_CHANNELS`] by default;
    /// 0 refuses them all, and clients then make every call on the session's connection).
    pub max_channels: usize,
    /// How long a new connection may take to open its session (`HELLO`) or attach as a
    /// channel (`ATTACH`) before the daemon closes it (10 s by default): a connection that
    /// never says anything holds threads of the daemon's.
    pub handshake_timeout: Duration,
    /// Connections served at once: sessions, their command channels, and connections that
    /// have not opened a session or attached yet ([`MAX_CONNECTIONS`] by default). Each
    /// holds two of the daemon's threads; one more is answered `LimitExceeded(Connections)`
    /// and closed, without a thread, so a client that opens connections without end cannot
    /// take the daemon's threads (or the process's) from the others. A channel is refused
    /// the same way once it would leave fewer than a quarter of the places free: those are
    /// for sessions.
    pub max_connections: usize,
    /// Whether command channels and sessions' events may move into shared memory
    /// (`MAP_CHANNEL` and `MAP_EVENTS`, §2.2 and §2.3 of the protocol document; on by
    /// default). Off, the daemon refuses both and clients keep everything on sockets.
    pub shared_memory: bool,
    /// Threads serving the mapped channels (at least one; by default one per four CPUs, at
    /// most 16). Each polls every ring it serves before it sleeps (receiving meanwhile for
    /// the RoCEv2 devices, see `rcm::Device::busy_poller`), so more of them than a
    /// machine has spare CPUs slows every call; a channel goes to the one serving fewest.
    pub ring_threads: usize,
}

/// [`DaemonConfig::ring_threads`] by default: one per four CPUs, 1 to 16.
pub fn default_ring_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get() / 4)
        .clamp(1, 16)
}

/// Connections a daemon serves at once by default ([`DaemonConfig::max_connections`]).
pub const MAX_CONNECTIONS: usize = 1024;

impl DaemonConfig {
    /// A RoCEv2 daemon on `binds` at `socket`, with default limits.
    pub fn new(socket: impl Into<PathBuf>, binds: Vec<IpAddr>) -> Self {
        DaemonConfig {
            socket: socket.into(),
            binds,
            transport: Transport::Roce,
            // One callback thread: the daemon's callbacks only queue an event for a session
            // and try a non-blocking send (never waiting on a client), and every extra thread
            // adds wake-ups (2,000-connection bench through the daemon: 3.3-3.9k conn/s
            // with 4, 3.8-5.0k with 1).
            //
            // Those callbacks run on the device thread that received their event (`Inline`):
            // a thread hop less per event on the way to a client (serial connects through the
            // daemon, 2-core VM, interleaved: p50 ~216 µs against ~288 with `Threads`).
            fabric: FabricConfig {
                dispatcher_threads: 1,
                callbacks: rcm::CallbackMode::Inline,
                ..FabricConfig::default()
            },
            limits: Limits::default(),
            mode: 0o660,
            max_channels: MAX_CHANNELS,
            handshake_timeout: Duration::from_secs(10),
            max_connections: MAX_CONNECTIONS,
            shared_memory: true,
            ring_threads: default_ring_threads(),
        }
    }
}

/// Why a daemon could not start.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// Another daemon answers on this socket path.
    #[error("a live daemon already serves {0}")]
    AlreadyRunning(PathBuf),
    /// Something that is not a socket is at the path; it is left alone.
    #[error("{0} exists and is not a socket; not touching it")]
    NotASocket(PathBuf),
    /// No address to serve.
    #[error("no --bind address given")]
    NoBinds,
    /// A device could not be opened.
    #[error("device {0}: {1}")]
    Device(IpAddr, rcm::Error),
    /// The socket could not be set up.
    #[error("socket {0}: {1}")]
    Io(PathBuf, std::io::Error),
}

/// A running daemon. Dropping it shuts it down (as [`Daemon::shutdown`]).
pub struct Daemon {
    shared: Arc<Shared>,
    accept: Option<std::thread::JoinHandle<()>>,
    rings: Vec<std::thread::JoinHandle<()>>,
}

struct Shared {
    fabric: Fabric,
    /// How long channel readers poll before they sleep (the fabric's `spin`).
    spin: Duration,
    limits: Limits,
    max_channels: usize,
    handshake_timeout: Duration,
    max_connections: usize,
    /// Channels may be mapped (`DaemonConfig::shared_memory`).
    map_channels: bool,
    /// Channels mapped since the start.
    mapped_channels: AtomicU64,
    /// Sessions whose events were mapped since the start.
    mapped_sessions: AtomicU64,
    /// The mapped channels, each served by one of the ring threads.
    rings: Vec<Rings>,
    /// Connections served now (each with its reader and writer threads).
    connections: AtomicUsize,
    /// Connections refused at `max_connections`.
    refused_connections: AtomicU64,
    socket: PathBuf,
    /// The socket file's device and inode, as bound.
    socket_file: Option<(u64, u64)>,
    stopping: AtomicBool,
    next_order: AtomicU64,
    /// Every session, by its order number.
    sessions: Mutex<HashMap<u64, Arc<Session>>>,
    /// Sessions that said hello, by token (for `migrate_id`).
    tokens: Mutex<HashMap<u64, Weak<Session>>>,
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    /// Events that found no session to go to (its client gone).
    orphan_events: AtomicU64,
}

/// Which session holds an id, under which handle. `None` once destroyed.
struct IdCell {
    owner: Mutex<Option<(Weak<Session>, u32)>>,
    /// The refusal of a `BIND` whose client did not wait for it (`Command::BindOrSeal`):
    /// every later call of the id but `QUERY` is refused with it (see `call_id`).
    sealed: std::sync::OnceLock<rcm::Error>,
}

impl IdCell {
    fn new(owner: (Weak<Session>, u32)) -> Arc<Self> {
        Arc::new(IdCell {
            owner: Mutex::new(Some(owner)),
            sealed: std::sync::OnceLock::new(),
        })
    }
}

struct Table {
    /// By handle: those this daemon chose, and those the client chose in its range
    /// (`proto::CLIENT_HANDLES`). A fast hash: foldhash is seeded at random, so a client
    /// cannot choose colliding handles without first learning the seed, and a table holds
    /// only its own session's ids, at most `max_ids` of them.
    ids: foldhash::HashMap<u32, (CmId, Arc<IdCell>)>,
    next: u32,
    closed: bool,
    /// Some id here was sealed (see `call_id`): until then a call does not look at its
    /// id's cell, another cache line at every command of a burst.
    sealed: bool,
}

impl Table {
    /// A handle not in use, below the client's range. Handles grow and are not reused until
    /// they wrap, so an event queued for a destroyed id cannot be taken for a newer one.
    fn alloc(&mut self) -> u32 {
        loop {
            self.next = self.next.wrapping_add(1) % proto::CLIENT_HANDLES;
            if self.next != 0 && !self.ids.contains_key(&self.next) {
                return self.next;
            }
        }
    }
}

struct Queued {
    handle: u32,
    /// For a connect request: the listener's handle.
    listener: Option<u32>,
    frame: Vec<u8>,
}

/// A session's queued events, with a count of them per handle (as the event's id or as the
/// listener of a queued connect request), so that destroying or migrating an id with
/// nothing queued does not walk the queue: at 100,000 connections through one daemon, with
/// a client reading its events more slowly than they came, every destroy walked tens of
/// thousands of queued events under the queue's lock (918 µs per destroy, against 11 µs).
#[derive(Default)]
struct EventQueue {
    q: VecDeque<Queued>,
    named: foldhash::HashMap<u32, u32>,
}

impl EventQueue {
    fn names(q: &Queued) -> impl Iterator<Item = u32> {
        std::iter::once(q.handle).chain(q.listener.filter(|l| *l != q.handle))
    }

    fn count(&mut self, q: &Queued) {
        for h in Self::names(q) {
            *self.named.entry(h).or_default() += 1;
        }
    }

    fn uncount(&mut self, q: &Queued) {
        for h in Self::names(q) {
            if let std::collections::hash_map::Entry::Occupied(mut e) = self.named.entry(h) {
                *e.get_mut() -= 1;
                if *e.get() == 0 {
                    e.remove();
                }
            }
        }
    }

    fn push_back(&mut self, q: Queued) {
        self.count(&q);
        self.q.push_back(q);
    }

    fn pop_front(&mut self) -> Option<Queued> {
        let q = self.q.pop_front()?;
        self.uncount(&q);
        if self.q.is_empty() {
            // Emptied: a burst's queue gives its room back (`rcm_proto::room`).
            rcm_proto::room::shrink_deque(&mut self.q);
            rcm_proto::room::shrink_map(&mut self.named);
        }
        Some(q)
    }

    fn len(&self) -> usize {
        self.q.len()
    }

    fn is_empty(&self) -> bool {
        self.q.is_empty()
    }

    /// Whether an event of `h`, or a connect request on listener `h`, is queued.
    fn names_any(&self, h: u32) -> bool {
        self.named.contains_key(&h)
    }

    fn front(&self) -> Option<&Queued> {
        self.q.front()
    }

    fn iter(&self) -> impl Iterator<Item = &Queued> {
        self.q.iter()
    }

    /// Keeps the events for which `keep` says so; walks the queue only when one names `h`.
    fn retain_naming(&mut self, h: u32, mut keep: impl FnMut(&mut Queued) -> bool) {
        if !self.names_any(h) {
            return;
        }
        let old = std::mem::take(&mut self.q);
        self.named.clear();
        for mut q in old {
            if keep(&mut q) {
                self.push_back(q);
            }
        }
    }

    fn clear(&mut self) {
        self.q.clear();
        self.named.clear();
    }
}

#[derive(Default)]
struct Out {
    events: EventQueue,
    credit: u64,
    unread_requests: u32,
    closed: bool,
    /// The wire has a backlog for the writer thread to send.
    backlog: bool,
    /// The client has granted credit (`GET_EVENT`) once: too late for `MAP_EVENTS`.
    granted: bool,
    /// The events ring had no room for the next event: the writer thread tries again.
    ring_full: bool,
    /// Buffers of events sent, for the next events' frames (see `Out::frame_buf`).
    spare: Vec<Vec<u8>>,
    /// Events taken from the queue to be written, since the session opened: an event's
    /// place in what the client receives, which `DESTROY_ID` answers (protocol §8).
    sent: u64,
}

/// The session's socket for writing, and the bytes of a cut batch that must go out before
/// anything else.
struct Wire {
    stream: UnixStream,
    backlog: Vec<u8>,
    /// Once the session's events are mapped (`MAP_EVENTS`, protocol §2.3): the ring that
    /// takes everything written for the session instead of the socket, which then carries
    /// only doorbells.
    ring: Option<rcm_shm::Producer>,
}

struct Session {
    order: u64,
    token: AtomicU64,
    table: Mutex<Table>,
    out: Mutex<Out>,
    out_cond: Condvar,
    stream: UnixStream,
    /// Replies (written by the reader) and event batches (by the writer) go out whole
    /// under this lock. A client that stops reading blocks only its own session.
    wire: Mutex<Wire>,
    dropped_events: AtomicU64,
    refused_requests: AtomicU64,
    /// When this session's last overload warning was logged (see `may_warn`).
    warned: AtomicU64,
    commands: AtomicU64,
    /// Held across `create_id`, so a client's creations are serialised even when they come
    /// on several command channels.
    creating: Mutex<()>,
    /// The command channels attached to this session (§2.1), by their connection's order:
    /// shut down when it closes.
    channels: Mutex<HashMap<u64, UnixStream>>,
    /// Set when the session closes: a mapped channel, which reads no socket while commands
    /// keep coming, stops serving it.
    ended: AtomicBool,
}

/// A command channel's hold on its session; leaves the session's list when dropped.
struct Channel {
    target: Arc<Session>,
    order: u64,
}

impl Drop for Channel {
    fn drop(&mut self) {
        lock(&self.target.channels).remove(&self.order);
    }
}

/// Command channels one session may have open at once.
pub const MAX_CHANNELS: usize = 16;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Locks the same mutex of two distinct sessions in `order` order; returns (a's, b's).
fn lock_two<'a, T>(
    a: &'a Session,
    b: &'a Session,
    f: impl Fn(&'a Session) -> &'a Mutex<T>,
) -> (MutexGuard<'a, T>, MutexGuard<'a, T>) {
    if a.order < b.order {
        let ga = lock(f(a));
        (ga, lock(f(b)))
    } else {
        let gb = lock(f(b));
        (lock(f(a)), gb)
    }
}

/// Events written per batch.
const EVENT_BATCH: usize = 256;

impl Daemon {
    /// Opens the devices and the socket and starts serving.
    pub fn start(cfg: DaemonConfig) -> Result<Daemon, DaemonError> {
        let DaemonConfig {
            socket,
            binds,
            transport,
            fabric: fabric_cfg,
            limits,
            mode,
            max_channels,
            handshake_timeout,
            max_connections,
            shared_memory,
            ring_threads,
        } = cfg;
        if binds.is_empty() {
            return Err(DaemonError::NoBinds);
        }
        claim_socket_path(&socket)?;
        let spin = fabric_cfg.spin;
        // Clients get no UD data path through the daemon: datagrams for its UD ids' QPNs
        // would only pile up in queues nobody reads.
        let fabric = Fabric::new(FabricConfig {
            ud_receive: false,
            ..fabric_cfg
        });
        for ip in &binds {
            let added = match transport {
                Transport::Roce => fabric.add_device(*ip),
                Transport::Iwarp => fabric.add_iwarp_device(*ip),
            };
            if let Err(e) = added {
                fabric.shutdown();
                return Err(DaemonError::Device(*ip, e));
            }
        }
        let rings = match (0..ring_threads.max(1)).map(|_| Rings::new()).collect() {
            Ok(r) => r,
            Err(e) => {
                fabric.shutdown();
                return Err(DaemonError::Io(socket, e));
            }
        };
        let listener = match UnixListener::bind(&socket) {
            Ok(l) => l,
            Err(e) => {
                fabric.shutdown();
                return Err(DaemonError::Io(socket, e));
            }
        };
        if let Err(e) = std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(mode)) {
            fabric.shutdown();
            let _ = std::fs::remove_file(&socket);
            return Err(DaemonError::Io(socket, e));
        }
        // Which file is ours: at stop the path is removed only if it still names it (another
        // daemon may have taken the path since someone removed ours).
        let socket_file = std::fs::symlink_metadata(&socket)
            .ok()
            .map(|m| (m.dev(), m.ino()));
        tracing::info!(socket = %socket.display(), binds = ?binds, ?transport, "rcm daemon serving");
        let shared = Arc::new(Shared {
            fabric,
            spin,
            limits,
            max_channels,
            handshake_timeout,
            max_connections,
            map_channels: shared_memory,
            mapped_channels: AtomicU64::new(0),
            mapped_sessions: AtomicU64::new(0),
            rings,
            connections: AtomicUsize::new(0),
            refused_connections: AtomicU64::new(0),
            socket,
            socket_file,
            stopping: AtomicBool::new(false),
            next_order: AtomicU64::new(1),
            sessions: Mutex::new(HashMap::new()),
            tokens: Mutex::new(HashMap::new()),
            threads: Mutex::new(Vec::new()),
            orphan_events: AtomicU64::new(0),
        });
        let mut d = Daemon {
            shared: shared.clone(),
            accept: None,
            rings: Vec::new(),
        };
        // On an error `d` is dropped, which stops the threads started so far.
        let io = |e| DaemonError::Io(shared.socket.clone(), e);
        for k in 0..shared.rings.len() {
            let sh = shared.clone();
            let t = std::thread::Builder::new()
                .name(format!("rcm-ucm-rings{k}"))
                .spawn(move || ring_loop(&sh, &sh.rings[k]))
                .map_err(io)?;
            d.rings.push(t);
        }
        let sh = shared.clone();
        let accept = std::thread::Builder::new()
            .name("rcm-ucm-accept".into())
            .spawn(move || accept_loop(&sh, &listener))
            .map_err(io)?;
        d.accept = Some(accept);
        Ok(d)
    }

    /// Command channels moved into shared memory since the start (`MAP_CHANNEL`).
    pub fn mapped_channels(&self) -> u64 {
        self.shared.mapped_channels.load(Ordering::Relaxed)
    }

    /// Sessions whose events (and replies) went into shared memory since the start
    /// (`MAP_EVENTS`).
    pub fn mapped_sessions(&self) -> u64 {
        self.shared.mapped_sessions.load(Ordering::Relaxed)
    }

    /// Threads serving the mapped channels (`DaemonConfig::ring_threads`).
    pub fn ring_threads(&self) -> usize {
        self.shared.rings.len()
    }

    /// The socket path.
    pub fn socket(&self) -> &Path {
        &self.shared.socket
    }

    /// The daemon's fabric (for leak checks: `live_ids`, `engine_ceps`, `bound_ports`).
    pub fn fabric(&self) -> &Fabric {
        &self.shared.fabric
    }

    /// Open sessions.
    pub fn sessions(&self) -> usize {
        lock(&self.shared.sessions).len()
    }

    /// Connections served now: sessions, channels, and those not through their handshake.
    pub fn connections(&self) -> usize {
        self.shared.connections.load(Ordering::SeqCst)
    }

    /// Connections refused so far because [`DaemonConfig::max_connections`] were served.
    pub fn refused_connections(&self) -> u64 {
        self.shared.refused_connections.load(Ordering::Relaxed)
    }

    /// Command channels attached to open sessions.
    pub fn channels(&self) -> usize {
        lock(&self.shared.sessions)
            .values()
            .map(|s| lock(&s.channels).len())
            .sum()
    }

    /// Threads of ended connections not joined yet (each ending connection joins those
    /// that ended before it, so this stays at one or two however many clients came and
    /// went).
    pub fn unjoined_threads(&self) -> usize {
        lock(&self.shared.threads)
            .iter()
            .filter(|t| t.is_finished())
            .count()
    }

    /// Ids held by all sessions.
    pub fn held_ids(&self) -> usize {
        lock(&self.shared.sessions)
            .values()
            .map(|s| lock(&s.table).ids.len())
            .sum()
    }

    /// Events dropped for full queues, over all sessions ever, plus those whose session was
    /// gone.
    pub fn dropped_events(&self) -> u64 {
        self.shared.orphan_events.load(Ordering::Relaxed)
            + lock(&self.shared.sessions)
                .values()
                .map(|s| s.dropped_events.load(Ordering::Relaxed))
                .sum::<u64>()
    }

    /// Stops accepting, ends every session (destroying its ids: peers see a REJ or DREQ),
    /// shuts the devices down and removes the socket file.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let sh = &self.shared;
        sh.stopping.store(true, Ordering::SeqCst);
        sh.rings.iter().for_each(Rings::wake);
        let rings = std::mem::take(&mut self.rings);
        let Some(accept) = self.accept.take() else {
            // Stopped already, or `start` failed after ring threads began.
            for r in rings {
                let _ = r.join();
            }
            return;
        };
        // The accept loop looks at the flag at least every ACCEPT_POLL. (It used to be woken
        // by a connection to the path, which hung for good once the path was removed, and
        // reached another daemon once one had taken it.)
        let _ = accept.join();
        // Before the sessions: each mapped channel's connection waits for its ring thread.
        for r in rings {
            let _ = r.join();
        }
        let sessions: Vec<Arc<Session>> = lock(&sh.sessions).values().cloned().collect();
        for s in &sessions {
            let _ = s.stream.shutdown(std::net::Shutdown::Both);
        }
        let threads = std::mem::take(&mut *lock(&sh.threads));
        for t in threads {
            let _ = t.join();
        }
        sh.fabric.shutdown();
        let still_ours = std::fs::symlink_metadata(&sh.socket)
            .ok()
            .is_some_and(|m| Some((m.dev(), m.ino())) == sh.socket_file);
        if still_ours {
            let _ = std::fs::remove_file(&sh.socket);
        }
        tracing::info!("rcm daemon stopped");
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Refuses a path a live daemon answers on or that is not a socket; removes a stale socket.
fn claim_socket_path(path: &Path) -> Result<(), DaemonError> {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    if !meta.file_type().is_socket() {
        return Err(DaemonError::NotASocket(path.to_path_buf()));
    }
    match UnixStream::connect(path) {
        Ok(_) => return Err(DaemonError::AlreadyRunning(path.to_path_buf())),
        // Nobody listens: a socket left by a daemon that died.
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {}
        // Anything else (no permission to connect, say) does not tell that nobody serves
        // it: the path is left alone.
        Err(e) => return Err(DaemonError::Io(path.to_path_buf(), e)),
    }
    tracing::info!(path = %path.display(), "removing a stale socket");
    std::fs::remove_file(path).map_err(|e| DaemonError::Io(path.to_path_buf(), e))
}

/// How often the accept loop looks at the stop flag while no client connects.
const ACCEPT_POLL: Duration = Duration::from_millis(100);

fn accept_loop(sh: &Arc<Shared>, listener: &UnixListener) {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let timeout = Timespec::try_from(ACCEPT_POLL).ok();
    loop {
        if sh.stopping.load(Ordering::SeqCst) {
            return;
        }
        let mut fds = [PollFd::new(listener, PollFlags::IN)];
        if !matches!(poll(&mut fds, timeout.as_ref()), Ok(n) if n > 0) {
            continue;
        }
        if sh.stopping.load(Ordering::SeqCst) {
            return;
        }
        let conn = listener.accept().map(|(s, _)| s);
        let stream = match conn {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if sh.connections.load(Ordering::SeqCst) >= sh.max_connections {
            refuse(sh, &stream);
            continue;
        }
        if let Err(e) = spawn_session(sh, stream) {
            tracing::warn!(error = %e, "could not start a session");
        }
    }
}

/// Answers a connection over the limit and closes it. Whatever it sent first (`HELLO` or
/// `ATTACH`, seq 1 from the client library) is not read: the answer has seq 0.
fn refuse(sh: &Shared, stream: &UnixStream) {
    let n = sh.refused_connections.fetch_add(1, Ordering::Relaxed);
    // Logged once per thousand: a client looping on connect must not flood the log.
    if n % 1000 == 0 {
        tracing::warn!(
            max = sh.max_connections,
            refused = n + 1,
            "connection refused: the daemon serves its most connections"
        );
    }
    let frame =
        Message::Err(WireError::Cm(rcm::Error::LimitExceeded(Limit::Connections))).encode(0);
    // A fresh socket's buffer takes a frame this small whole; never waits in any case.
    let _ = send(stream, &frame, SendFlags::DONTWAIT | SendFlags::NOSIGNAL);
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

/// Counts a connection served from `spawn_session` until its reader thread is done (or it
/// failed to start).
struct Served(Arc<Shared>);

impl Drop for Served {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Joins the reader threads of connections that ended: an ended thread's stack stays mapped
/// until it is joined, so a burst of short-lived clients left one per connection (tens of
/// KiB each) until the next client came.
fn reap_ended(sh: &Shared) {
    let done: Vec<_> = {
        let mut threads = lock(&sh.threads);
        let (done, live): (Vec<_>, Vec<_>) = std::mem::take(&mut *threads)
            .into_iter()
            .partition(std::thread::JoinHandle::is_finished);
        *threads = live;
        done
    };
    for t in done {
        let _ = t.join();
    }
}

fn spawn_session(sh: &Arc<Shared>, stream: UnixStream) -> std::io::Result<()> {
    sh.connections.fetch_add(1, Ordering::SeqCst);
    let served = Served(sh.clone());
    let order = sh.next_order.fetch_add(1, Ordering::Relaxed);
    let reader = stream.try_clone()?;
    let wire = stream.try_clone()?;
    let s = Arc::new(Session {
        order,
        token: AtomicU64::new(0),
        table: Mutex::new(Table {
            ids: foldhash::HashMap::default(),
            next: 0,
            closed: false,
            sealed: false,
        }),
        out: Mutex::new(Out::default()),
        out_cond: Condvar::new(),
        stream,
        wire: Mutex::new(Wire {
            stream: wire,
            backlog: Vec::new(),
            ring: None,
        }),
        dropped_events: AtomicU64::new(0),
        refused_requests: AtomicU64::new(0),
        warned: AtomicU64::new(0),
        commands: AtomicU64::new(0),
        creating: Mutex::new(()),
        channels: Mutex::new(HashMap::new()),
        ended: AtomicBool::new(false),
    });
    lock(&sh.sessions).insert(order, s.clone());
    reap_ended(sh);
    let ws = s.clone();
    let w = match std::thread::Builder::new()
        .name(format!("rcm-ucm-w{order}"))
        .spawn(move || writer_loop(&ws))
    {
        Ok(w) => w,
        Err(e) => {
            // No writer: undo the session (it holds nothing yet) as for a failed reader.
            lock(&sh.sessions).remove(&order);
            fail(&s);
            return Err(e);
        }
    };
    let sh2 = sh.clone();
    let rs = s.clone();
    let w = Arc::new(Mutex::new(Some(w)));
    let w2 = w.clone();
    let r = std::thread::Builder::new()
        .name(format!("rcm-ucm-r{order}"))
        .spawn(move || {
            let _served = served;
            tracing::debug!(session = order, "session open");
            reader_loop(&sh2, &rs, reader);
            close_session(&sh2, &rs);
            if let Some(w) = lock(&w2).take() {
                let _ = w.join();
            }
            // The connections that ended before this one: not only when the next begins.
            reap_ended(&sh2);
            tracing::debug!(session = order, "session closed");
        });
    match r {
        Ok(r) => {
            lock(&sh.threads).push(r);
            Ok(())
        }
        Err(e) => {
            // No reader: undo the session (it holds nothing yet) and end its writer.
            lock(&sh.sessions).remove(&order);
            fail(&s);
            if let Some(w) = lock(&w).take() {
                let _ = w.join();
            }
            Err(e)
        }
    }
}

/// Buffers of sent events a session keeps for its next events' frames, and the largest
/// one kept: a burst's events are a few hundred bytes each, and one with long private
/// data is let go rather than held.
const SPARE_FRAMES: usize = 32;
const SPARE_FRAME_BYTES: usize = 1024;

impl Out {
    /// Takes the event at the head of the queue as sent: its credit is used, and a connect
    /// request is no longer unread in the daemon. The caller checked that there is credit.
    /// Its frame's buffer is kept for a later event.
    fn take_sent(&mut self) -> bool {
        let Some(q) = self.events.pop_front() else {
            return false;
        };
        if q.listener.is_some() {
            self.unread_requests = self.unread_requests.saturating_sub(1);
        }
        self.credit -= 1;
        self.sent += 1;
        if self.spare.len() < SPARE_FRAMES && q.frame.capacity() <= SPARE_FRAME_BYTES {
            self.spare.push(q.frame);
        }
        true
    }

    /// A buffer for an event's frame: one of a sent event's if there is one, so that a
    /// burst's events do not each allocate (and free) their frame.
    fn frame_buf(&mut self) -> Vec<u8> {
        self.spare.pop().unwrap_or_default()
    }
}

/// Moves up to a batch of queued events that the client has credit for into `buf`.
fn take_batch(out: &mut Out, buf: &mut Vec<u8>) {
    let mut n = 0;
    while out.credit > 0 && n < EVENT_BATCH {
        let Some(q) = out.events.front() else {
            break;
        };
        buf.extend_from_slice(&q.frame);
        out.take_sent();
        n += 1;
    }
}

/// Writes what `flush_now` could not, and the events it left queued. Events are taken from
/// the queue only under the wire lock, so they go out in queue order whoever writes them.
fn writer_loop(s: &Session) {
    let mut buf = Vec::with_capacity(64 * 1024);
    let mut full_wait = RING_FULL_RETRY;
    loop {
        {
            let mut out = lock(&s.out);
            loop {
                if out.closed {
                    return;
                }
                if out.backlog || (out.credit > 0 && !out.events.is_empty()) {
                    break;
                }
                out = s
                    .out_cond
                    .wait(out)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
            }
        }
        let mut w = lock(&s.wire);
        if w.ring.is_some() {
            let ok = ring_events(s, &mut w);
            drop(w);
            if !ok {
                fail(s);
                return;
            }
            if lock(&s.out).ring_full {
                // The client reads slowly: it does not ring for room, so look again soon.
                std::thread::sleep(full_wait);
                full_wait = (full_wait * 2).min(RING_FULL_MAX_RETRY);
            } else {
                full_wait = RING_FULL_RETRY;
            }
            continue;
        }
        let backlog = std::mem::take(&mut w.backlog);
        buf.clear();
        {
            let mut out = lock(&s.out);
            out.backlog = false;
            take_batch(&mut out, &mut buf);
        }
        if send_all(&w.stream, &backlog).is_err() || send_all(&w.stream, &buf).is_err() {
            drop(w);
            fail(s);
            return;
        }
    }
}

/// Sends the queued events the client has credit for from the calling thread (an rcm
/// callback thread), without blocking: an event then costs no wake-up of the writer. What
/// the socket does not take at once is left to the writer thread, as is everything while
/// another thread is writing.
fn flush_now(s: &Session) {
    let mut w = match s.wire.try_lock() {
        Ok(w) => w,
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => {
            s.out_cond.notify_all();
            return;
        }
    };
    if w.ring.is_some() {
        if !ring_events(s, &mut w) {
            drop(w);
            fail(s);
        }
        return;
    }
    if !w.backlog.is_empty() {
        s.out_cond.notify_all();
        return;
    }
    let mut buf = Vec::new();
    // Batch after batch while the client has credit and events wait: a batch holds at most
    // EVENT_BATCH, and what is left after a whole one was sent would otherwise wait for the
    // next event (the writer is only woken for a backlog or a contended wire).
    loop {
        buf.clear();
        {
            let mut out = lock(&s.out);
            if out.closed {
                return;
            }
            take_batch(&mut out, &mut buf);
        }
        if buf.is_empty() {
            return;
        }
        let sent = match send(&w.stream, &buf, SendFlags::DONTWAIT | SendFlags::NOSIGNAL) {
            Ok(n) => n,
            Err(Errno::AGAIN | Errno::INTR) => 0,
            Err(_) => {
                drop(w);
                fail(s);
                return;
            }
        };
        if sent < buf.len() {
            // The rest of a frame may be cut: nothing else may be written before it.
            w.backlog = buf.split_off(sent);
            lock(&s.out).backlog = true;
            s.out_cond.notify_all();
            return;
        }
    }
}

thread_local! {
    /// On the ring thread: the sessions that have events to send after this round.
    static FLUSH_AFTER_ROUND: std::cell::RefCell<Option<Vec<Arc<Session>>>> =
        const { std::cell::RefCell::new(None) };
}

/// Sends a session's new events now, or, on the ring thread, once the round of commands
/// that produced them is done: a burst's events then leave in one write per session and
/// round instead of one per event (each a system call that may wake the client's reader).
fn flush_soon(s: &Arc<Session>) {
    let deferred = FLUSH_AFTER_ROUND.with(|f| {
        let mut f = f.borrow_mut();
        let Some(list) = f.as_mut() else {
            return false;
        };
        if !list.iter().any(|x| Arc::ptr_eq(x, s)) {
            list.push(s.clone());
        }
        true
    });
    if !deferred {
        flush_now(s);
    }
}

/// Sends what `flush_soon` put off on this thread. The list's room is kept for the next
/// round (a burst's rounds each made and freed one).
fn flush_round() {
    let Some(mut list) = FLUSH_AFTER_ROUND.with(|f| {
        let mut f = f.borrow_mut();
        let list = f.as_mut()?;
        (!list.is_empty()).then(|| std::mem::take(list))
    }) else {
        return;
    };
    for s in list.drain(..) {
        flush_now(&s);
    }
    FLUSH_AFTER_ROUND.with(|f| {
        if let Some(cur) = f.borrow_mut().as_mut() {
            if cur.is_empty() {
                *cur = list;
            }
        }
    });
}

/// How long a writer waits before it looks again at an events ring that had no room.
const RING_FULL_RETRY: Duration = Duration::from_millis(1);

/// The longest such wait: each look that still finds no room doubles it (from
/// `RING_FULL_RETRY / 10` for a reply, `RING_FULL_RETRY` for events), so a client that
/// stops reading costs its session's thread ~100 wake-ups a second, not thousands.
const RING_FULL_MAX_RETRY: Duration = Duration::from_millis(10);

/// Writes one whole frame into the session's events ring, ringing the doorbell if the
/// client sleeps: false when the ring has no room now; an error when the session cannot be
/// written to (the client hung up, or a frame longer than the ring).
fn ring_push(w: &mut Wire, frame: &[u8]) -> Result<bool, ()> {
    let Some(p) = w.ring.as_mut() else {
        return Err(());
    };
    crate::shmchan::push_ringing(p, &w.stream, frame).map_err(drop)
}

/// Moves the queued events the client has credit for into the events ring, in order, while
/// it has room (see `Out::ring_full`); false when the session cannot be written to.
fn ring_events(s: &Session, w: &mut Wire) -> bool {
    let mut out = lock(&s.out);
    out.ring_full = false;
    while out.credit > 0 && !out.closed {
        let Some(q) = out.events.front() else {
            break;
        };
        match ring_push(w, &q.frame) {
            Ok(true) => {
                out.take_sent();
            }
            Ok(false) => {
                out.ring_full = true;
                s.out_cond.notify_all();
                break;
            }
            Err(()) => return false,
        }
    }
    true
}

/// `MAP_EVENTS` on a session's own connection (protocol §2.3): the answer goes out on the
/// socket with the memory's descriptor, and everything written for the session after it
/// goes into the events ring. Refused (an error answer; the socket goes on as before) when
/// the daemon keeps sessions on their sockets, after the client's first credit (an event
/// may be on the socket already), or a second time.
fn map_events(sh: &Shared, s: &Session, seq: u32) {
    let refuse = |why: &str| {
        push_reply(
            s,
            &Message::Err(WireError::BadMessage(why.into())).encode(seq),
        );
    };
    if !sh.map_channels {
        return refuse("this daemon keeps events on the session's socket");
    }
    if lock(&s.out).granted {
        return refuse("MAP_EVENTS comes before the first GET_EVENT");
    }
    let mut w = lock(&s.wire);
    if w.ring.is_some() {
        drop(w);
        return refuse("the session's events are mapped already");
    }
    let (p, fd) = match crate::shmchan::events_daemon() {
        Ok(m) => m,
        Err(e) => {
            drop(w);
            return refuse(&format!("no shared memory: {e}"));
        }
    };
    // Counted before the answer goes: a client that has it finds itself counted.
    sh.mapped_sessions.fetch_add(1, Ordering::Relaxed);
    // Nothing is half-written: without credit no event was sent, and replies go out whole.
    let ok = Message::Ok(Answer::Reply(Reply::Done)).encode(seq);
    if crate::shmchan::send_with_fd(&w.stream, &ok, &fd).is_err() {
        sh.mapped_sessions.fetch_sub(1, Ordering::Relaxed);
        drop(w);
        return fail(s);
    }
    w.ring = Some(p);
}

/// The client cannot be written to: end the session (the reader sees the shutdown).
fn fail(s: &Session) {
    lock(&s.out).closed = true;
    s.out_cond.notify_all();
    let _ = s.stream.shutdown(std::net::Shutdown::Both);
}

fn push_reply(s: &Session, frame: &[u8]) {
    // Written at once by the reader: a reply costs no thread hop. A client that does not
    // read its replies blocks here, stalling only its own session.
    let mut w = lock(&s.wire);
    if w.ring.is_some() {
        let mut wait = RING_FULL_RETRY / 10;
        loop {
            match ring_push(&mut w, frame) {
                Ok(true) => return,
                Ok(false) if lock(&s.out).closed || hung_up(&w.stream) => return,
                Ok(false) => {
                    std::thread::sleep(wait);
                    wait = (wait * 2).min(RING_FULL_MAX_RETRY);
                }
                Err(()) => {
                    drop(w);
                    fail(s);
                    return;
                }
            }
        }
    }
    let backlog = std::mem::take(&mut w.backlog);
    if send_all(&w.stream, &backlog).is_err() || send_all(&w.stream, frame).is_err() {
        drop(w);
        fail(s);
    }
}

fn reader_loop(sh: &Arc<Shared>, s: &Arc<Session>, stream: UnixStream) {
    // Buffered: a client that pipelines commands has them read in one system call.
    let mut stream =
        std::io::BufReader::with_capacity(16 * 1024, SpinRead::new(stream, Duration::ZERO));
    // Until the session is open (or the channel attached): a connection that does not open
    // it in time is closed, whether it stays silent (the read's deadline), keeps sending
    // (checked at each frame) or does not read the answers it gets (the write's timeout).
    let deadline = Instant::now() + sh.handshake_timeout;
    stream.get_mut().deadline = Some(deadline);
    let _ = s.stream.set_write_timeout(Some(sh.handshake_timeout));
    let max = sh.limits.max_message as usize;
    let mut body = Vec::new();
    let mut hello = false;
    // For a command channel: the session it serves. Replies still go to this connection.
    let mut target: Option<Channel> = None;
    loop {
        if !hello && Instant::now() >= deadline {
            return;
        }
        let mut hb = [0u8; 12];
        if stream.read_exact(&mut hb).is_err() {
            return;
        }
        let h = match Header::parse(&hb) {
            Ok(h) => h,
            Err(e) => {
                // The stream cannot be resynchronised: say why and end the session.
                push_reply(
                    s,
                    &Message::Err(WireError::BadMessage(e.to_string())).encode(0),
                );
                return;
            }
        };
        let total = h.frame_len();
        if total > max {
            // Skip the body so the stream stays in step, and say which limit it hit.
            let skipped = std::io::copy(
                &mut (&mut stream).take(h.body_len() as u64),
                &mut std::io::sink(),
            );
            if !matches!(skipped, Ok(n) if n == h.body_len() as u64) {
                return;
            }
            let e = WireError::Cm(rcm::Error::LimitExceeded(Limit::MessageSize));
            push_reply(s, &Message::Err(e).encode(h.seq));
            continue;
        }
        body.resize(h.body_len(), 0);
        if stream.read_exact(&mut body).is_err() {
            return;
        }
        target
            .as_ref()
            .map_or(&**s, |c| &*c.target)
            .commands
            .fetch_add(1, Ordering::Relaxed);
        let cmd = match decode_command(h.kind, &body) {
            Ok(c) => c,
            Err(e) => {
                push_reply(
                    s,
                    &Message::Err(WireError::BadMessage(e.to_string())).encode(h.seq),
                );
                continue;
            }
        };
        // The events an operation produces (ADDR_RESOLVED from resolve_addr, say; a peer's
        // CONNECT_REQUEST from connect on the same device) are queued, and sent as far as
        // credit allows, by this thread before the reply, not by a woken callback thread
        // (the daemon's callbacks never block): they are what the next step waits for, the
        // reply only unblocks the caller (serial connects through a one-address daemon,
        // 18 interleaved rounds: p50 median 53.5 µs against 60.5 with the reply first).
        let here = matches!(cmd, Command::Call(..)).then(rcm::CallbacksHere::begin);
        let reply = match (&cmd, hello) {
            (Command::Hello { min, max }, false) => match check_version(*min, *max) {
                Ok(()) => {
                    hello = true;
                    stream.get_mut().deadline = None;
                    let _ = s.stream.set_write_timeout(None);
                    let token = loop {
                        let t: u64 = rand::random();
                        if t != 0 {
                            break t;
                        }
                    };
                    s.token.store(token, Ordering::SeqCst);
                    lock(&sh.tokens).insert(token, Arc::downgrade(s));
                    Some(Message::HelloOk {
                        version: proto::VERSION,
                        token,
                        limits: sh.limits,
                    })
                }
                Err(e) => Some(Message::Err(e)),
            },
            (Command::Attach { min, max, token }, false) => {
                match attach(sh, s, *min, *max, *token) {
                    Ok(t) => {
                        hello = true;
                        stream.get_mut().deadline = None;
                        let _ = s.stream.set_write_timeout(None);
                        target = Some(t);
                        // The client waits on this channel for each answer and sends its next
                        // command right after: worth polling for.
                        stream.get_mut().spin = sh.spin;
                        Some(Message::Ok(Answer::Reply(Reply::Done)))
                    }
                    Err(e) => Some(Message::Err(e)),
                }
            }
            (Command::Hello { .. } | Command::Attach { .. }, true) => Some(Message::Err(
                WireError::Handshake("the session is already open".into()),
            )),
            (Command::MapChannel, true) if target.is_some() => {
                if let Some(t) = target.take() {
                    match map_channel(sh, s, t, h.seq) {
                        Ok(()) => return,
                        Err(t) => target = Some(t),
                    }
                }
                None
            }
            (Command::MapEvents, true) if target.is_none() => {
                map_events(sh, s, h.seq);
                None
            }
            (Command::MapChannel, _) => Some(Message::Err(WireError::BadMessage(
                "MAP_CHANNEL is for an attached command channel".into(),
            ))),
            (Command::GetEvent(_), true) if target.is_some() => Some(get_event_on_a_channel()),
            (_, false) => Some(Message::Err(WireError::Handshake(
                "send Hello first".into(),
            ))),
            (_, true) => serve(sh, target.as_ref().map_or(s, |c| &c.target), cmd),
        };
        drop(here);
        if let Some(m) = reply {
            push_reply(s, &m.encode(h.seq));
        }
    }
}

/// `MAP_CHANNEL` on the command channel `s` of `t`'s session: the answer goes out with the
/// shared memory's descriptor, and from then on this thread serves the channel's commands
/// from the ring (see [`crate::shmchan`]) until either side ends. A refusal (the daemon's
/// choice, a message limit over the ring, no memory) is an error answer, and the channel
/// stays on its socket: `Err` gives it back to the socket's reader.
fn map_channel(sh: &Arc<Shared>, s: &Arc<Session>, t: Channel, seq: u32) -> Result<(), Channel> {
    let refuse = |why: String| {
        push_reply(s, &Message::Err(WireError::BadMessage(why)).encode(seq));
    };
    let made = if !sh.map_channels {
        Err("this daemon keeps command channels on their sockets".to_string())
    } else if rcm_shm::Producer::footprint(sh.limits.max_message as usize)
        > crate::shmchan::RING_BYTES as usize
    {
        Err("the message limit is over the shared ring's size".to_string())
    } else {
        s.stream
            .try_clone()
            .and_then(crate::shmchan::ShmEnd::daemon)
            .map_err(|e| format!("no shared memory: {e}"))
    };
    let (end, fd) = match made {
        Ok(m) => m,
        Err(why) => {
            refuse(why);
            return Err(t);
        }
    };
    // Counted before the answer goes, as for `map_events`.
    sh.mapped_channels.fetch_add(1, Ordering::Relaxed);
    {
        let w = lock(&s.wire);
        let ok = Message::Ok(Answer::Reply(Reply::Done)).encode(seq);
        if crate::shmchan::send_with_fd(&w.stream, &ok, &fd).is_err() {
            sh.mapped_channels.fetch_sub(1, Ordering::Relaxed);
            drop(w);
            fail(s);
            return Ok(());
        }
    }
    drop(fd);
    // The ring thread serves the channel from now on; this thread only holds the connection
    // open (its end closes it, as for a channel on its socket) until that thread is done.
    let done = Arc::new(Done::default());
    let rings = sh
        .rings
        .iter()
        .min_by_key(|r| r.serving.load(Ordering::Relaxed))
        .unwrap_or(&sh.rings[0]);
    rings.serving.fetch_add(1, Ordering::Relaxed);
    rings.add(Mapped {
        end,
        target: t,
        pending: None,
        answer: Vec::new(),
        done: done.clone(),
        serving: rings.serving.clone(),
    });
    done.wait();
    Ok(())
}

/// Set by the ring thread when it stops serving a mapped channel.
#[derive(Default)]
struct Done {
    done: Mutex<bool>,
    cond: Condvar,
}

impl Done {
    fn set(&self) {
        *lock(&self.done) = true;
        self.cond.notify_all();
    }

    fn wait(&self) {
        let mut d = lock(&self.done);
        while !*d {
            d = self
                .cond
                .wait(d)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }
}

/// A mapped channel, served by the ring thread.
struct Mapped {
    end: crate::shmchan::ShmEnd,
    target: Channel,
    /// An answer the ring had no room for: the channel's next command waits for it to go.
    pending: Option<Vec<u8>>,
    /// The buffer answers are encoded into, kept from command to command.
    answer: Vec<u8>,
    done: Arc<Done>,
    /// Its ring thread's count of channels.
    serving: Arc<AtomicUsize>,
}

impl Drop for Mapped {
    fn drop(&mut self) {
        self.serving.fetch_sub(1, Ordering::Relaxed);
        self.done.set();
    }
}

/// Mapped channels, of any session, served by one thread (`ring_loop`); the daemon has
/// `DaemonConfig::ring_threads` of them. A thread per channel, each polling its ring before
/// it sleeps, put more polling threads than CPUs on a small machine: a command then waited
/// for its channel's thread to get a CPU (in `hop_steps`, `accept` on a channel that had
/// been idle for one cycle: 18.6 µs from push to pickup, against 1.5 for a busy one). A
/// ring thread looks at each of its rings in turn, one command per channel per round, so a
/// client sending without pause delays the others by one command each round; any command
/// the daemon serves is short and never waits for a client.
struct Rings {
    /// Channels mapped and not yet taken in by the thread; `None` once the thread is gone
    /// (the daemon stops), so that a channel mapped after its last look is let go at once
    /// instead of leaving its connection's thread waiting, and the stop with it.
    new: Mutex<Option<Vec<Mapped>>>,
    /// Channels it serves.
    serving: Arc<AtomicUsize>,
    /// The thread's sleep is a poll(2) on every channel's socket and on this pair's read
    /// end: a byte on the write end wakes it for a new channel or the daemon's stop.
    wake_rx: UnixStream,
    wake_tx: UnixStream,
}

impl Rings {
    fn new() -> std::io::Result<Rings> {
        let (wake_rx, wake_tx) = UnixStream::pair()?;
        wake_rx.set_nonblocking(true)?;
        wake_tx.set_nonblocking(true)?;
        Ok(Rings {
            new: Mutex::new(Some(Vec::new())),
            serving: Arc::new(AtomicUsize::new(0)),
            wake_rx,
            wake_tx,
        })
    }

    fn add(&self, m: Mapped) {
        let refused = match lock(&self.new).as_mut() {
            Some(new) => {
                new.push(m);
                None
            }
            None => Some(m),
        };
        // Dropped outside the lock: that is what lets its connection's thread go.
        drop(refused);
        self.wake();
    }

    fn wake(&self) {
        // A full socket already holds a wake-up.
        let _ = send(
            &self.wake_tx,
            &[1],
            SendFlags::DONTWAIT | SendFlags::NOSIGNAL,
        );
    }
}

/// How often the ring thread, while it polls, looks for channels whose client hung up
/// (sleeping, it sees that at once).
const HANG_UP_CHECK: Duration = Duration::from_millis(10);

/// How often a sleeping ring thread tries again to write an answer its ring had no room for
/// (only a client that sends more than one command at a time on a channel fills it).
const PENDING_RETRY: Duration = Duration::from_millis(1);

/// A ring thread: serves the mapped channels given to `rings` until the daemon stops.
fn ring_loop(sh: &Arc<Shared>, rings: &Rings) {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    /// Closes `Rings::new` when the thread ends, however it ends.
    struct Closing<'a>(&'a Rings);
    impl Drop for Closing<'_> {
        fn drop(&mut self) {
            let left = lock(&self.0.new).take();
            drop(left);
        }
    }
    let _closing = Closing(rings);
    let mut live: Vec<Mapped> = Vec::new();
    let mut last_work = Instant::now();
    let mut last_check = Instant::now();
    FLUSH_AFTER_ROUND.with(|f| *f.borrow_mut() = Some(Vec::new()));
    let mut devices = DevicePolls::new(sh);
    let mut device_turn = false;
    loop {
        // Each turn shows the pollers on this CPU that their yield went to this process
        // (see `rcm::look_here`): a turn of commands can outlast a stolen yield's length.
        rcm::look_here();
        if sh.stopping.load(Ordering::SeqCst) {
            // Dropping each (here, and the new ones as `_closing` goes) tells its channel's
            // thread, which closes the connection.
            return;
        }
        if let Some(new) = lock(&rings.new).as_mut() {
            live.append(new);
        }
        // The round's datagrams (a connect's REQ, an accept's REP) go out after its answers
        // and events, those to one peer together (see `events_first`).
        let worked = events_first(|| {
            let mut worked = false;
            live.retain_mut(|m| match serve_channel(sh, m) {
                Ok(w) => {
                    worked |= w;
                    !m.target.target.ended.load(Ordering::Relaxed)
                }
                Err(e) => {
                    tracing::debug!(error = %e, "mapped channel ends");
                    false
                }
            });
            worked
        });
        let now = Instant::now();
        if now >= last_check + HANG_UP_CHECK {
            last_check = now;
            live.retain(|m| crate::shmchan::drain_doorbells(&m.end.stream));
        }
        if worked {
            // What the round sent to this daemon's own devices is in their sockets already
            // (loopback delivers within the send): received now, not at the idle loop's
            // turn for that device, which came one to three system calls later (a serial
            // connect through a two-address daemon waited for it twice, once for the REQ and
            // once for the REP). What the handling sends (an RTU) is held until the events
            // are in their rings: the event is what the client waits for.
            last_work = now;
            // A channel whose answer waits for room takes no command now (see the sleep
            // below): its commands are no reason to cut the sweep short.
            events_first(|| {
                devices.sweep(sh.spin, || {
                    live.iter()
                        .any(|m| m.pending.is_none() && m.end.has_command())
                })
            });
            continue;
        }
        // Not while held off polling: a yield of this thread went to a CPU-bound process
        // (see `rcm::spin_allowed`), and each would again; asleep, a client's doorbell
        // wakes it at once.
        if now < last_work + sh.spin && rcm::spin_allowed() {
            // A receive for a device and a yield are a system call each (about a µs on the
            // 2-core VMs), and a command that lands meanwhile waits for it: the rings are
            // looked at after each of the two, not after both (a call's round trip, `hop`
            // bench query: 1.97 -> 1.25 µs; serial connects through a two-address daemon
            // p50 ~50 -> ~40 µs, 6 interleaved rounds).
            device_turn = !device_turn;
            if device_turn {
                // As after a round: an RTU the handling sends goes after the event.
                if events_first(|| devices.poll(last_work + sh.spin - now)) {
                    last_work = now;
                }
                continue;
            }
            // Stolen, it holds this thread off polling: the next turn sleeps.
            let _ = rcm::yield_to_pollers();
            continue;
        }
        devices.sleep();
        // Asleep in every ring before the last look at them, so no command is missed: a
        // client that pushes after our mark rings the doorbell. A channel whose answer waits
        // for room takes no command before that answer is out (tried again each
        // PENDING_RETRY, below): the commands behind it are no reason to stay up, and
        // counting them kept this thread spinning for as long as its client did not read.
        if !live
            .iter()
            .filter(|m| m.pending.is_none())
            .all(|m| m.end.prepare_sleep())
        {
            for m in &live {
                m.end.awake();
            }
            continue;
        }
        let mut fds = Vec::with_capacity(live.len() + 1);
        fds.push(PollFd::new(&rings.wake_rx, PollFlags::IN));
        fds.extend(
            live.iter()
                .map(|m| PollFd::new(&m.end.stream, PollFlags::IN)),
        );
        // The session-ended and stop flags are looked at on every wake; a session's end
        // also shuts its channels' sockets down, which wakes this poll. An answer waiting
        // for room is tried again each PENDING_RETRY: the client that made room by reading
        // does not know to ring for it.
        let timeout = if live.iter().any(|m| m.pending.is_some()) {
            PENDING_RETRY
        } else {
            HANG_UP_CHECK * 10
        };
        let timeout = Timespec::try_from(timeout).ok();
        rcm::look_here();
        let woken = poll(&mut fds, timeout.as_ref()).is_ok_and(|n| n > 0);
        drop(fds);
        for m in &live {
            m.end.awake();
        }
        let _ = crate::shmchan::drain_doorbells(&rings.wake_rx);
        live.retain(|m| crate::shmchan::drain_doorbells(&m.end.stream));
        // Woken by the clock (a pending answer's retry, the hang-up check), not by a
        // client: one round, then asleep again, not a spin's worth of polling each time.
        let now = Instant::now();
        if woken {
            last_work = now;
        }
        last_check = now;
    }
}

/// Runs `work` (a round of commands, or receives for the devices) holding what it sends
/// (`rcm::SendBatch`): its answers and events go into their rings first, since they are what
/// clients wait for, then its datagrams, those to one peer in one system call (on loopback a
/// `sendto` also runs the receiver's network stack: about a µs). A datagram to a device's
/// own address reaches its engine within that send (`rcm::FabricConfig::loopback`, a
/// one-address daemon's clients connecting to each other): the callbacks of what it makes
/// run here, as a command's own do, not on a callback thread that may have to be woken
/// (tens of µs on these VMs), and their events go out after. Returns what `work` did.
fn events_first<R>(work: impl FnOnce() -> R) -> R {
    let batch = rcm::SendBatch::begin();
    let r = work();
    flush_round();
    let here = rcm::CallbacksHere::begin();
    drop(batch);
    drop(here);
    flush_round();
    r
}

/// The devices a ring thread receives for while it polls its rings with nothing to do
/// (RoCEv2 ones; see `rcm::Device::busy_poller`). Their own threads stand aside meanwhile:
/// on two CPUs, one-at-a-time connects through a two-address daemon had five threads
/// polling (the two device threads, this one, and the two client sessions' waiting
/// threads) and made ~65 context switches each, nearly all of them a poller yielding to
/// another poller; with this, ~30. The events polled here run their (never blocking)
/// callbacks on this thread, as a command's own do, so a datagram that answers a command
/// needs no other daemon thread.
struct DevicePolls {
    pollers: Vec<Arc<dyn rcm::remote::BusyPoll>>,
    /// Between `begin` and `end` on every poller.
    polling: bool,
    /// The poller the last look took.
    next: usize,
    /// Which pollers a look receives from (kept for its capacity).
    ready: Vec<bool>,
    /// What each poller offers to ask with `poll(2)` (`BusyPoll::readiness`), fetched at
    /// the first look after a sleep and let go at the next sleep: a device removed
    /// meanwhile keeps its socket open until then.
    srcs: Option<Vec<Option<Arc<dyn std::os::fd::AsFd + Send + Sync>>>>,
}

impl DevicePolls {
    fn new(sh: &Shared) -> Self {
        let pollers = sh
            .fabric
            .device_addrs()
            .into_iter()
            .filter_map(|ip| sh.fabric.device(ip)?.busy_poller())
            .collect();
        Self::of(pollers)
    }

    fn of(pollers: Vec<Arc<dyn rcm::remote::BusyPoll>>) -> Self {
        DevicePolls {
            pollers,
            polling: false,
            next: 0,
            ready: Vec::new(),
            srcs: None,
        }
    }

    /// Receives for the next device with something (see `sweep`; a device that cannot say
    /// counts as having something), the poll of every device (begun if need be) lasting
    /// `left` at most: whether anything came.
    fn poll(&mut self, left: Duration) -> bool {
        // One device per look: a receive call costs about a µs here, and a ring thread
        // looks between bursts' commands too (two calls a look made it ~70 of them per
        // connection of a burst). Which one, asked of all at once: taken in turn, a
        // datagram for the last of six devices waited five looks.
        self.look(left, 1, || false)
    }

    /// Receives once for each device that has something (one `poll(2)` for all of them,
    /// see `BusyPoll::readiness`), in turn from the one after the last looked at, stopping
    /// early when `commands` says one waits in a ring (it is served first; the next round
    /// sweeps again): whether anything came. At least one device with something is received
    /// from, so that a stream of commands does not keep the devices waiting. (Receiving
    /// from every device instead cost a daemon of six addresses ~1 µs a round, 2–4 µs a
    /// one-at-a-time connect.)
    fn sweep(&mut self, left: Duration, commands: impl Fn() -> bool) -> bool {
        self.look(left, self.pollers.len(), commands)
    }

    /// Receives for up to `most` devices that have something, in turn (see `sweep`).
    fn look(&mut self, left: Duration, most: usize, commands: impl Fn() -> bool) -> bool {
        let n = self.pollers.len();
        if n == 0 {
            return false;
        }
        if !self.polling {
            self.polling = true;
            for p in &self.pollers {
                p.begin(left);
            }
        }
        self.find_ready();
        let mut got = false;
        let mut looked = 0;
        let from = self.next;
        for step in 1..=n {
            let k = (from + step) % n;
            if !self.ready.get(k).copied().unwrap_or(true) {
                continue;
            }
            if looked == most || (looked > 0 && commands()) {
                break;
            }
            looked += 1;
            self.next = k;
            got |= self.poll_at(k);
        }
        got
    }

    /// Receives for poller `k` (the polls begun).
    fn poll_at(&mut self, k: usize) -> bool {
        let here = rcm::CallbacksHere::begin();
        let got = self.pollers.get(k).is_some_and(|p| p.poll());
        drop(here);
        if got {
            // The next poll begins again, with a deadline from then: the devices' threads
            // stay aside for as long as this thread is busy receiving.
            self.end();
        }
        got
    }

    /// Which devices have something to receive (`ready`): one `poll(2)` over those that
    /// say what to ask; the others are always received from, and so is every device when
    /// the `poll(2)` fails. A single device is just received from.
    fn find_ready(&mut self) {
        use rustix::event::{poll, PollFd, PollFlags, Timespec};
        fn pollfd(s: &Arc<dyn std::os::fd::AsFd + Send + Sync>) -> PollFd<'_> {
            PollFd::from_borrowed_fd(s.as_fd(), PollFlags::IN)
        }
        self.ready.clear();
        self.ready.resize(self.pollers.len(), true);
        if self.pollers.len() < 2 {
            return;
        }
        let pollers = &self.pollers;
        let srcs = self
            .srcs
            .get_or_insert_with(|| pollers.iter().map(|p| p.readiness()).collect());
        let fds_of = || {
            srcs.iter()
                .enumerate()
                .filter_map(|(k, s)| Some((k, s.as_ref()?)))
        };
        let Some((_, first)) = fds_of().next() else {
            return;
        };
        // On the stack for a daemon's usual few addresses: this runs at every idle look
        // and after every round, and a `Vec` was an allocation each time.
        let mut few: [PollFd; POLLED_ON_STACK] = std::array::from_fn(|_| pollfd(first));
        let mut many = Vec::new();
        let n = fds_of().count();
        let fds: &mut [PollFd] = if n <= POLLED_ON_STACK {
            for (slot, (_, s)) in few.iter_mut().zip(fds_of()) {
                *slot = pollfd(s);
            }
            &mut few[..n]
        } else {
            many.extend(fds_of().map(|(_, s)| pollfd(s)));
            &mut many
        };
        let zero = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        if poll(fds, Some(&zero)).is_err() {
            return;
        }
        for ((k, _), fd) in fds_of().zip(fds.iter()) {
            if let Some(r) = self.ready.get_mut(k) {
                // Anything but nothing (an error, a hang-up) is the device's own to handle.
                *r = !fd.revents().is_empty();
            }
        }
    }

    /// This thread stops polling the devices for now: their own threads may take their
    /// sockets back (when a poll got something, the next begins anew; before a sleep).
    fn end(&mut self) {
        if std::mem::take(&mut self.polling) {
            for p in &self.pollers {
                p.end();
            }
        }
    }

    /// This thread is about to sleep: the devices' own threads take their sockets back now.
    fn sleep(&mut self) {
        self.end();
        self.srcs = None;
        for p in &self.pollers {
            p.kick();
        }
    }
}

impl Drop for DevicePolls {
    fn drop(&mut self) {
        self.sleep();
    }
}

/// Devices whose readiness `DevicePolls::find_ready` asks without allocating.
const POLLED_ON_STACK: usize = 8;

/// Commands of one mapped channel served in a round at most: a client that pipelines its
/// calls (`rcm::Pipeline`) has many waiting, and a round's datagrams then go out in runs
/// (one system call per peer) while the other channels still get their turn each round.
const COMMANDS_PER_ROUND: usize = 32;

/// Serves the commands waiting in a mapped channel, [`COMMANDS_PER_ROUND`] at most: whether
/// there was one. Stops early when the client's answer ring is full (it reads its answers
/// before it writes more). An error ends the channel.
fn serve_channel(sh: &Arc<Shared>, m: &mut Mapped) -> std::io::Result<bool> {
    let mut worked = false;
    for _ in 0..COMMANDS_PER_ROUND {
        let w = serve_mapped(sh, m)?;
        worked |= w;
        if !w || m.pending.is_some() {
            break;
        }
    }
    Ok(worked)
}

/// Serves at most one command of a mapped channel: whether there was one (or a pending
/// answer went out). An error ends the channel.
fn serve_mapped(sh: &Arc<Shared>, m: &mut Mapped) -> std::io::Result<bool> {
    if let Some(p) = m.pending.take() {
        if !m.end.try_send(&p)? {
            m.pending = Some(p);
            return Ok(false);
        }
        m.answer = p;
        return Ok(true);
    }
    let Some(frame) = m.end.try_recv(crate::shmchan::RING_BYTES as usize)? else {
        return Ok(false);
    };
    // At each command too, not only each turn: a turn the scheduler preempts in its middle
    // gives a poller's yield back before the turn's end (see `rcm::look_here`).
    rcm::look_here();
    let answer = answer_mapped(sh, &m.target, frame, std::mem::take(&mut m.answer))?;
    if m.end.try_send(&answer)? {
        m.answer = answer;
    } else {
        // A client that pipelines its calls reads their answers while it writes more; one
        // that does not read them fills its answer ring, and then only its channel waits.
        m.pending = Some(answer);
    }
    Ok(true)
}

/// The answer to one frame read from a mapped channel of `t`'s session. Any frame the ring
/// can hold is read: one over the message limit is answered with that typed error, as on
/// a socket, and the channel goes on.
fn answer_mapped(
    sh: &Arc<Shared>,
    t: &Channel,
    frame: &[u8],
    buf: Vec<u8>,
) -> std::io::Result<Vec<u8>> {
    let max = sh.limits.max_message as usize;
    let h = match Header::parse(frame.first_chunk::<12>().unwrap_or(&[0; 12])) {
        Ok(h) if frame.len() == h.frame_len() => h,
        // A frame whose header does not match its length: the ring is out of step.
        _ => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "a frame that cannot be one",
            ))
        }
    };
    if frame.len() > max {
        let e = WireError::Cm(rcm::Error::LimitExceeded(Limit::MessageSize));
        return Ok(Message::Err(e).encode_in(buf, h.seq));
    }
    t.target.commands.fetch_add(1, Ordering::Relaxed);
    let reply = match decode_command(h.kind, &frame[12..]) {
        Ok(Command::Hello { .. } | Command::Attach { .. }) => {
            Message::Err(WireError::Handshake("the session is already open".into()))
        }
        Ok(Command::MapChannel) => Message::Err(WireError::BadMessage(
            "the channel is mapped already".into(),
        )),
        Ok(Command::GetEvent(_)) => get_event_on_a_channel(),
        Ok(cmd) => {
            // As on a socket channel: the events a call produces go out first.
            let here = matches!(cmd, Command::Call(..)).then(rcm::CallbacksHere::begin);
            let r = serve(sh, &t.target, cmd);
            drop(here);
            r.unwrap_or_else(|| Message::Err(WireError::BadMessage("no answer".into())))
        }
        Err(e) => Message::Err(WireError::BadMessage(e.to_string())),
    };
    Ok(reply.encode_in(buf, h.seq))
}

/// The answer to `GET_EVENT` on a command channel, socket or mapped: it grants nothing.
fn get_event_on_a_channel() -> Message {
    Message::Err(WireError::BadMessage(
        "GET_EVENT on a command channel: events flow on the session's own connection".into(),
    ))
}

/// Carries out one command of an open session. `None`: no reply (GetEvent).
fn serve(sh: &Arc<Shared>, s: &Arc<Session>, cmd: Command) -> Option<Message> {
    let r: Result<Answer, WireError> = match cmd {
        Command::Hello { .. } | Command::Attach { .. } => {
            Err(WireError::Handshake("unexpected Hello".into()))
        }
        Command::MapChannel => Err(WireError::BadMessage(
            "MAP_CHANNEL is for an attached command channel".into(),
        )),
        Command::MapEvents => Err(WireError::BadMessage(
            "MAP_EVENTS is for a session's own connection".into(),
        )),
        Command::CreateId(ps) => create_id(sh, s, ps, None),
        Command::CreateIdAs(ps, h) => create_id(sh, s, ps, Some(h)),
        Command::DestroyId(h) => destroy_id(s, h).map(|events| Answer::Released { events }),
        Command::GetEvent(n) => {
            let mut out = lock(&s.out);
            out.credit = out.credit.saturating_add(u64::from(n));
            out.granted = true;
            drop(out);
            flush_now(s);
            return None;
        }
        Command::MigrateId { token, handle } => migrate_id(sh, s, token, handle),
        Command::Devices => Ok(Answer::Devices(sh.fabric.device_addrs())),
        Command::Stats => {
            let ids = lock(&s.table).ids.len() as u64;
            let out = lock(&s.out);
            Ok(Answer::Stats(SessionStats {
                ids,
                queued_events: out.events.len() as u64,
                dropped_events: s.dropped_events.load(Ordering::Relaxed),
                refused_requests: s.refused_requests.load(Ordering::Relaxed),
                credit: out.credit,
                commands: s.commands.load(Ordering::Relaxed),
            }))
        }
        Command::Call(h, op) => call_id(s, h, op, false),
        Command::BindOrSeal(h, a) => call_id(s, h, Op::Bind(a), true),
    };
    Some(match r {
        Ok(a) => Message::Ok(a),
        Err(e) => Message::Err(e),
    })
}

/// Carries out `op` on the id `h` of `s`. An id sealed by a refused `BindOrSeal` refuses it
/// with that bind's error instead, unless it is a `QUERY` (which changes nothing): the
/// client wrote it behind the bind without knowing the bind failed, and a `listen` or
/// `resolve_addr` carried out on the unbound id would bind it elsewhere (the wildcard
/// address, another port). `seal`: this call is such a bind, whose refusal seals the id.
fn call_id(s: &Session, h: u32, op: Op, seal: bool) -> Result<Answer, WireError> {
    let found = {
        let t = lock(&s.table);
        t.ids.get(&h).map(
            |(id, cell)| match t.sealed.then(|| cell.sealed.get()).flatten() {
                Some(e) if !matches!(op, Op::Query) => Err(e.clone()),
                _ => Ok((id.clone(), seal.then(|| cell.clone()))),
            },
        )
    };
    let (id, cell) = match found {
        None => return Err(WireError::NoSuchId),
        Some(Err(e)) => return Err(WireError::Cm(e)),
        Some(Ok(found)) => found,
    };
    // Commands of one session run one at a time, in order, and rcm serialises calls on
    // one id: the two halves of Linux bug 2's fix.
    id.call(op).map(Answer::Reply).map_err(|e| {
        if let Some(cell) = cell {
            let _ = cell.sealed.set(e.clone());
            lock(&s.table).sealed = true;
        }
        WireError::Cm(e)
    })
}

/// Whether an `ATTACH` may have a place while `connections` (it included) of `max` are
/// served: at least a quarter of the places stay for sessions (a quarter exactly, not
/// rounded down: with 3, the third connection is kept from channels).
fn channel_may_attach(connections: usize, max: usize) -> bool {
    // 4 * free >= max, in u64 so that no count overflows.
    4 * (max as u64).saturating_sub(connections as u64) >= max as u64
}

/// `HELLO` and `ATTACH` both name a range of versions that must contain ours.
fn check_version(min: u16, max: u16) -> Result<(), WireError> {
    if min <= proto::VERSION && proto::VERSION <= max {
        Ok(())
    } else {
        Err(WireError::Handshake(format!(
            "versions {min}..={max} requested; this daemon speaks {}",
            proto::VERSION
        )))
    }
}

/// Makes connection `s` a command channel of the session holding `token`.
fn attach(
    sh: &Arc<Shared>,
    s: &Arc<Session>,
    min: u16,
    max: u16,
    token: u64,
) -> Result<Channel, WireError> {
    check_version(min, max)?;
    // Channels only make calls faster; sessions are needed. A quarter of the places are
    // kept from channels (this connection counts already), so a busy set of clients' channels
    // never leaves a new client without a place for its session.
    if !channel_may_attach(sh.connections.load(Ordering::SeqCst), sh.max_connections) {
        return Err(WireError::Cm(rcm::Error::LimitExceeded(Limit::Connections)));
    }
    let t = lock(&sh.tokens)
        .get(&token)
        .and_then(Weak::upgrade)
        .ok_or(WireError::NoSuchSession)?;
    // Registered under the table lock that close_session sets `closed` under, so a channel
    // is either refused or shut down with its session.
    let table = lock(&t.table);
    if table.closed {
        return Err(WireError::NoSuchSession);
    }
    let mut ch = lock(&t.channels);
    if ch.len() >= sh.max_channels {
        return Err(WireError::Cm(rcm::Error::LimitExceeded(Limit::Channels)));
    }
    let stream = s
        .stream
        .try_clone()
        .map_err(|e| WireError::BadMessage(e.to_string()))?;
    ch.insert(s.order, stream);
    drop(ch);
    drop(table);
    // A channel is not a session of its own: it holds nothing and is not counted.
    lock(&sh.sessions).remove(&s.order);
    Ok(Channel {
        target: t,
        order: s.order,
    })
}

fn create_id(
    sh: &Arc<Shared>,
    s: &Arc<Session>,
    ps: rcm::PortSpace,
    chosen: Option<u32>,
) -> Result<Answer, WireError> {
    let _serial = lock(&s.creating);
    {
        let t = lock(&s.table);
        if let Some(h) = chosen {
            // Checked before the limit: a client that names a wrong handle learns that,
            // whatever else holds. The creates of a session are serialised (`creating`),
            // so the handle is still free when it is entered below.
            if h < proto::CLIENT_HANDLES {
                return Err(WireError::Cm(rcm::Error::InvalidArgument(
                    "a handle a client chooses is 0x80000000 or above".into(),
                )));
            }
            if t.ids.contains_key(&h) {
                return Err(WireError::Cm(rcm::Error::InvalidArgument(
                    "the session holds an id with that handle".into(),
                )));
            }
        }
        if t.ids.len() >= sh.limits.max_ids as usize {
            return Err(WireError::Cm(rcm::Error::LimitExceeded(Limit::Ids)));
        }
    }
    let limits = sh.limits;
    let weak = Arc::downgrade(sh);
    let id = sh
        .fabric
        .try_create_id(ps, move |id, ev| on_event(&weak, limits, id, ev))
        .map_err(WireError::Cm)?;
    let mut t = lock(&s.table);
    if t.closed {
        drop(t);
        let _ = id.destroy();
        return Err(WireError::NoSuchId);
    }
    // Checked again: a connect request's child or a migrated id may have come in since.
    if t.ids.len() >= sh.limits.max_ids as usize {
        drop(t);
        let _ = id.destroy();
        return Err(WireError::Cm(rcm::Error::LimitExceeded(Limit::Ids)));
    }
    let h = chosen.unwrap_or_else(|| t.alloc());
    let cell = IdCell::new((Arc::downgrade(s), h));
    // The id has no event before its first operation, so the context is in place in time.
    id.set_context(cell.clone());
    t.ids.insert(h, (id, cell));
    Ok(Answer::Handle(h))
}

/// The QP attributes sent along with an event: those `init_qp_attr` gives for the latest
/// state that the event makes valid and that stays valid until a later event or a call of
/// the client's changes it. A client answers its `init_qp_attr` calls from them, so a
/// connection costs no `INIT_QP_ATTR` round trips (three on the active side). Computed here,
/// serialised with the id's other events, so they describe the id as the event leaves it.
fn qp_snapshot(id: &CmId, ev: &Event) -> Option<QpAttr> {
    match ev {
        // After the REP (or the MPA reply, or SIDR_REP) the path, QPNs and PSNs are fixed.
        Event::ConnectResponse { .. } | Event::Established { .. } => id
            .init_qp_attr(QpState::Rts)
            .or_else(|_| id.init_qp_attr(QpState::Init))
            .ok(),
        // Addresses known: INIT (port, partition, Q_Key) is. A child's own PSN is chosen at
        // accept, so its RTR/RTS attributes wait for ESTABLISHED.
        Event::AddrResolved | Event::RouteResolved | Event::ConnectRequest { .. } => {
            id.init_qp_attr(QpState::Init).ok()
        }
        _ => None,
    }
}

/// The rcm handler of every id the daemon holds: queue the event for the owning session.
fn on_event(sh: &Weak<Shared>, limits: Limits, id: &CmId, ev: Event) -> Flow {
    let orphan = || {
        if let Some(sh) = sh.upgrade() {
            sh.orphan_events.fetch_add(1, Ordering::Relaxed);
        }
    };
    let qp = qp_snapshot(id, &ev);
    if let Event::ConnectRequest { listener, .. } = &ev {
        return on_connect_request(limits, &listener.clone(), id, ev, qp, &orphan);
    }
    let Some(cell) = id.with_context(|c: &Arc<IdCell>| c.clone()) else {
        orphan();
        return Flow::Continue;
    };
    let own = lock(&cell.owner);
    let Some((sess, h)) = own.as_ref().and_then(|(w, h)| w.upgrade().map(|s| (s, *h))) else {
        orphan();
        return Flow::Continue;
    };
    let mut out = lock(&sess.out);
    if out.closed {
        orphan();
        return Flow::Continue;
    }
    if out.events.len() >= limits.max_queued_events as usize {
        // Dropped and counted; the id is left alone (never a second destroy).
        let dropped = sess.dropped_events.fetch_add(1, Ordering::Relaxed) + 1;
        if may_warn(&sess.warned) {
            tracing::warn!(
                session = sess.order,
                event = ev.name(),
                dropped,
                "event queue full: dropped"
            );
        }
        return Flow::Continue;
    }
    let buf = out.frame_buf();
    let frame = Message::Event {
        handle: h,
        event: WireEvent::from_event(ev, 0),
        qp,
    }
    .encode_in(buf, 0);
    out.events.push_back(Queued {
        handle: h,
        listener: None,
        frame,
    });
    drop(out);
    drop(own);
    flush_soon(&sess);
    Flow::Continue
}

/// Whether a session's overload warning (an event dropped, a connect request refused) may
/// be logged now: one a second per session. A client kept over its limits hits them at
/// the rate its peers connect, and a line each flooded the log (130,577 lines in two
/// minutes of `rcm stress --callbacks inline`); the counters keep every case and each line
/// carries the count so far.
fn may_warn(last: &AtomicU64) -> bool {
    static EPOCH: std::sync::LazyLock<std::time::Instant> =
        std::sync::LazyLock::new(std::time::Instant::now);
    // Milliseconds since the epoch plus a second, so that the first warning goes out.
    let now = u64::try_from(EPOCH.elapsed().as_millis())
        .unwrap_or(u64::MAX)
        .saturating_add(1000);
    let prev = last.load(Ordering::Relaxed);
    now >= prev.saturating_add(1000)
        && last
            .compare_exchange(prev, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
}

/// A connect request on a listener some session holds: the child gets its handle in that
/// session, fully, before the event is queued (Linux bug 3). Any limit hit refuses it, which
/// rejects it on the wire.
fn on_connect_request(
    limits: Limits,
    listener: &CmId,
    child: &CmId,
    ev: Event,
    qp: Option<QpAttr>,
    orphan: &dyn Fn(),
) -> Flow {
    let Some(lcell) = listener.with_context(|c: &Arc<IdCell>| c.clone()) else {
        orphan();
        return Flow::Destroy;
    };
    let own = lock(&lcell.owner);
    let Some((sess, lh)) = own.as_ref().and_then(|(w, h)| w.upgrade().map(|s| (s, *h))) else {
        orphan();
        return Flow::Destroy;
    };
    let mut t = lock(&sess.table);
    let mut out = lock(&sess.out);
    if t.closed || out.closed {
        // The session is going away with its listeners: the request has nowhere to go.
        orphan();
        return Flow::Destroy;
    }
    if t.ids.len() >= limits.max_ids as usize
        || out.events.len() >= limits.max_queued_events as usize
        || out.unread_requests >= limits.max_unread_requests
    {
        let refused = sess.refused_requests.fetch_add(1, Ordering::Relaxed) + 1;
        if may_warn(&sess.warned) {
            tracing::warn!(
                session = sess.order,
                refused,
                "connect request refused: session limit"
            );
        }
        return Flow::Destroy;
    }
    let h = t.alloc();
    let cell = IdCell::new((Arc::downgrade(&sess), h));
    child.set_context(cell.clone());
    t.ids.insert(h, (child.clone(), cell));
    let buf = out.frame_buf();
    let frame = Message::Event {
        handle: h,
        event: WireEvent::from_event(ev, lh),
        qp,
    }
    .encode_in(buf, 0);
    out.events.push_back(Queued {
        handle: h,
        listener: Some(lh),
        frame,
    });
    out.unread_requests += 1;
    drop(out);
    drop(t);
    drop(own);
    flush_soon(&sess);
    Flow::Continue
}

/// Removes `h` from the session (with its queued events and the connect requests queued on
/// it, whose children go too, with their own events) under the id's cell lock, so no event
/// of it is queued after; then destroys what was removed.
fn destroy_id(s: &Arc<Session>, h: u32) -> Result<u64, WireError> {
    let Some(cell) = lock(&s.table).ids.get(&h).map(|(_, c)| c.clone()) else {
        return Err(WireError::NoSuchId);
    };
    let mut victims = Vec::new();
    let mut child_cells = Vec::new();
    let sent;
    {
        let mut own = lock(&cell.owner);
        let mut t = lock(&s.table);
        // Re-check: a concurrent migrate or destroy may have won.
        let Some((id, _)) = t
            .ids
            .get(&h)
            .filter(|(_, c)| Arc::ptr_eq(c, &cell))
            .cloned()
        else {
            return Err(WireError::NoSuchId);
        };
        t.ids.remove(&h);
        rcm_proto::room::shrink_map(&mut t.ids);
        victims.push(id);
        let mut out = lock(&s.out);
        // Under the id's cell, which an event for it is queued under: every event of it
        // was taken to be written before this count, or is in the queue and goes below.
        sent = out.sent;
        let mut children = Vec::new();
        let mut of_children = foldhash::HashSet::default();
        let mut unread = out.unread_requests;
        // A child's later events (a REJ that reached it) come after its request: taken out
        // in this pass too, or a writer granted credit meanwhile could send one (naming a
        // handle the client never had) before the pass below.
        out.events.retain_naming(h, |q| {
            if q.listener == Some(h) {
                children.push(q.handle);
                of_children.insert(q.handle);
            }
            let gone = q.handle == h || of_children.contains(&q.handle);
            if gone && q.listener.is_some() {
                unread = unread.saturating_sub(1);
            }
            !gone
        });
        out.unread_requests = unread;
        for c in children {
            if let Some((cid, ccell)) = t.ids.remove(&c) {
                child_cells.push((c, ccell));
                victims.push(cid);
            }
        }
        *own = None;
    }
    // Each child's cell only after the table and queue are released: a child's event takes
    // its cell and then the queue, so holding the queue while taking a cell would deadlock.
    for (_, c) in &child_cells {
        *lock(&c.owner) = None;
    }
    // With their cells cleared no event of the children can be queued any more: now take
    // out those queued before (a REJ that reached a child behind its request) or meanwhile,
    // which would name handles the client never had (ucma destroys an unread request's
    // context with its events).
    if !child_cells.is_empty() {
        let mut out = lock(&s.out);
        let mut unread = out.unread_requests;
        for (c, _) in &child_cells {
            out.events.retain_naming(*c, |q| {
                let gone = q.handle == *c;
                if gone && q.listener.is_some() {
                    unread = unread.saturating_sub(1);
                }
                !gone
            });
        }
        out.unread_requests = unread;
    }
    for id in victims {
        let _ = id.destroy();
    }
    Ok(sent)
}

/// `migrate_id`: moves an id, and its queued events, from the session holding `token` to
/// `s`. Done under the id's cell lock and both sessions' table and queue locks (in order),
/// after re-checking that the id is still the source's: exactly one of a racing migrate,
/// destroy or close wins (Linux bug 1).
fn migrate_id(
    sh: &Arc<Shared>,
    s: &Arc<Session>,
    token: u64,
    handle: u32,
) -> Result<Answer, WireError> {
    let src = lock(&sh.tokens)
        .get(&token)
        .and_then(Weak::upgrade)
        .ok_or(WireError::NoSuchSession)?;
    if Arc::ptr_eq(&src, s) {
        return if lock(&s.table).ids.contains_key(&handle) {
            Ok(Answer::Handle(handle))
        } else {
            Err(WireError::NoSuchId)
        };
    }
    let Some(cell) = lock(&src.table).ids.get(&handle).map(|(_, c)| c.clone()) else {
        return Err(WireError::NoSuchId);
    };
    let mut own = lock(&cell.owner);
    // A listener takes the connect requests queued for it along, with their children, as
    // ucma_move_events does. No request is queued for it while its cell is held here
    // (on_connect_request takes it); one written meanwhile stays, its client has it. The
    // children's cells are taken now, before the tables and queues: a child's event takes
    // its cell and then the queue.
    let pending: Vec<u32> = requests_queued_for(&lock(&src.out).events, handle).collect();
    let child_cells: Vec<(u32, Arc<IdCell>)> = {
        let t = lock(&src.table);
        pending
            .iter()
            .filter_map(|c| t.ids.get(c).map(|(_, cell)| (*c, cell.clone())))
            .collect()
    };
    let mut child_owners: Vec<_> = child_cells
        .iter()
        .map(|(c, cell)| (*c, lock(&cell.owner)))
        .collect();
    let (mut ta, mut tb) = lock_two(&src, s, |x| &x.table);
    let Some(entry) = ta
        .ids
        .get(&handle)
        .filter(|(_, c)| Arc::ptr_eq(c, &cell))
        .cloned()
    else {
        return Err(WireError::NoSuchId);
    };
    if ta.closed || tb.closed {
        return Err(WireError::NoSuchId);
    }
    // A child whose connect request is still queued has not been handed to its client yet
    // (its handle was only guessed), and the request names the listener by its handle in
    // the source session: it stays there, with its listener, until the request is written.
    let (mut oa, mut ob) = lock_two(&src, s, |x| &x.out);
    if oa.events.names_any(handle)
        && oa
            .events
            .iter()
            .any(|q| q.handle == handle && q.listener.is_some())
    {
        return Err(WireError::NoSuchId);
    }
    // The children whose requests are still queued (and still in the source's table) go.
    let still: std::collections::HashSet<u32> = requests_queued_for(&oa.events, handle).collect();
    child_owners.retain(|(c, o)| still.contains(c) && o.is_some() && ta.ids.contains_key(c));
    if tb.ids.len() + 1 + child_owners.len() > sh.limits.max_ids as usize {
        return Err(WireError::Cm(rcm::Error::LimitExceeded(Limit::Ids)));
    }
    ta.ids.remove(&handle);
    rcm_proto::room::shrink_map(&mut ta.ids);
    let nh = tb.alloc();
    tb.sealed |= entry.1.sealed.get().is_some();
    tb.ids.insert(nh, entry);
    let mut renamed = foldhash::HashMap::default();
    renamed.insert(handle, nh);
    for (c, o) in &mut child_owners {
        if let Some(e) = ta.ids.remove(c) {
            let nc = tb.alloc();
            tb.sealed |= e.1.sealed.get().is_some();
            tb.ids.insert(nc, e);
            **o = Some((Arc::downgrade(s), nc));
            renamed.insert(*c, nc);
        }
    }
    let mut moved = Vec::new();
    let mut requests = 0;
    oa.events.retain_naming(handle, |q| {
        let Some(&to) = renamed.get(&q.handle) else {
            return true;
        };
        // Taken out of the source's queue whole (the frame's handles are rewritten below).
        let listener = q.listener.map(|_| nh);
        requests += u32::from(listener.is_some());
        moved.push(Queued {
            handle: to,
            listener,
            frame: std::mem::take(&mut q.frame),
        });
        false
    });
    oa.unread_requests = oa.unread_requests.saturating_sub(requests);
    ob.unread_requests += requests;
    for mut q in moved {
        rename_in_frame(&mut q);
        ob.events.push_back(q);
    }
    drop((oa, ob));
    *own = Some((Arc::downgrade(s), nh));
    drop((ta, tb));
    drop(child_owners);
    drop(own);
    s.out_cond.notify_all();
    Ok(Answer::Handle(nh))
}

/// The children whose connect requests on `listener` wait in `events`.
fn requests_queued_for(events: &EventQueue, listener: u32) -> impl Iterator<Item = u32> + '_ {
    events
        .iter()
        .filter(move |q| q.listener == Some(listener) && q.handle != listener)
        .map(|q| q.handle)
}

/// Writes a queued event's handle (and, for a connect request, its listener's) into its
/// frame: the handle sits right after the 12-byte header, and a connect request's
/// listener right after the event's kind byte that follows it.
fn rename_in_frame(q: &mut Queued) {
    if let Some(b) = q.frame.get_mut(12..16) {
        b.copy_from_slice(&q.handle.to_le_bytes());
    }
    if let (Some(l), Some(b)) = (q.listener, q.frame.get_mut(17..21)) {
        b.copy_from_slice(&l.to_le_bytes());
    }
}

/// The client is gone (or the daemon stops): every id it held is destroyed, its listeners
/// stop, its peers see a REJ or a DREQ.
fn close_session(sh: &Arc<Shared>, s: &Arc<Session>) {
    let ids: Vec<(CmId, Arc<IdCell>)> = {
        let mut t = lock(&s.table);
        t.closed = true;
        t.ids.drain().map(|(_, v)| v).collect()
    };
    {
        let mut out = lock(&s.out);
        out.closed = true;
        out.events.clear();
    }
    s.out_cond.notify_all();
    s.ended.store(true, Ordering::SeqCst);
    let _ = s.stream.shutdown(std::net::Shutdown::Both);
    for (_, c) in lock(&s.channels).drain() {
        let _ = c.shutdown(std::net::Shutdown::Both);
    }
    for (_, cell) in &ids {
        *lock(&cell.owner) = None;
    }
    let handles: Vec<_> = ids.iter().map(|(id, _)| id.begin_destroy()).collect();
    for (h, (id, _)) in handles.iter().zip(&ids) {
        if !h.wait_for(Duration::from_secs(10)) {
            tracing::warn!(id = id.key(), "destroy of a closed session's id is slow");
            h.wait();
        }
    }
    let token = s.token.load(Ordering::SeqCst);
    if token != 0 {
        lock(&sh.tokens).remove(&token);
    }
    let dropped = s.dropped_events.load(Ordering::Relaxed);
    sh.orphan_events.fetch_add(dropped, Ordering::Relaxed);
    lock(&sh.sessions).remove(&s.order);
    tracing::info!(
        session = s.order,
        ids = ids.len(),
        dropped_events = dropped,
        "session ended; its ids are destroyed"
    );
}

#[cfg(test)]
mod tests {
    use super::{
        channel_may_attach, may_warn, DevicePolls, EventQueue, Out, Queued, Table, POLLED_ON_STACK,
        SPARE_FRAMES, SPARE_FRAME_BYTES,
    };
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn the_daemons_handles_wrap_below_the_clients_range_and_skip_zero() {
        let mut t = Table {
            ids: foldhash::HashMap::default(),
            next: crate::proto::CLIENT_HANDLES - 2,
            closed: false,
            sealed: false,
        };
        assert_eq!(t.alloc(), crate::proto::CLIENT_HANDLES - 1);
        assert_eq!(t.alloc(), 1, "wrapped, past 0");
        assert_eq!(t.alloc(), 2);
    }

    #[test]
    fn sent_events_leave_their_buffers_for_the_next_but_only_so_many_and_so_large() {
        let mut out = Out::default();
        let queue = |out: &mut Out, cap: usize, listener: Option<u32>| {
            let mut frame = out.frame_buf();
            frame.reserve(cap);
            frame.extend_from_slice(b"frame");
            out.events.push_back(Queued {
                handle: 1,
                listener,
                frame,
            });
        };
        // The large one first: it is let go while there is still room for it.
        queue(&mut out, SPARE_FRAME_BYTES + 1, Some(7));
        for _ in 0..SPARE_FRAMES + 8 {
            queue(&mut out, 256, None);
        }
        out.unread_requests = 1;
        out.credit = u64::MAX;
        while out.take_sent() {}
        assert!(out.events.is_empty());
        assert_eq!(out.unread_requests, 0, "the request was taken as read");
        assert_eq!(
            out.spare.len(),
            SPARE_FRAMES,
            "no more than so many are kept"
        );
        assert!(out.spare.iter().all(|b| b.capacity() <= SPARE_FRAME_BYTES));
        // A kept buffer comes back with its room, and its old bytes are the encoder's to
        // clear (`Message::encode_in`).
        let b = out.frame_buf();
        assert!(b.capacity() >= 256);
        assert_eq!(out.spare.len(), SPARE_FRAMES - 1);
    }

    #[test]
    fn overload_warnings_are_one_a_second_per_session() {
        let (a, b) = (AtomicU64::new(0), AtomicU64::new(0));
        assert!(may_warn(&a), "the first warning is logged");
        assert!(!may_warn(&a), "a second one at once is not");
        assert!(may_warn(&b), "another session's first is");
        // A second later the session may warn again.
        a.fetch_sub(1000, Ordering::Relaxed);
        assert!(may_warn(&a));
        assert!(!may_warn(&a));
    }

    /// A quarter of the places, exactly, stay for sessions.
    #[test]
    fn channels_leave_a_quarter_of_the_places() {
        let may = channel_may_attach;
        assert!(may(768, 1024) && !may(769, 1024));
        // 3 places: a quarter is 0.75, so at most 2 connections may include a channel.
        assert!(may(2, 3) && !may(3, 3));
        assert!(may(0, 1) && !may(1, 1));
        // 0 places: nothing is served anyway; no overflow for huge counts.
        assert!(may(0, 0));
        assert!(!may(usize::MAX, usize::MAX));
    }

    /// A device's receive side as the ring thread sees it: counts what is asked of it, and
    /// has a datagram or not: a flag, or, with a socket, what the socket holds (which it
    /// then offers as its readiness).
    #[derive(Default)]
    struct FakeDevice {
        begun: AtomicUsize,
        ended: AtomicUsize,
        polls: AtomicUsize,
        has: AtomicBool,
        sock: Option<Arc<std::net::UdpSocket>>,
    }

    impl FakeDevice {
        fn with_socket() -> Self {
            let s = std::net::UdpSocket::bind("127.0.0.1:0").expect("a loopback socket");
            s.set_nonblocking(true).expect("non-blocking");
            FakeDevice {
                sock: Some(Arc::new(s)),
                ..FakeDevice::default()
            }
        }

        /// A datagram for the socket: on loopback it is queued when `send_to` returns.
        fn deliver(&self) {
            let s = self.sock.as_ref().expect("a socket");
            let to = s.local_addr().expect("its address");
            std::net::UdpSocket::bind("127.0.0.1:0")
                .and_then(|u| u.send_to(b"x", to))
                .expect("sent");
        }
    }

    impl rcm::remote::BusyPoll for FakeDevice {
        fn begin(&self, _spin: Duration) {
            self.begun.fetch_add(1, Ordering::SeqCst);
        }
        fn poll(&self) -> bool {
            self.polls.fetch_add(1, Ordering::SeqCst);
            match &self.sock {
                Some(s) => s.recv(&mut [0u8; 8]).is_ok(),
                None => self.has.swap(false, Ordering::SeqCst),
            }
        }
        fn end(&self) {
            self.ended.fetch_add(1, Ordering::SeqCst);
        }
        fn kick(&self) {}
        fn readiness(&self) -> Option<Arc<dyn std::os::fd::AsFd + Send + Sync>> {
            let s: Arc<dyn std::os::fd::AsFd + Send + Sync> = self.sock.clone()?;
            Some(s)
        }
    }

    fn polls_of(fakes: Vec<FakeDevice>) -> (Vec<Arc<FakeDevice>>, DevicePolls) {
        let fakes: Vec<Arc<FakeDevice>> = fakes.into_iter().map(Arc::new).collect();
        let polls = DevicePolls::of(
            fakes
                .iter()
                .map(|f| f.clone() as Arc<dyn rcm::remote::BusyPoll>)
                .collect(),
        );
        (fakes, polls)
    }

    /// Devices that say what to ask are asked together, and only those with something are
    /// received from; one that cannot say is received from every sweep.
    #[test]
    fn a_sweep_receives_only_where_something_waits() {
        let (f, mut d) = polls_of(vec![
            FakeDevice::with_socket(),
            FakeDevice::with_socket(),
            FakeDevice::with_socket(),
            FakeDevice::default(),
        ]);
        f[2].deliver();
        assert!(d.sweep(Duration::from_millis(1), || false));
        assert_eq!(polls(&f), [0, 0, 1, 1]);
        assert!(!d.sweep(Duration::from_millis(1), || false), "nothing left");
        assert_eq!(polls(&f), [0, 0, 1, 2]);
        f[0].deliver();
        f[1].deliver();
        assert!(d.sweep(Duration::from_millis(1), || false));
        assert_eq!(polls(&f), [1, 1, 1, 3]);
        // A waiting command: one device with something, then the command.
        f[0].deliver();
        f[1].deliver();
        assert!(d.sweep(Duration::from_millis(1), || true));
        assert_eq!(
            polls(&f)[..2].iter().sum::<usize>(),
            3,
            "one of the two only"
        );
        d.sleep();
        for dev in &f {
            assert_eq!(
                dev.begun.load(Ordering::SeqCst),
                dev.ended.load(Ordering::SeqCst)
            );
        }
    }

    /// Past the devices asked on the stack, and with one that cannot say among them, each
    /// answer still goes to its own device.
    #[test]
    fn more_devices_than_asked_on_the_stack_are_each_asked() {
        for n in [POLLED_ON_STACK, POLLED_ON_STACK + 3] {
            let mut fakes: Vec<FakeDevice> = (0..n).map(|_| FakeDevice::with_socket()).collect();
            fakes[1] = FakeDevice::default();
            let (f, mut d) = polls_of(fakes);
            f[2].deliver();
            f[n - 1].deliver();
            assert!(d.sweep(Duration::from_millis(1), || false));
            let mut want = vec![0; n];
            (want[1], want[2], want[n - 1]) = (1, 1, 1);
            assert_eq!(polls(&f), want, "{n} devices");
            d.sleep();
        }
    }

    /// `n` devices that cannot say whether they have something.
    fn devices(n: usize) -> (Vec<Arc<FakeDevice>>, DevicePolls) {
        polls_of((0..n).map(|_| FakeDevice::default()).collect())
    }

    fn polls(f: &[Arc<FakeDevice>]) -> Vec<usize> {
        f.iter().map(|d| d.polls.load(Ordering::SeqCst)).collect()
    }

    /// After a round with work every device is received from once, whichever had the
    /// datagram (the REQ a connect just sent to the daemon's other address, say).
    #[test]
    fn a_sweep_receives_once_from_every_device() {
        let (f, mut d) = devices(3);
        f[1].has.store(true, Ordering::SeqCst);
        assert!(d.sweep(Duration::from_millis(1), || false));
        assert_eq!(polls(&f), [1, 1, 1]);
        assert!(!d.sweep(Duration::from_millis(1), || false), "nothing left");
        assert_eq!(polls(&f), [2, 2, 2]);
    }

    /// A command waiting in a ring ends the sweep after the first device: it is served
    /// before the rest are looked at, and a stream of commands still lets a device be
    /// received from each round, each device in its turn.
    #[test]
    fn a_waiting_command_ends_a_sweep_after_one_device() {
        let (f, mut d) = devices(3);
        d.sweep(Duration::from_millis(1), || true);
        assert_eq!(polls(&f).iter().sum::<usize>(), 1);
        d.sweep(Duration::from_millis(1), || true);
        assert_eq!(polls(&f).iter().sum::<usize>(), 2);
        assert_eq!(
            polls(&f).iter().filter(|&&n| n > 0).count(),
            2,
            "the second sweep began at the next device"
        );
    }

    /// Every poll begun is ended (the devices' own threads take their sockets back) when
    /// the ring thread goes to sleep, however the sweeps went.
    #[test]
    fn sweeps_leave_every_begin_ended_at_sleep() {
        let (f, mut d) = devices(2);
        for k in 0..5 {
            f[k % 2].has.store(true, Ordering::SeqCst);
            d.sweep(Duration::from_millis(1), || false);
        }
        d.sleep();
        for (k, dev) in f.iter().enumerate() {
            let (b, e) = (
                dev.begun.load(Ordering::SeqCst),
                dev.ended.load(Ordering::SeqCst),
            );
            assert!(b > 0, "device {k} never polled");
            assert_eq!(b, e, "device {k}: {b} polls begun, {e} ended");
        }
    }

    /// An idle look receives from a device that has something, whichever is next in turn,
    /// and makes no receive call when none has.
    #[test]
    fn an_idle_look_goes_straight_to_the_device_with_something() {
        let (f, mut d) = polls_of((0..3).map(|_| FakeDevice::with_socket()).collect());
        assert!(!d.poll(Duration::from_millis(1)));
        assert_eq!(polls(&f), [0, 0, 0], "nothing to receive: no receive call");
        f[0].deliver();
        assert!(d.poll(Duration::from_millis(1)));
        assert_eq!(polls(&f), [1, 0, 0]);
        f[0].deliver();
        f[2].deliver();
        assert!(d.poll(Duration::from_millis(1)));
        assert!(d.poll(Duration::from_millis(1)));
        assert_eq!(polls(&f), [2, 0, 1], "one device a look, in turn");
        d.sleep();
    }

    fn q(handle: u32, listener: Option<u32>) -> Queued {
        Queued {
            handle,
            listener,
            frame: vec![handle as u8],
        }
    }

    /// The per-handle counts follow pushes, pops and removals, so a handle with nothing
    /// queued is known at once and one with something is found.
    #[test]
    fn event_queue_counts_what_names_each_handle() {
        let mut e = EventQueue::default();
        e.push_back(q(1, None));
        e.push_back(q(2, Some(9)));
        e.push_back(q(3, Some(9)));
        e.push_back(q(1, None));
        assert!(e.names_any(1) && e.names_any(9) && e.names_any(3));
        assert!(!e.names_any(4));
        // Nothing names 4: the queue is not walked (keep would panic).
        e.retain_naming(4, |_| panic!("walked"));
        assert_eq!(e.len(), 4);
        // The listener's requests go; the others stay, in order.
        e.retain_naming(9, |q| q.listener != Some(9));
        assert!(!e.names_any(9) && !e.names_any(2) && !e.names_any(3));
        assert_eq!(e.iter().map(|q| q.handle).collect::<Vec<_>>(), vec![1, 1]);
        assert_eq!(e.pop_front().map(|q| q.handle), Some(1));
        assert!(e.names_any(1));
        assert_eq!(e.pop_front().map(|q| q.handle), Some(1));
        assert!(!e.names_any(1) && e.is_empty() && e.named.is_empty());
        e.push_back(q(5, None));
        e.clear();
        assert!(!e.names_any(5) && e.is_empty());
    }

    /// A burst's queue gives its room back once it is read to the end: a session that once
    /// had thousands of events waiting does not keep their room for good.
    #[test]
    fn an_emptied_event_queue_gives_its_room_back() {
        let mut e = EventQueue::default();
        for h in 0..5000 {
            e.push_back(q(h, Some(h % 7)));
        }
        let peak = (e.q.capacity(), e.named.capacity());
        while e.pop_front().is_some() {}
        let (q_room, named_room) = (e.q.capacity(), e.named.capacity());
        assert!(
            rcm_proto::room::kept(q_room, std::mem::size_of::<Queued>())
                && rcm_proto::room::kept(named_room, std::mem::size_of::<(u32, u32)>()),
            "room left for {q_room} events and {named_room} names, of {peak:?}"
        );
    }
}
