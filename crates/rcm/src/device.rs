//! A RoCEv2 CM port: a UDP socket on one local address, the rcm-proto engine behind a mutex,
//! and an I/O thread that feeds it datagrams and time. (An iWARP device is the same struct
//! with its `iw` part set and no UDP socket: see `iwarp.rs`.) Commands from any thread lock the
//! engine briefly; transmits are sent and events routed only after the lock is released, so
//! no user code and no other id's teardown ever runs under it.

use crate::id::IdInner;
use crate::remote::BusyPoll;
use crate::rxgate::{RxGate, RxTurn};
use crate::sync;
use foldhash::HashMap as LocalMap;
use rcm_proto::ib::{CepHandle, CmEvent, Endpoint, Transmit};
use rcm_wire::roce::{self, Bth, Deth, GsiDatagram, IpForIcrc, Opcode, RocePacket};
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// One engine listener on a device and the rdma_cm listeners that share it.
pub(crate) struct ServiceListen {
    pub handle: CepHandle,
    pub ids: Vec<Weak<IdInner>>,
}

/// Engine events waiting to be routed, and whether a thread is routing them.
#[derive(Default)]
struct Pending {
    events: std::collections::VecDeque<(CepHandle, CmEvent)>,
    /// The queue the router last emptied, kept for its capacity: the two trade places each
    /// round, so routing allocates nothing once they have grown.
    spare: std::collections::VecDeque<(CepHandle, CmEvent)>,
    routing: bool,
}

/// Counters of one device.
#[derive(Debug, Default)]
pub struct DeviceStats {
    /// Datagrams received.
    pub rx: AtomicU64,
    /// Datagrams that were neither RoCEv2 GSI MADs nor UD SENDs (garbage).
    pub rx_bad: AtomicU64,
    /// Datagrams dropped because their ICRC was wrong (only counted with ICRC verification).
    pub rx_bad_icrc: AtomicU64,
    /// UD SENDs queued to a UD id.
    pub ud_delivered: AtomicU64,
    /// UD SENDs to a QPN no live UD id of this device receives on.
    pub ud_no_qp: AtomicU64,
    /// UD SENDs whose Q_Key was not the id's.
    pub ud_bad_qkey: AtomicU64,
    /// UD SENDs dropped because the id's receive queue was full.
    pub ud_queue_full: AtomicU64,
    /// UD SENDs sent.
    pub ud_sent: AtomicU64,
    /// Datagrams sent.
    pub tx: AtomicU64,
    /// Send errors.
    pub tx_errors: AtomicU64,
    /// System calls that sent several datagrams at once (see `send_group`).
    pub tx_segmented: AtomicU64,
    /// Receives that brought several datagrams at once (`UDP_GRO`).
    pub rx_coalesced: AtomicU64,
    /// Datagrams to the device's own address handed to its engine (`FabricConfig::loopback`).
    pub looped: AtomicU64,
    /// Datagrams received by a thread waiting for an event (see `rxgate`).
    pub rx_polled: AtomicU64,
    /// Times the device's own thread went to sleep until its socket (or one of its iWARP
    /// sockets) had something, its poll (`FabricConfig::spin`) over with nothing found.
    pub sleeps: AtomicU64,
    /// Where a traced connect's time went on this device (`rcm::trace`; off by default).
    pub trace: crate::trace::DeviceStamps,
}

pub(crate) struct DeviceInner {
    pub ip: IpAddr,
    pub port: u16,
    /// The socket, taken (closed) at shutdown so the address can be bound again.
    sock: Mutex<Option<Arc<UdpSocket>>>,
    engine: Mutex<Endpoint>,
    /// Engine handles of published ids (reserve → publish → unpublish discipline: an id is
    /// inserted only once fully built, removed before its teardown).
    /// (This and the other id tables are keyed by what this side chose: a fast hash.)
    pub ceps: Mutex<LocalMap<CepHandle, Weak<IdInner>>>,
    /// Engine listeners by service ID.
    pub listens: Mutex<LocalMap<u64, ServiceListen>>,
    /// UD ids receiving datagrams, by their QPN (registered by a UD `connect`/`accept`,
    /// removed at teardown).
    pub ud_qps: Mutex<LocalMap<u32, Weak<IdInner>>>,
    pub removed: AtomicBool,
    /// Children published after a removal's walk of the id table had passed them by: they
    /// got their `DeviceRemoval` on publication, and the removal waits for them too.
    pub late_holders: Mutex<Vec<(u64, Arc<crate::slot::Slot<crate::Event>>)>>,
    stop: AtomicBool,
    wake_at: Mutex<Option<Instant>>,
    /// Ends the I/O thread's sleep in poll(2): an eventfd only that thread reads (see
    /// `wake_io_thread`). `None` on a device verifying ICRCs, whose thread sleeps in a read
    /// of its raw socket and is woken by a one-byte datagram to itself.
    wake: Option<Arc<std::os::fd::OwnedFd>>,
    /// Engine events in engine order, waiting to be routed by one thread at a time.
    pending: Mutex<Pending>,
    psn: AtomicU32,
    /// Datagrams to one destination go out in one segmented send (`UDP_SEGMENT`): off on a
    /// device that verifies ICRCs (it keeps to one datagram per send, the plainest traffic
    /// to check), and once the kernel refused one.
    gso: AtomicBool,
    /// `CallbackMode::Inline`: callbacks of received events run on the receive loop.
    pub(crate) inline_callbacks: bool,
    /// `FabricConfig::loopback`: datagrams to `ip` go to the engine, not to the socket.
    loopback: bool,
    pub stats: DeviceStats,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Set on iWARP devices: TCP instead of the UDP socket (the IB engine is then unused).
    pub iw: Option<crate::iwarp::IwDev>,
    /// Who receives from the socket (see `rxgate`): on a RoCEv2 device whose I/O thread reads
    /// it (not one verifying ICRCs on a raw socket), and on an iWARP device (its streams'
    /// readiness).
    pub(crate) gate: Option<Arc<RxGate>>,
    /// What a thread waiting for an event polls when this device has a `gate` (the hint
    /// names it; see `busy_poll_hint`).
    pub(crate) poller: Option<Arc<DevicePoll>>,
}

impl DeviceInner {
    pub(crate) fn open(
        ip: IpAddr,
        port: u16,
        engine: Endpoint,
        verify_icrc: bool,
        spin: Duration,
        inline_callbacks: bool,
        loopback: bool,
    ) -> crate::Result<Arc<Self>> {
        let raw = if verify_icrc {
            Some(raw_receiver(ip)?)
        } else {
            None
        };
        let at = SocketAddr::new(ip, port);
        // Typed, so that a tool can say what usually holds the port: another process's
        // device (an rcm, a daemon), as only one process may own it.
        let sock = UdpSocket::bind(at).map_err(|e| match e.kind() {
            std::io::ErrorKind::AddrInUse => crate::Error::AddrInUse(at),
            std::io::ErrorKind::AddrNotAvailable => crate::Error::AddrNotAvailable(ip),
            _ => e.into(),
        })?;
        if ip.is_ipv4() {
            crate::sys::pmtudisc_do(&sock)?;
        } else {
            crate::sys::accept_zero_checksum6(&sock)?;
        }
        crate::sys::grow_buffers(&sock, 16 << 20);
        // A UDP socket takes a segmented send whole (with `UDP_GRO`, see `RxBatch`) or has the
        // kernel cut it; the raw socket of ICRC verification sees it whole and cuts it itself
        // (`cut_run`).
        let gso = raw.is_none() && crate::sys::enable_gro(&sock).is_ok();
        let sock = Arc::new(sock);
        let io_sock = sock.clone();
        let gate = raw.is_none().then(|| Arc::new(RxGate::new()));
        let io_gate = gate.clone();
        let wake = match raw {
            Some(_) => None,
            None => Some(Arc::new(
                rustix::event::eventfd(
                    0,
                    rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
                )
                .map_err(|e| crate::Error::Io(format!("eventfd: {e}")))?,
            )),
        };
        let io_wake = wake.clone();
        let dev = Arc::new_cyclic(|me| DeviceInner {
            port,
            wake,
            sock: Mutex::new(Some(sock)),
            gso: AtomicBool::new(gso),
            inline_callbacks,
            loopback,
            poller: gate.is_some().then(|| Arc::new(DevicePoll(me.clone()))),
            gate,
            ..DeviceInner::blank(ip, engine)
        });
        let weak = Arc::downgrade(&dev);
        // Made here, not on the thread: the device's memory is all taken when it opens.
        let rx = raw.is_none().then(RxBatch::new);
        let h = std::thread::Builder::new()
            .name(format!("rcm-dev-{ip}"))
            .spawn(move || {
                crate::fabric::mark_own_thread();
                match (raw, rx, io_gate, io_wake) {
                    (Some(raw), _, _, _) => raw_io_loop(&weak, &io_sock, &raw),
                    (None, Some(rx), Some(gate), Some(wake)) => {
                        io_loop(&weak, &io_sock, &wake, &gate, spin, rx);
                    }
                    _ => {}
                }
            })
            .map_err(|e| crate::Error::Io(e.to_string()))?;
        *sync::lock(&dev.thread) = Some(h);
        Ok(dev)
    }

    /// An iWARP device on `ip`: TCP listeners and streams run by its own I/O thread.
    pub(crate) fn open_iwarp(
        ip: IpAddr,
        cfg: rcm_proto::iw::CepConfig,
        engine: Endpoint,
        max_half_open: usize,
        spin: Duration,
        inline_callbacks: bool,
    ) -> crate::Result<Arc<Self>> {
        crate::iwarp::check_addr(ip)?;
        let iw = crate::iwarp::IwDev::new(cfg, max_half_open)?;
        let dev = Arc::new_cyclic(|me| DeviceInner {
            iw: Some(iw),
            inline_callbacks,
            gate: Some(Arc::new(RxGate::new())),
            poller: Some(Arc::new(DevicePoll(me.clone()))),
            ..DeviceInner::blank(ip, engine)
        });
        crate::iwarp::IwDev::start(&dev, spin)?;
        Ok(dev)
    }

