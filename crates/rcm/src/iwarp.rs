//! An iWARP CM port: TCP on one local address, one `rcm_proto::iw::Cep` per stream, and an I/O
//! thread running a `mio` event loop over the device's listeners and streams.
//!
//! It mirrors the RoCEv2 driver (`device.rs`): every command and every input runs under the
//! engine lock (the streams, their Ceps and the listening sockets), the bytes a Cep queued are
//! written and its socket actions applied before the lock is released, and its events are
//! queued in Cep order while the lock is still held. One thread at a time then routes that
//! queue to the ids, with no engine lock held, so user code never runs under it and the events
//! of one stream reach its id in order.
//!
//! A thread of the application waiting for an event polls the device's readiness itself while
//! the I/O thread stands aside (busy polling, as on RoCEv2 devices; see `rxgate`): the
//! readiness is edge-triggered, so whoever takes it from the poll hands it to the engine,
//! and the I/O thread sleeps on the poll's descriptor without holding the poll, so that a
//! waiter can look meanwhile.
//!
//! As Linux's siw and iw_cm do, an rdma_cm listener on port P listens on TCP `ip:P`; an active
//! side connects to `dst:P` from an ephemeral local port of its device's address, and sends
//! the MPA Request once the TCP connect completed.

use crate::device::DeviceInner;
use crate::id::IdInner;
use crate::rxgate::RxGate;
use crate::sync;
use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Registry, Token, Waker};
use rcm_proto::iw::{self, Cep, CepConfig, TcpAction};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// Names one TCP stream of a device (also its mio token). Never reused.
pub(crate) type ConnKey = usize;

/// The rdma_cm listeners of one TCP port, and the key of its listening socket.
type PortListeners = (ConnKey, Vec<Weak<IdInner>>);

const WAKER: Token = Token(0);

/// What the driver reports for a stream, to be routed to its id.
#[derive(Debug)]
pub(crate) enum IwEvent {
    /// An event of the stream's Cep.
    Cep(iw::Event),
    /// Passive: a valid MPA Request arrived on a stream accepted on TCP port `port`.
    Request {
        port: u16,
        peer: SocketAddr,
        req: iw::ConnectRequest,
    },
    /// Active: the TCP connect failed (refused: nobody listens on that port).
    ConnectFailed(ErrorKind),
}

struct Conn {
    cep: Cep,
    stream: TcpStream,
    peer: SocketAddr,
    /// Active: the TCP connect is still in flight; the MPA Request waits for it.
    connecting: Option<iw::ConnectParams>,
    /// Bytes the socket did not take yet.
    out: iw::ByteQueue,
    /// Socket actions due once `out` is written.
    after: VecDeque<TcpAction>,
    /// Passive: the TCP port it was accepted on.
    listen_port: Option<u16>,
    /// The socket is closed (or reset): the entry goes once drained.
    done: bool,
    /// A close waits for `out` to be written until then; after, it becomes a reset (a peer
    /// that stopped reading would otherwise hold the stream for good).
    drain_by: Option<Instant>,
    /// Passive, and its MPA Request has not come yet (counted in `IwEngine::half_open`).
    half_open: bool,
}

struct Listener {
    sock: TcpListener,
    port: u16,
}

/// The streams and listeners of one device, behind its engine lock.
pub(crate) struct IwEngine {
    conns: HashMap<ConnKey, Conn>,
    listeners: HashMap<ConnKey, Listener>,
    next: ConnKey,
    /// Events in order, moved to the routing queue before the lock is released.
    events: Vec<(ConnKey, IwEvent)>,
    /// Streams that had more to read when their turn's budget ([`READ_TURN`]) ran out: the
    /// I/O thread comes back to them after the others, without sleeping.
    unread: Vec<ConnKey>,
    /// No stream's timer or drain deadline is due before this (`None`: none is known): the
    /// I/O thread looks through the streams only once it is reached.
    earliest: Option<Instant>,
    /// When the I/O thread will look again if nothing wakes it; a call that arms an earlier
    /// timer wakes it.
    sleeping_until: Option<Instant>,
    /// Accepted streams whose MPA Request has not come yet.
    half_open: usize,
    /// Their keys, oldest first (with keys of streams that have since left the state, pruned
    /// as it grows).
    half_open_order: VecDeque<ConnKey>,
    /// Streams' timer and drain deadlines as they were set (a stream's later change is a
    /// new entry; an entry its stream has since moved past is stale and skipped): what is
    /// due comes off the top, without a look through every stream. Rebuilt from the
    /// streams when stale entries outnumber them.
    deadlines: BinaryHeap<Reverse<(Instant, ConnKey)>>,
    /// When the I/O thread last looked through every stream's deadline (a safety net, once
    /// a second at most: `deadlines` has every deadline set).
    last_scan: Option<Instant>,
    /// When listeners whose accept failed for want of a resource (descriptors, memory) are
    /// tried again, and which: their queued connections raise no new edge.
    stalled: Option<(Instant, Vec<ConnKey>)>,
}

/// The backlog of an iWARP listener that asked for 0: connect requests not delivered to the
/// application yet (ucma's `max_backlog`, 1,024).
pub(crate) const IW_DEFAULT_BACKLOG: usize = 1024;

/// A non-blocking TCP socket of `addr`'s family.
fn tcp_socket(addr: SocketAddr) -> std::io::Result<socket2::Socket> {
    let s = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    s.set_nonblocking(true)?;
    Ok(s)
}

/// A TCP listener whose accept queue holds the rdma_cm listener's backlog, and at least
/// the default (siw passes the backlog to `listen`): std's and mio's 128 overflowed under
/// a burst (1,336 SYNs dropped in a two-process burst of 15,000; none now), and each
/// connection the kernel could not queue waited for a retransmission (a second or more).
/// The kernel caps it at `net.core.somaxconn`.
fn tcp_listener(addr: SocketAddr, backlog: usize) -> std::io::Result<TcpListener> {
    let s = tcp_socket(addr)?;
    s.set_reuse_address(true)?;
    s.bind(&addr.into())?;
    // Never below the default: rcm bounds undelivered requests itself (the rdma_cm
    // backlog), and a small queue here would make even streams that never become requests
    // (a peer that says nothing) wait for SYN retransmissions, seconds apart.
    let backlog = backlog.max(IW_DEFAULT_BACKLOG);
    s.listen(i32::try_from(backlog).unwrap_or(i32::MAX))?;
    Ok(TcpListener::from_std(s.into()))
}

