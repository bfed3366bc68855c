//! The fabric: the devices of this process, the port spaces, the dispatcher that runs
//! callbacks, and the registry of live ids.

use crate::device::DeviceInner;
use crate::event::Event;
use crate::id::IdInner;
use crate::ports::Ports;
use crate::slot::{Scheduler, Slot};
use crate::sync;
use rcm_proto::ib::{Endpoint, EndpointConfig, RetryPolicy};
use std::collections::VecDeque;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Duration;

/// How a fabric is set up.
#[derive(Debug, Clone)]
pub struct FabricConfig {
    /// UDP port of every RoCEv2 device (4791 on a real network).
    pub udp_port: u16,
    /// Retransmission policy of the CM engines.
    pub retry: RetryPolicy,
    /// Threads that run callbacks.
    pub dispatcher_threads: usize,
    /// Seed for comm IDs and PSNs; `None` draws one from the OS.
    pub seed: Option<u64>,
    /// Shortest timewait (the path's ACK timeout is used when longer).
    pub min_timewait: Duration,
    /// Most accepted connections per RoCEv2 device waiting for their RTU; past it the
    /// oldest are given up as REP timeouts (bounds what a spoofed REQ flood can hold; see
    /// `rcm_proto::ib::EndpointConfig::max_half_open`). On an iWARP device: accepted TCP
    /// streams whose MPA Request has not come yet, at most 1,024 (each holds a file
    /// descriptor); past it the oldest silent stream is reset (after a last read, in case
    /// its Request has come) to make room for the new one; so it is when the process runs
    /// out of descriptors (its `RLIMIT_NOFILE`, often 1,024, may come first), so that
    /// silent streams cannot keep clients out.
    pub max_half_open: usize,
    /// Verify the ICRC of every received RoCEv2 datagram (IPv4 devices): datagrams are read
    /// from a raw socket, which shows the IP header the ICRC covers, and a wrong ICRC is
    /// dropped and counted ([`Device::icrc_drops`]). Needs CAP_NET_RAW; off by default, when
    /// a UDP socket is used and an IPv4 datagram's ICRC is accepted unverified (the socket
    /// does not show the IPv4 ID it covers). IPv6 datagrams' ICRCs are checked either way.
    pub verify_icrc: bool,
    /// Keep the UD datagrams sent to a UD id's QPN for [`CmId::recv_ud`](crate::CmId::recv_ud)
    /// (up to [`UD_RECV_QUEUE`](crate::UD_RECV_QUEUE) each). On by default; off where no one
    /// takes them (the `rcm daemon` serves no UD data path), so that a peer sending to an
    /// id's QPN cannot make the process keep what it sends: they are counted as for no QP.
    pub ud_receive: bool,
    /// How long an idle device or callback thread keeps polling for work before it sleeps
    /// (default [`DEFAULT_SPIN`], 100 µs).
    /// Waking a sleeping thread on an idle CPU costs tens of microseconds (about 35 µs on
    /// the 2-core test VM, most of a loopback round trip), and a connect crosses several
    /// threads; polling briefly after activity keeps those hand-offs at a few µs. The poll
    /// yields the CPU to runnable threads, and an idle fabric sleeps. Zero never polls.
    /// A device's thread does not poll while a thread waiting for an event polls the device
    /// itself (see [`EventChannel::set_spin`](crate::EventChannel::set_spin)). A thread
    /// whose yield went to a CPU-bound process (its CPU was gone for the rest of a tick)
    /// sleeps instead of polling for a while, 2 ms to 1.6 s (see [`crate::spin_until`]):
    /// on a busy host polling would cost a tick per hop.
    pub spin: Duration,
    /// Where callbacks run, and whether what they send is batched (default: on the
    /// callback threads, unbatched, so a callback may block).
    pub callbacks: CallbackMode,
    /// A CM datagram a RoCEv2 device sends to its own address (two ids of one device
    /// talking, as two clients of one `rcm daemon` do) goes straight to its engine, in the
    /// sending thread, instead of through the kernel's UDP and a wake-up of the device's
    /// receive thread: what rxe does for a packet to its own address (`rxe_loopback`), so
    /// such traffic is not on the wire in either (on by default; [`Device::looped`] counts
    /// it). Datagrams to another device, even one of this fabric, always go through UDP.
    pub loopback: bool,
}

/// Where a fabric's callbacks run ([`FabricConfig::callbacks`]). Every mode keeps every
/// guarantee: one callback at a time per id, in order, `Flow::Destroy`, destroy from inside.
/// The two faster modes are for callbacks that never block outside rcm (no sleep, no lock
/// held long, no I/O, no waiting for the network such as `recv_ud` or another process):
/// such a callback would hold back what the callbacks before it sent, or in `Inline` mode
/// the device's whole receive loop and timers. In `Inline` mode a callback must not wait for
/// another id's callback either (`DestroyHandle::wait`, `Removal::wait`): that callback may
/// be queued behind this one on the same thread. (A blocking `destroy` from a callback never
/// waits, in any mode.)
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum CallbackMode {
    /// On the fabric's callback threads (`dispatcher_threads`); each datagram a callback
    /// sends leaves at once. A callback may block.
    #[default]
    Threads,
    /// On the callback threads, which hold the datagrams their callbacks send while more
    /// callbacks are ready and send them together when none is (see [`SendBatch`]): fewer
    /// system calls in a burst, nothing added for a lone event.
    BatchedThreads,
    /// An event a RoCEv2 device's receive loop produced runs its callback on that thread,
    /// after the batch of datagrams it received, with what the callbacks send held and sent
    /// together at the end (a receive of one datagram holds nothing: its answer leaves from
    /// within the call that made it): one thread hop less per event (on a 2-core VM, serial
    /// connect p50 ~33 µs instead of ~55). An iWARP device's I/O thread likewise runs the
    /// callbacks of what its streams brought (a connect request, the MPA Reply, the peer's
    /// close) after each pass over them (serial iWARP connects p50 ~40–57 µs instead of
    /// ~61–67). Events from elsewhere (a call's own, a timer's, and those of datagrams a
    /// thread waiting in `get_event` received itself, see
    /// [`EventChannel::set_spin`](crate::EventChannel::set_spin)) run as in
    /// `BatchedThreads`. For a fabric served by the `rcm daemon` (rcm-ucm), the callbacks
    /// run on the session's reader thread after each batch of events it read.
    Inline,
}