    /// A device on `ip` with nothing of a transport yet (no socket, thread, or iWARP
    /// state, all tables empty): each `open_*` sets what its transport has.
    fn blank(ip: IpAddr, engine: Endpoint) -> DeviceInner {
        DeviceInner {
            ip,
            port: 0,
            sock: Mutex::new(None),
            engine: Mutex::new(engine),
            ceps: Mutex::new(LocalMap::default()),
            listens: Mutex::new(LocalMap::default()),
            ud_qps: Mutex::new(LocalMap::default()),
            removed: AtomicBool::new(false),
            late_holders: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            wake_at: Mutex::new(None),
            wake: None,
            pending: Mutex::new(Pending::default()),
            psn: AtomicU32::new(0),
            gso: AtomicBool::new(false),
            inline_callbacks: false,
            loopback: false,
            stats: DeviceStats::default(),
            thread: Mutex::new(None),
            iw: None,
            gate: None,
            poller: None,
        }
    }

    /// Whether this is an iWARP device.
    pub(crate) fn is_iwarp(&self) -> bool {
        self.iw.is_some()
    }

    /// Wakes the device's I/O thread if it is parked (standing aside for a waiter).
    pub(crate) fn unpark_io(&self) {
        if let Some(iw) = &self.iw {
            iw.unpark();
        } else if let Some(h) = sync::lock(&self.thread).as_ref() {
            h.thread().unpark();
        }
    }

    /// Runs `f` on the engine, then sends what it queued and routes what it reported.
    ///
    /// Events leave the engine in order and are queued before the engine lock is released;
    /// one thread at a time routes the queue, so the events of one connection reach its id in
    /// engine order even when several threads drive the engine. A call made while this thread
    /// is already routing (a teardown inside routing) only queues: the router picks it up.
    pub(crate) fn with_engine<R>(
        self: &Arc<Self>,
        f: impl FnOnce(&mut Endpoint, Instant) -> R,
    ) -> R {
        if let Some(p) = &self.poller {
            if !crate::fabric::own_thread() {
                set_busy_poll_hint(p);
            }
        }
        let now = Instant::now();
        // The thread's transmit list is reused (a nested call, from a callback this one
        // routes, finds it taken and uses a fresh one; so does a call made while the thread's
        // locals are being torn down).
        let mut tx = TX_LIST
            .try_with(|l| std::mem::take(&mut *l.borrow_mut()))
            .unwrap_or_default();
        let (r, mut next) = {
            let mut ep = sync::lock(&self.engine);
            let r = f(&mut ep, now);
            ep.take_transmits(&mut tx);
            let mut p = sync::lock(&self.pending);
            ep.take_events(&mut p.events);
            drop(p);
            // Whether the I/O thread must wake sooner than it planned: only a timer armed
            // by this call can make it (see `run_timers`).
            (r, ep.poll_armed())
        };
        self.stats.trace.engine_done();
        let mut local = LOCAL_LIST
            .try_with(|l| std::mem::take(&mut *l.borrow_mut()))
            .unwrap_or_default();
        for round in 0.. {
            // Bounded, so that two ids answering each other forever cannot hold this thread:
            // past it the rest goes through the socket, and the receive loop takes it.
            if round < LOOPBACK_ROUNDS {
                self.take_own(&mut tx, &mut local);
            }
            if !hold(self, &mut tx) {
                self.send_all(&tx);
            }
            tx.clear();
            if local.is_empty() {
                break;
            }
            next = earliest(next, self.deliver_own(&mut local, &mut tx));
        }
        let _ = LOCAL_LIST.try_with(|l| keep_list(&mut l.borrow_mut(), local));
        let _ = TX_LIST.try_with(|l| keep_list(&mut l.borrow_mut(), tx));
        self.maybe_wake(next);
        self.route_pending();
        r
    }

    /// Moves the datagrams of `tx` addressed to this device into `local` when they are to
    /// be looped back (`FabricConfig::loopback`, the device still open).
    fn take_own(&self, tx: &mut Vec<Transmit>, local: &mut Vec<Transmit>) {
        if !self.loopback || !tx.iter().any(|t| t.dst == self.ip) || self.socket().is_none() {
            return;
        }
        // All of them (a looped exchange's usual case): the lists trade places, nothing is
        // copied or allocated.
        if local.is_empty() && tx.iter().all(|t| t.dst == self.ip) {
            std::mem::swap(tx, local);
            return;
        }
        // One pass, the others keeping their order.
        let mut kept = 0;
        for i in 0..tx.len() {
            if tx[i].dst == self.ip {
                local.push(tx[i].clone());
            } else {
                tx.swap(kept, i);
                kept += 1;
            }
        }
        tx.truncate(kept);
    }

    /// Hands `local` (emptied) to the engine as received from this device's own address;
    /// what that makes the engine send goes to `tx`, what it reports to the routing queue.
    /// Returns the earliest deadline this armed (see `Endpoint::poll_armed`).
    fn deliver_own(&self, local: &mut Vec<Transmit>, tx: &mut Vec<Transmit>) -> Option<Instant> {
        let n = local.len() as u64;
        let mut ep = sync::lock(&self.engine);
        let now = Instant::now();
        for t in local.iter() {
            ep.handle_datagram(now, self.ip, &t.mad);
        }
        local.clear();
        ep.take_transmits(tx);
        let mut p = sync::lock(&self.pending);
        ep.take_events(&mut p.events);
        drop(p);
        for c in [&self.stats.looped, &self.stats.tx, &self.stats.rx] {
            c.fetch_add(n, Ordering::Relaxed);
        }
        ep.poll_armed()
    }

    fn route_pending(self: &Arc<Self>) {
        let mut p = sync::lock(&self.pending);
        if p.routing {
            return;
        }
        p.routing = true;
        loop {
            if p.events.is_empty() {
                p.routing = false;
                return;
            }
            let spare = std::mem::take(&mut p.spare);
            let mut batch = std::mem::replace(&mut p.events, spare);
            drop(p);
            self.route(batch.drain(..));
            p = sync::lock(&self.pending);
            // Not a flood's: a removal or a timer pass may route thousands at once.
            if p.spare.capacity() < batch.capacity() && batch.capacity() <= MAX_KEPT_LIST {
                p.spare = batch;
            }
        }
    }

    fn socket(&self) -> Option<Arc<UdpSocket>> {
        sync::lock(&self.sock).clone()
    }

    /// Turns `UDP_GRO` off for good (a UD QP is about to receive here): each receive then
    /// brings one datagram, so runs of UD SENDs, whose sizes say nothing, are never
    /// guessed at. Segmented sends to this device are cut by the kernel from then on, one
    /// receive each.
    pub(crate) fn receive_one_by_one(&self) -> crate::Result<()> {
        let Some(sock) = self.socket() else {
            return Ok(());
        };
        crate::sys::disable_gro(&sock).map_err(|e| crate::Error::Io(format!("UDP_GRO off: {e}")))
    }

    fn send_all(&self, tx: &[Transmit]) {
        if tx.is_empty() {
            return;
        }
        let Some(sock) = self.socket() else { return };
        let mut buf = TX_BUF
            .try_with(|b| std::mem::take(&mut *b.borrow_mut()))
            .unwrap_or_default();
        if tx.len() > 1 && self.gso.load(Ordering::Relaxed) {
            let mut batch = TX_BATCH
                .try_with(|b| std::mem::take(&mut *b.borrow_mut()))
                .unwrap_or_default();
            // Each destination's datagrams, in their order, a batch at a time; destinations
            // in order of first appearance (the lists are short: O(n·destinations)).
            for (i, t) in tx.iter().enumerate() {
                if tx[..i].iter().any(|u| u.dst == t.dst) {
                    continue;
                }
                // A group is gathered on the stack: a `Vec` each was an allocation per
                // destination and batch (five a connection of a burst through a daemon).
                let mut same = tx[i..].iter().filter(|u| u.dst == t.dst);
                let mut group = [t; crate::sys::MAX_SEGMENTS];
                loop {
                    let mut n = 0;
                    for (slot, u) in group.iter_mut().zip(same.by_ref()) {
                        *slot = u;
                        n += 1;
                    }
                    if n == 0 {
                        break;
                    }
                    self.send_group(&sock, &mut buf, &mut batch, &group[..n]);
                }
            }
            let _ = TX_BATCH.try_with(|b| *b.borrow_mut() = batch);
        } else {
            for t in tx {
                self.send_one(&sock, &mut buf, t);
            }
        }
        let _ = TX_BUF.try_with(|b| *b.borrow_mut() = buf);
    }

    /// The IP header the ICRC of the `nth` datagram of a segmented send covers; `None` for a
    /// destination of the other address family.
    fn ip_for_icrc(&self, dst: IpAddr, nth: usize) -> Option<IpForIcrc> {
        match (self.ip, dst) {
            // An unconnected socket with DF sends ID 0; the kernel numbers the datagrams a
            // segmented send is cut into from there, one by one (`inet_gso_segment`), and
            // the ICRC covers the ID.
            (IpAddr::V4(s), IpAddr::V4(d)) => Some(IpForIcrc::V4 {
                src: s,
                dst: d,
                ident: nth as u16,
                dont_fragment: true,
            }),
            (IpAddr::V6(s), IpAddr::V6(d)) => Some(IpForIcrc::V6 { src: s, dst: d }),
            _ => None,
        }
    }

    fn send_one(&self, sock: &UdpSocket, buf: &mut Vec<u8>, t: &Transmit) {
        let Some(ip) = self.ip_for_icrc(t.dst, 0) else {
            return;
        };
        let psn = self.psn.fetch_add(1, Ordering::Relaxed) & 0xFF_FFFF;
        let payload = roce::emit_gsi_into(buf, &ip, self.port, psn, &t.mad);
        self.stats.trace.sending();
        match sock.send_to(payload, SocketAddr::new(t.dst, self.port)) {
            Ok(_) => self.stats.tx.fetch_add(1, Ordering::Relaxed),
            Err(_) => self.stats.tx_errors.fetch_add(1, Ordering::Relaxed),
        };
    }