/// Most accepted streams of one device waiting for their MPA Request (each holds a file
/// descriptor until the Request comes or its timer ends it), whatever
/// [`FabricConfig::max_half_open`](crate::FabricConfig::max_half_open) allows more of.
pub(crate) const IW_MAX_HALF_OPEN: usize = 1024;

/// Bytes one stream may have read in one turn of the I/O thread: a peer sending without
/// pause (zero-length RDMA Writes cost nothing to keep) must not keep the thread, and the
/// engine lock every call of the device takes, to itself.
const READ_TURN: usize = 256 << 10;

/// Silent streams a listener that ran out of descriptors resets at most per readiness
/// event to take the connections waiting (the rest at its next retry, `ACCEPT_RETRY`).
const EVICT_WHEN_STALLED: usize = 64;

/// How long a listener whose accept failed for want of a resource waits before it tries
/// again (the connections wait in the kernel's accept queue meanwhile).
const ACCEPT_RETRY: Duration = Duration::from_millis(50);

#[derive(Default)]
struct Pending {
    events: VecDeque<(ConnKey, IwEvent)>,
    routing: bool,
}

/// Bytes of one iWARP connection that may wait for its socket (queued, not yet taken by
/// TCP): 4 MiB, Linux's largest TCP send buffer by default (`tcp_wmem`).
/// [`CmId::send`](crate::CmId::send) refuses a message that would take the queue past it
/// ([`Limit::SendBuffer`](crate::remote::Limit::SendBuffer); a longer message is taken
/// when nothing waits). What the peer makes this side answer is bounded apart: Read
/// Responses by the IRD (a Read Request while IRD responses are still unwritten ends the
/// stream, as siw does), the rest happens once per connection. Reading never stops for a
/// full queue: two ends that both did would wait on each other for good.
pub const IW_SEND_BUFFER: usize = 4 << 20;

/// [`IW_SEND_BUFFER`] was reached.
#[derive(Debug)]
pub(crate) struct SendBufferFull;

/// The iWARP part of a device.
pub(crate) struct IwDev {
    pub cfg: CepConfig,
    /// Accepted streams waiting for their MPA Request, at most (more are reset).
    max_half_open: usize,
    engine: Mutex<IwEngine>,
    registry: Registry,
    waker: Waker,
    /// The id each stream belongs to (inserted under the engine lock, before any of the
    /// stream's events can be routed).
    pub owners: Mutex<HashMap<ConnKey, Weak<IdInner>>>,
    /// rdma_cm listeners by TCP port, and the listening socket's key.
    pub listens: Mutex<HashMap<u16, PortListeners>>,
    pending: Mutex<Pending>,
    stop: AtomicBool,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// The streams' readiness: looked at by the I/O thread, or by a thread waiting for its
    /// event that polls the device meanwhile (busy polling, see [`DeviceInner::iw_poll_once`]).
    looker: Arc<Mutex<Looker>>,
    /// The epoll instance behind `looker`, which the I/O thread sleeps on without holding
    /// the looker: a waiter can poll the streams while the thread sleeps.
    epoll_fd: Arc<std::os::fd::OwnedFd>,
    /// A waiter took the waker's readiness, which was the I/O thread's, or left a stream
    /// unread: the thread looks through its deadlines, its unread streams and `stop` again
    /// before it sleeps.
    rewake: AtomicBool,
    /// The I/O thread is (about to be) asleep on `epoll_fd`. With `rewake`, each side
    /// writes its own flag before it reads the other's, so a wake-up a waiter took is
    /// either seen by the thread before it sleeps or given back to it by the waiter.
    asleep: AtomicBool,
}

/// The device's `mio` poll and the room its readiness lands in. Whoever holds it looks;
/// readiness is edge-triggered, so what one looker takes the other never sees, and the
/// taker hands it to the engine itself.
struct Looker {
    poll: Poll,
    events: Events,
}

impl Looker {
    /// The streams and listeners ready within `timeout` (zero: now), added to `keys`; true
    /// when the waker was among them.
    fn look(&mut self, timeout: Duration, keys: &mut Vec<ConnKey>) -> std::io::Result<bool> {
        self.poll.poll(&mut self.events, Some(timeout))?;
        let mut woken = false;
        for ev in &self.events {
            if ev.token() == WAKER {
                woken = true;
            } else {
                keys.push(ev.token().0);
            }
        }
        Ok(woken)
    }
}

impl IwDev {
    pub(crate) fn new(cfg: CepConfig, max_half_open: usize) -> crate::Result<Self> {
        let poll = Poll::new()?;
        let epoll_fd = Arc::new(crate::sys::dup_of(&poll)?);
        let registry = poll.registry().try_clone()?;
        let waker = Waker::new(poll.registry(), WAKER)?;
        Ok(IwDev {
            cfg,
            max_half_open: max_half_open.clamp(1, IW_MAX_HALF_OPEN),
            engine: Mutex::new(IwEngine {
                conns: HashMap::new(),
                listeners: HashMap::new(),
                next: 1,
                events: Vec::new(),
                unread: Vec::new(),
                earliest: None,
                sleeping_until: None,
                half_open: 0,
                half_open_order: VecDeque::new(),
                deadlines: BinaryHeap::new(),
                last_scan: None,
                stalled: None,
            }),
            registry,
            waker,
            owners: Mutex::new(HashMap::new()),
            listens: Mutex::new(HashMap::new()),
            pending: Mutex::new(Pending::default()),
            stop: AtomicBool::new(false),
            thread: Mutex::new(None),
            looker: Arc::new(Mutex::new(Looker {
                poll,
                events: Events::with_capacity(256),
            })),
            epoll_fd,
            rewake: AtomicBool::new(false),
            asleep: AtomicBool::new(false),
        })
    }