impl Default for FabricConfig {
    fn default() -> Self {
        FabricConfig {
            udp_port: rcm_wire::roce::ROCE_V2_UDP_PORT,
            retry: RetryPolicy::default(),
            dispatcher_threads: 2,
            seed: None,
            min_timewait: Duration::ZERO,
            max_half_open: 1 << 16,
            verify_icrc: false,
            ud_receive: true,
            spin: DEFAULT_SPIN,
            callbacks: CallbackMode::Threads,
            loopback: true,
        }
    }
}

pub use crate::slot::DEFAULT_SPIN;
use crate::spin::spin_until;

/// Runs scheduled slots on a small pool of threads.
pub(crate) struct Dispatcher {
    ready: Mutex<VecDeque<Arc<Slot<Event>>>>,
    cond: Condvar,
    stop: AtomicBool,
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    /// Slots in `ready` (read without the lock by polling workers).
    queued: AtomicUsize,
    /// Workers asleep on `cond` (changed and read under `ready`'s lock): no wake-up
    /// syscall is made when all are awake.
    sleepers: AtomicUsize,
    /// A worker is polling.
    spinning: AtomicBool,
    spin: Duration,
    /// Hold what callbacks send while more are ready (`CallbackMode::BatchedThreads`).
    batch_sends: bool,
}

std::thread_local! {
    /// Slots whose callbacks this thread runs itself when its [`CallbacksHere`] ends.
    static HERE: std::cell::RefCell<Option<Vec<Arc<Slot<Event>>>>> =
        const { std::cell::RefCell::new(None) };
    /// Whether this thread runs the callbacks of a [`CallbacksHere`] batch now.
    static RUNNING_HERE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// The list the last outermost guard emptied, kept for its capacity (a guard per
    /// received batch and per call would otherwise allocate one each).
    static HERE_SPARE: std::cell::Cell<Vec<Arc<Slot<Event>>>> =
        const { std::cell::Cell::new(Vec::new()) };
}

/// While it lives, the callbacks that this thread's calls schedule (an event its call
/// produced, say `ADDR_RESOLVED` from `resolve_addr`) are not handed to the fabric's
/// dispatcher threads; they run on this thread when it is dropped, with every guarantee
/// of a dispatcher thread (serialised per id, `Flow::Destroy`, destroy from inside).
///
/// For a provider whose callbacks never block (the `rcm daemon`'s only queue an event for a
/// client): an event its command produced then reaches the client without waking a
/// callback thread, which on a busy machine costs tens of µs. Do not hold a lock a
/// callback takes when it drops. Nested guards: the outermost runs them. It belongs to the
/// thread that made it (it is not `Send`: dropped on another thread, the callbacks it
/// collected would never run):
///
/// ```compile_fail
/// fn needs_send<T: Send>(_: T) {}
/// needs_send(rcm::CallbacksHere::begin());
/// ```
#[must_use = "the callbacks run when this is dropped"]
pub struct CallbacksHere {
    outermost: bool,
    _thread_bound: std::marker::PhantomData<*const ()>,
}

/// Whether this thread has a [`CallbacksHere`] open.
pub(crate) fn callbacks_here_open() -> bool {
    HERE.try_with(|h| h.try_borrow().map_or(true, |h| h.is_some()))
        .unwrap_or(true)
}

impl CallbacksHere {
    /// Starts deferring this thread's scheduled callbacks to the drop.
    pub fn begin() -> Self {
        // While the thread's locals are torn down the guard does nothing: callbacks go to
        // the dispatcher as usual.
        HERE.try_with(|h| {
            let mut h = h.borrow_mut();
            if h.is_some() {
                CallbacksHere {
                    outermost: false,
                    _thread_bound: std::marker::PhantomData,
                }
            } else {
                *h = Some(
                    HERE_SPARE
                        .try_with(std::cell::Cell::take)
                        .unwrap_or_default(),
                );
                CallbacksHere {
                    outermost: true,
                    _thread_bound: std::marker::PhantomData,
                }
            }
        })
        .unwrap_or(CallbacksHere {
            outermost: false,
            _thread_bound: std::marker::PhantomData,
        })
    }
}

impl Drop for CallbacksHere {
    fn drop(&mut self) {
        if !self.outermost {
            return;
        }
        // Taken first: what these callbacks schedule in turn goes to the dispatcher.
        let mut slots = HERE
            .try_with(|h| h.borrow_mut().take())
            .ok()
            .flatten()
            .unwrap_or_default();
        let outer_run = RUNNING_HERE.try_with(|r| r.replace(true)).unwrap_or(true);
        for s in slots.drain(..) {
            // Each was scheduled (its `scheduled` flag set) for this thread alone, so no
            // dispatcher thread runs it meanwhile: this is the dispatcher's own loop.
            s.drain();
        }
        let _ = RUNNING_HERE.try_with(|r| r.set(outer_run));
        // The answers owed to the callbacks' pipelined calls (see `Pipeline`). Looked at
        // before anything else: a device thread's receive loop drops one of these per batch.
        if !outer_run && crate::remote::owes_answers() && !pipeline_open() {
            crate::remote::complete_pipelined();
        }
        let _ = HERE_SPARE.try_with(|c| {
            let spare = c.take();
            c.set(if spare.capacity() >= slots.capacity() {
                spare
            } else {
                slots
            });
        });
    }
}

/// While it lives, the datagrams this thread's calls send (a `connect`'s REQ, an `accept`'s
/// REP, …) are held and go out together: those to one peer in one system call, which
/// crosses the kernel once instead of once each (`UDP_SEGMENT`; on loopback the receiver
/// takes them in one call too). For a thread that makes many calls in a row: a loop
/// issuing connects, or an event loop answering what [`crate::EventChannel::get_event`]
/// brings.
///
/// What is held is sent when the outermost guard drops, when 64 datagrams are held,
/// before this thread waits in rcm (`get_event` with nothing queued, a blocking `destroy`
/// that waits for a callback in flight, `recv_ud`): a batch never holds back what the
/// thread then waits for; and before [`Fabric::shutdown`] closes the devices. What is held
/// for a removed device is dropped with it. Do not wait on
/// anything else (a lock, a sleep, another library) while holding one: the datagrams, and
/// the peer, would wait too. iWARP devices and the daemon's ids are not affected.
#[must_use = "the datagrams go out when this is dropped"]
pub struct SendBatch {
    /// Thread-bound: the held datagrams are the thread's.
    _thread: std::marker::PhantomData<*const ()>,
}

impl SendBatch {
    /// Starts holding this thread's datagrams.
    pub fn begin() -> Self {
        crate::device::hold_begin();
        SendBatch {
            _thread: std::marker::PhantomData,
        }
    }