    /// Sends datagrams to one destination in one system call (every GSI datagram has the
    /// same size, which is what a segmented send needs); one at a time when there is one, or
    /// when the kernel refuses segmented sends on this route (then never again here).
    fn send_group(
        &self,
        sock: &UdpSocket,
        buf: &mut Vec<u8>,
        batch: &mut Vec<u8>,
        group: &[&Transmit],
    ) {
        let Some(&first) = group.first() else { return };
        if group.len() == 1 || !self.gso.load(Ordering::Relaxed) {
            for t in group {
                self.send_one(sock, buf, t);
            }
            return;
        }
        batch.clear();
        for (nth, t) in group.iter().enumerate() {
            let Some(ip) = self.ip_for_icrc(t.dst, nth) else {
                return;
            };
            let psn = self.psn.fetch_add(1, Ordering::Relaxed) & 0xFF_FFFF;
            batch.extend_from_slice(roce::emit_gsi_into(buf, &ip, self.port, psn, &t.mad));
        }
        let seg = roce::GSI_UDP_PAYLOAD_LEN as u16;
        let dst = SocketAddr::new(first.dst, self.port);
        self.stats.trace.sending();
        match crate::sys::send_segments(sock, dst, batch, seg) {
            Ok(_) => {
                self.stats
                    .tx
                    .fetch_add(group.len() as u64, Ordering::Relaxed);
                self.stats.tx_segmented.fetch_add(1, Ordering::Relaxed);
            }
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EIO | libc::EINVAL | libc::ENOPROTOOPT | libc::EOPNOTSUPP)
                ) =>
            {
                // Nothing was sent: a route whose device cannot checksum segments, or a
                // kernel without them.
                self.gso.store(false, Ordering::Relaxed);
                for t in group {
                    self.send_one(sock, buf, t);
                }
            }
            Err(_) => {
                self.stats
                    .tx_errors
                    .fetch_add(group.len() as u64, Ordering::Relaxed);
            }
        }
    }

    /// Wakes the I/O thread when a command armed a timer earlier than the one it sleeps to.
    fn maybe_wake(&self, next: Option<Instant>) {
        let Some(next) = next else { return };
        let sleeping_until = *sync::lock(&self.wake_at);
        if sleeping_until.is_none_or(|w| next < w) {
            self.wake_io_thread();
        }
    }

    /// Ends the I/O thread's sleep, whichever it is: in poll(2) on the socket and its
    /// eventfd, or in `park`, where it stands aside for a waiter's poll (without the unpark
    /// a timer would wait for the end of the poll, as long as the channel's spin). An unpark
    /// that finds it awake only makes its next park return at once. Not a datagram to its
    /// own socket, as before: a waiter polling the socket could take it first, and the
    /// thread then slept on to its old deadline (up to 500 ms) past the new timer. A raw
    /// (ICRC-verifying) device's thread is still woken so: no waiter polls it.
    fn wake_io_thread(&self) {
        match &self.wake {
            Some(w) => {
                let _ = rustix::io::write(&**w, &1u64.to_ne_bytes());
            }
            None => {
                if let Some(sock) = self.socket() {
                    let _ = sock.send_to(&[0], SocketAddr::new(self.ip, self.port));
                }
            }
        }
        if let Some(h) = sync::lock(&self.thread).as_ref() {
            h.thread().unpark();
        }
    }

    fn route(self: &Arc<Self>, events: impl Iterator<Item = (CepHandle, CmEvent)>) {
        for (h, ev) in events {
            match ev {
                CmEvent::ReqReceived {
                    listener,
                    cep,
                    info,
                } => {
                    crate::id::on_connect_request(
                        self,
                        listener,
                        cep,
                        crate::id::Incoming::Rc(info),
                    );
                }
                CmEvent::SidrReqReceived {
                    listener,
                    cep,
                    service_id,
                    private_data,
                    ..
                } => {
                    crate::id::on_connect_request(
                        self,
                        listener,
                        cep,
                        crate::id::Incoming::Ud {
                            service_id,
                            private_data,
                        },
                    );
                }
                ev => {
                    let id = sync::lock(&self.ceps).get(&h).and_then(Weak::upgrade);
                    if let Some(id) = id {
                        crate::id::on_engine_event(&id, self, h, ev);
                    }
                }
            }
        }
    }

    /// Feeds a batch of received datagrams to the engine under one lock; then queues the UD
    /// SENDs among them to their ids (outside the engine lock).
    fn handle_batch<'a>(
        self: &Arc<Self>,
        n: usize,
        batch: impl Iterator<Item = (SocketAddr, &'a [u8])>,
    ) {
        let (mut bad, mut bad_icrc) = (0, 0);
        let mut ud = Vec::new();
        self.with_engine(|ep, now| {
            for (from, buf) in batch {
                // A long batch shows itself to the pollers on this CPU as it goes: one that
                // the scheduler hands the CPU back to in its middle must not take the wait
                // for a stolen yield (see `crate::spin`).
                crate::spin::look_here();
                // A UDP socket cannot see the IPv4 ID the ICRC covers: IPv4's is checked
                // only with `verify_icrc` (a raw socket). IPv6's is checked here, as rxe
                // checks it: rxe sends IPv6 with a zero UDP checksum, which the socket takes
                // (UDP_NO_CHECK6_RX), so the ICRC is the only check a datagram gets.
                if let (IpAddr::V6(src), IpAddr::V6(dst)) = (from.ip(), self.ip) {
                    match roce::verify_icrc_v6(src, from.port(), dst, buf) {
                        Ok(()) => {}
                        Err(rcm_wire::WireError::BadCrc { .. }) => {
                            bad_icrc += 1;
                            continue;
                        }
                        // Too short to be RoCEv2: malformed.
                        Err(_) => {
                            bad += 1;
                            continue;
                        }
                    }
                }
                match classify(buf) {
                    Rx::Gsi(g) => ep.handle_datagram(now, from.ip(), g.mad),
                    Rx::Ud(d) => ud.push((from.ip(), d)),
                    Rx::Bad => bad += 1,
                }
            }
        });
        self.stats.rx.fetch_add(n as u64, Ordering::Relaxed);
        self.stats.rx_bad.fetch_add(bad, Ordering::Relaxed);
        if bad_icrc > 0 {
            self.stats
                .rx_bad_icrc
                .fetch_add(bad_icrc, Ordering::Relaxed);
        }
        for (src, d) in ud {
            self.deliver_ud(src, d);
        }
    }

    /// Handles what a receive batch brought (see `handle_batch`), counting the coalesced
    /// receives among it.
    fn handle_rx(self: &Arc<Self>, batch: &RxBatch) {
        self.stats.trace.received(batch.at);
        let coalesced = batch.coalesced();
        if coalesced > 0 {
            self.stats
                .rx_coalesced
                .fetch_add(coalesced, Ordering::Relaxed);
        }
        self.handle_batch(batch.count(), batch.datagrams());
    }

    /// Queues one UD SEND to the id receiving on its destination QPN, or counts why not.
    fn deliver_ud(&self, src: IpAddr, d: UdDatagram) {
        let id = sync::lock(&self.ud_qps)
            .get(&d.dest_qp)
            .and_then(Weak::upgrade);
        match id {
            Some(id) => crate::id::deliver_ud(&id, src, d, &self.stats),
            None => {
                self.stats.ud_no_qp.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Sends one RoCEv2 UD SEND Only (with immediate data when `imm` is set: opcode 0x65,
    /// ImmDt after the DETH) to `dst`'s device port, its ICRC computed for the IPv4 header a
    /// Linux unconnected `IP_PMTUDISC_DO` socket sends (ID 0, DF).
    pub(crate) fn send_ud(
        &self,
        dst: IpAddr,
        bth: &Bth,
        deth: &Deth,
        imm: Option<u32>,
        payload: &[u8],
    ) -> crate::Result<()> {
        let sock = self.socket().ok_or(crate::Error::DeviceRemoved)?;
        let ip = match (self.ip, dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => IpForIcrc::v4(s, d),
            (IpAddr::V6(s), IpAddr::V6(d)) => IpForIcrc::V6 { src: s, dst: d },
            _ => return Err(crate::Error::AddrNotAvailable(dst)),
        };
        let pkt = match imm {
            Some(i) => {
                let body = [i.to_be_bytes().as_slice(), payload].concat();
                roce::emit_ud(&ip, self.port, bth, deth, &body)
            }
            None => roce::emit_ud(&ip, self.port, bth, deth, payload),
        };
        match sock.send_to(&pkt, SocketAddr::new(dst, self.port)) {
            Ok(_) => {
                self.stats.tx.fetch_add(1, Ordering::Relaxed);
                self.stats.ud_sent.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                self.stats.tx_errors.fetch_add(1, Ordering::Relaxed);
                Err(e.into())
            }
        }
    }

    /// Stops the I/O thread (after removal completed, or at fabric shutdown).
    pub(crate) fn shutdown(&self) {
        if let Some(iw) = &self.iw {
            iw.shutdown();
            return;
        }
        self.stop.store(true, Ordering::SeqCst);
        self.wake_io_thread();
        let h = sync::lock(&self.thread).take();
        if let Some(h) = h {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
        // The I/O thread held the other reference: the socket closes here.
        sync::lock(&self.sock).take();
    }

    /// See `Endpoint::sweep_timers`.
    pub(crate) fn sweep_timers(&self) {
        sync::lock(&self.engine).sweep_timers();
    }

    /// Connection endpoints by state (see `Endpoint::cep_states`).
    pub(crate) fn cep_states(&self) -> std::collections::BTreeMap<String, usize> {
        sync::lock(&self.engine).cep_states()
    }

    /// Bytes this device's per-connection tables have room for: its engine's and its own
    /// endpoint-to-id table (see `Fabric::table_bytes`).
    pub(crate) fn table_bytes(&self) -> usize {
        let ceps = rcm_proto::room::map_bytes(&sync::lock(&self.ceps));
        let iw = self.iw.as_ref().map_or(0, crate::iwarp::IwDev::table_bytes);
        ceps + iw + sync::lock(&self.engine).table_bytes()
    }

    /// The engine's counters and table sizes (for tests).
    pub(crate) fn engine_stats(
        &self,
    ) -> (
        rcm_proto::ib::Stats,
        usize,
        (usize, usize, usize, usize, usize),
    ) {
        let ep = sync::lock(&self.engine);
        let ceps = match &self.iw {
            Some(iw) => iw.conn_count(),
            None => ep.cep_count(),
        };
        (ep.stats().clone(), ceps, ep.table_sizes())
    }
}

/// Fires the engine's due timers and returns how long a receive loop may sleep: until the
/// next deadline (time is the engine's to keep), at least 100 µs and at most 500 ms.
fn run_timers(d: &Arc<DeviceInner>) -> Duration {
    // When this thread will look again is published under the engine lock: a call that
    // arms an earlier timer either comes before (and `poll_timeout` sees it) or after, and
    // then compares its deadline with this one in `maybe_wake`. Published later, a call in
    // between compared with the previous, past, deadline, sent no wake-up, and its timer
    // waited up to 500 ms.
    let at = d.with_engine(|ep, now| {
        ep.handle_timeout(now);
        let next = ep.poll_timeout();
        let wait = next
            .map_or(Duration::from_millis(500), |t| {
                t.saturating_duration_since(now)
            })
            .clamp(Duration::from_micros(100), Duration::from_millis(500));
        let until = now + wait;
        // A deadline within the shortest sleep is recorded as is, so that this thread's own
        // `maybe_wake` (in `with_engine`) finds nothing earlier and sends itself nothing.
        *sync::lock(&d.wake_at) = Some(next.map_or(until, |t| t.min(until)));
        until
    });
    // The due transmits and events were handled after the deadline was taken: sleep only
    // for what is left of it.
    at.saturating_duration_since(Instant::now())
        .max(Duration::from_micros(100))
}

/// One datagram into `buf` if one is queued: its sender and length (never waits; the socket
/// itself stays blocking, so the other threads' sends on it are never refused for a full
/// buffer).
fn recv_nowait(sock: &UdpSocket, buf: &mut [u8]) -> Option<(SocketAddr, usize)> {
    match rustix::net::recvfrom(sock, &mut *buf, rustix::net::RecvFlags::DONTWAIT) {
        Ok((n, _, Some(from))) => Some((SocketAddr::try_from(from).ok()?, n.min(buf.len()))),
        _ => None,
    }
}

/// Waits up to `d` for `sock` to become readable.
pub(crate) fn wait_readable(sock: &impl std::os::fd::AsFd, d: Duration) {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let mut fds = [PollFd::new(sock, PollFlags::IN)];
    let t = Timespec::try_from(d).ok();
    let _ = poll(&mut fds, t.as_ref());
}

/// Sleeps until `sock` is readable, `wake` is written to (then drained) or `d` has passed.
fn wait_readable_or_woken(sock: &UdpSocket, wake: &std::os::fd::OwnedFd, d: Duration) {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let mut fds = [
        PollFd::new(sock, PollFlags::IN),
        PollFd::new(wake, PollFlags::IN),
    ];
    let t = Timespec::try_from(d).ok();
    let _ = poll(&mut fds, t.as_ref());
    if !fds[1].revents().is_empty() {
        let mut n = [0u8; 8];
        let _ = rustix::io::read(wake, &mut n);
    }
}

/// Received datagrams, in one buffer kept from batch to batch: the receive loop allocates
/// nothing per datagram (a fresh buffer per datagram was the first allocation of every
/// packet, and what the connect burst's leftovers in the heap were made of). With `UDP_GRO`
/// one receive may bring several datagrams of one sender, cut here by their size.
struct RxBatch {
    /// Allocated zeroed, so pages no receive reached cost no memory.
    area: Box<[u8]>,
    /// Sender, start in `area`, length, and the size of the datagrams it holds.
    got: Vec<(SocketAddr, usize, usize, usize)>,
    used: usize,
    /// The socket is busy: a fill takes all that is queued, [`crate::sys::RECV_MANY`] a
    /// call. Otherwise a fill takes one datagram with a receive call of one (see `fill`).
    many: bool,
    /// The last fill found something.
    took_last: bool,
    /// When the first receive of the batch brought datagrams (`rcm::trace`, when on).
    at: u64,
}

/// The receive area of a device. A receive needs room for the largest coalesced run
/// ([`RX_MAX`]); a batch ends when less is left, after at least 192 KiB (about 700 GSI
/// datagrams).
const RX_AREA: usize = 256 << 10;
/// The most one receive can bring (a UDP datagram, or a coalesced run, is at most 64 KiB).
const RX_MAX: usize = 1 << 16;

impl RxBatch {
    fn new() -> Self {
        RxBatch {
            area: vec![0u8; RX_AREA].into_boxed_slice(),
            got: Vec::with_capacity(BATCH),
            used: 0,
            many: false,
            took_last: false,
            at: 0,
        }
    }

    fn is_empty(&self) -> bool {
        self.got.is_empty()
    }

    fn clear(&mut self) {
        self.got.clear();
        self.used = 0;
        self.at = 0;
    }

    /// Takes what `sock` has queued, without waiting, until the batch is full. Each system
    /// call may bring [`crate::sys::RECV_MANY`] datagrams: the first into the free part of
    /// the area, the others into the area's end (the datagrams are moved down from there);
    /// a call that brings fewer found the socket empty, and ends the filling.
    ///
    /// On a quiet socket (the last fill, or the one before, found nothing) a fill takes one
    /// datagram with a receive call of one: one at a time, the datagram that answers a
    /// polling thread is usually alone, and the receive of two then spends its second try
    /// finding the socket empty (a ping-pong on the 2-core VM: 8.37 µs a round trip with
    /// `recvmmsg` of two, 8.05 of one). Two fills in a row that found something make the
    /// socket busy until a fill finds it empty. Serial connects, `--pin`, 10 interleaved
    /// rounds: p50 10.5-12.9 µs (median 10.85) against 10.9-12.8 (11.1); unpinned
    /// 16.7-17.0 against 17.3-17.8 (3 rounds); bursts within noise.
    ///
    /// The quiet fill's call is `recvfrom` (`sys::recv_one`), not a `recvmmsg` of one: its
    /// empty look costs a third less, and a polling thread makes many. It cannot tell a
    /// coalesced run, which is then cut as `sys::gsi_run_stride` guesses. Serial connects,
    /// `--pin`, 11 interleaved rounds: p50 10.45–12.83 µs against 10.86–13.27, lower in 10.
    fn fill(&mut self, sock: &UdpSocket) {
        use crate::sys::RECV_MANY;
        let spare = (RECV_MANY - 1) * RX_MAX;
        while self.got.len() + RECV_MANY <= BATCH {
            let first_end = self.area.len() - spare;
            if first_end < self.used + RX_MAX {
                return;
            }
            let (head, tail) = self.area.split_at_mut(first_end);
            let Some(first) = head.get_mut(self.used..) else {
                return;
            };
            let mut first = Some(first);
            let mut rest = tail.chunks_mut(RX_MAX);
            let bufs: [&mut [u8]; RECV_MANY] =
                std::array::from_fn(|_| first.take().or_else(|| rest.next()).unwrap_or_default());
            let mut out = [None; RECV_MANY];
            let n = if self.many {
                crate::sys::recv_many(sock, bufs, &mut out, RECV_MANY)
            } else {
                let [first, ..] = bufs;
                crate::sys::recv_one(sock, first, &mut out[0])
            };
            for (i, r) in out.iter().enumerate().take(n) {
                let Some((from, len, stride)) = *r else {
                    continue;
                };
                if i > 0 {
                    let at = first_end + (i - 1) * RX_MAX;
                    self.area.copy_within(at..at + len, self.used);
                }
                self.got.push((from, self.used, len, stride.max(1)));
                // The next datagram starts on a fresh cache line.
                self.used += len.next_multiple_of(64);
            }
            if n == 0 {
                self.many = false;
                self.took_last = false;
                return;
            }
            if self.at == 0 && crate::trace::on() {
                self.at = crate::trace::now();
            }
            if !self.many {
                // Something the fill before took too: the socket is busy, take more a call.
                self.many = self.took_last;
                self.took_last = true;
                return;
            }
            if n < RECV_MANY {
                return;
            }
        }
    }

    /// Receives that brought more than one datagram.
    fn coalesced(&self) -> u64 {
        self.got
            .iter()
            .filter(|&&(_, _, n, stride)| n > stride)
            .count() as u64
    }

    /// How many datagrams [`RxBatch::datagrams`] gives.
    fn count(&self) -> usize {
        self.got
            .iter()
            .map(|&(_, _, n, stride)| n.div_ceil(stride).max(1))
            .sum()
    }

    fn datagrams(&self) -> impl Iterator<Item = (SocketAddr, &[u8])> {
        self.got.iter().flat_map(move |&(from, at, n, stride)| {
            let d = self.area.get(at..at + n).unwrap_or_default();
            // An empty datagram is one too (garbage, counted as such).
            d.chunks(stride)
                .chain(d.is_empty().then_some(d))
                .map(move |d| (from, d))
        })
    }
}

fn io_loop(
    dev: &Weak<DeviceInner>,
    sock: &UdpSocket,
    wake: &std::os::fd::OwnedFd,
    gate: &RxGate,
    spin: Duration,
    mut batch: RxBatch,
) {
    let mut nap = Duration::ZERO;
    loop {
        let Some(d) = dev.upgrade() else { return };
        if d.stop.load(Ordering::SeqCst) {
            return;
        }
        let wait = run_timers(&d);
        drop(d);
        // A thread waiting for its answer polls the socket (see `rxgate`): stand aside until
        // its poll's deadline, keeping to the timers.
        let aside = gate.polled_left();
        if !aside.is_zero() {
            nap = crate::rxgate::next_nap(nap, aside);
            std::thread::park_timeout(nap.min(wait));
            continue;
        }
        nap = Duration::ZERO;
        // Take what is queued, up to a batch, and feed it to the engine under one lock.
        let mut turn = take_batch(gate, &mut batch, sock);
        if turn.is_none() {
            // Poll a while (`FabricConfig::spin`), then sleep in poll(2) up to the next timer.
            let until = Instant::now() + wait;
            let polled = crate::spin::spin_until(spin.min(wait), || {
                if !gate.polled_left().is_zero() {
                    return true;
                }
                turn = take_batch(gate, &mut batch, sock);
                turn.is_some()
            });
            if !polled {
                let left = until.saturating_duration_since(Instant::now());
                // Woken by a datagram a waiter that began polling meanwhile is there for.
                if !left.is_zero() {
                    if let Some(d) = dev.upgrade() {
                        d.stats.sleeps.fetch_add(1, Ordering::Relaxed);
                    }
                    wait_readable_or_woken(sock, wake, left);
                    if gate.polled_left().is_zero() {
                        turn = take_batch(gate, &mut batch, sock);
                    }
                }
            }
        }
        if turn.is_none() {
            continue;
        }
        if !feed(dev, batch.count(), |d| {
            d.handle_rx(&batch);
        }) {
            return;
        }
        batch.clear();
    }
}

/// Receives into `batch` if this thread gets the turn and something is queued; the turn is
/// then kept until the batch has been handed to the engine.
fn take_batch<'g>(gate: &'g RxGate, batch: &mut RxBatch, sock: &UdpSocket) -> Option<RxTurn<'g>> {
    let turn = gate.enter()?;
    batch.fill(sock);
    (!batch.is_empty()).then_some(turn)
}

std::thread_local! {
    /// What this (non-rcm) thread last called into: the receive side (a device's, a
    /// provider's) its answer most likely comes from when it then waits for an event.
    static BUSY_POLL_HINT: std::cell::RefCell<Option<Weak<dyn BusyPoll>>> =
        const { std::cell::RefCell::new(None) };
    /// The receive area of a waiter polling a device (allocated on its first poll; the
    /// pages no receive reached cost no memory).
    static POLL_BATCH: std::cell::RefCell<Option<RxBatch>> =
        const { std::cell::RefCell::new(None) };
}

pub(crate) fn set_busy_poll_hint(p: &Arc<DevicePoll>) {
    let _ = BUSY_POLL_HINT.try_with(|h| {
        if let Ok(mut h) = h.try_borrow_mut() {
            let same = h
                .as_ref()
                .is_some_and(|w| std::ptr::addr_eq(w.as_ptr(), Arc::as_ptr(p)));
            if !same {
                *h = Some(Arc::downgrade(p) as Weak<dyn BusyPoll>);
                crate::slot::hint_moved(Arc::as_ptr(p).cast());
            }
        }
    });
}

/// A provider's id was called on this thread: what its waiter polls is the provider's
/// (none if it offers none).
pub(crate) fn set_remote_poll_hint(r: &dyn crate::remote::RemoteId) {
    if crate::fabric::own_thread() {
        return;
    }
    let _ = BUSY_POLL_HINT.try_with(|h| {
        if let Ok(mut h) = h.try_borrow_mut() {
            *h = r.busy_poll();
            let next = h
                .as_ref()
                .map_or(std::ptr::null(), |w| w.as_ptr().cast::<()>());
            crate::slot::hint_moved(next);
        }
    });
}

/// What a thread about to wait for an event polls meanwhile, if anything: the device or
/// provider it last called into, if that one is still there. Never for rcm's own threads,
/// nor inside a callback or with a [`crate::CallbacksHere`] open (events it received would
/// run callbacks in a place their owner did not choose).
pub(crate) fn busy_poll_hint() -> Option<Arc<dyn BusyPoll>> {
    if crate::fabric::own_thread()
        || crate::slot::in_callback()
        || crate::fabric::callbacks_here_open()
    {
        return None;
    }
    BUSY_POLL_HINT
        .try_with(|h| h.try_borrow().ok()?.as_ref()?.upgrade())
        .ok()
        .flatten()
}

/// A device's receive side as a waiting thread polls it (see `rxgate`).
pub(crate) struct DevicePoll(Weak<DeviceInner>);

impl BusyPoll for DevicePoll {
    fn begin(&self, spin: Duration) {
        if let Some(g) = self.0.upgrade().and_then(|d| d.gate.clone()) {
            g.polled_for(spin);
        }
    }

    fn poll(&self) -> bool {
        self.0.upgrade().is_some_and(|d| d.poll_once())
    }

    fn end(&self) {
        if let Some(g) = self.0.upgrade().and_then(|d| d.gate.clone()) {
            g.poll_ended();
        }
    }

    fn readiness(&self) -> Option<Arc<dyn std::os::fd::AsFd + Send + Sync>> {
        // The socket, while the device has it: kept only for the caller's poll(2), so a
        // removed device's port is not held.
        let s: Arc<dyn std::os::fd::AsFd + Send + Sync> = self.0.upgrade()?.socket()?;
        Some(s)
    }

    fn kick(&self) {
        let Some(d) = self.0.upgrade() else { return };
        if d.gate.as_ref().is_some_and(|g| g.polled_left().is_zero()) {
            // It may be parked standing aside: back to its socket now.
            d.unpark_io();
        }
    }
}

impl DeviceInner {
    /// What a thread polling this device on its behalf uses (see `Device::busy_poller`).
    pub(crate) fn poller(&self) -> Option<Arc<DevicePoll>> {
        self.poller.clone()
    }

    /// Receives what the socket holds and hands it to the engine, as the I/O thread does,
    /// unless another thread has the turn. What it makes the engine send goes out at once,
    /// or is held if this thread holds a `SendBatch` (its waiter sends it when it goes on
    /// waiting, after taking the event the poll brought if one came); callbacks of
    /// its events run where the fabric's mode puts events from elsewhere (the callback
    /// threads), never on this thread.
    fn poll_once(self: &Arc<Self>) -> bool {
        if self.is_iwarp() {
            return self.iw_poll_once();
        }
        let Some(gate) = &self.gate else { return false };
        if self.stop.load(Ordering::Relaxed) {
            return false;
        }
        let Some(sock) = self.socket() else {
            return false;
        };
        POLL_BATCH
            .try_with(|b| {
                // Taken by a poll further up this thread's stack: nothing to do twice.
                let Ok(mut b) = b.try_borrow_mut() else {
                    return false;
                };
                let batch = b.get_or_insert_with(RxBatch::new);
                let Some(turn) = take_batch(gate, batch, &sock) else {
                    return false;
                };
                self.handle_rx(batch);
                self.stats
                    .rx_polled
                    .fetch_add(batch.count() as u64, Ordering::Relaxed);
                batch.clear();
                drop(turn);
                true
            })
            .unwrap_or(false)
    }
}

/// Hands a received batch to the device's engine; false once the device is gone or
/// stopping (the receive loop then ends).
fn feed(dev: &Weak<DeviceInner>, n: usize, handle: impl FnOnce(&Arc<DeviceInner>)) -> bool {
    if n == 0 {
        return true;
    }
    let Some(d) = dev.upgrade() else { return false };
    if d.stop.load(Ordering::SeqCst) {
        return false;
    }
    // `CallbackMode::Inline`: the batch's callbacks run here when `_here` drops, and what
    // they and the engine send goes out together when `_b` drops, after them. A receive of
    // one datagram has nothing to join its answer: held, a one-at-a-time connect's REP
    // waited for its callback's return (0.3 µs of a pinned serial connect, probe
    // timestamps on the Intel host), so it leaves from within the call that made it.
    let _b = (d.inline_callbacks && n > 1).then(crate::SendBatch::begin);
    let _here = d.inline_callbacks.then(crate::CallbacksHere::begin);
    handle(&d);
    true
}

/// A raw IPv4 socket that receives every UDP datagram to `ip` with its IP header, so that
/// the ICRC, which covers the IPv4 Identification, TTL-masked header and all, can be checked
/// (a UDP socket never shows the header). Needs CAP_NET_RAW.
fn raw_receiver(ip: IpAddr) -> crate::Result<socket2::Socket> {
    if !ip.is_ipv4() {
        return Err(crate::Error::InvalidArgument(
            "ICRC verification needs an IPv4 device (a raw IPv6 socket gives no IP header)".into(),
        ));
    }
    let s = socket2::Socket::new(
        socket2::Domain::IPV4,
        socket2::Type::RAW,
        Some(socket2::Protocol::UDP),
    )
    .map_err(|e| crate::Error::Io(format!("ICRC verification needs a raw socket: {e}")))?;
    s.bind(&SocketAddr::new(ip, 0).into())?;
    let _ = s.set_recv_buffer_size(16 << 20);
    Ok(s)
}

/// Splits a raw IPv4 packet into (IP header, UDP datagram) when it is a UDP datagram for
/// `ip:port`; `None` otherwise. Never panics.
fn udp_for(pkt: &[u8], ip: IpAddr, port: u16) -> Option<(&[u8], &[u8], SocketAddr)> {
    let first = *pkt.first()?;
    let ihl = usize::from(first & 0x0F) * 4;
    if first >> 4 != 4 || ihl < 20 || *pkt.get(9)? != 17 {
        return None;
    }
    let dst = IpAddr::from([*pkt.get(16)?, *pkt.get(17)?, *pkt.get(18)?, *pkt.get(19)?]);
    if dst != ip {
        return None;
    }
    let src = IpAddr::from([pkt[12], pkt[13], pkt[14], pkt[15]]);
    let total = usize::from(u16::from_be_bytes([*pkt.get(2)?, *pkt.get(3)?])).min(pkt.len());
    let udp = pkt.get(ihl..total)?;
    let sport = u16::from_be_bytes([*udp.first()?, *udp.get(1)?]);
    let dport = u16::from_be_bytes([*udp.get(2)?, *udp.get(3)?]);
    if dport != port || udp.len() < 8 {
        return None;
    }
    Some((pkt.get(..ihl)?, udp, SocketAddr::new(src, sport)))
}

/// The receive loop with ICRC verification: datagrams come from the raw socket with their IP
/// header; those whose ICRC is wrong are counted and dropped, the rest go to the engine as
/// from the UDP socket. The UDP socket still owns the port (and sends); what it receives is
/// the same traffic again and is discarded.
fn raw_io_loop(dev: &Weak<DeviceInner>, sock: &UdpSocket, raw: &socket2::Socket) {
    use std::io::Read;
    // Room for a whole IP packet: a segmented run from this host arrives here uncut (up to
    // 64 KiB), and a datagram-sized buffer would truncate it and lose the whole run.
    let mut buf = vec![0u8; 1 << 16];
    let mut sink = vec![0u8; RX_BUF];
    loop {
        let Some(d) = dev.upgrade() else { return };
        if d.stop.load(Ordering::SeqCst) {
            return;
        }
        let _ = raw.set_read_timeout(Some(run_timers(&d)));
        let (ip, port) = (d.ip, d.port);
        drop(d);
        let mut batch: Vec<(SocketAddr, Vec<u8>)> = Vec::with_capacity(BATCH);
        let mut reader = raw;
        // The first read waits (up to the next deadline); then the socket goes non-blocking
        // (once, not per packet) and what is queued is taken, up to a bound that also counts
        // the raw socket's other UDP traffic to this address, so timers are never starved.
        let mut reads = 0;
        while batch.len() < BATCH && reads < 4 * BATCH {
            let Ok(n) = reader.read(&mut buf) else { break };
            if reads == 0 {
                let _ = raw.set_nonblocking(true);
            }
            reads += 1;
            let Some((hdr, udp, from)) = buf.get(..n).and_then(|p| udp_for(p, ip, port)) else {
                continue;
            };
            let Some(d) = dev.upgrade() else { return };
            if from == SocketAddr::new(ip, port) && udp.len() == 8 + 1 {
                // The device's own one-byte wake-up datagram (see `maybe_wake`), not traffic;
                // a connection to a listener on this same device sends the rest from here too.
            } else if udp.len() < 8 + roce::BTH_LEN + roce::ICRC_LEN {
                d.stats.rx.fetch_add(1, Ordering::Relaxed);
                d.stats.rx_bad.fetch_add(1, Ordering::Relaxed);
            } else if verify(hdr, udp, port).is_ok() {
                if let Some(payload) = udp.get(8..) {
                    batch.push((from, payload.to_vec()));
                }
            } else if let Some(run) = cut_run(hdr, udp, port) {
                d.stats.rx_coalesced.fetch_add(1, Ordering::Relaxed);
                batch.extend(run.into_iter().map(|p| (from, p)));
            } else {
                d.stats.rx.fetch_add(1, Ordering::Relaxed);
                d.stats.rx_bad_icrc.fetch_add(1, Ordering::Relaxed);
            }
        }
        if reads > 0 {
            let _ = raw.set_nonblocking(false);
        }
        // The UDP socket's copies of the same datagrams.
        while recv_nowait(sock, &mut sink).is_some() {}
        if !feed(dev, batch.len(), |d| {
            d.handle_batch(batch.len(), batch.iter().map(|(a, d)| (*a, d.as_slice())));
        }) {
            return;
        }
    }
}

/// A run of GSI datagrams sent in one segmented send from this host: on loopback the raw
/// socket sees it whole (the kernel cuts it only for the UDP socket). Its pieces, each
/// verified against the header the kernel gives it (IPv4 ID counted on from the run's,
/// lengths its own), or `None` (then it is one datagram with a bad ICRC).
fn cut_run(hdr: &[u8], udp: &[u8], port: u16) -> Option<Vec<Vec<u8>>> {
    let run = roce::split_gsi_run(hdr, udp.get(..8)?, udp.get(8..)?).ok()?;
    let mut u = Vec::with_capacity(8 + roce::GSI_UDP_PAYLOAD_LEN);
    run.into_iter()
        .map(|(h, uh, piece)| {
            u.clear();
            u.extend_from_slice(&uh);
            u.extend_from_slice(piece);
            verify(&h, &u, port).ok()?;
            Some(piece.to_vec())
        })
        .collect()
}

/// Checks a datagram's ICRC against its real IP and UDP headers. The device's UDP port plays
/// the role of 4791 (a test fabric on another port computes its ICRCs as if on 4791, as it
/// sends them), so it is read as 4791 here.
fn verify(hdr: &[u8], udp: &[u8], port: u16) -> rcm_wire::Result<()> {
    if port == roce::ROCE_V2_UDP_PORT {
        return roce::verify_icrc(hdr, udp);
    }
    let mut u = udp.to_vec();
    if let Some(p) = u.get_mut(2..4) {
        p.copy_from_slice(&roce::ROCE_V2_UDP_PORT.to_be_bytes());
    }
    roce::verify_icrc(hdr, &u)
}

/// Datagrams a [`crate::SendBatch`] of this thread holds, by device.
#[derive(Default)]
struct Held {
    depth: u32,
    count: usize,
    by_dev: Vec<(Arc<DeviceInner>, Vec<Transmit>)>,
    /// Emptied lists of earlier flushes, kept for their capacity (a few: one per device a
    /// batch reached).
    spare: Vec<Vec<Transmit>>,
}

/// Keeps `tx` (emptied) for the thread's send batch if one is open; false if none is.
fn hold(dev: &Arc<DeviceInner>, tx: &mut Vec<Transmit>) -> bool {
    if tx.is_empty() {
        return false;
    }
    let full = HELD.try_with(|h| {
        let mut h = h.borrow_mut();
        if h.depth == 0 {
            return None;
        }
        h.count += tx.len();
        if let Some((_, l)) = h.by_dev.iter_mut().find(|(d, _)| Arc::ptr_eq(d, dev)) {
            l.append(tx);
        } else {
            // A list kept from an earlier flush: `tx` keeps its capacity for the thread's
            // next engine call.
            let mut l = h.spare.pop().unwrap_or_default();
            l.append(tx);
            h.by_dev.push((dev.clone(), l));
        }
        Some(h.count >= crate::sys::MAX_SEGMENTS)
    });
    match full {
        Ok(Some(full)) => {
            if full {
                flush_held();
            }
            true
        }
        _ => false,
    }
}

/// Opens a send batch on this thread (they nest).
pub(crate) fn hold_begin() {
    let _ = HELD.try_with(|h| h.borrow_mut().depth += 1);
}

/// Closes a send batch; the outermost sends what was held.
pub(crate) fn hold_end() {
    let last = HELD.try_with(|h| {
        let mut h = h.borrow_mut();
        h.depth = h.depth.saturating_sub(1);
        h.depth == 0
    });
    if last == Ok(true) {
        flush_held();
    }
}

/// Whether this thread holds datagrams.
pub(crate) fn holding() -> bool {
    HELD.try_with(|h| h.borrow().count > 0).unwrap_or(false)
}

/// Sends the datagrams this thread's send batch holds. Called before the thread waits in
/// rcm, so a batch never holds back what the wait is for.
pub(crate) fn flush_held() {
    let Ok(mut lists) = HELD.try_with(|h| {
        let mut h = h.borrow_mut();
        h.count = 0;
        std::mem::take(&mut h.by_dev)
    }) else {
        return;
    };
    // The devices are not kept past this (a removed one is freed); the lists are, emptied,
    // for their capacity.
    for (d, mut l) in lists.drain(..) {
        d.send_all(&l);
        drop(d);
        l.clear();
        // One that grew past a batch (a removal rejecting thousands at once) is let go.
        if l.capacity() > MAX_SPARE_CAPACITY {
            continue;
        }
        let _ = HELD.try_with(|h| {
            let mut h = h.borrow_mut();
            if h.spare.len() < MAX_SPARE_LISTS {
                h.spare.push(l);
            }
        });
    }
    let _ = HELD.try_with(|h| {
        let mut h = h.borrow_mut();
        if h.by_dev.capacity() < lists.capacity() && h.by_dev.is_empty() {
            h.by_dev = lists;
        }
    });
}

/// Emptied send lists a thread keeps (see `Held::spare`), and the most datagrams the
/// capacity of one may hold.
const MAX_SPARE_LISTS: usize = 4;
const MAX_SPARE_CAPACITY: usize = 4 * crate::sys::MAX_SEGMENTS;

/// The most entries a list a thread or the router keeps for reuse may have room for: one
/// engine call's output is usually a few datagrams or events, and a timer pass that
/// retransmitted 20,000 REQs would otherwise keep 5 MB on the thread that ran it.
const MAX_KEPT_LIST: usize = 256;

/// Keeps the emptied list `v` in a thread's slot `kept` for its capacity, if it has more
/// room than the one there, up to [`MAX_KEPT_LIST`].
fn keep_list(kept: &mut Vec<Transmit>, mut v: Vec<Transmit>) {
    if v.capacity() > MAX_KEPT_LIST {
        v.clear();
        v.shrink_to(MAX_KEPT_LIST);
    }
    if kept.capacity() < v.capacity() {
        *kept = v;
    }
}

/// The earlier of two deadlines, if any.
fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Datagrams handled under one engine lock.
const BATCH: usize = 64;

/// Rounds of datagrams to the device's own address that one engine call hands back to its
/// engine before the rest go through the socket (a CM exchange takes at most a few).
const LOOPBACK_ROUNDS: usize = 16;

std::thread_local! {
    /// What the thread's send batch holds (see [`crate::SendBatch`]).
    static HELD: std::cell::RefCell<Held> = std::cell::RefCell::new(Held::default());
    /// The thread's list of datagrams an engine call queued (see `with_engine`).
    static TX_LIST: std::cell::RefCell<Vec<Transmit>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The thread's list of datagrams an engine call sent to its own device (see
    /// `take_own`), kept for its capacity like `TX_LIST`.
    static LOCAL_LIST: std::cell::RefCell<Vec<Transmit>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The thread's buffer for building a datagram (one per packet was most of the
    /// allocations of a connection).
    static TX_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The thread's buffer for datagrams sent together (see `send_group`).
    static TX_BATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Receive buffer: more than a UD SEND of the largest IB MTU (4096) with BTH, DETH, ImmDt,
/// pad and ICRC; a longer datagram is truncated by the socket and then fails to parse.
const RX_BUF: usize = 8192;

/// A UD SEND Only (with or without immediate data) to a QP other than QP1.
pub(crate) struct UdDatagram {
    pub dest_qp: u32,
    pub qkey: u32,
    pub src_qp: u32,
    pub imm: Option<u32>,
    pub payload: Vec<u8>,
}

/// What a received datagram is.
enum Rx<'a> {
    Gsi(GsiDatagram<'a>),
    Ud(UdDatagram),
    Bad,
}

/// Sorts a datagram: a CM MAD for QP1, a UD SEND for a UD QP, or garbage. Never panics.
fn classify(buf: &[u8]) -> Rx<'_> {
    let Ok(p) = RocePacket::parse(buf) else {
        return Rx::Bad;
    };
    // The default partition (full or limited membership), as rxe's P_Key check, which
    // QP1's MADs pass too (`check_keys`): a MAD of another partition is not answered.
    if p.bth.pkey & 0x7FFF != 0x7FFF {
        return Rx::Bad;
    }
    if p.bth.dest_qp == roce::GSI_QPN {
        return GsiDatagram::from_packet(&p).map_or(Rx::Bad, Rx::Gsi);
    }
    let imm = match p.bth.opcode {
        Opcode::UD_SEND_ONLY => None,
        Opcode::UD_SEND_ONLY_IMM => match p.ext_headers.get(roce::DETH_LEN..roce::DETH_LEN + 4) {
            Some(&[a, b, c, d]) => Some(u32::from_be_bytes([a, b, c, d])),
            _ => return Rx::Bad,
        },
        _ => return Rx::Bad,
    };
    let (Some(deth), Some(payload)) = (p.deth, p.payload) else {
        return Rx::Bad;
    };
    Rx::Ud(UdDatagram {
        dest_qp: p.bth.dest_qp,
        qkey: deth.qkey,
        src_qp: deth.src_qp,
        imm,
        payload: payload.to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcm_proto::ib::EndpointConfig;

    fn device(ip: IpAddr, port: u16) -> Arc<DeviceInner> {
        let cfg = EndpointConfig::new(ip, 0x0200_00FF_FE00_0001, 1);
        DeviceInner::open(
            ip,
            port,
            Endpoint::new(cfg),
            false,
            Duration::ZERO,
            false,
            true,
        )
        .expect("device")
    }

    fn transmits(dst: IpAddr, n: u8) -> Vec<Transmit> {
        (0..n).map(|k| Transmit { dst, mad: [k; 256] }).collect()
    }

    /// Received datagrams of `sock` until it has been quiet for 200 ms.
    fn drain(sock: &UdpSocket) -> Vec<Vec<u8>> {
        sock.set_read_timeout(Some(Duration::from_millis(200)))
            .expect("timeout");
        let mut got = Vec::new();
        let mut buf = vec![0u8; 65536];
        while let Ok(n) = sock.recv(&mut buf) {
            got.push(buf[..n].to_vec());
        }
        got
    }

    /// The datagrams to the device's own address are taken for its engine, in order, and the
    /// others keep theirs; a device that is shut takes none (they go to its closed socket).
    #[test]
    fn own_address_datagrams_are_taken_in_order() {
        let me = IpAddr::from([127, 0, 0, 1]);
        let other = IpAddr::from([127, 0, 0, 5]);
        let dev = device(me, 28423);
        let list = || -> Vec<Transmit> {
            (0..7u8)
                .map(|k| Transmit {
                    dst: if k % 3 == 1 { me } else { other },
                    mad: [k; 256],
                })
                .collect()
        };
        let tags = |l: &[Transmit]| l.iter().map(|t| t.mad[0]).collect::<Vec<_>>();
        let (mut tx, mut local) = (list(), Vec::new());
        dev.take_own(&mut tx, &mut local);
        assert_eq!(tags(&local), [1, 4]);
        assert_eq!(tags(&tx), [0, 2, 3, 5, 6]);
        assert!(tx.iter().all(|t| t.dst == other));
        dev.shutdown();
        let (mut tx, mut local) = (list(), Vec::new());
        dev.take_own(&mut tx, &mut local);
        assert!(local.is_empty());
        assert_eq!(tx.len(), 7);
    }

    /// Datagrams to one peer leave in one segmented send and arrive one by one at a plain
    /// socket (the kernel cuts the run), each whole and in order.
    #[test]
    fn a_list_to_one_peer_is_one_segmented_send() {
        let dev = device(IpAddr::from([127, 0, 0, 1]), 28420);
        let peer = UdpSocket::bind("127.0.0.5:28420").expect("peer");
        dev.send_all(&transmits(IpAddr::from([127, 0, 0, 5]), 3));
        let got = drain(&peer);
        assert_eq!(got.len(), 3);
        for (k, d) in got.iter().enumerate() {
            assert_eq!(d.len(), roce::GSI_UDP_PAYLOAD_LEN);
            let g = GsiDatagram::parse(d).expect("a GSI datagram");
            assert_eq!(g.mad[0], k as u8, "in order");
        }
        assert_eq!(dev.stats.tx_segmented.load(Ordering::Relaxed), 1);
        assert_eq!(dev.stats.tx.load(Ordering::Relaxed), 3);
        dev.shutdown();
    }

    /// Where the kernel refuses a segmented send (here `SO_NO_CHECK`: `EINVAL`; a route
    /// without checksum offload gives `EIO`), nothing is lost: the datagrams go one by one,
    /// each with the ICRC for ID 0, and the device stops trying.
    #[test]
    fn a_refused_segmented_send_falls_back_to_one_by_one() {
        let dev = device(IpAddr::from([127, 0, 0, 1]), 28421);
        let sock = dev.socket().expect("socket");
        crate::sys::set_no_check(&sock).expect("SO_NO_CHECK");
        let peer = UdpSocket::bind("127.0.0.5:28421").expect("peer");
        dev.send_all(&transmits(IpAddr::from([127, 0, 0, 5]), 3));
        dev.send_all(&transmits(IpAddr::from([127, 0, 0, 5]), 2));
        let got = drain(&peer);
        assert_eq!(got.len(), 5);
        assert!(!dev.gso.load(Ordering::Relaxed), "segmented sends are off");
        assert_eq!(dev.stats.tx_segmented.load(Ordering::Relaxed), 0);
        assert_eq!(dev.stats.tx.load(Ordering::Relaxed), 5);
        assert_eq!(dev.stats.tx_errors.load(Ordering::Relaxed), 0);
        dev.shutdown();
    }

    /// Waits up to 5 s for `f` to hold.
    fn eventually(f: impl Fn() -> bool) -> bool {
        let until = Instant::now() + Duration::from_secs(5);
        while !f() {
            if Instant::now() > until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        true
    }

    /// While a waiter polls the device (its deadline not passed), the device's thread
    /// leaves the socket to it, even when woken by the datagram; the waiter's poll then
    /// receives and handles it.
    #[test]
    fn a_polled_device_leaves_its_datagrams_to_the_waiter() {
        let me = IpAddr::from([127, 0, 0, 1]);
        let dev = device(me, 28424);
        let gate = dev.gate.clone().expect("a UDP device has a gate");
        gate.polled_for(Duration::from_secs(60));
        // The thread finishes what it was doing, then stands aside.
        std::thread::sleep(Duration::from_millis(20));
        let peer = UdpSocket::bind("127.0.0.5:0").expect("peer");
        peer.send_to(b"not a MAD", SocketAddr::new(me, 28424))
            .expect("send");
        std::thread::sleep(Duration::from_millis(100));
        let rx = |c: &AtomicU64| c.load(Ordering::Relaxed);
        assert_eq!(rx(&dev.stats.rx), 0, "the device's thread received it");
        assert!(dev.poll_once(), "the waiter found nothing");
        assert_eq!(rx(&dev.stats.rx), 1);
        assert_eq!(rx(&dev.stats.rx_polled), 1);
        assert_eq!(rx(&dev.stats.rx_bad), 1, "handled (judged) by the waiter");
        assert!(!dev.poll_once(), "nothing more was queued");
        dev.shutdown();
        assert!(!dev.poll_once(), "a shut device is not polled");
    }

    /// A timer armed while the device's thread stands aside for a waiter runs on time, not
    /// at the end of the waiter's poll: here a REQ to a silent address is retransmitted
    /// every 20-40 ms while a waiter's poll lasts a minute.
    #[test]
    fn timers_run_while_a_waiter_polls() {
        let me = IpAddr::from([127, 0, 0, 1]);
        let dev = retrying_device(me, 28426);
        let gate = dev.gate.clone().expect("a UDP device has a gate");
        gate.polled_for(Duration::from_secs(60));
        // Parked with no timer: until the waiter's deadline, or 500 ms (its longest sleep).
        let sent = reqs_in_300_ms(&dev);
        assert!(
            sent >= 3,
            "{sent} REQ(s) in 300 ms: the retransmission timer waited"
        );
        dev.shutdown();
    }

    /// A waiter that polls the socket at once after a command armed a timer (as `get_event`
    /// does after `connect`) must not take the I/O thread's wake-up: the thread, asleep in
    /// poll(2) up to 500 ms, then slept on and the REQ's retries waited. Several tries, as
    /// which thread looks first is the scheduler's to decide.
    #[test]
    fn a_waiters_poll_does_not_take_the_io_threads_wake_up() {
        let me = IpAddr::from([127, 0, 0, 1]);
        for port in 28430..28435 {
            let dev = retrying_device(me, port);
            std::thread::sleep(Duration::from_millis(20));
            let p =
                rcm_proto::ib::ConnectParams::new(IpAddr::from([127, 0, 0, 9]), 0x1_0000_1f4f, 7);
            dev.with_engine(|ep, now| ep.connect(now, &p))
                .expect("connect");
            let _ = dev.poll_once();
            std::thread::sleep(Duration::from_millis(300));
            let sent = dev.stats.tx.load(Ordering::Relaxed);
            assert!(sent >= 3, "{sent} REQ(s) in 300 ms: the thread slept on");
            dev.shutdown();
        }
    }

    /// A device whose REQs retry every 20-40 ms, its thread asleep (no timer yet).
    fn retrying_device(me: IpAddr, port: u16) -> Arc<DeviceInner> {
        let mut cfg = EndpointConfig::new(me, 0x0200_00FF_FE00_0001, 1);
        cfg.retry = rcm_proto::ib::RetryPolicy::Backoff {
            initial: Duration::from_millis(20),
            max_wait: Duration::from_millis(40),
            deadline: Duration::from_secs(30),
        };
        DeviceInner::open(
            me,
            port,
            Endpoint::new(cfg),
            false,
            Duration::ZERO,
            false,
            true,
        )
        .expect("device")
    }

    /// Connects to an address nobody answers from, 20 ms after the device's thread began
    /// its sleep; the datagrams it sent in the 300 ms after (the REQ and its retries).
    fn reqs_in_300_ms(dev: &Arc<DeviceInner>) -> u64 {
        std::thread::sleep(Duration::from_millis(20));
        let p = rcm_proto::ib::ConnectParams::new(IpAddr::from([127, 0, 0, 9]), 0x1_0000_1f4f, 7);
        dev.with_engine(|ep, now| ep.connect(now, &p))
            .expect("connect");
        std::thread::sleep(Duration::from_millis(300));
        dev.stats.tx.load(Ordering::Relaxed)
    }

    /// A command that arms a timer earlier than the I/O thread's sleep wakes it (the
    /// thread sleeps up to 500 ms when it has no timer): the REQ is retried on time.
    #[test]
    fn a_timer_a_command_arms_wakes_the_sleeping_io_thread() {
        let me = IpAddr::from([127, 0, 0, 1]);
        let dev = retrying_device(me, 28427);
        let sent = reqs_in_300_ms(&dev);
        assert!(sent >= 3, "{sent} REQ(s) in 300 ms: the thread slept on");
        dev.shutdown();
    }

    /// The device's thread stands aside only until the waiter's deadline: a waiter that
    /// stops polling without a word (it got its event and went) leaves nothing stranded.
    #[test]
    fn a_device_takes_its_socket_back_after_the_waiters_deadline() {
        let me = IpAddr::from([127, 0, 0, 1]);
        let dev = device(me, 28425);
        let gate = dev.gate.clone().expect("a UDP device has a gate");
        gate.polled_for(Duration::from_millis(50));
        let peer = UdpSocket::bind("127.0.0.5:0").expect("peer");
        peer.send_to(b"not a MAD", SocketAddr::new(me, 28425))
            .expect("send");
        assert!(
            eventually(|| dev.stats.rx.load(Ordering::Relaxed) == 1),
            "the datagram stayed in the socket"
        );
        assert_eq!(dev.stats.rx_polled.load(Ordering::Relaxed), 0);
        dev.shutdown();
    }

    /// A batch on a quiet socket takes one datagram per fill, with a receive call of one;
    /// two fills in a row that each found something make it take all that is queued, two
    /// a call; a fill that finds the socket empty makes it quiet again. Nothing is lost or
    /// reordered either way.
    #[test]
    fn a_batch_takes_one_at_a_time_until_the_socket_is_busy() {
        let rx = UdpSocket::bind("127.0.0.1:0").expect("receiver");
        let to = rx.local_addr().expect("addr");
        let tx = UdpSocket::bind("127.0.0.6:0").expect("sender");
        let mut b = RxBatch::new();
        let mut take = || -> Vec<u8> {
            b.clear();
            b.fill(&rx);
            b.datagrams().map(|(_, d)| d[0]).collect()
        };
        for k in 1..=5u8 {
            tx.send_to(&[k; 64], to).expect("send");
        }
        assert_eq!(take(), [1], "a quiet batch takes one");
        assert_eq!(
            take(),
            [2],
            "the second in a row still one: the first finding was news"
        );
        assert_eq!(take(), [3, 4, 5], "busy now: the rest at once");
        assert_eq!(take(), [] as [u8; 0]);
        for k in 6..=7u8 {
            tx.send_to(&[k; 64], to).expect("send");
        }
        assert_eq!(take(), [6], "an empty look made it quiet again");
        assert_eq!(take(), [7]);
    }

    /// A receiver with `UDP_GRO` on, and the run of four GSI datagrams sent to it in one
    /// segmented send from 127.0.0.`sender`.
    fn gsi_run_sent_coalesced(sender: u8) -> (UdpSocket, Vec<Vec<u8>>) {
        use rcm_wire::roce::{emit_gsi, IpForIcrc, GSI_UDP_PAYLOAD_LEN as GSI, MAD_LEN};
        let rx = UdpSocket::bind("127.0.0.1:0").expect("receiver");
        crate::sys::enable_gro(&rx).expect("UDP_GRO");
        let to = rx.local_addr().expect("addr");
        let tx = UdpSocket::bind((std::net::Ipv4Addr::new(127, 0, 0, sender), 0)).expect("sender");
        let ip = IpForIcrc::v4([127, 0, 0, sender].into(), [127, 0, 0, 1].into());
        let gsi: Vec<Vec<u8>> = (0..4u8)
            .map(|k| emit_gsi(&ip, 4791, k.into(), &[k; MAD_LEN]))
            .collect();
        crate::sys::send_segments(&tx, to, &gsi.concat(), GSI as u16).expect("segmented send");
        (rx, gsi)
    }

    /// A quiet batch's receive cannot see `UDP_GRO`'s control message: a segmented run of
    /// GSI datagrams still comes as its datagrams, cut by their size, in order.
    #[test]
    fn a_quiet_batch_cuts_a_run_of_gsi_datagrams() {
        let (rx, gsi) = gsi_run_sent_coalesced(7);
        let mut b = RxBatch::new();
        b.fill(&rx);
        assert!(!b.many, "taken as a quiet batch");
        let got: Vec<Vec<u8>> = b.datagrams().map(|(_, d)| d.to_vec()).collect();
        assert_eq!(got, gsi);
        assert_eq!((b.count(), b.coalesced()), (4, 1));
    }

    /// A run coalesced while `UDP_GRO` was on and still queued when it is turned off (as a
    /// UD id's registration does) comes without its segment size: a busy batch cuts it as a
    /// quiet one does, by the GSI datagram's size, instead of taking it for one bad datagram.
    #[test]
    fn a_busy_batch_cuts_a_run_coalesced_before_gro_was_turned_off() {
        let (rx, gsi) = gsi_run_sent_coalesced(8);
        crate::sys::disable_gro(&rx).expect("UDP_GRO off");
        let mut b = RxBatch::new();
        b.many = true;
        b.fill(&rx);
        let got: Vec<Vec<u8>> = b.datagrams().map(|(_, d)| d.to_vec()).collect();
        assert_eq!(got, gsi);
    }

    /// One receive call may bring two datagrams (the second is moved down beside the
    /// first) and a coalesced run comes whole with its segment size; a batch stops at
    /// `BATCH` receives; nothing is lost, cut or reordered.
    #[test]
    fn a_batch_takes_what_is_queued_whole_and_in_order() {
        let rx = UdpSocket::bind("127.0.0.1:0").expect("receiver");
        crate::sys::enable_gro(&rx).expect("UDP_GRO");
        let to = rx.local_addr().expect("addr");
        let tx = UdpSocket::bind("127.0.0.5:0").expect("sender");
        let mut b = RxBatch::new();
        let take = |b: &mut RxBatch| -> Vec<Vec<u8>> {
            b.clear();
            // As on a busy socket (see the test below for how a batch gets there).
            b.many = true;
            b.fill(&rx);
            b.datagrams().map(|(_, d)| d.to_vec()).collect()
        };
        // Singles of different sizes (loopback queues them before `send_to` returns).
        let singles: Vec<Vec<u8>> = (1..=5u8).map(|k| vec![k; 100 * k as usize]).collect();
        for d in &singles {
            tx.send_to(d, to).expect("send");
        }
        assert_eq!(take(&mut b), singles);
        // A run of three in one segmented send, then a single.
        let run: Vec<u8> = (0..3u8).flat_map(|k| [10 + k; 296]).collect();
        crate::sys::send_segments(&tx, to, &run, 296).expect("segmented send");
        tx.send_to(&[20; 50], to).expect("send");
        let got = take(&mut b);
        let mut want: Vec<Vec<u8>> = run.chunks(296).map(<[u8]>::to_vec).collect();
        want.push(vec![20; 50]);
        assert_eq!(got, want);
        assert_eq!(b.coalesced(), 1, "the run came in one receive");
        // More than a batch: the rest comes with the next.
        let many: Vec<Vec<u8>> = (0..BATCH as u16 + 6)
            .map(|k| k.to_be_bytes().repeat(40))
            .collect();
        for d in &many {
            tx.send_to(d, to).expect("send");
        }
        let first = take(&mut b);
        assert!(
            first.len() <= BATCH && first.len() >= BATCH - 1,
            "{}",
            first.len()
        );
        let second = take(&mut b);
        assert_eq!([first, second].concat(), many);
        assert!(take(&mut b).is_empty());
    }

    /// An IPv6 device takes datagrams whose UDP checksum is 0, which is how Linux's rxe sends
    /// RoCEv2 over IPv6 (the kernel dropped them before the socket saw them, so an IPv6
    /// device never heard a Linux peer). The peer here sends with `UDP_NO_CHECK6_TX`.
    #[test]
    fn an_ipv6_device_takes_datagrams_with_udp_checksum_zero() {
        let lo6 = IpAddr::from(std::net::Ipv6Addr::LOCALHOST);
        let dev = device(lo6, 28422);
        let peer = UdpSocket::bind("[::1]:0").expect("peer");
        crate::sys::send_zero_checksum6(&peer).expect("UDP_NO_CHECK6_TX");
        peer.send_to(b"not a MAD", SocketAddr::new(lo6, 28422))
            .expect("send");
        let until = Instant::now() + Duration::from_secs(5);
        while dev.stats.rx_bad.load(Ordering::Relaxed) == 0 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            dev.stats.rx.load(Ordering::Relaxed),
            1,
            "the datagram arrived"
        );
        assert_eq!(
            dev.stats.rx_bad.load(Ordering::Relaxed),
            1,
            "and was judged"
        );
        dev.shutdown();
    }
}