    /// Starts the I/O thread (once the device is built); it polls for `spin` after it last
    /// had something to do before it sleeps (`FabricConfig::spin`).
    pub(crate) fn start(dev: &Arc<DeviceInner>, spin: Duration) -> crate::Result<()> {
        let (Some(iw), Some(gate)) = (dev.iw.as_ref(), dev.gate.clone()) else {
            return Ok(());
        };
        let looker = iw.looker.clone();
        let epoll_fd = iw.epoll_fd.clone();
        let weak = Arc::downgrade(dev);
        let h = std::thread::Builder::new()
            .name(format!("rcm-iw-{}", dev.ip))
            .spawn(move || {
                crate::fabric::mark_own_thread();
                io_loop(&weak, &looker, &epoll_fd, &gate, spin);
            })
            .map_err(|e| crate::Error::Io(e.to_string()))?;
        *sync::lock(&iw.thread) = Some(h);
        Ok(())
    }

    /// Stops the I/O thread and closes every socket (after removal, or at shutdown).
    pub(crate) fn shutdown(&self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.waker.wake();
        let h = sync::lock(&self.thread).take();
        if let Some(h) = h {
            // It may be asleep standing aside for a waiter (see `io_loop`).
            h.thread().unpark();
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
        let mut e = sync::lock(&self.engine);
        for (_, c) in e.conns.drain() {
            reset(&c.stream);
        }
        e.listeners.clear();
        e.events.clear();
        drop(e);
        sync::lock(&self.listens).clear();
    }

    /// Wakes the I/O thread if it is parked (standing aside for a waiter).
    pub(crate) fn unpark(&self) {
        if let Some(h) = sync::lock(&self.thread).as_ref() {
            h.thread().unpark();
        }
    }

    /// Streams still held (for leak checks).
    pub(crate) fn conn_count(&self) -> usize {
        sync::lock(&self.engine).conns.len()
    }

    /// Bytes the stream and owner tables have room for (see `Fabric::table_bytes`).
    pub(crate) fn table_bytes(&self) -> usize {
        let conns = rcm_proto::room::map_bytes(&sync::lock(&self.engine).conns);
        let owners = rcm_proto::room::map_bytes(&sync::lock(&self.owners));
        conns + owners
    }
}

/// Sets `SO_LINGER` 0 so that closing the socket resets the connection (RST), as siw does
/// when the QP goes to error.
fn reset(s: &TcpStream) {
    let _ = socket2::SockRef::from(s).set_linger(Some(Duration::ZERO));
}

impl IwEngine {
    fn new_key(&mut self) -> ConnKey {
        self.next += 1;
        self.next
    }

    /// Runs `f` on a stream's Cep, then drives the stream.
    pub(crate) fn with_cep<R>(
        &mut self,
        key: ConnKey,
        now: Instant,
        registry: &Registry,
        f: impl FnOnce(&mut Cep) -> R,
    ) -> Option<R> {
        let c = self.conns.get_mut(&key)?;
        let r = f(&mut c.cep);
        self.drive(key, now, registry);
        Some(r)
    }

    /// Moves what the Cep produced: bytes to the socket, actions once the bytes are out,
    /// events to the queue. A write error is the end of the stream for the Cep.
    fn drive(&mut self, key: ConnKey, now: Instant, registry: &Registry) {
        let Some(c) = self.conns.get_mut(&key) else {
            return;
        };
        loop {
            while let Some(b) = c.cep.poll_transmit() {
                c.out.extend(&b);
            }
            while let Some(a) = c.cep.poll_tcp_action() {
                c.after.push_back(a);
            }
            while let Some(e) = c.cep.poll_event() {
                let ev = match (e, c.listen_port) {
                    (iw::Event::ConnectRequest(req), Some(port)) => {
                        if std::mem::take(&mut c.half_open) {
                            self.half_open = self.half_open.saturating_sub(1);
                        }
                        IwEvent::Request {
                            port,
                            peer: c.peer,
                            req,
                        }
                    }
                    (e, _) => IwEvent::Cep(e),
                };
                self.events.push((key, ev));
            }
            if c.connecting.is_some() {
                // Destroyed before the TCP connect completed: drop the half-open socket.
                c.done = c.cep.is_closed();
                break;
            }
            if c.done {
                break;
            }
            if let Err(graceful) = c.flush(now) {
                c.cep.on_tcp_closed(now, graceful);
                continue;
            }
            break;
        }
        if c.done {
            if c.half_open {
                self.half_open = self.half_open.saturating_sub(1);
            }
            let _ = registry.deregister(&mut c.stream);
            self.remove_conn(key);
            return;
        }
        let (timer, drain) = (c.cep.poll_timeout(), c.drain_by);
        self.note_deadline(key, timer);
        self.note_deadline(key, drain);
    }

    /// Forgets stream `key`, giving back the room a flood of streams left in the table
    /// (`rcm_proto::room`: ~770 bytes a stream, 25 MB after 20,000 at once).
    fn remove_conn(&mut self, key: ConnKey) -> Option<Conn> {
        let c = self.conns.remove(&key);
        rcm_proto::room::shrink_map(&mut self.conns);
        c
    }

    /// The oldest stream still waiting for its MPA Request, taken off the order.
    fn oldest_half_open(&mut self) -> Option<ConnKey> {
        while let Some(k) = self.half_open_order.pop_front() {
            if self.conns.get(&k).is_some_and(|c| c.half_open) {
                return Some(k);
            }
        }
        None
    }

    /// Resets stream `k` if it is still waiting for its MPA Request (it has no id yet).
    fn evict_if_half_open(&mut self, k: ConnKey, registry: &Registry) {
        if !self.conns.get(&k).is_some_and(|c| c.half_open) {
            return;
        }
        if let Some(mut c) = self.remove_conn(k) {
            let _ = registry.deregister(&mut c.stream);
            reset(&c.stream);
            self.half_open = self.half_open.saturating_sub(1);
        }
    }