    /// Sends what this thread holds now, keeping the batch open: for a point after which
    /// other threads' datagrams should not overtake this thread's (before handing work to
    /// another thread, say).
    pub fn flush() {
        before_wait();
    }
}

impl Drop for SendBatch {
    fn drop(&mut self) {
        crate::device::hold_end();
    }
}

/// Sends what this thread's [`SendBatch`] holds, and completes its [`Pipeline`]'s calls,
/// before a wait: what the thread then waits for may be the event of a call that failed.
pub(crate) fn before_wait() {
    if crate::device::holding() {
        crate::device::flush_held();
    }
    crate::remote::complete_pipelined();
}

std::thread_local! {
    /// How many [`Pipeline`]s this thread has open.
    static PIPELINES: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Whether this thread runs the callbacks of a [`CallbacksHere`] batch now.
pub(crate) fn running_callbacks_here() -> bool {
    RUNNING_HERE.try_with(std::cell::Cell::get).unwrap_or(false)
}

/// Whether this thread has a [`Pipeline`] open.
pub(crate) fn pipeline_open() -> bool {
    PIPELINES.try_with(|p| p.get() > 0).unwrap_or(false)
}

/// While it lives, the calls this thread makes on a daemon's ids (`rcm-ucm`) that return
/// nothing but success, namely `bind`, `resolve_addr`, `resolve_route`, `connect`, `accept`,
/// `establish`, and `disconnect` of an id whose `Established` event has come, return as
/// soon as the command is written, without waiting for the daemon's answer: a loop issuing
/// thousands of connects, or a server's callbacks accepting a burst of requests, then pays
/// one round trip to the daemon for the lot instead of one each.
///
/// Two more go the same way. The daemon's release of an id this thread destroys without
/// waiting ([`CmId::begin_destroy`](crate::CmId::begin_destroy),
/// [`Flow::Destroy`](crate::Flow), and a blocking [`CmId::destroy`](crate::CmId::destroy)
/// with no callback in flight; one that waits for a callback first awaits what is owed, as
/// any wait in rcm does). And `create_id`: the client names the new id's handle itself, and
/// the id is usable at once by this thread, whose later calls go behind its creation
/// (another thread's calls on it may overtake the creation until this thread's answers are
/// awaited, and find no such id: hand it over after the pipeline ends).
///
/// What changes for the caller: such a call returns `Ok` even when the daemon then finds it
/// wrong (an id in the wrong state, say); that failure comes instead as the id's error
/// event, as rdma_cm reports failures found after a call returned: `ADDR_ERROR` for `bind`
/// and `resolve_addr`, `ROUTE_ERROR` for `resolve_route`, `CONNECT_ERROR` for the others,
/// each carrying the daemon's error. (A refused `bind` also makes the daemon refuse every
/// later call of the id with the same error, `query` aside, so that a `listen` or
/// `resolve_addr` behind it does not bind the id elsewhere; only destroying it is left. A
/// `disconnect` is pipelined only once established, when the daemon refuses it only for a
/// removed device, whose `DeviceRemoval` comes as well; an earlier one waits, so that its
/// refusal, the connection still being set up, is its return value. A `create_id` the daemon refuses, at its limit of ids, gives an id whose
/// `CONNECT_ERROR` carries `LimitExceeded(Ids)`, whose later calls fail, and which is left
/// only to be destroyed.) Calls keep their order: every later call of this thread on the
/// same daemon goes after them, and one that returns something (`query`) reads the answers
/// owed before its own.
///
/// The answers still owed are awaited (and their failures delivered) when the outermost
/// guard drops, or, opened within a callback that a [`CallbacksHere`] batch runs (a daemon
/// session's reader with `CallbackMode::Inline`), when that batch ends, so that a burst's
/// accepts share it; and before this thread waits in rcm (`get_event` with nothing queued,
/// a blocking `destroy` that waits for a callback), since what it waits for may be such an
/// error event, or the callback for the channel this thread keeps. Ids of devices in this
/// process are not affected: their calls never wait for another process, and report every
/// failure as their return value. Not `Send`, like [`SendBatch`]. While it
/// holds answers owed, the thread keeps a command channel of the daemon's session to itself:
/// do not wait on anything else meanwhile (a lock another calling thread of that session
/// holds, a sleep), since a thread of the session may be waiting for a channel.
#[must_use = "the calls' answers are awaited when this is dropped"]
pub struct Pipeline {
    _thread: std::marker::PhantomData<*const ()>,
}

impl Pipeline {
    /// Starts sending this thread's answerless calls without waiting.
    pub fn begin() -> Self {
        let _ = PIPELINES.try_with(|p| p.set(p.get() + 1));
        Pipeline {
            _thread: std::marker::PhantomData,
        }
    }
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        let open = PIPELINES
            .try_with(|p| {
                p.set(p.get().saturating_sub(1));
                p.get() > 0
            })
            .unwrap_or(false);
        // Within a callback batch, the batch's end completes them (see `CallbacksHere`).
        if !open && !running_callbacks_here() && !callbacks_here_open() {
            crate::remote::complete_pipelined();
        }
    }
}

impl Scheduler<Event> for Dispatcher {
    /// A connect request is delivered as a callback of its listener (serialised with the
    /// listener's callbacks, as Linux delivers it under the listener's handler mutex).
    fn gate(&self, ev: &Event) -> Option<Arc<Slot<Event>>> {
        match ev {
            Event::ConnectRequest { listener, .. } => Some(listener.0.slot.clone()),
            _ => None,
        }
    }

    fn schedule(&self, slot: Arc<Slot<Event>>) {
        let mut slot = Some(slot);
        let _ = HERE.try_with(|h| {
            if let Some(v) = h.borrow_mut().as_mut() {
                v.extend(slot.take());
            }
        });
        let Some(slot) = slot else {
            return;
        };
        let mut q = sync::lock(&self.ready);
        q.push_back(slot);
        self.queued.fetch_add(1, Ordering::Relaxed);
        let sleeping = self.sleepers.load(Ordering::Relaxed) > 0;
        drop(q);
        if sleeping {
            self.cond.notify_one();
        }
    }
}

impl Dispatcher {
    fn start(n: usize, spin: Duration, batch_sends: bool) -> Arc<Self> {
        let d = Arc::new(Dispatcher {
            ready: Mutex::new(VecDeque::new()),
            cond: Condvar::new(),
            stop: AtomicBool::new(false),
            threads: Mutex::new(Vec::new()),
            queued: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            spinning: AtomicBool::new(false),
            spin,
            batch_sends,
        });
        for i in 0..n.max(1) {
            let w = Arc::downgrade(&d);
            if let Ok(h) = std::thread::Builder::new()
                .name(format!("rcm-cb-{i}"))
                .spawn(move || {
                    mark_own_thread();
                    worker(&w);
                })
            {
                sync::lock(&d.threads).push(h);
            }
        }
        d
    }