    /// Stream `key`'s timer or drain deadline may now be `t`.
    fn note_deadline(&mut self, key: ConnKey, t: Option<Instant>) {
        if let Some(t) = t {
            self.earliest = Some(self.earliest.map_or(t, |e| e.min(t)));
            if self.deadlines.len() > 2 * self.conns.len() + 1024 {
                self.rebuild_deadlines();
            }
            self.deadlines.push(Reverse((t, key)));
        }
    }

    /// `deadlines` from the streams' own, stale entries gone.
    fn rebuild_deadlines(&mut self) {
        self.deadlines = self
            .conns
            .iter()
            .flat_map(|(k, c)| {
                [c.cep.poll_timeout(), c.drain_by]
                    .into_iter()
                    .flatten()
                    .map(|t| Reverse((t, *k)))
            })
            .collect();
    }
}

impl Conn {
    /// Writes what it can; applies the socket actions once everything is written. `Err` when
    /// the socket failed (the peer reset it).
    fn flush(&mut self, now: Instant) -> Result<(), bool> {
        // A reset discards what is not yet sent: it is not held back behind those bytes, which
        // a peer that stopped reading would never take (the stream would stay for good). So
        // does a close whose bytes the peer has not taken within the Cep's close timeout (the
        // kernel bounds an orphaned socket's last bytes likewise).
        if self.after.contains(&TcpAction::Reset) || self.drain_by.is_some_and(|t| t <= now) {
            self.out.clear();
            self.after.clear();
            reset(&self.stream);
            self.done = true;
            return Ok(());
        }
        while !self.out.is_empty() {
            match self.stream.write(self.out.bytes()) {
                Ok(0) => return Err(false),
                Ok(n) => {
                    self.out.consume(n);
                    self.cep.transmitted(n);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if self.drain_by.is_none() && self.after.contains(&TcpAction::Close) {
                        self.drain_by = Some(now + self.cep.config().close_timeout);
                    }
                    return Ok(());
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => {
                    self.done = true;
                    return Err(false);
                }
            }
        }
        while let Some(a) = self.after.pop_front() {
            match a {
                TcpAction::Shutdown => {
                    let _ = self.stream.shutdown(Shutdown::Write);
                }
                TcpAction::Close => self.done = true,
                TcpAction::Reset => {
                    reset(&self.stream);
                    self.done = true;
                }
            }
        }
        Ok(())
    }
}

impl DeviceInner {
    fn iw(&self) -> &IwDev {
        // Only called on iWARP devices (`with_iw` checks).
        self.iw
            .as_ref()
            .unwrap_or_else(|| unreachable!("not an iWARP device"))
    }

    /// Runs `f` on the iWARP engine, then routes what it reported, after releasing the lock.
    /// Like `with_engine`: events are queued in order under the lock, and one thread at a time
    /// routes them; a call made while this thread routes only queues.
    pub(crate) fn with_iw<R>(
        self: &Arc<Self>,
        f: impl FnOnce(&mut IwEngine, &IwDev, Instant) -> R,
    ) -> R {
        if let Some(p) = &self.poller {
            if !crate::fabric::own_thread() {
                crate::device::set_busy_poll_hint(p);
            }
        }
        let iw = self.iw();
        let now = Instant::now();
        let r = {
            let mut e = sync::lock(&iw.engine);
            let r = f(&mut e, iw, now);
            // A call armed a timer before the I/O thread means to look (on that thread,
            // `sleeping_until` is cleared while it works).
            if e.sleeping_until
                .is_some_and(|s| e.earliest.is_some_and(|t| t < s))
            {
                e.sleeping_until = None;
                let _ = iw.waker.wake();
            }
            if !e.events.is_empty() {
                let mut p = sync::lock(&iw.pending);
                p.events.extend(e.events.drain(..));
                let entry = std::mem::size_of::<(ConnKey, IwEvent)>();
                if !rcm_proto::room::kept(e.events.capacity(), entry) {
                    e.events.shrink_to(rcm_proto::room::FLOOR_ENTRIES);
                }
            }
            r
        };
        self.route_iw();
        r
    }

    fn route_iw(self: &Arc<Self>) {
        let iw = self.iw();
        let mut p = sync::lock(&iw.pending);
        if p.routing {
            return;
        }
        p.routing = true;
        loop {
            let batch: Vec<_> = p.events.drain(..).collect();
            rcm_proto::room::shrink_deque(&mut p.events);
            if batch.is_empty() {
                p.routing = false;
                return;
            }
            drop(p);
            for (key, ev) in batch {
                crate::id::on_iw_event(self, key, ev);
            }
            p = sync::lock(&iw.pending);
        }
    }

    /// Active: opens a TCP connection from this device's address and the id's rdma_cm
    /// port `port` to `dst`; the MPA Request (`p`) leaves once it is connected. `owner`
    /// receives the stream's events.
    ///
    /// siw binds the socket to the id's address (`kernel_bindconnect`, with SO_REUSEADDR),
    /// so the passive side's child sees the client's rdma_cm address as its peer. rcm does
    /// the same; where the kernel has that TCP port taken (another socket holds it, or the
    /// same 4-tuple waits in TIME_WAIT), it connects from a port the kernel picks instead of
    /// failing the connect.
    pub(crate) fn iw_connect(
        self: &Arc<Self>,
        dst: SocketAddr,
        port: u16,
        p: iw::ConnectParams,
        owner: Weak<IdInner>,
    ) -> crate::Result<ConnKey> {
        let start = |port: u16| -> std::io::Result<socket2::Socket> {
            let sock = tcp_socket(dst)?;
            sock.set_nodelay(true)?;
            if port == 0 {
                // The port is chosen at connect (Linux 4.2 and later; an older kernel picks
                // it here).
                let _ = crate::sys::bind_address_no_port(&sock);
            } else {
                sock.set_reuse_address(true)?;
            }
            sock.bind(&SocketAddr::new(self.ip, port).into())?;
            match sock.connect(&dst.into()) {
                Ok(()) => Ok(sock),
                Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => Ok(sock),
                Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(sock),
                Err(e) => Err(e),
            }
        };
        let sock = match start(port) {
            Ok(s) => s,
            Err(e)
                if port != 0
                    && matches!(e.kind(), ErrorKind::AddrInUse | ErrorKind::AddrNotAvailable) =>
            {
                start(0)?
            }
            Err(e) => return Err(e.into()),
        };
        let mut stream = TcpStream::from_std(sock.into());
        let cfg = self.iw().cfg.clone();
        self.with_iw(|e, iw, _| {
            let key = e.new_key();
            iw.registry.register(
                &mut stream,
                Token(key),
                Interest::READABLE | Interest::WRITABLE,
            )?;
            sync::lock(&iw.owners).insert(key, owner);
            e.conns.insert(
                key,
                Conn {
                    cep: Cep::active(cfg),
                    stream,
                    peer: dst,
                    connecting: Some(p),
                    out: iw::ByteQueue::default(),
                    after: VecDeque::new(),
                    listen_port: None,
                    done: false,
                    drain_by: None,
                    half_open: false,
                },
            );
            let t = e.conns.get(&key).and_then(|c| c.cep.poll_timeout());
            e.note_deadline(key, t);
            Ok(key)
        })
    }

    /// Starts a TCP listener on `port` for the rdma_cm listener `id` (shared by every
    /// rdma_cm listener of this device on that port).
    pub(crate) fn iw_listen(
        self: &Arc<Self>,
        port: u16,
        backlog: usize,
        id: Weak<IdInner>,
    ) -> crate::Result<()> {
        let iw = self.iw();
        let mut ls = sync::lock(&iw.listens);
        if let Some((_, ids)) = ls.get_mut(&port) {
            ids.push(id);
            return Ok(());
        }
        let addr = SocketAddr::new(self.ip, port);
        let mut sock = tcp_listener(addr, backlog).map_err(|e| match e.kind() {
            ErrorKind::AddrInUse => crate::Error::AddrInUse(addr),
            _ => e.into(),
        })?;
        let mut e = sync::lock(&iw.engine);
        let key = e.new_key();
        iw.registry
            .register(&mut sock, Token(key), Interest::READABLE)?;
        e.listeners.insert(key, Listener { sock, port });
        drop(e);
        ls.insert(port, (key, vec![id]));
        Ok(())
    }

    /// Removes `id` from the listeners of `port`; the last one closes the TCP listener.
    pub(crate) fn iw_unlisten(&self, port: u16, id: &IdInner) {
        let iw = self.iw();
        let mut ls = sync::lock(&iw.listens);
        let Some((key, ids)) = ls.get_mut(&port) else {
            return;
        };
        ids.retain(|w| {
            w.upgrade()
                .is_some_and(|x| !std::ptr::eq(Arc::as_ptr(&x), id))
        });
        if ids.is_empty() {
            let key = *key;
            ls.remove(&port);
            let mut e = sync::lock(&iw.engine);
            if let Some(mut l) = e.listeners.remove(&key) {
                let _ = iw.registry.deregister(&mut l.sock);
            }
        }
    }

    /// Runs `f` on a stream's Cep (if the stream still exists), then drives it.
    pub(crate) fn iw_cep<R>(
        self: &Arc<Self>,
        key: ConnKey,
        f: impl FnOnce(&mut Cep, Instant) -> R,
    ) -> Option<R> {
        self.with_iw(|e, iw, now| e.with_cep(key, now, &iw.registry, |c| f(c, now)))
    }

    /// Queues `msg` as a Send on a stream, unless [`IW_SEND_BUFFER`] bytes or more wait for
    /// the socket already (`Ok(Err(Full))`): a peer that stops reading cannot make this
    /// side hold what the application keeps sending. `None`: no such stream.
    pub(crate) fn iw_send(
        self: &Arc<Self>,
        key: ConnKey,
        msg: &[u8],
    ) -> Option<Result<Result<(), iw::CepError>, SendBufferFull>> {
        self.with_iw(|e, iw, now| {
            // A message longer than the bound is taken when nothing waits. What the engine
            // holds for the initiator's first FPDU (`responder_hold`) waits too.
            let conn = e.conns.get(&key)?;
            let unsent = conn.out.len() + conn.cep.held_bytes();
            if unsent > 0 && unsent + msg.len() > IW_SEND_BUFFER {
                return Some(Err(SendBufferFull));
            }
            e.with_cep(key, now, &iw.registry, |c| Ok(c.send(now, msg)))
        })
    }