    fn stop(&self) {
        {
            // Under the queue's lock, which a worker holds from its last look at `stop` until
            // it sleeps: it either sees the flag or gets the notification.
            let _q = sync::lock(&self.ready);
            self.stop.store(true, Ordering::SeqCst);
        }
        self.cond.notify_all();
        let hs = std::mem::take(&mut *sync::lock(&self.threads));
        for h in hs {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}

fn worker(d: &Weak<Dispatcher>) {
    let mut held: Option<SendBatch> = None;
    loop {
        let Some(disp) = d.upgrade() else { return };
        let slot = {
            let mut q = sync::lock(&disp.ready);
            let mut polled = false;
            loop {
                if disp.stop.load(Ordering::SeqCst) {
                    return;
                }
                if let Some(s) = q.pop_front() {
                    disp.queued.fetch_sub(1, Ordering::Relaxed);
                    if q.is_empty() {
                        rcm_proto::room::shrink_deque(&mut q);
                    }
                    break s;
                }
                if held.is_some() {
                    // No callback to run: what the last ones sent goes out before this thread
                    // polls or sleeps (checked here, with the queue found empty, not before:
                    // another worker may take what this one saw queued).
                    drop(q);
                    held = None;
                    q = sync::lock(&disp.ready);
                    continue;
                }
                // Poll a while before sleeping (see `FabricConfig::spin`); one worker at a
                // time, so pollers never crowd out the threads with work on a small machine.
                if !polled
                    && disp
                        .spinning
                        .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                        .is_ok()
                {
                    polled = true;
                    drop(q);
                    // Ended by a stop too: `stop` joins this thread, and a fabric's shutdown
                    // would otherwise last as long as the spin (it may be set to seconds).
                    spin_until(disp.spin, || {
                        disp.queued.load(Ordering::Relaxed) > 0 || disp.stop.load(Ordering::Relaxed)
                    });
                    disp.spinning.store(false, Ordering::Release);
                    q = sync::lock(&disp.ready);
                    continue;
                }
                disp.sleepers.fetch_add(1, Ordering::Relaxed);
                q = disp
                    .cond
                    .wait_timeout(q, Duration::from_millis(200))
                    .map_or_else(|e| e.into_inner().0, |r| r.0);
                disp.sleepers.fetch_sub(1, Ordering::Relaxed);
            }
        };
        if disp.batch_sends && held.is_none() {
            held = Some(SendBatch::begin());
        }
        drop(disp);
        // Counted at each slot, as a device thread counts at each datagram (see
        // `crate::spin`): a run of callbacks can outlast a stolen yield.
        crate::spin::look_here();
        slot.drain();
    }
}

pub(crate) struct FabricInner {
    pub cfg: FabricConfig,
    pub devices: Mutex<Vec<Arc<DeviceInner>>>,
    pub ports: Mutex<Ports>,
    pub dispatcher: Arc<Dispatcher>,
    pub ids: Mutex<foldhash::HashMap<u64, Weak<IdInner>>>,
    pub wildcard_listeners: Mutex<Vec<Weak<IdInner>>>,
    /// Serialises wildcard listens with device additions (Linux `cma_listen_on_all` vs
    /// `cma_add_one` under one lock).
    pub listen_lock: Mutex<()>,
    /// Held through a shutdown.
    shutting: Mutex<()>,
    /// Set (under the id table's lock) when a shutdown starts: no id is published and no
    /// device added after it, so the shutdown's walk of the table misses none.
    pub shut: std::sync::atomic::AtomicBool,
    next_key: AtomicU64,
    /// Soft QP numbers: in turn, none twice while in use.
    pub(crate) qpns: crate::qpns::QpnSpace,
    /// Devices ever added: each one's CA GUID and engine seed take the next number, so a
    /// device added again after its removal does not replay the comm IDs (and GUID) its
    /// predecessor used, which peers still hold in timewait.
    next_device: AtomicU64,
    seed: u64,
    /// Who owns the devices when they are in another process.
    pub provider: Option<Arc<dyn crate::remote::Provider>>,
}

impl FabricInner {
    pub(crate) fn new_key(&self) -> u64 {
        self.next_key.fetch_add(1, Ordering::Relaxed)
    }

    /// A soft QP number no id holds (above the reserved QP0/QP1, within 24 bits), held
    /// until given back with [`FabricInner::give_back_qpn`].
    pub(crate) fn new_qpn(&self) -> u32 {
        self.qpns.take()
    }

    /// A number from [`FabricInner::new_qpn`] is no longer held.
    pub(crate) fn give_back_qpn(&self, qpn: u32) {
        self.qpns.give_back(qpn);
    }

    pub(crate) fn device(&self, ip: IpAddr) -> Option<Arc<DeviceInner>> {
        sync::lock(&self.devices)
            .iter()
            .find(|d| d.ip == ip && !d.removed.load(Ordering::SeqCst))
            .cloned()
    }

    pub(crate) fn devices(&self) -> Vec<Arc<DeviceInner>> {
        sync::lock(&self.devices)
            .iter()
            .filter(|d| !d.removed.load(Ordering::SeqCst))
            .cloned()
            .collect()
    }

    pub(crate) fn scheduler(&self) -> Arc<dyn Scheduler<Event>> {
        self.dispatcher.clone()
    }
}

/// A set of RoCEv2 and iWARP devices in this process and everything bound to them. Cheap to clone.
///
/// A fabric runs until [`Fabric::shutdown`], or until its last `Fabric` handle is dropped,
/// which shuts it down the same way (as closing ucma's file destroys every id it made): its
/// ids are destroyed, so their peers see DREQ or REJ, its devices stop and their ports are
/// released. [`CmId`](crate::CmId) handles do not keep a fabric running: keep a `Fabric`
/// handle for as long as its ids are in use (their calls fail once it is shut down). A
/// handle moved into a callback keeps the fabric until that callback is dropped.
#[derive(Clone)]
pub struct Fabric(
    pub(crate) Arc<FabricInner>,
    #[allow(dead_code, reason = "held for its drop")] Arc<LastHandle>,
);

/// Shared by a fabric's handles only (ids hold its inner part): the last one's drop shuts
/// the fabric down.
struct LastHandle(Arc<FabricInner>);

impl Drop for LastHandle {
    fn drop(&mut self) {
        shutdown_from_here(&self.0);
    }
}

/// Shuts the fabric down on this thread, or, where waiting for the fabric's threads could
/// wait for this thread (one of rcm's own threads, a callback, an id's teardown, which a
/// callback may be waiting for), on a thread of its own, without waiting for it.
fn shutdown_from_here(f: &Arc<FabricInner>) {
    if OWN_THREAD.with(std::cell::Cell::get)
        || crate::slot::in_callback()
        || crate::slot::in_teardown()
    {
        let f2 = f.clone();
        let spawned = std::thread::Builder::new()
            .name("rcm-shutdown".into())
            .spawn(move || shutdown(&f2));
        if spawned.is_ok() {
            return;
        }
    }
    shutdown(f);
}

std::thread_local! {
    /// Set on the threads rcm starts (dispatcher, device and iWARP threads).
    static OWN_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks the calling thread as one of rcm's own.
pub(crate) fn mark_own_thread() {
    OWN_THREAD.with(|c| c.set(true));
}

/// Whether the calling thread is one of rcm's own.
pub(crate) fn own_thread() -> bool {
    OWN_THREAD.try_with(std::cell::Cell::get).unwrap_or(true)
}

impl Fabric {
    /// An empty fabric.
    pub fn new(cfg: FabricConfig) -> Self {
        Self::build(cfg, None)
    }

    /// A fabric whose devices belong to a provider in another process (the `rcm daemon`
    /// through `rcm-ucm`): the same API, every operation carried out there. It has no local
    /// devices; `cfg` matters only for `dispatcher_threads`. See [`crate::remote`].
    pub fn with_provider(provider: Arc<dyn crate::remote::Provider>, cfg: FabricConfig) -> Self {
        Self::build(cfg, Some(provider))
    }

    /// Whether the devices are a provider's (see [`Fabric::with_provider`]).
    pub fn is_remote(&self) -> bool {
        self.0.provider.is_some()
    }

    fn build(cfg: FabricConfig, provider: Option<Arc<dyn crate::remote::Provider>>) -> Self {
        let seed = cfg.seed.unwrap_or_else(rand::random);
        let dispatcher = Dispatcher::start(
            cfg.dispatcher_threads,
            cfg.spin,
            cfg.callbacks != CallbackMode::Threads,
        );
        let inner = Arc::new(FabricInner {
            cfg,
            devices: Mutex::new(Vec::new()),
            ports: Mutex::new(Ports::new(seed as u16)),
            dispatcher,
            ids: Mutex::new(foldhash::HashMap::default()),
            wildcard_listeners: Mutex::new(Vec::new()),
            listen_lock: Mutex::new(()),
            shutting: Mutex::new(()),
            shut: std::sync::atomic::AtomicBool::new(false),
            next_key: AtomicU64::new(1),
            qpns: crate::qpns::QpnSpace::new(0x100, 0x00FF_FE00, (seed >> 16) as u32 & 0xFFFF),
            next_device: AtomicU64::new(0),
            seed,
            provider,
        });
        Fabric(inner.clone(), Arc::new(LastHandle(inner)))
    }

    /// The embedded default: `n` devices on 127.0.0.1, 127.0.0.2, … in this process. Needs no
    /// privileges and nothing installed.
    pub fn loopback(n: u8) -> crate::Result<Self> {
        Self::loopback_with(n, FabricConfig::default())
    }

    /// Like [`Fabric::loopback`] with a configuration.
    pub fn loopback_with(n: u8, cfg: FabricConfig) -> crate::Result<Self> {
        let f = Fabric::new(cfg);
        for i in 1..=n {
            f.add_device(IpAddr::from([127, 0, 0, i]))?;
        }
        Ok(f)
    }

    /// Adds a RoCEv2 device on a local address (it binds UDP `udp_port` there). Wildcard
    /// listeners start listening on it at once. [`crate::Error::AddrInUse`] (`ip:udp_port`)
    /// when another socket holds that port (one process owns a device's port);
    /// [`crate::Error::AddrNotAvailable`] when `ip` is not an address of this host;
    /// [`crate::Error::InvalidArgument`] for an address that is not unicast (the wildcard:
    /// bind a listener to it instead, to listen on every device).
    pub fn add_device(&self, ip: IpAddr) -> crate::Result<Device> {
        self.add(ip, None)
    }

    /// Adds an iWARP device on a local address, with siw's timers (see
    /// [`Fabric::add_iwarp_device_with`]).
    pub fn add_iwarp_device(&self, ip: IpAddr) -> crate::Result<Device> {
        self.add_iwarp_device_with(ip, rcm_proto::iw::CepConfig::default())
    }

    /// Adds an iWARP device: the rdma_cm port is the TCP port, as with Linux's siw. A
    /// listener on port P listens on TCP `ip:P`; a connect opens TCP to `dst:P` from an
    /// ephemeral port of `ip` and runs MPA (revision 2, or 1 when `cfg.max_revision` is 1,
    /// which then also caps what the device answers; no CRC, no markers) over it. No
    /// socket is opened until something listens or connects. The same [`CmId`] API works on
    /// it (differences: no UD port spaces, private data up to 252 bytes in MPA revision 2,
    /// see the methods), and wildcard listeners start listening on it at once.
    /// [`crate::Error::AddrNotAvailable`] when `ip` is not an address of this host.
    ///
    /// [`CmId`]: crate::CmId
    pub fn add_iwarp_device_with(
        &self,
        ip: IpAddr,
        cfg: rcm_proto::iw::CepConfig,
    ) -> crate::Result<Device> {
        self.add(ip, Some(cfg))
    }

    /// `n` iWARP devices on 127.0.0.1, 127.0.0.2, … in a new fabric.
    pub fn loopback_iwarp(n: u8, cfg: FabricConfig) -> crate::Result<Self> {
        let f = Fabric::new(cfg);
        for i in 1..=n {
            f.add_iwarp_device(IpAddr::from([127, 0, 0, i]))?;
        }
        Ok(f)
    }

    fn add(&self, ip: IpAddr, iwarp: Option<rcm_proto::iw::CepConfig>) -> crate::Result<Device> {
        if self.0.provider.is_some() {
            return Err(crate::Error::InvalidArgument(
                "the devices of a provider-backed fabric are the provider's".into(),
            ));
        }
        if let Some(why) = not_a_device_address(ip) {
            return Err(crate::Error::InvalidArgument(
                format!("a device needs a unicast address of this host; {ip} is {why}").into(),
            ));
        }
        if self.0.device(ip).is_some() {
            return Err(crate::Error::DeviceExists(ip));
        }
        let n = self.0.next_device.fetch_add(1, Ordering::Relaxed);
        // The GUID's low byte repeats after 256 additions; the comm IDs, drawn from the
        // whole number's seed, do not.
        let mut cfg = EndpointConfig::new(
            ip,
            0x0200_00FF_FE00_0000 | (self.0.seed & 0xFFFF) << 8 | (n & 0xFF),
            self.0.seed ^ n,
        );
        cfg.retry = self.0.cfg.retry;
        cfg.min_timewait = self.0.cfg.min_timewait;
        cfg.max_half_open = self.0.cfg.max_half_open;
        let _listens = sync::lock(&self.0.listen_lock);
        let dev = match iwarp {
            Some(icfg) => DeviceInner::open_iwarp(
                ip,
                icfg,
                Endpoint::new(cfg),
                self.0.cfg.max_half_open,
                self.0.cfg.spin,
                self.0.cfg.callbacks == CallbackMode::Inline,
            )?,
            None => DeviceInner::open(
                ip,
                self.0.cfg.udp_port,
                Endpoint::new(cfg),
                self.0.cfg.verify_icrc,
                self.0.cfg.spin,
                self.0.cfg.callbacks == CallbackMode::Inline,
                self.0.cfg.loopback,
            )?,
        };
        {
            let mut devices = sync::lock(&self.0.devices);
            // Checked under the lock the shutdown takes the devices with.
            if self.0.shut.load(Ordering::SeqCst) {
                drop(devices);
                dev.shutdown();
                return Err(crate::Error::ShutDown);
            }
            devices.push(dev.clone());
        }
        crate::id::on_device_added(&self.0, &dev);
        Ok(Device(dev))
    }

    /// Removes a device: every id bound to it gets one `DeviceRemoval` event (after the
    /// callback in flight; never if that callback asked for destroy), listeners on it stop.
    /// The returned handle completes when all those ids are destroyed.
    pub fn remove_device(&self, ip: IpAddr) -> crate::Result<Removal> {
        let dev = self
            .0
            .device(ip)
            .ok_or(crate::Error::AddrNotAvailable(ip))?;
        // One removal per device: a second one racing this would walk the ids too, and the
        // two would share the holders between them, the first to finish stopping the device
        // under the other's.
        if dev
            .removed
            .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            return Err(crate::Error::AddrNotAvailable(ip));
        }
        let holders = crate::id::on_device_removed(&self.0, &dev);
        Ok(Removal {
            fabric: Arc::downgrade(&self.0),
            dev,
            holders,
            done: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The devices' addresses.
    pub fn device_addrs(&self) -> Vec<IpAddr> {
        if let Some(p) = &self.0.provider {
            return p.device_addrs();
        }
        self.0.devices().iter().map(|d| d.ip).collect()
    }

    /// This process's device on `ip` (`None` for a fabric served by a daemon, whose
    /// devices are the daemon's).
    pub fn device(&self, ip: IpAddr) -> Option<Device> {
        self.0.device(ip).map(Device)
    }

    /// What threads waiting in [`EventChannel::get_event`] received themselves (busy
    /// polling): the datagrams of all its devices ([`Device::busy_polled`]), or for a
    /// provider's fabric what the provider counts (the daemon client: frames).
    ///
    /// [`EventChannel::get_event`]: crate::EventChannel::get_event
    pub fn busy_polled(&self) -> u64 {
        let own: u64 = self
            .0
            .devices()
            .iter()
            .map(|d| d.stats.rx_polled.load(Ordering::Relaxed))
            .sum();
        own + self.0.provider.as_ref().map_or(0, |p| p.busy_polled())
    }

    /// Ids alive (created and not yet torn down), for leak checks.
    pub fn live_ids(&self) -> usize {
        sync::lock(&self.0.ids)
            .values()
            .filter(|w| w.strong_count() > 0)
            .count()
    }

    /// Port bindings held, for leak checks.
    pub fn bound_ports(&self) -> usize {
        sync::lock(&self.0.ports).len()
    }

    /// Connection endpoints each device's engine still holds (timewait included), for leak
    /// checks.
    pub fn engine_ceps(&self) -> usize {
        self.0.devices().iter().map(|d| d.engine_stats().1).sum()
    }

    /// QP numbers the fabric has handed out and not had back (attached QPs, and the numbers
    /// connects and accepts without one announce), for leak checks: each comes back when
    /// its id is destroyed (or its QP, unless a connection still goes by its number).
    pub fn qpns_in_use(&self) -> usize {
        self.0.qpns.in_use()
    }

    /// Bytes the fabric's per-connection tables have room for (their capacity, not what they
    /// hold), its devices' CM engines' included: what a flood of connections leaves behind
    /// once it is gone. Each table gives most of its room back once it is a quarter full
    /// (`rcm_proto::room`, which lets each keep 16 KiB), so this comes back down to about
    /// 100 KiB a device however big the flood was (190 KiB for two devices after 3,000
    /// connections in rcm's memory test, from 1.6 MB at the peak).
    pub fn table_bytes(&self) -> usize {
        let ids = rcm_proto::room::map_bytes(&sync::lock(&self.0.ids));
        ids + self
            .0
            .devices()
            .iter()
            .map(|d| d.table_bytes())
            .sum::<usize>()
    }

    /// Destroys every id (their peers are sent what a destroy sends: DREQ, or REJ to a
    /// connection being set up) and stops every device and the dispatcher. From its start
    /// the fabric makes nothing new: an id created then is born destroyed (the `try_` forms
    /// say [`crate::Error::ShutDown`]), a connect request arriving then is refused, and
    /// adding a device fails with `ShutDown`; so no id outlives it. An id whose channel
    /// events the application still holds is torn down at once, not at their ack (they stay
    /// readable); the callbacks running when it begins are given up to 2 s to return, so
    /// that their ids' teardowns still reach the peers. Called from a
    /// callback (or an id's teardown, or one of rcm's threads) it returns at once and the
    /// shutdown completes on a thread of its own: waiting there for the fabric's threads
    /// could wait for the caller itself.
    pub fn shutdown(&self) {
        shutdown_from_here(&self.0);
    }
}

/// How long a shutdown waits, in all, for the callbacks running when it began to return
/// (their ids' teardowns send their DREQs and REJs while the devices still run).
const SHUTDOWN_WAITS_FOR_CALLBACKS: std::time::Duration = std::time::Duration::from_secs(2);

fn shutdown(f: &FabricInner) {
    // One at a time: a second shutdown (the last handle dropped while one started from a
    // callback runs, say) returns only once the devices are stopped and the ports released.
    let _one = sync::lock(&f.shutting);
    let ids: Vec<_> = {
        let table = sync::lock(&f.ids);
        f.shut.store(true, Ordering::SeqCst);
        table.values().filter_map(Weak::upgrade).collect()
    };
    for id in &ids {
        drop(crate::id::CmId(id.clone()).begin_destroy());
    }
    // An id whose events the application still holds is torn down now, not at their ack
    // (after the devices stopped, its DREQ or REJ could not leave); one whose callback runs
    // on a dispatcher thread ends when the callback returns: waited for, a while.
    let until = std::time::Instant::now() + SHUTDOWN_WAITS_FOR_CALLBACKS;
    for id in &ids {
        id.slot.tear_down_despite_held();
        let left = until.saturating_duration_since(std::time::Instant::now());
        id.slot.wait_destroyed_for(left);
    }
    // The DREQs and REJs those destroys queued must leave before the sockets close, even
    // when this thread holds a send batch: a peer would otherwise keep its end up.
    before_wait();
    let devices = std::mem::take(&mut *sync::lock(&f.devices));
    for d in devices {
        d.shutdown();
    }
    if let Some(p) = &f.provider {
        p.shutdown();
    }
    f.dispatcher.stop();
}

/// A device of a fabric.
#[derive(Clone)]
pub struct Device(pub(crate) Arc<DeviceInner>);

impl Device {
    /// Its address.
    pub fn addr(&self) -> IpAddr {
        self.0.ip
    }

    /// Its stamps in the current trace (see [`crate::trace`]).
    pub fn trace(&self) -> crate::trace::DeviceTrace {
        self.0.stats.trace.read()
    }

    /// Whether it is an iWARP device (TCP) rather than RoCEv2 (UDP).
    pub fn is_iwarp(&self) -> bool {
        self.0.is_iwarp()
    }

    /// (received, sent) datagram counts.
    pub fn traffic(&self) -> (u64, u64) {
        (
            self.0.stats.rx.load(Ordering::Relaxed),
            self.0.stats.tx.load(Ordering::Relaxed),
        )
    }

    /// CM datagrams it sent to its own address and handed to its engine directly
    /// ([`FabricConfig::loopback`]); they are also in both counts of [`Device::traffic`].
    pub fn looped(&self) -> u64 {
        self.0.stats.looped.load(Ordering::Relaxed)
    }

    /// Datagrams received by threads waiting in [`EventChannel::get_event`] rather than by
    /// the device's own thread: a waiter polls the device it last called for as long as
    /// the channel polls ([`EventChannel::set_spin`]), and handles what arrives itself, its
    /// own event included (busy polling). They are also in [`Device::traffic`]. On an iWARP
    /// device it counts instead the streams' readiness events that waiters handled.
    ///
    /// [`EventChannel::get_event`]: crate::EventChannel::get_event
    /// [`EventChannel::set_spin`]: crate::EventChannel::set_spin
    pub fn busy_polled(&self) -> u64 {
        self.0.stats.rx_polled.load(Ordering::Relaxed)
    }

    /// How many times the device's own thread went to sleep until its socket (an iWARP
    /// device's: any of its TCP sockets) had something: after each stretch of work it polls
    /// for [`FabricConfig::spin`] first, and sleeps only when that found nothing.
    pub fn sleeps(&self) -> u64 {
        self.0.stats.sleeps.load(Ordering::Relaxed)
    }

    /// Its receive side, for a thread of a provider that polls for work of its own and can
    /// receive for the device meanwhile (the `rcm daemon`'s ring threads): while it polls
    /// (from [`BusyPoll::begin`] to [`BusyPoll::end`]) the device's own thread stands aside
    /// (see [`RxGate`](crate::remote::RxGate)), so that on a machine with few CPUs one
    /// thread polls where two did. [`BusyPoll::poll`] receives and handles what is queued;
    /// the callbacks of its events run where the fabric's mode puts events from elsewhere,
    /// or on the polling thread inside a [`CallbacksHere`]. Call [`BusyPoll::kick`] before
    /// the thread sleeps, or the device's thread resumes only when the poll's deadline
    /// passes. `None` for a device whose thread must read its socket itself (one verifying
    /// ICRCs on a raw socket), and for iWARP devices: their streams are polled by the
    /// application's waiting threads
    /// ([`EventChannel::set_spin`](crate::EventChannel::set_spin)), not by a provider's.
    ///
    /// [`BusyPoll::begin`]: crate::remote::BusyPoll::begin
    /// [`BusyPoll::end`]: crate::remote::BusyPoll::end
    /// [`BusyPoll::poll`]: crate::remote::BusyPoll::poll
    /// [`BusyPoll::kick`]: crate::remote::BusyPoll::kick
    pub fn busy_poller(&self) -> Option<Arc<dyn crate::remote::BusyPoll>> {
        if self.0.is_iwarp() {
            return None;
        }
        self.0
            .poller()
            .map(|p| p as Arc<dyn crate::remote::BusyPoll>)
    }

    /// (sent, received) system calls that each carried several datagrams: sends of a
    /// [`SendBatch`] or of one engine call to one peer, and receives the kernel coalesced
    /// (`UDP_GRO`). Both stay 0 where the kernel does not segment UDP.
    pub fn batched_io(&self) -> (u64, u64) {
        (
            self.0.stats.tx_segmented.load(Ordering::Relaxed),
            self.0.stats.rx_coalesced.load(Ordering::Relaxed),
        )
    }

    /// The engine's counters.
    pub fn engine_stats(&self) -> rcm_proto::ib::Stats {
        self.0.engine_stats().0
    }

    /// Drops the entries of the RoCEv2 engine's timer queues that no longer name a live
    /// timer (answered retransmissions, mostly) and gives back their room at once. The
    /// engine does this by itself once they are half of all entries, so up to about two
    /// thousand of them (32 bytes each) can be held at any moment; a measurement of what
    /// connections hold calls this first. Does nothing on an iWARP device.
    pub fn sweep_engine_timers(&self) {
        if !self.0.is_iwarp() {
            self.0.sweep_timers();
        }
    }

    /// How many of the RoCEv2 engine's connection endpoints are in each state (empty on an
    /// iWARP device), for diagnosing a connection that does not end.
    pub fn engine_cep_states(&self) -> std::collections::BTreeMap<String, usize> {
        if self.0.is_iwarp() {
            return std::collections::BTreeMap::new();
        }
        self.0.cep_states()
    }

    /// Datagrams dropped for a wrong ICRC: every IPv6 one, and IPv4 ones with
    /// [`FabricConfig::verify_icrc`] (a UDP socket cannot see the IPv4 ID the ICRC covers).
    pub fn icrc_drops(&self) -> u64 {
        self.0.stats.rx_bad_icrc.load(Ordering::Relaxed)
    }

    /// The UD data path's counters (see [`CmId::send_ud`] and [`CmId::recv_ud`]).
    ///
    /// [`CmId::send_ud`]: crate::CmId::send_ud
    /// [`CmId::recv_ud`]: crate::CmId::recv_ud
    pub fn ud_stats(&self) -> UdStats {
        let s = &self.0.stats;
        let r = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
        UdStats {
            sent: r(&s.ud_sent),
            delivered: r(&s.ud_delivered),
            no_qp: r(&s.ud_no_qp),
            bad_qkey: r(&s.ud_bad_qkey),
            queue_full: r(&s.ud_queue_full),
            garbage: r(&s.rx_bad),
        }
    }
}

/// Counters of a RoCEv2 device's UD data path ([`Device::ud_stats`]). Every received
/// datagram that is not a CM MAD for QP1 ends in exactly one of `delivered`, `no_qp`,
/// `bad_qkey`, `queue_full` or `garbage`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UdStats {
    /// UD SENDs sent from this device.
    pub sent: u64,
    /// UD SENDs queued to a UD id's receive queue.
    pub delivered: u64,
    /// UD SENDs dropped: no UD id of this device receives on the destination QPN (none
    /// registered, destroyed, or not connecting or established), or the fabric keeps none
    /// ([`FabricConfig::ud_receive`] off).
    pub no_qp: u64,
    /// UD SENDs dropped: the DETH Q_Key was not the id's (`RDMA_UDP_QKEY`).
    pub bad_qkey: u64,
    /// UD SENDs dropped: the id's receive queue was full ([`UD_RECV_QUEUE`]).
    ///
    /// [`UD_RECV_QUEUE`]: crate::UD_RECV_QUEUE
    pub queue_full: u64,
    /// Datagrams that were neither a CM MAD nor a UD SEND (garbage, truncated, other
    /// opcodes, another partition), dropped.
    pub garbage: u64,
}

/// A device removal in progress. Dropped before [`Removal::wait`] saw it complete, it
/// completes in the background: a thread of its own waits for the ids still holding the
/// device, then stops it (its thread, its socket) and takes it off the fabric, so its
/// address can be added again.
pub struct Removal {
    fabric: Weak<FabricInner>,
    dev: Arc<DeviceInner>,
    holders: Vec<(u64, Arc<Slot<Event>>)>,
    /// `wait` stopped the device.
    done: std::sync::atomic::AtomicBool,
}

impl Drop for Removal {
    fn drop(&mut self) {
        if self.done.load(Ordering::SeqCst) {
            return;
        }
        let rest = Removal {
            fabric: self.fabric.clone(),
            dev: self.dev.clone(),
            holders: std::mem::take(&mut self.holders),
            done: std::sync::atomic::AtomicBool::new(false),
        };
        // Its holders are destroyed by the application or, at the latest, by the fabric's
        // shutdown; until then the thread sleeps.
        let _ = std::thread::Builder::new()
            .name("rcm-removal".into())
            .spawn(move || while rest.wait(Duration::from_secs(3600)).is_err() {});
    }
}

impl Removal {
    /// Ids that still hold the device (their keys).
    pub fn holding(&self) -> Vec<u64> {
        self.all_holders()
            .iter()
            .filter(|(_, s)| s.phase() != crate::slot::Phase::Destroyed)
            .map(|(k, _)| *k)
            .collect()
    }

    /// The ids the walk reached, and those published after it (see `removal_after_publish`).
    fn all_holders(&self) -> Vec<(u64, Arc<Slot<Event>>)> {
        let mut all = self.holders.clone();
        all.extend(sync::lock(&self.dev.late_holders).iter().cloned());
        all
    }

    /// Waits up to `timeout` for every id on the device to be destroyed; then stops the
    /// device. On timeout returns the keys of the ids still holding it (the device keeps
    /// running; wait again).
    pub fn wait(&self, timeout: Duration) -> Result<(), Vec<u64>> {
        let end = rcm_proto::later(std::time::Instant::now(), timeout);
        // Late holders only ever join the end of the list: wait until it stops growing.
        let mut done = 0;
        loop {
            let all = self.all_holders();
            if done == all.len() {
                break;
            }
            for (_, s) in &all[done..] {
                let left = end.saturating_duration_since(std::time::Instant::now());
                if !s.wait_destroyed_for(left) {
                    return Err(self.holding());
                }
            }
            done = all.len();
        }
        self.dev.shutdown();
        if let Some(f) = self.fabric.upgrade() {
            sync::lock(&f.devices).retain(|d| !Arc::ptr_eq(d, &self.dev));
        }
        self.done.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// Waits until done, reporting every 10 s which ids hold the device (as Linux's
    /// `cm_destroy_id_wait_timeout` does) instead of hanging silently.
    pub fn wait_reporting(&self) {
        while let Err(ids) = self.wait(Duration::from_secs(10)) {
            eprintln!(
                "rcm: removal of device {} still held by ids {ids:?}",
                self.dev.ip
            );
        }
    }
}

/// Why `ip` cannot be a device's address, if it cannot: a device sends from its address
/// (the RoCEv2 ICRC covers it, and rdma_cm's header carries it), so it must be one unicast
/// address. A socket bound to the wildcard would take every local address's traffic and
/// send from whichever the kernel picks, with an ICRC computed for 0.0.0.0.
fn not_a_device_address(ip: IpAddr) -> Option<&'static str> {
    if ip.is_unspecified() {
        return Some("the wildcard (a listener bound to it listens on every device)");
    }
    if ip.is_multicast() {
        return Some("a multicast address");
    }
    match ip {
        IpAddr::V4(v4) if v4.is_broadcast() => Some("the broadcast address"),
        // The socket would send IPv4 while the ICRC and rdma_cm's header say IPv6 (Linux's
        // `rdma_bind_addr` finds no device for one: -EADDRNOTAVAIL); the IPv4 address is
        // the device.
        IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some() => {
            Some("IPv4-mapped (use the IPv4 address itself)")
        }
        // Usable only with its interface (scope ID), which a device's address does not
        // carry (Linux's `cma_check_linklocal` wants one).
        IpAddr::V6(v6) if v6.is_unicast_link_local() => {
            Some("link-local (it needs an interface scope, which rcm does not carry)")
        }
        _ => None,
    }
}