    /// Feeds one readiness event to the engine.
    fn iw_ready(e: &mut IwEngine, iw: &IwDev, token: Token, now: Instant) {
        let key = token.0;
        if let Some(l) = e.listeners.get(&key) {
            let port = l.port;
            let (mut accepted, mut stalled) = drain_accepts(|| l.sock.accept());
            // Out of descriptors (or memory) with silent streams open: the oldest of them
            // gives its descriptor up, as past the half-open bound, and the queue is tried
            // again. Otherwise streams that say nothing would keep every new client out
            // until their MPA timeout, below any half-open bound the process's open-file
            // limit does not reach (and the process's own files and sockets with them).
            let mut evicted = 0;
            while stalled && evicted < EVICT_WHEN_STALLED {
                let Some(k) = e.oldest_half_open() else { break };
                DeviceInner::iw_ready(e, iw, Token(k), now);
                e.evict_if_half_open(k, &iw.registry);
                evicted += 1;
                let Some(l) = e.listeners.get(&key) else {
                    break;
                };
                let (more, still) = drain_accepts(|| l.sock.accept());
                accepted.extend(more);
                stalled = still;
            }
            if stalled {
                let (at, keys) = e.stalled.get_or_insert_with(|| (now, Vec::new()));
                *at = now + ACCEPT_RETRY;
                if !keys.contains(&key) {
                    keys.push(key);
                }
            }
            for (mut stream, peer) in accepted {
                // Past the bound the oldest silent stream is reset (as the RoCE engine gives
                // up its oldest half-open connection): a peer that opens streams and says
                // nothing must not take the process's descriptors, nor keep new clients out.
                while e.half_open >= iw.max_half_open {
                    let Some(k) = e.oldest_half_open() else { break };
                    // Its Request may be waiting in its socket: read it first, and reset
                    // the stream only if it is still silent.
                    DeviceInner::iw_ready(e, iw, Token(k), now);
                    e.evict_if_half_open(k, &iw.registry);
                }
                let _ = stream.set_nodelay(true);
                let k = e.new_key();
                if iw
                    .registry
                    .register(
                        &mut stream,
                        Token(k),
                        Interest::READABLE | Interest::WRITABLE,
                    )
                    .is_err()
                {
                    continue;
                }
                let cep = Cep::passive(now, iw.cfg.clone());
                e.note_deadline(k, cep.poll_timeout());
                e.conns.insert(
                    k,
                    Conn {
                        cep,
                        stream,
                        peer,
                        connecting: None,
                        out: iw::ByteQueue::default(),
                        after: VecDeque::new(),
                        listen_port: Some(port),
                        done: false,
                        drain_by: None,
                        half_open: true,
                    },
                );
                e.half_open += 1;
                e.half_open_order.push_back(k);
                if e.half_open_order.len() > 2 * e.half_open + 64 {
                    let conns = &e.conns;
                    e.half_open_order
                        .retain(|k| conns.get(k).is_some_and(|c| c.half_open));
                }
            }
            return;
        }
        let Some(c) = e.conns.get_mut(&key) else {
            return;
        };
        if c.connecting.is_some() {
            // The connect finished one way or the other once the socket reports anything.
            match c.stream.take_error() {
                Ok(Some(err)) | Err(err) => {
                    let kind = err.kind();
                    e.events.push((key, IwEvent::ConnectFailed(kind)));
                    if let Some(mut c) = e.remove_conn(key) {
                        let _ = iw.registry.deregister(&mut c.stream);
                    }
                    return;
                }
                Ok(None) => {}
            }
            match c.stream.peer_addr() {
                Ok(_) => {
                    if let Some(p) = c.connecting.take() {
                        // The parameters were checked by the caller; a refusal here still
                        // ends the connection cleanly.
                        if c.cep.connect(now, &p).is_err() {
                            c.cep.destroy(now);
                            e.events
                                .push((key, IwEvent::ConnectFailed(ErrorKind::InvalidInput)));
                        }
                    }
                }
                Err(err) if err.kind() == ErrorKind::NotConnected => return,
                Err(err) => {
                    e.events.push((key, IwEvent::ConnectFailed(err.kind())));
                    if let Some(mut c) = e.remove_conn(key) {
                        let _ = iw.registry.deregister(&mut c.stream);
                    }
                    return;
                }
            }
        }
        let mut buf = [0u8; 16 << 10];
        // Read what the socket has (edge-triggered: until it would block), up to a turn's
        // budget; the rest raises no new edge, so the stream is noted to be read again.
        let mut closed = None;
        let mut budget = READ_TURN;
        loop {
            if budget == 0 {
                e.unread.push(key);
                break;
            }
            match c.stream.read(&mut buf) {
                Ok(0) => {
                    closed = Some(true);
                    break;
                }
                Ok(n) => {
                    budget = budget.saturating_sub(n);
                    c.cep.on_bytes(now, &buf[..n]);
                    if c.cep.is_closed() {
                        break;
                    }
                }
                Err(err) if err.kind() == ErrorKind::WouldBlock => break,
                Err(err) if err.kind() == ErrorKind::Interrupted => {}
                Err(_) => {
                    closed = Some(false);
                    break;
                }
            }
        }
        if let Some(graceful) = closed {
            c.cep.on_tcp_closed(now, graceful);
        }
        e.drive(key, now, &iw.registry);
    }

    /// Runs the Cep timers that are due; returns the next deadline.
    fn iw_timers(e: &mut IwEngine, iw: &IwDev, now: Instant) -> Option<Instant> {
        if let Some((_, keys)) = e.stalled.take_if(|(t, _)| *t <= now) {
            for k in keys {
                DeviceInner::iw_ready(e, iw, Token(k), now);
            }
        }
        let soonest = |e: &IwEngine| match (e.earliest, e.stalled.as_ref().map(|(t, _)| *t)) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        // Nothing due yet: no look at the streams (most are idle). With no deadline known,
        // a look through every stream once a second all the same, rebuilding `deadlines`.
        let recent = e
            .last_scan
            .is_some_and(|t| now.saturating_duration_since(t) < Duration::from_secs(1));
        if e.earliest.map_or(recent, |t| t > now) {
            return soonest(e);
        }
        if e.earliest.is_none() {
            e.last_scan = Some(now);
            e.rebuild_deadlines();
        }
        // What is due, off the top; each stream's own deadlines decide (an entry is stale
        // once its stream moved on, and a stream may have two entries due).
        let mut keys = Vec::new();
        while let Some(&Reverse((t, k))) = e.deadlines.peek() {
            if t > now {
                break;
            }
            e.deadlines.pop();
            keys.push(k);
        }
        keys.sort_unstable();
        keys.dedup();
        for k in keys {
            let due = |e: &IwEngine, f: fn(&Conn) -> Option<Instant>| {
                e.conns.get(&k).and_then(f).is_some_and(|t| t <= now)
            };
            if due(e, |c| c.cep.poll_timeout()) {
                e.with_cep(k, now, &iw.registry, |c| c.on_timer(now));
            }
            if due(e, |c| c.drain_by) {
                e.drive(k, now, &iw.registry);
            }
        }
        e.earliest = e.deadlines.peek().map(|Reverse((t, _))| *t);
        soonest(e)
    }
}

/// Looks at the streams' readiness now, adding what is ready to `keys`, unless another
/// thread is looking at this instant (the I/O thread, or a waiter: see `iw_poll_once`);
/// `woken` is set when the waker was among it, `failed` when the poll failed.
fn look_now(looker: &Mutex<Looker>, keys: &mut Vec<ConnKey>, woken: &mut bool, failed: &mut bool) {
    let mut l = match looker.try_lock() {
        Ok(l) => l,
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => return,
    };
    match l.look(Duration::ZERO, keys) {
        Ok(w) => *woken |= w,
        Err(_) => *failed = true,
    }
}

fn io_loop(
    dev: &Weak<DeviceInner>,
    looker: &Mutex<Looker>,
    epoll_fd: &std::os::fd::OwnedFd,
    gate: &RxGate,
    spin: Duration,
) {
    let mut keys = Vec::new();
    let mut wait = Duration::from_millis(100);
    // Until when this thread polls rather than sleeps: `spin` after it last had something to
    // do. Each step of a connection's setup (the TCP connect, the MPA Request, the Reply)
    // makes the other end's thread ready; asleep in epoll, each would cost a wake-up.
    let mut poll_until = Instant::now();
    let mut nap = Duration::ZERO;
    loop {
        // A thread waiting for its event polls the streams (see `rxgate`): stand aside until
        // its poll's deadline. The timers and the streams left unread stay this thread's: a
        // pass without readiness runs them.
        let aside = gate.polled_left();
        if !aside.is_zero() {
            nap = crate::rxgate::next_nap(nap, aside);
            wait = {
                let Some(d) = dev.upgrade() else { return };
                if d.iw().stop.load(Ordering::SeqCst) {
                    return;
                }
                let _here = d.inline_callbacks.then(crate::CallbacksHere::begin);
                d.iw_pass(&mut keys, true)
            };
            std::thread::park_timeout(nap.min(wait.max(Duration::from_micros(1))));
            // The waiter is busy with this device: what follows its event is likely soon.
            poll_until = rcm_proto::later(Instant::now(), spin);
            continue;
        }
        nap = Duration::ZERO;
        let start = Instant::now();
        let mut woken = false;
        let mut failed = false;
        let polled = !wait.is_zero()
            && crate::spin::spin_until(
                poll_until.saturating_duration_since(start).min(wait),
                || {
                    if !gate.polled_left().is_zero() {
                        return true;
                    }
                    look_now(looker, &mut keys, &mut woken, &mut failed);
                    woken || failed || !keys.is_empty()
                },
            );
        if polled && keys.is_empty() && !woken && !failed {
            // A waiter began polling: stand aside.
            continue;
        }
        let mut slept = false;
        if !polled {
            let mut left = wait.saturating_sub(start.elapsed());
            let Some(d) = dev.upgrade() else { return };
            let iw = d.iw();
            iw.asleep.store(true, Ordering::SeqCst);
            // A waiter took a wake-up meant for this thread: the deadlines (and `stop`) are
            // looked at again first.
            if iw.rewake.swap(false, Ordering::SeqCst) {
                left = Duration::ZERO;
            }
            drop(d);
            slept = !left.is_zero();
            // Asleep until the streams have readiness, without holding the looker: a waiter
            // may take it meanwhile.
            if slept {
                crate::device::wait_readable(epoll_fd, left);
            }
            if let Some(d) = dev.upgrade() {
                d.iw().asleep.store(false, Ordering::SeqCst);
            }
            // What woke this thread is a waiter's if one began polling meanwhile.
            if gate.polled_left().is_zero() {
                look_now(looker, &mut keys, &mut woken, &mut failed);
            }
        }
        if failed {
            std::thread::sleep(Duration::from_millis(1));
        }
        if woken || !keys.is_empty() {
            poll_until = rcm_proto::later(Instant::now(), spin);
        }
        let Some(d) = dev.upgrade() else { return };
        if slept {
            d.stats.sleeps.fetch_add(1, Ordering::Relaxed);
        }
        if d.iw().stop.load(Ordering::SeqCst) {
            return;
        }
        // `CallbackMode::Inline`: the callbacks of what this pass produced run here once the
        // device's state is let go (at the end of the pass), not on a callback thread that
        // must be woken: a serial connect's MPA Reply is written by the accepting callback
        // on this thread.
        let _here = d.inline_callbacks.then(crate::CallbacksHere::begin);
        wait = d.iw_pass(&mut keys, true);
    }
}

impl DeviceInner {
    /// Hands the readiness in `keys` (emptied) to the engine, with the streams left unread
    /// before, and runs the timers that are due: the I/O thread's pass, or (`io_thread`
    /// false) a waiter's. Returns how long the I/O thread may wait before its next pass.
    fn iw_pass(self: &Arc<Self>, keys: &mut Vec<ConnKey>, io_thread: bool) -> Duration {
        // Time is the Cep's to keep; the I/O thread only sleeps until its next deadline, and
        // not at all while a stream has more to read.
        self.with_iw(|e, iw, now| {
            if io_thread {
                e.sleeping_until = None;
            }
            let unread = std::mem::take(&mut e.unread);
            // Each stream gets one turn a pass, whether it is ready again, left unread, or
            // both (one poll reports a stream once).
            if !unread.is_empty() {
                let mut seen: std::collections::HashSet<ConnKey> = keys.iter().copied().collect();
                keys.extend(unread.into_iter().filter(|k| seen.insert(*k)));
            }
            // Streams before listeners: a Request already in a stream's socket is read
            // before new accepts could count that stream as silent.
            keys.sort_by_key(|k| e.listeners.contains_key(k));
            for k in keys.drain(..) {
                DeviceInner::iw_ready(e, iw, Token(k), now);
            }
            let next = DeviceInner::iw_timers(e, iw, now);
            let wait = if e.unread.is_empty() {
                next.map_or(Duration::from_millis(500), |t| {
                    t.saturating_duration_since(now)
                })
                .clamp(Duration::from_millis(1), Duration::from_millis(500))
            } else {
                Duration::ZERO
            };
            // What this sleep is for: the deadline itself when it comes within the shortest
            // sleep (the thread wakes just after it), so that only an earlier one wakes it
            // (not this thread's own, which would make it spin until the deadline).
            if io_thread {
                e.sleeping_until = Some(next.map_or(now + wait, |t| t.min(now + wait)));
            }
            wait
        })
    }

    /// Busy polling (see `rxgate`): a thread waiting for an event looks at the streams'
    /// readiness, as the I/O thread does, and hands what it took to the engine itself;
    /// false when nothing was ready, or the I/O thread was looking at that instant. The
    /// events' callbacks run where the fabric's mode puts events from elsewhere, never on
    /// this thread.
    pub(crate) fn iw_poll_once(self: &Arc<Self>) -> bool {
        let Some(iw) = self.iw.as_ref() else {
            return false;
        };
        if iw.stop.load(Ordering::Relaxed) {
            return false;
        }
        let mut keys = Vec::new();
        let (mut woken, mut failed) = (false, false);
        look_now(&iw.looker, &mut keys, &mut woken, &mut failed);
        if woken {
            // The wake-up was the I/O thread's (a call armed an earlier timer, or the device
            // stops).
            self.iw_hand_back(iw);
        }
        if keys.is_empty() {
            return false;
        }
        self.stats
            .rx_polled
            .fetch_add(keys.len() as u64, Ordering::Relaxed);
        if self.iw_pass(&mut keys, false).is_zero() {
            // A stream had more to read than a turn takes: it raises no new edge, so the I/O
            // thread must come back to it without sleeping, whether or not this waiter polls
            // again.
            self.iw_hand_back(iw);
        }
        true
    }

    /// The I/O thread looks at its deadlines, its streams left unread and `stop` before it
    /// sleeps again; one asleep, or parked standing aside, is woken for it.
    fn iw_hand_back(&self, iw: &IwDev) {
        iw.rewake.store(true, Ordering::SeqCst);
        if iw.asleep.load(Ordering::SeqCst) {
            let _ = iw.waker.wake();
        } else {
            self.unpark_io();
        }
    }
}

/// Whether `ip` can carry an iWARP device (any local address; checked by binding).
/// The bind takes no port (the port is left to a connect that never comes): a host whose
/// ephemeral range is all held, as thousands of short iWARP connections on loopback leave
/// it in TIME_WAIT for a minute, could otherwise open no iWARP device ("Address already in
/// use" from a bind to port 0).
pub(crate) fn check_addr(ip: IpAddr) -> crate::Result<()> {
    let at = SocketAddr::new(ip, 0);
    let s = tcp_socket(at)?;
    let _ = crate::sys::bind_address_no_port(&s);
    s.bind(&at.into()).map_err(|e| match e.kind() {
        std::io::ErrorKind::AddrNotAvailable => crate::Error::AddrNotAvailable(ip),
        _ => e.into(),
    })
}

/// Accepts every connection queued on an edge-triggered listener: until `WouldBlock`
/// (returns `false`), past a connection that went away before it was taken (that one is
/// skipped; the next may be fine), or until an error that leaves the rest queued (out of
/// descriptors or memory: EMFILE, ENFILE, ENOBUFS; returns `true`, and the listener must be
/// tried again shortly, since nothing else would bring it back to them until another
/// connection came).
fn drain_accepts<T>(mut accept: impl FnMut() -> std::io::Result<T>) -> (Vec<T>, bool) {
    let mut accepted = Vec::new();
    loop {
        match accept() {
            Ok(t) => accepted.push(t),
            Err(err) if err.kind() == ErrorKind::WouldBlock => return (accepted, false),
            Err(err)
                if matches!(
                    err.kind(),
                    ErrorKind::Interrupted
                        | ErrorKind::ConnectionAborted
                        | ErrorKind::ConnectionReset
                ) => {}
            Err(_) => return (accepted, true),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Error, ErrorKind};

    /// Scripted `accept` results, in order.
    fn script(v: Vec<std::io::Result<u32>>) -> impl FnMut() -> std::io::Result<u32> {
        let mut it = v.into_iter();
        move || {
            it.next()
                .unwrap_or_else(|| Err(ErrorKind::WouldBlock.into()))
        }
    }

    /// A connection that went away before it was taken (ECONNABORTED, ECONNRESET) or an
    /// interrupted call is skipped and the queue drained on; running out of descriptors stops
    /// the draining and asks for a retry, with what was taken kept.
    #[test]
    fn accepting_skips_the_connections_gone_and_stops_at_a_lack_of_descriptors() {
        let (got, stalled) = super::drain_accepts(script(vec![
            Ok(1),
            Err(ErrorKind::ConnectionAborted.into()),
            Ok(2),
            Err(ErrorKind::ConnectionReset.into()),
            Err(ErrorKind::Interrupted.into()),
            Ok(3),
        ]));
        assert_eq!((got, stalled), (vec![1, 2, 3], false));
        let emfile = Error::from_raw_os_error(libc::EMFILE);
        let (got, stalled) = super::drain_accepts(script(vec![Ok(1), Err(emfile), Ok(2)]));
        assert_eq!((got, stalled), (vec![1], true));
        let (got, stalled) = super::drain_accepts(script(vec![]));
        assert_eq!((got, stalled), (vec![], false));
    }

    /// The accept queue holds at least the default backlog, here for a backlog of 2: 260
    /// connections none of which is accepted yet all complete (std's and mio's 128 dropped
    /// the SYNs past it; a dropped one is retried after a second, past this test's 500 ms).
    #[test]
    fn a_tcp_listener_queues_its_backlog() {
        let l = super::tcp_listener("127.0.0.1:0".parse().expect("addr"), 2).expect("listener");
        let at = l.local_addr().expect("addr");
        let held: Vec<_> = (0..260)
            .map(|i| {
                std::net::TcpStream::connect_timeout(&at, std::time::Duration::from_millis(500))
                    .unwrap_or_else(|e| panic!("connection {i}: {e}"))
            })
            .collect();
        assert_eq!(held.len(), 260);
    }
}
